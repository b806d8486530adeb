"""A picture of one step, and every captured step for Perfetto: trace frames -> `timeline.png`, `timeline.json`.

`step_view(trace, step)` picks one `step{i}` NVTX range (default: the median-length step; with an even
count, the shorter of the middle two) and keeps what happened in it: the kernels running in it, the NVTX
ranges, the host's CUDA API calls per thread. `render_timeline_png(view, title)` draws it:

- NVTX rows on top, one per (thread, nesting depth), each range a labelled block;
- one GPU row per (device, stream): kernels coloured by category (workbench/analysis/categories.py);
- one host row per thread below: its CUDA runtime / driver calls, coloured by kind (launch, synchronize,
  allocation, copy/set, other; frames.api_kind). Autograd launches the backward's kernels from its own
  thread, so a training step has two launching threads.

Dense rows (a Swin-B step is ~1,600 kernels on ~1,400 pixels) are drawn per pixel column, not per bar:
each column is a bar stacked from the categories running in it, each as tall as the share of the column
it covers (at least MIN_SEGMENT of the row). So the shortest kernel still shows, an idle GPU still looks
idle, and the colours stay those of the legend. No kernel is labelled.

`perfetto_trace(trace)` is the Chrome trace-event JSON (`traceEvents`) that ui.perfetto.dev and
chrome://tracing open: kernels and memcpy/memset on a GPU process ("GPU 0", one track per stream), NVTX ranges
and CUDA API calls on their host process and thread, a flow arrow from each launch to its kernel. It holds
the captured steps (kernels by launch time, like the range attribution of frames.py), whole steps up to
MAX_EVENTS events; what it leaves out is said in `otherData.left_out`. Timestamps are microseconds from
the first event of the trace.

`write_timeline` writes both files. Each names its trace (PNG text chunk and JSON key `trace`), so that
the analyze command can refuse to replace the pictures of another trace (analyze.TableFiles).
"""
from __future__ import annotations

import io
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from workbench.analysis import frames as A
from workbench.analysis.categories import CATEGORIES, categorize
from workbench.errors import UserError
from workbench.files import atomic_write_bytes, atomic_write_text
from workbench.labels import DeviceWords, trace_words

WHOLE_TRACE = "whole trace"
PNG_NAME = "timeline.png"
JSON_NAME = "timeline.json"
TIMELINE_FILES = (PNG_NAME, JSON_NAME)

# 1600 x 900 pixels: wide enough for a ~70 ms step at ~50 µs a pixel column.
FIGSIZE_IN = (16.0, 9.0)
DPI = 100
_AXES = (0.145, 0.175, 0.845, 0.715)   # left, bottom, width, height of the rows, in figure fractions
MIN_SEGMENT = 0.15   # the least height of a category present in a pixel column
RASTER_LEVELS = 60
# The GPUs' processes are GPU_PID_BASE + 0, 1, ... in order of device id: above Linux's largest pid (2**22),
# so never a host's.
GPU_PID_BASE = 1 << 24
# About 180 bytes an event: 300,000 events make a file of ~55 MB, well inside what the Perfetto UI loads.
MAX_EVENTS = 300_000

CATEGORY_COLORS = {
    "GEMM": "#1f77b4", "attention": "#9467bd", "softmax": "#e377c2", "elementwise": "#ff7f0e",
    "reduction": "#bcbd22", "normalization": "#2ca02c", "copy/memory": "#d62728", "optimizer": "#8c564b",
    "window gather/scatter": "#17becf", "communication": "#f4a6a6", "other": "#7f7f7f",
}
API_KINDS = ("launch", "synchronize", "allocation", "copy/set", "other")
# distinct from the category colours: the host rows have their own legend
API_COLORS = {"launch": "#3b4f7a", "synchronize": "#b2182b", "allocation": "#e6ab02", "copy/set": "#6a3d9a",
              "other": "#a0a0a0"}
_NVTX_COLORS = ("#c9d6e8", "#d9e4c8", "#f0dcc0", "#e2d0e8", "#cfe5e3")
assert set(CATEGORY_COLORS) == set(CATEGORIES) and not set(API_COLORS.values()) & set(CATEGORY_COLORS.values())


def _step_number(name: str) -> int:
    return int(name[4:])


def step_ranges(ranges: pd.DataFrame) -> pd.DataFrame:
    """The `step{i}` ranges (frames.STEP_RANGE), in order of start."""
    if ranges.empty:
        return ranges
    steps = ranges[ranges["name"].str.match(A.STEP_RANGE)]
    return steps.sort_values("start_ns", kind="stable").reset_index(drop=True)


