"""The README's results table, rendered from stored stage records.

`swinbench report RECORDS... --readme README.md` reads the records (folders or files, in the order
given), renders one Markdown table with `results_table` and writes it between the README's markers
`<!-- results:begin -->` and `<!-- results:end -->`; nothing outside the markers changes. The block
ends with the command that rendered it, with the record paths relative to the README's folder, so a
test can render the same records again and compare (tests/test_readme_table.py).

`results_table(records, command)` is pure: a list of `swinbench.stage/1` records (grouped by run, in the
order given) -> Markdown. One row per stage; the first row of each run names the model, mode, batch
and device. Under the table, one line per run with what measured it (GPU and driver, or CPU; torch,
triton and timm versions; the date) and where its records are.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

from workbench.errors import UserError
from workbench.files import atomic_write_text
from workbench.results.record import StageRecord, as_records, read_record, record_files, refuse_copies
from workbench.results.report import (CROSS_RUN_MARK, CROSS_RUN_NOTE, PEER_LABEL, REUSED_MARK, REUSED_NOTE, _is_peer,
                                      best_form, fmt_rate, fmt_speedup, fmt_step, speedup_table)

BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"
HEADERS = ["run", "stage", "precision", "eager ms (median ± IQR)", "eager × baseline", "eager × previous",
           "graph ms (median ± IQR)", "graph img/s", "graph × baseline", "graph × previous", "gate"]
_SIZES = {"tiny": "T", "small": "S", "base": "B", "large": "L", "huge": "H", "giant": "G"}


def short_model(name: str | None) -> str:
    """'swin_base_patch4_window7_224' -> 'Swin-B 224', 'swinv2_tiny_window8_256' -> 'SwinV2-T 256 (window 8)',
    'swinv2_cr_small_ns_224' -> 'SwinV2-CR-S 224 ns'; the tiny CPU Swin -> 'tiny CPU Swin'; other names as is."""
    if name == "swinbench_tiny_cpu":
        return "tiny CPU Swin"
    cr = re.fullmatch(r"swinv2_cr_(tiny|small|base|large|huge|giant)(_ns)?_(\d+)", name or "")
    if cr:
        size, ns, img = cr.groups()
        return f"SwinV2-CR-{_SIZES[size]} {img}" + (" ns" if ns else "")
    v2 = re.fullmatch(r"swinv2_(tiny|small|base|large)_window(?:\d+to)?(\d+)_(?:\d+to)?(\d+)(.*)", name or "")
    if v2:
        size, window, img, rest = v2.groups()
        return f"SwinV2-{_SIZES[size]} {img} (window {window})" + (f" {rest.lstrip('_')}" if rest else "")
    m = re.fullmatch(r"swin_(tiny|small|base|large)_patch4_window(\d+)_(\d+)(.*)", name or "")
    if not m:
        return str(name)
    size, window, img, rest = m.groups()
    label = f"Swin-{_SIZES[size]} {img}" + (f" (window {window})" if window != "7" else "")
    return label + (f" {rest.lstrip('_')}" if rest else "")


def run_label(rec: StageRecord) -> str:
    """'Swin-B 224, training, batch 64, H200' for a run's first row."""
    mode = "inference" if rec.mode == "infer" else "training"
    at = f" at {rec.shape_label}" if rec.shape_label else ""
    return (f"{short_model(rec.model)}{at}, {mode}, batch {rec.batch}, "
            f"{rec.env.device_name.removeprefix('NVIDIA ')}")


def gpu_label(env) -> str:
    """'NVIDIA H200 (driver 580.x)' for a GPU record's environment."""
    return f"{env.gpu or 'GPU'} (driver {env.driver or '?'})"


def versions_label(env) -> str:
    """'torch 2.11.0, triton 3.6.0, timm 1.0.29': the versions a record was measured with."""
    return ", ".join(f"{k} {getattr(env, k)}" for k in ("torch", "triton", "timm") if getattr(env, k))


