"""`swinbench matrix`: the Swin family, models x modes x {amp, the fused stage, the PyTorch-alone peer}.

A cell is one model in one mode at one batch: training at the model's training batch
(TRAIN_BATCH, or --train-batch), inference at 64, 8 or 1. Each cell is one `run_apply` call with the
stages amp, the fused swinbench stage (fmha in training and dense in inference unless --fused names
others) and torch-compile (the
strongest PyTorch-alone peer; its graph-replayed form is the whole compiled step in one CUDA graph; for a
fused stage that quantizes, torchao's peer of the same precision too), into
`<out>/<model>-<mode>-b<batch>/` with its own records and report.md. So a matrix cut short keeps every
finished cell, `resume` continues it (a cell whose records are all finished is skipped; a cell cut short
is continued with apply's own resume), and the measurement cache (`reuse.py`) makes a rerun cheap.
After every cell, `<out>/matrix.md` and `<out>/matrix.json` are rendered again from the cells' stored
records (`results/matrix_table.py`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from workbench.arguments import name_list
from workbench.errors import UserError
from workbench.models import TINY_MODEL, check_model_name
from workbench.results.matrix_table import MATRIX_JSON, MATRIX_MD, cell_folders, write_matrix
from workbench.results.record import read_records
from workbench.run_folder import run_entries

# The family the matrix runs by default on a GPU (Swin v1: the four sizes at window 7 / 224 px and the
# window-12 model at 384 px that fine-tuning uses most; SwinV2-T, window 8 at 256 px, whose attention runs
# the fused kernel between the window kernels, fused_linear its SwinV2 form, while fused_block stands aside).
FAMILY = [
    "swin_tiny_patch4_window7_224",
    "swin_small_patch4_window7_224",
    "swin_base_patch4_window7_224",
    "swin_large_patch4_window7_224",
    "swin_base_patch4_window12_384",
    "swinv2_tiny_window8_256",
]
# Training batch per model: the batches swinbench's training figures are quoted at (Swin-T 128, Swin-B
# and -L 64), Swin-S and SwinV2-T as Swin-T, and half of Swin-B's at 384 px, where a step holds about
# three times the tokens. A model not named here takes train_batch_for's rule.
TRAIN_BATCH = {
    "swin_tiny_patch4_window7_224": 128,
    "swin_small_patch4_window7_224": 128,
    "swin_base_patch4_window7_224": 64,
    "swin_large_patch4_window7_224": 64,
    "swin_base_patch4_window12_384": 32,
    "swinv2_tiny_window8_256": 128,
    TINY_MODEL: 8,   # the CPU demo: a few images keep a CPU cell short
}
# mode name -> (apply's mode, batch; None: the model's training batch)
MODES = {"train": ("train", None), "infer64": ("infer", 64), "infer8": ("infer", 8), "infer1": ("infer", 1)}
DEFAULT_MODES = ["train", "infer64", "infer1"]
# The swinbench stage per mode: the fused stack that trains fastest, and for inference the one that also runs
# fc1's bias and GELU in the GEMM epilogue (dense; in training its Linear backward is one more launch pair).
DEFAULT_FUSED = {"train": "fmha", "infer": "dense"}
PEER = "torch-compile"
AMP = "amp"


@dataclass(frozen=True)
class Cell:
    """One apply run of the matrix: `mode` is apply's ('train' or 'infer'), `name` its folder's name."""

    model: str
    mode: str
    batch: int
    name: str


def train_batch_for(model: str) -> int:
    """TRAIN_BATCH's entry; otherwise 32 at 384 px and for SwinV2-CR's huge and giant, 64 for base and
    large, 128 for the rest."""
    if model in TRAIN_BATCH:
        return TRAIN_BATCH[model]
    if model.endswith("_384") or re.search(r"_(huge|giant)_", model):
        return 32
    return 64 if re.search(r"_(base|large)_", model) else 128


def cell_name(model: str, mode: str, batch: int) -> str:
    return f"{model}-{mode}-b{batch}"


def parse_list(text: str | list[str] | None, what: str) -> list[str] | None:
    """'a,b' -> ['a', 'b']; None stays None; UserError for an empty item (arguments.name_list) or a name
    given twice."""
    if text is None:
        return None
    items = name_list(text, f"--{what}")
    dup = sorted({s for s in items if items.count(s) > 1})
    if dup:
        raise UserError(f"--{what} names {dup[0]!r} twice")
    return items


def plan_cells(models: list[str], modes: list[str], train_batch: int | None = None) -> list[Cell]:
    """models x modes -> cells in that order. train_batch: every model's training batch instead of
    train_batch_for. UserError (before anything runs) for an unknown model or mode or a batch < 1."""
    if train_batch is not None and (isinstance(train_batch, bool) or train_batch < 1):
        raise UserError(f"--train-batch must be at least 1, got {train_batch}")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise UserError(f"unknown mode {bad[0]!r} in --modes: choose from {', '.join(MODES)}")
    for model in models:
        check_model_name(model)
    cells = []
    for model in models:
        for name in modes:
            mode, batch = MODES[name]
            batch = batch or train_batch or train_batch_for(model)
            cells.append(Cell(model, mode, batch, cell_name(model, mode, batch)))
    return cells


def parse_fused(text: str | dict | None) -> dict[str, str]:
    """--fused: one stage for every cell ('block'), or a stage per mode ('train=fmha,infer=dense'; a mode left
    out keeps its DEFAULT_FUSED stage) -> {apply mode: stage}."""
    if text is None:
        return dict(DEFAULT_FUSED)
    if isinstance(text, dict):
        out = dict(DEFAULT_FUSED)
        out.update(text)
        return out
    text = text.strip()
    if "=" not in text:
        if not text:
            raise UserError("--fused is empty: name a swinbench stage (fmha, dense, block, ...)")
        return {mode: text for mode in DEFAULT_FUSED}
    out = dict(DEFAULT_FUSED)
    seen = set()
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        mode, _, stage = (x.strip() for x in item.partition("="))
        if mode not in DEFAULT_FUSED or not stage:
            raise UserError(f"--fused {text!r}: give a stage, or MODE=STAGE pairs with MODE train or infer "
                            "(e.g. train=fmha,infer=dense)")
        if mode in seen:
            raise UserError(f"--fused {text!r}: {mode} is named twice")
        seen.add(mode)
        out[mode] = stage
    return out


def check_fused(fused: str, mode: str | None = None) -> None:
    """UserError unless `fused` is a recipe that runs swinbench kernels (not amp, not a PyTorch-alone peer)
    and, for the training cells (mode 'train'), one that trains (no inference-only pass)."""
    from workbench.optimize.recipes import RecipeBook, inference_only_pass, is_pytorch_alone

    chain = RecipeBook().chain(fused)
    if is_pytorch_alone(chain):
        raise UserError(f"--fused {fused} runs PyTorch alone: name a swinbench stage (fmha, block, ...)")
    only = inference_only_pass(chain) if mode == "train" else None
    if only:
        raise UserError(f"--fused {fused} cannot train ({only} is inference only): give the training cells "
                        f"another stage, e.g. --fused train=fmha,infer={fused}")


def cell_stages(fused: str, compiled: bool = False) -> list[str]:
    """amp, the fused stage and the PyTorch-alone peer; with `compiled`, also the fused stage under
    torch.compile (the built-in `<fused>-compile`, which extends it: the cell's swinbench side is then the
    faster of the two forms); for a fused stage that quantizes its GEMMs (fp8, int8-compile, ...), also
    torchao's peer of the same precision (the strongest PyTorch-alone path there)."""
    from workbench.optimize.recipes import RecipeBook, quantized_dtypes

    book = RecipeBook()
    extra = []
    if compiled:
        with_compiled = compiled_stages(book)
        if fused not in with_compiled:
            raise UserError(f"--compiled: there is no built-in {fused}-compile that extends {fused}; name a stage "
                            f"with one ({', '.join(with_compiled)})")
        extra.append(f"{fused}-compile")
    return [AMP, fused, *extra, PEER] + [f"torchao-{d}" for d in sorted(quantized_dtypes(book.chain(fused)))]


