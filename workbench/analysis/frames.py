"""Pure analyses of trace frames (see workbench/trace/__init__.py for the columns).

Each function takes frames and returns a new frame; none reads a file or prints. Shares are always
`part / sum over ALL kernels in the given frame * 100`, the definition nsys's `cuda_gpu_kern_sum` uses, so
a kernel table, a category table and a range table built from the same frame agree on the denominator.

Range attribution (range_table, kernels_in_range, attribute_ranges): a kernel belongs to range R when the
CPU start of its launching runtime call (`launch_ns`) lies in [R.start_ns, R.end_ns] and it was launched by
R's process (same `pid`), on any thread. Same-process rather than same-thread is what makes training traces
come out right: autograd runs backward on its own thread, so the kernels of `loss.backward()` are launched
from a thread that never pushed the `backward` range. Forward-hook ranges (`stage{s}.block{b}`) only exist
while the main thread runs forward, when no other thread launches work, so matching by time alone is safe
for them too. Kernels with no known launch (launch_ns = -1) belong to no range. Nested ranges are
inclusive: a kernel in `forward` also counts in the `step{i}` around it. A range table counts a kernel at
most once per range name, even where instances of one name nest or overlap (a recursive range, the same
name on two threads), so a range's share never exceeds 100%.

Several GPUs: shares are of one device's kernel time. `per_device` runs any table function once per
`device_id` and stacks the results under a leading `device` column; a trace on one device keeps the
tables without that column.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from workbench.analysis.categories import categorize
from workbench.errors import UserError

KERNEL_TABLE_COLUMNS = ["kernel", "instances", "total_ns", "avg_ns", "med_ns", "min_ns", "max_ns", "share_pct"]
CATEGORY_TABLE_COLUMNS = ["category", "instances", "total_ns", "share_pct"]
RANGE_TABLE_COLUMNS = ["range", "instances", "kernels", "gpu_ns", "avg_gpu_ns", "share_pct"]
BUSY_COLUMNS = ["metric", "ns", "pct"]


def _share(part, total: int) -> np.ndarray:
    part = np.asarray(part, dtype="float64")
    return part * 100.0 / total if total else np.zeros(len(part))


def _cpu_operator_rows(kernels: pd.DataFrame) -> np.ndarray:
    if "device_id" not in kernels or "correlation_id" not in kernels:
        return np.zeros(len(kernels), dtype=bool)
    return (kernels["device_id"].to_numpy("int64") < 0) & (kernels["correlation_id"].to_numpy("int64") >= 0)


def instance_rows(kernels: pd.DataFrame) -> np.ndarray:
    """Which rows begin a kernel or operator: every GPU kernel; of a CPU operator's self-time stretches
    (device_id -1, one correlation_id per operator: trace.kineto.cpu_ops_as_kernels) only the first. Counts
    are of these rows, so an operator split by the operators nested in it counts once."""
    if kernels.empty:
        return np.zeros(0, dtype=bool)
    cpu = _cpu_operator_rows(kernels)
    if not cpu.any():
        return np.ones(len(kernels), dtype=bool)
    later = np.zeros(len(kernels), dtype=bool)
    later[cpu] = kernels["correlation_id"][cpu].duplicated().to_numpy()
    return ~later


def _per_instance(kernels: pd.DataFrame, name_col: str) -> tuple[pd.Series, np.ndarray]:
    """(name, duration ns) of each kernel or operator: a CPU operator's stretches summed into one."""
    cpu = _cpu_operator_rows(kernels)
    if not cpu.any():
        return kernels[name_col], kernels["duration_ns"].to_numpy(dtype="int64")
    ops = kernels[cpu].groupby("correlation_id", sort=False).agg(name=(name_col, "first"), ns=("duration_ns", "sum"))
    names = pd.concat([kernels.loc[~cpu, name_col], ops["name"]], ignore_index=True)
    return names, np.concatenate([kernels["duration_ns"].to_numpy("int64")[~cpu], ops["ns"].to_numpy("int64")])


