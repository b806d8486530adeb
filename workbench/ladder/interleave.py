"""Timing stages in alternation (`swinbench apply --interleave N`).

`apply` times its stages one after another, each in its own process. A stage bound by the GPU gives the
same figure whenever it runs. A stage bound by the host launching kernels gives whatever the host
gives at that minute: on a shared or virtual host its step time can move by tens of percent within
minutes while the GPU work stays the same. Two host-bound stages timed minutes apart can then swap
places.

After the stages have run, `--interleave N` builds every stage that was measured and passed its gate
side by side in one process and times them again in N rounds. Each round runs `block` back-to-back steps
of each stage (CUDA events per step, one synchronize per block, as `timing.time_steps` times them), and
the stages' order rotates from round to round. Every stage's round median is then taken within seconds
of every other stage's, so a ratio of two stages' round medians is free of the slow drift. The median
over rounds of that ratio is the paired speedup. Its quartiles over the rounds say how steady it is.

Each measured record gets an `interleaved` entry: the round medians, the median step and IQR over all
interleaved steps, and the paired ratio against the first interleaved stage and against the stage it
extends (or its nearest interleaved ancestor). The report shows them in their own table.

Every stage lives at once in this process, so the phase needs the sum of the stages' memory: it is
for a handful of stages.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from workbench.ladder.events import print_event
from workbench.files import atomic_write_text
from workbench.results.record import as_records

BLOCK_STEPS = 3        # back-to-back steps per stage per round
WARMUP_STEPS = 3       # untimed steps per stage after it is built (compiles, autotuning, graph capture)


@dataclass
class InterleaveSpec:
    """What the interleaved phase needs, as JSON (it crosses into its own process)."""

    stages: list[dict]     # per stage: {"stage", "stage_ref"}
    config: dict           # WorkloadConfig as a dict
    rounds: int
    block: int = BLOCK_STEPS
    warmup: int = WARMUP_STEPS


def build_stage_workload(config, stage_ref: str):
    """A prepared workload with every pass of `stage_ref`'s recipe chain applied -> (workload, pass results)."""
    from workbench.optimize.recipes import resolve_chain
    from workbench.optimize.workload import Workload

    workload = Workload.build(config)
    results = workload.apply_chain(resolve_chain(stage_ref))
    workload.prepare()
    return workload, results


def time_interleaved(steps: dict[str, Callable[[int], object]], *, rounds: int, block: int, warmup: int,
                     device: torch.device, on_round: Callable[[int, dict[str, list[float]]], None] | None = None
                     ) -> dict[str, dict]:
    """Warm each stage up, then `rounds` rounds of `block` timed steps of each stage, the order rotating
    by one stage per round -> per stage {"samples_ms": every timed step, "round_median_ms": one per round}.
    on_round(r, {stage: that round's step times in ms}) after each round."""
    if rounds < 1 or block < 1:
        raise ValueError("rounds and block must be at least 1")
    names = list(steps)
    cuda = device.type == "cuda"
    for name in names:
        for i in range(warmup):
            steps[name](i)
    if cuda:
        torch.cuda.synchronize(device)
    out = {n: {"samples_ms": [], "round_median_ms": []} for n in names}
    for r in range(rounds):
        k = r % len(names)
        round_ms: dict[str, list[float]] = {}
        for name in names[k:] + names[:k]:
            first = warmup + r * block
            if cuda:
                events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                          for _ in range(block)]
                torch.cuda.synchronize(device)
                for i, (start, end) in enumerate(events):
                    start.record()
                    steps[name](first + i)
                    end.record()
                torch.cuda.synchronize(device)
                times = [s.elapsed_time(e) for s, e in events]
            else:
                times = []
                for i in range(block):
                    t0 = time.perf_counter()
                    steps[name](first + i)
                    times.append((time.perf_counter() - t0) * 1e3)
            round_ms[name] = times
        add_round(out, round_ms)
        if on_round:
            on_round(r, round_ms)
    return out


