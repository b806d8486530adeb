"""swinbench command line: each command parses its options and calls one function in `workbench`."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
import typer.core
import typer.exceptions
from rich.console import Console
from typer.core import TyperGroup

from workbench.errors import UserError

console = Console()
err_console = Console(stderr=True)


# typer's own click: a vendored copy (typer._click) in newer typer, the click package in older ones
_click = getattr(typer.core, "_click", None) or typer.core.click
# click's Ctrl-C outside a command's work: in the click package, or in typer's own exceptions beside its copy
_Abort = getattr(_click.exceptions, "Abort", None) or typer.exceptions.Abort


class _OneLineErrors(TyperGroup):
    """The command line's own errors (an option's value that is no number, an unknown option or command, a
    missing argument) as one line on stderr and exit 2, like every other mistake, not a box of usage."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _click.exceptions.ClickException as exc:
            if not standalone_mode:
                raise
            if type(exc).__name__ == "NoArgsIsHelpError":   # the help is printed already
                sys.exit(exc.exit_code)
            ctx = getattr(exc, "ctx", None)
            hint = f" (see: {ctx.command_path} --help)" if isinstance(exc, _click.exceptions.UsageError) and ctx else ""
            _print_error(f"{exc.format_message()}{hint}")
            sys.exit(exc.exit_code)
        except _Abort:   # click's form of Ctrl-C outside a command's own work
            if not standalone_mode:
                raise
            _print_error("interrupted")
            sys.exit(130)
        if not standalone_mode:
            return rv
        # super() returns an Exit's code (--help, typer.Exit) or the command's own return value (None)
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    cls=_OneLineErrors,
    help="Where a Swin Transformer's GPU time goes, and how to make it faster stage by stage, with proof.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_error(message: str) -> None:
    from rich.markup import escape

    # the message may quote a file's contents: '[/x]' there is text, not rich markup
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def _fail(exc: Exception, code: int) -> typer.Exit:
    _print_error(str(exc))
    return typer.Exit(code)


def _call(fn, *args, **kwargs):
    """Run a library function; a user's mistake becomes one line on stderr and a non-zero exit."""
    try:
        return fn(*args, **kwargs)
    except UserError as exc:
        exit_ = _fail(exc, exc.exit_code)
        exit_.result = getattr(exc, "result", None)    # what a failed apply still wrote (records, report)
        raise exit_ from None
    except OSError as exc:   # a path the user gave that the system refuses (too long, no permission, disk full)
        where = f": {exc.filename}" if exc.filename else ""
        raise _fail(Exception(f"{exc.strerror or exc}{where}"), 2) from None
    except KeyboardInterrupt as exc:   # workbench.errors.Interrupted says what was kept
        raise _fail(Exception(str(exc) or "interrupted"), 130) from None


MAX_REGRESSION = "5"   # percent: check's default allowed change per metric
Model = Annotated[Optional[str], typer.Option(help="timm Swin model name (default: swin_tiny_patch4_window7_224 on a GPU, the tiny 'swinbench_tiny_cpu' Swin on the CPU).")]
Device = Annotated[str, typer.Option(help="auto (cuda if a GPU is visible, else cpu), cuda, cuda:N or cpu. CPU runs use the tiny Swin by default and are labelled CPU in every output.")]
ImgSize = Annotated[Optional[str], typer.Option(help="Build the model at this resolution instead of its name's: 384, or HxW like 256x320 (timm pads feature maps that are not a multiple of the window inside the blocks; the fused kernels do the same).")]
Timeline = Annotated[bool, typer.Option("--timeline/--no-timeline", help="Also write timeline.png (one step: NVTX ranges, GPU kernels by category, host CUDA calls per thread) and timeline.json (every step, for ui.perfetto.dev) beside the tables.")]
Step = Annotated[Optional[str], typer.Option(help="The step timeline.png draws (3 or step3; default: the median-length step).")]
Records = Annotated[Optional[list[Path]], typer.Option("--records", help="Stage records (files or folders written by `swinbench apply`) to take the findings' measured gains from, matched by model, mode, batch and GPU; repeatable. Default: the canonical runs under reports/*/records.")]
AllowMissing = Annotated[bool, typer.Option("--allow-missing", help="Let stages and measurements of the baseline that the current records lack pass (listed 'only in baseline'); by default they are MISSING, a regression.")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="If --out holds an earlier run, move it aside to a '.previous-' sibling first (nothing is deleted). Without it such a folder is refused.")]
OverwriteTables = Annotated[bool, typer.Option("--overwrite", help="If --out holds tables of another trace, move them aside into <out>/previous-<their time>/ first (nothing is deleted). Without it they are refused. Only with --format.")]