def plan_stages(fused: dict[str, str], modes: set[str], compiled: bool = False, console=None) -> dict[str, list[str]]:
    """{apply mode: cell_stages} for the modes the plan runs. With `compiled`, each mode's stage takes its
    compiled form where it has a built-in one; a mode whose stage has none runs without it (said on the
    console), and it is refused (cell_stages' line) when no mode's stage has one."""
    from workbench.optimize.recipes import RecipeBook

    for mode in sorted(modes):
        check_fused(fused[mode], mode)
    with_compiled = set(compiled_stages(RecipeBook())) if compiled else set()
    if compiled and not any(fused[m] in with_compiled for m in modes):
        cell_stages(fused[sorted(modes)[-1]], compiled=True)   # raises: no mode's stage has a compiled form
    plan = {}
    for mode in sorted(modes):
        plan[mode] = cell_stages(fused[mode], compiled and fused[mode] in with_compiled)
        if compiled and fused[mode] not in with_compiled and console is not None:
            console.print(f"[yellow]note:[/] --compiled: {fused[mode]} has no built-in compiled form; the {mode} "
                          f"cells run {fused[mode]} as written and graph-replayed only", highlight=False)
    return plan


def compiled_stages(book) -> list[str]:
    """The built-in stages X with an `X-compile` that extends X."""
    names = set(book.builtins)
    return sorted(n for n in names if f"{n}-compile" in names and book.chain(f"{n}-compile")[-2].name == n)