def add_round(timings: dict[str, dict], round_samples: dict[str, list[float]]) -> int:
    """Add one round's step times ({stage: ms}, as on_round and the "round" event give them) to timings
    in time_interleaved's form (created as needed) -> the number of rounds now in it. What a caller
    that only sees the rounds go by (apply, reading the interleave process's events) keeps, so that the
    rounds already timed survive a run that stops before the last."""
    for name, times in round_samples.items():
        t = timings.setdefault(name, {"samples_ms": [], "round_median_ms": []})
        t["samples_ms"] += times
        t["round_median_ms"].append(statistics.median(times))
    return min(len(t["round_median_ms"]) for t in timings.values())


def paired_ratio(base_rounds: list[float], other_rounds: list[float]) -> dict:
    """How much faster `other` is than `base`, round by round (base round median / other's): the median
    and quartiles over the rounds. The quartiles are the exclusive ones (the sample's own spread widened for
    few rounds: of 2 or 3 rounds, the lowest and the highest), so a round that went the other way keeps a ratio
    of few rounds from reading as significant."""
    ratios = sorted(b / o for b, o in zip(base_rounds, other_rounds) if o > 0)
    if not ratios:
        return {"median": None, "q1": None, "q3": None}
    if len(ratios) == 1:
        return {"median": ratios[0], "q1": ratios[0], "q3": ratios[0]}
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="exclusive")
    # of 2 rounds the exclusive quartiles reach past the sample (even below 0): its lowest and highest
    return {"median": statistics.median(ratios), "q1": max(q1, ratios[0]), "q3": min(q3, ratios[-1])}


def interleaved_entries(records, timings: dict[str, dict], *, rounds: int, block: int,
                        rounds_planned: int | None = None) -> dict[str, dict]:
    """Each interleaved stage's `interleaved` record entry (as records.Interleaved.to_dict gives it) from
    the timings of `time_interleaved` (`rounds` of them timed, of `rounds_planned`: fewer where the run
    stopped early). `records`: StageRecords, or record dicts (validated into them)."""
    records = as_records(records)
    names = [r.stage for r in records if r.stage in timings]
    first = names[0]
    entries = {}
    for rec in records:
        name = rec.stage
        if name not in timings:
            continue
        t = timings[name]
        samples = t["samples_ms"]
        q = statistics.quantiles(samples, n=4, method="inclusive") if len(samples) > 1 else [samples[0]] * 3
        previous = next((a for a in rec.ancestors() if a in timings and a != name), None)
        entries[name] = {
            "rounds": rounds, "rounds_planned": rounds_planned or rounds, "block": block, "with": names,
            "step_ms": statistics.median(samples), "iqr_ms": q[2] - q[0],
            "samples_ms": samples, "round_median_ms": t["round_median_ms"],
            "first_stage": first,
            "x_first": paired_ratio(timings[first]["round_median_ms"], t["round_median_ms"]),
            "previous_stage": previous,
            "x_previous": (paired_ratio(timings[previous]["round_median_ms"], t["round_median_ms"])
                           if previous else None),
        }
    return entries


def run_interleaved_spec(spec: InterleaveSpec, emit: Callable[[dict], None]) -> dict[str, dict]:
    """Build every stage of `spec`, time them in alternation -> {stage: timings} (`time_interleaved`)."""
    from workbench.optimize.workload import WorkloadConfig

    config = WorkloadConfig(**spec.config)
    workloads = {}
    for s in spec.stages:
        emit({"event": "build", "stage": s["stage"]})
        workloads[s["stage"]], _ = build_stage_workload(config, s["stage_ref"])
    device = next(iter(workloads.values())).ctx.device
    return time_interleaved({name: wl.step for name, wl in workloads.items()}, rounds=spec.rounds, block=spec.block,
                            warmup=spec.warmup, device=device,
                            on_round=lambda r, samples: emit({"event": "round", "i": r, "samples_ms": samples}))


def interleave_main(spec_path: str, result_path: str) -> int:
    """Entry point of the interleaved phase's own process: timings written as JSON to result_path."""
    spec = InterleaveSpec(**json.loads(Path(spec_path).read_text()))
    timings = run_interleaved_spec(spec, print_event)
    atomic_write_text(result_path, json.dumps(timings))
    return 0


def spec_json(spec: InterleaveSpec) -> str:
    return json.dumps(asdict(spec), indent=2)


if __name__ == "__main__":
    sys.exit(interleave_main(sys.argv[1], sys.argv[2]))
