"""`swinbench profile`: capture a Swin workload's trace and print where its GPU time goes."""
from __future__ import annotations

import datetime as _dt
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console

from workbench.capture.backends import capture_nsys, capture_torch, resolve_backend
from workbench.capture.remedies import findings_gains, gain_records
from workbench.errors import UserError
from workbench.run_folder import claim_run_folder
from workbench.models import check_model_name, default_model_for, own_img_size
from workbench.precision import resolve_precision
from workbench.optimize.workload import WorkloadConfig
from workbench.devices import pick_device, resolve_device


@dataclass
class ProfileResult:
    out_dir: Path
    backend: str
    trace: Path
    files: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def default_run_name(config: WorkloadConfig, recipe: str | None) -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    size = [f"{config.img_size[0]}x{config.img_size[1]}"] if config.img_size else []
    parts = [config.model.replace("_patch4", "").replace("_window", "w"), *size, config.mode, config.precision,
             f"b{config.batch}"] + ([Path(recipe).stem] if recipe else []) + [stamp]
    return "-".join(parts)


def run_profile(*, model: str | None, mode: str, batch: int, precision: str, steps: int, warmup: int,
                device: str, backend: str, out: Path | None, nsys: str | None = None, recipe: str | None = None,
                fmt: str = "csv", top: int = 15, console: Console | None = None,
                overwrite: bool = False, timeline: bool = True, records: list[Path] | None = None,
                nproc: int | None = None, parallel: str | None = None, img_size=None) -> ProfileResult:
    """Capture `steps` steps after `warmup`, analyze the trace, print the tables and write them beside it,
    with `timeline` also timeline.png (the median step) and timeline.json (Perfetto).

    out: the folder (default profiles/<model-mode-precision-batch-time>/), locked while the capture
    writes it. A folder that holds an earlier profile or run is refused (UserError, nothing changed)
    unless `overwrite`, which moves that run's files aside to `<out>.previous-<its time>` first
    (`run_folder.claim_run_folder`). records: stage records the findings' measured gains are taken from
    (default: the canonical runs, `remedies.gain_records`), read before the capture. nproc: data parallel
    in that many processes under torchrun (DDP, or FSDP2 with parallel 'fsdp'), one capture per rank in
    <out>/rank<r>/ and the ranks table (analysis.ranks) over them. img_size: '384', 'HxW' or (H, W), the
    resolution the model is built at (default: its name's)."""
    console = console or Console()
    if steps < 1 or warmup < 0:
        raise UserError("--steps must be at least 1 and --warmup at least 0")
    from workbench.optimize.distributed import check_nproc, check_parallel, oversubscribed_note

    if nproc is not None:
        check_nproc(nproc, mode, resolve_device(pick_device(device)))
    check_parallel(parallel, nproc)
    cpu_fallback = device == "auto" and not torch.cuda.is_available()
    device = pick_device(device)
    dev = resolve_device(device)
    model = model or default_model_for(device)
    check_model_name(model)  # fail fast, before any subprocess starts
    size = own_img_size(model, img_size)
    config = WorkloadConfig(model=model, mode=mode, batch=batch, precision=precision, device=device,
                            img_size=list(size) if size else None)
    ran_as = resolve_precision(precision).runs_as(dev.type)
    if recipe:
        from workbench.optimize.recipes import chain_passes

        chain_passes(recipe)  # validate the recipe before capturing
    stored = gain_records(records)   # a bad --records path is refused before the capture
    if nproc is not None and recipe:
        _refuse_own_graphs_data_parallel(recipe, parallel or "ddp")
    if nproc is not None and recipe and parallel == "fsdp":
        from workbench.optimize.recipes import is_graph_form, resolve_chain

        chain = resolve_chain(recipe)
        if any(is_graph_form(r) for r in chain):
            raise UserError(f"recipe {chain[-1].name!r} replays CUDA graphs, which swinbench does not run under FSDP: "
                            f"profile it under DDP, or profile {chain[-2].name if len(chain) > 1 else 'baseline'}")
    chosen, nsys_path, note = resolve_backend(backend, dev, nsys)
    out_dir = Path(out) if out else Path("profiles") / default_run_name(config, recipe)
    with claim_run_folder(out_dir, command="profile", overwrite=overwrite) as claim:
        if cpu_fallback:  # said once the arguments and the folder are good: a user mistake gets one line only
            console.print(f"[yellow]note:[/] no CUDA GPU here: running {config.model} on the CPU "
                          "(timings and shares are CPU figures, not GPU ones)")
        notes = [note] if note else []
        crowded = oversubscribed_note(nproc, dev)
        if crowded:
            notes.append(crowded)
        if ran_as != precision:   # the run name, the tables' titles and run.json keep the name asked for
            notes.append(f"--precision {precision} runs as {ran_as} on the CPU (TF32 and fp16 autocast are GPU "
                         f"modes here): the capture is of {ran_as}")
        first = _warmup_short_of(recipe, warmup)
        if first:
            notes.append(f"--warmup {warmup}: the captured steps include {first}, which later steps do not pay")
        for n in notes + claim.notes:
            console.print(f"[yellow]note:[/] {n}", highlight=False)
        if nproc is not None:
            return _capture_ranks(config, recipe, out_dir, chosen, nsys_path, nproc, steps=steps, warmup=warmup,
                                  fmt=fmt, top=top, notes=notes, console=console, timeline=timeline,
                                  parallel=parallel or "ddp", records=stored)
        return _capture_and_analyze(config, recipe, out_dir, chosen, nsys_path, steps=steps, warmup=warmup,
                                    fmt=fmt, top=top, notes=notes, console=console, timeline=timeline,
                                    records=stored)


