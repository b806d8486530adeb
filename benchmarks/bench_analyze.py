"""Time `analyze_trace` end to end on a synthetic 1M-kernel nsys SQLite export.

What a user needs from it: how long `swinbench analyze` (and `diff`, `apply --profile`) take on a large
capture on their machine. A few training steps of a big model under nsys hold hundreds of thousands of
kernels; the design budget is 10 s for a million on 2 CPU cores. It runs on the CPU, no GPU needed.

The file mirrors the real export's tables and columns (CUPTI_ACTIVITY_KIND_KERNEL / _RUNTIME, NVTX_EVENTS,
StringIds, ENUM_NSYS_EVENT_TYPE, META_DATA_EXPORT; DDL as nsys 2025.3 writes it, trimmed to the columns
the parser may read plus a few it must ignore) and the shape of a training trace: steps > forward (12 block
ranges) / backward / optimizer on the main thread, backward kernels launched from a second (autograd)
thread, a few hundred distinct long demangled names.

    python benchmarks/bench_analyze.py        # writes benchmarks/results/analyze.{json,md}

Options: --kernels N (default 1,000,000), --keep PATH (keep the synthetic export), --out-dir DIR.
One flat record: build time (not timed against the budget), load, analysis and total seconds; the sums
the analysis returns are checked against the ones the file was built with.
"""
from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import RESULTS_DIR, add_out_dir_argument, markdown_table, write_results  # noqa: E402
from workbench.analysis.analyze import analyze_trace  # noqa: E402
from workbench.env import environment_stamp  # noqa: E402

DDL = [
    "CREATE TABLE StringIds (id INTEGER NOT NULL PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE ENUM_NSYS_EVENT_TYPE (id INTEGER NOT NULL PRIMARY KEY, name TEXT, label TEXT)",
    "CREATE TABLE META_DATA_EXPORT (name TEXT NOT NULL, value TEXT)",
    """CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT NULL,
        eventClass INTEGER NOT NULL, globalTid INTEGER, correlationId INTEGER, nameId INTEGER NOT NULL,
        returnValue INTEGER NOT NULL, callchainId INTEGER)""",
    """CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL,
        deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, greenContextId INTEGER, streamId INTEGER NOT NULL,
        correlationId INTEGER, globalPid INTEGER, demangledName INTEGER NOT NULL, shortName INTEGER NOT NULL,
        mangledName INTEGER, launchType INTEGER, cacheConfig INTEGER, registersPerThread INTEGER NOT NULL,
        gridX INTEGER NOT NULL, gridY INTEGER NOT NULL, gridZ INTEGER NOT NULL, blockX INTEGER NOT NULL,
        blockY INTEGER NOT NULL, blockZ INTEGER NOT NULL, staticSharedMemory INTEGER NOT NULL,
        dynamicSharedMemory INTEGER NOT NULL, localMemoryPerThread INTEGER NOT NULL,
        localMemoryTotal INTEGER NOT NULL, gridId INTEGER NOT NULL, sharedMemoryExecuted INTEGER,
        graphNodeId INTEGER, sharedMemoryLimitConfig INTEGER)""",
    """CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL,
        rangeId INTEGER, category INTEGER, color INTEGER, text TEXT, globalTid INTEGER, endGlobalTid INTEGER,
        textId INTEGER, domainId INTEGER, uint64Value INTEGER, int64Value INTEGER, doubleValue REAL,
        uint32Value INTEGER, int32Value INTEGER, floatValue REAL, jsonTextId INTEGER, jsonText TEXT,
        binaryData TEXT)""",
]

PID = 935
MAIN_TID = (1 << 48) | (PID << 24) | PID
AUTOGRAD_TID = (1 << 48) | (PID << 24) | (PID + 48)
GLOBAL_PID = (1 << 48) | (PID << 24)
BLOCKS = [f"stage{s}.block{b}" for s, n in enumerate([2, 2, 6, 2]) for b in range(n)]


