"""`swinbench analyze`: one trace file -> kernel / category / range / busy tables, rendered or written.

Layers: `load_trace` (parsing) -> the pure functions of workbench/analysis.py -> `Analysis` (frames only)
-> `render_analysis` (rich) or `write_analysis` (csv / json). Nothing here reads a file except through
load_trace, and the renderers never see the trace.

A trace with kernels on several GPUs gets its kernel, category, range and busy tables per device: each
frame has a leading `device` column and shares of that device's kernel time, and the renderer shows one
block of tables per GPU. A trace on one GPU has the tables without that column. The rows the parser
dropped as broken are in trace_meta["warnings"], shown above the tables and written into the JSON.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

from workbench import analysis as A
from workbench.errors import UserError
from workbench.labels import DeviceWords, trace_words
from workbench.trace import Trace, load_trace

NAME_STYLES = {"demangled": "name", "short": "short_name"}
BACKENDS = {"nsys": "nsys", "kineto": "torch.profiler"}


@dataclass
class Analysis:
    """Frames of one analyzed trace. kernels: kernel_share_table; categories: category_share_table;
    ranges: range_table; busy: busy_idle (each with a leading `device` column when the kernels ran on
    several GPUs); api: api_table (host-side CUDA calls, whole trace); backend: 'nsys' | 'torch.profiler'.
    trace_meta is the trace's meta (notes, warnings) plus name_style, range_name, devices (the GPUs the
    tables cover), kernel_count, kernel_total_ns (all devices), memops (count, ns), api_scope, api_steps and
    api_unit ('step' | 'range instance' | None: what api.per_step is per), and with several devices
    device_steps ({device: unit instances in the processes that launched its kernels})."""

    trace_meta: dict
    kernels: pd.DataFrame
    categories: pd.DataFrame
    ranges: pd.DataFrame
    busy: pd.DataFrame
    backend: str
    api: pd.DataFrame = None

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


def analyze_trace(path, *, name_style: str = "demangled", range_name: str | None = None) -> Analysis:
    """Parse `path` and build every table. `name_style`: 'demangled' (full C++ name) or 'short' (nsys's
    shortName). `range_name`: restrict everything to kernels launched inside that NVTX / record_function
    range (all its instances); shares are then of that range's kernel time."""
    if name_style not in NAME_STYLES:
        raise UserError(f"unknown name style {name_style!r}: use one of {', '.join(NAME_STYLES)}")
    trace = load_trace(path)
    kernels = trace.kernels
    if range_name is not None:
        kernels = A.kernels_in_range(trace, range_name)
        if kernels.empty:
            raise UserError(f"range {range_name!r} launched no GPU kernels")

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
        kernel_count=int(len(kernels)),
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
    if len(devices) > 1:
        meta["device_steps"] = {int(d): int(windows["pid"].isin(k["pid"].unique()).sum())
                                for d, k in kernels.groupby("device_id", sort=True)}
    return Analysis(
        trace_meta=meta,
        **frames,
        backend=BACKENDS.get(trace.meta.get("source"), str(trace.meta.get("source"))),
        api=api,
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
    return text if len(text) <= width else text[: width - 1] + "…"


def _header(analysis: Analysis) -> str:
    m = analysis.trace_meta
    version = m.get("export_version") or (f"schema {m['schema_version']}" if m.get("schema_version") else "")
    span_ns = (m.get("span_end_ns") or 0) - (m.get("span_start_ns") or 0)
    parts = [
        f"[bold]{analysis.backend}[/bold]{' ' + version if version else ''}",
        f"trace {m.get('path')}",
        f"span {span_ns / 1e6:,.3f} ms",
        f"{m.get('kernel_count', 0):,} {trace_words(m).units}, {m.get('kernel_total_ns', 0) / 1e6:,.3f} ms",
    ]
    if len(m.get("devices") or []) > 1:
        parts.append(f"{len(m['devices'])} GPUs (devices {', '.join(map(str, m['devices']))})")
    if m.get("gpus"):
        parts.append(", ".join(sorted(set(m["gpus"]))))
    if m.get("range_name"):
        parts.append(f"range {m['range_name']!r}")
    return " · ".join(parts)


def render_analysis(analysis: Analysis, console: Console, top: int = 15) -> None:
    """Header line (backend, trace path, span, GPUs), warnings and notes, then the kernel, category, range
    and busy tables (one block of them per GPU when there are several), then the host's CUDA calls; long
    tails are folded into one 'other (k ...)' row with exact sums."""
    console.print(_header(analysis))
    # A CPU-only Kineto trace is analyzed on its leaf CPU operators: say so in every title.
    words = trace_words(analysis.trace_meta)
    for warning in analysis.warnings:
        console.print(f"[bold yellow]warning:[/] {warning}", highlight=False)
    for note in analysis.trace_meta.get("notes", []):
        console.print(f"[yellow]note:[/yellow] {note}")
    frames = (analysis.kernels, analysis.categories, analysis.ranges, analysis.busy)
    if "device" in analysis.kernels:
        for device in analysis.devices:  # one block of tables per GPU
            console.rule(f"GPU {device}", align="left")
            one = [f[f["device"] == device].drop(columns="device").reset_index(drop=True) for f in frames]
            _render_tables(*one, analysis.trace_meta, console, top, words, title=f"GPU {device}: ")
    else:
        _render_tables(*frames, analysis.trace_meta, console, top, words)
    _render_api(analysis, console, top)



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
            t.add_row(_pct(row.share_pct), _ms(row.gpu_ns), _ms(row.avg_gpu_ns), f"{row.instances:,}", f"{row.kernels:,}", str(row.range))
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
        per = f"per {m['api_unit']}" if m.get("api_unit") else "calls"
        api = A.fold_tail(analysis.api, min(top, 10), "call", ["calls", "per_step", "total_ns", "share_pct"], noun="names")
        t = Table(title=f"CUDA API calls on the host ({m.get('api_scope')})", title_justify="left")
        for col in ("call", "kind", "calls", per, "total ms", "avg µs", "max µs", "share %"):
            t.add_column(col, justify="left" if col in ("kind", "call") else "right", no_wrap=col == "call")
        for row in api.itertuples(index=False):
            kind = row.kind if isinstance(row.kind, str) else ""
            per_step = "" if row.per_step is None or math.isnan(row.per_step) else f"{row.per_step:,.1f}"
            t.add_row(str(row.call), kind, f"{row.calls:,.0f}", per_step, _ms(row.total_ns), _us(row.avg_ns),
                      _us(row.max_ns), _pct(row.share_pct))
        console.print(t)
        blocking = A.blocking_calls(A.api_summary(analysis.api))
        if blocking:
            console.print(f"[yellow]note:[/yellow] {blocking:,.1f} synchronizing or allocating CUDA calls {per} "
                          "(cudaStreamSynchronize, cudaMalloc, ...): each one can stall the launch queue and "
                          "leave the GPU idle")


# --- files -----------------------------------------------------------------------------------------------

def _records(df: pd.DataFrame) -> list[dict]:
    return json.loads(df.to_json(orient="records"))


def write_frames(frames: dict[str, pd.DataFrame], out_dir, fmt: str, *, csv_prefix: str = "",
                 json_name: str, meta: dict) -> list[Path]:
    """csv: one `<csv_prefix><name>.csv` per frame; json: one `json_name` holding `meta` and every frame
    as a list of records (NaN as null). Returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "csv":
        paths = []
        for name, df in frames.items():
            path = out / f"{csv_prefix}{name}.csv"
            df.to_csv(path, index=False)
            paths.append(path)
        return paths
    if fmt == "json":
        path = out / json_name
        doc = {**meta, **{k: _records(v) for k, v in frames.items()}}
        path.write_text(json.dumps(doc, indent=1, default=str))
        return [path]
    raise UserError(f"unknown output format {fmt!r}: use csv or json")


def write_analysis(analysis: Analysis, out_dir, fmt: str = "csv") -> list[Path]:
    """csv: kernels.csv, categories.csv, ranges.csv, busy.csv, api.csv; json: one analysis.json with every
    frame as a list of records plus backend and meta. Returns the paths written."""
    frames = {"kernels": analysis.kernels, "categories": analysis.categories, "ranges": analysis.ranges, "busy": analysis.busy}
    if analysis.api is not None:
        frames["api"] = analysis.api
    return write_frames(frames, out_dir, fmt, json_name="analysis.json",
                        meta={"backend": analysis.backend, "meta": analysis.trace_meta})