@app.command()
def profile(
    model: Model = None,
    mode: Annotated[str, typer.Option(help="train (forward, backward, AdamW step) or infer (the forward alone: no loss, no backward).")] = "train",
    batch: Annotated[int, typer.Option(help="Images per step.")] = 32,
    precision: Annotated[str, typer.Option(help="fp32 | tf32 | bf16 | fp16 (bf16/fp16 via autocast).")] = "bf16",
    steps: Annotated[int, typer.Option(help="Steps captured in the trace.")] = 4,
    warmup: Annotated[int, typer.Option(help="Steps run before the capture starts (not captured).")] = 3,
    device: Device = "auto",
    backend: Annotated[str, typer.Option(help="auto (nsys on a GPU if found, else torch.profiler) | nsys | torch.")] = "auto",
    out: Annotated[Optional[Path], typer.Option(parser=_out_path, help="Output folder (default profiles/<run-name>/).")] = None,
    nsys: Annotated[Optional[str], typer.Option(help="Path to nsys (else $SWINBENCH_NSYS, PATH, usual install folders).")] = None,
    recipe: Annotated[Optional[str], typer.Option(help="Profile the model as this recipe (name or YAML path) leaves it.")] = None,
    format: Annotated[str, typer.Option("--format", help="Machine-readable tables written beside the trace: csv | json.")] = "csv",
    top: Annotated[int, typer.Option(help="Rows per table before the tail is folded into 'other'.")] = 15,
    timeline: Timeline = True,
    records: Records = None,
    overwrite: Overwrite = False,
    nproc: Annotated[Optional[int], typer.Option(help="Data parallel: this many processes under torchrun (one GPU each; gloo on the CPU), DDP, --batch per process; one capture per rank in <out>/rank<r>/ and a ranks table (step time, communication, how much of it compute hides, skew).")] = None,
    parallel: Annotated[Optional[str], typer.Option(help="With --nproc: ddp (every process holds the whole model; the default) or fsdp (FSDP2: each process holds 1/N of the weights, gradients and optimizer state; its all-gathers and reduce-scatters are in the trace).")] = None,
    img_size: ImgSize = None,
):
    """Run a Swin model under Nsight Systems (or torch.profiler) and show where its GPU time goes (on the CPU: its CPU operator time)."""
    _given(model=model, recipe=recipe, nsys=nsys, parallel=parallel, img_size=img_size)
    from workbench.capture.profile import run_profile

    _check_format(format)
    _check_top(top)
    _call(run_profile, model=model, mode=mode, batch=batch, precision=precision, steps=steps, warmup=warmup,
          device=device, backend=backend, out=out, nsys=nsys, recipe=recipe, fmt=format, top=top, console=console,
          overwrite=overwrite, timeline=timeline, records=records, nproc=nproc, parallel=parallel, img_size=img_size)


def _given(**options) -> None:
    """An option given as an empty string is a mistake, not a request for its default: one line, exit 2."""
    for name, value in options.items():
        if value is not None and not str(value).strip():
            raise _fail(UserError(f"--{name.replace('_', '-')} is empty: give a value, or leave the option out "
                                  "for its default"), 2)


def _out_path(value: str) -> Path:
    """--out's value as a path; an empty one is refused (Path("") would be the current folder, which a run
    would then claim, and with --overwrite move its entries aside)."""
    if not str(value).strip():
        raise typer.BadParameter("empty: give the folder or file to write, or leave the option out for its default")
    return Path(value)


def _name_list(value: Optional[str], option: str = "--stages", what: str = "stage") -> Optional[list[str]]:
    """A comma-separated option (--stages, --compare) as names; an empty item (a doubled or trailing comma)
    is refused, not dropped."""
    from workbench.arguments import name_list

    return None if value is None else _call(name_list, value, option, what)


def _cache_folder(cache: Optional[Path]) -> Optional[Path]:
    """--cache: a folder (made if missing), never a file that is there."""
    if cache is not None and cache.exists() and not cache.is_dir():
        raise _fail(UserError(f"--cache {cache} is a file: give a folder for the measurement cache"), 2)
    return cache


def _on_command_line(ctx: typer.Context, name: str) -> bool:
    """Whether the user gave option `name` (by its parameter name), not its default."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


def _note(text: str) -> None:
    console.print(f"[yellow]note:[/] {text}", highlight=False)


def _check_format(fmt: str, allowed=("csv", "json")) -> None:
    if fmt not in allowed:
        raise _fail(UserError(f"unknown format {fmt!r}: choose {' or '.join(allowed)}"), 2)


def _version() -> str:
    """The installed package's version, else (a source checkout run as `python cli.py`) workbench's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("swinbench")
    except PackageNotFoundError:
        from workbench import __version__

        return __version__


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"swinbench {_version()}")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print swinbench's version and exit.")] = False,
):
    pass   # options of `swinbench` itself; the help text is the app's


NAME_HELP = ("Kernel names: short (nsys's shortName; the default of both analyze and diff), op (the short name "
             "with what PyTorch's generic elementwise and reduce kernels run, e.g. vectorized_elementwise_kernel"
             "[add bf16], and a CUTLASS wrapper's own kernel name) or demangled (the full C++ name, as nsys prints "
             "it). CPU operators have one name.")


def _check_top(top: int) -> None:
    if top < 1:
        raise _fail(UserError(f"--top must be at least 1, got {top}"), 2)


def _check_written_with_format(fmt: Optional[str], **options) -> None:
    """--out and --overwrite of analyze and diff are about the tables --format writes: alone they would be
    dropped without a word (nothing written), so they are refused."""
    given = [f"--{name}" for name, value in options.items() if value not in (None, False)]
    if fmt is None and given:
        raise _fail(UserError(f"{given[0]} is about the tables --format writes: it needs --format (csv or json); "
                              "without it nothing is written"), 2)


def _check_name_style(name: str) -> None:
    """--name of analyze and diff: how kernel names are shown."""
    if name not in ("demangled", "short", "op"):
        raise _fail(UserError(f"unknown --name {name!r}: choose demangled, short or op"), 2)