def kernel_names(n: int = 300) -> list[tuple[str, str]]:
    """(demangled, short) pairs shaped like real ones: templated at::native kernels and cuBLAS nvjet."""
    families = [
        ("elementwise_kernel", "void at::native::elementwise_kernel<(int)128, (int)4, void at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase &)::[lambda() (instance {i})]>(at::TensorIteratorBase &, const T1 &)::[lambda(int) (instance 1)]>(int, T3)"),
        ("vectorized_elementwise_kernel", "void at::native::vectorized_elementwise_kernel<(int)8, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char *, (unsigned long){i}>>(int, T2, T3)"),
        ("reduce_kernel", "void at::native::reduce_kernel<(int)128, (int)4, at::native::ReduceOp<float, at::native::func_wrapper_t<float, at::native::sum_functor<float, float, float>::operator ()(at::TensorIterator &)::[lambda(float, float) (instance {i})]>, unsigned int, float, (int)4, (int)4>>(T3)"),
        ("vectorized_layer_norm_kernel", "void at::native::<unnamed>::vectorized_layer_norm_kernel<float, float, (bool){i}>(int, T2, const T1 *, const T1 *, const T1 *, T2 *, T2 *, T1 *)"),
        ("softmax_warp_forward", "void <unnamed>::softmax_warp_forward<float, float, float, (int){i}, (bool)0, (bool)0>(T2 *, const T1 *, int, int, int, const bool *, int, bool)"),
        ("roll_cuda_kernel", "void at::native::roll_cuda_kernel<float>(const T1 *, T1 *, long, long, long, long, long, long{i})"),
        ("multi_tensor_apply_kernel", "void at::native::<unnamed>::multi_tensor_apply_kernel<at::native::<unnamed>::TensorListMetadata<(int){i}>, at::native::<unnamed>::UnaryOpFunctor<float, (int)2, (int)1, (int)1>, at::native::Sqrt<float>>(T1, T2, T3...)"),
        (None, "nvjet_sm90_tst_192x96_64x5_1x2_h_bz_coopB_bias_TN{i}"),
    ]
    out = []
    for i in range(n):
        short, template = families[i % len(families)]
        name = template.format(i=i)
        out.append((name, short or name))
    return out


