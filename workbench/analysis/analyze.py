"""`swinbench analyze`: one trace file -> kernel / category / range / busy tables, rendered or written.

Layers: `load_trace` (parsing) -> the pure functions of workbench/analysis/frames.py -> `Analysis` (frames only)
-> `render_analysis` (rich) or `write_analysis` (csv / json, and timeline.png / timeline.json drawn by
timeline.py from the parsed frames the Analysis keeps). Nothing here reads a file except through
load_trace, and the renderers never see the trace file.

A trace with kernels on several GPUs gets its kernel, category, range and busy tables per device: each
frame has a leading `device` column and shares of that device's kernel time, and the renderer shows one
block of tables per GPU. A trace on one GPU has the tables without that column. The rows the parser
dropped as broken are in trace_meta["warnings"], shown above the tables and written into the JSON.
"""
from __future__ import annotations

import csv
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from workbench.analysis import frames as A
from workbench.analysis.findings import findings
from workbench.analysis.floors import kernel_floors
from workbench.analysis.timeline import TIMELINE_FILES, pick_step, timeline_origin, timeline_title, write_timeline
from workbench.errors import UserError
from workbench.labels import DeviceWords, trace_words
from workbench.files import atomic_write_text
from workbench.trace import Trace, load_trace
from workbench.trace.kineto import op_kernel_name

NAME_STYLES = {"demangled": "name", "short": "short_name", "op": "op_name"}
BACKENDS = {"nsys": "nsys", "kineto": "torch.profiler"}


@dataclass
class Analysis:
    """Frames of one analyzed trace. kernels: kernel_share_table; categories: category_share_table;
    ranges: range_table; busy: busy_idle (each with a leading `device` column when the kernels ran on
    several GPUs); api: api_table (host-side CUDA calls, whole trace); backend: 'nsys' | 'torch.profiler'.
    trace_meta is the trace's meta (notes, warnings) plus name_style, range_name, devices (the GPUs the
    tables cover), kernel_count, kernel_total_ns (all devices), memops (count, ns), api_scope, api_steps and
    api_unit ('step' | 'range instance' | None: what api.per_step is per), and with several devices
    device_steps ({device: unit instances in the processes that launched its kernels}), and floors (the
    summary of floors.kernel_floors) where `floors` is set. trace: the parsed
    trace the tables were built from (what timeline.py draws); never written."""

    trace_meta: dict
    kernels: pd.DataFrame
    categories: pd.DataFrame
    ranges: pd.DataFrame
    busy: pd.DataFrame
    backend: str
    api: pd.DataFrame = None
    trace: Trace | None = field(default=None, repr=False)
    floors: pd.DataFrame | None = None      # floors.kernel_floors, where the capture logged its launches

    @property
    def devices(self) -> list[int]:
        return list(self.trace_meta.get("devices", []))

    @property
    def warnings(self) -> list[str]:
        return list(self.trace_meta.get("warnings", []))


def _busy_over_instances(trace: Trace, kernels: pd.DataFrame, range_name: str) -> pd.DataFrame:
    """busy_idle summed over each instance of `range_name`, each over its own first-to-last kernel span,
    so the gaps between instances (other phases) do not count as idle."""
    instances = trace.ranges[trace.ranges["name"] == range_name]
    owner = A.range_instance_of(kernels, instances)
    parts = [A.busy_idle(group) for _, group in kernels.groupby(owner, sort=False)]  # one per instance
    ns = np.sum([p["ns"].to_numpy() for p in parts], axis=0)
    span = ns[0]
    return pd.DataFrame({"metric": parts[0]["metric"], "ns": ns, "pct": ns * 100.0 / span if span else 0.0 * ns})


def _with_op_names(kernels: pd.DataFrame) -> pd.DataFrame:
    """kernels with an op_name column (trace.kineto.op_kernel_name of each demangled name)."""
    codes, uniques = pd.factorize(kernels["name"])
    return kernels.assign(op_name=np.asarray([op_kernel_name(u) for u in uniques], dtype=object)[codes])


