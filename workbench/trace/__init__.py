"""Trace parsing: one GPU trace file in, pandas frames with documented columns out.

`load_trace(path)` picks the parser from the file's suffix:

- `.sqlite` / `.sqlite.xz`: an Nsight Systems SQLite export (`nsys_sqlite.py`); `.xz` is decompressed to a
  temporary file first.
- `.nsys-rep`: exported to SQLite with `nsys export --type sqlite`, then as above.
- `.json` / `.json.gz`: a Kineto (torch.profiler) Chrome trace (`kineto.py`).

Every parser returns the same `Trace`, so the analysis layer (`workbench/analysis/frames.py`) never sees a file.

Frames (all times are integer nanoseconds on the trace's own clock; unknown integers are -1):

kernels, one row per GPU kernel:
    start_ns, end_ns, duration_ns (int64), name (demangled), short_name (str), device_id, stream_id,
    correlation_id (int64), launch_ns (CPU start of the launching runtime call), launch_tid (the launching
    thread, same id space as ranges.tid), pid (the launching process).
ranges, one row per NVTX push/pop or start/end range (Kineto: user_annotation):
    range_id, name, domain (str), start_ns, end_ns, tid, pid (int64), depth (nesting depth on its thread,
    0 = outermost).
memops, one row per memcpy/memset activity (not kernels; kept apart as nsys's cuda_gpu_kern_sum does):
    start_ns, end_ns, duration_ns, kind ('memcpy' | 'memset'), bytes, device_id, stream_id, correlation_id.
api, one row per CUDA runtime / driver API call on the host (nsys CUPTI_ACTIVITY_KIND_RUNTIME, Kineto
cuda_runtime / cuda_driver events):
    start_ns, end_ns, duration_ns, name (without nsys's `_v3020`-style version suffix), tid, pid,
    correlation_id.

Several GPUs: kernels and memops carry the GPU in `device_id` (nsys deviceId; Kineto args.device, else the
event's pid, which torch.profiler sets to the device index), so a single-process multi-GPU capture or a
merged trace of several ranks keeps its devices apart; the analysis builds its tables per device.

Broken input, decided once here for every parser:

- A row whose times cannot be a real event is dropped: no start or end (NULL, absent, a JSON NaN), a start
  or end that is not a number (text, a blob, a JSON string or list), a negative time, an end before its start, or an absurd time
  (beyond MAX_TIMESTAMP_NS, lasting longer than MAX_SPAN_NS, or starting more than MAX_SPAN_NS from the
  median start of its frame). Such a row has no duration to trust, and one of them is enough to turn a
  total negative or stretch a span over years, while the rest of the trace is still good. Each kind of
  drop adds ONE line to `meta["warnings"]` saying how many rows of which frame went, and the analysis
  shows those lines with its tables and in its JSON. (A fractional ns count in an nsys export is truncated
  to whole ns, not dropped; an id column holding something other than an integer reads -1.)
- Nothing valid left (every kernel row dropped), or a table the frames cannot be built without (no kernel
  table; no StringIds, so kernel names cannot be resolved): UserError, one line.
- A kernel or API name id that StringIds lacks: the row is kept (its time is real) under the name
  `<string id N>` (`<no name>` for NULL), with one warning line.
- An NVTX push/pop range that never ended (the capture stopped inside it) is normal: dropped with a note.
- Compressed input (.xz, .json.gz) is decompressed as a stream up to decompression_cap(size): at most
  MAX_DECOMPRESSED_BYTES, and at most MAX_COMPRESSION_RATIO times the compressed size. Beyond it, UserError:
  a few hundred kilobytes can otherwise expand to gigabytes on disk before anything reads them.

meta["warnings"] (list of one-line str) holds the warnings; meta["notes"] what is normal but worth saying.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from workbench.errors import UserError

KERNEL_COLUMNS = [
    "start_ns", "end_ns", "duration_ns", "name", "short_name", "device_id", "stream_id",
    "correlation_id", "launch_ns", "launch_tid", "pid",
]
RANGE_COLUMNS = ["range_id", "name", "domain", "start_ns", "end_ns", "tid", "pid", "depth"]
MEMOP_COLUMNS = ["start_ns", "end_ns", "duration_ns", "kind", "bytes", "device_id", "stream_id", "correlation_id"]
API_COLUMNS = ["start_ns", "end_ns", "duration_ns", "name", "tid", "pid", "correlation_id"]

_STR_COLUMNS = {"name", "short_name", "domain", "kind"}

# No clock reading is this large: 2**62 ns is 146 years, past any epoch a profiler counts from, and keeps
# every sum of two times inside int64.
MAX_TIMESTAMP_NS = 2**62
# No profiled event lasts longer, and none starts farther than this from the others of its frame.
MAX_SPAN_NS = 24 * 3600 * 10**9
# Compressed traces expand to at most this many bytes, and at most this many times their own size (real
# nsys exports compress about 5x, Kineto JSON about 10x).
MAX_DECOMPRESSED_BYTES = 4 << 30
MAX_COMPRESSION_RATIO = 50

# Why a row's times are refused (`time_code`); a row counts under the first that drop_bad_times finds.
TIME_OK, TIME_MISSING, TIME_NOT_A_NUMBER, TIME_NEGATIVE, TIME_END_BEFORE_START, TIME_ABSURD = range(6)
_TIME_REASONS = {
    TIME_MISSING: "no start or end time",
    TIME_NOT_A_NUMBER: "a start or end time that is not a number",
    TIME_NEGATIVE: "a negative start or end time",
    TIME_END_BEFORE_START: "an end before the start",
    TIME_ABSURD: "an absurd time (beyond 2^62 ns, lasting over 24 h, or over 24 h away from the other rows)",
}


@dataclass
class Trace:
    """A parsed trace: kernels, ranges, memops and api frames (columns above) plus `meta`.

    meta keys: source ('nsys' | 'kineto'), path, schema_version, export_version, span_start_ns,
    span_end_ns (first kernel start, last kernel end), notes and warnings (lists of one-line str).
    launches: the `launches.json` the capture wrote beside the trace (one step's eager Triton launches with
    the bytes of their arguments, see LAUNCHES_FILE), or None.
    """

    kernels: pd.DataFrame
    ranges: pd.DataFrame
    meta: dict
    memops: pd.DataFrame = field(default_factory=lambda: empty_frame(MEMOP_COLUMNS))
    api: pd.DataFrame = field(default_factory=lambda: empty_frame(API_COLUMNS))
    launches: dict | None = None


def empty_frame(columns: list[str]) -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series([], dtype=object if c in _STR_COLUMNS else "int64") for c in columns})


def _int_column(values) -> np.ndarray:
    """int64 with -1 for missing (NULL / NaN / None)."""
    s = pd.to_numeric(pd.Series(values), errors="coerce")
    return s.fillna(-1).to_numpy(dtype="int64")


def finish_frame(df: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """Fill missing optional columns, cast to the documented dtypes, keep the documented order."""
    out = {}
    n = len(df)
    for c in columns:
        if c in _STR_COLUMNS:
            col = df[c] if c in df else pd.Series([""] * n, index=df.index)
            out[c] = col.fillna("").astype(object).to_numpy()
        else:
            out[c] = _int_column(df[c].to_numpy()) if c in df else np.full(n, -1, dtype="int64")
    return pd.DataFrame(out, columns=columns)


def drop_bad_times(df: pd.DataFrame, what: str, warnings: list[str]) -> pd.DataFrame:
    """`df` without the rows whose times cannot be real (rules in the module docstring), one line per
    kind of drop appended to `warnings` ("dropped 3 of 1,204 kernel rows: an end before the start").

    df: int64 start_ns and end_ns, plus an optional int `time_code` column the parser filled where it saw
    the raw value (TIME_MISSING, TIME_NOT_A_NUMBER, TIME_ABSURD; start_ns / end_ns hold anything there).
    The numeric checks run here, on int64 arrays. Returns the kept rows without `time_code`.
    """
    n = len(df)
    code = df["time_code"].to_numpy("int64").copy() if "time_code" in df else np.zeros(n, dtype="int64")
    start, end = df["start_ns"].to_numpy("int64"), df["end_ns"].to_numpy("int64")
    code[(code == TIME_OK) & ((start < 0) | (end < 0))] = TIME_NEGATIVE
    # before end < start: a huge start (a saturated cast, say) is what is wrong with its row
    code[(code == TIME_OK) & ((start > MAX_TIMESTAMP_NS) | (end > MAX_TIMESTAMP_NS))] = TIME_ABSURD
    code[(code == TIME_OK) & (end < start)] = TIME_END_BEFORE_START
    code[(code == TIME_OK) & (end - start > MAX_SPAN_NS)] = TIME_ABSURD  # both in [0, 2**62]: no overflow
    ok = code == TIME_OK
    if ok.any():
        median = int(np.median(start[ok]))  # robust to a few stray rows
        code[ok & (np.abs(start - median) > MAX_SPAN_NS)] = TIME_ABSURD
    kinds, counts = np.unique(code[code != TIME_OK], return_counts=True)
    for kind, count in zip(kinds, counts):  # at most five kinds
        warnings.append(f"dropped {count:,} of {n:,} {what}: {_TIME_REASONS[int(kind)]}")
    kept = df[code == TIME_OK] if len(kinds) else df
    return kept.drop(columns=["time_code"], errors="ignore")


def decompression_cap(compressed_bytes: int) -> int:
    """The most bytes a compressed trace of `compressed_bytes` may expand to (module docstring)."""
    return min(MAX_DECOMPRESSED_BYTES, MAX_COMPRESSION_RATIO * max(int(compressed_bytes), 1))


def copy_capped(src, dst, path: Path, chunk: int = 1 << 20) -> int:
    """Copy the decompressing stream `src` into `dst`, chunk by chunk, and stop with a UserError naming
    the cap as soon as more than decompression_cap(size of `path`) bytes come out. Returns bytes copied."""
    cap = decompression_cap(path.stat().st_size)
    copied = 0
    while True:
        block = src.read(min(chunk, cap + 1 - copied))
        if not block:
            return copied
        copied += len(block)
        if copied > cap:
            raise UserError(
                f"{path} decompresses to more than {cap:,} bytes, the cap for a file of its size "
                f"({MAX_COMPRESSION_RATIO}x its {path.stat().st_size:,} bytes, at most "
                f"{MAX_DECOMPRESSED_BYTES >> 30} GiB): decompress it yourself and pass the result"
            )
        dst.write(block)


def nesting_depth(start: np.ndarray, end: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """Depth of each range among the ranges of its thread (0 = outermost), for properly nested ranges.

    With a thread's ranges sorted by (start asc, end desc), the ranges open at range i's start are the
    earlier-sorted ones that have not ended: depth_i = i - #(ends <= start_i). O(n log n), no Python loop
    over rows.
    """
    n = len(start)
    depth = np.zeros(n, dtype="int64")
    if n == 0:
        return depth
    order = np.lexsort((-end, start, tid))
    s, e, t = start[order], end[order], tid[order]
    bounds = np.flatnonzero(np.r_[True, t[1:] != t[:-1], True])
    for lo, hi in zip(bounds[:-1], bounds[1:]):  # one iteration per thread, not per range
        ends_sorted = np.sort(e[lo:hi])
        closed = np.searchsorted(ends_sorted, s[lo:hi], side="right")
        depth[order[lo:hi]] = np.arange(hi - lo) - closed
    return np.maximum(depth, 0)


def kernel_span(kernels: pd.DataFrame) -> tuple[int | None, int | None]:
    if kernels.empty:
        return None, None
    return int(kernels["start_ns"].min()), int(kernels["end_ns"].max())


def _suffix(path: Path) -> str:
    name = path.name.lower()
    for suffix in (".sqlite.xz", ".json.gz", ".sqlite", ".nsys-rep", ".json", ".db", ".xz"):
        if name.endswith(suffix):
            return suffix
    return path.suffix.lower()


def load_trace(path) -> Trace:
    """Parse an nsys export (.sqlite, .sqlite.xz, .nsys-rep) or a Kineto trace (.json, .json.gz).

    Raises UserError (one line) when the file is missing, unreadable, of an unknown kind, expands past the
    decompression cap, or has no kernels with valid times. meta gets `devices`: the distinct device_id of
    the kernels, ascending.
    """
    trace = _parse(path)
    trace.meta.setdefault("warnings", [])
    trace.meta["devices"] = sorted(int(d) for d in trace.kernels["device_id"].unique())
    trace.launches = load_launches(Path(os.fspath(path)).parent / LAUNCHES_FILE, trace.meta["warnings"])
    return trace


# Written by the capture beside its trace: {"schema": LAUNCHES_SCHEMA, "device_name": str | null,
# "step": int | null, "launches": [{"kernel": str, "bytes": int, "largest": [[shape...], dtype]}]}: the eager
# Triton launches of one warm-up step, in launch order (workbench.kernels._common.launch_log); of a stage
# that compiles, "step" null and "forced_eager" true: one step before the warm-up with torch.compile
# forced eager (Inductor launches the same kernels on the same shapes itself).
LAUNCHES_FILE = "launches.json"
LAUNCHES_SCHEMA = "swinbench.launches/1"


def _largest_ok(largest) -> bool:
    """A launch's largest tensor as launches.json keeps it: null, or [shape (list of ints), dtype (str)]."""
    return largest is None or (isinstance(largest, list) and len(largest) == 2 and isinstance(largest[0], list)
                               and all(isinstance(d, int) and not isinstance(d, bool) for d in largest[0])
                               and isinstance(largest[1], str))