def _refuse_own_graphs_data_parallel(recipe: str, parallel: str) -> None:
    """Refuse, before torchrun starts, a recipe whose step replays Inductor's own CUDA graphs (mode
    reduce-overhead): every rank would refuse it (Workload.parallel_blocker)."""
    from workbench.optimize.passes.compile import replays_own_graphs
    from workbench.optimize.recipes import effective_passes, resolve_chain

    chain = resolve_chain(recipe)
    for p in effective_passes(chain):
        params = p.params or {}
        if p.name == "compile" and replays_own_graphs({"mode": params.get("mode"), "options": params.get("inductor")}):
            raise UserError(f"recipe {chain[-1].name!r} replays Inductor's CUDA graphs (compile mode "
                            f"{params.get('mode')}), which swinbench does not run under {parallel.upper()}: profile "
                            "a recipe that captures the whole step itself (a -graph recipe) instead")


def _warmup_short_of(recipe: str | None, warmup: int) -> str | None:
    """What the first steps do once that a capture after `warmup` steps would hold (None: nothing): the
    first step's autotuning and allocations; a compiled recipe's compilation (its first two steps); a
    graph recipe's eager warm-up steps and capture, which the workload runs inside its first step
    (`Workload.step`), so one warm-up step holds them."""
    from workbench.optimize.recipes import effective_passes, resolve_chain

    names = {p.name for p in effective_passes(resolve_chain(recipe))} if recipe else set()
    if "cuda_graph" in names:   # compiling too, where the recipe compiles: all inside the first step
        return "the CUDA graph's warm-up steps and its capture" if warmup < 1 else None
    if "compile" in names and warmup < 2:
        return "torch.compile's compilation"
    if warmup < 1:
        return "the first step's autotuning and allocations"
    return None


def _capture_ranks(config: WorkloadConfig, recipe: str | None, out_dir: Path, chosen: str, nsys_path: str | None,
                   nproc: int, *, steps: int, warmup: int, fmt: str, top: int, notes: list[str], console: Console,
                   timeline: bool, parallel: str = "ddp", records: list | None = None) -> ProfileResult:
    """run_profile with --nproc: every rank captured under torchrun, each rank's tables written in its
    folder (the findings with their measured gains from `records`, as for one process), rank 0's printed,
    then the ranks table (analysis.ranks) printed and written beside them."""
    from workbench.analysis.analyze import analyze_trace, render_analysis, write_analysis
    from workbench.analysis.ranks import rank_frame, rank_row, render_rank_table, write_rank_table

    label = "Nsight Systems" if chosen == "nsys" else "torch.profiler"
    at = f" at {config.img_size[0]}x{config.img_size[1]} px" if config.img_size else ""
    with _phase(console, f"capturing {config.model}{at} {config.mode} {config.precision} batch {config.batch} per "
                         f"process in {nproc} processes (torchrun, {parallel.upper()}): {warmup} warm-up + {steps} "
                         "captured steps "
                         f"under {label} on every rank"):
        from workbench.capture.backends import capture_ranks

        traces = capture_ranks(config, recipe, out_dir, steps, warmup, chosen, nsys_path, nproc, parallel)
    _print_passes(traces[0].parent / "run.json", recipe, console)
    files, rows = [], []
    at = f" at {config.img_size[0]}x{config.img_size[1]} px" if config.img_size else ""
    title = (f"{config.model}{at} {config.mode} {config.precision} batch {config.batch}"
             + (f", recipe {recipe}" if recipe else ""))
    for rank, trace in enumerate(traces):
        with _phase(console, f"analyzing rank {rank}: {trace}"):
            analysis = analyze_trace(trace)
        rows.append(rank_row(rank, analysis.trace))
        gains = findings_gains(records or [], trace, analysis.trace_meta)
        if rank == 0:
            console.print(f"[bold]rank 0 of {nproc}[/] (every rank's tables are in its folder)")
            render_analysis(analysis, console, top=top, gains=gains.gains, names="op")
            if gains.note:
                console.print(f"[yellow]note:[/] {gains.note}", highlight=False)
        files += _capture_files(trace.parent, trace) if trace.parent != out_dir else []
        files += write_analysis(analysis, trace.parent, fmt, trace=trace, timeline=timeline,
                                title=f"{title}, rank {rank} of {nproc}", gains=gains.gains,
                                on_note=lambda line: console.print(f"[yellow]note:[/] {line}", highlight=False))
    table = rank_frame(rows)
    render_rank_table(table, console, cpu=config.device == "cpu")
    files = _capture_files(out_dir) + files
    files.append(write_rank_table(table, out_dir, fmt))
    console.print(f"[bold]{label}[/] backend, {nproc} ranks; files written:")
    for f in files:
        console.print(f"  {f}")
    return ProfileResult(out_dir=out_dir, backend=chosen, trace=traces[0], files=files, notes=notes)