def kernels_by(analysis: Analysis, name_style: str) -> pd.DataFrame:
    """analysis's kernel table over the same kernels (its range's, per GPU where there are several), grouped
    by `name_style`'s names instead of its own."""
    trace, range_name = analysis.trace, analysis.trace_meta.get("range_name")
    kernels = A.kernels_in_range(trace, range_name) if range_name is not None else trace.kernels
    kernels = _with_op_names(kernels) if name_style == "op" else kernels
    column = NAME_STYLES[name_style]
    if "device" in analysis.kernels:
        return A.stack_devices({int(d): A.kernel_share_table(k, column)
                                for d, k in kernels.groupby("device_id", sort=True)})
    return A.kernel_share_table(kernels, column)


def analyze_trace(path, *, name_style: str = "demangled", range_name: str | None = None) -> Analysis:
    """Parse `path` and build every table. `name_style`: 'demangled' (full C++ name), 'short' (nsys's
    shortName) or 'op' (the short name with the op of PyTorch's generic kernels: trace.kineto.op_kernel_name).
    `range_name`: restrict everything to kernels launched inside that NVTX / record_function
    range (all its instances); shares are then of that range's kernel time."""
    if name_style not in NAME_STYLES:
        raise UserError(f"unknown name style {name_style!r}: use one of {', '.join(NAME_STYLES)}")
    trace = load_trace(path)
    kernels = trace.kernels
    if range_name is not None:
        kernels = A.kernels_in_range(trace, range_name)
        if kernels.empty:
            words = trace_words(trace.meta)   # a CPU capture's range runs operators, it launches no kernels
            raise UserError(f"range {range_name!r} {'ran' if words.is_cpu else 'launched'} no {words.device} "
                            f"{words.units}")
    kernels = _with_op_names(kernels) if name_style == "op" else kernels

    def tables(k: pd.DataFrame) -> dict[str, pd.DataFrame]:
        busy = _busy_over_instances(trace, k, range_name) if range_name is not None else A.busy_idle(k)
        return {"kernels": A.kernel_share_table(k, NAME_STYLES[name_style]), "categories": A.category_share_table(k),
                "ranges": A.range_table(trace, kernels=k), "busy": busy}

    devices = sorted(int(d) for d in kernels["device_id"].unique())
    if len(devices) > 1:
        per = {int(d): tables(k) for d, k in kernels.groupby("device_id", sort=True)}  # one iteration per GPU
        frames = {name: A.stack_devices({d: t[name] for d, t in per.items()}) for name in per[devices[0]]}
    else:
        frames = tables(kernels)
    meta = dict(trace.meta)
    meta["warnings"] = list(meta.get("warnings", []))
    meta.update(
        name_style=name_style,
        range_name=range_name,
        devices=devices,
        kernel_count=int(A.instance_rows(kernels).sum()),
        kernel_total_ns=int(kernels["duration_ns"].sum()),
        memops_count=int(len(trace.memops)),
        memops_ns=int(trace.memops["duration_ns"].sum()),
    )
    meta["notes"] = list(meta.get("notes", []))
    if len(trace.memops):
        meta["notes"].append(
            f"{len(trace.memops)} memcpy/memset activities ({meta['memops_ns'] / 1e6:.3f} ms) are not kernels: "
            "not in the kernel, category or busy figures"
        )
    windows, unit, scope = _unit_windows(trace, range_name)
    api, api_meta = _scoped_api(trace, windows, unit, scope)
    meta.update(api_meta)
    # the host's kernel launches over the kernels' own scope (the whole trace, or the range's instances):
    # what diff compares when it compares whole traces (one side without steps)
    meta["host_launches"] = None
    if trace.api is not None and len(trace.api):
        # the table above already counts what it should where it holds a range's instances or all calls
        launches = api if range_name is not None or not len(windows) else A.api_table(trace.api)
        meta["host_launches"] = float(launches.loc[launches["kind"] == "launch", "calls"].sum())
    if len(devices) > 1:
        meta["device_steps"] = {int(d): int(windows["pid"].isin(k["pid"].unique()).sum())
                                for d, k in kernels.groupby("device_id", sort=True)}
    floors = None
    if trace.launches is not None and range_name is None and len(devices) == 1:
        floors, meta["floors"] = kernel_floors(kernels, trace.launches)
    return Analysis(
        trace_meta=meta,
        **frames,
        backend=BACKENDS.get(trace.meta.get("source"), str(trace.meta.get("source"))),
        api=api,
        trace=trace,
        floors=floors,
    )


