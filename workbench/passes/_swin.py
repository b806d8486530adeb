"""What the passes that patch timm's SwinTransformerBlock share: finding the blocks, square windows,
and whether a dropout / stochastic-depth module is the identity right now."""
from __future__ import annotations

import importlib

import torch

from . import PassContext, PassUnavailable, require_triton


def square(pair) -> int | None:
    """The side of a square timm (h, w) window or shift (or an int), None when not square."""
    a, b = (pair, pair) if isinstance(pair, int) else tuple(pair)
    return int(a) if a == b else None


def inactive(m: torch.nn.Module | None, training: bool) -> bool:
    """m(x) is x now: None or nn.Identity, nn.Dropout with p == 0 or in eval, timm's DropPath with
    drop_prob 0 or in eval."""
    if m is None or isinstance(m, torch.nn.Identity):
        return True
    if isinstance(m, torch.nn.Dropout):
        return m.p == 0 or not training
    if type(m).__name__ == "DropPath":
        return getattr(m, "drop_prob", 1.0) == 0.0 or not training
    return False


def swin_blocks(model: torch.nn.Module, ctx: PassContext, kernels: str, what: str) -> list:
    """Every timm SwinTransformerBlock in `model`, after checking that timm and the Triton kernel module
    `kernels` import and that the device runs Triton; PassUnavailable (naming `what`) otherwise."""
    try:
        from timm.models.swin_transformer import SwinTransformerBlock

        importlib.import_module(kernels)
    except ImportError as exc:
        raise PassUnavailable(f"{what} not importable: {exc}") from exc
    require_triton(ctx.device)
    blocks = [m for m in model.modules() if isinstance(m, SwinTransformerBlock)]
    if not blocks:
        raise PassUnavailable("no timm SwinTransformerBlock in this model")
    return blocks
