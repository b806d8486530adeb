"""sdpa_attention: timm's own fused path for window attention, F.scaled_dot_product_attention.

timm's WindowAttention reads `self.fused_attn` in every forward, so setting it on the built
instances is enough (no rebuild, same weights). SDPA gets the relative position bias (plus the
shift mask) as a float attn_mask, so PyTorch picks the memory-efficient or math kernel, not flash.
"""
from __future__ import annotations

from . import PassContext, PassResult, PassUnavailable

NAME = "sdpa_attention"


def window_attention_modules(model):
    """Every timm WindowAttention in `model` (Swin v1)."""
    from timm.models.swin_transformer import WindowAttention

    return [m for m in model.modules() if isinstance(m, WindowAttention)]


def apply(model, ctx: PassContext):
    modules = window_attention_modules(model)
    if not modules:
        raise PassUnavailable("no timm WindowAttention in this model (replaced by an earlier pass?)")
    already = sum(bool(m.fused_attn) for m in modules)
    for m in modules:
        m.fused_attn = True
    changed = f"{len(modules)} WindowAttention modules use F.scaled_dot_product_attention"
    return model, PassResult(NAME, {}, changed, {"modules": len(modules), "already_fused": already})