@app.command()
def analyze(
    trace: Annotated[Path, typer.Argument(help=".sqlite, .sqlite.xz or .nsys-rep from Nsight Systems, or a Kineto .json trace.")],
    name: Annotated[str, typer.Option(help=NAME_HELP)] = "short",
    top: Annotated[int, typer.Option(help="Rows per table before the tail is folded into 'other'.")] = 15,
    format: Annotated[Optional[str], typer.Option("--format", help="Also write the tables as csv or json.")] = None,
    out: Annotated[Optional[Path], typer.Option(parser=_out_path, help="Folder for --format output (default: beside the trace).")] = None,
    range: Annotated[Optional[str], typer.Option("--range", help="Only kernels launched inside this NVTX range (e.g. backward, stage2.block1); written tables carry it in their names (kernels.range-backward.csv).")] = None,
    timeline: Timeline = True,
    step: Step = None,
    records: Records = None,
    overwrite: OverwriteTables = False,
):
    """Where one trace's GPU time goes (a CPU capture's: CPU operator time): per kernel, category and NVTX range.

    GPU time shares per kernel, category and NVTX range, GPU busy vs idle, and the host's CUDA API calls
    per step (launches, synchronizing and allocating calls). With --format, also timeline.png (one step)
    and timeline.json (every step, for ui.perfetto.dev)."""
    from workbench.analysis.analyze import analysis_tables, analyze_trace, render_analysis, write_analysis
    from workbench.analysis.timeline import pick_step
    from workbench.capture.remedies import findings_gains, gain_records

    _check_name_style(name)
    _check_top(top)
    _check_written_with_format(format, out=out, overwrite=overwrite)
    if _is_folder(trace):
        given = [flag for flag, value in (("--step", step), ("--records", records)) if value is not None]
        if given:
            raise _fail(UserError(f"{given[0]} goes with one trace file, not a folder of rank traces: give "
                                  f"{trace}/rank0/... to analyze one rank"), 2)
        return _analyze_ranks(trace, name, top, format, out, timeline, overwrite, range)
    folder = out or trace.parent
    if step is not None and (format is None or not timeline):
        raise _fail(UserError("--step picks the step timeline.png draws: it needs --format (and no --no-timeline)"), 2)
    if format is not None:
        _check_format(format)
        _call(analysis_tables(folder, format, trace, range, timeline).check, overwrite)   # refuse before the work
    stored = _call(gain_records, records)
    analysis = _call(analyze_trace, trace, name_style=name, range_name=range)
    if step is not None:
        _call(pick_step, analysis.trace, step)
    gains = findings_gains(stored, trace, analysis.trace_meta)
    render_analysis(analysis, console, top=top, gains=gains.gains)
    if gains.note:
        _note(gains.note)
    if format:
        for f in _call(write_analysis, analysis, folder, format, trace=trace, overwrite=overwrite, on_note=_note,
                       timeline=timeline, step=step, gains=gains.gains):
            console.print(f"wrote {f}")


def _is_folder(path: Path) -> bool:
    """Whether `path` is a folder; a path the system cannot even look up (a name too long) is not: the
    trace loader says what is wrong with it."""
    try:
        return path.is_dir()
    except OSError:
        return False


def _analyze_ranks(folder: Path, name: str, top: int, format: Optional[str], out: Optional[Path], timeline: bool,
                   overwrite: bool, range_name: Optional[str] = None) -> None:
    """analyze FOLDER: the rank<r>/ traces `profile --nproc` wrote, read together (analysis.ranks)."""
    from workbench.analysis.analyze import analysis_tables, analyze_trace, render_analysis, write_analysis
    from workbench.analysis.ranks import rank_frame, rank_row, rank_traces, render_rank_table, write_rank_table

    traces = rank_traces(folder)
    if not traces:
        inside = sorted(p.name for p in folder.glob("trace.*") if p.suffix in (".sqlite", ".json", ".xz", ".gz"))
        hint = (f" (this one holds {inside[0]}: `swinbench analyze {folder / inside[0]}`)" if inside else "")
        raise _fail(UserError(f"{folder} is a folder without rank0/, rank1/, ... traces: give a trace file, or the "
                              f"folder `swinbench profile --nproc` wrote{hint}"), 2)
    out = out or folder
    if format is not None:
        _check_format(format)
        for rank, trace in traces:
            _call(analysis_tables(out / trace.parent.name, format, trace, range_name, timeline).check, overwrite)
    cpu, rows = False, []
    for rank, trace in traces:
        analysis = _call(analyze_trace, trace, name_style=name, range_name=range_name)
        rows.append(rank_row(rank, analysis.trace))
        cpu = cpu or analysis.trace_meta.get("device") == "cpu"
        if rank == traces[0][0]:
            console.print(f"[bold]rank {rank} of {len(traces)}[/] (--format writes every rank's tables)")
            render_analysis(analysis, console, top=top)
        if format:
            for f in _call(write_analysis, analysis, out / trace.parent.name, format, trace=trace, overwrite=overwrite,
                           on_note=_note, timeline=timeline):
                console.print(f"wrote {f}")
    table = rank_frame(rows)
    render_rank_table(table, console, cpu=cpu)
    if format:
        console.print(f"wrote {write_rank_table(table, out, format)}")


