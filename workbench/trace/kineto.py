"""Kineto (torch.profiler `export_chrome_trace`) JSON -> Trace frames.

Complete events (`"ph": "X"`) are read by category (case-insensitive; older torch wrote `Kernel`, `Runtime`):

- `kernel`: GPU kernels. ts/dur are microseconds (floats with ns digits) -> integer ns. args: device,
  stream, correlation.
- `cuda_runtime` / `cuda_driver`: the launching API call (cudaLaunchKernel, cuLaunchKernel for Triton),
  joined to kernels on args.correlation; gives launch_ns, launch_tid (its tid) and pid (its pid).
- `user_annotation`: `record_function` ranges on the CPU (incl. `ProfilerStep#N`) -> ranges, domain
  "user_annotation". `gpu_user_annotation` (their projection onto the GPU timeline) is skipped: ranges are
  CPU intervals, and kernels are attributed by launch time as for nsys.
- `gpu_memcpy` / `gpu_memset` -> memops.

Kineto names kernels with their demangled name only; short_name is derived from it (template arguments,
parameters and namespaces stripped), one pass per distinct name.

No GPU kernels at all (a CPU-only capture): load_kineto falls back to the `cpu_op` events' self time
(cpu_ops_as_kernels) and notes it, so `profile --device cpu` still gets tables. Kernel events whose times
are all broken are not "no kernels": that is a UserError.

Times: `ts` and `dur` must be numbers (a numeric string is read as one); a missing, non-numeric, infinite
or out-of-range one marks the event for drop_bad_times (workbench/trace/__init__.py), which drops it with
one warning line per kind. end = start + dur, so a negative dur is an end before the start.
"""
from __future__ import annotations

import gzip
import io
import json
import re
import zlib
from pathlib import Path

import numpy as np
import pandas as pd

from workbench.errors import UserError
from workbench.trace import (
    API_COLUMNS, KERNEL_COLUMNS, MAX_TIMESTAMP_NS, MEMOP_COLUMNS, RANGE_COLUMNS, TIME_ABSURD, TIME_MISSING,
    TIME_NOT_A_NUMBER, TIME_OK, Trace, copy_capped, drop_bad_times, empty_frame, finish_frame, kernel_span,
    nesting_depth,
)

_KERNEL = {"kernel"}
_RUNTIME = {"cuda_runtime", "runtime", "cuda_driver", "driver"}
_ANNOTATION = {"user_annotation"}
_MEMCPY = {"gpu_memcpy", "memcpy"}
_MEMSET = {"gpu_memset", "memset"}


def short_kernel_name(name: str) -> str:
    """'void at::native::foo<(int)4, bar<x>>(int, T1)' -> 'foo', like nsys's shortName; plain names (Triton,
    nvjet) stay as they are. Keeps only the characters outside every <...> and (...), then the last
    `::` component."""
    s = name.strip()
    if s.startswith("void "):
        s = s[5:]
    kept, depth = [], 0
    for ch in s:  # one pass per distinct name (callers factorize first)
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth = max(depth - 1, 0)
        elif depth == 0:
            kept.append(ch)
    short = "".join(kept).split("::")[-1].strip()
    return short or name


_OP_PATTERNS = (                  # the op a generic PyTorch kernel runs, from its demangled name
    re.compile(r"CUDAFunctor_(\w+?)<([\w:]+)>"),             # CUDAFunctor_add<float>
    re.compile(r"binary_internal::(\w+?)Functor<([\w:]+)"),     # AUnaryFunctor<..., binary_internal::MulFunctor<
    re.compile(r"::(\w+?)_functor<([\w:]+)"),                  # sum_functor<c10::BFloat16, ...
    re.compile(r"::(\w+?)(?:CUDAKernel(?:Impl)?|_kernel_cuda)\b()"),  # GeluBackwardCUDAKernelImpl, direct_copy_kernel_cuda
    re.compile(r"::(\w+?)Functor<([\w:]+)"),                   # FusedAdamMathFunctor<float, ...
    re.compile(r"::(\w+?)Ops<([\w:]+)"),                       # MeanOps<float, ...
)
_TYPE_NAMES = {"float": "fp32", "double": "fp64", "c10::BFloat16": "bf16", "c10::Half": "fp16", "BFloat16": "bf16",
               "Half": "fp16", "int": "int32", "long": "int64", "bool": "bool"}