def _run_note(rec: StageRecord, where: str | None) -> str:
    env = rec.env
    if env.on_gpu:
        device = gpu_label(env)
    else:
        device = "CPU, not a GPU speed figure"
        if env.triton_launcher == "interpreter":
            device += " (Triton kernels under the CPU interpreter: the stages run and pass the gate, slowly)"
    versions = versions_label(env)
    date = str(env.date or "")[:10]
    timing = rec.timing
    steps = (f"; median of {timing.repeats} steps after {timing.warmup} warm-up" if timing is not None else "")
    parts = [f"**{run_label(rec)}**: {device}", versions, f"measured {date}" if date else ""]
    text = "; ".join(p for p in parts if p) + steps
    return text + (f"; records `{where}`" if where else "")


def _nan(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def results_table(records, command: str | None = None, sources: list[str] | None = None) -> str:
    """The README's results block (Markdown, no markers): the table, one line per run, and `command`
    (the command that rendered it) when given. `sources[i]` names where run i's records are, in
    the order the runs first appear."""
    if not records:
        raise UserError("no stage records for the results table")
    records = as_records(records)
    df = speedup_table(records)
    runs = list(dict.fromkeys(r.run_id for r in records))
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "|".join("---" for _ in HEADERS) + "|"]
    first_of_run: dict = {}
    best_lines = []
    row_of = lambda cells: "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
    for run in runs:
        mine = [(rec, row) for rec, row in zip(records, df.itertuples()) if rec.run_id == run]
        run_records = [rec for rec, _ in mine]
        best = best_form(run_records, speedup_table(run_records))
        last_main = max((i for i, (rec, _) in enumerate(mine) if not _is_peer(rec, run_records)), default=None)
        for i, (rec, row) in enumerate(mine):
            first = rec.run_id not in first_of_run
            first_of_run.setdefault(rec.run_id, rec)
            xb = fmt_speedup(row.x_baseline) + (CROSS_RUN_MARK if row.x_baseline_cross_run else "")
            xp = fmt_speedup(row.x_previous) + (CROSS_RUN_MARK if row.x_previous_cross_run else "")
            gp = fmt_speedup(row.x_previous_graph)
            if not _nan(row.x_previous) and row.previous_stage != row.extends:
                xp += f" (vs {row.previous_stage})"
                gp += f" (vs {row.previous_stage})" if not _nan(row.x_previous_graph) else ""
            gate = row.gate if row.status == "ok" else row.status
            stage = row.stage + (PEER_LABEL if rec.pytorch_alone and _is_peer(rec, run_records) else "")
            stage += f" {REUSED_MARK}" if rec.reused is not None else ""
            lines.append(row_of([run_label(rec) if first else "", stage, row.precision_label or "-",
                                 fmt_step(row.step_ms, row.step_iqr_ms), xb, xp,
                                 fmt_step(row.graph_ms, row.graph_iqr_ms), fmt_rate(row.graph_img_per_s),
                                 fmt_speedup(row.x_baseline_graph), gp, gate]))
            if best is not None and i == last_main:
                graph = best["form"] != "as written"
                ms, x = f"**{best['ms']:.2f}**", f"**{fmt_speedup(best['x_baseline'])}**"
                rate = fmt_rate(rec.batch / best["ms"] * 1e3)
                lines.append(row_of(["", f"**best form: {best['stage']}, {best['form']}**", "",
                                     "-" if graph else ms, "-" if graph else x, "",
                                     ms if graph else "-", rate if graph else "-", x if graph else "-", "", ""]))
        if best is not None and best["peer"]:
            best_lines.append(f"- **{run_label(run_records[0])}**: the fused stack's best form ({best['stage']}, "
                              f"{best['form']}, {best['ms']:.2f} ms) against the strongest PyTorch-alone peer "
                              f"({best['peer']}, {best['peer_form']}, {best['peer_ms']:.2f} ms): "
                              f"**{best['x_peer']:.2f}x**")
    lines.append("")
    lines += best_lines + ([""] if best_lines else [])
    for i, run in enumerate(runs):
        where = sources[i] if sources and i < len(sources) else None
        lines.append(f"- {_run_note(first_of_run[run], where)}")
    lines.append("")
    lines.append("eager: the step as a plain training script runs it; graph: the same step captured once and "
                 "replayed as one CUDA graph (no host launch cost). × previous: against the stage it extends (or "
                 "the named ancestor), in the same column. Stages that fail the correctness gate against the fp32 "
                 "baseline, or are not available, have no speedups. (PyTorch alone): a peer that runs none of "
                 "swinbench's kernels.")
    if df["reused"].any():
        lines.append(REUSED_NOTE)
    if (df["x_baseline_cross_run"] | df["x_previous_cross_run"]).any():
        lines.append(CROSS_RUN_NOTE)
    if command:
        lines += ["", f"Rendered by `{command}`; do not edit by hand."]
    return "\n".join(lines)


