"""How close each of swinbench's own kernels runs to its memory floor.

The capture logs one warm-up step's eager Triton launches (`launches.json` beside the trace: each launch's
kernel and the bytes of its tensor arguments, each counted once). Under torch.compile on a GPU Inductor
launches swinbench's kernels itself, out of the log's sight: there the capture logs one step run before the
warm-up with torch.compile forced eager and the compiled code's branches taken (`kernels._common.as_compiled`),
which launches the same kernels with the same arguments in the same order (`forced_eager`). A launch that reads or writes every
element of every argument once must move at least those bytes, so at the GPU's peak memory bandwidth it
cannot take less than

    floor = argument bytes / peak bandwidth

and `floor_pct` = floor / the measured duration: 100% is a kernel running at the HBM limit for the bytes
it is given; above 100%, some of them came from the L2 cache (a previous kernel had just written them).
The floor is the kernel's as designed: buffers it is handed for partial sums, or padding inside a tensor,
count as bytes it must move; what it re-reads (a key block per query block) does not.
The compute floor does not bind for these kernels: the window attention does 4·N²·d FLOPs forward over
about 8·N·d bytes (N/2 FLOPs a byte, 25 at window 7, 72 at window 12; backward about 0.6·N), below the
ridge of any data-centre GPU (an H200: 989 TFLOP/s bf16 over 4.8 TB/s, about 206), and the norm,
partition and reduction kernels do a few FLOPs a byte.

Matching: the trace's instances of a kernel, in start order, repeat the step's launches of that kernel in
launch order (instance i is launch i mod n of the n per step), so each instance gets its launch's bytes.
A kernel whose trace count is no multiple of n, and kernels the log lacks (cuBLAS, PyTorch's own,
Inductor's), get no floor. Peak bandwidths are the vendors' figures (PEAK_GBPS); a GPU not listed gets no
floors, and the table says so.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

# HBM bandwidth in GB/s as the vendor states it, by a substring of torch's device name (the longest one that matches).
PEAK_GBPS = (
    ("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0), ("GH200", 4000.0),
    ("B200", 8000.0), ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0),
    ("L40S", 864.0), ("L40", 864.0), ("L4", 300.0), ("A10", 600.0), ("RTX 4090", 1008.0), ("RTX 6000 Ada", 960.0),
)

COLUMNS = ["kernel", "largest_argument", "calls_per_step", "median_us", "floor_us", "floor_pct", "achieved_gbps",
           "us_per_step", "config"]


def peak_gbps(device_name: str | None) -> float | None:
    """The vendor's HBM bandwidth of the GPU named `device_name` (GB/s), or None when it is not listed."""
    if not device_name:
        return None
    # the longest matching key wins: "H100 PCIe" before "H100", "A100-SXM4-80GB" before "A100"
    hits = [(len(k), v) for k, v in PEAK_GBPS if k in device_name]
    return max(hits)[1] if hits else None


def _label(entry: dict) -> str:
    largest = entry.get("largest")
    if not (isinstance(largest, list) and len(largest) == 2 and isinstance(largest[0], list)):
        return "-"
    return "x".join(str(int(d)) for d in largest[0]) + f" {largest[1]}"


def launch_entry(entry: dict) -> dict:
    """A launch of `launch_log` as launches.json and kernel_floors take it: the kernel, its argument bytes
    and its largest tensor ([shape, dtype])."""
    tensors = entry["tensors"]
    largest = max(tensors, key=lambda t: int(np.prod(t[0], dtype=np.int64)), default=None)
    return {"kernel": entry["kernel"], "bytes": int(entry["bytes"]), "largest": largest,
            **({"config": str(entry["config"])} if entry.get("config") else {})}


def kernel_floors(kernels: pd.DataFrame, launches: dict) -> tuple[pd.DataFrame, dict]:
    """(table, summary) of the logged kernels against their memory floor; see the module docstring.

    table (COLUMNS), one row per kernel and largest-argument shape, most time per step first: calls_per_step, the
    median duration (µs), the floor (µs) and floor_pct, achieved GB/s (argument bytes over the median),
    us_per_step (calls x median). summary: peak_gbps, device_name, steps (trace instances / launches per
    step), kernel_us_per_step and floor_us_per_step over the matched rows, unmatched ({kernel: why}),
    forced_eager (the bytes are of a step run with torch.compile forced eager) and note (why there is no
    table, where there is none)."""
    device = launches.get("device_name")
    peak = peak_gbps(device)
    summary = {"peak_gbps": peak, "device_name": device, "unmatched": {}, "note": None,
               "forced_eager": bool(launches.get("forced_eager"))}
    empty = pd.DataFrame(columns=COLUMNS)
    if not device:
        summary["note"] = "no memory floors: the kernels ran on the CPU (Triton's interpreter), not on a GPU"
        return empty, summary
    if peak is None:
        summary["note"] = (f"no memory floors: the peak bandwidth of {device} is not known to swinbench "
                           "(workbench/analysis/floors.py PEAK_GBPS)")
        return empty, summary
    entries = launches.get("launches") or []
    if not entries:
        summary["note"] = "no memory floors: the logged step launched none of swinbench's Triton kernels"
        return empty, summary
    by_kernel: dict[str, list[dict]] = {}
    for e in entries:
        by_kernel.setdefault(e["kernel"], []).append(e)
    rows, steps_seen = [], set()
    for name, logged in by_kernel.items():
        found = kernels[(kernels["name"] == name) | (kernels["short_name"] == name)].sort_values("start_ns", kind="stable")
        n, m = len(logged), len(found)
        if m == 0:
            summary["unmatched"][name] = "not in the trace"
            continue
        if m % n:
            summary["unmatched"][name] = f"{m} instances in the trace, {n} launches per step"
            continue
        steps_seen.add(m // n)
        nbytes = np.array([logged[i % n]["bytes"] for i in range(m)], dtype=np.float64)
        labels = [_label(logged[i % n]) for i in range(m)]
        configs = [str(logged[i % n].get("config") or "") for i in range(m)]
        part = pd.DataFrame({"label": labels, "bytes": nbytes, "ns": found["duration_ns"].to_numpy(dtype=np.float64),
                             "config": configs})
        # launches of one shape that differ only in a small argument (the shifted blocks' mask) share a
        # row: their calls add up and the floor is of their mean bytes
        for label, g in part.groupby("label", sort=False):
            b = float(g["bytes"].mean())
            median_ns = float(g["ns"].median())
            calls = len(g) / (m // n)
            floor_ns = b / peak            # bytes / (GB/s) = ns
            rows.append({"kernel": name, "largest_argument": label, "calls_per_step": calls,
                         "median_us": median_ns / 1e3, "floor_us": floor_ns / 1e3,
                         "floor_pct": 100.0 * floor_ns / median_ns if median_ns > 0 else np.nan,
                         "achieved_gbps": b / median_ns if median_ns > 0 else np.nan,
                         "us_per_step": calls * median_ns / 1e3,
                         # the autotuner's choice (one per shape; '' for a kernel without one)
                         "config": " | ".join(dict.fromkeys(c for c in g["config"] if c))})
    table = pd.DataFrame(rows, columns=COLUMNS)
    if table.empty:
        summary["note"] = "no memory floors: no logged kernel could be matched to the trace"
        return table, summary
    table = table.sort_values("us_per_step", ascending=False, kind="stable").reset_index(drop=True)
    summary["steps"] = sorted(steps_seen)
    summary["kernel_us_per_step"] = float(table["us_per_step"].sum())
    summary["floor_us_per_step"] = float((table["calls_per_step"] * table["floor_us"]).sum())
    return table, summary
