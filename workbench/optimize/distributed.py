"""Data parallel over torch.distributed: the settings a training run takes (DDP's or FSDP2's), and the wrapping.

swinbench does not launch processes itself: `torchrun` (torch.distributed.run) starts one process per
GPU and sets RANK, LOCAL_RANK and WORLD_SIZE; the process group is initialized by the caller (or by
`init_process_group_from_env`, what `swinbench train --nproc` runs in each rank). A patched Swin then
trains data parallel in one of two ways, each rank on its own shard of the global batch:

    DataParallel   DistributedDataParallel: every rank holds all the weights, gradients and optimizer
                   state; after backward every `p.grad` holds the mean over the ranks (DDP all-reduces
                   the gradient buckets in place while backward runs).
    FullyShard     FSDP2 (torch.distributed.fsdp.fully_shard): every rank holds 1/N of each parameter
                   (a DTensor shard), of its gradient and of the optimizer state; each unit (a Swin
                   block, or a stage) all-gathers its parameters before its forward and its backward, and
                   reduce-scatters its gradients (their mean over the ranks) after its backward.

A recipe that replays its training step as one CUDA graph runs under DDP with the all-reduce inside the
graph (NCCL collectives are capturable): DDP is built on the side stream that the eager warm-up steps,
the capture and any eager fallback then run on, and DDP_GRAPH_WARMUP_STEPS eager steps run before the
capture, as PyTorch's CUDA-graph notes ask. FSDP2 does not run inside a graph here.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from typing import ClassVar

import torch

from workbench.arguments import require_bool, require_positive
from workbench.errors import UserError
from workbench.files import short_repr


# eager DDP steps before a training step that uses DDP is captured in a CUDA graph: DDP's reducer
# rebuilds its buckets and settles its static-graph bookkeeping over its first iterations, and PyTorch's
# CUDA-graph notes ask for 11 of them
DDP_GRAPH_WARMUP_STEPS = 11


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
    strategy: ClassVar[str] = "ddp"

    def __post_init__(self):
        require_positive("bucket_cap_mb", self.bucket_cap_mb)
        for name in ("gradient_as_bucket_view", "static_graph", "broadcast_buffers"):
            require_bool(name, getattr(self, name))

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, **asdict(self)}


SHARD_UNITS = ("block", "stage")


@dataclass(frozen=True)
class FullyShard:
    """FSDP2's settings (torch.distributed.fsdp.fully_shard), for models whose weights, gradients and
    optimizer state should not be held whole by every rank.

    unit: what one all-gather covers: "block" (each timm SwinTransformerBlock: the most units, the least
    memory held gathered at once) or "stage" (each stage with its blocks and patch merging: fewer, larger
    collectives). The root (patch embedding, the last norm, the head) is one more unit either way.
    reshard_after_forward: free each unit's gathered parameters after its forward and gather them again
    for its backward (the least memory); False keeps them gathered from forward to backward (one
    all-gather fewer per unit per step, the whole model's parameters held between the two).
    """

    unit: str = "block"
    reshard_after_forward: bool = True
    strategy: ClassVar[str] = "fsdp"

    def __post_init__(self):
        if self.unit not in SHARD_UNITS:
            raise UserError(f"unit must be one of {', '.join(SHARD_UNITS)}, got {short_repr(self.unit)}")
        require_bool("reshard_after_forward", self.reshard_after_forward)

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, **asdict(self)}


STRATEGIES = {"ddp": DataParallel, "fsdp": FullyShard}
Parallel = DataParallel | FullyShard


def require_fully_shard() -> None:
    """UserError unless this torch has FSDP2 (torch.distributed.fsdp.fully_shard, torch 2.6 and later)."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: F401
    except ImportError:
        raise UserError(f"FSDP needs torch.distributed.fsdp.fully_shard (torch 2.6 or later); this is torch "
                        f"{torch.__version__}: use DDP, or a newer torch") from None


def check_nproc(nproc, mode: str, dev) -> None:
    """UserError unless `--nproc` can run (apply, profile): a whole number >= 1, training, a GPU per process."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise UserError(f"--nproc must be a whole number >= 1, got {nproc!r}")
    if mode != "train":
        raise UserError("--nproc measures data-parallel training (DDP's gradient all-reduce): use --mode train")
    if dev.type == "cuda":
        if dev.index is not None:
            raise UserError(f"--nproc gives each process its own GPU (cuda:0 to cuda:{nproc - 1}): use --device "
                            f"cuda, not {dev}")
        if nproc > torch.cuda.device_count():
            raise UserError(f"--nproc {nproc} needs {nproc} GPUs on this machine; it has {torch.cuda.device_count()}")


def oversubscribed_note(nproc: int | None, dev) -> str | None:
    """One line where `--nproc` on the CPU starts more processes than the machine has cores (they share
    them, so the step times measure contention), else None."""
    import os

    cores = os.cpu_count() or 1
    if nproc is None or dev.type == "cuda" or nproc <= cores:
        return None
    return (f"--nproc {nproc} on {cores} CPU cores: the processes share cores, so their step times (and the "
            "efficiency) measure contention, not data parallelism")


def check_parallel(parallel: str | None, nproc: int | None) -> None:
    """UserError unless a command's `--parallel` names a strategy and goes with --nproc (and FSDP's is
    importable); None (not given) passes."""
    if parallel is None:
        return
    if parallel not in STRATEGIES:
        raise UserError(f"--parallel must be one of {', '.join(STRATEGIES)}, got {short_repr(parallel)}")
    if nproc is None:
        raise UserError("--parallel goes with --nproc (how the processes share the training)")
    if parallel == "fsdp":
        require_fully_shard()


def world_size() -> int:
    """The process group's size, 1 when torch.distributed is not initialized."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def asked_strategy(value) -> str | None:
    """The strategy optimize_swin's `distributed` asks for: "ddp", "fsdp", or None (one process), read
    without checking the settings or the process group (data_parallel_settings checks both)."""
    if value is None:
        return "ddp" if world_size() > 1 else None
    if value is False:
        return None
    if isinstance(value, FullyShard) or (isinstance(value, str) and value == "fsdp") or \
            (isinstance(value, dict) and value.get("strategy") == "fsdp"):
        return "fsdp"
    return "ddp"


