"""What each finding's remedy gave where swinbench measured it: gains from stored stage records, for the
findings table (workbench/analysis/findings.py takes them as a plain mapping; it never reads a record).

`remedy_gains(records, workload)` keeps the records of the trace's workload: the same model, mode and GPU
name (never another model or GPU; the CPU is never matched: the recipes are accelerator stages), the same
batch where a run of it exists, else the nearest batch, said in each gain ("measured at batch 64"). Only
stages that ran and passed the gate (or are the reference) count. One gain per remedy key:

- `cuda_graph` (findings.GRAPH_KEY): a stage replayed as one CUDA graph against the same stage as written
  (its `graph` timing against its eager step), of the stages whose graph recipes the remedy names:
  block, then dense, then fmha, the first measured;
- a stage name (fmha, apex, window, dense, block): that stage against the nearest stage of its chain
  measured in the same run (fmha against window), graph-replayed where both were, and as written.

The headline `x` is the graph-replayed ratio where there is one (what the remedy saves on the GPU, the
host's launch cost taken out), else the eager one. Among several matching runs, those of the trace's batch
come first, then the nearest batch, then the newest.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from workbench.results.record import StageRecord, as_records

GRAPH_KEY = "cuda_graph"            # the same key as findings.GRAPH_KEY (results may not import analysis)
GRAPH_STAGES = ("block", "dense", "fmha")   # the stages block-graph, dense-graph and fmha-graph replay
KERNEL_STAGES = ("fmha", "apex", "window", "dense", "block")


@dataclass(frozen=True)
class TraceWorkload:
    """What a trace is of, as far as matching records goes. gpu: the GPU's name as records stamp it
    ('NVIDIA H200'); None for a CPU trace or one that does not say."""

    model: str | None
    mode: str | None
    batch: int | None
    gpu: str | None
    img_size: tuple[int, int] | None = None     # where the model was built at another resolution (--img-size)


@dataclass
class RemedyGains:
    """gains: {remedy key: {"x": float, "text": str, "stage", "against", "x_eager", "x_graph", "batch",
    "run_id"}}, what findings.findings takes; note: one line on what matched, or why nothing did."""

    gains: dict[str, dict] = field(default_factory=dict)
    note: str = ""


def _counted(rec: StageRecord) -> bool:
    return rec.ok and rec.step_ms is not None and rec.gate.status in ("PASS", "REFERENCE")


def _graph_ms(rec: StageRecord) -> float | None:
    return rec.graph.step_ms if rec.graph is not None else None


def _fmt(x: float) -> str:
    return f"{x:.2f}x"


def _describe(records: list[StageRecord]) -> str:
    """The workloads the records hold, in words (at most three)."""
    seen = []
    for rec in records:
        what = f"{rec.model} {rec.mode} batch {rec.batch} on {rec.env.device_name}"
        if what not in seen:
            seen.append(what)
    return "; ".join(seen[:3]) + (f"; and {len(seen) - 3} more" if len(seen) > 3 else "")


def _runs(records: list[StageRecord], batch: int | None) -> list[dict[str, StageRecord]]:
    """The matching records grouped by run ({stage: record} of counted stages), best run first."""
    runs: dict[str, dict[str, StageRecord]] = {}
    for rec in records:
        if _counted(rec):
            runs.setdefault(rec.run_id, {}).setdefault(rec.stage, rec)

    def first(stages: dict[str, StageRecord]) -> StageRecord:
        return next(iter(stages.values()))

    newest = sorted(runs.values(), key=lambda s: first(s).env.date or "", reverse=True)
    gap = (lambda b: abs(b - batch)) if batch is not None else (lambda b: 0)
    return sorted(newest, key=lambda s: (gap(first(s).batch), -first(s).batch))   # stable: newest first on ties


def _graph_gain(stages: dict[str, StageRecord]) -> dict | None:
    for name in GRAPH_STAGES:
        rec = stages.get(name)
        graph = _graph_ms(rec) if rec is not None else None
        if graph and rec.step_ms and graph != rec.step_ms:
            x = rec.step_ms / graph
            return {"x": x, "text": f"{_fmt(x)}: {name} graph-replayed vs as written", "stage": name,
                    "against": name, "x_eager": None, "x_graph": x}
    return None


def _stage_gain(name: str, stages: dict[str, StageRecord]) -> dict | None:
    rec = stages.get(name)
    if rec is None:
        return None
    against = next((stages[a] for a in rec.ancestors() if a in stages), None)
    if against is None:
        return None
    x_eager = against.step_ms / rec.step_ms
    ga, gs = _graph_ms(against), _graph_ms(rec)
    x_graph = ga / gs if ga and gs else None
    if x_graph is not None:
        text = f"{_fmt(x_graph)} graph-replayed, {_fmt(x_eager)} as written ({name} vs {against.stage})"
    else:
        text = f"{_fmt(x_eager)} ({name} vs {against.stage})"
    return {"x": x_graph if x_graph is not None else x_eager, "text": text, "stage": name, "against": against.stage,
            "x_eager": x_eager, "x_graph": x_graph}


def remedy_gains(records, workload: TraceWorkload) -> RemedyGains:
    """The measured gains of the remedies for `workload` from stage records (StageRecord or dicts), with
    a note saying which records matched (see the module docstring for the rules)."""
    records = as_records(records)
    if workload.gpu is None:   # a CPU trace: the remedies' gains are GPU figures, nothing to say
        return RemedyGains()
    if workload.model is None:
        return RemedyGains(note="no measured gains: the trace does not say which model it is of (run.json "
                                "beside it, written by `swinbench profile`, does)")
    same = [r for r in records if r.env.on_gpu and r.env.device_name == workload.gpu and r.model == workload.model
            and (workload.mode is None or r.mode == workload.mode) and r.img_size == workload.img_size]
    at = f" at {workload.img_size[0]}x{workload.img_size[1]}" if workload.img_size else ""
    what = f"{workload.model}{at} {workload.mode or ''} on {workload.gpu}".replace("  ", " ")
    if not same:
        held = _describe(records)
        return RemedyGains(note=f"no measured gains: no stored records of {what}"
                                + (f" (the records hold {held})" if held else ""))
    gains: dict[str, dict] = {}
    used: dict[str, int] = {}
    runs = _runs(same, workload.batch)
    for key in (GRAPH_KEY, *KERNEL_STAGES):
        for stages in runs:
            gain = _graph_gain(stages) if key == GRAPH_KEY else _stage_gain(key, stages)
            if gain is None:
                continue
            first = next(iter(stages.values()))
            gain.update(batch=first.batch, run_id=first.run_id)
            if workload.batch is not None and first.batch != workload.batch:
                gain["text"] += f"; measured at batch {first.batch}"
            if math.isfinite(gain["x"]):
                gains[key] = gain
                used[first.run_id] = first.batch
            break
    if not gains:
        return RemedyGains(note=f"no measured gains: the stored records of {what} hold no remedy stage that "
                                "ran and passed the gate")
    listed = ", ".join(f"{run} (batch {b})" for run, b in used.items())
    return RemedyGains(gains, note=f"measured gains: stored records of {what}, run {listed}")
