"""Pass `fused_block`: each timm SwinTransformerBlock runs as one autograd Function, for the host.

After the kernel passes (fused_window, fused_attention, fused_layernorm's add+norm2, fused_linear) a
Swin training step does much less GPU work than AMP, yet in eager mode it is no faster: the step is bound
by the host issuing each launch through an nn.Module call, autocast dispatch, autograd graph recording
or a Python autograd Function. This pass keeps the same kernels and the same cuBLAS GEMMs but plans
`whole_block` (block_plan.py): the block's forward and backward are issued from one
`block_forward.SwinBlockFunction`:

    forward   norm_shift_partition -> qkv GEMM -> window attention -> proj GEMM -> merge_roll
              -> add + norm2 (add_layer_norm) -> fc1 GEMM -> GELU -> fc2 GEMM -> + residual
    backward  the same in reverse, by hand: bias gradients and the GELU backward in the fused
              reduction (kernels.linear), LayerNorm backwards with the residual gradient folded in

so autograd records one node per block instead of 21 (eight of them Python autograd Functions, in the
dense stack under autocast), and the block's Python runs once per direction. Its backward zeroes one
buffer for all six column reductions of the block and scatters the relative-position table's gradient
with one index_add_. Numerics are those of the dense stage under autocast: GEMMs in the autocast dtype on
weights cast once per step, LayerNorm statistics and the residual stream in fp32, the attention in the
fused kernel, bias gradients summed in fp32. The LayerNorms write their outputs straight in the GEMMs'
dtype (one rounding, as autocast's cast would do).

A block is planned so when it is timm's plain configuration (square window and shift, LayerNorms with
weight and bias, qkv/proj/fc biases, timm's Mlp with exact GELU and no hidden norm) and fused_attention
has not left its attention on PyTorch's path (measured faster, above max_tokens, attention dropout).
Others keep the forward their plan had (counted in the details; the plan says why). At run time the
block falls back to the forward of the rest of its plan while torch.compile traces (the Function is not
traced; the kernels are custom ops there), while a dropout (or a drop path other than timm's DropPath)
is active, or when its window is made non-square. timm's stochastic depth runs inside the Function: the per-sample factors are
drawn with timm's calls in timm's order, so a seed drops the same samples, and each branch and its
gradient are multiplied by them in one Triton pass (kernels.drop_path).
"""
from __future__ import annotations

import torch

from workbench.optimize.passes import PassContext, PassResult, PassUnavailable
from workbench.optimize.passes._swin import square, stand_aside_v2, swin_blocks
from workbench.optimize.passes.block_plan import block_plans

NAME = "fused_block"
OWN_KERNELS = True   # runs swinbench kernels: a stage with it is not PyTorch alone


def _why_not(blk) -> str | None:
    """None when the block has the plain configuration the Function implements, else the reason."""
    attn, mlp = blk.attn, blk.mlp
    if square(blk.window_size) is None or square(blk.shift_size) is None:
        return "non-square window or shift"
    for name in ("norm1", "norm2"):
        norm = getattr(blk, name)
        if tuple(getattr(norm, "normalized_shape", ())) != (blk.dim,) or getattr(norm, "weight", None) is None \
                or getattr(norm, "bias", None) is None:
            return f"{name} is not a LayerNorm with weight and bias"
    if not hasattr(attn, "relative_position_bias_table") or not hasattr(attn, "relative_position_index"):
        return "attention without timm's relative position table"
    linears = (attn.qkv, attn.proj, getattr(mlp, "fc1", None), getattr(mlp, "fc2", None))
    if any(not isinstance(lin, torch.nn.Linear) or lin.bias is None for lin in linears):
        return "a Linear without bias, or an MLP that is not timm's Mlp"
    act = getattr(mlp, "act", None)
    if not isinstance(act, torch.nn.GELU) or act.approximate != "none":
        return "MLP activation is not exact GELU"
    if not isinstance(getattr(mlp, "norm", torch.nn.Identity()), torch.nn.Identity):
        return "MLP with a hidden norm"
    return None


def _attention_fallback(plan) -> str | None:
    """Why fused_attention left this block's attention off the kernel (measured faster on PyTorch's path,
    above max_tokens, attention dropout), None where it did not: the whole-block Function runs the kernel."""
    return None if plan.attention == "triton" else dict(plan.fallbacks).get("attention")


def apply(model: torch.nn.Module, ctx: PassContext) -> tuple[torch.nn.Module, PassResult]:
    """Plan `whole_block` for every plain timm SwinTransformerBlock in `model` and bind -> (model, PassResult)."""
    blocks = swin_blocks(model, ctx, "workbench.kernels.window_attention", "fused block kernels")
    if not blocks:
        return stand_aside_v2(model, NAME, "the whole-block Function computes Swin v1's pre-norm block")
    plans = block_plans(model)
    planned, reasons, already = [], {}, 0
    for name, blk in blocks:
        if plans.plan(name).whole_block:
            already += 1
            continue
        reason = ("the block's forward was replaced outside its plan" if plans.forward_replaced_elsewhere(name, blk)
                  else f"its attention stays on PyTorch's path ({_attention_fallback(plans.plan(name))})"
                  if _attention_fallback(plans.plan(name)) else _why_not(blk))
        if reason is None:
            planned.append(name)
        else:
            reasons[name] = reason
    skipped: dict[str, int] = {}
    for reason in reasons.values():
        skipped[reason] = skipped.get(reason, 0) + 1
    if not planned and not already:
        raise PassUnavailable("no SwinTransformerBlock has the plain configuration the fused block implements: "
                              + "; ".join(f"{n} {r}" for r, n in skipped.items()))
    for name in planned:
        plans.update(name, whole_block=True)
    for name, reason in reasons.items():
        plans.fall_back(name, "whole_block", reason)
    plans.bind(model)
    patched = len(planned)
    changed = (f"{patched}/{len(blocks)} SwinTransformerBlock -> one autograd Function each (fused kernels, "
               "cuBLAS GEMMs, backward by hand)")
    if skipped:
        changed += "; left as they were: " + "; ".join(f"{n} ({r})" for r, n in skipped.items())
    details = {"blocks_patched": patched, "blocks_total": len(blocks), "blocks_skipped": skipped,
               "implementation": "workbench.optimize.passes.block_forward.SwinBlockFunction"}
    return model, PassResult(NAME, {}, changed, details)
