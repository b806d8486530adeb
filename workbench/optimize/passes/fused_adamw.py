"""fused_adamw: one fused optimizer kernel (per parameter group) instead of for-each AdamW launches.

impl 'auto' (default): apex.optimizers.FusedAdam(adam_w_mode=True) when apex imports (what NVIDIA's
Swin talk used), else torch.optim.AdamW(fused=True). On the CPU it stays torch's for-each AdamW
(fused CPU AdamW is no GPU figure) and says so. Under FSDP2 (`ctx.sharded`) 'auto' is torch's fused
AdamW, which steps DTensor shards; apex's kernels take plain tensors only. Hyperparameters are read
from the baseline optimizer so the stage computes the same update, with the ones a user chose
(`ctx.optimizer_settings`, set by `workbench.api.optimize_swin`) over them.
"""
from __future__ import annotations

import torch

from workbench.errors import UserError
from workbench.optimize.passes import PassContext, PassResult, PassUnavailable, default_optimizer_factory

NAME = "fused_adamw"
IMPLS = ("auto", "apex", "torch")
PARAMS = {"impl": (str, IMPLS)}   # parameter -> (type, allowed values), checked when a recipe is loaded


def baseline_hyperparameters() -> dict:
    """lr, betas, eps, weight_decay of `default_optimizer_factory` (built on a dummy parameter)."""
    opt = default_optimizer_factory([torch.nn.Parameter(torch.zeros(1))])
    return {k: opt.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")}


def _apex_fused_adam():
    from apex.optimizers import FusedAdam  # type: ignore

    return FusedAdam


def in_your_loop(params: dict, ctx: PassContext) -> str | None:
    """What a loop of your own writes to get this pass (workbench.optimize.patching.patch_swin); None for a
    patch planned for inference (no optimizer)."""
    if not ctx.training:
        return None
    return ("step with a fused optimizer: torch.optim.AdamW(params, ..., fused=True) (or apex's FusedAdam "
            "with adam_w_mode=True)")


def apply(model, ctx: PassContext, impl: str = "auto"):
    if impl not in IMPLS:
        raise UserError(f"pass fused_adamw: impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    hp = {**baseline_hyperparameters(), **ctx.optimizer_settings}
    if ctx.device.type != "cuda":
        if impl == "apex":
            raise PassUnavailable("apex FusedAdam needs a CUDA device")
        ctx.optimizer_factory = lambda params: torch.optim.AdamW(params, **hp, foreach=True)
        ctx.optimizer_name = "torch.optim.AdamW(foreach=True)"
        return model, PassResult(NAME, {"impl": impl}, "CPU: kept for-each AdamW (fused AdamW is a GPU kernel)",
                                 {"optimizer": ctx.optimizer_name, **hp})
    fused_adam = None
    if impl == "apex" and ctx.sharded:
        raise PassUnavailable("apex FusedAdam steps plain tensors, not FSDP's DTensor shards: use impl torch")
    if impl in ("auto", "apex") and not ctx.sharded:
        try:
            fused_adam = _apex_fused_adam()
        except ImportError as exc:
            if impl == "apex":
                raise PassUnavailable(f"apex is not importable: {exc}") from None
    if fused_adam is not None:
        ctx.optimizer_factory = lambda params: fused_adam(params, adam_w_mode=True, **hp)
        ctx.optimizer_name = "apex.optimizers.FusedAdam(adam_w_mode=True)"
    else:
        ctx.optimizer_factory = lambda params: torch.optim.AdamW(params, **hp, fused=True)
        ctx.optimizer_name = "torch.optim.AdamW(fused=True)"
    return model, PassResult(NAME, {"impl": impl}, f"optimizer -> {ctx.optimizer_name}",
                             {"optimizer": ctx.optimizer_name, **hp})
