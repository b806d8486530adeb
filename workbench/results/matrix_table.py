"""The family matrix table, rendered from the stored records of its cells.

`swinbench matrix` runs one `apply` per cell (a model, a mode and a batch) into `<out>/<cell>/`, each
with the stages amp, the fused swinbench stage and the PyTorch-alone peer torch-compile. This module
reads those folders back and writes `<out>/matrix.md` and `<out>/matrix.json`; it never runs a model,
so the table can be rebuilt without a GPU (`swinbench matrix --render-only OUT`).

Per cell, the best form of each side is `report.best_form` (per stage the faster of its step as written
and its step replayed as one CUDA graph): the swinbench side is the fused stack (among='last'), the peer
side the fastest PyTorch-alone peer; amp is taken the same way (the faster of its two forms). A cell
where swinbench is slower than the peer is marked: it is a finding, not a rounding detail.

matrix_rows(cells) -> one dict per cell, keys ROW_KEYS:
  cell (folder name), model, mode ('train' or 'infer'), batch, device ('CPU' or the GPU's name),
  amp_ms, amp_form, peer (stage), peer_form, peer_ms, swinbench (stage), swinbench_form, swinbench_ms,
  swinbench_iqr_ms, swinbench_img_per_s, x_peer (peer ms / swinbench ms), x_amp (amp ms / swinbench ms),
  peak_mem_bytes (of the swinbench stage), gate ('PASS', or each stage that did not pass and why),
  slower (swinbench slower than the peer), run_id, floors (the swinbench stage's kernels against their
  memory floor: StageRecord.kernel_floors of its record, at most FLOOR_ROWS; [] where it has none),
  measured_with (GPU and driver, or CPU; torch, triton and timm versions), date (of its first record).
Times are milliseconds per step; None where a side was not measured or did not pass the gate.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

from workbench.errors import UserError
from workbench.files import atomic_write_text, refuse_to_replace
from workbench.results.readme_table import (display_path, gpu_label, readme_file, replace_between_markers,
                                             short_model, table_block, versions_label)
from workbench.results.record import StageRecord, as_records, read_records
from workbench.results.report import _is_peer, _isnum, best_form, fmt_bytes, fmt_rate, fmt_speedup, speedup_table
from workbench.run_folder import MATRIX_JSON, MATRIX_MD  # the names that mark a matrix folder

MATRIX_SCHEMA = "swinbench.matrix/1"
README_BEGIN = "<!-- matrix:begin -->"
README_END = "<!-- matrix:end -->"
SLOWER_MARK = "▼"
SLOWER_NOTE = (f"{SLOWER_MARK} swinbench's best form is slower than the strongest PyTorch-alone peer in this cell: "
               "the fused stack loses here.")
ROW_KEYS = ["cell", "model", "mode", "batch", "device", "amp_ms", "amp_form", "peer", "peer_form", "peer_ms",
            "swinbench", "swinbench_form", "swinbench_ms", "swinbench_iqr_ms", "swinbench_img_per_s", "x_peer",
            "x_amp", "peak_mem_bytes", "gate", "slower", "run_id", "floors", "measured_with", "date"]
FLOOR_ROWS = 4      # per cell in matrix.md: the swinbench stage's costliest kernels against their floor
HEADERS = ["model", "mode", "batch", "amp ms", "peer ms (form)", "swinbench ms ± IQR (form)", "swinbench img/s",
           "× peer", "× amp", "peak memory", "gate"]
_MODE_ORDER = {"train": 0, "infer": 1}


def _num(x) -> float | None:
    return float(x) if _isnum(x) else None


def _form(stage: str | None, form: str | None) -> str:
    if stage is None:
        return "-"
    return f"{stage}, graph" if form == "graph-replayed" else stage


def _stage_best(df, stage: str) -> tuple[float | None, str | None]:
    """(ms, form) of a counted stage: the faster of as written and graph-replayed (best_form's rule)."""
    rows = df[(df["stage"] == stage) & df["counted"]]
    if rows.empty:
        return None, None
    r = rows.iloc[0]
    forms = [(r["step_ms"], "as written")]
    if _isnum(r["graph_ms"]) and r["graph_ms"] != r["step_ms"]:
        forms.append((r["graph_ms"], "graph-replayed"))
    ms, form = min(forms)
    return float(ms), form


def _gate(records: list[StageRecord]) -> str:
    bad = [f"{r.stage} {r.gate.status if r.ok else r.status}" for r in records
           if not (r.ok and r.gate.status in ("PASS", "REFERENCE"))]
    return "PASS" if records and not bad else ("; ".join(bad) or "no records")


def cell_row(cell: str, records) -> dict:
    """One matrix row (ROW_KEYS) from the stage records of one cell's run."""
    records = as_records(records)
    if not records:
        raise UserError(f"matrix cell {cell} holds no stage records")
    first = records[0]
    df = speedup_table(records)
    best = best_form(records, df, among="last", require_graph=False) or {}
    if best.get("peer") is None:   # no fused stage counted: best_form names no peer then, the row still does
        peers = [(*_stage_best(df, r.stage), r.stage) for r in records
                 if r.pytorch_alone and r.stage != "baseline" and _is_peer(r, records)]
        peers = [p for p in peers if p[0] is not None]
        if peers:
            ms, form, stage = min(peers)
            best.update(peer=stage, peer_form=form, peer_ms=ms)
    amp_ms, amp_form = _stage_best(df, "amp")
    sw_ms, sw_stage, sw_form = best.get("ms"), best.get("stage"), best.get("form")
    iqr = peak = rate = None
    if sw_stage is not None:
        r = df[df["stage"] == sw_stage].iloc[0]
        graph = sw_form == "graph-replayed"
        iqr = _num(r["graph_iqr_ms"] if graph else r["step_iqr_ms"])
        rate = _num(r["graph_img_per_s"] if graph else r["img_per_s"])
        peak = _num(r["peak_mem_bytes"])
    x_peer = best.get("x_peer")
    sw_rec = next((r for r in records if r.stage == sw_stage), None)
    floors = [f.to_dict() for f in sw_rec.kernel_floors[0][:FLOOR_ROWS]] if sw_rec is not None else []
    return {
        "cell": cell, "model": first.model, "mode": first.mode, "batch": first.batch,
        "device": first.env.device_name, "amp_ms": amp_ms, "amp_form": amp_form, "peer": best.get("peer"),
        "peer_form": best.get("peer_form"), "peer_ms": _num(best.get("peer_ms")), "swinbench": sw_stage,
        "swinbench_form": sw_form, "swinbench_ms": _num(sw_ms), "swinbench_iqr_ms": iqr, "swinbench_img_per_s": rate,
        "x_peer": _num(x_peer), "x_amp": amp_ms / sw_ms if amp_ms and sw_ms else None, "peak_mem_bytes": peak,
        "gate": _gate(records), "slower": bool(_isnum(x_peer) and x_peer < 1.0), "run_id": first.run_id,
        "floors": floors, "measured_with": _measured_with(first), "date": str(first.env.date or "")[:10] or None,
    }


def _measured_with(rec: StageRecord) -> str:
    """'NVIDIA H200 (driver 580.x); torch 2.11, triton 3.6, timm 1.0' for the record's machine and versions."""
    env = rec.env
    device = gpu_label(env) if env.on_gpu else "CPU"
    return "; ".join(p for p in (device, versions_label(env)) if p)


def measured_line(rows: list[dict]) -> str:
    """What measured the cells: each distinct machine and versions, with the dates its cells were measured."""
    dates: dict[str, list[str]] = {}
    for r in rows:
        dates.setdefault(r["measured_with"], []).append(r["date"] or "?")
    parts = []
    for what, ds in dates.items():
        first, last = min(ds), max(ds)
        parts.append(f"{what}; measured {first}" + (f" to {last}" if last != first else ""))
    return "Measured with " + "; and ".join(parts) + "."


def matrix_rows(cells) -> list[dict]:
    """[(cell name, records)] -> one row per cell (ROW_KEYS), in the order given."""
    return [cell_row(name, records) for name, records in cells]


def _ms(ms, iqr=None) -> str:
    if not _isnum(ms):
        return "-"
    return f"{ms:.2f} ± {iqr:.2f}" if _isnum(iqr) else f"{ms:.2f}"


def display_row(row: dict, name_device: bool = False) -> list[str]:
    """A row's cells as the table shows them; `name_device` (a table of several devices): the model's
    cell names the device that measured it."""
    ratio = fmt_speedup(row["x_peer"])
    if row["slower"]:
        ratio = f"**{ratio}** {SLOWER_MARK}"
    model = short_model(row["model"]) + (f" ({row['device']})" if name_device else "")
    return [model, "training" if row["mode"] == "train" else "inference", str(row["batch"]),
            _ms(row["amp_ms"]) + (" (graph)" if row["amp_form"] == "graph-replayed" else ""),
            f"{_ms(row['peer_ms'])} ({_form(row['peer'], row['peer_form'])})" if row["peer"] else "-",
            f"{_ms(row['swinbench_ms'], row['swinbench_iqr_ms'])} ({_form(row['swinbench'], row['swinbench_form'])})"
            if row["swinbench"] else "-",
            fmt_rate(row["swinbench_img_per_s"]), ratio, fmt_speedup(row["x_amp"]), fmt_bytes(row["peak_mem_bytes"]),
            row["gate"]]


def _where(rows: list[dict]) -> str:
    devices = list(dict.fromkeys(r["device"] for r in rows))
    if devices == ["CPU"]:
        return "CPU — not a GPU speed figure"
    text = ", ".join(devices)
    return text + (" — CPU rows are not GPU speed figures" if "CPU" in devices else "")


def summary_line(rows: list[dict]) -> str:
    """How many cells swinbench wins against the peer, and the weakest ratio."""
    compared = [r for r in rows if _isnum(r["x_peer"])]
    if not compared:
        return "No cell has both a swinbench stage and a PyTorch-alone peer that passed the gate."
    slower = [r for r in compared if r["slower"]]
    low = min(compared, key=lambda r: r["x_peer"])
    weakest = f"lowest {low['x_peer']:.2f}x ({short_model(low['model'])}, {low['mode']}, batch {low['batch']})"
    if not slower:
        cells = ("its one cell" if len(rows) == 1 else f"all {len(rows)} cells") if len(compared) == len(rows) \
            else f"{len(compared)} of {len(rows)} cells"
        line = f"swinbench is at least as fast as the strongest PyTorch-alone peer in {cells}; {weakest}."
    else:
        line = (f"swinbench is slower than the strongest PyTorch-alone peer in {len(slower)} of {len(compared)} "
                f"cells compared ({SLOWER_MARK}); {weakest}.")
    unmatched = [r for r in rows if not _isnum(r["x_peer"])]
    if unmatched:
        line += (f" {len(unmatched)} cell(s) without both a swinbench stage and a peer that passed the gate: "
                 + ", ".join(f"{short_model(r['model'])} {r['mode']} b{r['batch']}" for r in unmatched) + ".")
    return line


def matrix_markdown(rows: list[dict], command: str | None = None, heading: bool = True) -> str:
    """The matrix as Markdown: a title naming the device (a heading, or with heading=False a bold line
    for the README's block), the table, the summary and the notes."""
    if not rows:
        raise UserError("the matrix has no finished cells to render")
    title = f"swinbench matrix — {_where(rows)}"
    lines = [f"# {title}" if heading else f"**{title}**", "",
             "| " + " | ".join(HEADERS) + " |", "|" + "|".join("---" for _ in HEADERS) + "|"]
    several = len({r["device"] for r in rows}) > 1
    lines += ["| " + " | ".join(display_row(r, several)) + " |" for r in rows]
    lines += ["", summary_line(rows), "", measured_line(rows), "",
              "Each cell is one `swinbench apply` run (its own records and report.md in the cell's folder): amp, "
              "the fused swinbench stage and the PyTorch-alone peer torch-compile, on the same seed. "
              "Per stage the faster of its step as written and its step replayed as one CUDA graph counts "
              "(graph: the graph-replayed form; torch-compile's graph form is the whole compiled step, "
              "optimizer included, in one CUDA graph). × peer: peer ms over swinbench ms; × amp likewise. "
              "Peak memory: the swinbench stage's."]
    if any(r["slower"] for r in rows):
        lines += ["", SLOWER_NOTE]
    if heading and any(r.get("floors") for r in rows):
        lines += ["", "## swinbench's kernels against their memory floor", "",
                  f"Each cell's swinbench stage: its {FLOOR_ROWS} costliest kernels per argument shape, the median "
                  "time (in the nsys capture where the cell was profiled, else in the steps torch.profiler timed the "
                  "GPU time of), the floor (argument bytes at the GPU's peak bandwidth) and floor / median "
                  "(docs/analysis.md).", "",
                  "| model | mode | batch | stage | kernel | largest argument | calls/step | median µs | floor µs "
                  "| % of floor |", "|" + "|".join("---" for _ in range(10)) + "|"]
        for r in rows:
            for f in r.get("floors") or []:
                lines.append(f"| {short_model(r['model'])} | {'training' if r['mode'] == 'train' else 'inference'} "
                             f"| {r['batch']} | {r['swinbench']} | {f['kernel']} | {f['largest_argument']} "
                             f"| {f['calls_per_step']:,.0f} | {f['median_us']:,.1f} | {f['floor_us']:,.1f} "
                             f"| {f['floor_pct']:.0f}% |")
    if command:
        lines += ["", f"Rendered by `{command}`."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- folders


CELL_NAME = re.compile(r".+-(train|infer)-b\d+")   # matrix.cell_name: <model>-<mode>-b<batch>


def cell_folders(out_dir: Path) -> list[Path]:
    """The cell folders under out_dir (named as `swinbench matrix` names a cell, with a records/ folder
    holding a record), not the earlier runs that `--overwrite` moved aside (`<cell>.previous-<run id>`),
    nor other runs' folders (a reports/ folder is not a matrix)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise UserError(f"no matrix folder {out_dir}")
    return sorted(p for p in out_dir.iterdir() if p.is_dir() and CELL_NAME.fullmatch(p.name)
                  and any((p / "records").glob("*.json")))


def _order(row: dict, models: list[str]) -> tuple:
    model = row["model"]
    return (models.index(model) if model in models else len(models), model, _MODE_ORDER.get(row["mode"], 2),
            -int(row["batch"]))


def read_matrix(out_dir: Path, model_order: list[str] | None = None, names: list[str] | None = None) -> list[dict]:
    """The rows of the cell folders under out_dir (every one, or those `names` lists that hold records),
    ordered by model (model_order first), training before inference, larger batches first. UserError
    when no cell holds records."""
    folders = [f for f in cell_folders(out_dir) if names is None or f.name in names]
    if not folders:
        if any((Path(out_dir) / "records").glob("*.json")):
            raise UserError(f"{out_dir} is one run's folder (its records/ are one cell's or one apply's), not a "
                            f"matrix: give the matrix folder that holds the cells")
        raise UserError(f"{out_dir} holds no matrix cells (folders named <model>-<mode>-b<batch> with "
                        "records/): nothing to render")
    rows = matrix_rows((f.name, read_records([f / "records"])) for f in folders)
    return sorted(rows, key=lambda r: _order(r, list(model_order or [])))


def write_matrix(out_dir: Path, model_order: list[str] | None = None, command: str | None = None,
                 names: list[str] | None = None) -> tuple[Path, Path]:
    """Render matrix.md and matrix.json in out_dir from its cells' records (read_matrix) -> (md, json)."""
    out_dir = Path(out_dir)
    rows = read_matrix(out_dir, model_order, names)
    md = out_dir / MATRIX_MD
    js = out_dir / MATRIX_JSON
    for path, ours in ((md, lambda head: head.startswith("# swinbench matrix")),
                       (js, lambda head: f'"schema": "{MATRIX_SCHEMA}"' in head[:200])):
        refuse_to_replace(path, ours, "a table swinbench matrix wrote",
                          remedy="move it away to render the matrix there")
    atomic_write_text(md, matrix_markdown(rows, command))
    clean = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows]
    atomic_write_text(js, json.dumps({"schema": MATRIX_SCHEMA, "cells": clean}, indent=2) + "\n")
    return md, js


# ---------------------------------------------------------------- the README's block


def render_matrix_for_readme(out_dir: Path, readme: Path, model_order: list[str] | None = None) -> str:
    """The block between README_BEGIN and README_END: the matrix of out_dir's cells, ending with the
    command that renders it (paths relative to the README's folder), which tests/test_matrix.py reruns."""
    readme = Path(readme)
    command = (f"swinbench matrix --render-only {display_path(Path(out_dir), readme.parent)} "
               f"--readme {readme.name}")
    text = matrix_markdown(read_matrix(out_dir, model_order), command, heading=False)
    return text.rstrip("\n") + " Do not edit by hand.\n"


def readme_matrix_block(text: str) -> str:
    """What a README holds between README_BEGIN and README_END (UserError unless each occurs once)."""
    return table_block(text, README_BEGIN, README_END)


def update_readme_matrix(out_dir: Path, readme: Path, model_order: list[str] | None = None) -> Path:
    """`swinbench matrix --render-only OUT --readme README.md`: rewrite the block between the matrix
    markers, atomically; nothing outside them changes."""
    readme = readme_file(readme)
    try:
        text = readme.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {readme}: {getattr(exc, 'strerror', None) or exc}") from None
    block = render_matrix_for_readme(out_dir, readme, model_order)
    return atomic_write_text(readme, replace_between_markers(text, block, str(readme), README_BEGIN, README_END))