def _unit_windows(trace: Trace, range_name: str | None) -> tuple[pd.DataFrame, str, str]:
    """(ranges, unit, scope in words) that figures are per: `range_name`'s instances when given, else the
    `step{i}` ranges (warm-up and the capture's setup excluded)."""
    ranges = trace.ranges
    if range_name is not None:
        windows = ranges[ranges["name"] == range_name]
        return windows, "range instance", f"inside {len(windows)} {range_name!r} ranges"
    windows = ranges[ranges["name"].str.match(A.STEP_RANGE)] if len(ranges) else ranges
    return windows, "step", f"inside {len(windows)} step ranges"


def _scoped_api(trace: Trace, windows: pd.DataFrame, unit: str, scope: str) -> tuple[pd.DataFrame, dict]:
    """(api_table, meta) for the host's CUDA calls inside `windows` (_unit_windows), else over the whole
    trace when there are none. meta: api_scope (words), api_steps (instances counted per, or None) and
    api_unit ('range instance' | 'step' | None)."""
    if not len(windows):
        return A.api_table(trace.api), {"api_scope": "whole trace", "api_steps": None, "api_unit": None}
    table = A.api_table(A.calls_in_windows(trace.api, windows), len(windows))
    return table, {"api_scope": scope, "api_steps": len(windows), "api_unit": unit}


def category_shares(analysis: Analysis) -> dict[str, float]:
    """{category: share_pct}, largest first; of all GPUs' kernel time together when there are several."""
    cats = analysis.categories
    if "device" in cats:
        total = cats.groupby("category", sort=False)["total_ns"].sum().sort_values(ascending=False, kind="stable")
        return {str(c): float(ns) * 100.0 / float(total.sum()) for c, ns in total.items()} if total.sum() else {}
    return {str(c): float(s) for c, s in zip(cats["category"], cats["share_pct"])}


# --- rendering -------------------------------------------------------------------------------------------

def _ms(ns) -> str:
    return "" if ns is None or (isinstance(ns, float) and math.isnan(ns)) else f"{ns / 1e6:,.3f}"


def _us(ns) -> str:
    return "" if ns is None or (isinstance(ns, float) and math.isnan(ns)) else f"{ns / 1e3:,.1f}"


def _pct(x) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"


def _clip(text: str, width: int = 100) -> str:
    """A name for a table cell: at most `width` characters, its brackets shown as they are (C++ lambdas
    '[lambda() (instance 3)]' and op names '[add bf16]' are not rich markup)."""
    return escape(text if len(text) <= width else text[: width - 1] + "…")


def _header(analysis: Analysis) -> str:
    m = analysis.trace_meta
    version = m.get("export_version") or (f"schema {m['schema_version']}" if m.get("schema_version") else "")
    span_ns = (m.get("span_end_ns") or 0) - (m.get("span_start_ns") or 0)
    parts = [
        f"[bold]{analysis.backend}[/bold]{' ' + version if version else ''}",
        f"trace {m.get('path')}",
        f"{'trace span' if m.get('range_name') else 'span'} {span_ns / 1e6:,.3f} ms",   # a range's own: busy table
        f"{m.get('kernel_count', 0):,} {trace_words(m).units}, {m.get('kernel_total_ns', 0) / 1e6:,.3f} ms",
    ]
    if len(m.get("devices") or []) > 1:
        parts.append(f"{len(m['devices'])} GPUs (devices {', '.join(map(str, m['devices']))})")
    if m.get("gpus"):
        parts.append(", ".join(sorted(set(m["gpus"]))))
    if m.get("range_name"):
        parts.append(f"range {m['range_name']!r}")
    return " · ".join(parts)