def pick_step(trace, step: int | str | None = None) -> pd.Series | None:
    """The step range to draw: `step` (3, '3' or 'step3'), or with None the median-length step (the
    shorter of the middle two for an even count; ties by order). None when the trace has no step ranges
    and none was asked for; UserError (one line) for a step it does not have."""
    steps = step_ranges(trace.ranges)
    if step is None:
        if steps.empty:
            return None
        length = (steps["end_ns"] - steps["start_ns"]).to_numpy("int64")
        order = np.argsort(length, kind="stable")
        return steps.iloc[int(order[(len(order) - 1) // 2])]
    text = str(step).strip()
    m = re.fullmatch(r"(?:step)?(\d+)", text)
    if m is None:
        raise UserError(f"--step takes a step number (3 or step3), got {text[:40]!r}")
    if steps.empty:
        raise UserError("the trace has no step ranges (NVTX step0, step1, ...) to pick a step from")
    chosen = steps[steps["name"] == f"step{int(m.group(1))}"]
    if chosen.empty:
        names = sorted(steps["name"].unique(), key=_step_number)
        raise UserError(f"no range step{int(m.group(1))} in the trace; it has {', '.join(names[:8])}"
                        + (f", ... ({len(names)} steps)" if len(names) > 8 else ""))
    return chosen.iloc[0]


def os_tid(tid, source: str | None) -> np.ndarray:
    """The OS thread id: nsys packs the process into its globalTid (pid << 24 | tid); Kineto's is plain."""
    t = np.asarray(tid, dtype="int64")
    return np.where(t < 0, t, t & 0xFFFFFF) if source == "nsys" else t


@dataclass
class Row:
    """One row of the picture: kind 'nvtx' | 'gpu' | 'host', its label, and the rows of its frame."""

    kind: str
    label: str
    frame: pd.DataFrame


@dataclass
class StepView:
    """One step of a trace, ready to draw (all times int ns on the trace's clock).

    label: 'step2' or 'whole trace'; why: how it was chosen ('median of 4 steps', 'named', ...);
    start_ns / end_ns: the step range on the host; view_end_ns: end of the drawing (the later of the step's
    end and its last kernel's end); rows: top to bottom. kernels: those drawn (start_ns, end_ns, category,
    own = launched inside the step); kernel_count / kernel_ns: of the own ones; busy_pct: the union of all
    kernels over the step range; words: labels.trace_words."""

    label: str
    why: str
    start_ns: int
    end_ns: int
    view_end_ns: int
    rows: list[Row]
    kernels: pd.DataFrame
    kernel_count: int
    kernel_ns: int
    busy_pct: float
    words: DeviceWords
    devices: int = 1             # GPUs with kernels in the view: busy_pct is then of any of them

    @property
    def step_ns(self) -> int:
        return self.end_ns - self.start_ns


def _overlapping(df: pd.DataFrame, lo: int, hi: int) -> pd.DataFrame:
    return df[(df["end_ns"] >= lo) & (df["start_ns"] <= hi)]


def _short(names, limit: int = 26) -> str:
    """'forward/backward/...' from the distinct names of a row, in order of appearance."""
    distinct = list(dict.fromkeys(names))
    text = "/".join(distinct[:2]) + ("/…" if len(distinct) > 2 else "")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def step_view(trace, step: int | str | None = None) -> StepView:
    """The rows of one step (pick_step), or of the whole trace when it has no step ranges."""
    words = trace_words(trace.meta)
    source = trace.meta.get("source")
    kernels, ranges, api = trace.kernels, trace.ranges, trace.api
    chosen = pick_step(trace, step)
    if chosen is None:
        lo, hi = int(kernels["start_ns"].min()), int(kernels["end_ns"].max())
        own = np.ones(len(kernels), dtype=bool)
        label, why, main_tid, main_pid = WHOLE_TRACE, "no step ranges", None, None
    else:
        lo, hi = int(chosen["start_ns"]), int(chosen["end_ns"])
        launch = kernels["launch_ns"].to_numpy("int64")   # the attribution rule of frames.py
        own = (launch >= lo) & (launch <= hi) & (kernels["pid"].to_numpy("int64") == int(chosen["pid"]))
        n = len(step_ranges(ranges))
        label = str(chosen["name"])
        why = "named" if step is not None else ("the only step" if n == 1 else f"median of {n} steps")
        main_tid, main_pid = int(chosen["tid"]), int(chosen["pid"])
    view_end = max(hi, int(kernels.loc[own, "end_ns"].max())) if own.any() else hi
    k = kernels.assign(own=own)
    k = _overlapping(k, lo, view_end)
    k = k.assign(category=categorize(k["name"]).to_numpy())
    busy = A.busy_idle(k, lo, hi) if hi > lo else None
    busy_pct = float(busy.loc[busy["metric"] == "busy", "pct"].iloc[0]) if busy is not None else 0.0

    def thread_label(tid: int) -> str:
        return "main" if tid == main_tid else f"thread {int(os_tid([tid], source)[0])}"

    rows: list[Row] = []
    r = _overlapping(ranges, lo, view_end)
    if main_pid is not None:
        r = r[r["pid"] == main_pid]
    tids = sorted(r["tid"].unique(), key=lambda t: (t != main_tid, int(r.loc[r["tid"] == t, "start_ns"].min())))
    for tid in tids:  # one iteration per thread with ranges
        on = r[r["tid"] == tid]
        for depth in sorted(on["depth"].unique()):
            row = on[on["depth"] == depth].sort_values("start_ns")
            prefix = "" if tid == main_tid else f"{thread_label(tid)}: "
            rows.append(Row("nvtx", prefix + _short(row["name"]), row))
    gpu_rows = k.groupby(["device_id", "stream_id"], sort=True) if len(k) else []
    for (device, stream), g in gpu_rows:  # one iteration per stream
        name = (f"{words.device} {words.units}" if words.is_cpu else f"GPU {device} · stream {stream}")
        rows.append(Row("gpu", name, g))
    a = _overlapping(api, lo, view_end)
    if main_pid is not None:
        a = a[a["pid"] == main_pid]
    if len(a):
        codes, uniques = pd.factorize(a["name"])
        a = a.assign(kind=np.array([A.api_kind(n) for n in uniques], dtype=object)[codes])  # per distinct name
        launches = a[a["kind"] == "launch"].groupby("tid").size()
        for tid in sorted(a["tid"].unique(), key=lambda t: (t != main_tid, -int(launches.get(t, 0)))):
            g = a[a["tid"] == tid]
            n_launch = int((g["kind"] == "launch").sum())
            rows.append(Row("host", f"CUDA API, {thread_label(tid)}\n{n_launch:,} launches", g))
    count = int(A.instance_rows(kernels)[np.asarray(own)].sum())    # operators, not their self-time stretches
    return StepView(label=label, why=why, start_ns=lo, end_ns=hi, view_end_ns=view_end, rows=rows, kernels=k,
                    kernel_count=count, kernel_ns=int(kernels.loc[own, "duration_ns"].sum()),
                    busy_pct=busy_pct, words=words, devices=int(k["device_id"].nunique()) if len(k) else 1)


# ---------------------------------------------------------------- drawing


def coverage(start, end, lo: int, hi: int, columns: int) -> np.ndarray:
    """The fraction (0..1) of each of `columns` equal columns of [lo, hi) that the union of the
    [start, end) intervals (int ns) covers. O((n + columns) log n). Times are taken relative to lo in
    int64 first: a Kineto clock counts ns since the epoch (~5e18), past float64's whole-ns range."""
    span = hi - lo
    s = np.clip(np.asarray(start, dtype="int64") - lo, 0, span).astype("float64")
    e = np.clip(np.asarray(end, dtype="int64") - lo, 0, span).astype("float64")
    keep = e > s
    if not keep.any() or span <= 0:
        return np.zeros(columns)
    order = np.argsort(s[keep], kind="stable")
    s, e = s[keep][order], e[keep][order]
    reach = np.maximum.accumulate(e)
    new = np.r_[True, s[1:] > reach[:-1]]
    bs, be = s[new], reach[np.r_[np.flatnonzero(new)[1:] - 1, len(s) - 1]]
    before = np.r_[0.0, np.cumsum(be - bs)]        # covered length before each block

    def covered_until(x: np.ndarray) -> np.ndarray:
        i = np.searchsorted(bs, x, side="right") - 1
        inside = np.clip(x - bs[np.clip(i, 0, None)], 0.0, (be - bs)[np.clip(i, 0, None)])
        return np.where(i < 0, 0.0, before[np.clip(i, 0, None)] + inside)

    edges = span * np.arange(columns + 1) / columns
    return np.diff(covered_until(edges)) / (span / columns)


def raster_row(frame: pd.DataFrame, key: str, colors: dict, lo: int, hi: int, columns: int,
               levels: int = RASTER_LEVELS) -> np.ndarray:
    """RGBA pixels (levels x columns x 4, top row first) of one dense row: each pixel column is a bar
    stacked from the bottom, one segment per `key` value (in `colors` order) as tall as the share of the
    column it covers, white above. A value present in a column gets at least MIN_SEGMENT of the height,
    so the shortest kernel still shows; an idle column stays white."""
    from matplotlib.colors import to_rgb

    keys = [k for k in colors if (frame[key] == k).any()]
    rgba = np.ones((levels, columns, 4))
    if not keys:
        return rgba
    values = frame[key].to_numpy()
    share = np.stack([coverage(frame["start_ns"].to_numpy()[values == k], frame["end_ns"].to_numpy()[values == k],
                               lo, hi, columns) for k in keys])   # one row per category present
    share = np.where(share > 0, np.maximum(share, MIN_SEGMENT), 0.0)
    share /= np.maximum(share.sum(axis=0), 1.0)                     # overlapping streams: at most full height
    top = np.rint(np.cumsum(share, axis=0) * levels).astype(int)    # segment tops, in pixels from the bottom
    level = np.arange(levels)[::-1][:, None]                         # pixel row -> height from the bottom
    which = (level[None, :, :] >= top[:, None, :]).sum(axis=0)       # the segment each pixel falls in
    palette = np.vstack([np.array([to_rgb(colors[k]) for k in keys]), np.ones((1, 3))])  # last: white
    rgba[:, :, :3] = palette[which]
    return rgba


def _ms(ns) -> str:
    ms = float(ns) / 1e6
    return f"{ms:,.2f}" if ms < 1 else f"{ms:,.1f}"


def summary_line(view: StepView) -> str:
    """'step2 (median of 4 steps): 64.0 ms · 1,360 kernels launched in it, 17.9 ms of GPU kernel time · GPU
    busy 28.0 % of the step', the picture's second title line."""
    w = view.words
    where = "in it" if w.is_cpu else "launched in it"
    busy = f"any of {view.devices} {w.device}s busy" if view.devices > 1 and not w.is_cpu else f"{w.device} busy"
    if view.label == WHOLE_TRACE:
        return (f"{view.label} (no step ranges): {_ms(view.step_ns)} ms · {view.kernel_count:,} {w.units}, "
                f"{_ms(view.kernel_ns)} ms of {w.time} · {busy} {view.busy_pct:.1f} % of the span")
    return (f"{view.label} ({view.why}): {_ms(view.step_ns)} ms · {view.kernel_count:,} {w.units} {where}, "
            f"{_ms(view.kernel_ns)} ms of {w.time} · {busy} {view.busy_pct:.1f} % of the step")


_ROW_HEIGHT = {"nvtx": 1.0, "gpu": 2.2, "host": 1.4}


def render_timeline_png(view: StepView, title: str, metadata: dict | None = None) -> bytes:
    """The PNG (FIGSIZE_IN at DPI: 1600 x 900 pixels) of `view`: title, rows, legends. `metadata` goes
    into the PNG's text chunks."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    fig = Figure(figsize=FIGSIZE_IN, dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_axes(_AXES)
    columns = int(round(_AXES[2] * FIGSIZE_IN[0] * DPI))
    lo, hi = view.start_ns, max(view.view_end_ns, view.start_ns + 1)
    ms = lambda ns: (np.asarray(ns, dtype="int64") - lo) / 1e6  # noqa: E731  (int64 first: see coverage)
    x_hi = float(ms(hi))
    y, ticks, labels, bounds = 0.0, [], [], []
    previous_kind = None
    for i, row in enumerate(view.rows):  # a few dozen rows at most
        h = _ROW_HEIGHT[row.kind]
        if previous_kind is not None and row.kind != previous_kind:
            bounds.append(y)
            y += 0.3
        top, bottom = y + 0.08 * h, y + 0.92 * h
        if row.kind == "nvtx":
            f = row.frame
            x0, x1 = ms(np.maximum(f["start_ns"], lo)), ms(np.minimum(f["end_ns"], hi))
            color = _NVTX_COLORS[i % len(_NVTX_COLORS)]
            ax.broken_barh(list(zip(x0, x1 - x0)), (top, bottom - top), facecolors=color, edgecolors="#555555",
                           linewidths=0.4)
            px_per_ms = columns / x_hi
            for name, a, b in zip(f["name"], x0, x1):  # ranges of one row: tens, not thousands
                if (b - a) * px_per_ms > 6.5 * len(str(name)) + 4:
                    ax.text((a + b) / 2, (top + bottom) / 2, str(name), ha="center", va="center", fontsize=7.5,
                            clip_on=True)
        else:
            key, colors = ("category", CATEGORY_COLORS) if row.kind == "gpu" else ("kind", API_COLORS)
            img = raster_row(row.frame, key, colors, lo, hi, columns)
            ax.imshow(img, extent=(0.0, x_hi, bottom, top), aspect="auto", interpolation="nearest")
        ticks.append((top + bottom) / 2)
        labels.append(row.label)
        previous_kind = row.kind
        y += h
    ax.set_xlim(0.0, x_hi)
    ax.set_ylim(max(y, 1.0), 0.0)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=8)
    for b in bounds:
        ax.axhline(b + 0.15, color="#999999", linewidth=0.6)
    step_end = float(ms(view.end_ns))
    whole = view.label == WHOLE_TRACE
    if not whole:
        ax.axvline(step_end, color="#333333", linewidth=0.9, linestyle="--")
        if step_end < x_hi:
            ax.axvspan(step_end, x_hi, color="#000000", alpha=0.04, linewidth=0)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_xlabel(f"ms from the start of {'the trace' if whole else view.label}"
                  + (" (dashed: the step's end; after it, its last kernels)" if step_end < x_hi else ""), fontsize=9)
    w = view.words
    fig.text(0.5, 0.965, title, ha="center", va="center", fontsize=13, weight="bold")
    fig.text(0.5, 0.93, summary_line(view), ha="center", va="center", fontsize=10.5)
    own = view.kernels[view.kernels["own"]]
    per_cat = own.groupby("category")["duration_ns"].sum()
    present = [c for c in CATEGORY_COLORS if (view.kernels["category"] == c).any()]
    handles = [Patch(color=CATEGORY_COLORS[c], label=f"{c} {_ms(per_cat.get(c, 0))} ms") for c in present]
    if handles:
        scope = "trace" if whole else "step"
        fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.045), ncol=min(len(handles), 5),
                   frameon=False, fontsize=8.5, title=f"{w.device} {w.units} by category ({w.time} in the {scope})",
                   title_fontsize=8.5)
    kinds = [k for k in API_KINDS if any(r.kind == "host" and (r.frame["kind"] == k).any() for r in view.rows)]
    if kinds:
        fig.legend(handles=[Patch(color=API_COLORS[k], label=k) for k in kinds], loc="lower center",
                   bbox_to_anchor=(0.5, 0.0), ncol=len(kinds), frameon=False, fontsize=8.5,
                   title="host CUDA API calls by kind", title_fontsize=8.5)
    buf = io.BytesIO()
    with warnings.catch_warnings():   # a range name the font cannot draw shows as a box, not a warning line
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .*missing from font")
        fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": "swinbench", **(metadata or {})})
    return buf.getvalue()


# ---------------------------------------------------------------- Perfetto / Chrome trace events


def trace_start_ns(trace) -> int:
    """The first time of any event in the trace (kernels, ranges, API calls, memops)."""
    starts = [int(f["start_ns"].min()) for f in (trace.kernels, trace.ranges, trace.api, trace.memops) if len(f)]
    return min(starts)


def _unit_of(time_ns, pid, steps: pd.DataFrame) -> np.ndarray:
    """Index (into `steps`) of the step whose [start, end] holds each time in the same process, or -1."""
    probe = pd.DataFrame({"launch_ns": np.asarray(time_ns, dtype="int64"), "pid": np.asarray(pid, dtype="int64")})
    ids = A.range_instance_of(probe, steps.assign(range_id=np.arange(len(steps), dtype="int64")))
    return ids


def _us(ns, t0: int) -> list[float]:
    """Microseconds from t0, to the ns (three decimals)."""
    return np.round((np.asarray(ns, dtype="int64") - t0) / 1e3, 3).tolist()


@dataclass
class ExportSelection:
    """What perfetto_trace writes: the rows of each frame it keeps, the kept kernels' step names, the
    step names kept, and notes on what it left out."""

    kernels: pd.DataFrame
    ranges: pd.DataFrame
    api: pd.DataFrame
    memops: pd.DataFrame
    kernel_step: list[str]
    steps: list[str]
    notes: list[str]


def select_for_export(trace, max_events: int = MAX_EVENTS) -> ExportSelection:
    """The captured steps that fit in `max_events` events (rules in perfetto_trace)."""
    words = trace_words(trace.meta)
    k, r, a, m = trace.kernels, trace.ranges, trace.api, trace.memops
    steps = step_ranges(r)
    if len(steps):
        k_unit = _unit_of(k["launch_ns"], k["pid"], steps)
        a_unit = _unit_of(a["start_ns"], a["pid"], steps)
        r_unit = _unit_of(r["start_ns"], r["pid"], steps)
        by_corr = pd.Series(a_unit, index=a["correlation_id"].to_numpy()).groupby(level=0).first()
        m_unit = by_corr.reindex(m["correlation_id"].to_numpy()).fillna(-1).to_numpy("int64")
        names = steps["name"].tolist()
    else:
        k_unit, a_unit, r_unit, m_unit = (np.zeros(len(f), dtype="int64") for f in (k, a, r, m))
        names = [WHOLE_TRACE]
    weight = 1 + 2 * ((k["launch_ns"].to_numpy("int64") >= 0) & (not words.is_cpu))   # a kernel and its flow arrow
    per_unit = np.zeros(len(names), dtype="int64")
    for unit, w in ((k_unit, weight), (a_unit, 1), (r_unit, 1), (m_unit, 1)):
        inside = unit >= 0
        per_unit += np.bincount(unit[inside], weights=np.broadcast_to(w, unit.shape)[inside],
                                minlength=len(names)).astype("int64")
    kept = int(np.searchsorted(np.cumsum(per_unit), max_events, side="right"))
    notes, cutoff = [], None
    if kept == 0:   # the first unit alone is over the cap: its earliest events
        kept = 1
        first = np.sort(np.concatenate([f.loc[u == 0, "start_ns"].to_numpy("int64")
                                        for f, u in ((k, k_unit), (a, a_unit), (r, r_unit), (m, m_unit))]))
        cutoff = int(first[max_events // 3])      # a kernel counts three events with its flow arrow
        notes.append(f"{names[0]} alone has {int(per_unit[0]):,} events, over the cap of {max_events:,}: only "
                     f"its events in the first {(cutoff - trace_start_ns(trace)) / 1e6:,.1f} ms")
    if kept < len(names):
        notes.append(f"{names[kept]}…{names[-1]} ({len(names) - kept} of {len(names)} steps) left out: the "
                     f"export holds at most {max_events:,} events")
    outside = int((k_unit < 0).sum())
    if outside:
        notes.append(f"{outside:,} {words.units} launched outside the step ranges (setup) left out")

    def keep(frame: pd.DataFrame, unit: np.ndarray) -> np.ndarray:
        sel = (unit >= 0) & (unit < kept)
        return sel & (frame["start_ns"].to_numpy("int64") < cutoff) if cutoff is not None else sel

    k_sel = keep(k, k_unit)
    return ExportSelection(kernels=k[k_sel], ranges=r[keep(r, r_unit)], api=a[keep(a, a_unit)],
                           memops=m[keep(m, m_unit)], kernel_step=[names[u] for u in k_unit[k_sel]],
                           steps=names[:kept], notes=notes)


def _gpu_pids(sel: ExportSelection) -> dict[int, int]:
    """{device id: its process id in the export}, GPU_PID_BASE + its rank among the devices."""
    devices = sorted(set(sel.kernels["device_id"].tolist()) | set(sel.memops["device_id"].tolist()))
    return {d: GPU_PID_BASE + i for i, d in enumerate(devices)}


def _metadata_events(sel: ExportSelection, trace, gpu_pids: dict[int, int]) -> list[dict]:
    """Process and thread names: 'host process N' with 'main thread T' (the one that pushed the steps)
    and 'thread T'; 'GPU d (name)' with 'stream s'."""
    source = trace.meta.get("source")
    main_tids = set(step_ranges(trace.ranges)["tid"]) if len(trace.ranges) else set()
    events = []

    def meta(pid, tid, what, value):
        events.append({"ph": "M", "name": what, "pid": int(pid), "tid": int(tid), "ts": 0,
                       "args": {"sort_index" if what.endswith("sort_index") else "name": value}})

    threads = [sel.api[["pid", "tid"]], sel.ranges[["pid", "tid"]]]
    on_gpu = not trace_words(trace.meta).is_cpu
    if not on_gpu:
        threads.append(sel.kernels[["pid", "launch_tid"]].rename(columns={"launch_tid": "tid"}))
    threads = pd.concat(threads).drop_duplicates()
    for pid in sorted(threads["pid"].unique()):
        meta(pid, 0, "process_name", f"host process {pid}")
        meta(pid, 0, "process_sort_index", 0)
    for pid, tid in threads.itertuples(index=False):  # one per host thread
        os_id = int(os_tid([tid], source)[0])
        meta(pid, os_id, "thread_name", f"{'main thread' if tid in main_tids else 'thread'} {os_id}")
    if on_gpu:
        gpus = set(trace.meta.get("gpus") or [])
        model = f" ({next(iter(gpus))})" if len(gpus) == 1 else ""
        streams = pd.concat([sel.kernels[["device_id", "stream_id"]], sel.memops[["device_id", "stream_id"]]])
        for device, pid in gpu_pids.items():
            meta(pid, 0, "process_name", f"GPU {device}{model}")
            meta(pid, 0, "process_sort_index", 1 + pid - GPU_PID_BASE)
        for device, stream in streams.drop_duplicates().itertuples(index=False):
            meta(gpu_pids[device], stream, "thread_name", f"stream {stream}")
    return events


def _kernel_events(sel: ExportSelection, source: str | None, gpu_pids: dict[int, int] | None, t0: int) -> list[dict]:
    """One 'X' event per kernel on its GPU stream's track (a CPU operator: on its thread), named by its
    short name; args: name (demangled), category, step, device, stream, correlation, launched_by_tid.
    Then a flow arrow ('s' on the launching thread, 'f' on the kernel) per launched GPU kernel. gpu_pids:
    _gpu_pids, None for CPU operators."""
    k = sel.kernels
    cats = categorize(k["name"]).tolist()
    ts, dur = _us(k["start_ns"], t0), np.round(k["duration_ns"].to_numpy("int64") / 1e3, 3).tolist()
    launch_tid = os_tid(k["launch_tid"], source).tolist()
    device, stream, corr = (k[c].tolist() for c in ("device_id", "stream_id", "correlation_id"))
    on_gpu = gpu_pids is not None
    if on_gpu:
        pids, tids, cat = [gpu_pids[d] for d in device], stream, "kernel"
    else:
        pids, tids, cat = k["pid"].tolist(), launch_tid, "cpu_op"
    events = [{"ph": "X", "cat": cat, "name": short, "pid": pids[i], "tid": tids[i], "ts": ts[i], "dur": dur[i],
               "args": {"name": name, "category": cats[i], "step": sel.kernel_step[i], "device": device[i],
                        "stream": stream[i], "correlation": corr[i], "launched_by_tid": launch_tid[i]}}
              for i, (name, short) in enumerate(zip(k["name"].tolist(), k["short_name"].tolist()))]
    if on_gpu:
        launched = np.flatnonzero(k["launch_ns"].to_numpy("int64") >= 0)
        launch_ts = _us(k["launch_ns"].to_numpy("int64")[launched], t0)
        launch_pid = k["pid"].to_numpy("int64")[launched].tolist()
        for j, i in enumerate(launched.tolist()):  # two flow events per launched kernel
            events.append({"ph": "s", "cat": "ac2g", "name": "launch", "id": j, "pid": launch_pid[j],
                           "tid": launch_tid[i], "ts": launch_ts[j]})
            events.append({"ph": "f", "bp": "e", "cat": "ac2g", "name": "launch", "id": j, "pid": pids[i],
                           "tid": tids[i], "ts": ts[i]})
    return events


def _host_events(frame: pd.DataFrame, cat: str, args: list[dict], source: str | None, t0: int) -> list[dict]:
    """One 'X' event per NVTX range or API call, on its host thread."""
    ts = _us(frame["start_ns"], t0)
    dur = np.round((frame["end_ns"] - frame["start_ns"]).to_numpy("int64") / 1e3, 3).tolist()
    tids = os_tid(frame["tid"], source).tolist()
    return [{"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tids[i], "ts": ts[i], "dur": dur[i],
             "args": args[i]} for i, (name, pid) in enumerate(zip(frame["name"].tolist(), frame["pid"].tolist()))]


def _memop_events(m: pd.DataFrame, gpu_pids: dict[int, int], t0: int) -> list[dict]:
    """One 'X' event per memcpy / memset, on its GPU stream's track."""
    ts, dur = _us(m["start_ns"], t0), np.round(m["duration_ns"].to_numpy("int64") / 1e3, 3).tolist()
    return [{"ph": "X", "cat": f"gpu_{kind}", "name": kind.capitalize(), "pid": gpu_pids[int(device)],
             "tid": int(stream), "ts": ts[i], "dur": dur[i], "args": {"bytes": int(nbytes)}}
            for i, (kind, nbytes, device, stream)
            in enumerate(zip(m["kind"], m["bytes"].tolist(), m["device_id"].tolist(), m["stream_id"].tolist()))]


def perfetto_trace(trace, *, origin: str | None = None, max_events: int = MAX_EVENTS) -> tuple[dict, list[str]]:
    """(the trace-event JSON object, notes on what it leaves out) of the captured steps (module docstring).

    Units are the `step{i}` ranges, in order (the whole trace when it has none); a kernel belongs to the
    step whose range holds its launch in the same process (as frames.range_instance_of), an API call or
    range to the step holding its start, a memcpy/memset to its API call's step. Whole steps are kept while
    the events fit in `max_events`; when even the first does not, its earliest events. Events are sorted
    by time after the metadata; ts and dur are µs from trace_start_ns. The object's `trace` key is
    `origin`; `otherData` holds source, steps, time_zero_ns, kernels (the count) and left_out."""
    source = trace.meta.get("source")
    on_gpu = not trace_words(trace.meta).is_cpu
    sel = select_for_export(trace, max_events)
    t0 = trace_start_ns(trace)
    gpu_pids = _gpu_pids(sel) if on_gpu else None
    timed = _kernel_events(sel, source, gpu_pids, t0)
    timed += _host_events(sel.ranges, "nvtx", [{"domain": d} for d in sel.ranges["domain"].tolist()], source, t0)
    timed += _host_events(sel.api, "cuda_runtime", [{"correlation": c} for c in sel.api["correlation_id"].tolist()],
                          source, t0)
    if on_gpu:
        timed += _memop_events(sel.memops, gpu_pids, t0)
    elif len(sel.memops):
        sel.notes.append(f"{len(sel.memops)} memcpy/memset left out: without GPU kernels the timeline shows CPU "
                         "operators")
    timed.sort(key=lambda e: (e["ts"], -e.get("dur", 0.0)))   # a parent before what it holds
    doc = {
        "traceEvents": _metadata_events(sel, trace, gpu_pids or {}) + timed,
        "displayTimeUnit": "ms",
        "trace": origin,
        "otherData": {"source": source, "steps": sel.steps, "time_zero_ns": t0, "kernels": int(len(sel.kernels)),
                      "left_out": "; ".join(sel.notes)},
    }
    return doc, sel.notes


def write_timeline(trace, out_dir, *, title: str, origin: str | None = None, step: int | str | None = None,
                   max_events: int = MAX_EVENTS, on_note=None) -> list[Path]:
    """Write `<out_dir>/timeline.png` (step_view of `step`) and `<out_dir>/timeline.json` (perfetto_trace),
    each atomically, each naming `origin` (the trace, as analyze.trace_origin says it) -> the two paths.
    on_note(line) hears what the JSON leaves out. UserError for a step the trace does not have, before
    anything is written."""
    view = step_view(trace, step)
    out = Path(out_dir)
    png = render_timeline_png(view, title, {"trace": origin or ""})
    doc, notes = perfetto_trace(trace, origin=origin, max_events=max_events)
    paths = [atomic_write_bytes(out / PNG_NAME, png),
             atomic_write_text(out / JSON_NAME, json.dumps(doc, separators=(",", ":")))]
    for note in notes:
        if on_note:
            on_note(f"{JSON_NAME}: {note}")
    return paths


def timeline_title(trace_path) -> str:
    """The picture's title for a trace file: its name, with its folder's when the file is a generic
    `trace.*` (what `swinbench profile` writes)."""
    path = Path(str(trace_path))
    generic = path.name.split(".")[0] in ("trace", "profile", "report") and path.parent.name
    return f"{path.parent.name}/{path.name}" if generic else path.name


def timeline_origin(path: Path) -> str | None:
    """The trace a timeline file names (write_timeline's `origin`), '' when it names none, None when the
    file cannot be read as one."""
    try:
        if path.suffix == ".png":
            from PIL import Image

            with Image.open(path) as img:
                return img.text.get("trace") if hasattr(img, "text") else None
        doc = json.loads(path.read_text())
        return doc.get("trace") if isinstance(doc, dict) and "traceEvents" in doc else None
    except (OSError, ValueError, UnicodeDecodeError, SyntaxError):
        return None
