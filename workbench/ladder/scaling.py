"""`apply --nproc N`: every measured stage again under torchrun, data parallel, gated on every rank.

After the ladder has measured a stage in one process, the parent starts

    python -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node N --no-python \
        python -P -m workbench.ladder.scaling SPEC    (backends.torchrun_module_command)

(fresh processes per stage, as `isolate` runs stages). Each rank builds the stage's workload with the
run's per-process batch B, takes rank r's share of a global synthetic batch of N x B images (the same seed
on every rank), applies the chain's passes and wraps the model in DDP, or with `--parallel fsdp` shards it
with FSDP2 and builds the optimizer over the shards (`optimize.distributed`).

The gate holds on every rank, against the fp32 baseline over the global batch: every rank computes the
baseline's forward + backward on its own share and the ranks combine them (logits gathered in rank order,
the mean of the losses, the mean of the gradients: what one process computes over the N x B images, up
to the order of the sums). The stage's one forward + backward under DDP is combined the same way (DDP
already averaged its gradients; FSDP's averaged shards are gathered whole), and each rank compares it with
the stage's tolerance (the baseline's too: its reference here is one process over the global batch); the
record keeps every rank's verdict, and in its `ddp` field the strategy and its settings.

Timing: `warmup` + `steps` training steps per rank (`time_steps`; each rank's median and IQR are kept); a
step waits for the all-reduce, so the slowest rank's median is the step time, img/s = N x B / that, and
efficiency = img/s / (N x the stage's one-process img/s at batch B). A stage whose whole step is one CUDA
graph (cuda_graph) runs with DDP's all-reduce captured in it; stages that replay Inductor's own graphs
(reduce-overhead), graph stages under FSDP, and passes not available here are 'not run', with the
reason (Workload.parallel_blocker). A rank that fails takes the group down
(torchrun stops the others): the stage's scaling is then an 'error' naming the log.

Communication: after the timing, each rank runs a few more steps under torch.profiler (`_communication`).
Rank 0 writes the stage's figures before that profile, so a profiler that takes the processes down costs
the `comm` figures only: the record keeps the rest and says why in `comm_error`.
"""
from __future__ import annotations

import gc
import json
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import torch

from workbench.files import atomic_write_text

SCALING_DIR = "scaling"


def torchrun_command(nproc: int, spec_path: Path) -> tuple[list[str], dict]:
    from workbench.capture.backends import torchrun_module_command

    return torchrun_module_command(["--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc)],
                                   "workbench.ladder.scaling", str(spec_path))


def scale_stage(record: dict, spec, nproc: int, extra_env: dict | None = None, parallel: str = "ddp") -> dict:
    """Run the stage of `spec` (a StageSpec) under torchrun with `nproc` processes, data parallel by
    `parallel` ("ddp" or "fsdp"), and put the result in `record["scaling"]` (written) -> the record.
    `record` is the stage's one-process record."""
    from workbench.results.record import write_record

    out_dir = Path(spec.out_dir)
    folder = out_dir / SCALING_DIR
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{spec.stage_index:02d}-{spec.stage}"
    spec_path, result_path, log_path = (folder / f"{name}.spec.json", folder / f"{name}.json",
                                        folder / f"{name}.log")
    result_path.unlink(missing_ok=True)
    atomic_write_text(spec_path, json.dumps({"stage": asdict(spec), "single_img_per_s": record.get("img_per_s"),
                                             "result": str(result_path), "parallel": parallel}, indent=1) + "\n")
    from workbench.capture.backends import stop_process

    cmd, env = torchrun_command(nproc, spec_path)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env={**env, **(extra_env or {})})
        try:
            code = proc.wait()
        finally:
            stop_process(proc)
    if result_path.exists():
        scaling = json.loads(result_path.read_text())
        if code != 0:    # the ranks wrote their figures, then went down in the communication profile
            scaling["comm_error"] = (f"torchrun exited with {code} during the communication profile, after the "
                                     f"stage's figures were written; its output is in {log_path}")
    else:
        scaling = {"world_size": nproc, "backend": "nccl" if record.get("env", {}).get("device_type") == "cuda"
                   else "gloo", "batch_per_process": spec.config["batch"], "global_batch": spec.config["batch"] * nproc,
                   "status": "error", "reason": f"torchrun exited with {code}; its output is in {log_path}"}
    record["scaling"] = scaling
    record["_path"] = str(write_record(record, out_dir / "records"))
    return record


