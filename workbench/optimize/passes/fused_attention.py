"""Pass `fused_attention`: run every timm WindowAttention of the Swin blocks through the fused Triton kernel.

Each block's plan (block_plan.py) gets `attention = triton`: its WindowAttention keeps the qkv and proj
Linears as they are and swaps the attention core (q k^T * scale + bias + mask, softmax, @ v) for the fused
kernel (block_forward.attention_forward): the N x N scores never reach global memory, and the
relative-position bias is read from timm's table by the kernels (bias: table) or gathered from it in one
launch (bias: gather), its gradient summed back into the table by one deterministic Triton launch over the
index's inverse. Blocks whose attention has a non-zero attn_drop keep timm's path (the kernel has no
dropout) and are counted; the plan says why.

Route per shape: windows of up to 64 tokens (window 7: 49) run the kernel that holds a window's keys in
one tile; windows of 65 to 256 tokens (window 12: 144) run its key-tiled path (keys in blocks of 64).
Both beat PyTorch's SDPA at their shapes on an H200 (docs/kernels.md has the figures). Windows above
`max_tokens` tokens (default and largest: 256, what the kernels take; SwinV2's window 24 holds 576) run
timm's F.scaled_dot_product_attention path instead, each plan says why, and the pass result counts them;
a smaller `max_tokens` in a recipe moves the line (`max_tokens: 64` keeps window 12 on SDPA).
"""
from __future__ import annotations

import torch

from workbench.errors import UserError
from workbench.optimize.passes import PassContext, PassResult
from workbench.optimize.passes._swin import swin_blocks
from workbench.optimize.passes.block_plan import BIAS_MODES, block_plans

NAME = "fused_attention"
OWN_KERNELS = True   # runs swinbench kernels: a stage with it is not PyTorch alone
PARAMS = {"bias": (str, BIAS_MODES), "max_tokens": (int, None)}   # parameter -> (type, allowed values)
KERNEL_MAX_TOKENS = 256   # the largest window (tokens) the kernels take: four 64-key blocks
MAX_TOKENS = KERNEL_MAX_TOKENS   # default: every window the kernels take runs on them


def _reads_timm_table(attn: torch.nn.Module) -> bool:
    """Whether the module's bias is timm's gather from a 2-D table through its index (what the kernels can
    read themselves), not a computation of a subclass's own."""
    from timm.models.swin_transformer import WindowAttention

    table, index = getattr(attn, "relative_position_bias_table", None), getattr(attn, "relative_position_index", None)
    return (table is not None and index is not None and table.dim() == 2
            and type(attn)._get_rel_pos_bias is WindowAttention._get_rel_pos_bias)


def window_tokens(blk: torch.nn.Module) -> int:
    """Tokens per attention window of a timm SwinTransformerBlock as built now."""
    area = getattr(blk.attn, "window_area", None)
    if area is None:
        ws = blk.window_size if isinstance(blk.window_size, (tuple, list)) else (blk.window_size,) * 2
        area = int(ws[0]) * int(ws[1])
    return int(area)


def apply(model: torch.nn.Module, ctx: PassContext, bias: str = "table",
          max_tokens: int = MAX_TOKENS) -> tuple[torch.nn.Module, PassResult]:
    """Plan the fused attention for every timm SwinTransformerBlock in `model` and bind -> (model, PassResult).

    bias: 'table' (default) has the kernels read timm's relative-position table through its index
    themselves and the backward sum the bias gradient straight into the table (two launches fewer per
    block than 'gather'); 'gather' gathers the (nH, N, N) bias from the table in one launch before the
    kernel. A module with its own bias computation (a subclass overriding _get_rel_pos_bias) gets
    'gather'. max_tokens: blocks with larger windows run timm's SDPA path (the module docstring says why)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= KERNEL_MAX_TOKENS:
        raise UserError(f"pass fused_attention: max_tokens must be a whole number from 1 to {KERNEL_MAX_TOKENS} "
                        f"(the kernels' largest window), not {max_tokens!r}")
    if bias not in BIAS_MODES:
        raise UserError(f"pass fused_attention: bias must be one of {', '.join(sorted(BIAS_MODES))}, not {bias!r}")
    blocks = swin_blocks(model, ctx, "workbench.kernels.window_attention", "fused window attention kernel")
    plans = block_plans(model)
    patched, skipped_dropout, table_modules = 0, 0, 0
    routed: dict[int, int] = {}        # window tokens -> blocks sent to SDPA
    for name, blk in blocks:
        tokens = window_tokens(blk)
        if tokens > max_tokens:
            routed[tokens] = routed.get(tokens, 0) + 1
            plans.update(name, sdpa=True)
            plans.fall_back(name, "attention", f"{tokens} tokens per window, above max_tokens {max_tokens}: "
                                               + ("PyTorch's SDPA runs (the kernels take at most "
                                                  f"{KERNEL_MAX_TOKENS})" if tokens > KERNEL_MAX_TOKENS
                                                  else "PyTorch's SDPA runs, as the recipe asks"))
            continue
        if blk.attn.attn_drop.p > 0:
            skipped_dropout += 1  # the kernel has no attention dropout: keep timm's path
            plans.fall_back(name, "attention", "attn_drop > 0: the kernel has no dropout")
            continue
        table = bias == "table" and _reads_timm_table(blk.attn)
        plans.update(name, attention="triton", attention_bias="table" if table else "gather")
        if bias == "table" and not table:
            plans.fall_back(name, "attention_bias", "the module computes its relative-position bias itself")
        patched += 1
        table_modules += bool(table)
    plans.bind(model)
    changed = f"{patched} WindowAttention -> fused Triton window attention (fwd+bwd)"
    if skipped_dropout:
        changed += f"; {skipped_dropout} left on timm's path (attn_drop > 0)"
    for tokens, count in sorted(routed.items()):
        changed += f"; {count} with {tokens}-token windows on PyTorch's SDPA (above max_tokens {max_tokens})"
    if bias == "table":
        changed += f", {table_modules} reading the bias table in-kernel"
    else:
        changed += ", the bias gathered before the kernel"
    details = {
        "patched_modules": patched,
        "skipped_attn_dropout": skipped_dropout,
        "sdpa_routed": sum(routed.values()),
        "max_tokens": max_tokens,
        "bias": bias,
        "table_modules": table_modules,
        "implementation": ("workbench.kernels.window_attention.fused_window_attention_table (Triton)" if table_modules
                           else "workbench.kernels.window_attention.fused_window_attention_qkv (Triton)"),
    }
    params = {**({"bias": bias} if bias != "table" else {}), **({"max_tokens": max_tokens} if max_tokens != MAX_TOKENS else {})}
    return model, PassResult(NAME, params, changed, details)