_WRAPPERS = re.compile(r"^(?:void\s+)?cutlass\w*::(?:Kernel2?|device_kernel)<([\w:]+)")


def op_kernel_name(name: str) -> str:
    """The short name (short_kernel_name) with what it runs where that name alone does not say: PyTorch's
    generic elementwise, reduce and multi-tensor kernels get their op and its dtype where the name holds
    them ('vectorized_elementwise_kernel[add bf16]', 'reduce_kernel[sum bf16]',
    'elementwise_kernel[direct_copy]'); a CUTLASS wrapper ('Kernel2') its kernel's own name."""
    wrapped = _WRAPPERS.match(name.strip())
    if wrapped:
        return wrapped.group(1).split("::")[-1]
    short = short_kernel_name(name)
    if "at::native" not in name or short == name:
        return short
    for pattern in _OP_PATTERNS:
        found = pattern.search(name)
        if found:
            op, dtype = found.group(1), _TYPE_NAMES.get(found.group(2), "")
            return f"{short}[{op} {dtype}]" if dtype else f"{short}[{op}]"
    return short


def _int(values) -> np.ndarray:
    """ints from numbers or strings like 'stream 7' (-1 when there is none)."""
    s = pd.Series(values, dtype=object)
    num = pd.to_numeric(s, errors="coerce")
    if num.isna().any():
        digits = s.astype(str).str.extract(r"(-?\d+)\s*$", expand=False)
        num = num.fillna(pd.to_numeric(digits, errors="coerce"))
    return num.fillna(-1).to_numpy(dtype="int64")


def _us_to_ns(values) -> tuple[np.ndarray, np.ndarray]:
    """(float64 ns, time_code) of µs values: TIME_MISSING for None / absent, TIME_NOT_A_NUMBER for what
    does not parse as a number, TIME_ABSURD for an infinite one or one beyond MAX_TIMESTAMP_NS; those read
    0 ns."""
    raw = pd.Series(values, dtype=object)
    ns = pd.to_numeric(raw, errors="coerce").to_numpy("float64") * 1000.0
    code = np.full(len(raw), TIME_OK, dtype="int64")
    code[np.isnan(ns)] = TIME_NOT_A_NUMBER
    code[raw.isna().to_numpy()] = TIME_MISSING
    with np.errstate(invalid="ignore"):
        code[(code == TIME_OK) & ~(np.abs(ns) <= MAX_TIMESTAMP_NS)] = TIME_ABSURD
    return np.where(code == TIME_OK, ns, 0.0), code


def _arg(args: pd.Series, key: str) -> list:
    return [a.get(key) if isinstance(a, dict) else None for a in args]


def _events(data: dict) -> pd.DataFrame:
    events = data.get("traceEvents") if isinstance(data, dict) else data if isinstance(data, list) else None
    if not isinstance(events, list):
        raise UserError("not a Kineto trace: no traceEvents list")
    ev = pd.DataFrame([e for e in events if isinstance(e, dict) and e.get("ph") == "X"])
    for col in ("cat", "name", "pid", "tid", "ts", "dur", "args"):
        if col not in ev:
            ev[col] = None
    ev["cat_l"] = ev["cat"].fillna("").astype(str).str.lower()
    start, start_code = _us_to_ns(ev["ts"])
    dur, dur_code = _us_to_ns(ev["dur"])
    code = np.where(start_code != TIME_OK, start_code, dur_code)
    code[(code == TIME_OK) & ~(np.abs(start + dur) <= MAX_TIMESTAMP_NS)] = TIME_ABSURD
    ev["start_ns"] = np.rint(np.where(code == TIME_OK, start, 0.0)).astype("int64")
    ev["end_ns"] = ev["start_ns"] + np.rint(np.where(code == TIME_OK, dur, 0.0)).astype("int64")
    ev["time_code"] = code
    return ev


