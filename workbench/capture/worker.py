"""The process that runs under the profiler: build the workload, apply a recipe, warm up, capture steps.

`python -m workbench.capture.worker SPEC.json` (nsys re-runs swinbench through this). It writes
`run.json` beside the trace: the configuration, the environment stamp and the captured steps' times
(under a profiler, so only indicative; `swinbench apply` gives the clean figures); and `launches.json`:
the eager Triton launches of one step with their argument bytes, which the analysis holds the traced
kernels against (workbench/analysis/floors.py): the last warm-up step that launched any, or, where the
stage compiles, one step run before the warm-up with torch.compile forced eager (Workload.eager_step).
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from workbench.analysis.floors import launch_entry
from workbench.env import environment_stamp
from workbench.kernels._common import launch_log
from workbench.errors import UserError
from workbench.files import atomic_write_text
from workbench.optimize.ranges import RangeMarker, annotate_modules
from workbench.optimize.timing import time_steps
from workbench.optimize.workload import Workload, WorkloadConfig
from workbench.trace import LAUNCHES_FILE, LAUNCHES_SCHEMA


def apply_recipe(workload: Workload, recipe: str | None) -> list[dict]:
    """Apply every pass of `recipe`'s chain (baseline first) to the workload -> pass results as dicts."""
    if not recipe:
        return []
    from workbench.optimize.recipes import resolve_chain

    return [result.to_dict() for result in workload.apply_chain(resolve_chain(recipe))]


def run_capture(config: WorkloadConfig, recipe: str | None, *, steps: int, warmup: int, marker: str,
                out_dir: Path, torch_trace: Path | None = None, rank: int | None = None,
                world: int = 1, parallel: str = "ddp") -> dict:
    """Build, patch, warm up and capture. With `rank` (a process of `world` under torchrun, the process
    group initialized): the workload takes rank's share of a global synthetic batch of world x batch
    images and trains in DDP (`parallel` 'fsdp': sharded by FSDP2, the optimizer over the shards), and
    every rank starts its capture after the same barrier."""
    workload = Workload.build(config)
    workload.ctx.sharded = rank is not None and parallel == "fsdp"     # master_weights stands aside
    passes = apply_recipe(workload, recipe)
    missing = [p for p in passes if not p.get("available", True)]
    if missing:   # the capture would be of another model than the recipe's, under its name
        raise UserError(f"recipe {recipe} cannot run here: {missing[0]['name']} {missing[0]['changed']}; profile it "
                        "where it runs, or profile the recipe it extends")
    if rank is not None:
        blocker = workload.parallel_blocker(parallel)
        if blocker:
            raise UserError(f"{blocker}; profile the recipe it extends with --nproc")
        workload.take_shard(rank, world)
    workload.marker = RangeMarker(marker)
    annotate_modules(workload.model, workload.marker)
    if workload.ctx.compile and workload.marker.kind != "none":
        said = "the compiled forward has no per-block ranges (torch.compile runs it without the modules' hooks)"
        workload.marker.note = f"{workload.marker.note}; {said}" if workload.marker.note else said
    device = workload.ctx.device
    data_parallel = None
    if rank is not None:
        from workbench.optimize.distributed import DataParallel, FullyShard, sharding_blocker

        blocker = sharding_blocker(workload.ctx.grad_scaler, device) if workload.ctx.sharded else None
        if blocker:
            raise UserError(blocker)
        data_parallel = FullyShard() if workload.ctx.sharded else DataParallel()
    workload.prepare(data_parallel=data_parallel)      # DDP, or FSDP2 with the optimizer over the shards
    launches = eager = None
    if workload.ctx.compile:    # Inductor launches swinbench's kernels itself: log them from one step run eagerly
        with launch_log() as log:
            workload.eager_step()
        if log:
            eager = {"step": None, "forced_eager": True, "launches": [launch_entry(e) for e in log]}
    for i in range(warmup):
        with launch_log() as log:
            workload.step(i)
        if log:     # the last warm-up step that launched kernels from Python (a graph replay launches none)
            launches = {"step": i, "launches": [launch_entry(e) for e in log]}
    launches = eager or launches
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if rank is not None:
        torch.distributed.barrier()     # the ranks' captures start together
    if marker == "torch":
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            timing = time_steps(lambda i: workload.step(warmup + i), warmup=0, repeats=steps, device=device)
        _export_chrome_trace(prof, Path(torch_trace))
    else:
        torch.cuda.profiler.start()
        timing = time_steps(lambda i: workload.step(warmup + i), warmup=0, repeats=steps, device=device)
        torch.cuda.profiler.stop()
    run = {"config": asdict(config), "recipe": recipe, "passes": passes, "warmup": warmup, "steps": steps,
           "backend": "nsys" if marker == "nvtx" else "torch", "env": environment_stamp(device),
           "timing_under_profiler": timing.to_dict(), "marker_note": workload.marker.note,
           **({"rank": rank, "world_size": world, "dist_backend": torch.distributed.get_backend(),
               "parallel": parallel} if rank is not None else {})}
    atomic_write_text(Path(out_dir) / "run.json", json.dumps(run, indent=2, default=str) + "\n")
    if launches is not None:
        doc = {"schema": LAUNCHES_SCHEMA, "device_name": run["env"].get("gpu"), **launches}
        atomic_write_text(Path(out_dir) / LAUNCHES_FILE, json.dumps(doc, separators=(",", ":")) + "\n")
    else:       # no eager Triton launch in the warm-up: no file an earlier capture left may stand for this one
        (Path(out_dir) / LAUNCHES_FILE).unlink(missing_ok=True)
    return run


def _export_chrome_trace(prof, path: Path) -> None:
    """The profiler's Kineto trace to `path`, whole or not at all (exported beside it, then renamed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, path)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        tmp.unlink(missing_ok=True)


RANK_DIR = "rank{rank}"     # a rank's folder under the capture's folder (profile --nproc)


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    config = WorkloadConfig(**spec["config"])
    if not spec.get("nproc"):
        run_capture(config, spec["recipe"], steps=spec["steps"], warmup=spec["warmup"],
                    marker=spec["marker"], out_dir=Path(spec["out_dir"]),
                    torch_trace=Path(spec["torch_trace"]) if spec.get("torch_trace") else None)
        return 0
    # one rank of `profile --nproc N` under torchrun: its files go to <out>/rank<r>/
    from dataclasses import replace

    import torch.distributed as dist

    from workbench.optimize.distributed import init_process_group_from_env
    from workbench.devices import pick_device

    device = init_process_group_from_env(torch.device(pick_device(config.device)).type)
    rank, world = dist.get_rank(), dist.get_world_size()
    rank_dir = Path(spec["out_dir"]) / RANK_DIR.format(rank=rank)
    rank_dir.mkdir(parents=True, exist_ok=True)
    run_capture(replace(config, device=str(device)), spec["recipe"], steps=spec["steps"], warmup=spec["warmup"],
                marker=spec["marker"], out_dir=rank_dir,
                torch_trace=rank_dir / "trace.json" if spec["marker"] == "torch" else None, rank=rank, world=world,
                parallel=spec.get("parallel", "ddp"))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
