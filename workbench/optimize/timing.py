"""Timing: CUDA events around each step on the GPU (host clock after synchronize on the CPU),
warm-up excluded, median and interquartile range over the repeats."""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from workbench.kernels._common import cuda_graph_us  # noqa: F401  (the kernels time their own routes with it)


@dataclass
class StepTiming:
    """Per-step times in milliseconds. `clock` says what measured them ('cuda-events' or 'host')."""

    samples_ms: list[float]
    warmup: int
    clock: str

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def iqr_ms(self) -> float:
        if len(self.samples_ms) < 4:
            return max(self.samples_ms) - min(self.samples_ms)
        q = statistics.quantiles(self.samples_ms, n=4, method="inclusive")
        return q[2] - q[0]

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(median_ms=self.median_ms, iqr_ms=self.iqr_ms, repeats=len(self.samples_ms))
        return d


def time_steps(step: Callable[[int], object], *, warmup: int, repeats: int, device: torch.device,
               on_step: Callable[[int], None] | None = None) -> StepTiming:
    """Run `step(i)` warmup + repeats times; time each of the last `repeats` on its own.

    On CUDA, an event pair brackets each step and the host synchronizes once at the end, so the
    steps queue back to back as in real training; on the CPU, each step is timed with perf_counter.
    `on_step(i)` is called after each step (progress bars).
    """
    for i in range(warmup):
        step(i)
        if on_step:
            on_step(i)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for r, (start, end) in enumerate(events):
            start.record()
            step(warmup + r)
            end.record()
            if on_step:
                on_step(warmup + r)
        torch.cuda.synchronize(device)
        return StepTiming([s.elapsed_time(e) for s, e in events], warmup, "cuda-events")
    samples = []
    for r in range(repeats):
        t0 = time.perf_counter()
        step(warmup + r)
        samples.append((time.perf_counter() - t0) * 1e3)
        if on_step:
            on_step(warmup + r)
    return StepTiming(samples, warmup, "host")


def per_call_us(fns: list[Callable[[], object]], *, loops: int = 5, calls: int = 10) -> tuple[float, float, float]:
    """(median, p20, p80) microseconds per plain call, host launch cost included: CUDA events (or the
    host clock without a GPU) around `calls` back-to-back calls round robin over `fns`, `loops` times,
    after one warm call of each. What eager code pays on this host, beside `cuda_graph_us`."""
    on_gpu = torch.cuda.is_available()
    for fn in fns:
        fn()
    if on_gpu:
        torch.cuda.synchronize()
    times = []
    for _ in range(loops):
        if on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(calls):
                fns[i % len(fns)]()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / calls)
        else:
            t0 = time.perf_counter()
            for i in range(calls):
                fns[i % len(fns)]()
            times.append((time.perf_counter() - t0) * 1e6 / calls)
    if len(times) == 1:
        return times[0], times[0], times[0]
    q = statistics.quantiles(times, n=10, method="inclusive")
    return statistics.median(times), q[1], q[7]


def gpu_kernel_ms(step: Callable[[int], object], *, steps: int, first: int, device: torch.device
                  ) -> tuple[float | None, list[tuple[str, int, int]]]:
    """GPU time per step of `step(i)` as written: the summed duration of every kernel, copy and memset
    it runs on the device, read by torch.profiler (CUPTI) over `steps` steps numbered from `first`
    (None when the profiler sees no GPU activity: no CUPTI here), and those activities as (name,
    start ns, duration ns) in start order. Kernels of concurrent streams add up, so on a step that
    overlaps streams the time can exceed the step's wall time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(first + i)
        torch.cuda.synchronize(device)
    events = sorted(((e.name, int(e.time_range.start * 1e3), int(e.time_range.elapsed_us() * 1e3))
                     for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e[1])
    total_us = sum(e[2] for e in events) / 1e3
    return (total_us / 1e3 / steps if total_us > 0 else None), events