def _kernels(ev: pd.DataFrame, warnings: list[str], path: str) -> pd.DataFrame:
    """The kernels frame; UserError when there are kernel events but none with valid times."""
    k = ev[ev["cat_l"].isin(_KERNEL)]
    if k.empty:
        return empty_frame(KERNEL_COLUMNS)
    k = drop_bad_times(k, "kernel rows", warnings).reset_index(drop=True)
    if k.empty:
        raise UserError(f"no GPU kernel with valid times in {path or 'the trace'}: {'; '.join(warnings)}")
    args = k["args"]
    k["correlation_id"] = _int(_arg(args, "correlation"))
    dev = _int(_arg(args, "device"))
    stream = _int(_arg(args, "stream"))
    k["device_id"] = np.where(dev >= 0, dev, _int(k["pid"]))
    k["stream_id"] = np.where(stream >= 0, stream, _int(k["tid"]))
    rt = ev[ev["cat_l"].isin(_RUNTIME) & (ev["time_code"] == TIME_OK)]
    rt = pd.DataFrame({
        "correlation_id": _int(_arg(rt["args"], "correlation")),
        "launch_ns": rt["start_ns"].to_numpy("int64"),
        "launch_tid": _int(rt["tid"]),
        "pid": _int(rt["pid"]),
    })
    rt = rt[rt["correlation_id"] >= 0].drop_duplicates("correlation_id")
    k = k.drop(columns=["pid"]).merge(rt, on="correlation_id", how="left")
    k["name"] = k["name"].fillna("").astype(str)
    codes, uniques = pd.factorize(k["name"])
    k["short_name"] = np.asarray([short_kernel_name(u) for u in uniques], dtype=object)[codes]
    k["duration_ns"] = k["end_ns"] - k["start_ns"]
    k = k.sort_values("start_ns", kind="stable")
    return finish_frame(k, KERNEL_COLUMNS)


def _ranges(ev: pd.DataFrame, warnings: list[str]) -> pd.DataFrame:
    r = drop_bad_times(ev[ev["cat_l"].isin(_ANNOTATION)], "range rows", warnings)
    if r.empty:
        return empty_frame(RANGE_COLUMNS)
    r["tid"] = _int(r["tid"])
    r["pid"] = _int(r["pid"])
    r["domain"] = "user_annotation"
    r["name"] = r["name"].fillna("").astype(str)
    r = r.sort_values(["start_ns", "end_ns"], ascending=[True, False], kind="stable").reset_index(drop=True)
    r["range_id"] = np.arange(len(r), dtype="int64")
    r["depth"] = nesting_depth(r["start_ns"].to_numpy("int64"), r["end_ns"].to_numpy("int64"), r["tid"].to_numpy("int64"))
    return finish_frame(r, RANGE_COLUMNS)


def _memops(ev: pd.DataFrame, warnings: list[str]) -> pd.DataFrame:
    m = drop_bad_times(ev[ev["cat_l"].isin(_MEMCPY | _MEMSET)], "memcpy/memset rows", warnings)
    if m.empty:
        return empty_frame(MEMOP_COLUMNS)
    m["kind"] = np.where(m["cat_l"].isin(_MEMCPY), "memcpy", "memset")
    m["bytes"] = _int(_arg(m["args"], "bytes"))
    m["device_id"] = _int(_arg(m["args"], "device"))
    m["stream_id"] = _int(_arg(m["args"], "stream"))
    m["correlation_id"] = _int(_arg(m["args"], "correlation"))
    m["duration_ns"] = m["end_ns"] - m["start_ns"]
    return finish_frame(m.sort_values("start_ns", kind="stable"), MEMOP_COLUMNS)