def build(path: Path, n_kernels: int, kernels_per_step: int = 4000, seed: int = 0) -> dict:
    """Write the synthetic export; returns the expected totals for a sanity check."""
    rng = np.random.default_rng(seed)
    con = sqlite3.connect(path)
    for ddl in DDL:
        con.execute(ddl)
    names = kernel_names()
    strings = ["swinbench", "forward", "backward", "optimizer", "cudaLaunchKernel", "cudaStreamSynchronize"] + BLOCKS
    strings += [f"step{i}" for i in range(n_kernels // kernels_per_step + 1)]
    string_ids = {s: i for i, s in enumerate(strings)}
    name_ids = []
    for demangled, short in names:
        for s in (demangled, short):
            if s not in string_ids:
                string_ids[s] = len(string_ids)
        name_ids.append((string_ids[demangled], string_ids[short]))
    con.executemany("INSERT INTO StringIds VALUES (?, ?)", [(i, s) for s, i in string_ids.items()])
    con.executemany("INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES (?, ?, ?)",
                    [(34, "NvtxMark", "NvtxMark"), (59, "NvtxPushPopRange", "NvtxPushPopRange"),
                     (60, "NvtxStartEndRange", "NvtxStartEndRange"), (75, "NvtxDomainCreate", "NvtxDomainCreate")])
    con.executemany("INSERT INTO META_DATA_EXPORT VALUES (?, ?)",
                    [("EXPORT_PRODUCT_VERSION", "2025.3.2.0"), ("EXPORT_SCHEMA_VERSION", "3.20.3")])

    # Launches: 4 us apart on the CPU; kernels run 3..40 us each, queued behind one another on stream 7.
    launch = 1_000_000_000 + np.arange(n_kernels, dtype=np.int64) * 4_000
    dur = rng.integers(3_000, 40_000, n_kernels)
    start = np.maximum(launch + 5_000, 0)
    end_prev = np.maximum.accumulate(start + dur)  # serialize: each starts after the previous ends
    start = np.r_[start[0], np.maximum(start[1:], end_prev[:-1])]
    end = start + dur
    which = rng.integers(0, len(names), n_kernels)
    demangled = np.array([a for a, _ in name_ids])[which]
    short = np.array([b for _, b in name_ids])[which]
    step = np.arange(n_kernels) // kernels_per_step
    pos = np.arange(n_kernels) % kernels_per_step
    phase = np.select([pos < 1300, pos < 3600], [0, 1], 2)  # forward / backward / optimizer
    tid = np.where(phase == 1, AUTOGRAD_TID, MAIN_TID)
    corr = np.arange(n_kernels, dtype=np.int64) * 2 + 10

    con.executemany(
        "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL (start, end, deviceId, contextId, streamId, correlationId, globalPid, "
        "demangledName, shortName, registersPerThread, gridX, gridY, gridZ, blockX, blockY, blockZ, staticSharedMemory, "
        "dynamicSharedMemory, localMemoryPerThread, localMemoryTotal, gridId) "
        "VALUES (?, ?, 0, 1, 7, ?, ?, ?, ?, 32, 128, 1, 1, 128, 1, 1, 0, 0, 0, 0, ?)",
        zip(start.tolist(), end.tolist(), corr.tolist(), [GLOBAL_PID] * n_kernels, demangled.tolist(), short.tolist(),
            range(n_kernels)),
    )
    launch_name = string_ids["cudaLaunchKernel"]
    sync_name = string_ids["cudaStreamSynchronize"]
    runtime = zip(launch.tolist(), (launch + 2_500).tolist(), tid.tolist(), corr.tolist())
    con.executemany(f"INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 1, ?, ?, {launch_name}, 0, NULL)", runtime)
    # A sync per step: runtime rows without kernels, as real traces have.
    n_steps = int(step.max()) + 1
    step_first = np.arange(n_steps) * kernels_per_step
    step_last = np.minimum(step_first + kernels_per_step, n_kernels) - 1
    con.executemany(f"INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 1, {MAIN_TID}, ?, {sync_name}, 0, NULL)",
                    [(int(launch[l]) + 3_000, int(launch[l]) + 3_500, int(corr[l]) + 1) for l in step_last])

    # NVTX: domain, then per step: step > forward > 12 blocks, backward, optimizer (all on the main thread).
    nvtx = [(500_000_000, None, 75, "swinbench", MAIN_TID, None, 1)]
    for s in range(n_steps):
        f, l = int(step_first[s]), int(step_last[s])
        idx = np.arange(f, l + 1)
        fw, bw, op = idx[phase[idx] == 0], idx[phase[idx] == 1], idx[phase[idx] == 2]
        t0, t1 = int(launch[f]) - 500, int(launch[l]) + 3_600
        nvtx.append((t0, t1, 59, None, MAIN_TID, string_ids[f"step{s}"], 1))
        for ph_name, ph_idx in (("forward", fw), ("backward", bw), ("optimizer", op)):
            if len(ph_idx):
                nvtx.append((int(launch[ph_idx[0]]) - 100, int(launch[ph_idx[-1]]) + 2_600, 59, None, MAIN_TID,
                             string_ids[ph_name], 1))
        for b, chunk in enumerate(np.array_split(fw, len(BLOCKS))):
            if len(chunk):
                nvtx.append((int(launch[chunk[0]]) - 50, int(launch[chunk[-1]]) + 2_550, 59, None, MAIN_TID,
                             string_ids[BLOCKS[b]], 1))
    con.executemany("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, textId, domainId) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)", nvtx)
    con.commit()
    con.close()
    return {"kernels": n_kernels, "total_ns": int(dur.sum()), "ranges": len(nvtx) - 1,
            "backward_ns": int(dur[phase == 1].sum())}


BUDGET_S = 10.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=1_000_000, help="kernels in the synthetic export")
    parser.add_argument("--keep", type=Path, default=None, help="write the synthetic export here and keep it")
    add_out_dir_argument(parser, cpu_measures=True)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="swinbench-bench-") as tmp:
        path = args.keep or Path(tmp) / "synthetic_1m.sqlite"
        if path.exists():
            path.unlink()
        t0 = time.perf_counter()
        expected = build(path, args.kernels)
        t_build = time.perf_counter() - t0

        from workbench.trace import load_trace
        t0 = time.perf_counter()
        load_trace(path)
        t_load = time.perf_counter() - t0

        t0 = time.perf_counter()
        result = analyze_trace(path)
        t_total = time.perf_counter() - t0

    kernel_total = int(result.kernels["total_ns"].sum())
    backward = result.ranges.set_index("range").loc["backward", "gpu_ns"]
    assert kernel_total == expected["total_ns"], (kernel_total, expected["total_ns"])
    assert int(backward) == expected["backward_ns"], (backward, expected["backward_ns"])
    record = {
        "bench": "analyze_trace", "kernels": expected["kernels"], "nvtx_ranges": expected["ranges"],
        "build_s": round(t_build, 2), "load_s": round(t_load, 2), "analyze_total_s": round(t_total, 2),
        "cpu_count": os.cpu_count(), "budget_s": BUDGET_S, "within_budget": t_total < BUDGET_S,
    }
    print(json.dumps(record))
    print(f"analyze_trace on {expected['kernels']:,} kernels: {t_total:.2f} s (load {t_load:.2f} s)")
    table = markdown_table(
        ["kernels", "NVTX ranges", "CPU cores", "parse s", "parse + analysis s", f"within {BUDGET_S:g} s"],
        [[f"{record['kernels']:,}", f"{record['nvtx_ranges']:,}", record["cpu_count"], f"{t_load:.2f}",
          f"{t_total:.2f}", "yes" if record["within_budget"] else "NO"]])
    for path in write_results(
            args.out_dir or RESULTS_DIR, "analyze", title="`analyze_trace` on a synthetic nsys export",
            stamp=environment_stamp("cpu"), settings={"kernels": args.kernels}, records=[record], table=table, cpu_measures=True,
            notes=["The export has the tables and columns nsys writes, steps of forward / backward / optimizer "
                   "ranges, backward kernels launched from a second thread and a few hundred long demangled names."]):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