@app.command()
def diff(
    before: Annotated[Path, typer.Argument(help="The trace to compare against (.sqlite, .sqlite.xz, .nsys-rep or Kineto .json), or a folder of rank<r>/ traces that `profile --nproc` wrote.")],
    after: Annotated[Path, typer.Argument(help="The trace after the change, or a folder of rank<r>/ traces.")],
    name: Annotated[str, typer.Option(help=NAME_HELP)] = "short",
    top: Annotated[int, typer.Option(help="Kernel rows before the tail is folded into 'other'.")] = 15,
    format: Annotated[Optional[str], typer.Option("--format", help="Also write the tables as csv or json.")] = None,
    out: Annotated[Optional[Path], typer.Option(parser=_out_path, help="Folder for --format output (default: beside AFTER; for a rank folder, inside it).")] = None,
    range: Annotated[Optional[str], typer.Option("--range", help="Compare only kernels launched inside this NVTX range (e.g. backward), per instance of it; written tables carry it in their names.")] = None,
    rank: Annotated[Optional[int], typer.Option(help="With rank folders: the rank whose kernels are compared (default: the slowest after the change). Also compares rank R of a folder with a single trace, or of two folders with different ranks.")] = None,
    overwrite: OverwriteTables = False,
):
    """Compare two traces kernel by kernel, per step, largest change first (two rank folders: rank by rank).

    GPU ms and launches per step for every kernel and category on both sides and the change, and the
    step's kernel time, kernel count, host launches and GPU busy (for two CPU captures: CPU operators,
    op time and CPU busy). Two folders of `profile --nproc` ranks: each rank's step time, kernel and
    communication time and GPU busy, before and after, then the kernels of the slowest rank."""
    from workbench.analysis.analyze import analyze_trace
    from workbench.analysis.diff import diff_analyses, diff_tables, render_diff, write_diff
    from workbench.analysis.rank_diff import diff_plan

    _check_name_style(name)
    _check_top(top)
    _check_written_with_format(format, out=out, overwrite=overwrite)
    if format is not None:
        _check_format(format)
    plan = _call(diff_plan, before, after, rank)
    if plan.ranks is not None:
        return _diff_ranks(plan, before, after, name, top, format, out, range, overwrite)
    out = out or (after if _is_folder(after) else after.parent)
    if format is not None:
        _call(diff_tables(out, format, plan.before_trace, plan.after_trace, range).check, overwrite)
    a = _call(analyze_trace, plan.before_trace, name_style=name, range_name=range)
    b = _call(analyze_trace, plan.after_trace, name_style=name, range_name=range)
    result = _call(diff_analyses, a, b, str(plan.before_trace), str(plan.after_trace))
    result.notes[:0] = plan.notes
    render_diff(result, console, top=top)
    if format:
        for f in _call(write_diff, result, out, format, overwrite=overwrite, on_note=_note):
            console.print(f"wrote {f}")


def _diff_ranks(plan, before: Path, after: Path, name: str, top: int, format: Optional[str], out: Optional[Path],
                range: Optional[str], overwrite: bool) -> None:
    """diff FOLDER FOLDER: two `profile --nproc` captures rank by rank (analysis.rank_diff)."""
    from workbench.analysis.rank_diff import diff_ranks, rank_diff_tables, render_rank_diff, write_rank_diff

    out = out or after
    if format is not None:
        _call(rank_diff_tables(out, format, before, after, range).check, overwrite)
    with console.status("reading the ranks") as status:   # drawn on a terminal only
        result = _call(diff_ranks, plan, str(before), str(after), name_style=name, range_name=range,
                       on_rank=lambda i, n, r: status.update(f"reading rank {r} ({i + 1} of {n}), before and after"))
    render_rank_diff(result, console, top=top)
    if format:
        for f in _call(write_rank_diff, result, out, format, range_name=range, overwrite=overwrite, on_note=_note):
            console.print(f"wrote {f}")