def _api(ev: pd.DataFrame, warnings: list[str]) -> pd.DataFrame:
    a = drop_bad_times(ev[ev["cat_l"].isin(_RUNTIME)], "CUDA API rows", warnings)
    if a.empty:
        return empty_frame(API_COLUMNS)
    a["name"] = a["name"].fillna("").astype(str)
    a["tid"] = _int(a["tid"])
    a["pid"] = _int(a["pid"])
    a["correlation_id"] = _int(_arg(a["args"], "correlation"))
    a["duration_ns"] = a["end_ns"] - a["start_ns"]
    return finish_frame(a.sort_values("start_ns", kind="stable"), API_COLUMNS)


def parse_kineto(data: dict, path: str = "") -> Trace:
    """Trace from an already-loaded Kineto JSON object (no emptiness check: a CPU-only trace has ranges
    but no kernels; kernel events with none of valid times are a UserError naming `path`)."""
    ev = _events(data)
    notes: list[str] = []
    warnings: list[str] = []
    kernels = _kernels(ev, warnings, path)
    unlaunched = int((kernels["launch_ns"] < 0).sum())
    if unlaunched:
        notes.append(f"{unlaunched} of {len(kernels)} kernels have no matching runtime launch (not attributed to ranges)")
    span_start, span_end = kernel_span(kernels)
    meta = {
        "source": "kineto",
        "path": path,
        "schema_version": data.get("schemaVersion") if isinstance(data, dict) else None,
        "export_version": None,
        "span_start_ns": span_start,
        "span_end_ns": span_end,
        "notes": notes,
        "warnings": warnings,
    }
    if isinstance(data, dict):
        if data.get("baseTimeNanoseconds") is not None:
            meta["base_time_ns"] = data["baseTimeNanoseconds"]
        props = data.get("deviceProperties")
        gpus = [d["name"] for d in (props if isinstance(props, list) else [])
                if isinstance(d, dict) and isinstance(d.get("name"), str)]
        if gpus:
            meta["gpus"] = gpus
    return Trace(kernels=kernels, ranges=_ranges(ev, warnings), meta=meta, memops=_memops(ev, warnings),
                 api=_api(ev, warnings))


# CPU operators that are process-group collectives (torch.distributed's c10d ops)
_COLLECTIVE = re.compile(r"c10d::", re.IGNORECASE)


