"""The join behind the findings' measured-gain column: what a trace is of (its run.json, its GPU) and the
stored stage records to look its remedies up in (the canonical runs under reports/*/records, or the
records a user names with --records), handed to results.remedy_gains; analysis.findings only receives
the resulting mapping."""
from __future__ import annotations

import json
from pathlib import Path

from workbench.errors import UserError
from workbench.labels import trace_words
from workbench.results.record import StageRecord, read_records
from workbench.results.remedy_gains import RemedyGains, TraceWorkload, remedy_gains

# The canonical runs committed with swinbench: reports/<run>/records/*.json beside the package.
CANONICAL_REPORTS = Path(__file__).resolve().parent.parent.parent / "reports"


def canonical_record_folders(root: Path = CANONICAL_REPORTS) -> list[Path]:
    """The record folders of the canonical runs (reports/*/records holding stage records), sorted."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("*/records") if p.is_dir() and any(p.glob("*.json")))


def gain_records(paths: list[Path] | None) -> list[StageRecord]:
    """The records measured gains are looked up in: those under `paths` (UserError, one line, for a path
    that is missing or holds no valid record), or with None the canonical runs' (a canonical folder that
    cannot be read is skipped: the findings do not depend on it)."""
    if paths:
        return read_records(list(paths))
    out: list[StageRecord] = []
    for folder in canonical_record_folders():
        try:
            out += read_records([folder])
        except UserError:
            continue
    return out


def _run_json(trace: Path) -> dict:
    """The run.json `swinbench profile` writes beside its trace ({} when there is none or it is unreadable)."""
    path = Path(trace).parent / "run.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def trace_workload(trace: Path | None, trace_meta: dict) -> TraceWorkload:
    """Model, mode and batch from the run.json beside `trace`; the GPU's name from the trace (all its GPUs
    of one name), else from that run.json. A CPU trace has no GPU."""
    run = _run_json(trace) if trace is not None else {}
    config = run.get("config") if isinstance(run.get("config"), dict) else {}
    env = run.get("env") if isinstance(run.get("env"), dict) else {}
    gpu = None
    if not trace_words(trace_meta).is_cpu:
        names = sorted({g for g in trace_meta.get("gpus") or [] if isinstance(g, str) and g})
        gpu = names[0] if len(names) == 1 else env.get("gpu") if isinstance(env.get("gpu"), str) else None
    batch = config.get("batch")
    size = config.get("img_size")
    img_size = (tuple(size) if isinstance(size, list) and len(size) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in size) else None)
    return TraceWorkload(model=config.get("model") if isinstance(config.get("model"), str) else None,
                         mode=config.get("mode") if isinstance(config.get("mode"), str) else None,
                         batch=batch if isinstance(batch, int) and not isinstance(batch, bool) else None, gpu=gpu,
                         img_size=img_size)


def findings_gains(records: list[StageRecord], trace: Path | None, trace_meta: dict) -> RemedyGains:
    """The measured gains of the findings' remedies for the trace (results.remedy_gains on its workload)."""
    return remedy_gains(records, trace_workload(trace, trace_meta))