# ---------------------------------------------------------------- in each rank


def _over_ranks(out, world: int, device: torch.device, *, average_grads: bool):
    """One rank's GateOutputs -> those of the global batch: logits gathered in rank order, the mean loss, the
    gradients averaged over the ranks when `average_grads` (DDP's are already)."""
    import torch.distributed as dist

    from workbench.optimize.gate import GateOutputs

    logits: list = [None] * world
    losses: list = [None] * world
    dist.all_gather_object(logits, out.logits)
    dist.all_gather_object(losses, out.loss)
    grads = dict(out.grads)
    if average_grads:
        for name, g in grads.items():
            if g is not None:
                t = g.to(device)
                dist.all_reduce(t)
                grads[name] = (t / world).cpu()
    return GateOutputs(torch.cat(logits), sum(losses) / world, grads)


COMM_STEPS = 3     # steps each rank runs under torch.profiler, after the timing, for its communication figures


class _NoFigures(Exception):
    """The profile of the communication steps could not be made or read (the steps themselves ran)."""


def _communication(workload, device: torch.device, rank: int, steps: int = COMM_STEPS) -> dict:
    """This rank's communication per step and the part of it that no compute kernel of the rank overlaps
    (analysis.ranks.rank_row), from `steps` more steps under torch.profiler: GPU kernels on a GPU (NCCL's),
    leaf operators on the CPU (gloo's c10d collectives). Measured apart from the timing, which it would
    disturb."""
    import tempfile

    from workbench.analysis.ranks import rank_row
    from workbench.optimize.ranges import RangeMarker
    from workbench.trace import load_trace

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    marker, workload.marker = workload.marker, RangeMarker("torch")    # step<i> ranges: the steps counted
    try:
        prof = torch.profiler.profile(activities=activities)
        prof.__enter__()
    except Exception as exc:        # the steps still run below: every rank must join their collectives
        prof, failed = None, exc
    try:
        for i in range(steps):      # a step that raises ends this rank, and torchrun the others
            workload.step(i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        workload.marker = marker
        if prof is not None:
            prof.__exit__(None, None, None)
    if prof is None:
        raise _NoFigures(f"the profiler did not start: {type(failed).__name__}: {failed}")
    try:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "trace.json"
            prof.export_chrome_trace(str(path))
            row = rank_row(rank, load_trace(path))
    except Exception as exc:
        raise _NoFigures(f"{type(exc).__name__}: {exc}") from None
    return {"comm_ms": row["comm_ms"], "exposed_ms": row["exposed_ms"]}


def _measure(spec, single_img_per_s: float | None, device: torch.device, rank: int, world: int,
             parallel: str = "ddp") -> tuple[dict, object]:
    """This rank's gate and timing of the stage -> (the stage's scaling result, every rank's figures in it,
    the stage's prepared workload, or None where the stage did not run)."""
    import torch.distributed as dist

    from workbench.optimize.distributed import STRATEGIES
    from workbench.optimize.gate import capture_parameters, compare, forward_backward, weights_digest
    from workbench.optimize.recipes import gate_tolerance, resolve_chain
    from workbench.optimize.timing import time_steps
    from workbench.optimize.workload import Workload, WorkloadConfig

    config = replace(WorkloadConfig(**spec.config), device=str(device))
    settings = STRATEGIES[parallel]()
    result = {"world_size": world, "backend": dist.get_backend(), "batch_per_process": config.batch,
              "global_batch": config.batch * world, "status": "ok", "reason": None, "ddp": settings.to_dict()}
    chain = resolve_chain(spec.stage_ref)

    reference = Workload.build(replace(config, precision="fp32"))
    reference.take_shard(rank, world)
    digest = weights_digest(reference.model)
    params = capture_parameters(reference.model)
    reference.prepare()
    ref = _over_ranks(forward_backward(reference, params), world, device, average_grads=True)
    ref.weights_digest = digest
    del reference, params
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    workload = Workload.build(config)
    workload.take_shard(rank, world)
    digest = weights_digest(workload.model)
    params = capture_parameters(workload.model)
    workload.ctx.sharded = parallel == "fsdp"
    missing = [r for r in workload.apply_chain(chain) if not r.available]
    if missing:
        return {**result, "status": "not run", "reason": "; ".join(f"{r.name}: {r.changed}" for r in missing)}, None
    blocker = workload.parallel_blocker(parallel)
    if blocker:
        return {**result, "status": "not run", "reason": blocker}, None
    workload.prepare(data_parallel=settings)      # DDP, or FSDP2 with the optimizer over the shards

    out = _over_ranks(forward_backward(workload, params), world, device, average_grads=False)
    out.weights_digest = digest
    # under DDP or FSDP even the baseline is gated: its reference is one process over the global batch, not itself
    gate = compare(out, ref, gate_tolerance(chain, workload.ctx.precision.name))
    verdicts: list = [None] * world
    dist.all_gather_object(verdicts, gate.status)

    timing = time_steps(workload.step, warmup=spec.warmup, repeats=spec.steps, device=device)
    medians: list = [None] * world
    dist.all_gather_object(medians, timing.median_ms)
    iqrs: list = [None] * world
    dist.all_gather_object(iqrs, timing.iqr_ms)
    step_ms = max(medians)
    img_per_s = config.batch * world / (step_ms / 1e3)
    return {**result, "img_per_s": img_per_s, "step_ms": step_ms, "step_ms_per_rank": medians,
            "step_iqr_ms_per_rank": iqrs,
            "efficiency": img_per_s / (world * single_img_per_s) if single_img_per_s else None,
            "gate": {"status": "FAIL" if "FAIL" in verdicts else gate.status, "reason": gate.reason,
                     "ranks": verdicts, "metrics": json.loads(json.dumps(gate.metrics, default=str))}}, workload


def _add_communication(result: dict, workload, device: torch.device, rank: int, world: int,
                       steps: int = COMM_STEPS) -> dict:
    """`result` with its `comm` figures: every rank's communication per step from `steps` more steps under
    torch.profiler (none where a rank's profile could not be made: the stage log says why). A step that
    raises ends the rank (torchrun then ends the others): caught here, it would leave this rank at the
    all-gather while the others wait in the step's collectives."""
    import torch.distributed as dist

    try:
        # its steps run on every rank whatever the profiler does (_communication): the ranks reach the
        # all-gather below together
        mine = _communication(workload, device, rank, steps)
    except _NoFigures as exc:   # the timing and the gate stand without it; the stage log says why
        print(f"rank {rank}: no communication figures: {exc}", file=sys.stderr)
        mine = None
    comm: list = [None] * world
    dist.all_gather_object(comm, mine)
    if None in comm:
        return result
    return {**result, "comm": {"comm_ms_per_rank": [c["comm_ms"] for c in comm],
                               "exposed_ms_per_rank": [c["exposed_ms"] for c in comm], "steps": steps}}


def scaling_main(spec_path: str) -> int:
    """One rank: measure the stage of the spec, rank 0 writes the result file."""
    import torch.distributed as dist

    from workbench.optimize.distributed import init_process_group_from_env
    from workbench.devices import pick_device

    data = json.loads(Path(spec_path).read_text())
    spec = SimpleNamespace(**data["stage"])     # apply.StageSpec's fields (apply imports this module)
    device = init_process_group_from_env(torch.device(pick_device(spec.config["device"])).type)
    rank, world = dist.get_rank(), dist.get_world_size()
    result, workload = _measure(spec, data.get("single_img_per_s"), device, rank, world, data.get("parallel", "ddp"))
    # the figures go to disk before the profile: a profiler that takes the processes down loses only `comm`
    if rank == 0:
        atomic_write_text(Path(data["result"]), json.dumps(result, indent=1) + "\n")
    if workload is not None:
        result = _add_communication(result, workload, device, rank, world)
        if rank == 0 and "comm" in result:
            atomic_write_text(Path(data["result"]), json.dumps(result, indent=1) + "\n")
    dist.barrier()
    # only on success: a rank that raised exits without waiting on its peers, and torchrun stops them
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(scaling_main(sys.argv[1]))