def data_parallel_settings(value, accumulate: int = 1) -> Parallel | None:
    """optimize_swin's `distributed` -> the data-parallel settings (DataParallel for DDP, FullyShard for
    FSDP2), or None (one process's training).

    None: DDP with the default settings when torch.distributed is initialized with more than one process,
    else none. False: none. True or "ddp": DDP with the default settings; "fsdp": FSDP2 with its defaults.
    A dict: the settings of the strategy its "strategy" key names ("ddp" when it has none). A DataParallel
    or a FullyShard: those. All but None and False need an initialized process group. DDP's defaults are
    DataParallel's, with static_graph off when `accumulate` > 1."""
    default = DataParallel(static_graph=accumulate == 1)
    if value is None:
        return default if world_size() > 1 else None
    if value is False:
        return None
    if value is True or isinstance(value, str) and value == "ddp":
        settings = default
    elif isinstance(value, str) and value == "fsdp":
        settings = FullyShard()
    elif isinstance(value, (DataParallel, FullyShard)):
        settings = value
    elif isinstance(value, dict):
        settings = _settings_from_dict(value, default)
    else:
        raise UserError(f"distributed must be None (DDP when torchrun started several processes), False, True, "
                        f"'ddp', 'fsdp', a dict of DDP or FSDP settings, a DataParallel or a FullyShard, got "
                        f"{short_repr(value)}")
    if isinstance(settings, FullyShard):
        require_fully_shard()
    if isinstance(settings, DataParallel) and settings.static_graph and accumulate > 1:
        raise UserError("distributed: static_graph does not go with accumulate > 1 (DDP cannot skip the all-reduce "
                        "of a micro-step under a static graph): set static_graph False")
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise UserError(f"distributed asks for {settings.strategy.upper()}, but torch.distributed is not "
                        "initialized: start the script with torchrun and call torch.distributed.init_process_group() "
                        "first")
    return settings


def _settings_from_dict(value: dict, ddp_default: DataParallel) -> Parallel:
    strategy = value.get("strategy", "ddp")
    if strategy not in STRATEGIES:
        raise UserError(f"distributed: strategy must be one of {', '.join(STRATEGIES)}, got {short_repr(strategy)}")
    cls = STRATEGIES[strategy]
    given = {k: v for k, v in value.items() if k != "strategy"}
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(given) - names, key=str)
    if unknown:
        raise UserError(f"distributed: unknown {strategy.upper()} setting {short_repr(unknown[0])} (settings: "
                        f"{', '.join(sorted(names))})")
    if cls is DataParallel:
        given = {"static_graph": ddp_default.static_graph, **given}
    return cls(**given)


