"""`swinbench apply`: run a recipe stage by stage, each one checked against the baseline, timed and
(optionally) profiled, one stored record per stage, then the report.

Per stage (all on the same seed, so the same initial weights and the same synthetic batch):
  1. build the workload, digest its weights, apply the chain's passes (an unavailable pass makes the
     stage 'not available': reported, not timed);
  2. correctness gate (`gate.py`): one forward + backward against the baseline's, which is computed
     once per run and kept (in memory, or in `<out>/reference.pt` for stage subprocesses);
  3. timing: the first forward + backward (the gate's) is timed on its own and, when the stage
     compiles, reported as compile_s; then `warmup` steps, then `steps` timed steps (median, IQR);
     peak memory on CUDA;
  4. profile (--profile): `capture.backends.capture_workload`, in its own process under nsys (else
     torch.profiler in the stage's process), then the
     category shares from `analyze` and the stage's timeline.png / timeline.json beside its trace.
The record is written to `<out>/records/` as soon as the stage ends, so an interrupted run keeps
every finished stage. Then, with `interleave` rounds (by default CPU_INTERLEAVE_ROUNDS on the CPU, whose
timings drift with the machine's load, and none on a GPU), the stages are timed again in alternation
(`interleave.py`).

Progress: rich bars on a terminal; otherwise (a CI log) one plain line as each stage starts and ends
(stage, img/s, gate) and one per interleaved round.

Process model: with `isolate=True` (the default on CUDA) each stage runs in a fresh Python process
(`python -m workbench.ladder.apply SPEC.json`), so the caching allocator, cuDNN/cuBLAS autotuning and
torch.compile's caches of one stage never reach the next one's timing or peak memory. The parent
only plans, shows progress (the child reports steps on stdout) and renders; it never touches CUDA.
`isolate=False` (the default on the CPU, and for tests) runs stages in this process.
"""
from __future__ import annotations

import datetime as _dt
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from workbench.env import device_label, environment_stamp
from workbench.ladder.events import EVENT_PREFIX, print_event
from workbench.errors import Interrupted, UserError
from workbench.optimize.gate import (GateOutputs, activation_dtypes, capture_parameters, compare, compute_reference, forward_backward,
                   weights_digest)
from workbench.models import check_model_name, default_model_for, own_img_size, parse_img_size
from workbench.ladder.interleave import InterleaveSpec, add_round, interleaved_entries, run_interleaved_spec, spec_json
from workbench.ladder.progress import LadderProgress
from workbench.ladder.reuse import (RecordCache, compile_cache_counts, compile_cache_env, compile_cache_note,
                                    reused_record)
from workbench.files import atomic_write_text
from workbench.kernels._common import launch_log
from workbench.optimize.distributed import check_nproc, check_parallel, oversubscribed_note
from workbench.results.record import SCHEMA, KernelFloor, read_record, write_record
from workbench.optimize.recipes import (StagePlan, as_jsonable, effective_passes, gate_tolerance, graph_recipes,
                                       is_pytorch_alone, plan_stages, resolve_chain)
from workbench.run_folder import FolderClaim, claim_run_folder, newest_time_tag, previous_folder, run_entries
from workbench.optimize.timing import gpu_kernel_ms, time_steps
from workbench.optimize.workload import Workload, WorkloadConfig
from workbench.devices import pick_device, resolve_device

# On the CPU, stages timed one after another drift with the machine's load far more than on a GPU, so
# `apply` times them again in alternation by default there (a few rounds: the tiny Swin's steps are short).
CPU_INTERLEAVE_ROUNDS = 3
# Steps that torch.profiler reads the GPU kernel time of, after the timed steps.
GPU_TIME_STEPS = 3
# Untimed replays before the graph-replayed steps are timed (after the capture's own warm-up steps).
GRAPH_WARMUP = 2
# `apply --recipe auto`: the ladder it runs, by device type: on a GPU the longest chain (with the peers,
# as any GPU run), on the CPU the default CPU ladder; then it recommends the best stage that passed.
AUTO = "auto"
AUTO_LADDER = {"cuda": "block", "cpu": "fmha"}
DEFAULT_RECIPE = "fmha"
STAGES_LABEL = "stages"    # the recipe a run of --stages alone is named by: no recipe's chain ran

@dataclass
class ApplyResult:
    """What `run_apply` wrote: the records (dicts, in stage order), their files and the report."""

    run_id: str
    out_dir: Path
    records_dir: Path
    records: list[dict]
    record_paths: list[Path]
    report_path: Path | None
    failed: list[str] = field(default_factory=list)    # stages with status 'error'
    auto: dict | None = None    # with --recipe auto: report.auto_choice of the run (None: nothing passed)


@dataclass
class StageSpec:
    """Everything one stage needs, as JSON (it crosses into the stage subprocess)."""

    run_id: str
    recipe: str                    # what the user asked for (name or path), for the records
    stage: str
    stage_index: int
    stage_ref: str                 # what resolve_chain takes: a built-in name or a user file path
    recipe_source: str | None      # the user file the stage comes from, None for a built-in
    config: dict                   # WorkloadConfig as a dict
    steps: int
    warmup: int
    profile: bool
    out_dir: str
    reference_path: str | None = None


# ---------------------------------------------------------------- one stage


def _base_record(spec: StageSpec, plan_chain) -> dict:
    cfg = spec.config
    return {
        "schema": SCHEMA, "run_id": spec.run_id, "recipe": spec.recipe, "stage": spec.stage,
        "stage_index": spec.stage_index, "status": "ok", "error": None,
        "extends": plan_chain[-2].name if plan_chain and len(plan_chain) > 1 else None,
        "description": plan_chain[-1].description if plan_chain else "",
        "recipe_source": spec.recipe_source,
        "chain": as_jsonable(plan_chain) if plan_chain else [],
        "model": cfg["model"], "mode": cfg["mode"], "batch": cfg["batch"], "precision": cfg["precision"],
        "device": cfg["device"], "seed": cfg["seed"],
        "env": environment_stamp(cfg["device"]),
        "timing": None, "img_per_s": None, "step_ms": None, "step_iqr_ms": None, "peak_mem_bytes": None,
        "compile_s": None, "first_step_s": None, "optimizer": None,
        "gate": {"status": "SKIP", "tolerance": {}, "metrics": {}, "reason": None},
        "passes": [], "stage_passes": [p.name for p in plan_chain[-1].passes] if plan_chain else [],
        "profile": None, "notes": [], "activation_dtypes": None,
        "graph": None, "graph_note": None, "gpu_time": None,
        "pytorch_alone": is_pytorch_alone(plan_chain) if plan_chain else None, "reused": None,
        **({"checkpoint": _checkpoint_entry(cfg)} if cfg.get("checkpoint") else {}),
        **({"img_size": list(cfg["img_size"])} if cfg.get("img_size") else {}),
    }