def load_launches(path: Path, warnings: list[str]) -> dict | None:
    """The launches file at `path`, or None when there is none; a file that is not one (another schema,
    broken JSON, a wrong field) adds one line to `warnings` and is left out."""
    import json

    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
        ok = (isinstance(doc, dict) and doc.get("schema") == LAUNCHES_SCHEMA and isinstance(doc.get("launches"), list)
              and isinstance(doc.get("device_name"), (str, type(None)))
              and all(isinstance(e, dict) and isinstance(e.get("kernel"), str) and isinstance(e.get("bytes"), int)
                      and e["bytes"] >= 0 and _largest_ok(e.get("largest")) for e in doc["launches"]))
    except (OSError, UnicodeDecodeError, ValueError):
        ok = False
    if not ok:
        warnings.append(f"{path.name} beside the trace is not a {LAUNCHES_SCHEMA} file: kernel floors left out")
        return None
    return doc


def _parse(path) -> Trace:
    path = Path(os.fspath(path))
    if not path.exists():
        raise UserError(f"trace not found: {path}")
    if path.is_dir():
        raise UserError(f"trace is a directory, not a file: {path}")
    suffix = _suffix(path)
    if suffix in (".sqlite", ".sqlite.xz", ".db", ".xz", ".nsys-rep"):
        from workbench.trace import nsys_sqlite

        if suffix == ".nsys-rep":
            return nsys_sqlite.load_nsys_rep(path)
        if suffix in (".sqlite.xz", ".xz"):
            return nsys_sqlite.load_sqlite_xz(path)
        return nsys_sqlite.load_sqlite(path)
    if suffix in (".json", ".json.gz"):
        from workbench.trace import kineto

        return kineto.load_kineto(path)
    raise UserError(
        f"unknown trace type {path.name!r}: expected .sqlite, .sqlite.xz, .nsys-rep, .json or .json.gz"
    )


__all__ = ["Trace", "load_trace", "KERNEL_COLUMNS", "RANGE_COLUMNS", "MEMOP_COLUMNS", "drop_bad_times"]
