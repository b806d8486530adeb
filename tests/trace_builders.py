"""Small hand-built traces for the robustness tests: an nsys SQLite export with the tables and columns the
parser reads (no NOT NULL constraints, so a test can store what a damaged export holds) and Kineto JSON
in torch.profiler's shape."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

PID = 935
MAIN_TID = (PID << 24) | PID
GLOBAL_PID = PID << 24
NAMES = {1: "sm90_xmma_gemm_bf16_kernel", 2: "softmax_warp_forward", 3: "cudaLaunchKernel_v7000", 4: "step0",
         5: "step1"}
# (start, end, deviceId, demangledName id): four kernels, 4,000 ns of GPU time on device 0
GOOD_KERNELS = [(1000, 2000, 0, 1), (2500, 3000, 0, 2), (3500, 5000, 0, 1), (5200, 6200, 0, 2)]


def nsys_export(path: Path, kernels, *, strings: bool = True, ranges=((500, 20_000, 4),)) -> Path:
    """An nsys-shaped SQLite file. kernels: (start, end, deviceId, name id) rows, any values SQLite stores;
    kernel i is launched by cudaLaunchKernel correlation i, 100 ns before an integer start (at 0 otherwise),
    from the main thread of process PID. ranges: NVTX push/pop (start, end, text id) on that thread."""
    with sqlite3.connect(path) as con:
        if strings:
            con.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT)")
            con.executemany("INSERT INTO StringIds VALUES (?, ?)", NAMES.items())
        con.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, deviceId INTEGER, "
                    "streamId INTEGER, correlationId INTEGER, globalPid INTEGER, demangledName INTEGER, "
                    "shortName INTEGER)")
        con.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER, end INTEGER, globalTid INTEGER, "
                    "correlationId INTEGER, nameId INTEGER)")
        for i, (start, end, device, name) in enumerate(kernels):
            con.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?, 7, ?, ?, ?, ?)",
                        (start, end, device, i, GLOBAL_PID, name, name))
            launch = start - 100 if isinstance(start, int) and 100 <= start < 2**62 else 0
            con.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, ?, ?, 3)",
                        (launch, launch + 50, MAIN_TID, i))
        con.execute("CREATE TABLE NVTX_EVENTS (start INTEGER, end INTEGER, eventType INTEGER, text TEXT, "
                    "globalTid INTEGER, textId INTEGER, domainId INTEGER)")
        con.executemany("INSERT INTO NVTX_EVENTS VALUES (?, ?, 59, NULL, ?, ?, 0)",
                        [(s, e, MAIN_TID, text) for s, e, text in ranges])
    return path


def kineto_trace(path: Path, kernels, *, step=(0.5, 10.0)) -> Path:
    """A torch.profiler-shaped JSON trace. kernels: (ts, dur, device) in µs, any JSON values; kernel i is
    launched by cudaLaunchKernel correlation i at 0.1 µs from thread 1 of pid 1, inside one `step0`."""
    events = [{"ph": "X", "cat": "user_annotation", "name": "step0", "pid": 1, "tid": 1, "ts": step[0],
               "dur": step[1]}]
    for i, (ts, dur, device) in enumerate(kernels):
        kernel = {"ph": "X", "cat": "kernel", "name": NAMES[1 + i % 2], "pid": device, "tid": 7,
                  "args": {"device": device, "stream": 7, "correlation": i}}
        kernel.update({k: v for k, v in (("ts", ts), ("dur", dur)) if v is not None})
        events += [kernel, {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                            "ts": 0.6 + 0.01 * i, "dur": 0.005, "args": {"correlation": i}}]
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    return path


GEMM = "sm90_xmma_gemm_bf16_kernel"
ALL_REDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"


def rank_trace(path: Path, device: int, *, gemm_us: float, comm_us: float, hidden_us: float, step_us: float,
               steps: int = 2) -> Path:
    """One data-parallel rank's torch.profiler trace: `steps` ranges step0.. of `step_us` each, and in each a
    GEMM of `gemm_us` from the step's start, then an all-reduce of `comm_us` that starts `hidden_us` before
    the GEMM ends (so that much of it runs beside compute), both on GPU `device`, launched from thread 1."""
    events = []
    for s in range(steps):
        t0 = 10.0 + s * step_us
        events.append({"ph": "X", "cat": "user_annotation", "name": f"step{s}", "pid": 1, "tid": 1, "ts": t0,
                       "dur": step_us})
        for j, (name, ts, dur) in enumerate(((GEMM, t0 + 1, gemm_us), (ALL_REDUCE, t0 + 1 + gemm_us - hidden_us,
                                                                        comm_us))):
            corr = 2 * s + j
            events += [{"ph": "X", "cat": "kernel", "name": name, "pid": device, "tid": 7 + j, "ts": ts, "dur": dur,
                        "args": {"device": device, "stream": 7 + j, "correlation": corr}},
                       {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                        "ts": t0 + 0.1 + 0.01 * j, "dur": 0.005, "args": {"correlation": corr}}]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    return path


def rank_folder(folder: Path, ranks: list[dict]) -> Path:
    """A `profile --nproc` output folder: rank<r>/trace.json of rank_trace(**ranks[r]) on GPU r."""
    for r, kwargs in enumerate(ranks):
        rank_trace(folder / f"rank{r}" / "trace.json", r, **kwargs)
    return folder