@app.command()
def apply(
    recipe: Annotated[Optional[str], typer.Option(help="Recipe name (see `swinbench recipes`) or a YAML file; runs every stage from baseline to it. auto: the whole ladder for this machine (on a GPU to block, with the PyTorch-alone peers; on the CPU to fmha), then the best configuration that passes the gate and the command that reproduces it. Default: fmha; with --stages, the stages alone (the run is named 'stages').")] = None,
    stages: Annotated[Optional[str], typer.Option(help="Comma-separated stages to run instead of the chain (e.g. baseline,amp,torch-compile).")] = None,
    model: Model = None,
    batch: Annotated[int, typer.Option(help="Images per step.")] = 64,
    mode: Annotated[str, typer.Option(help="train (forward, backward, optimizer step) or infer (the forward alone, no backward; the gate compares logits and the loss computed from them).")] = "train",
    steps: Annotated[int, typer.Option(help="Timed steps per stage (median and IQR over these).")] = 20,
    warmup: Annotated[int, typer.Option(help="Untimed steps per stage first (compilation happens here).")] = 5,
    device: Device = "auto",
    out: Annotated[Optional[Path], typer.Option(parser=_out_path, help="Output folder for records, report and traces (default reports/runs/<run>/).")] = None,
    profile: Annotated[bool, typer.Option("--profile", help="Also capture each stage (nsys) and report its kernel-category shares.")] = False,
    check_against: Annotated[Optional[Path], typer.Option(help="Baseline records to check this run against when it ends (exit 1 on a regression; see `swinbench check`).")] = None,
    allow_missing: AllowMissing = False,
    max_regression: Annotated[Optional[str], typer.Option(help=f"With --check-against: allowed change per metric in percent (default {MAX_REGRESSION}).")] = None,
    thresholds: Annotated[Optional[Path], typer.Option(help="With --check-against: YAML of per-stage limits.")] = None,
    force: Annotated[bool, typer.Option("--force", help="With --check-against: compare across GPUs or versions anyway.")] = False,
    seed: Annotated[int, typer.Option(help="Seed for weights and the synthetic batch (the same for every stage).")] = 0,
    peers: Annotated[Optional[bool], typer.Option("--peers/--no-peers", help="Also run the PyTorch-alone peer stages of the chain (torch-sdpa, torch-compile; torchao's for a chain that quantizes). Default: on a GPU yes, on the CPU no.")] = None,
    isolate: Annotated[Optional[bool], typer.Option("--isolate/--no-isolate", help="Run each stage in its own process so allocator and compile caches don't leak between stages. Default: on a GPU yes.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --out: keep its finished stages (same stages, recipe, model, batch, steps and settings) and run the rest.")] = False,
    overwrite: Overwrite = False,
    fresh: Annotated[bool, typer.Option("--fresh", help="Measure every stage again, even one whose measurement under the same conditions (GPU, driver, versions, swinbench code, steps) is cached from an earlier run.")] = False,
    cache: Annotated[Optional[Path], typer.Option(parser=_out_path, help="Where measurements and compile caches are kept between runs (default $XDG_CACHE_HOME/swinbench or ~/.cache/swinbench).")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="A shorter ladder: the recipe's chain without the peers, 10 timed steps after 3 warm-up steps.")] = False,
    nproc: Annotated[Optional[int], typer.Option(help="After the stages, run each measured stage again under torchrun with this many processes (one GPU each; gloo on the CPU), DDP, --batch per process: img/s, efficiency against the one-process figure, and the gate on every rank against the baseline over the global batch.")] = None,
    parallel: Annotated[Optional[str], typer.Option(help="With --nproc: ddp (every process holds the whole model; the default) or fsdp (FSDP2: each process holds 1/N of the weights, gradients and optimizer state).")] = None,
    interleave: Annotated[Optional[int], typer.Option(help="After the stages, build the measured ones side by side in one process and time them again in this many rounds, in alternation, for paired speedups that a drifting host cannot move (0: off; 10-30 is typical on a GPU). Needs every stage's memory at once. Default: 3 rounds on the CPU, off on a GPU.")] = None,
    checkpoint: Annotated[Optional[Path], typer.Option(help="With --mode infer: trained weights for every stage (a `swinbench train --save-checkpoints` file, or a plain timm state_dict): each stage also runs the held-out images, and the gate holds its accuracy and top-1 agreement against the baseline's.")] = None,
    data: Annotated[Optional[Path], typer.Option(help="With --checkpoint: the held-out images (an ImageFolder; its val/ when there is one). Default: what the checkpoint was trained on.")] = None,
    img_size: ImgSize = None,
):
    """Apply a staged optimization recipe, measuring, checking and profiling every stage."""
    _given(recipe=recipe, model=model, stages=stages, max_regression=max_regression, parallel=parallel,
           img_size=img_size)
    from workbench.ladder.apply import run_apply

    from workbench.ladder.reuse import default_cache_dir
    from workbench.run_folder import run_entries

    limit = _check_inputs_before_apply(check_against, thresholds, max_regression, nproc, force, allow_missing,
                                       _planned_run(check_against, model, mode, batch, device, checkpoint))
    if resume and out is not None and (not out.exists() or (out.is_dir() and not run_entries(out))):
        _note(f"--resume: {out} holds no earlier run; starting a new one there")
    if quick:
        steps, warmup, peers = min(steps, 10), min(warmup, 3), False if peers is None else peers
    def check(records_dir: Path) -> None:     # exits with the check's code
        _run_check([check_against], [records_dir], limit, 2.0, thresholds, force, "md", allow_missing=allow_missing)

    try:
        result = _call(run_apply, recipe, model=model, batch=batch, steps=steps, warmup=warmup, device=device,
                       out_dir=out, profile=profile, stages=_name_list(stages),
                       seed=seed, peers=peers, isolate=isolate, console=console, mode=mode, interleave=interleave,
                       resume=resume, overwrite=overwrite, cache_dir=_cache_folder(cache) or default_cache_dir(),
                       fresh=fresh, nproc=nproc, parallel=parallel, checkpoint=checkpoint, data=data,
                       img_size=img_size)
    except typer.Exit as failed:
        # stages that failed are what --check-against is for: check the records that were written (a stage
        # that ran in the baseline and fails now is a regression, exit 1); exit 2 if nothing regressed
        result = getattr(failed, "result", None)
        if check_against is None or result is None:
            raise
        try:
            check(result.records_dir)
        except typer.Exit as checked:
            if checked.exit_code == 1:
                raise
        raise failed
    if check_against is not None:
        check(result.records_dir)


def _planned_run(check_against, model, mode, batch, device, checkpoint) -> dict:
    """What apply's records will say, as far as it is known before any stage runs ({record key: value},
    None where not known): the default model of the device when --model is not given (a checkpoint names
    its own), and the device type, so that --check-against refuses a baseline of another model or device
    before the run, not after it."""
    planned = {"mode": mode, "batch": batch, "model": model, "device_type": None}
    if check_against is None:
        return planned
    try:
        from workbench.devices import pick_device
        from workbench.models import default_model_for

        import torch

        name = pick_device(device)
        planned["device_type"] = torch.device(name).type
        if model is None and checkpoint is None:
            planned["model"] = default_model_for(name)
    except (RuntimeError, ValueError, TypeError):   # an unknown --device: apply refuses it itself
        pass
    return planned