def wrap_data_parallel(model: torch.nn.Module, device: torch.device, settings: DataParallel,
                       stream: "torch.cuda.Stream | None" = None):
    """`model` (on `device`, patched) in DistributedDataParallel with `settings`; rank 0's parameters and
    buffers are broadcast to every rank here. `stream`: the side stream a CUDA-graph step will be
    warmed up and captured on; DDP is built on it (its gradient hooks then belong to that stream)."""
    import contextlib
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    # torch 2.14 renamed broadcast_buffers (the per-forward broadcast) to forward_sync_buffers
    buffers = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
               else "broadcast_buffers")
    side = stream if device.type == "cuda" else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                      bucket_cap_mb=settings.bucket_cap_mb,
                                      gradient_as_bucket_view=settings.gradient_as_bucket_view,
                                      static_graph=settings.static_graph, **{buffers: settings.broadcast_buffers})
    if side is not None:
        torch.cuda.current_stream(device).wait_stream(side)
    return ddp


def shard_units(model: torch.nn.Module, unit: str) -> list[torch.nn.Module]:
    """The modules FullyShard's `unit` names in a timm Swin, in module order: its SwinTransformerBlocks
    ("block") or its SwinTransformerStages ("stage")."""
    from timm.models.swin_transformer import SwinTransformerBlock, SwinTransformerStage

    kind = SwinTransformerBlock if unit == "block" else SwinTransformerStage
    return [m for m in model.modules() if isinstance(m, kind)]


def require_shard_units(model: torch.nn.Module, unit: str) -> list[torch.nn.Module]:
    """shard_units(model, unit), or a UserError where there are none (a SwinV2 or swinv2_cr, whose blocks
    and stages are other classes): optimize_swin asks before any pass changes the model."""
    units = shard_units(model, unit)
    if not units:
        raise UserError(f"FSDP shards a timm Swin by {unit}, and this {type(model).__name__} has no "
                        f"Swin{'TransformerBlock' if unit == 'block' else 'TransformerStage'}")
    return units


def fully_shard_model(model: torch.nn.Module, settings: FullyShard,
                      param_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Shard `model` (on its device, patched) in place with FSDP2 -> the same object, whose parameters are
    now DTensor shards: build the optimizer over them after this. Rank 0's parameters and buffers are
    broadcast to every rank first (as DDP does), then each of `shard_units(model, settings.unit)` and the
    root go through fully_shard. With `param_dtype` (bf16 for a bf16 recipe) each unit's gathered
    parameters are cast to it for forward and backward while the shards stay fp32 and the gradients are
    reduce-scattered in fp32 (MixedPrecisionPolicy)."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    units = require_shard_units(model, settings.unit)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)
    # a timm Swin block returns a reshaped view of its output, which the next block and the stage read out
    # of place; torch warns about in-place use of such views, which would skip FSDP's pre-backward hook
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for module in units:
        fully_shard(module, reshard_after_forward=settings.reshard_after_forward, mp_policy=policy)
    fully_shard(model, reshard_after_forward=settings.reshard_after_forward, mp_policy=policy)
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A model sharded by fully_shard_model -> its state_dict as one process holds it: every tensor whole,
    a plain torch.Tensor on the model's device. A collective: every rank calls it (and gets it all)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def load_full_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True):
    """Load a whole (unsharded) state_dict, such as full_state_dict's or a plain timm Swin's, into a model
    sharded by fully_shard_model: each rank keeps its shards. A collective; every rank gives the same
    state_dict. -> torch's (missing_keys, unexpected_keys)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    return set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, strict=strict))


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


def sharding_blocker(grad_scaler: bool, device: torch.device | str) -> str | None:
    """Why a stage cannot train under FSDP here (None: it can): fp16 with a GradScaler on a GPU, whose inf
    check would see one rank's shards only."""
    if grad_scaler and torch.device(device).type == "cuda":
        return "fp16 with a GradScaler is not run under FSDP (its inf check would see one rank's shards): use bf16"
    return None