def _checkpoint_entry(cfg: dict) -> dict:
    """The record's `checkpoint`: the file, what it says of itself, and the held-out images measured on."""
    from workbench.checkpoints import load_checkpoint

    described = load_checkpoint(cfg["checkpoint"]).describe()
    heldout = cfg.get("heldout") or described.get("data")
    if heldout is None and described.get("format") != "state_dict":
        heldout = "digits (the shipped validation split)"
    return {**described, "heldout": heldout}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_stage(spec: StageSpec, reference: GateOutputs, on_event: Callable[[dict], None] | None = None) -> dict:
    """Run one stage (passes, gate, timing, profile) in this process -> its record (also written)."""
    emit = on_event or (lambda e: None)
    out_dir = Path(spec.out_dir)
    chain = []
    try:
        chain = resolve_chain(spec.stage_ref)
    except UserError as exc:
        record = _base_record(spec, [])
        record.update(status="error", error=str(exc))
        return _finish(record, out_dir, emit)
    record = _base_record(spec, chain)
    config = WorkloadConfig(**spec.config)
    workload = None
    cache_counts = compile_cache_counts()
    try:
        workload = Workload.build(config)
        digest = weights_digest(workload.model)
        params = capture_parameters(workload.model)
        record["passes"] = [result.to_dict() for result in workload.apply_chain(chain)]
        record["precision"] = workload.ctx.precision.name
        record["optimizer"] = None
        if config.mode == "train":
            record["optimizer"] = workload.ctx.optimizer_name + (
                " on fp32 master weights" if workload.ctx.master_weights is not None else "")
        missing = [r for r in record["passes"] if not r["available"]]
        if missing:
            record["status"] = "not available"
            record["error"] = "; ".join(f"{r['name']}: {r['changed']}" for r in missing)
            record["gate"]["reason"] = "not run: a pass is not available"
            return _finish(record, out_dir, emit)

        # 1. gate: the first forward + backward, timed on its own (it compiles when the stage does)
        workload.prepare()
        device = workload.ctx.device
        _sync(device)
        t0 = time.perf_counter()
        outputs = forward_backward(workload, params)
        _sync(device)
        record["first_step_s"] = time.perf_counter() - t0
        if workload.ctx.compile:
            record["compile_s"] = record["first_step_s"]
        outputs.weights_digest = digest
        tolerance = gate_tolerance(chain, record["precision"])
        gate = compare(outputs, reference, tolerance, is_reference=not effective_passes(chain))
        record["gate"] = gate.to_dict()
        emit({"event": "gate", "status": gate.status})
        record["activation_dtypes"] = activation_dtypes(workload)

        # 2. speed
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        timing = time_steps(workload.step, warmup=spec.warmup, repeats=spec.steps, device=device,
                            on_step=lambda i: emit({"event": "step", "i": i}))
        record["timing"] = timing.to_dict()
        record["step_ms"] = timing.median_ms
        record["step_iqr_ms"] = timing.iqr_ms
        record["img_per_s"] = config.batch / (timing.median_ms / 1e3)
        if device.type == "cuda":
            record["peak_mem_bytes"] = torch.cuda.max_memory_allocated(device)
            with launch_log() as log:
                kernel_ms, events = gpu_kernel_ms(workload.step, steps=GPU_TIME_STEPS,
                                                  first=spec.warmup + spec.steps, device=device)
            if kernel_ms is not None:
                record["gpu_time"] = {"kernel_ms": kernel_ms, "busy_pct": 100.0 * kernel_ms / timing.median_ms,
                                      "steps": GPU_TIME_STEPS, "source": "torch.profiler (CUPTI)"}
                try:    # the floors are a reading of the measured steps: failing to take one fails no stage
                    record["gpu_time"].update(_step_floors(workload, log, events, GPU_TIME_STEPS, device))
                except Exception as exc:
                    record["notes"].append(f"no kernel floors: {type(exc).__name__}: "
                                           f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}")
        # 3. the same step replayed as one CUDA graph: what the rung saves on the GPU, the host's cost removed
        _time_graph(workload, spec, record, emit)
    except torch.cuda.OutOfMemoryError:
        record.update(status="error", error=f"out of memory at batch {config.batch}")
    except UserError as exc:
        record.update(status="error", error=str(exc))
    except Exception as exc:  # a broken kernel must not take the other stages down; the log has the traceback
        record.update(status="error", error=f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}")
        log = atomic_write_text(out_dir / "logs" / f"{spec.stage_index:02d}-{spec.stage}.traceback.txt",
                                traceback.format_exc())
        record["notes"].append(f"traceback in {log}")
    finally:
        now = compile_cache_counts()
        note = compile_cache_note({k: now[k] - cache_counts.get(k, 0) for k in now})
        if note:
            record["notes"].append(note)
        if workload is not None and workload.ctx.compile:
            torch._dynamo.reset()   # in-process runs: the next stage must not reuse these graphs
        workload = None
        _free_device_memory()

    # 3. profile, after the timed workload is gone (the capture builds its own)
    if spec.profile and record["status"] == "ok":
        emit({"event": "profile"})
        record["profile"] = _profile_stage(spec, config, record)
    return _finish(record, out_dir, emit)


def _time_graph(workload: Workload, spec: StageSpec, record: dict, emit) -> None:
    """Add the stage's graph-replayed timing (`graph`) or say why there is none (`graph_note`). The record
    as measured so far is written first: a capture that takes the process down loses nothing else. On the
    CPU nothing replays a CUDA graph, reduce-overhead included: no graph timing, whatever the stage."""
    own = workload.own_graphs()
    if own and workload.ctx.device.type == "cuda":
        record["graph"] = {"timing": record["timing"], "img_per_s": record["img_per_s"], "step_ms": record["step_ms"],
                           "step_iqr_ms": record["step_iqr_ms"], "how": own}
        return
    blocker = workload.graph_blocker()
    if blocker:
        record["graph_note"] = blocker
        return
    record["graph_note"] = "the stage process ended while capturing the step as a CUDA graph"
    path = write_record(record, Path(spec.out_dir) / "records")
    emit({"event": "saved", "record": str(path)})
    emit({"event": "graph"})
    device = workload.ctx.device
    try:
        workload.use_graph(True)
        # the capture itself runs three warm-up steps first; replays need no more than a couple
        timing = time_steps(workload.step, warmup=min(spec.warmup, GRAPH_WARMUP), repeats=spec.steps, device=device,
                            on_step=lambda i: emit({"event": "step", "i": i}))
    except torch.cuda.OutOfMemoryError:
        record["graph_note"] = "not captured: out of memory with the graph's own memory pool"
        return
    except Exception as exc:   # a step that cannot be captured (a host sync) is a finding, not a failed stage
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        record["graph_note"] = f"not captured: {type(exc).__name__}: {first}"
        return
    finally:
        workload.use_graph(False)
    record["graph_note"] = None
    record["graph"] = {"timing": timing.to_dict(), "img_per_s": spec.config["batch"] / (timing.median_ms / 1e3),
                       "step_ms": timing.median_ms, "step_iqr_ms": timing.iqr_ms,
                       "how": "the whole step captured once and replayed as one CUDA graph"}


def _finish(record: dict, out_dir: Path, emit) -> dict:
    path = write_record(record, out_dir / "records")
    record["_path"] = str(path)
    emit({"event": "done", "record": str(path), "status": record["status"]})
    return record