def render_analysis(analysis: Analysis, console: Console, top: int = 15, gains=None,
                    names: str | None = None) -> None:
    """Header line (backend, trace path, span, GPUs), warnings and notes, then the kernel, category, range
    and busy tables (one block of them per GPU when there are several), then the host's CUDA calls, then
    the findings (workbench/analysis/findings.py, with the measured `gains` of their remedies); long
    tails are folded into one 'other (k ...)' row with exact sums. names: print the kernel table grouped
    by this name style (NAME_STYLES) instead of the analysis's own."""
    console.print(_header(analysis))
    # A CPU-only Kineto trace is analyzed on its CPU operators' self time: say so in every title.
    words = trace_words(analysis.trace_meta)
    for warning in analysis.warnings:
        console.print(f"[bold yellow]warning:[/] {warning}", highlight=False)
    for note in analysis.trace_meta.get("notes", []):
        console.print(f"[yellow]note:[/yellow] {note}")
    meta = analysis.trace_meta
    kernels = analysis.kernels
    if names is not None and names != meta.get("name_style"):
        kernels, meta = kernels_by(analysis, names), {**meta, "name_style": names}
    frames = (kernels, analysis.categories, analysis.ranges, analysis.busy)
    if "device" in analysis.kernels:
        for device in analysis.devices:  # one block of tables per GPU
            console.rule(f"GPU {device}", align="left")
            one = [f[f["device"] == device].drop(columns="device").reset_index(drop=True) for f in frames]
            _render_tables(*one, meta, console, top, words, title=f"GPU {device}: ")
    else:
        _render_tables(*frames, meta, console, top, words)
    _render_api(analysis, console, top)
    _render_floors(analysis, console, top)
    _render_findings(analysis, console, gains)


def _render_floors(analysis: Analysis, console: Console, top: int) -> None:
    """swinbench's kernels against their memory floor (floors.py), most time per step first."""
    summary = analysis.trace_meta.get("floors")
    if not summary:
        return
    if summary.get("note"):
        console.print(f"[yellow]note:[/yellow] {summary['note']}")
        return
    t = Table(title=f"swinbench's kernels against their memory floor (argument bytes at {summary['peak_gbps']:,.0f} "
                    f"GB/s, {summary['device_name']}): {summary['kernel_us_per_step'] / 1e3:,.3f} ms per step, "
                    f"{summary['floor_us_per_step'] / 1e3:,.3f} ms at the floor", title_justify="left")
    for col in ("kernel", "largest argument", "calls/step", "med µs", "floor µs", "% of floor", "GB/s", "µs/step"):
        t.add_column(col, justify="left" if col in ("kernel", "largest argument") else "right")
    for row in analysis.floors.head(top).itertuples(index=False):
        t.add_row(_clip(str(row.kernel)), str(row.largest_argument), f"{row.calls_per_step:,.0f}", f"{row.median_us:,.1f}",
                  f"{row.floor_us:,.1f}", _pct(row.floor_pct), f"{row.achieved_gbps:,.0f}", f"{row.us_per_step:,.1f}")
    console.print(t)
    if len(analysis.floors) > top:
        console.print(f"({len(analysis.floors) - top} more rows in floors.csv)")
    if summary.get("forced_eager"):
        console.print("[yellow]note:[/yellow] the stage compiles: Inductor launched these kernels; their argument "
                      "bytes are those of one step run with torch.compile forced eager (the same kernels, the same "
                      "shapes)")
    if summary.get("unmatched"):
        console.print("[yellow]note:[/yellow] no floor for " + "; ".join(
            f"{k} ({v})" for k, v in summary["unmatched"].items()), highlight=False)


def _render_findings(analysis: Analysis, console: Console, gains=None) -> None:
    """The findings (workbench/analysis/findings.py), ranked by time per step, and how their time is split."""
    table = findings(analysis, gains)
    if table.empty:
        return
    unit = analysis.trace_meta.get("api_unit") or "trace"
    t = Table(title=f"findings, ranked by ms per {unit} (idle + categories = span; small "
                    f"{trace_words(analysis.trace_meta).units} are inside the categories, marked *)", title_justify="left")
    for col in ["#", *(["GPU"] if "device" in table else []), "ms", "% span", "finding", "remedy", "measured gain"]:
        t.add_column(col, justify="left" if col in ("finding", "remedy", "measured gain") else "right")
    for row in table.itertuples(index=False):
        what = f"{row.kind}: {row.what}" + (f" ({row.note})" if row.note else "")
        t.add_row(f"{row.rank}{'' if row.partition else '*'}", *([str(row.device)] if "device" in table else []),
                  f"{row.ms_per_step:,.3f}", _pct(row.share_pct), escape(what), escape(str(row.remedy)),
                  escape(str(row.gain)))
    console.print(t)