def kernel_share_table(kernels: pd.DataFrame, name_col: str = "name") -> pd.DataFrame:
    """One row per distinct `name_col`: instances, total/avg/median/min/max duration (ns), share_pct.

    share_pct = total_ns / sum of duration_ns over all rows of `kernels` * 100. Sorted by total_ns desc
    (then name, so ties are stable). Groups on integer codes, so a million rows take well under a second.
    """
    if kernels.empty:
        return pd.DataFrame({c: [] for c in KERNEL_TABLE_COLUMNS})
    names, dur = _per_instance(kernels, name_col)
    codes, uniques = pd.factorize(names, sort=False)
    stats = pd.Series(dur).groupby(codes).agg(["count", "sum", "mean", "median", "min", "max"])
    total = int(dur.sum())
    table = pd.DataFrame({
        "kernel": np.asarray(uniques, dtype=object)[stats.index.to_numpy()],
        "instances": stats["count"].to_numpy("int64"),
        "total_ns": stats["sum"].to_numpy("int64"),
        "avg_ns": stats["mean"].to_numpy("float64"),
        "med_ns": stats["median"].to_numpy("float64"),
        "min_ns": stats["min"].to_numpy("int64"),
        "max_ns": stats["max"].to_numpy("int64"),
    })
    table["share_pct"] = _share(table["total_ns"], total)
    return table.sort_values(["total_ns", "kernel"], ascending=[False, True], kind="stable").reset_index(drop=True)


def category_share_table(kernels: pd.DataFrame) -> pd.DataFrame:
    """One row per category present (workbench.analysis.categories, on the demangled `name`): instances, total_ns,
    share_pct of all kernel time. Sorted by total_ns desc. Its total_ns sums to the kernels' total exactly.
    """
    if kernels.empty:
        return pd.DataFrame({c: [] for c in CATEGORY_TABLE_COLUMNS})
    names, dur = _per_instance(kernels, "name")
    cats = categorize(names).to_numpy()
    grouped = pd.Series(dur).groupby(cats).agg(["count", "sum"])
    table = pd.DataFrame({
        "category": grouped.index.to_numpy(dtype=object),
        "instances": grouped["count"].to_numpy("int64"),
        "total_ns": grouped["sum"].to_numpy("int64"),
    })
    table["share_pct"] = _share(table["total_ns"], int(kernels["duration_ns"].sum()))
    return table.sort_values(["total_ns", "category"], ascending=[False, True], kind="stable").reset_index(drop=True)


def attribute_ranges(kernels: pd.DataFrame, ranges: pd.DataFrame) -> pd.DataFrame:
    """`ranges` plus two columns per instance: `kernels` (count) and `gpu_ns` (summed kernel duration) of the
    kernels it launched (rule in the module docstring).

    Vectorized: per process, kernels sorted by launch_ns with a prefix sum of duration; each range is two
    np.searchsorted calls, O(R log K). Bounds are inclusive at both ends.
    """
    out = ranges.copy()
    out["kernels"] = np.zeros(len(out), dtype="int64")
    out["gpu_ns"] = np.zeros(len(out), dtype="int64")
    if out.empty or kernels.empty:
        return out
    launched = kernels[kernels["launch_ns"] >= 0]
    counts = np.zeros(len(out), dtype="int64")
    gpu = np.zeros(len(out), dtype="int64")
    r_pid = out["pid"].to_numpy("int64")
    r_start = out["start_ns"].to_numpy("int64")
    r_end = out["end_ns"].to_numpy("int64")
    first = instance_rows(launched)
    for pid, group in launched.groupby("pid", sort=False):  # one iteration per process
        launch = group["launch_ns"].to_numpy("int64")
        order = np.argsort(launch, kind="stable")
        launch = launch[order]
        prefix = np.concatenate([[0], np.cumsum(group["duration_ns"].to_numpy("int64")[order])])
        n_prefix = np.concatenate([[0], np.cumsum(first[launched.index.get_indexer(group.index)][order])])
        mask = r_pid == pid
        lo = np.searchsorted(launch, r_start[mask], side="left")
        hi = np.searchsorted(launch, r_end[mask], side="right")
        counts[mask] = n_prefix[hi] - n_prefix[lo]
        gpu[mask] = prefix[hi] - prefix[lo]
    out["kernels"] = counts
    out["gpu_ns"] = gpu
    return out


