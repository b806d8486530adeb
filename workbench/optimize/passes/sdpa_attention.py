"""sdpa_attention: timm's own fused path for window attention, F.scaled_dot_product_attention.

timm's WindowAttention reads `self.fused_attn` in every forward, so the blocks' plans (block_plan.py) get
`sdpa` and binding sets it on the built instances (no rebuild, same weights). SDPA gets the relative
position bias (plus the shift mask) as a float attn_mask, so PyTorch picks the memory-efficient or math
kernel, not flash. Where fused_attention plans the Triton kernel for a block, that kernel runs instead.
"""
from __future__ import annotations

from workbench.optimize.passes import PassContext, PassResult, PassUnavailable
from workbench.optimize.passes._swin import named_swin_blocks
from workbench.optimize.passes.block_plan import block_plans

NAME = "sdpa_attention"


def window_attention_modules(model):
    """Every timm WindowAttention in `model` (Swin v1)."""
    from timm.models.swin_transformer import WindowAttention

    return [m for m in model.modules() if isinstance(m, WindowAttention)]


def apply(model, ctx: PassContext):
    blocks = [(name, blk) for name, blk in named_swin_blocks(model) if hasattr(blk.attn, "fused_attn")]
    if not blocks:
        raise PassUnavailable("no timm WindowAttention in this model")
    already = sum(bool(blk.attn.fused_attn) for _, blk in blocks)
    plans = block_plans(model)
    for name, _ in blocks:
        plans.update(name, sdpa=True)
    plans.bind(model)
    changed = f"{len(blocks)} WindowAttention modules use F.scaled_dot_product_attention"
    return model, PassResult(NAME, {}, changed, {"modules": len(blocks), "already_fused": already})