def cell_finished(folder: Path, stages: list[str], *, steps: int, warmup: int, on_gpu: bool,
                  profile: bool = False) -> bool:
    """Whether folder's records hold every stage, each finished (ok or not available, as apply's resume
    keeps them) under this plan: measured with these steps and warm-up on this device kind, and captured
    when `profile` asks for it. A cell that differs is not skipped: apply's resume then says, in one line,
    what differs."""
    return stages_finished(_cell_records(folder), stages, steps=steps, warmup=warmup, on_gpu=on_gpu,
                           profile=profile)


def _cell_records(folder: Path) -> list | None:
    """The stage records of a cell folder; None when it holds none or they are damaged (apply's resume
    then says what is wrong with them)."""
    records_dir = folder / "records"
    if not records_dir.is_dir() or not any(records_dir.glob("*.json")):
        return None
    try:
        return read_records([records_dir])
    except UserError:
        return None


def stages_finished(records: list | None, stages: list[str], *, steps: int, warmup: int, on_gpu: bool,
                    profile: bool = False) -> bool:
    """cell_finished on a cell's records as _cell_records read them."""
    if records is None:
        return False
    done = set()
    for r in records:
        if r.env.on_gpu != on_gpu or r.status not in ("ok", "not available"):
            continue
        if r.ok and r.timing is not None and (r.timing.repeats, r.timing.warmup) != (steps, warmup):
            continue
        if r.ok and profile and not r.profile:
            continue
        done.add(r.stage)
    return all(s in done for s in stages)


def _refuse_another_device(out_dir: Path, device, cells: dict[str, list | None]) -> None:
    """UserError (one line) when a cell of the matrix in out_dir was measured on another device than
    `device` (the CPU, or another GPU): one table compares cells of one device. cells: each cell folder's
    name -> its records (_cell_records)."""
    import torch

    here = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    for name, records in cells.items():
        if records is None:
            continue    # a damaged cell: apply's resume says what is wrong with it
        there = next((r.env.device_name for r in records), here)
        if there != here:
            raise UserError(f"--resume: {out_dir} holds cells measured on {there} ({name}), this command "
                            f"measures on {here}: one matrix compares cells of one device; choose another --out")


def _started(out_dir: Path) -> list[str]:
    """The entries of out_dir that an earlier matrix wrote: its tables and cell folders holding a run."""
    if not out_dir.is_dir():
        return []
    names = [p.name for p in sorted(out_dir.iterdir())
             if p.name in (MATRIX_MD, MATRIX_JSON) or (p.is_dir() and run_entries(p))]
    return names