def _profile_stage(spec: StageSpec, config: WorkloadConfig, record: dict) -> dict | None:
    """Capture the stage (its own process under nsys), keep its kernel-category shares, in percent, and
    draw its timeline (a timeline that cannot be drawn is a note, not a failed profile)."""
    try:
        from workbench.analysis.analyze import analyze_trace, category_shares
        from workbench.capture.backends import capture_workload
    except ImportError as exc:
        record["notes"].append(f"profile not captured: {exc}")
        return None
    folder = Path(spec.out_dir) / "profiles" / f"{spec.stage_index:02d}-{spec.stage}"
    try:
        # At least two warm-up steps, so a compiled stage's compilation stays out of the capture.
        trace, backend = capture_workload(config, spec.stage, spec.recipe_source, folder, spec.steps,
                                          max(spec.warmup, 2))
        analysis = analyze_trace(trace, name_style="short")
        shares = category_shares(analysis)          # {category: percent of GPU kernel time}
    except (UserError, OSError, RuntimeError, ImportError) as exc:
        record["notes"].append(f"profile failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
        return None
    top = []
    kernels = getattr(analysis, "kernels", None)
    if kernels is not None and {"kernel", "share_pct"} <= set(kernels.columns):
        top = [{"kernel": str(k), "share_pct": float(s)} for k, s in kernels[["kernel", "share_pct"]].head(10).values]
    kernel_ms = float(kernels["total_ns"].sum()) / 1e6 / spec.steps if kernels is not None else None
    per_step = None
    if len(analysis.api) and analysis.trace_meta.get("api_unit") == "step":
        from workbench.analysis.frames import api_summary
        per_step = api_summary(analysis.api)        # {kind: host CUDA calls per step}
    # every kernel's GPU ms and launches per step, so that reports can say what changed between stages
    by_name = []
    if kernels is not None and {"kernel", "total_ns", "instances"} <= set(kernels.columns):
        by_name = [{"kernel": str(k), "ms_per_step": round(float(t) / 1e6 / spec.steps, 5),
                    "per_step": round(float(n) / spec.steps, 3)}
                   for k, t, n in kernels[["kernel", "total_ns", "instances"]].values]
    profile = {"backend": backend, "trace": str(trace), "category_share_pct": shares, "top_kernels": top,
               "kernel_ms_per_step": kernel_ms, "api_calls_per_step": per_step, "kernels_per_step": by_name,
               "timeline": _stage_timeline(spec, config, analysis, trace, folder, record)}
    floors, summary = analysis.floors, analysis.trace_meta.get("floors") or {}
    if floors is not None and len(floors):
        profile["floors"] = _floor_rows(floors)
        profile["floor_peak_gbps"] = summary.get("peak_gbps")
    elif summary.get("note") and summary.get("device_name"):     # a GPU whose bandwidth swinbench lacks
        record["notes"].append(summary["note"])
    return profile


FLOOR_ROWS = 12     # the kernel rows against their memory floor a stage record keeps (most time per step first)


def _floor_rows(table) -> list[dict]:
    """swinbench's kernels against their memory floor (analysis/floors.py) as a record keeps them: the
    FLOOR_ROWS costliest."""
    return [{**{k: str(r[k]) for k in KernelFloor.TEXT}, **{k: round(float(r[k]), 4) for k in KernelFloor.NUMBERS},
             **{k: str(r[k]) for k in KernelFloor.OPTIONAL_TEXT if r.get(k)}}
            for r in table.head(FLOOR_ROWS).to_dict("records")]


def _step_floors(workload: Workload, log: list, events: list, steps: int, device: torch.device) -> dict:
    """gpu_time's floors and floor_peak_gbps ({} where none match): swinbench's kernels in the `steps`
    steps torch.profiler timed (`events`) against their memory floor, the bytes from the launch log of
    those steps (the first step's share of it), or, where the stage compiles (Inductor launches the
    kernels itself, out of the log's sight), of one more step run with torch.compile forced eager
    (Workload.eager_step). A stage replayed as one CUDA graph launches nothing from Python and gets none."""
    import pandas as pd

    from workbench.analysis.floors import kernel_floors, launch_entry

    if workload.ctx.compile:
        with launch_log() as log:
            workload.eager_step()
    elif len(log) % steps:      # steps that launched differently: no one step to hold the trace against
        return {}
    else:
        log = log[:len(log) // steps]
    if not log or not events:
        return {}
    kernels = pd.DataFrame(events, columns=["name", "start_ns", "duration_ns"])
    kernels["short_name"] = kernels["name"]
    table, summary = kernel_floors(kernels, {"device_name": torch.cuda.get_device_name(device),
                                             "launches": [launch_entry(e) for e in log]})
    if table.empty:
        return {}
    return {"floors": _floor_rows(table), "floor_peak_gbps": summary["peak_gbps"]}


def _stage_timeline(spec: StageSpec, config: WorkloadConfig, analysis, trace: Path, folder: Path,
                    record: dict) -> str | None:
    """Write the stage's timeline.png and timeline.json into its profile folder -> the PNG's path relative
    to the run folder (what the report links), or None with a note when it could not be drawn."""
    from workbench.analysis.analyze import trace_origin
    from workbench.analysis.timeline import write_timeline

    title = f"{spec.stage}: {config.model} {config.mode} {config.precision} batch {config.batch}"
    try:
        png, _ = write_timeline(analysis.trace, folder, title=title, origin=trace_origin(trace, folder))
    except (UserError, OSError, ValueError) as exc:
        record["notes"].append(f"timeline not drawn: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
        return None
    return png.relative_to(Path(spec.out_dir)).as_posix()


# ---------------------------------------------------------------- stage subprocess


def _load_reference(path: Path) -> GateOutputs:
    return GateOutputs.from_state(torch.load(path, map_location="cpu", weights_only=True))


def reference_error(exc: BaseException, batch: int) -> str:
    """The error every stage records when the baseline's reference outputs (the gate's) cannot be computed."""
    text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "can't allocate memory" in text:
        return f"out of memory at batch {batch} (baseline reference)"
    return f"baseline reference failed: {text if isinstance(exc, UserError) else f'{type(exc).__name__}: {text}'}"


def stage_main(spec_path: str) -> int:
    """Entry point of a stage subprocess: compute the reference if no stage has yet, run the stage."""
    spec = StageSpec(**json.loads(Path(spec_path).read_text()))
    emit = print_event
    ref_path = Path(spec.reference_path)
    if not ref_path.exists():
        emit({"event": "reference"})
        try:
            ref = compute_reference(WorkloadConfig(**spec.config))
        except Exception as exc:      # every stage is then this error: recorded, never a traceback
            record = _base_record(spec, [])
            record.update(status="error", error=reference_error(exc, spec.config["batch"]))
            _finish(record, Path(spec.out_dir), emit)
            return 0
        tmp = ref_path.with_suffix(".tmp")
        torch.save(ref.to_state(), tmp)
        tmp.replace(ref_path)
        _free_device_memory()
    run_stage(spec, _load_reference(ref_path), emit)
    return 0


def _stream(module: str, args: list[str], log_path: Path, on_event: Callable[[dict], None],
            extra_env: dict[str, str] | None = None) -> int:
    """Run a workbench module in a fresh interpreter that does not import from the current folder
    (`capture.backends.python_module_command`); its stdout events go to on_event, the rest of its output to
    log_path -> its exit code."""
    from workbench.capture.backends import python_module_command, stop_process

    cmd, env = python_module_command(module, *args)
    env = {**(env or os.environ), **(extra_env or {})}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        try:
            for line in proc.stdout:
                if line.startswith(EVENT_PREFIX):
                    on_event(json.loads(line[len(EVENT_PREFIX):]))
                else:
                    log.write(line)
            return proc.wait()
        finally:
            stop_process(proc)   # on Ctrl-C: the child must not write on after this run has released its folder



def _run_isolated(spec: StageSpec, on_event: Callable[[dict], None], extra_env: dict[str, str] | None = None) -> dict:
    """Run a stage in a fresh interpreter; its stdout events drive progress, the rest goes to a log."""
    out_dir = Path(spec.out_dir)
    spec_path = atomic_write_text(out_dir / "logs" / f"{spec.stage_index:02d}-{spec.stage}.spec.json",
                                  json.dumps(asdict(spec), indent=2))
    log_path = out_dir / "logs" / f"{spec.stage_index:02d}-{spec.stage}.log"
    record_path = None

    def on_line(event):
        nonlocal record_path
        on_event(event)
        if event.get("event") in ("done", "saved"):
            record_path = event["record"]

    rc = _stream("workbench.ladder.apply", [str(spec_path)], log_path, on_line, extra_env)
    if record_path and Path(record_path).exists():
        record = read_record(Path(record_path)).to_dict()
        record["_path"] = record_path
        return record
    # The process died before writing its record (a crash in a kernel, a kill): record that.
    chain = []
    try:
        chain = resolve_chain(spec.stage_ref)
    except UserError:
        pass
    record = _base_record(spec, chain)
    tail = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()][-1:] or [""]
    record.update(status="error", error=f"stage process exited {rc}: {tail[0][:200]} (log: {log_path})")
    return _finish(record, out_dir, on_event)


def _complete_rounds(with_rounds: list[dict], rounds: int) -> bool:
    """Whether the records (all kept from the earlier run) already hold interleaved rounds as asked: each
    stage timed `rounds` rounds, all with the same stages."""
    if len(with_rounds) < 2:
        return False
    entries = [r["interleaved"] for r in with_rounds]
    return all(e.get("rounds") == rounds and e.get("with") == entries[0].get("with") for e in entries)


def _interleave(records: list[dict], specs: list[StageSpec], config: WorkloadConfig, rounds: int, isolate: bool,
                out_dir: Path, console, shown: LadderProgress, *, asked: bool = True) -> None:
    """Time every measured stage that passed its gate again, in alternation in one process
    (`interleave.py`), and add each one's `interleaved` entry to its record. The records and the report
    are rewritten after every round, so a run stopped part-way (a time limit, an error, Ctrl-C) keeps the
    rounds it timed. shown: the run's progress display; asked: the user asked for it (else it is the CPU's default, skipped quietly with fewer than two stages)."""
    chosen = [(spec, rec) for spec, rec in zip(specs, records)
              if rec["status"] == "ok" and rec["gate"]["status"] != "FAIL" and rec.get("step_ms") is not None]
    if len(chosen) < 2:
        if asked:
            console.print("[yellow]note:[/] --interleave needs two measured stages that passed the gate; skipped")
        return
    ispec = InterleaveSpec(stages=[{"stage": s.stage, "stage_ref": s.stage_ref} for s, _ in chosen],
                           config=asdict(config), rounds=rounds)
    from workbench.results.report import render_report

    shown.start_rounds(rounds)
    seen: dict[str, dict] = {}  # the rounds timed so far, from the events
    done = 0

    def save(timings: dict, n_rounds: int) -> None:
        entries = interleaved_entries([rec for _, rec in chosen], timings, rounds=n_rounds, block=ispec.block,
                                      rounds_planned=rounds)
        for _, rec in chosen:
            rec["interleaved"] = entries[rec["stage"]]
            write_record({k: v for k, v in rec.items() if k != "_path"}, out_dir / "records")
        render_report(records, out_dir / "report.md")

    def on_event(event):
        nonlocal done
        if event.get("event") == "round" and event.get("samples_ms"):
            timed = add_round(seen, event["samples_ms"])
            save(seen, timed)
            done = timed        # what the records hold: the rounds saved
        shown.round_event(event)

    error = None
    try:
        if isolate:
            logs = out_dir / "logs"
            spec_path, result_path = logs / "interleave.spec.json", logs / "interleave.result.json"
            atomic_write_text(spec_path, spec_json(ispec))
            result_path.unlink(missing_ok=True)
            rc = _stream("workbench.ladder.interleave", [str(spec_path), str(result_path)], logs / "interleave.log",
                         on_event)
            if rc != 0 or not result_path.exists():
                tail = [ln for ln in (logs / "interleave.log").read_text(errors="replace").splitlines() if ln.strip()][-1:]
                raise RuntimeError(f"process exited {rc}: {(tail or [''])[0][:200]} (log: {logs / 'interleave.log'})")
            timings = json.loads(result_path.read_text())
        else:
            timings = run_interleaved_spec(ispec, on_event)
            _free_device_memory()
    except torch.cuda.OutOfMemoryError:
        error = f"out of memory with {len(chosen)} stages built at once"
    except Exception as exc:  # the stages' own records are already written; this phase only adds to them
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
    shown.end_rounds()
    if error:
        kept = (f"; the {done} of {rounds} rounds timed before it stopped are in the records" if done
                else "; the stages' own timings stand")
        console.print(f"[yellow]note:[/] interleaved timing failed: {error}{kept}")
        return
    save(timings, rounds)


def _plan_differences(records: list[dict], plans: list[StagePlan], recipe: str, config: WorkloadConfig, *,
                      steps: int, warmup: int, profile: bool, nproc: int | None = None,
                      parallel: str = "ddp") -> list[str]:
    """What keeps the stage records of a run folder from being continued by the run planned now, one
    phrase each ([]: it can be resumed): records of several runs, stages not in this plan (at their place
    in it), another recipe, model, mode, batch, seed, device kind or GPU, image size, checkpoint or held-out
    data, for measured stages other steps, warm-up or no profile where one is asked for, and data-parallel
    figures of another world size or strategy where `nproc` would measure them again."""
    diffs: dict[str, str] = {}
    runs = sorted({str(r.get("run_id")) for r in records})
    if len(runs) > 1:
        diffs["runs"] = f"records of {len(runs)} runs ({', '.join(runs[:3])})"
    planned = {(i, p.name) for i, p in enumerate(plans)}
    other = [f"{r.get('stage_index')}:{r.get('stage')}" for r in records
             if (r.get("stage_index"), r.get("stage")) not in planned]
    if other:
        listed = ", ".join(other[:4]) + (f" and {len(other) - 4} more" if len(other) > 4 else "")
        diffs["stages"] = (f"stages {listed} there, not in this plan "
                           f"({', '.join(f'{i}:{p.name}' for i, p in enumerate(plans))})")
    want = {"recipe": str(recipe), "model": config.model, "mode": config.mode, "batch": config.batch,
            "seed": config.seed}
    device_type = "cuda" if str(config.device).startswith("cuda") else "cpu"
    gpu = None
    if device_type == "cuda":      # the GPU's name from nvidia-smi: this process never touches CUDA
        from workbench.ladder.reuse import gpu_identity

        gpu = (gpu_identity() or (None,))[0]
    heldout_now = None
    if config.checkpoint:
        try:
            heldout_now = _checkpoint_entry(asdict(config)).get("heldout")
        except UserError:
            heldout_now = config.heldout
    for rec in records:
        for key, value in want.items():
            if rec.get(key) != value:
                diffs.setdefault(key, f"{key} {rec.get(key)!r} there vs {value!r}")
        there = (rec.get("env") or {}).get("device_type")
        if there != device_type:
            diffs.setdefault("device", f"device {there} there vs {device_type}")
        elif gpu is not None and (rec.get("env") or {}).get("gpu") not in (None, gpu):
            diffs.setdefault("gpu", f"GPU {(rec.get('env') or {}).get('gpu')} there vs {gpu}")
        if rec.get("img_size") != config.img_size:
            diffs.setdefault("img_size", f"image size {rec.get('img_size') or 'the model default'} there vs "
                                         f"{config.img_size or 'the model default'}")
        weights = (rec.get("checkpoint") or {}).get("path")
        if weights != config.checkpoint:
            diffs.setdefault("checkpoint", f"checkpoint {weights or 'none'} there vs {config.checkpoint or 'none'}")
        heldout = (rec.get("checkpoint") or {}).get("heldout")
        if config.checkpoint and weights == config.checkpoint and heldout != heldout_now:
            diffs.setdefault("heldout", f"held-out data {heldout} there vs {heldout_now}")
        timing = rec.get("timing") or {}
        if rec.get("status") == "ok" and (timing.get("repeats"), timing.get("warmup")) != (steps, warmup):
            diffs.setdefault("steps", f"steps/warm-up {timing.get('repeats')}/{timing.get('warmup')} there "
                                      f"vs {steps}/{warmup}")
        if rec.get("status") == "ok" and profile and not rec.get("profile"):
            diffs.setdefault("profile", f"stage {rec.get('stage')} not profiled there")
        there = _kept_scaling(rec)
        if nproc is not None and there is not None and there != (nproc, parallel):
            diffs.setdefault("nproc", f"data-parallel figures at {there[0]} processes ({there[1]}) there vs "
                                      f"--nproc {nproc} ({parallel})")
    return list(diffs.values())


def _kept_scaling(record: dict) -> tuple[int, str] | None:
    """(world size, strategy) of a record's data-parallel figures that a resumed run keeps (None: none, or
    an error, which --resume measures again)."""
    scaling = record.get("scaling")
    if not isinstance(scaling, dict) or scaling.get("status") == "error":
        return None
    return scaling.get("world_size"), (scaling.get("ddp") or {}).get("strategy", "ddp")


def _folder_records(records_dir: Path) -> list[dict]:
    """The stage records in records_dir ([] when it has none)."""
    from workbench.results.record import read_records

    if not records_dir.is_dir() or not any(records_dir.glob("*.json")):
        return []
    return [r.to_dict() for r in read_records([records_dir])]   # dicts, as apply holds them


def _refusal(out_dir: Path, entries: list[Path], dest: Path, plans, recipe, config, **plan) -> str:
    """The one line said when out_dir holds an earlier run and neither --resume nor --overwrite was given:
    --resume is offered only when that run's plan is this one's, else what differs is named."""
    moving = f"nothing was changed: --overwrite moves it aside to {dest}"
    try:
        records = _folder_records(out_dir / "records")
    except UserError as exc:
        return f"{out_dir} holds an earlier run whose records cannot be read ({exc}); {moving}, or choose another --out"
    if not records:
        names = ", ".join(e.name for e in entries[:5]) + (", ..." if len(entries) > 5 else "")
        return f"{out_dir} holds an earlier run's files ({names}); {moving}, or choose another --out"
    what = f"{out_dir} holds run {records[0].get('run_id')} ({len(records)} stage records)"
    diffs = _plan_differences(records, plans, recipe, config, **plan)
    if diffs:
        return f"{what} of another plan ({'; '.join(diffs)}); {moving}, or choose another --out"
    return f"{what}; {moving}, --resume continues it, or choose another --out"


def _resumable(out_dir: Path, entries: list[Path], plans, recipe, config, **plan
               ) -> tuple[str | None, dict[tuple[int, str], dict]]:
    """(run id, finished records) of the run in out_dir that --resume continues: the records kept are
    those with status ok or not available (an error is run again), {(stage_index, stage): record}.
    UserError, before anything is written, when that run's plan differs from this one
    (_plan_differences) or the folder holds no stage records but other files of a run (a report of
    records kept elsewhere)."""
    records_dir = out_dir / "records"
    records = _folder_records(records_dir)
    if not records:
        others = [e.name for e in entries if e.name not in ("logs", "reference.pt", "reference.tmp")
                  and not e.name.startswith(".")]
        if others:
            raise UserError(f"cannot resume {out_dir}: it holds no stage records, only {', '.join(others)}; "
                            "nothing was changed (--overwrite moves them aside)")
        return None, {}
    diffs = _plan_differences(records, plans, recipe, config, **plan)
    if diffs:
        dest = previous_folder(out_dir, _earlier_run_id(records_dir) or newest_time_tag(entries))
        raise UserError(f"cannot resume {out_dir}: its run {records[0].get('run_id')} differs from this plan: "
                        f"{'; '.join(diffs)}; nothing was changed: --overwrite moves it aside to {dest}, "
                        "or choose another --out")
    kept = {}
    for rec in records:
        if rec["status"] in ("ok", "not available"):
            rec["_path"] = str(records_dir / f"{rec['stage_index']:02d}-{rec['stage']}.json")
            kept[(rec["stage_index"], rec["stage"])] = rec
    return records[0].get("run_id"), kept


# ---------------------------------------------------------------- the run


def default_run_id(recipe: str, model: str, batch: int, mode: str = "train", img_size=None) -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    short = model.replace("swin_", "").replace("_patch4", "").replace("_window", "w")
    size = f"-{img_size[0]}x{img_size[1]}" if img_size else ""
    return f"{Path(recipe).stem}-{short}{size}-b{batch}{'-infer' if mode == 'infer' else ''}-{stamp}"



def check_steps(steps: int, warmup: int) -> None:
    """--steps and --warmup within what a record holds (results.record.MAX_COUNT), else UserError."""
    from workbench.results.record import MAX_COUNT

    if not (1 <= steps <= MAX_COUNT and 0 <= warmup <= MAX_COUNT):
        raise UserError(f"--steps must be a whole number from 1 to {MAX_COUNT} and --warmup from 0 to {MAX_COUNT}")


def run_apply(recipe: str | None, *, model: str | None, batch: int, steps: int, warmup: int, device: str = "auto",
              out_dir: Path | None = None, profile: bool = False, stages: list[str] | None = None, seed: int = 0,
              progress: bool = True, console=None, isolate: bool | None = None,
              peers: bool | None = None, mode: str = "train", interleave: int | None = None,
              resume: bool = False, overwrite: bool = False, cache_dir: Path | None = None,
              fresh: bool = False, nproc: int | None = None, parallel: str | None = None,
              checkpoint: Path | None = None, data: Path | None = None,
              img_size=None) -> ApplyResult:
    """Run every stage of `recipe` (baseline first), write one record per stage and the report.

    recipe: a built-in name or a YAML path, or 'auto': the ladder of AUTO_LADDER for this device (with
    `stages`, those stages, the records named STAGES_LABEL), then the best configuration that passed the
    gate (report.auto_choice), printed at the end, written in report.md and returned in ApplyResult.auto.
    None: DEFAULT_RECIPE, or with `stages` none: the run and its records are named STAGES_LABEL.
    stages: explicit stage names instead of the chain (a YAML recipe's own stages by name too).
    mode: 'train' (forward, backward, optimizer step; the gate compares logits, loss and gradients) or
    'infer' (forward only under inference_mode; the gate compares logits and loss).
    isolate: a fresh process per stage (default: on CUDA yes, on the CPU no).
    peers: also run the built-in PyTorch-alone peers of the chain (torch-sdpa, torch-compile; torchao's
    for a chain that quantizes); default on CUDA yes,
    on the CPU no (Inductor on the CPU is slow to compile and says nothing about the GPU). Ignored with `stages`.
    interleave: after the stages, time those measured and passing the gate again in this many rounds,
    in alternation in one process (`interleave.py`); 0: off; None: CPU_INTERLEAVE_ROUNDS on the CPU, off
    on a GPU.
    progress: show where the run is: rich bars on a terminal, else (a CI log) one plain line as each
    stage starts and ends.
    out_dir: the run's folder (default reports/runs/<run id>), locked while the run writes it
    (`run_folder.claim_run_folder`). A folder that holds an earlier run is refused (UserError, nothing
    changed) unless `resume` or `overwrite` says what to do with it.
    resume: keep the stages that `out_dir` already holds a finished record of and run only the others;
    refused when that run's plan differs (stages at their places, recipe, model, mode, batch, seed,
    device kind, steps, warm-up, profiling). The kept records keep their run id, which the new ones take too.
    overwrite: move the earlier run's files aside to `<out_dir>.previous-<its run id>` first.
    cache_dir: where measurements and compile caches are kept between runs (`reuse.py`); a GPU stage
    whose measurement that cache already holds under the same conditions is reused, not run, and marked
    so. None: no cache. fresh: measure every stage again (the new records replace the cached ones).
    Raises UserError (exit 2) after writing everything if a stage ended in an error (exit 1 is only for a
    regression that `swinbench check` measures), and Interrupted (a KeyboardInterrupt) on Ctrl-C or
    SIGTERM, after rewriting the report from the stages that finished.
    nproc: after the stages (and interleaved rounds), every measured stage again under torchrun with this
    many processes, DDP, batch per process `batch` (`scaling.py`): its record gets `scaling` (img/s at
    that world size, efficiency against the one-process img/s, the gate on every rank). Training only.
    parallel: with nproc, "ddp" (the default) or "fsdp" (FSDP2: the model sharded over the processes).
    checkpoint: with mode 'infer', trained weights every stage loads (`checkpoints.load_checkpoint`; its
    model is the default `model`): each stage also runs the held-out images (`data`, an ImageFolder, or
    what the checkpoint was trained on) and the gate holds accuracy and top-1 agreement against the
    baseline's where the recipe sets accuracy_drop / top1_agreement (gate.py).
    img_size: '384', '256x320' or (H, W): every stage builds the model at that resolution (default: the
    model name's, or with a checkpoint the one it was trained at).
    """
    from rich.console import Console

    console = console or Console()
    check_steps(steps, warmup)
    if interleave is not None and interleave < 0:
        raise UserError("--interleave must be 0 (off) or a number of rounds")
    device = pick_device(device)
    dev = resolve_device(device)
    on_gpu = dev.type == "cuda"
    if nproc is not None:
        check_nproc(nproc, mode, dev)
    check_parallel(parallel, nproc)
    model, img_size = _with_checkpoint(checkpoint, data, model, mode, parse_img_size(img_size))
    model = model or default_model_for(device)
    check_model_name(model)
    img_size = own_img_size(model, img_size)
    auto = str(recipe) == AUTO
    if auto:    # with `stages` no ladder's chain runs: the records are named as those of `stages` alone
        recipe = None if stages else AUTO_LADDER[dev.type if dev.type in AUTO_LADDER else "cpu"]
    named = recipe if recipe is not None else (STAGES_LABEL if stages else DEFAULT_RECIPE)
    recipe = recipe if recipe is not None else DEFAULT_RECIPE
    plans: list[StagePlan] = plan_stages(recipe, stages, peers=on_gpu if peers is None else peers)
    recipe = named        # what the run id, the records and the report call it
    isolate = on_gpu if isolate is None else isolate
    asked_interleave = interleave is not None
    interleave = interleave if asked_interleave else (0 if on_gpu else CPU_INTERLEAVE_ROUNDS)
    config = WorkloadConfig(model=model, mode=mode, batch=batch, precision="fp32", device=device, seed=seed,
                            checkpoint=None if checkpoint is None else str(Path(checkpoint).resolve()),
                            heldout=None if data is None else str(Path(data).resolve()),
                            img_size=list(img_size) if img_size else None)
    run_id = default_run_id(AUTO if auto else recipe, model, batch, mode, img_size)
    if resume and out_dir is None:
        raise UserError("--resume needs --out: the folder of the run to resume")
    out_dir = Path(out_dir) if out_dir else Path("reports") / "runs" / run_id
    records_dir = out_dir / "records"
    plan = dict(steps=steps, warmup=warmup, profile=profile, nproc=nproc, parallel=parallel or "ddp")
    claim = claim_run_folder(
        out_dir, command="apply", overwrite=overwrite, keep=resume,
        refusal=lambda entries, dest: _refusal(out_dir, entries, dest, plans, recipe, config, **plan),
        previous_tag=lambda entries: _earlier_run_id(records_dir) or newest_time_tag(entries))
    with claim:
        return _run_claimed(claim, recipe, plans, config, run_id, records_dir, console=console, resume=resume,
                            steps=steps, warmup=warmup, profile=profile, isolate=isolate, on_gpu=on_gpu,
                            interleave=interleave, asked_interleave=asked_interleave, progress=progress,
                            cache=RecordCache(cache_dir, on_gpu=on_gpu, fresh=fresh) if cache_dir else None,
                            auto=auto, nproc=nproc, parallel=parallel or "ddp")


def _with_checkpoint(checkpoint: Path | None, data: Path | None, model: str | None, mode: str,
                     img_size: tuple[int, int] | None) -> tuple[str | None, tuple[int, int] | None]:
    """(model, img_size) as a checkpoint sets them where the user did not: the model it names and the
    resolution it was trained at. UserError, before anything runs, for a checkpoint that cannot be
    measured as asked (training mode, another model, a plain state_dict without --model or --data), for
    --data without one, and for a --data that is no ImageFolder of two classes or more."""
    if checkpoint is None:
        if data is not None:
            raise UserError("--data goes with --checkpoint: the held-out images a trained model is measured on")
        return model, img_size
    from workbench.checkpoints import load_checkpoint

    if mode != "infer":
        raise UserError("--checkpoint goes with --mode infer: it measures the trained model's held-out accuracy")
    weights = load_checkpoint(checkpoint)
    if model and weights.model and model != weights.model:
        raise UserError(f"--checkpoint {checkpoint} holds a {weights.model}, not --model {model}")
    if weights.model is None and not model:
        raise UserError(f"--checkpoint {checkpoint} is a plain state_dict, which does not name its model: give --model")
    if weights.meta is None and data is None:
        raise UserError(f"--checkpoint {checkpoint} is a plain state_dict, which does not say what it was trained "
                        "on: give --data DIR (an ImageFolder) to measure it on")
    trained_at = (weights.meta or {}).get("input_size")
    img_size = img_size or (tuple(trained_at[1:]) if trained_at else None)
    if data is not None:    # a folder that is no ImageFolder is refused now, not after the folder is claimed
        from workbench.datasets import ImageFolderData

        ImageFolderData(data, img_size or (224, 224), workers=0)
    return model or weights.model, img_size


def _earlier_run_id(records_dir: Path) -> str | None:
    """The run id in the first readable record of records_dir (to name the folder it is moved aside to)."""
    for path in sorted(records_dir.glob("*.json")) if records_dir.is_dir() else []:
        try:
            run_id = json.loads(path.read_text()).get("run_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(run_id, str) and run_id:
            return run_id
    return None


def _run_claimed(claim: FolderClaim, recipe: str, plans: list[StagePlan], config: WorkloadConfig, run_id: str,
                 records_dir: Path, *, console, resume: bool, steps: int, warmup: int, profile: bool,
                 isolate: bool, on_gpu: bool, interleave: int, asked_interleave: bool,
                 progress: bool, cache: RecordCache | None = None, auto: bool = False,
                 nproc: int | None = None, parallel: str = "ddp") -> ApplyResult:
    """run_apply's work once its folder is claimed: every stage, the interleaved rounds, the scaling runs
    (`nproc`), the report (with `auto`, the best configuration that passed the gate)."""
    from workbench.results.report import (activation_dtype_changes, auto_choice, auto_choice_lines, render_report,
                                          render_speedup_table)

    out_dir = claim.folder
    dev = resolve_device(config.device)
    for note in claim.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    kept: dict[tuple[int, str], dict] = {}
    if resume:
        earlier_id, kept = _resumable(out_dir, run_entries(out_dir), plans, recipe, config, steps=steps,
                                      warmup=warmup, profile=profile, nproc=nproc, parallel=parallel)
        run_id = earlier_id or run_id
    if not on_gpu:
        console.print(f"[yellow]note:[/] {device_label(environment_stamp(dev))}: {config.model}'s CPU step "
                      "times show the workflow, not what the recipes do on a GPU")
        crowded = oversubscribed_note(nproc, dev)
        if crowded:
            console.print(f"[yellow]note:[/] {crowded}", highlight=False)
        if interleave and not asked_interleave and len(plans) > 1:
            console.print(f"[yellow]note:[/] on the CPU the stages are timed again in alternation after they run "
                          f"({interleave} rounds; --interleave 0 turns it off, --interleave N sets the rounds)")

    specs = [StageSpec(run_id=run_id, recipe=str(recipe), stage=p.name, stage_index=i,
                       stage_ref=p.recipe.name if p.recipe.builtin else str(p.recipe.source),
                       recipe_source=p.recipe.user_source, config=asdict(config), steps=steps, warmup=warmup,
                       profile=profile, out_dir=str(out_dir),
                       reference_path=str(out_dir / "reference.pt") if isolate else None)
             for i, p in enumerate(plans)]
    if isolate and not kept:
        (out_dir / "reference.pt").unlink(missing_ok=True)
    if kept:
        console.print(f"resuming {out_dir}: keeping {len(kept)} finished stage(s) "
                      f"({', '.join(name for _, name in sorted(kept))})")

    records: list[dict] = []
    planned = {(spec.stage_index, spec.stage) for spec in specs}
    keys = [cache.key(as_jsonable(p.chain), asdict(config), steps=steps, warmup=warmup, profile=profile,
                      isolate=isolate)
            if cache is not None else None for p in plans]
    extra_env = compile_cache_env(cache.folder) if cache is not None else None
    reused = []

    def finished_now() -> list[dict]:   # after Ctrl-C: the records on disk, else those this process holds
        return _finished_on_disk(records_dir, run_id, planned) or _finished(records, kept)

    with _report_if_interrupted(finished_now, len(specs), out_dir), \
            LadderProgress(console, progress, len(specs)) as shown:
        reference = no_reference = None
        for spec in specs:
            shown.start_stage(spec.stage_index, spec.stage, warmup + steps)
            cached = cache.lookup(keys[spec.stage_index]) if cache is not None else None
            if (spec.stage_index, spec.stage) in kept:
                record = kept[(spec.stage_index, spec.stage)]
                shown.note("kept from the earlier run")
            elif cached is not None:
                record = reused_record(cached, run_id=run_id, recipe=str(recipe), stage_index=spec.stage_index)
                record["_path"] = str(write_record(record, records_dir))
                reused.append(f"{spec.stage} (run {record['reused']['run_id']})")
                shown.note("reused")
            elif isolate:
                record = _run_isolated(spec, shown.event, extra_env)
            else:
                if reference is None and no_reference is None:
                    shown.note("reference")
                    try:
                        reference = compute_reference(config)
                    except Exception as exc:      # every stage is then this error: recorded, never a traceback
                        no_reference = reference_error(exc, config.batch)
                if no_reference is not None:
                    record = _base_record(spec, [])
                    record.update(status="error", error=no_reference)
                    record = _finish(record, out_dir, shown.event)
                else:
                    record = run_stage(spec, reference, shown.event)
            records.append(record)
            if cache is not None and cached is None and (spec.stage_index, spec.stage) not in kept:
                cache.store(keys[spec.stage_index], record, out_dir)   # a kept record: another run's conditions
            shown.end_stage(spec.stage_index, spec.stage, record)
            finished = _finished(records, kept)   # the report holds what has finished, should the run stop here
            render_report(finished, out_dir / "report.md",
                          note=_unfinished_note(len(finished), len(specs)) if len(finished) < len(specs) else None)
        earlier_rounds = [r for r in records if (r.get("interleaved") or {}).get("rounds")]
        if interleave and kept and len(kept) == len(specs) and _complete_rounds(earlier_rounds, interleave):
            console.print(f"[yellow]note:[/] the kept stages hold their {interleave} interleaved rounds: kept, not "
                          "timed again", highlight=False)
        elif interleave:
            reference = None
            _free_device_memory()
            if earlier_rounds:   # paired timings need every stage in one process: the kept ones are timed again
                console.print(f"[yellow]note:[/] the interleaved rounds of {len(earlier_rounds)} kept stage(s) are "
                              "replaced: every stage is timed again in alternation with the others", highlight=False)
            shown.line(f"timing the stages again in alternation: {interleave} rounds")
            _interleave(records, specs, config, interleave, isolate, out_dir, console, shown, asked=asked_interleave)
        if nproc is not None:
            _scale(records, specs, nproc, parallel, shown, extra_env, kept)

    choice = auto_choice(records, graph_recipes()) if auto else None
    report_path = render_report(records, out_dir / "report.md", auto=choice)
    render_speedup_table(records, console)
    for line in activation_dtype_changes(records):
        console.print(f"[yellow]note:[/] {line.replace('**', '')}")
    if reused:
        console.print(f"reused {len(reused)} stage measurement(s) from earlier runs under the same conditions "
                      f"(GPU, driver, versions, swinbench code, steps): {', '.join(reused)}; --fresh measures "
                      "them again", highlight=False)
    paths = [Path(r["_path"]) for r in records]
    failed = [r["stage"] for r in records if r["status"] == "error"]
    ok = sum(r["status"] == "ok" for r in records)
    console.print(f"{ok}/{len(records)} stages measured; records in {records_dir}, report {report_path}")
    if auto:
        for line in auto_choice_lines(choice) if choice else [
                "auto: no stage of the ladder was measured and passed the gate: nothing to recommend"]:
            console.print(line.replace("**", "").replace("`", ""), highlight=False, soft_wrap=True)
    result = ApplyResult(run_id, out_dir, records_dir, records, paths, report_path, failed, auto=choice)
    if failed:
        first = next(r for r in records if r["status"] == "error")
        err = UserError(f"{len(failed)} stage(s) failed ({first['stage']}: {first['error']}); "
                        f"finished stages are in {records_dir}, report {report_path}", exit_code=2)
        err.result = result   # for callers that want the records anyway
        raise err
    return result


def _scale(records: list[dict], specs: list[StageSpec], nproc: int, parallel: str, shown, extra_env,
           kept: dict | None = None) -> None:
    """Every measured stage again under torchrun with `nproc` processes, `parallel` ("ddp" or "fsdp")
    (scaling.py), in place; a stage kept by --resume keeps the data-parallel figures it holds (those of
    this world size and strategy: _plan_differences refuses others), and only an error is run again."""
    from workbench.ladder.scaling import scale_stage

    def say(text: str) -> None:   # on a terminal too: the bars show nothing while torchrun runs
        shown.console.print(text, markup=False, highlight=False, soft_wrap=True)

    by_key = {(s.stage_index, s.stage): s for s in specs}
    for i, record in enumerate(records):
        spec = by_key.get((record["stage_index"], record["stage"]))
        if record["status"] != "ok" or spec is None:
            continue
        if (record["stage_index"], record["stage"]) in (kept or {}) and _kept_scaling(record):
            say(f"{record['stage']}: data parallel at {nproc} processes kept from the earlier run")
            continue
        say(f"{record['stage']}: data parallel, {nproc} processes under torchrun"
            + (", FSDP" if parallel == "fsdp" else ""))
        records[i] = record = scale_stage(record, spec, nproc, extra_env, parallel)
        s = record["scaling"]
        if s["status"] == "ok":
            eff = f", efficiency {s['efficiency']:.2f}" if s.get("efficiency") else ""
            if eff and s.get("backend") == "gloo":    # one thread per rank against every core in one process
                eff += " (CPU: one thread per process against all cores in one, not like for like)"
            ranks = s["gate"]["ranks"]
            gate = (f"{s['gate']['status']} on every rank" if set(ranks) == {s["gate"]["status"]}
                    else f"{s['gate']['status']} (by rank: {', '.join(ranks)})")
            say(f"  {record['stage']}: {s['img_per_s']:,.1f} img/s at {nproc} processes{eff}, gate {gate}")
        else:
            say(f"  {record['stage']}: {s['status']}: {s['reason']}")


def _finished(records: list[dict], kept: dict[tuple[int, str], dict]) -> list[dict]:
    """The records of the stages run so far and the kept ones (a resumed run's) not yet reached, in stage order."""
    done = {(r["stage_index"], r["stage"]) for r in records}
    return sorted(records + [r for key, r in kept.items() if key not in done], key=lambda r: r["stage_index"])


def _unfinished_note(done: int, total: int, interrupted: bool = False) -> str:
    """The line under a report's title while a run has not finished, or after it was interrupted."""
    if interrupted and done == total:
        return (f"**Interrupted** after all {total} stages had finished; interleaved rounds timed before the "
                "stop, if any, are in the records.")
    if interrupted:
        return (f"**Interrupted:** the run was stopped after {done} of {total} stages had finished; this report "
                "holds those. The same command with `--resume` runs the rest.")
    return (f"**Incomplete:** {done} of {total} stages had finished when this report was written (the run "
            "was still going, or was stopped).")


def _finished_on_disk(records_dir: Path, run_id: str, planned: set[tuple[int, str]]) -> list[dict]:
    """The records of this run's planned stages in records_dir, in stage order ([] if none can be read).
    After Ctrl-C these are what finished: a stage process can write its record in the instant between
    its last event and the interrupt, before the record reaches this process's list."""
    from workbench.results.record import read_records

    try:
        records = [r.to_dict() for r in read_records([records_dir])] if records_dir.is_dir() else []
    except UserError:
        return []
    ours = [r for r in records if r.get("run_id") == run_id and (r.get("stage_index"), r.get("stage")) in planned]
    return sorted(ours, key=lambda r: r["stage_index"])


@contextmanager
def _report_if_interrupted(finished_now: Callable[[], list[dict]], total: int, out_dir: Path):
    """On Ctrl-C (or SIGTERM, which the folder claim turns into one): rewrite the report from the
    stages that finished (finished_now()), saying the run was interrupted, and raise Interrupted, whose
    message says where they are."""
    try:
        yield
    except KeyboardInterrupt:
        from workbench.results.report import render_report

        finished = finished_now()
        if not finished:
            raise Interrupted(f"interrupted before any stage finished; nothing was measured ({out_dir})") from None
        report = render_report(finished, out_dir / "report.md",
                               note=_unfinished_note(len(finished), total, interrupted=True))
        if len(finished) == total:
            raise Interrupted(f"interrupted after all {total} stages had finished: their records are in "
                              f"{out_dir / 'records'}, report {report}") from None
        raise Interrupted(f"interrupted after {len(finished)} of {total} stages: their records are in "
                          f"{out_dir / 'records'}, report {report} (--resume runs the rest)") from None


if __name__ == "__main__":
    sys.exit(stage_main(sys.argv[1]))