def _check_inputs_before_apply(check_against, thresholds, max_regression, nproc=None, force=False,
                               allow_missing=False, planned: dict | None = None) -> float:
    """apply's --check-against, --thresholds and --max-regression, validated before any stage runs (a typo
    there, or a baseline of another --nproc, model, mode or batch, must not cost a run) -> the percentage."""
    limit = _percent(MAX_REGRESSION if max_regression is None else max_regression)
    if check_against is None:
        given = [name for name, value in (("--thresholds", thresholds is not None), ("--force", force),
                                          ("--max-regression", max_regression is not None),
                                          ("--allow-missing", allow_missing)) if value]
        if given:
            raise _fail(UserError(f"{given[0]} is read with --check-against; give both or neither"), 2)
        return limit
    from workbench.results.check import check_planned_run, load_thresholds

    _call(load_thresholds, thresholds, max_regression_pct=limit)
    _call(check_planned_run, [check_against], nproc, force, planned)
    return limit


@app.command()
def train(
    recipe: Annotated[Optional[str], typer.Option(help="Recipe to train with (name or YAML file). Default: amp on a GPU (PyTorch's own bf16 autocast), baseline on the CPU.")] = None,
    compare: Annotated[Optional[str], typer.Option(help="Comma-separated recipes to train on the same data order and seeds (e.g. baseline,amp,fmha-graph); the baseline runs with --baseline-seeds seeds and every other recipe gets a parity verdict in report.md.")] = None,
    baseline_seeds: Annotated[Optional[int], typer.Option(help="With --compare: seeds of the baseline, whose spread the parity rule measures (default 2, at least 2).")] = None,
    seeds: Annotated[int, typer.Option(help="Seeds of each recipe (with --compare: of every recipe but the reference, whose seeds are --baseline-seeds or this, the larger); parity holds the mean over a recipe's seeds against the reference.")] = 1,
    reference: Annotated[Optional[str], typer.Option(help="With --compare: the recipe the others are held against (default baseline, fp32); e.g. amp to see what swinbench's kernels change at the same precision.")] = None,
    model: Model = None,
    data: Annotated[Optional[Path], typer.Option(help="An ImageFolder (class folders, or train/ and val/ of them). Default: the handwritten digits shipped with swinbench (1,797 images, 10 classes), upsampled to the model's input size.")] = None,
    steps: Annotated[Optional[int], typer.Option(help="Optimizer steps per run (instead of --epochs).")] = None,
    epochs: Annotated[Optional[int], typer.Option(help="Epochs per run (default 5 when --steps is not given).")] = None,
    batch: Annotated[int, typer.Option(help="Images per step.")] = 64,
    lr: Annotated[float, typer.Option(help="AdamW peak learning rate (linear warm-up over 5% of the steps, then cosine to 0).")] = 3e-4,
    weight_decay: Annotated[float, typer.Option(help="AdamW weight decay.")] = 0.05,
    label_smoothing: Annotated[float, typer.Option(help="Label smoothing of the cross-entropy loss.")] = 0.1,
    clip_grad: Annotated[float, typer.Option(help="Clip the global gradient norm to this (0: off).")] = 5.0,
    seed: Annotated[int, typer.Option(help="Seed of the weights, data order and augmentation (the baseline's extra seeds count up from it).")] = 0,
    workers: Annotated[int, typer.Option(help="Data-loading processes for --data.")] = 4,
    device: Device = "auto",
    out: Annotated[Optional[Path], typer.Option(parser=_out_path, help="Output folder for records, report.md and curves.png (default reports/runs/train-<recipe>-<model>-<time>/, train-compare-... with --compare).")] = None,
    overwrite: Overwrite = False,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the comparison in --out: keep the runs that finished there with the same settings and train the rest (a long comparison in several sittings).")] = False,
    nproc: Annotated[Optional[int], typer.Option(help="Data parallel: this many processes on this machine under torchrun, one per GPU (gloo on the CPU), DDP; --batch is per process, the global batch N x --batch.")] = None,
    nnodes: Annotated[int, typer.Option(help="With --nproc: machines in the run (torchrun's --nnodes); run the same command on each.")] = 1,
    rdzv_endpoint: Annotated[Optional[str], typer.Option(help="With --nnodes > 1: HOST:PORT of the c10d rendezvous, the same on every machine.")] = None,
    rdzv_id: Annotated[Optional[str], typer.Option(help="With --rdzv-endpoint: the job's name at the rendezvous (default swinbench).")] = None,
    parallel: Annotated[Optional[str], typer.Option(help="With --nproc: ddp (every process holds the whole model; the default) or fsdp (FSDP2: each process holds 1/N of the weights, gradients and optimizer state, for models that do not fit otherwise).")] = None,
    img_size: ImgSize = None,
    save_checkpoints: Annotated[bool, typer.Option("--save-checkpoints", help="Save each finished run's weights (timm's state_dict under the key state_dict, with the model and data named) to checkpoints/ in --out, for `swinbench apply --mode infer --checkpoint`.")] = False,
    ema: Annotated[Optional[float], typer.Option(help="Keep an exponential moving average of the weights with this decay (e.g. 0.999) and validate it every epoch beside them (with --save-checkpoints it is saved too, as <run>-ema.pt). Not with --parallel fsdp.")] = None,
):
    """Train a Swin on real data with a recipe (or compare recipes) and report loss, accuracy, img/s and parity."""
    from workbench.train.loop import TrainConfig, command_line, run_train

    _given(recipe=recipe, compare=compare, reference=reference, model=model, rdzv_endpoint=rdzv_endpoint,
           rdzv_id=rdzv_id, parallel=parallel, img_size=img_size)
    config = TrainConfig(model=model, recipe=recipe, compare=_name_list(compare, "--compare", "recipe"),
                         baseline_seeds=baseline_seeds, seeds=seeds, reference=reference, steps=steps, epochs=epochs, batch=batch, lr=lr,
                         weight_decay=weight_decay, label_smoothing=label_smoothing, clip_grad=clip_grad, seed=seed,
                         data=data, workers=workers, device=device, command=command_line(), nproc=nproc, nnodes=nnodes,
                         rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, parallel=parallel,
                         save_checkpoints=save_checkpoints, img_size=img_size, ema=ema)
    _call(run_train, config, out_dir=out, overwrite=overwrite, console=console, resume=resume)