def replace_between_markers(text: str, block: str, where: str = "the file", begin: str = BEGIN,
                            end: str = END) -> str:
    """`text` with everything between `begin` and `end` (default the results block's markers) replaced
    by `block` (markers kept, each on its own line). UserError unless each marker occurs exactly once,
    `begin` first."""
    nb, ne = text.count(begin), text.count(end)
    if nb != 1 or ne != 1:
        raise UserError(f"{where} must hold {begin} and {end} once each (found {nb} and {ne})")
    start, stop = text.index(begin) + len(begin), text.index(end)
    if stop < start:
        raise UserError(f"{where}: {end} comes before {begin}")
    return text[:start] + "\n" + block.strip("\n") + "\n" + text[stop:]


def table_block(text: str, begin: str = BEGIN, end: str = END) -> str:
    """What `text` holds between the markers, without the surrounding newlines."""
    replace_between_markers(text, "", begin=begin, end=end)  # validates the markers
    return text[text.index(begin) + len(begin): text.index(end)].strip("\n")


def display_path(path: Path, base: Path) -> str:
    try:
        return Path(os.path.relpath(Path(path).resolve(), base.resolve())).as_posix()
    except ValueError:  # another drive (Windows)
        return Path(path).as_posix()


def render_for_readme(paths: list[Path], readme: Path) -> str:
    """The block `update_readme` writes: records read per path (in the order given), sources and the
    command with paths relative to the README's folder."""
    readme = Path(readme)
    records: list[StageRecord] = []
    sources: list[str] = []
    files: list[Path] = []
    read: list[StageRecord] = []     # in the order of files
    for p in map(Path, paths):
        seen = {r.run_id for r in records}
        named = {f.resolve() for f in files}
        mine = [f for f in record_files([p]) if f.resolve() not in named]    # a file named twice is read once
        got = [read_record(f) for f in mine]
        files += mine
        read += got
        new_runs = dict.fromkeys(r.run_id for r in got if r.run_id not in seen)
        sources += [display_path(p, readme.parent)] * len(new_runs)
        records += sorted(got, key=lambda r: (r.run_id, r.stage_index))
    refuse_copies(files, read)
    command = "swinbench report " + " ".join(display_path(p, readme.parent) for p in paths) + \
        f" --readme {readme.name}"
    return results_table(records, command, sources)


def readme_file(readme) -> Path:
    """The file --readme rewrites: a symbolic link's target (the atomic rename would otherwise put a copy in
    place of the link and leave the file it points to as it was), else the path as given."""
    readme = Path(readme)
    return Path(os.path.realpath(readme)) if readme.is_symlink() else readme


def update_readme(paths: list[Path], readme: Path) -> Path:
    """`swinbench report RECORDS... --readme README.md`: rewrite the table between the markers, atomically."""
    readme = readme_file(readme)
    try:
        text = readme.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {readme}: {getattr(exc, 'strerror', None) or exc}") from None
    new = replace_between_markers(text, render_for_readme(paths, readme), str(readme))
    return atomic_write_text(readme, new)
