"""Optimization passes. A pass is one module in this package with:

    NAME: str                                   # the name recipes use
    def apply(model, ctx: PassContext, **params) -> tuple[nn.Module, PassResult]

`apply` returns the changed model (the same object when patched in place) and a short record
of what it changed. Passes that change how the model is *run* rather than the model itself
(precision, optimizer, compile) change `ctx` and say so in their result. Such a step pass also has

    def in_your_loop(params: dict, ctx: PassContext) -> str | None   # what a loop of your own writes to get it

which `patch_swin` (optimize/patching.py) gives a user in place of the pass: it applies a recipe's model
passes only.

Passes that change how a timm Swin v1 block runs do not replace its forwards themselves: each sets its
fields of the blocks' plans and binds them (block_plan.py; the forwards are block_forward.py's), so they
compose in any order. The SwinV2 forms (swin_transformer_v2's and -CR's blocks) are bound on the
instances by the passes themselves, and so is quantize_linear's MLP forward; quantize_linear refuses a
model whose Linears fused_linear or fused_block already took.

Adding a technique means adding one module here, its test and a YAML line; `PASS_MODULES`
below is the only list to extend. A pass that runs swinbench's own kernels sets
`OWN_KERNELS = True`, so that reports can tell the fused stack from the PyTorch-alone peers.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from workbench.errors import UserError
from workbench.precision import Precision

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def default_optimizer_factory(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The baseline optimizer: plain (for-each) AdamW, as a user would write it."""
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.05, foreach=True)


@dataclass
class PassContext:
    """What passes may read and change besides the model.

    device: where the model runs. precision: autocast/TF32 mode (the `amp` pass sets it).
    optimizer_factory: builds the optimizer (fused_adamw replaces it).
    optimizer_settings: AdamW hyperparameters (lr, betas, eps, weight_decay) a user chose over the
    baseline's (`default_optimizer_factory`); fused_adamw builds its optimizer with them.
    compile: whether the runner wraps the step in torch.compile (the `compile` pass sets it).
    grad_scaler: whether fp16 training uses a GradScaler.
    cuda_graph: whether the runner captures the step in a CUDA graph (the `cuda_graph` pass sets it).
    master_weights: low-precision GEMM weights with fp32 masters (the `master_weights` pass sets it); the
    runner then builds the optimizer through it, around whatever `optimizer_factory` builds.
    training: whether the workload trains (passes may skip what only training needs).
    sharded: whether the runner shards the parameters with FSDP2 after the passes (DTensor shards, FSDP's
    own mixed precision): passes that store parameters their own way, or step them with kernels that take
    plain tensors only, stand aside.
    batch: images per step where the runner knows it (the workload's batch); passes that time their
    choices at the model's shapes (fused_attention's route) time them at it, else at a default.
    swin_only: the model is the user's own, holding a Swin (patch_swin): passes that change modules by
    type (the quantized Linears) change those of the Swin blocks and patch merging layers only.
    calibration: real images for static calibration (quantize_linear with activations: static):
    (count, batch) -> batches of images (N, C, H, W) fp32 on any device, and calibration_source says what
    they are; None: synthetic images (an untrained model's ranges on noise).
    """

    device: torch.device
    precision: Precision
    optimizer_factory: OptimizerFactory = default_optimizer_factory
    optimizer_name: str = "torch.optim.AdamW(foreach=True)"
    optimizer_settings: dict = field(default_factory=dict)
    compile: bool = False
    compile_options: dict = field(default_factory=dict)
    grad_scaler: bool = False
    cuda_graph: bool = False
    master_weights: Any = None
    training: bool = True
    sharded: bool = False
    batch: int | None = None     # images per step, where the caller knows it (passes that time shapes use it)
    swin_only: bool = False      # change only the Swin's own modules (patch_swin on a model of the user's)
    calibration: Callable[[int, int], list] | None = None
    calibration_source: str | None = None


@dataclass
class PassResult:
    """What a pass did: `changed` is one line for tables; `details` holds counts and the implementation used."""

    name: str
    params: dict[str, Any]
    changed: str
    details: dict[str, Any] = field(default_factory=dict)
    available: bool = True

    def to_dict(self) -> dict:
        return {"name": self.name, "params": self.params, "changed": self.changed,
                "details": self.details, "available": self.available}