def _render_tables(kernels: pd.DataFrame, categories: pd.DataFrame, ranges: pd.DataFrame, busy: pd.DataFrame,
                   meta: dict, console: Console, top: int, words: DeviceWords, title: str = "") -> None:
    """The kernel, category, range and busy tables of one device; `title` goes before each table's title."""
    unit, units = words.device, words.units
    kernels = A.fold_tail(kernels, top, "kernel", ["instances", "total_ns", "share_pct"], noun=units)
    t = Table(title=f"{title}{unit} {units} ({meta.get('name_style', 'demangled')} names)", title_justify="left")
    for col, kw in [("share %", {"justify": "right"}), ("total ms", {"justify": "right"}), ("count", {"justify": "right"}),
                    ("avg µs", {"justify": "right"}), ("med µs", {"justify": "right"}), (words.unit, {"overflow": "fold"})]:
        t.add_column(col, **kw)
    for row in kernels.itertuples(index=False):  # at most top + 1 rows
        t.add_row(_pct(row.share_pct), _ms(row.total_ns), f"{row.instances:,}", _us(row.avg_ns), _us(row.med_ns), _clip(str(row.kernel)))
    console.print(t)

    t = Table(title=f"{title}categories", title_justify="left")
    for col in ("share %", "total ms", "count", "category"):
        t.add_column(col, justify="left" if col == "category" else "right")
    for row in categories.itertuples(index=False):
        t.add_row(_pct(row.share_pct), _ms(row.total_ns), f"{row.instances:,}", str(row.category))
    console.print(t)

    if not ranges.empty:
        ranges = A.fold_tail(ranges, top, "range", ["instances", "kernels"], noun="ranges")
        t = Table(title=f"{title}ranges ({unit} time of the {units} each launched; nested ranges inclusive)",
                  title_justify="left")
        for col in ("share %", f"{unit} ms", "avg ms", "instances", units, "range"):
            t.add_column(col, justify="left" if col == "range" else "right")
        for row in ranges.itertuples(index=False):
            t.add_row(_pct(row.share_pct), _ms(row.gpu_ns), _ms(row.avg_gpu_ns), f"{row.instances:,}", f"{row.kernels:,}", _clip(str(row.range)))
        console.print(t)

    t = Table(title=f"{title}{unit} busy / idle ({units})", title_justify="left")
    for col in ("metric", "ms", "% of span"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    for row in busy.itertuples(index=False):
        metric = f"{words.op}_sum" if row.metric == "kernel_sum" else str(row.metric)
        t.add_row(metric, _ms(row.ns), _pct(row.pct))
    console.print(t)


def _render_api(analysis: Analysis, console: Console, top: int) -> None:
    """The host's CUDA API calls (whole trace, not per device) and the blocking-calls note."""
    if analysis.api is not None and len(analysis.api):
        m = analysis.trace_meta
        # without step (or range) instances the calls are of the whole trace: no per-unit column
        per = f"per {m['api_unit']}" if m.get("api_unit") else None
        api = A.fold_tail(analysis.api, min(top, 10), "call", ["calls", "per_step", "total_ns", "share_pct"], noun="names")
        t = Table(title=f"CUDA API calls on the host ({m.get('api_scope')})", title_justify="left")
        for col in ("call", "kind", "calls", *([per] if per else []), "total ms", "avg µs", "max µs", "share %"):
            t.add_column(col, justify="left" if col in ("kind", "call") else "right", no_wrap=col == "call")
        for row in api.itertuples(index=False):
            kind = row.kind if isinstance(row.kind, str) else ""
            per_step = [] if not per else ["" if row.per_step is None or math.isnan(row.per_step) else f"{row.per_step:,.1f}"]
            t.add_row(str(row.call), kind, f"{row.calls:,.0f}", *per_step, _ms(row.total_ns), _us(row.avg_ns),
                      _us(row.max_ns), _pct(row.share_pct))
        console.print(t)
        blocking = A.blocking_calls(A.api_summary(analysis.api))
        if blocking:
            console.print(f"[yellow]note:[/yellow] {blocking:,.{1 if per else 0}f} synchronizing or allocating "
                          f"CUDA calls {per or 'in the trace'} "
                          "(cudaStreamSynchronize, cudaMalloc, ...): each one can stall the launch queue and "
                          "leave the GPU idle")


# --- files -----------------------------------------------------------------------------------------------

def _records(df: pd.DataFrame) -> list[dict]:
    return json.loads(df.to_json(orient="records"))


def tables_suffix(range_name: str | None) -> str:
    """What a table's file name carries between its name and extension: '' for a whole trace,
    '.range-<name>' for tables of one NVTX range (characters a file name cannot hold become '_')."""
    if range_name is None:
        return ""
    return ".range-" + (re.sub(r"[^A-Za-z0-9._-]+", "_", range_name).strip(".") or "_")


def trace_origin(trace, out_dir) -> str:
    """How a table in `out_dir` names the trace it was made from: its path relative to out_dir (so a
    folder of tables can move with its trace), or absolute when there is no relative path."""
    try:
        return os.path.relpath(Path(trace).resolve(), Path(out_dir).resolve())
    except ValueError:
        return str(Path(trace).resolve())


def _origin_of(path: Path, keys: list[str]) -> dict | None:
    """The origin (trace, range) an existing table file names: {key: value}; {} for a CSV with the origin
    columns but no rows (nothing to lose); None when the file names none (written by an older swinbench,
    or not a table of ours) or cannot be read."""
    try:
        if path.suffix == ".json":
            doc = json.loads(path.read_text())
            if not isinstance(doc, dict) or not all(k in doc for k in keys):
                return None
            return {k: doc[k] or "" for k in keys}
        with open(path, newline="") as fh:
            reader = csv.DictReader(fh)
            if not reader.fieldnames or not all(k in reader.fieldnames for k in keys):
                return None
            row = next(reader, None)
            return {} if row is None else {k: row[k] or "" for k in keys}
    except (OSError, UnicodeDecodeError, ValueError, csv.Error):
        return None


@dataclass
class TableFiles:
    """The files one set of tables is written to, and what they are of.

    csv: `<out>/<csv_prefix><name><suffix>.csv` per table name; json: `<out>/<json_stem><suffix>.json`
    holding them all. suffix: tables_suffix(origin['trace_range']). origin ({'trace': trace_origin(...),
    'trace_range': range or None}; a diff has before_trace and after_trace) is written into every table:
    as its last CSV columns, as top-level JSON keys. Rewriting tables of the same origin is fine; tables
    of another origin, or naming none, are not replaced without `overwrite` (which moves them aside into
    `<out>/previous-<their time>/`). timeline: timeline.png and timeline.json (timeline.py) come with the
    tables; they are of the trace, not of a range, so a timeline of the same trace is rewritten whatever
    the range, and one of another trace is in the way as tables are."""

    out: Path
    fmt: str
    names: list[str]
    origin: dict[str, str | None]
    csv_prefix: str = ""
    json_stem: str = "analysis"
    timeline: bool = False

    def paths(self) -> dict[str, Path]:
        suffix = tables_suffix(self.origin.get("trace_range"))
        if self.fmt == "json":
            return {"*": self.out / f"{self.json_stem}{suffix}.json"}
        return {name: self.out / f"{self.csv_prefix}{name}{suffix}.csv" for name in self.names}

    def timeline_paths(self) -> list[Path]:
        return [self.out / name for name in TIMELINE_FILES] if self.timeline else []

    def _ours(self) -> dict[str, str]:
        return {k: "" if v is None else str(v) for k, v in self.origin.items()}

    def _in_the_way(self) -> list[Path]:
        """Existing files of another origin (or naming none) where these tables or their timeline go."""
        ours = self._ours()
        tables = [p for p in self.paths().values() if p.exists() and _origin_of(p, list(ours)) not in ({}, ours)]
        return tables + [p for p in self.timeline_paths() if p.exists() and timeline_origin(p) != ours["trace"]]

    def _what(self, path: Path) -> str:
        """What the file in the way holds, in words."""
        if path in self.timeline_paths():
            theirs = timeline_origin(path)
            return f"the timeline of another trace ({theirs!r})" if theirs else "a timeline that does not name its trace"
        theirs = _origin_of(path, list(self._ours()))
        return (f"tables of another trace or range ({', '.join(f'{k} {v!r}' for k, v in theirs.items() if v)})"
                if theirs else "tables that do not name their trace")

    def check(self, overwrite: bool = False) -> list[Path]:
        """Before any work: UserError (one line) when the folder cannot take the tables, or tables of
        another origin are in the way and `overwrite` is not given -> the paths in the way."""
        if self.fmt not in ("csv", "json"):
            raise UserError(f"unknown output format {self.fmt!r}: use csv or json")
        from workbench.run_folder import check_writable_folder, refuse_records_folder

        check_writable_folder(self.out)
        refuse_records_folder(self.out)
        others = self._in_the_way()
        if others and not overwrite:
            raise UserError(f"{others[0]} holds {self._what(others[0])}; nothing was written: --overwrite moves "
                            "them aside, or choose another --out")
        return others

    def write(self, frames: dict[str, pd.DataFrame], meta: dict, *, overwrite: bool = False,
              on_note=None) -> list[Path]:
        """Write `frames` (keys: self.names), each file atomically, after check(); a JSON file holds `meta`
        and every frame as a list of records (NaN as null). on_note(line) hears where tables in the way
        were moved. Returns the paths written."""
        if self.check(overwrite):
            from workbench.run_folder import move_aside, newest_time_tag

            existing = [p for p in [*self.paths().values(), *self.timeline_paths()] if p.exists()]
            dest = move_aside(existing, self.out / f"previous-{newest_time_tag(existing)}")
            if on_note:
                on_note(f"moved the earlier tables aside to {dest}")
        ours = self._ours()
        paths = self.paths()
        if self.fmt == "json":
            doc = {**meta, **ours, **{k: _records(v) for k, v in frames.items()}}
            return [atomic_write_text(paths["*"], json.dumps(doc, indent=1, default=str))]
        return [atomic_write_text(paths[name], df.assign(**ours).to_csv(index=False)) for name, df in frames.items()]


ANALYSIS_TABLES = ["kernels", "categories", "ranges", "busy", "api", "findings", "floors"]


def analysis_tables(out_dir, fmt: str, trace, range_name: str | None, timeline: bool = False) -> TableFiles:
    """Where write_analysis puts the tables of `trace` (scoped to range_name), and with `timeline` its
    timeline files, in out_dir; `.check()` it before analyzing, so a refusal comes before the work."""
    origin = {"trace": trace_origin(trace, out_dir), "trace_range": range_name}
    return TableFiles(Path(out_dir), fmt, ANALYSIS_TABLES, origin, json_stem="analysis", timeline=timeline)


def write_analysis(analysis: Analysis, out_dir, fmt: str = "csv", *, trace=None, overwrite: bool = False,
                   on_note=None, timeline: bool = False, step: int | str | None = None,
                   title: str | None = None, gains=None) -> list[Path]:
    """csv: kernels.csv, categories.csv, ranges.csv, busy.csv, api.csv, findings.csv (and floors.csv where the
    capture logged its launches; of a CPU capture ranges.csv says operators, cpu_ns and avg_cpu_ns for
    kernels, gpu_ns and avg_gpu_ns); json: one analysis.json with every
    frame as a list of records plus backend and meta. Tables of one range carry it in their names
    (kernels.range-backward.csv); every table names its trace (`trace`, relative to out_dir; default the
    path the analysis was read from) and range (`trace_range`, empty for the whole trace), and tables of
    another trace are not replaced without `overwrite` (see TableFiles). With `timeline`, also
    timeline.png (the step `step`, default the median one, under `title`, default timeline_title) and
    timeline.json (Perfetto) of the whole trace (timeline.write_timeline). gains: the measured gains of
    the findings' remedies (findings.findings). Returns the paths written."""
    ranges = analysis.ranges
    if analysis.trace_meta.get("device") == "cpu":    # a CPU capture times operators, not GPU kernels
        ranges = ranges.rename(columns={"kernels": "operators", "gpu_ns": "cpu_ns", "avg_gpu_ns": "avg_cpu_ns"})
    frames = {"kernels": analysis.kernels, "categories": analysis.categories, "ranges": ranges, "busy": analysis.busy}
    if analysis.api is not None:
        frames["api"] = analysis.api
    frames["findings"] = findings(analysis, gains)
    if analysis.floors is not None:
        frames["floors"] = analysis.floors
    source = trace if trace is not None else analysis.trace_meta.get("path")
    draw = timeline and analysis.trace is not None
    if draw:
        pick_step(analysis.trace, step)   # a step the trace lacks is refused before anything is written
    tables = analysis_tables(out_dir, fmt, source, analysis.trace_meta.get("range_name"), timeline=draw)
    paths = tables.write(frames, {"backend": analysis.backend, "meta": analysis.trace_meta}, overwrite=overwrite,
                         on_note=on_note)
    if draw:
        paths += write_timeline(analysis.trace, out_dir, title=title or timeline_title(source),
                                origin=tables.origin["trace"], step=step, on_note=on_note)
    return paths
