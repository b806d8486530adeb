"""sdpa_attention: window attention on PyTorch's F.scaled_dot_product_attention, for Swin v1 and SwinV2.

Swin v1: timm's WindowAttention reads `self.fused_attn` in every forward, so the blocks' plans
(block_plan.py) get `sdpa` and binding sets it on the built instances (no rebuild, same weights). SDPA gets
the relative position bias (plus the shift mask) as a float attn_mask, so PyTorch picks the
memory-efficient or math kernel, not flash. Where fused_attention plans the Triton kernel for a block,
that kernel runs instead.

SwinV2 (timm's swin_transformer_v2 WindowAttention and swin_transformer_v2_cr WindowMultiHeadAttention,
_swin.py): timm computes the cosine attention eagerly (scores, scale, bias, mask and softmax as separate
ops, the (B_, nH, N, N) scores written and read several times each way). Each module of exactly timm's
classes gets `v2_sdpa_forward` bound on the instance: the same function in PyTorch alone, written as
timm's v1 path writes its own, which is what a user would write: q and k normalized, the per-head logit
scale folded into q, the position bias (16 * sigmoid of cpb_mlp's table gathered to (nH, N, N); -CR:
meta_mlp's output reshaped) added to the shift mask as SDPA's float attn_mask, and SDPA with scale 1.
No parameter or buffer changes (state_dict is the same). Attention dropout runs as SDPA's dropout_p, as timm's v1 path runs it (another random stream than
timm's eager dropout). Subclasses and modules whose forward was replaced elsewhere keep timm's path,
counted by reason.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from workbench.optimize.passes import PassContext, PassResult, PassUnavailable
from workbench.optimize.passes._swin import (named_swin_blocks, passes_input_to_qkv, v2_attention_classes, v2_bias,
                                             v2_qkv, v2_terms, v2_why_not_class)
from workbench.optimize.passes.block_plan import block_plans

NAME = "sdpa_attention"


def window_attention_modules(model):
    """Every timm WindowAttention in `model` (Swin v1)."""
    from timm.models.swin_transformer import WindowAttention

    return [m for m in model.modules() if isinstance(m, WindowAttention)]


@passes_input_to_qkv
def v2_sdpa_forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """timm's SwinV2 WindowAttention.forward with its core on F.scaled_dot_product_attention:
    normalize(q) * exp(min(logit_scale, log 100)) against normalize(k) with scale 1, plus 16 * sigmoid
    of cpb_mlp's bias table and the (nW, N, N) shift mask as attn_mask, attn_drop's p as dropout_p while
    training, then proj. q, k and the mask are cast to v's dtype (SDPA takes one dtype)."""
    b_, n, c = x.shape
    qkv_bias, logit_scale, table = v2_terms(self)
    q, k, v = v2_qkv(self, x, qkv_bias).reshape(b_, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    q = (F.normalize(q, dim=-1) * logit_scale.view(1, -1, 1, 1)).to(v.dtype)
    k = F.normalize(k, dim=-1).to(v.dtype)
    bias = v2_bias(self, table, n)                                                 # (nH, N, N)
    if mask is None:
        attn_mask = bias.unsqueeze(0)
    else:
        num_win = mask.shape[0]
        attn_mask = (bias.unsqueeze(0) + mask.unsqueeze(1)).unsqueeze(0)           # (1, nW, nH, N, N)
        attn_mask = attn_mask.expand(b_ // num_win, -1, -1, -1, -1).reshape(b_, self.num_heads, n, n)
    x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask.to(v.dtype),
                                       dropout_p=self.attn_drop.p if self.training else 0.0, scale=1.0)
    return self.proj_drop(self.proj(x.transpose(1, 2).reshape(b_, n, c)))


def bound_here(attn: torch.nn.Module) -> bool:
    """Whether attn's forward is v2_sdpa_forward, bound by this pass (or by fused_attention's route)."""
    return getattr(vars(attn).get("forward"), "__func__", None) is v2_sdpa_forward


def v2_why_not(attn: torch.nn.Module) -> str | None:
    """None when v2_sdpa_forward computes this SwinV2 attention's function, else why it keeps timm's."""
    why = v2_why_not_class(attn)
    if why:
        return why
    if "forward" in vars(attn) and not bound_here(attn):
        return "its forward was replaced elsewhere"
    return None


def bind_v2(attn: torch.nn.Module) -> None:
    """Bind v2_sdpa_forward on this SwinV2 WindowAttention (v2_why_not is None for it)."""
    attn.forward = types.MethodType(v2_sdpa_forward, attn)


def _apply_v2(model) -> tuple[int, dict[str, int]]:
    classes = v2_attention_classes()
    patched, left = 0, {}
    for m in model.modules():
        if not isinstance(m, classes):
            continue
        reason = v2_why_not(m)
        if reason is None:
            bind_v2(m)
            patched += 1
        else:
            left[reason] = left.get(reason, 0) + 1
    return patched, left


def apply(model, ctx: PassContext):
    blocks = [(name, blk) for name, blk in named_swin_blocks(model) if hasattr(blk.attn, "fused_attn")]
    v2_patched, v2_left = _apply_v2(model)
    if not blocks and not (v2_patched or v2_left):
        raise PassUnavailable("no timm WindowAttention (Swin v1 or SwinV2) in this model")
    parts, details = [], {}
    if blocks:
        already = sum(bool(blk.attn.fused_attn) for _, blk in blocks)
        plans = block_plans(model)
        for name, _ in blocks:
            plans.update(name, sdpa=True)
        plans.bind(model)
        parts.append(f"{len(blocks)} WindowAttention modules use F.scaled_dot_product_attention")
        details.update(modules=len(blocks), already_fused=already)
    if v2_patched or v2_left:
        text = (f"{v2_patched} SwinV2 attention modules run their cosine attention on "
                "F.scaled_dot_product_attention (logit scale folded into q, position bias and mask as attn_mask)")
        for reason, count in sorted(v2_left.items()):
            text += f"; {count} left on timm's path ({reason})"
        parts.append(text)
        details.update(swinv2_modules=v2_patched, swinv2_left_on_timm=v2_left)
    return model, PassResult(NAME, {}, "; ".join(parts), details)
