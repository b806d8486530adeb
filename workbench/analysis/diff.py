"""`swinbench diff BEFORE AFTER`: what changed between two traces, kernel by kernel.

Two analyses (`analyze_trace`) -> `TraceDiff` (frames only: per-kernel and per-category GPU time and
counts per step on each side, their deltas, and a summary of kernel time, kernel count, host launches
and GPU busy) -> `render_diff` (rich) or `write_diff` (csv / json). Kernels are matched by name, so the
diff is exact for library and hand-written kernels; Inductor numbers its generated kernels per graph
(`triton_poi_fused_add_0`), so after a recompile the same kernel can show up under two names.

Per step: each side's totals are divided by its number of `step{i}` NVTX ranges (the captured steps;
swinbench's captures hold only those), so traces of different lengths compare; host launches are those
inside the steps, as analyze's API table counts them. A trace without step ranges is compared as a whole,
and the output says so.

Two CPU captures (Kineto without GPU kernels: CPU operators' self time in place of kernels) are compared the
same way; their tables and summary say CPU and operators (`labels.pair_words`).

Several GPUs: two traces on one GPU each compare whatever its index. Otherwise both must hold kernels of
the same devices (diff refuses in one line when they do not), and each device is compared with its
namesake: the kernel, category and summary frames get a leading `device` column (-1 in the summary for
the host's launches), and a device's figures are per step of the processes that launched its kernels.
The rows each side's parser dropped as broken come along as warnings.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from workbench.analysis.frames import api_summary, fold_tail, stack_devices
from workbench.analysis.analyze import Analysis, TableFiles, trace_origin
from workbench.errors import UserError
from workbench.labels import DeviceWords, GPU_WORDS, pair_words

KERNEL_COLUMNS = ["kernel", "before_ms", "after_ms", "delta_ms", "before_n", "after_n"]
CATEGORY_COLUMNS = ["category", "before_ms", "after_ms", "delta_ms"]


@dataclass
class TraceDiff:
    """kernels / categories: per-unit ms and counts on each side and the delta (after - before), largest
    |delta| first. summary: metric, before, after, delta. unit: 'step' when both traces have step ranges,
    'range instance' when both were scoped to a range, else 'trace'. steps: (before, after) divisors.
    With several GPUs (`devices`), every frame leads with a `device` column and device_steps holds each
    device's (before, after) divisors. warnings: the parsers' warnings of both sides, labelled."""

    before: str
    after: str
    unit: str
    steps: tuple[int, int]
    kernels: pd.DataFrame
    categories: pd.DataFrame
    summary: pd.DataFrame
    notes: list[str] = field(default_factory=list)
    words: DeviceWords = GPU_WORDS   # CPU traces: CPU operators, labelled so (workbench/labels.py)
    warnings: list[str] = field(default_factory=list)
    devices: list[int] = field(default_factory=list)
    device_steps: dict[int, tuple[int, int]] = field(default_factory=dict)
    range_name: str | None = None    # the NVTX range both sides were scoped to, None for whole traces


def _steps(analysis: Analysis) -> int | None:
    """How many steps (or, with a range, instances of it) the analysis covers; None if not known."""
    meta = analysis.trace_meta
    return int(meta["api_steps"]) if meta.get("api_unit") and meta.get("api_steps") else None


def per_unit(table: pd.DataFrame, key: str, per: int) -> pd.DataFrame:
    """A kernel or category share table (total_ns, instances) -> key, ms, n per unit (`per` units)."""
    out = pd.DataFrame({key: table[key].astype(str),
                        "ms": table["total_ns"].to_numpy("float64") / 1e6 / per,
                        "n": table["instances"].to_numpy("float64") / per})
    return out.groupby(key, as_index=False, sort=False).sum()


def join_per_unit(before: pd.DataFrame, after: pd.DataFrame, key: str) -> pd.DataFrame:
    """Two (key, ms, n) frames -> key, before_ms, after_ms, delta_ms, before_n, after_n; a key missing on
    one side counts 0 there; largest |delta_ms| first (then key, for a stable order)."""
    joined = before.rename(columns={"ms": "before_ms", "n": "before_n"}).merge(
        after.rename(columns={"ms": "after_ms", "n": "after_n"}), on=key, how="outer").fillna(0.0)
    joined["delta_ms"] = joined["after_ms"] - joined["before_ms"]
    order = np.lexsort((joined[key].to_numpy(), -joined["delta_ms"].abs().to_numpy()))
    return joined.iloc[order].reset_index(drop=True)[[key, "before_ms", "after_ms", "delta_ms", "before_n", "after_n"]]


def _joined(before: pd.DataFrame, after: pd.DataFrame, key: str, per: tuple[int, int]) -> pd.DataFrame:
    return join_per_unit(per_unit(before, key, per[0]), per_unit(after, key, per[1]), key)


def _busy_pct(analysis: Analysis, device: int | None = None) -> float:
    busy = analysis.busy if device is None else analysis.busy[analysis.busy["device"] == device]
    rows = busy[busy["metric"] == "busy"]
    return float(rows["pct"].iloc[0]) if len(rows) else math.nan


def _launches(analysis: Analysis, per: int, unit: str) -> float:
    """Host kernel launches divided by `per`: per step (or range instance), those inside the steps, the
    figure analyze's API table and findings give; compared whole (`unit` 'trace'), every launch of the
    trace on both sides, as the kernel counts are."""
    if analysis.api is None or not len(analysis.api):
        return math.nan
    if unit != "trace":    # analysis.api holds the calls inside its steps (analyze._scoped_api)
        return float(analysis.api.loc[analysis.api["kind"] == "launch", "calls"].sum()) / per
    if analysis.trace_meta.get("host_launches") is not None:
        return float(analysis.trace_meta["host_launches"]) / per
    calls = float(api_summary(analysis.api).get("launch", 0.0))
    steps = _steps(analysis)
    return (calls * steps if steps else calls) / per


def _devices(before: Analysis, after: Analysis, before_label: str, after_label: str) -> list[int] | None:
    """The devices to compare one by one, or None when each trace ran on one GPU (compared whole)."""
    b, a = before.devices, after.devices
    if len(b) <= 1 and len(a) <= 1:
        return None
    if b != a:
        raise UserError(f"the traces ran on different GPUs ({before_label}: devices {', '.join(map(str, b))}; "
                        f"{after_label}: devices {', '.join(map(str, a))}): diff compares GPU by GPU, so both "
                        "need kernels on the same devices")
    return b


def diff_analyses(before: Analysis, after: Analysis, before_label: str = "before",
                  after_label: str = "after") -> TraceDiff:
    """The per-kernel and per-category differences of two analyses (see the module doc)."""
    if before.trace_meta.get("name_style") != after.trace_meta.get("name_style"):
        raise UserError("the two analyses name kernels differently (demangled against short)")
    if before.trace_meta.get("range_name") != after.trace_meta.get("range_name"):
        raise UserError("the two analyses cover different ranges "
                        f"({before.trace_meta.get('range_name')!r} against {after.trace_meta.get('range_name')!r})")
    devices = _devices(before, after, before_label, after_label)
    steps_b, steps_a = _steps(before), _steps(after)
    units = before.trace_meta.get("api_unit"), after.trace_meta.get("api_unit")
    notes = []
    if steps_b and steps_a and units[0] == units[1]:
        unit, per = units[0], (steps_b, steps_a)
    else:
        unit, per = "trace", (1, 1)
        missing = " and ".join(label for label, s in ((before_label, steps_b), (after_label, steps_a)) if not s)
        notes.append(f"no step ranges in {missing or 'one of them'}: whole traces compared, not per step")
    words = pair_words(before.trace_meta, after.trace_meta)
    if words.device == "CPU/GPU":
        notes.append("one trace is a CPU capture (CPU operators) and the other a GPU one (GPU kernels): "
                     "their times are not comparable")
    if before.backend != after.backend:
        notes.append(f"different capture backends ({before.backend} against {after.backend}): kernel names "
                     "and coverage may differ")
    warnings = [f"{label}: {w}" for label, side in ((before_label, before), (after_label, after)) for w in side.warnings]
    if devices is not None:
        return _diff_per_device(before, after, devices, unit, per,
                                TraceDiff(before_label, after_label, unit, per, None, None, None, notes, words,
                                          warnings, devices, range_name=before.trace_meta.get("range_name")))
    kernels = _joined(before.kernels, after.kernels, "kernel", per)[KERNEL_COLUMNS]
    categories = _joined(before.categories, after.categories, "category", per)[CATEGORY_COLUMNS]
    rows = [
        (f"{words.op} ms", before.trace_meta["kernel_total_ns"] / 1e6 / per[0],
         after.trace_meta["kernel_total_ns"] / 1e6 / per[1]),
        (words.units, before.trace_meta["kernel_count"] / per[0], after.trace_meta["kernel_count"] / per[1]),
        ("host launches", _launches(before, per[0], unit), _launches(after, per[1], unit)),
        (f"{words.device} busy % of span", _busy_pct(before), _busy_pct(after)),
    ]
    summary = pd.DataFrame(rows, columns=["metric", "before", "after"])
    summary["delta"] = summary["after"] - summary["before"]
    return TraceDiff(before_label, after_label, unit, per, kernels, categories, summary, notes, words, warnings,
                     range_name=before.trace_meta.get("range_name"))


def _diff_per_device(before: Analysis, after: Analysis, devices: list[int], unit: str, per: tuple[int, int],
                     diff: TraceDiff) -> TraceDiff:
    """Fill `diff`'s frames device by device; each device's divisors are the unit instances of the
    processes that launched its kernels (analysis device_steps), or 1 when the traces compare whole."""
    def device_steps(analysis: Analysis, device: int) -> int:
        return int((analysis.trace_meta.get("device_steps") or {}).get(device) or 0)

    if unit != "trace" and not all(device_steps(a, d) for a in (before, after) for d in devices):
        diff.notes.append("a GPU's kernels come from a process without step ranges: whole traces compared")
        unit, per = "trace", (1, 1)
        diff.unit, diff.steps = unit, per
    diff.device_steps = {d: (device_steps(before, d), device_steps(after, d)) if unit != "trace" else (1, 1)
                         for d in devices}
    kernels, categories, rows = {}, {}, []
    for d, pair in diff.device_steps.items():  # one iteration per GPU
        b_k, a_k = (a.kernels[a.kernels["device"] == d] for a in (before, after))
        b_c, a_c = (a.categories[a.categories["device"] == d] for a in (before, after))
        kernels[d] = _joined(b_k, a_k, "kernel", pair)[KERNEL_COLUMNS]
        categories[d] = _joined(b_c, a_c, "category", pair)[CATEGORY_COLUMNS]
        rows += [
            (d, "kernel ms", b_k["total_ns"].sum() / 1e6 / pair[0], a_k["total_ns"].sum() / 1e6 / pair[1]),
            (d, "kernels", b_k["instances"].sum() / pair[0], a_k["instances"].sum() / pair[1]),
            (d, "GPU busy % of span", _busy_pct(before, d), _busy_pct(after, d)),
        ]
    rows.append((-1, "host launches", _launches(before, per[0], unit), _launches(after, per[1], unit)))
    summary = pd.DataFrame(rows, columns=["device", "metric", "before", "after"])
    summary["before"] = summary["before"].astype("float64")
    summary["after"] = summary["after"].astype("float64")
    summary["delta"] = summary["after"] - summary["before"]
    diff.kernels, diff.categories, diff.summary = stack_devices(kernels), stack_devices(categories), summary
    return diff


def _fmt(x: float, digits: int = 3, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:+,.{digits}f}" if signed else f"{x:,.{digits}f}"


def render_diff(diff: TraceDiff, console: Console, top: int = 15) -> None:
    """Labels and unit, warnings and notes, the summary, then the kernel and category tables (one pair per
    GPU when the traces ran on several)."""
    per = f"per {diff.unit}"
    steps = f" ({diff.steps[0]} and {diff.steps[1]} of them)" if diff.unit != "trace" else ""
    console.print(f"[bold]before[/] {diff.before}\n[bold]after[/]  {diff.after}\nfigures {per}{steps}; "
                  "delta = after - before")
    if diff.device_steps and diff.unit != "trace" and set(diff.device_steps.values()) != {diff.steps}:
        console.print("per GPU: " + ", ".join(f"GPU {d} {b} and {a} {diff.unit}s" for d, (b, a) in diff.device_steps.items()))
    for warning in diff.warnings:
        console.print(f"[bold yellow]warning:[/] {warning}", highlight=False)
    for note in diff.notes:
        console.print(f"[yellow]note:[/] {note}")
    several = "device" in diff.summary
    t = Table(title=f"Summary ({per})")
    for c in (["device"] if several else []) + ["metric", "before", "after", "delta"]:
        t.add_column(c, justify="left" if c in ("device", "metric") else "right")
    w = diff.words
    for row in diff.summary.itertuples(index=False):
        digits = 3 if row.metric == f"{w.op} ms" else 1
        cells = [row.metric, _fmt(row.before, digits), _fmt(row.after, digits), _fmt(row.delta, digits, True)]
        t.add_row(*([("host" if row.device < 0 else f"{w.device} {row.device}")] if several else []), *cells)
    console.print(t)
    if not several:
        _render_kernel_tables(diff.kernels, diff.categories, per, console, top, w)
        return
    for device in diff.devices:  # one pair of tables per GPU
        one = [f[f["device"] == device].drop(columns="device").reset_index(drop=True) for f in (diff.kernels, diff.categories)]
        _render_kernel_tables(*one, per, console, top, w, title=f"GPU {device}: ")


def _render_kernel_tables(kernels: pd.DataFrame, categories: pd.DataFrame, per: str, console: Console, top: int,
                          w: DeviceWords, title: str = "") -> None:
    t = Table(title=f"{title}{w.units.capitalize()} by change of {w.device} ms {per} (n: instances {per})")
    # the numbers keep their width; the kernel name gets what is left of the console (at least 20)
    t.add_column(w.unit, no_wrap=True, max_width=max(20, min(80, console.width - 66)), overflow="ellipsis")
    for c in ("ms before", "ms after", "delta", "n before", "n after"):
        t.add_column(c, justify="right", no_wrap=True)
    numbers = [c for c in KERNEL_COLUMNS if c != "kernel"]
    for row in fold_tail(kernels, top, "kernel", numbers, noun=w.units).itertuples(index=False):
        t.add_row(escape(str(row.kernel)), _fmt(row.before_ms), _fmt(row.after_ms), _fmt(row.delta_ms, 3, True),
                  _fmt(row.before_n, 1), _fmt(row.after_n, 1))
    console.print(t)
    t = Table(title=f"{title}Categories by change of {w.device} ms {per}")
    for c in ("category", "ms before", "ms after", "delta"):
        t.add_column(c, justify="left" if c == "category" else "right")
    for row in categories.itertuples(index=False):
        t.add_row(str(row.category), _fmt(row.before_ms), _fmt(row.after_ms), _fmt(row.delta_ms, 3, True))
    console.print(t)


def diff_tables(out_dir, fmt: str, before, after, range_name: str | None) -> TableFiles:
    """Where write_diff puts the tables of `before` against `after` (scoped to range_name) in out_dir;
    `.check()` it before analyzing, so a refusal comes before the work."""
    origin = {"before_trace": trace_origin(before, out_dir), "after_trace": trace_origin(after, out_dir),
              "trace_range": range_name}
    return TableFiles(Path(out_dir), fmt, ["kernels", "categories", "summary"], origin, csv_prefix="diff_",
                      json_stem="diff")


def write_diff(diff: TraceDiff, out_dir, fmt: str = "csv", *, overwrite: bool = False, on_note=None) -> list[Path]:
    """diff_kernels / diff_categories / diff_summary as csv, or one diff.json with all three and the meta.
    Tables of a range carry it in their names (diff_kernels.range-backward.csv); every table names both
    traces (before_trace, after_trace: relative to out_dir; diff.before and diff.after are their paths)
    and the range (trace_range), and tables of other traces are not replaced without `overwrite` (see
    analyze.TableFiles)."""
    frames = {"kernels": diff.kernels, "categories": diff.categories, "summary": diff.summary}
    meta = {"before": diff.before, "after": diff.after, "unit": diff.unit, "steps": list(diff.steps), "notes": diff.notes,
            "warnings": diff.warnings, "devices": diff.devices}
    tables = diff_tables(out_dir, fmt, diff.before, diff.after, diff.range_name)
    return tables.write(frames, meta, overwrite=overwrite, on_note=on_note)