def _capture_and_analyze(config: WorkloadConfig, recipe: str | None, out_dir: Path, chosen: str,
                         nsys_path: str | None, *, steps: int, warmup: int, fmt: str, top: int, notes: list[str],
                         console: Console, timeline: bool, records: list | None = None) -> ProfileResult:
    """run_profile's work once its folder is claimed: the capture, the tables printed and written."""
    from workbench.analysis.analyze import analyze_trace, render_analysis, write_analysis

    mode, precision, batch = config.mode, config.precision, config.batch
    label = "Nsight Systems" if chosen == "nsys" else "torch.profiler"
    at = f" at {config.img_size[0]}x{config.img_size[1]} px" if config.img_size else ""
    with _phase(console, f"capturing {config.model}{at} {mode} {precision} batch {batch}: "
                         f"{warmup} warm-up + {steps} captured steps under {label}"):
        if chosen == "nsys":
            trace = capture_nsys(config, recipe, out_dir, steps, warmup, nsys_path)
        else:
            trace = capture_torch(config, recipe, out_dir, steps, warmup)
    _print_passes(out_dir / "run.json", recipe, console)
    with _phase(console, f"analyzing {trace}"):
        analysis = analyze_trace(trace)
    gains = findings_gains(records or [], trace, analysis.trace_meta)
    render_analysis(analysis, console, top=top, gains=gains.gains, names="op")
    if gains.note:
        console.print(f"[yellow]note:[/] {gains.note}", highlight=False)
    files = _capture_files(out_dir, trace)
    title = f"{config.model}{at} {mode} {precision} batch {batch}" + (f", recipe {recipe}" if recipe else "")
    files += write_analysis(analysis, out_dir, fmt, trace=trace, timeline=timeline, title=title, gains=gains.gains,
                            on_note=lambda line: console.print(f"[yellow]note:[/] {line}", highlight=False))
    console.print(f"[bold]{label}[/] backend; files written:")
    for f in files:
        console.print(f"  {f}")
    return ProfileResult(out_dir=out_dir, backend=chosen, trace=trace, files=files, notes=notes)


def _capture_files(folder: Path, trace: Path | None = None) -> list[Path]:
    """The files a capture left in `folder` (its trace, run.json, logs, the spec it ran), those that exist."""
    paths = [folder / "trace.nsys-rep", *([trace] if trace is not None else []),
             *(folder / n for n in ("run.json", "capture_spec.json", "capture.log", "nsys.log", "torchrun.log"))]
    return [p for p in paths if p.exists()]


@contextmanager
def _phase(console: Console, what: str):
    """One phase of the run: a spinner on a terminal; elsewhere (a CI log) a plain line as it starts and
    one as it ends, so a log shows where a long capture is."""
    if console.is_terminal:
        with console.status(what + " ..."):
            yield
        return
    console.print(f"{what} ...", markup=False, highlight=False, soft_wrap=True)
    t0 = time.perf_counter()
    yield
    console.print(f"{what}: done in {time.perf_counter() - t0:.1f} s", markup=False, highlight=False, soft_wrap=True)


def _print_passes(run_json: Path, recipe: str | None, console: Console) -> None:
    """What the recipe changed in the profiled model, one line a pass; a pass that could not apply
    here is flagged, so a trace is never mistaken for the optimized model's."""
    if not recipe or not run_json.exists():
        return
    import json

    for p in json.loads(run_json.read_text()).get("passes", []):
        style = "" if p.get("available", True) else "[yellow]not applied:[/] "
        console.print(f"recipe {recipe}: {style}{p['name']}: {p['changed']}")