@app.command()
def recipes():
    """List the recipes and their passes."""
    from workbench.optimize.recipes import render_recipes

    _call(render_recipes, console)


@app.command()
def report(
    records: Annotated[list[Path], typer.Argument(help="Stage records (JSON files or folders) written by `swinbench apply`.")],
    out: Annotated[Optional[Path], typer.Option(parser=_out_path, help="Markdown file to write (default: report.md beside the records; records of several folders need --out).")] = None,
    readme: Annotated[Optional[Path], typer.Option(help="Instead, rewrite the results table between <!-- results:begin --> and <!-- results:end --> in this Markdown file (one table for all the records given; with --out, the report too).")] = None,
):
    """Re-render the Markdown report from stored records (no GPU needed)."""
    from workbench.results.report import render_report_from_paths

    if readme is not None:
        from workbench.results.readme_table import update_readme
        from workbench.results.report import report_target

        if out is not None:     # a refusal of --out comes before the README is rewritten
            _call(report_target, records, out)
        console.print(f"wrote {_call(update_readme, records, readme)}")
        if out is None:
            return
    from workbench.optimize.recipes import graph_recipes

    path = _call(render_report_from_paths, records, out, graph_recipes())
    console.print(f"wrote {path}")


@app.command()
def matrix(
    ctx: typer.Context,
    models: Annotated[Optional[str], typer.Option(help="Comma-separated timm Swin models (default: tiny, small, base and large at window 7 / 224 px, base at window 12 / 384 px and SwinV2-T at window 8 / 256 px on a GPU; the tiny CPU Swin on the CPU).")] = None,
    modes: Annotated[str, typer.Option(help="Comma-separated cells per model: train (at the model's training batch), infer64, infer8, infer1.")] = "train,infer64,infer1",
    train_batch: Annotated[Optional[int], typer.Option(help="Training batch for every model (default per model: workbench.ladder.matrix.TRAIN_BATCH, e.g. 128 for tiny/small, 64 for base/large, 32 at 384 px).")] = None,
    fused: Annotated[Optional[str], typer.Option(help="The swinbench stage each cell runs beside amp and torch-compile: one for every cell, or per mode as train=STAGE,infer=STAGE (default train=fmha,infer=dense).")] = None,
    steps: Annotated[int, typer.Option(help="Timed steps per stage.")] = 20,
    warmup: Annotated[int, typer.Option(help="Untimed steps per stage first (compilation happens here).")] = 5,
    device: Device = "auto",
    out: Annotated[Optional[Path], typer.Option(parser=_out_path, help="Output folder: one folder per cell, matrix.md and matrix.json (default reports/runs/matrix-<time>/).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the matrix in --out: skip its finished cells, continue a cell cut short.")] = False,
    overwrite: Overwrite = False,
    fresh: Annotated[bool, typer.Option("--fresh", help="Measure every stage again instead of reusing a cached measurement.")] = False,
    cache: Annotated[Optional[Path], typer.Option(parser=_out_path, help="Where measurements and compile caches are kept between runs (default $XDG_CACHE_HOME/swinbench or ~/.cache/swinbench).")] = None,
    render_only: Annotated[Optional[Path], typer.Option(help="Run nothing: render matrix.md and matrix.json in this matrix folder from its cells' records.")] = None,
    readme: Annotated[Optional[Path], typer.Option(help="With --render-only: instead, rewrite the table between <!-- matrix:begin --> and <!-- matrix:end --> in this Markdown file.")] = None,
    profile: Annotated[bool, typer.Option("--profile", help="Also capture every stage (nsys, as apply --profile): each stage's kernel categories, and the kernel floors of the capture in matrix.md (without it, those of the GPU-time steps).")] = False,
    compiled: Annotated[bool, typer.Option("--compiled", help="Also run the fused stage under torch.compile (<fused>-compile) in every cell whose stage has a built-in compiled form; the cell's swinbench side is the faster form.")] = False,
):
    """Run the Swin family matrix (models x train/infer64/infer1 x amp, fused stage, torch-compile) and write one table."""
    from workbench.ladder.matrix import FAMILY, parse_list, run_matrix

    _given(models=models, modes=modes, fused=fused)
    if readme is not None and render_only is None:
        raise _fail(UserError("--readme renders a matrix already run: give --render-only OUT too"), 2)
    if render_only is not None:
        running = [f"--{name.replace('_', '-')}" for name in ctx.params if name not in ("render_only", "readme")
                   and _on_command_line(ctx, name)]
        if running:
            raise _fail(UserError(f"--render-only runs nothing, so {running[0]} has nothing to do: leave it out, "
                                  "or run the matrix without --render-only"), 2)
    if readme is not None:
        from workbench.results.matrix_table import update_readme_matrix

        console.print(f"wrote {_call(update_readme_matrix, render_only, readme, FAMILY)}")
        return
    if render_only is not None:
        from workbench.results.matrix_table import write_matrix

        for path in _call(write_matrix, render_only, FAMILY, f"swinbench matrix --render-only {render_only}"):
            console.print(f"wrote {path}")
        return
    from workbench.ladder.reuse import default_cache_dir

    if out is None:
        if resume:
            raise _fail(UserError("--resume needs --out: the folder of the matrix to resume"), 2)
        import datetime as _dt

        out = Path("reports") / "runs" / f"matrix-{_dt.datetime.now():%Y%m%d-%H%M%S}"
    _call(run_matrix, models=_call(parse_list, models, "models"), modes=_call(parse_list, modes, "modes"),
          train_batch=train_batch, fused=fused, out_dir=out, steps=steps, warmup=warmup, device=device,
          cache_dir=_cache_folder(cache) or default_cache_dir(), fresh=fresh, resume=resume, overwrite=overwrite, console=console,
          profile=profile, compiled=compiled)