def cpu_ops_as_kernels(ev_or_data, warnings: list[str] | None = None) -> pd.DataFrame:
    """The self time of every `cpu_op` event (its time less that of the operators nested in it on its
    thread: the exclusive-time view, torch.profiler's "Self CPU"), in the kernels frame's columns, for
    CPU-only traces. An operator's self time is one row per stretch between its children: `aten::addmm`
    keeps the matrix product it computes itself, the copies nested in it are theirs, and the rows of a
    thread never overlap, so times add up without double counting. The stretches of one operator share
    its correlation_id (a number per operator) and launch_ns (its start): tables count operators, not
    stretches (frames.instance_rows).
    A process-group collective (`c10d::...`: FSDP's all-gather and reduce-scatter, DDP's all-reduce) is
    one row over its whole time, the operators inside it (its buffers, copies, waits) part of it: that
    time is communication. An operator with no self time (its children cover it) is one 0 ns row, so it is
    still counted. launch_tid = tid: range attribution works unchanged. device_id / stream_id are -1.
    Operators with broken times are dropped, with a line in `warnings`."""
    ev = ev_or_data if isinstance(ev_or_data, pd.DataFrame) else _events(ev_or_data)
    ops = drop_bad_times(ev[ev["cat_l"] == "cpu_op"], "CPU operator rows", [] if warnings is None else warnings)
    if ops.empty:
        return empty_frame(KERNEL_COLUMNS)
    ops["tid"] = _int(ops["tid"])
    ops["pid"] = _int(ops["pid"])
    ops = ops.sort_values(["tid", "start_ns", "end_ns"], ascending=[True, True, False], kind="stable")
    tid, start, end = (ops[c].to_numpy("int64") for c in ("tid", "start_ns", "end_ns"))
    names = ops["name"].fillna("").astype(str).to_numpy()
    pids = ops["pid"].to_numpy("int64")
    collective = ops["name"].fillna("").astype(str).str.match(_COLLECTIVE).to_numpy()
    # walk each thread's operators in (start, longest first) order with a stack of the open ones: an
    # operator's stretch runs from where its last child (or its start) left off to its next child's start
    rows: list[tuple] = []
    stack: list[list] = []        # [index, where its next stretch starts]

    def close(top) -> None:
        i, at = top
        if end[i] > at:
            rows.append((at, end[i], i))

    held = np.zeros(len(ops), dtype=bool)     # inside a collective: no row of its own
    for i in range(len(ops)):
        while stack and (tid[stack[-1][0]] != tid[i] or start[i] >= end[stack[-1][0]]):
            close(stack.pop())
        if stack and collective[stack[-1][0]]:
            held[i] = True
            continue              # inside a collective: its time is the collective's
        if stack:
            top = stack[-1]
            if start[i] > top[1]:
                rows.append((top[1], start[i], top[0]))
            top[1] = max(top[1], min(end[i], end[top[0]]))
        stack.append([i, start[i]])
    while stack:
        close(stack.pop())
    # an operator with no self time (its children cover it, or it took 0 ns) is still one: a 0 ns row
    counted = np.zeros(len(ops), dtype=bool)
    counted[[r[2] for r in rows]] = True
    rows += [(start[i], start[i], i) for i in np.flatnonzero(~counted & ~held)]
    seg = np.array(rows, dtype="int64").reshape(-1, 3)
    op = seg[:, 2]
    out = pd.DataFrame({"start_ns": seg[:, 0], "end_ns": seg[:, 1], "name": names[op], "pid": pids[op],
                        "correlation_id": op, "launch_ns": start[op], "launch_tid": tid[op]})
    out["short_name"] = out["name"]
    out["duration_ns"] = out["end_ns"] - out["start_ns"]
    out = out.sort_values(["start_ns", "launch_tid"], kind="stable")
    return finish_frame(out, KERNEL_COLUMNS)


def load_kineto(path: Path) -> Trace:
    """Read a .json or .json.gz Kineto trace (.gz decompressed up to the decompression cap, copy_capped);
    UserError on unreadable JSON or zero kernels."""
    try:
        if path.name.lower().endswith(".gz"):
            buffer = io.BytesIO()
            with gzip.open(path, "rb") as src:
                copy_capped(src, buffer, path)
            text = buffer.getvalue().decode("utf-8")
        else:
            text = path.read_text(encoding="utf-8")
        data = json.loads(text)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise UserError(f"cannot read {path} as a Kineto JSON trace: {e}") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        what = ""
        if isinstance(data, dict) and str(data.get("schema", "")).startswith("swinbench."):
            what = f" (a swinbench {data['schema'].split('/')[0][len('swinbench.'):]} file: `swinbench report` reads records)"
        raise UserError(f"{path} is not a Kineto trace: no traceEvents list{what}")
    trace = parse_kineto(data, str(path))
    if trace.kernels.empty:
        # A CPU-only capture (torch.profiler on the CPU dev box): analyze CPU operators instead, and say so.
        trace.kernels = cpu_ops_as_kernels(data, trace.meta["warnings"])
        if trace.kernels.empty:
            raise UserError(f"empty trace: no GPU kernels and no CPU operators in {path}")
        trace.meta["span_start_ns"], trace.meta["span_end_ns"] = kernel_span(trace.kernels)
        trace.meta["device"] = "cpu"
        trace.meta["notes"].append(
            "no GPU kernels in this trace: the tables show CPU operators (each aten op's self time) instead"
        )
    return trace