def _launched_in_union(kernels: pd.DataFrame, ranges: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(kernels, gpu_ns) per distinct name of `ranges` (in pd.factorize order): the kernels launched inside
    the union of that name's instances, per process, so each kernel counts once per name.

    Per process, kernels sorted by launch_ns with a prefix sum of duration; each name's instances merged
    into disjoint blocks (sort by start, running max of end); two np.searchsorted calls per block.
    """
    codes, names = pd.factorize(ranges["name"], sort=False)
    counts = np.zeros(len(names), dtype="int64")
    gpu = np.zeros(len(names), dtype="int64")
    launched = kernels[kernels["launch_ns"] >= 0]
    first = instance_rows(launched)
    by_pid = {}
    for pid, group in launched.groupby("pid", sort=False):  # one iteration per process
        launch = group["launch_ns"].to_numpy("int64")
        order = np.argsort(launch, kind="stable")
        by_pid[pid] = (launch[order], np.concatenate([[0], np.cumsum(group["duration_ns"].to_numpy("int64")[order])]),
                       np.concatenate([[0], np.cumsum(first[launched.index.get_indexer(group.index)][order])]))
    r = pd.DataFrame({"code": codes, "pid": ranges["pid"].to_numpy("int64"),
                      "start": ranges["start_ns"].to_numpy("int64"), "end": ranges["end_ns"].to_numpy("int64")})
    for (code, pid), inst in r.groupby(["code", "pid"], sort=False):  # one iteration per (name, process)
        if pid not in by_pid:
            continue
        launch, prefix, n_prefix = by_pid[pid]
        inst = inst.sort_values("start", kind="stable")
        start, reach = inst["start"].to_numpy(), np.maximum.accumulate(inst["end"].to_numpy())
        new_block = np.r_[True, start[1:] > reach[:-1]]
        block_end = reach[np.r_[np.flatnonzero(new_block)[1:] - 1, len(start) - 1]]
        lo = np.searchsorted(launch, start[new_block], side="left")
        hi = np.searchsorted(launch, block_end, side="right")
        counts[code] += int((n_prefix[hi] - n_prefix[lo]).sum())
        gpu[code] += int((prefix[hi] - prefix[lo]).sum())
    return counts, gpu


def range_table(trace, domain: str | None = None, kernels: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per range name: instances, kernels launched (each counted once however many instances of
    the name hold its launch), gpu_ns (their summed duration; nested ranges of other names inclusive),
    avg_gpu_ns per instance, share_pct of all kernel time in `kernels` (default trace.kernels), so at most
    100. Sorted by gpu_ns desc. `domain` keeps only ranges of that NVTX domain.
    """
    kernels = trace.kernels if kernels is None else kernels
    ranges = trace.ranges if domain is None else trace.ranges[trace.ranges["domain"] == domain]
    if ranges.empty:
        return pd.DataFrame({c: [] for c in RANGE_TABLE_COLUMNS})
    n_kernels, gpu_ns = _launched_in_union(kernels, ranges)
    grouped = ranges.groupby(pd.factorize(ranges["name"], sort=False)[0], sort=True).agg(
        range=("name", "first"), instances=("range_id", "size"), first=("start_ns", "min"))
    table = pd.DataFrame({
        "range": grouped["range"].to_numpy(dtype=object),
        "instances": grouped["instances"].to_numpy("int64"),
        "kernels": n_kernels,
        "gpu_ns": gpu_ns,
        "first": grouped["first"].to_numpy("int64"),
    })
    table["avg_gpu_ns"] = table["gpu_ns"] / table["instances"]
    table["share_pct"] = _share(table["gpu_ns"], int(kernels["duration_ns"].sum()))
    table = table.sort_values(["gpu_ns", "first"], ascending=[False, True], kind="stable")
    return table[RANGE_TABLE_COLUMNS].reset_index(drop=True)


def per_device(kernels: pd.DataFrame, table) -> pd.DataFrame:
    """`table(kernels of one device)` for each device_id of `kernels`, stacked by stack_devices; each
    device's shares are of its own kernel time."""
    return stack_devices({int(d): table(group) for d, group in kernels.groupby("device_id", sort=True)})


def stack_devices(tables: dict[int, pd.DataFrame]) -> pd.DataFrame:
    """{device: table} -> one frame: the tables in ascending device order under a leading int64 `device`
    column."""
    frames = []
    for device in sorted(tables):  # one iteration per GPU
        t = tables[device].copy()
        t.insert(0, "device", np.full(len(t), device, dtype="int64"))
        frames.append(t)
    return pd.concat(frames, ignore_index=True)


def range_instance_of(kernels: pd.DataFrame, instances: pd.DataFrame) -> np.ndarray:
    """For each kernel whose launch lies inside an instance in `instances` of the same process, the
    range_id of the first instance of its block (instances that overlap, or nest, merged into one block:
    the same name pushed again inside itself, or on two threads); -1 for a kernel launched outside them.
    Disjoint instances (steps) are each their own block.
    """
    result = np.full(len(kernels), -1, dtype="int64")
    k_pid = kernels["pid"].to_numpy("int64")
    k_launch = kernels["launch_ns"].to_numpy("int64")
    for pid, inst in instances.groupby("pid", sort=False):  # one iteration per process
        inst = inst.sort_values("start_ns", kind="stable")
        starts = inst["start_ns"].to_numpy("int64")
        reach = np.maximum.accumulate(inst["end_ns"].to_numpy("int64"))  # covers overlapping instances too
        ids = inst["range_id"].to_numpy("int64")
        new_block = np.r_[True, starts[1:] > reach[:-1]]
        first = np.flatnonzero(new_block)[np.cumsum(new_block) - 1]      # each instance's block's first one
        sel = np.flatnonzero((k_pid == pid) & (k_launch >= 0))
        idx = np.searchsorted(starts, k_launch[sel], side="right") - 1
        ok = idx >= 0
        ok[ok] = k_launch[sel][ok] <= reach[idx[ok]]
        result[sel[ok]] = ids[first[idx[ok]]]
    return result


def kernels_in_range(trace, name: str) -> pd.DataFrame:
    """The rows of trace.kernels launched inside any instance of the range called `name`.

    Raises UserError listing some available range names when no range is called `name`.
    """
    instances = trace.ranges[trace.ranges["name"] == name]
    if instances.empty:
        names = pd.unique(trace.ranges["name"])
        shown = ", ".join(map(str, names[:8])) + (f", ... ({len(names)} names)" if len(names) > 8 else "")
        raise UserError(f"no range named {name!r} in the trace; available: {shown or 'none (trace has no ranges)'}")
    inside = range_instance_of(trace.kernels, instances) >= 0
    return trace.kernels[inside].reset_index(drop=True)


def _union_ns(start: np.ndarray, end: np.ndarray) -> int:
    """Length of the union of [start, end) intervals: sort, running max of ends, sum the merged blocks."""
    if len(start) == 0:
        return 0
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    reach = np.maximum.accumulate(e)
    new_block = np.r_[True, s[1:] > reach[:-1]]
    block_start = s[new_block]
    block_end = reach[np.r_[np.flatnonzero(new_block)[1:] - 1, len(s) - 1]]
    return int((block_end - block_start).sum())


def busy_idle(kernels: pd.DataFrame, span_start_ns: int | None = None, span_end_ns: int | None = None) -> pd.DataFrame:
    """GPU busy vs idle over a span: rows span, busy, idle, kernel_sum; `pct` is of the span.

    busy = length of the union of kernel intervals clipped to the span (overlapping kernels on several
    streams count once); idle = span - busy; kernel_sum = summed kernel durations inside the span (> busy
    when kernels overlap). Default span: first kernel start to last kernel end. Counts the rows it is given
    (the analyze command passes kernels only, not memcpy/memset).
    """
    start = kernels["start_ns"].to_numpy("int64")
    end = kernels["end_ns"].to_numpy("int64")
    lo = int(start.min()) if span_start_ns is None and len(start) else int(span_start_ns or 0)
    hi = int(end.max()) if span_end_ns is None and len(end) else int(span_end_ns or 0)
    s, e = np.clip(start, lo, hi), np.clip(end, lo, hi)
    keep = e > s
    span = max(hi - lo, 0)
    busy = _union_ns(s[keep], e[keep])
    ns = [span, busy, span - busy, int((e[keep] - s[keep]).sum())]
    return pd.DataFrame({"metric": ["span", "busy", "idle", "kernel_sum"], "ns": ns, "pct": _share(ns, span)})


def fold_tail(table: pd.DataFrame, top: int, label_col: str, sum_cols: list[str], noun: str = "kernels") -> pd.DataFrame:
    """The first `top` rows plus one "other (k kernels)" row holding the exact sums of `sum_cols` over the
    k folded rows (other columns are left empty/NaN). Tables of `top` rows or fewer come back unchanged.
    """
    if len(table) <= top:
        return table.reset_index(drop=True)
    head, tail = table.iloc[:top], table.iloc[top:]
    columns = {}
    for c in table.columns:
        if c == label_col:
            extra = f"other ({len(tail)} {noun})"
        elif c in sum_cols:
            extra = tail[c].sum()
        else:
            extra = None
        columns[c] = head[c].tolist() + [extra]  # `top` rows: small, built directly (no all-NA concat)
    return pd.DataFrame(columns, columns=table.columns)


# ---------------------------------------------------------------- host: CUDA API calls

API_TABLE_COLUMNS = ["call", "kind", "calls", "per_step", "total_ns", "avg_ns", "max_ns", "share_pct"]
# What a call does to the host, by name. `synchronize` blocks the host until the GPU (or a stream or
# event) catches up; `allocation` (cudaMalloc / cudaFree / ...) can synchronize the device as well. In a
# steady training step either one, repeated per step, stalls the launch queue and shows as GPU idle.
_API_KINDS = (
    ("synchronize", ("Synchronize",)),
    ("allocation", ("Malloc", "Free", "HostAlloc", "HostRegister")),
    ("launch", ("LaunchKernel", "cuLaunch", "GraphLaunch")),
    ("copy/set", ("Memcpy", "Memset")),
)
STEP_RANGE = r"^step\d+$"
# The kinds that can drain the launch queue: what `analyze` warns about, `check` counts as blocking calls
# per step and the `apply` report sums in its sync+alloc column.
BLOCKING_KINDS = ("synchronize", "allocation")


def api_kind(name: str) -> str:
    """'synchronize' | 'allocation' | 'launch' | 'copy/set' | 'other' for a CUDA API call name."""
    for kind, needles in _API_KINDS:
        if any(n in name for n in needles):
            return kind
    return "other"


def calls_in_windows(api: pd.DataFrame, windows: pd.DataFrame) -> pd.DataFrame:
    """The API calls that start inside any [start_ns, end_ns] of `windows` (ranges), on any thread of the
    window's process: autograd's thread makes the backward's calls inside a `step` range it never pushed."""
    if api.empty or windows.empty:
        return api.iloc[:0]
    start = api["start_ns"].to_numpy("int64")
    pid = api["pid"].to_numpy("int64")
    keep = np.zeros(len(api), dtype=bool)
    for w_pid, group in windows.groupby("pid", sort=False):
        lo, hi = group["start_ns"].to_numpy("int64"), group["end_ns"].to_numpy("int64")
        order = np.argsort(lo, kind="stable")
        lo, hi = lo[order], np.maximum.accumulate(hi[order])
        i = np.searchsorted(lo, start, side="right") - 1
        inside = (i >= 0) & (start <= hi[np.clip(i, 0, None)])
        keep |= inside & ((pid == w_pid) | (w_pid < 0) | (pid < 0))
    return api[keep]


def api_table(api: pd.DataFrame, steps: int | None = None) -> pd.DataFrame:
    """One row per API call name, most host time first: kind, calls, calls per step (when `steps`),
    total / average / longest duration and the share of all API time in the frame."""
    if api.empty:
        return pd.DataFrame({c: pd.Series([], dtype=object if c in ("call", "kind") else "float64")
                             for c in API_TABLE_COLUMNS})
    g = api.groupby("name", sort=False)["duration_ns"]
    t = pd.DataFrame({"calls": g.size(), "total_ns": g.sum(), "max_ns": g.max()})
    t = t.reset_index().rename(columns={"name": "call"})
    t["kind"] = [api_kind(n) for n in t["call"]]
    t["avg_ns"] = t["total_ns"] / t["calls"]
    t["per_step"] = t["calls"] / steps if steps else np.nan
    t["share_pct"] = _share(t["total_ns"].to_numpy("int64"), int(t["total_ns"].sum()))
    t = t.sort_values(["total_ns", "call"], ascending=[False, True], kind="stable").reset_index(drop=True)
    return t[API_TABLE_COLUMNS]


def api_summary(table: pd.DataFrame) -> dict:
    """{kind: calls per step} (per the whole frame when the table has no step count) from api_table."""
    col = "per_step" if len(table) and table["per_step"].notna().all() else "calls"
    return {str(k): float(v) for k, v in table.groupby("kind")[col].sum().items()}


def blocking_calls(summary: dict) -> float:
    """Synchronizing plus allocating calls in an api_summary (or a record's api_calls_per_step)."""
    return sum(float(summary.get(k, 0.0)) for k in BLOCKING_KINDS)
