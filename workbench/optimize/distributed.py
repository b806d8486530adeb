"""Data parallel over torch.distributed: the DDP settings a training run takes, and the wrapping.

swinbench does not launch processes itself: `torchrun` (torch.distributed.run) starts one process per
GPU and sets RANK, LOCAL_RANK and WORLD_SIZE; the process group is initialized by the caller (or by
`init_process_group_from_env`, what `swinbench train --nproc` runs in each rank). A patched Swin is then
wrapped in DistributedDataParallel with `DataParallel`'s settings: every rank holds the same weights,
runs its own shard of the global batch, and after backward every `p.grad` holds the mean over the ranks
(DDP all-reduces the gradient buckets in place while backward runs).
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields

import torch

from workbench.errors import UserError
from workbench.files import short_repr


@dataclass(frozen=True)
class DataParallel:
    """DistributedDataParallel's settings that matter for throughput.

    bucket_cap_mb: gradient megabytes per all-reduce bucket (DDP's default 25): smaller buckets start
    their all-reduce earlier in backward, larger ones pay less per-call latency.
    gradient_as_bucket_view: each `p.grad` is a view into its bucket, which saves one copy per gradient
    per step and the memory of a second gradient.
    static_graph: the model uses the same parameters every step (a Swin does): DDP then skips its search
    for unused parameters and orders its buckets by the first step's gradient order. It does not go with
    gradient accumulation (DDP asserts when a static graph skips the all-reduce of a micro-step), so the
    default settings turn it off when accumulate > 1.
    broadcast_buffers: broadcast the module buffers from rank 0 before every forward; a Swin's buffers
    (relative-position index, attention mask) are constants, so off.
    """

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    static_graph: bool = True
    broadcast_buffers: bool = False

    def __post_init__(self):
        if isinstance(self.bucket_cap_mb, bool) or not isinstance(self.bucket_cap_mb, (int, float)) or \
                not (math.isfinite(self.bucket_cap_mb) and self.bucket_cap_mb > 0):
            raise UserError(f"bucket_cap_mb must be a number > 0, got {short_repr(self.bucket_cap_mb)}")
        for name in ("gradient_as_bucket_view", "static_graph", "broadcast_buffers"):
            if not isinstance(getattr(self, name), bool):
                raise UserError(f"{name} must be True or False, got {short_repr(getattr(self, name))}")

    def to_dict(self) -> dict:
        return asdict(self)


def world_size() -> int:
    """The process group's size, 1 when torch.distributed is not initialized."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def data_parallel_settings(value, accumulate: int = 1) -> DataParallel | None:
    """optimize_swin's `distributed` -> the DDP settings, or None (no wrapping).

    None: DDP with the default settings when torch.distributed is initialized with more than one process,
    else none. False: none. True: DDP with the default settings. A dict of DataParallel's fields, or a
    DataParallel: DDP with those. True, a dict or a DataParallel need an initialized process group.
    The defaults are DataParallel's, with static_graph off when `accumulate` > 1."""
    default = DataParallel(static_graph=accumulate == 1)
    if value is None:
        return default if world_size() > 1 else None
    if value is False:
        return None
    if value is True:
        settings = default
    elif isinstance(value, DataParallel):
        settings = value
    elif isinstance(value, dict):
        names = {f.name for f in fields(DataParallel)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise UserError(f"distributed: unknown DDP setting {short_repr(unknown[0])} (settings: "
                            f"{', '.join(sorted(names))})")
        settings = DataParallel(**{"static_graph": default.static_graph, **value})
    else:
        raise UserError(f"distributed must be None (DDP when torchrun started several processes), False, True, a "
                        f"dict of DDP settings or a DataParallel, got {short_repr(value)}")
    if settings.static_graph and accumulate > 1:
        raise UserError("distributed: static_graph does not go with accumulate > 1 (DDP cannot skip the all-reduce "
                        "of a micro-step under a static graph): set static_graph False")
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise UserError("distributed asks for DDP, but torch.distributed is not initialized: start the script with "
                        "torchrun and call torch.distributed.init_process_group() first")
    return settings


def wrap_data_parallel(model: torch.nn.Module, device: torch.device, settings: DataParallel):
    """`model` (on `device`, patched) in DistributedDataParallel with `settings`; rank 0's parameters and
    buffers are broadcast to every rank here."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    # torch 2.14 renamed broadcast_buffers (the per-forward broadcast) to forward_sync_buffers
    buffers = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
               else "broadcast_buffers")
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   bucket_cap_mb=settings.bucket_cap_mb,
                                   gradient_as_bucket_view=settings.gradient_as_bucket_view,
                                   static_graph=settings.static_graph, **{buffers: settings.broadcast_buffers})


def backend_for(device: torch.device) -> str:
    """nccl for CUDA devices, gloo for the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group_from_env(device_type: str) -> torch.device:
    """In a process torchrun started: initialize the default process group from its environment (nccl on
    CUDA, gloo on the CPU) -> this rank's device (cuda:LOCAL_RANK, or cpu)."""
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device), device_id=device if device.type == "cuda" else None)
    return device


def shard_batch(workload, rank: int, world: int) -> None:
    """Give a Workload rank's share of the global synthetic batch of world x its batch images (the same
    seed on every rank, so the ranks' shares together are one process's global batch)."""
    from workbench.optimize.workload import synthetic_batch

    b = workload.config.batch
    x, y = synthetic_batch(workload.model, b * world, workload.model.num_classes, workload.ctx.device,
                           workload.config.seed)
    workload.x, workload.y = x[rank * b:(rank + 1) * b].contiguous(), y[rank * b:(rank + 1) * b].contiguous()