def run_matrix(*, models: list[str] | None = None, modes: list[str] | None = None, train_batch: int | None = None,
               fused: str | dict | None = None, out_dir: Path, steps: int = 20, warmup: int = 5, device: str = "auto",
               cache_dir: Path | None = None, fresh: bool = False, resume: bool = False, overwrite: bool = False,
               console=None, progress: bool = True, run_apply=None, profile: bool = False,
               compiled: bool = False) -> dict:
    """Run every cell (one `run_apply` each) and render matrix.md / matrix.json in out_dir.

    models: default FAMILY on a GPU, the tiny CPU Swin on the CPU. modes: names of MODES (default
    DEFAULT_MODES). A folder holding an earlier matrix is refused (one line) unless `resume` (skip the
    finished cells, continue the others with apply's resume; the cells of other models or modes in the
    folder stay, and the table shows every cell in it) or `overwrite` (each cell's earlier files
    are moved aside by apply). A cell whose stage fails is reported and the others still run; the
    failures raise UserError at the end, after the table is written. profile: capture every stage too
    (apply's --profile); matrix.md then holds the capture's kernel floors (else those of apply's GPU-time
    steps, StageRecord.kernel_floors).
    fused: the swinbench stage, one for every cell or per mode (parse_fused; default DEFAULT_FUSED).
    compiled: run the fused stage's compiled form in every cell too, where it has one (plan_stages).
    run_apply: for tests.
    -> {"cells": [Cell], "ran": [names], "skipped": [names], "failed": {name: message}, "matrix": md path}."""
    from rich.console import Console

    from workbench.devices import pick_device, resolve_device

    console = console or Console()
    if run_apply is None:
        from workbench.ladder.apply import run_apply
    from workbench.ladder.apply import check_steps

    check_steps(steps, warmup)
    if resume and overwrite:
        raise UserError("--resume continues the matrix in --out and --overwrite moves it aside: give one")
    device = pick_device(device)
    on_gpu = resolve_device(device).type == "cuda"
    models = models or (list(FAMILY) if on_gpu else [TINY_MODEL])
    modes = modes or list(DEFAULT_MODES)
    fused = parse_fused(fused)
    cells = plan_cells(models, modes, train_batch)
    stages = plan_stages(fused, {c.mode for c in cells}, compiled, console)
    out_dir = Path(out_dir)
    from workbench.run_folder import refuse_inside_a_run, refuse_records_folder

    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"the output folder {out_dir} is a file")
    refuse_inside_a_run(out_dir)
    refuse_records_folder(out_dir)
    other = run_entries(out_dir)
    if other:   # a run of apply, profile or train, not a matrix: never mixed with the matrix's cells
        listed = ", ".join(e.name for e in other[:3]) + (", ..." if len(other) > 3 else "")
        raise UserError(f"{out_dir} holds a run of apply, profile or train ({listed}); nothing was changed: "
                        "give the matrix its own --out")
    earlier = _started(out_dir)
    if earlier and not (resume or overwrite):
        listed = ", ".join(earlier[:3]) + (", ..." if len(earlier) > 3 else "")
        raise UserError(f"{out_dir} holds an earlier matrix ({listed}); nothing was changed: --resume continues it, "
                        "--overwrite moves each cell's files aside, or choose another --out")
    # each cell's records, read once for --resume: the device check and the finished-cell check share them
    # (a cell's run writes only its own folder, so none of them changes before its cell comes up)
    stored = {f.name: _cell_records(f) for f in cell_folders(out_dir)} if resume and out_dir.is_dir() else {}
    if earlier and resume:
        _refuse_another_device(out_dir, resolve_device(device), stored)
    elif resume:
        console.print(f"[yellow]note:[/] --resume: {out_dir} holds no earlier matrix; starting a new one there")
    if not on_gpu:
        console.print("[yellow]note:[/] CPU matrix: the step times show the workflow, not what the stages do on a "
                      "GPU (torch-compile compiles with Inductor on the CPU: slow)")
    ran, skipped, failed = [], [], {}

    def render() -> Path | None:
        # every cell in the folder, not only this run's: a run of some models into a matrix folder adds
        # to its table and never drops the other cells from it
        if not any(any((out_dir / c.name / "records").glob("*.json")) for c in cells):
            return None
        return write_matrix(out_dir, model_order=models, command=f"swinbench matrix --render-only {out_dir}")[0]

    try:
        for i, cell in enumerate(cells, 1):
            folder = out_dir / cell.name
            head = f"matrix cell {i}/{len(cells)}: {cell.model}, {cell.mode}, batch {cell.batch}"
            if resume and stages_finished(stored.get(cell.name), stages[cell.mode], steps=steps, warmup=warmup,
                                          on_gpu=on_gpu, profile=profile):
                skipped.append(cell.name)
                console.print(f"{head}: finished in an earlier run, kept", highlight=False)
                continue
            console.print(f"{head} -> {folder}", highlight=False)
            try:
                run_apply(fused[cell.mode], model=cell.model, batch=cell.batch, steps=steps, warmup=warmup,
                          device=device, out_dir=folder, stages=list(stages[cell.mode]), mode=cell.mode,
                          resume=resume and bool(run_entries(folder)), overwrite=overwrite, cache_dir=cache_dir,
                          fresh=fresh, console=console, progress=progress,
                          **({"profile": True} if profile else {}))
            except UserError as exc:
                if getattr(exc, "result", None) is None:   # not a stage failure: the plan itself is wrong
                    raise
                failed[cell.name] = str(exc)
            ran.append(cell.name)
            render()
    finally:
        md = render()   # also after Ctrl-C or a refused cell: the table holds what finished
        if md is not None:
            planned = {c.name for c in cells}
            others = sum(f.name not in planned for f in cell_folders(out_dir))
            console.print(f"matrix: {md} ({len(ran)} cell(s) run, {len(skipped)} kept"
                          + (f", {others} other cell(s) of the folder" if others > 0 else "") + ")", highlight=False)
    if failed:
        name, message = next(iter(failed.items()))
        raise UserError(f"{len(failed)} matrix cell(s) had a failed stage ({name}: {message}); the table {md} "
                        "shows them")
    return {"cells": cells, "ran": ran, "skipped": skipped, "failed": failed, "matrix": md}