@app.command()
def check(
    baseline: Annotated[list[Path], typer.Option(help="Baseline records (files or folders); repeatable.")],
    current: Annotated[list[Path], typer.Option(help="Current records (files or folders); repeatable.")],
    max_regression: Annotated[str, typer.Option(help="Default allowed change per metric in percent, e.g. 5 or 5%.")] = MAX_REGRESSION,
    max_share_drift: Annotated[float, typer.Option(help="Allowed drift of a kernel category's share, in percentage points.")] = 2.0,
    thresholds: Annotated[Optional[Path], typer.Option(help="YAML with per-stage, per-metric limits (see docs/check.md).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Compare records of different GPUs, versions, models, batches or data-parallel world sizes anyway (noted in the output).")] = False,
    format: Annotated[str, typer.Option("--format", help="md (Markdown table) | json.")] = "md",
    out: Annotated[Optional[Path], typer.Option("--out", "--output", parser=_out_path, help="Write the table to this file as well as stdout (--output is the same option).")] = None,
    allow_missing: AllowMissing = False,
):
    """Compare stored results with a baseline: exit 0 if nothing regressed, 1 if something did, 2 on bad input."""
    _run_check(baseline, current, _percent(max_regression), max_share_drift, thresholds, force, format, out,
               allow_missing=allow_missing)


def _percent(text: str) -> float:
    import math

    from workbench.files import short_repr

    try:
        text = str(text).strip()
        value = float(text[:-1] if text.endswith("%") else text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise _fail(UserError(f"--max-regression takes a percentage >= 0 like 5 or 5%, got {short_repr(text)}"), 2)
    return value


def _run_check(baseline, current, limit, drift, thresholds, force, fmt, output=None, allow_missing=False):
    import json

    from workbench.results.check import check_records, is_check_output, refuse_among_records, render_markdown, to_json

    if fmt == "markdown":
        fmt = "md"
    _check_format(fmt, ("md", "json"))
    from workbench.files import atomic_write_text, refuse_to_replace
    from workbench.results.record import record_files

    if output is not None:   # before the work: a check never writes over a record, a trace or a user's file
        _call(refuse_to_replace, output, is_check_output, "a table swinbench check wrote",
              inputs=_call(record_files, [*baseline, *current]))
        _call(refuse_among_records, output)

    try:
        result = _call(check_records, baseline, current, max_regression_pct=limit, thresholds_file=thresholds,
                       force=force, max_share_drift_pp=drift, allow_missing=allow_missing)
        text = json.dumps(to_json(result), indent=2, default=str) if fmt == "json" else render_markdown(result)
        if output is not None:
            _call(atomic_write_text, output, text + "\n")
    except typer.Exit:
        raise
    except Exception as exc:  # exit 1 means a measured regression to CI: nothing else may exit 1
        raise _fail(Exception(f"swinbench check failed (not a regression): {type(exc).__name__}: "
                              f"{str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"), 2) from None
    typer.echo(text)
    raise typer.Exit(result.exit_code)


@app.command()
def env(
    device: Device = "auto",
    format: Annotated[str, typer.Option("--format", help="table (terminal) | json.")] = "table",
):
    """Say what this machine gives swinbench (GPU, versions, nsys, nvtx, Triton, launcher) and what falls back."""
    import json

    from workbench.capture.environment import environment_report, render_environment

    _check_format(format, ("table", "json"))
    rows = _call(environment_report, device)
    if format == "json":
        typer.echo(json.dumps(rows, indent=1))
    else:
        render_environment(rows, console)


@app.command()
def models():
    """List the Swin models swinbench can build (timm's, plus the tiny CPU one)."""
    from workbench.models import swin_model_names

    for name in swin_model_names():
        typer.echo(name)


def _quiet_cpu_build_notice() -> None:
    """torch's C++ extension helper logs "No CUDA runtime is found, using CUDA_HOME=..." when torch.compile
    builds on a machine without a GPU; every output already says the run is a CPU one."""
    import logging

    logging.getLogger("torch.utils.cpp_extension").addFilter(
        lambda record: not str(record.msg).startswith("No CUDA runtime is found"))


def main() -> None:
    _quiet_cpu_build_notice()
    app()


if __name__ == "__main__":
    sys.exit(main())