def triton_runs_on(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run for `device`: on a CUDA device, or anywhere under the
    interpreter (TRITON_INTERPRET set and not 0, as the tests set it on the CPU)."""
    import os

    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class PassUnavailable(Exception):
    """Raised by a pass whose implementation is missing here (a kernel not built yet, no GPU for it), or
    that finds nothing to do; `details` (what it measured on the way) go into the stage's record."""

    def __init__(self, message: str, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.details = details or {}


def require_triton(device: torch.device | str) -> None:
    """PassUnavailable unless the Triton kernels can run for `device` (see triton_runs_on)."""
    if not triton_runs_on(device):
        raise PassUnavailable("the Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1 on the CPU)")


# name -> module (relative to this package). Extend this when adding a pass.
PASS_MODULES = {
    "amp": "amp",
    "sdpa_attention": "sdpa_attention",
    "fused_adamw": "fused_adamw",
    "master_weights": "master_weights",
    "fused_layernorm": "fused_layernorm",
    "fused_window": "fused_window",
    "patch_embed": "patch_embed",
    "fused_attention": "fused_attention",
    "fused_linear": "fused_linear",
    "fused_block": "fused_block",
    "compile": "compile",
    "cuda_graph": "cuda_graph",
    "quantize_linear": "quantize_linear",
    "torchao_quantize": "torchao_quantize",
}


def get_pass(name: str):
    """The pass module for `name`; UserError for an unknown name. A module that fails to import
    (kernel not there yet) is reported as unavailable by `apply_pass`, not here."""
    if name not in PASS_MODULES:
        raise UserError(f"unknown pass {name!r}: known passes are {', '.join(sorted(PASS_MODULES))}")
    return importlib.import_module(f"{__name__}.{PASS_MODULES[name]}")


def inference_only(name: str) -> bool:
    """Whether the pass refuses training (its module sets INFERENCE_ONLY): callers that patch a user's model
    in place ask first, so that a training run is refused before any pass has changed the model."""
    return bool(getattr(get_pass(name), "INFERENCE_ONLY", False))


def uses_swinbench_kernels(name: str) -> bool:
    """Whether the pass runs swinbench's own kernels (its module sets OWN_KERNELS): a stage whose
    chain has none of them is what a user gets from PyTorch alone."""
    return bool(getattr(get_pass(name), "OWN_KERNELS", False))


def apply_pass(name: str, model: torch.nn.Module, ctx: PassContext, params: dict | None = None):
    """Apply one pass by name -> (model, PassResult). An unavailable pass returns the model unchanged
    and a result with available=False and the reason, so a run can go on and say so."""
    params = dict(params or {})
    try:
        module = get_pass(name)
        return module.apply(model, ctx, **params)
    except (ImportError, PassUnavailable) as exc:
        if isinstance(exc, ImportError) and name not in PASS_MODULES:
            raise
        details = getattr(exc, "details", {})
        return model, PassResult(name, params, f"not available: {exc}", details=details, available=False)


def refuse_unpatchable(model: torch.nn.Module, what: str) -> None:
    """UserError (one line) for a model the passes cannot patch as asked: weights on the meta device (no
    values to patch or check), or a model a recipe has patched already (a second recipe would find its
    modules replaced, change nothing and report the counts of nothing). what: the call, for the message."""
    param = next(iter(model.parameters()), None)
    if param is not None and param.device.type == "meta":
        raise UserError(f"{what}: the model's weights are on the meta device (no values): materialize them "
                        "(to_empty, then load a state_dict) first")
    from workbench.optimize.passes.block_plan import PLANS_ATTRIBUTE

    for name, module in model.named_modules():
        if PLANS_ATTRIBUTE in vars(module) or type(module).__module__.startswith("workbench."):
            raise UserError(f"{what}: the model is patched already ({name or 'the model'} is "
                            f"{type(module).__name__}): build a fresh timm model and load the weights into it "
                            "(state_dict() gives timm's)")
