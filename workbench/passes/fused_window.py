"""Pass `fused_window`: each timm SwinTransformerBlock's window plumbing runs as two fused kernels.

timm's attention half is, per block (x: (B, H, W, C)):
    LayerNorm -> roll(-shift) -> pad -> window_partition -> attn -> window_reverse -> crop -> roll(+shift) -> + x
about eight full passes over the activations besides the attention itself. Patched, it is
    windows = norm_shift_partition(x, norm1.weight, norm1.bias, norm1.eps, ws, shift)   # one kernel
    attn    = blk.attn(windows, mask=attn_mask)                                          # unchanged module
    x       = merge_unshift_add(attn, x, ws, shift, H, W)                                # one kernel
and the MLP half is timm's. `blk.attn(...)` is called as a module, so a pass that replaces
`blk.attn.forward` (fused_attention) composes with this one in either order.

Details the patched forward keeps from timm:
  * drop_path1 active (stochastic depth, training): merge_roll, then x + drop_path1(...), unfused add.
  * dynamic_mask: the mask is built from the padded shape, as timm does (`get_attn_mask`).
  * window_size / shift_size are timm tuples; only square ones are fused. apply() raises
    PassUnavailable for a model with a non-square block; a block made non-square later
    (set_input_size) runs its previous forward.
  * Autocast: timm's LayerNorm gives fp32 under autocast (layer_norm autocasts to fp32) and the qkv
    Linear then casts it to the autocast dtype. norm_shift_partition computes in fp32 too and, when
    the windows go straight into that Linear (timm's or fused_attention's forward), writes them in the
    autocast dtype itself: the same bits as the cast, without the cast's pass over the activation or
    the backward's cast back (`_swin.autocast_input_dtype`). add_layer_norm does the same for norm2's
    output when it goes straight into the MLP's fc1. merge_unshift_add adds the (bf16/fp16) attention
    output into the fp32 residual and returns fp32, as `x + attn` does.
  * Residual add after the MLP: in eager mode each stage hands a block's MLP branch to the next block
    unadded, whose norm kernel adds it (`add_norm_shift_partition`, `swin_stage_forward_fused_window`);
    the stage's last block adds its own. Same values as `x + branch`; one launch and one autograd node
    fewer per block each way. Inside that loop a block returns (x, branch): a forward hook on a block
    sees that pair (the stages' outputs are whole).
  * Composition with fused_layernorm(fuse_residual=True): a block that carries
    `_swinbench_add_norm2` keeps that fusion (the contract in fused_layernorm's docstring), and in eager
    mode goes one step further: `merge_add_norm` merges the attention windows back, adds them into x and
    runs norm2 in one kernel, whose backward writes the gradient of the sum once in token order (the
    residual's) and once in window order (the attention output's). That saves, per block, the merged
    branch's write and read forward, and the cast and re-partition of its gradient backward: three
    launches and one autograd node. Under torch.compile (or with drop_path1 active) the branch is merged
    with merge_roll and `add_layer_norm(x, branch, norm2...)` does the add and norm2. A block whose
    forward another pass replaced is left alone and counted in details["blocks_forward_already_patched"].
"""
from __future__ import annotations

import types

import torch

from . import PassContext, PassResult, PassUnavailable
from ._swin import attn_input_goes_to_linear, inactive, norm_output_dtype, square, swin_blocks
from .fused_layernorm import add_norm2, norm2_output_dtype

NAME = "fused_window"


def _window_attention_windows(self, x: torch.Tensor, pending: torch.Tensor | None = None):
    """-> (attn_windows (B*nW, ws*ws, C), ws, shift, x), or None when this block can't be fused now.
    pending: the previous block's MLP branch, not yet added to x (`swin_stage_forward_fused_window`): the
    add is done by the norm's kernel, and the x returned is the sum (the residual stream)."""
    from ..kernels.window import add_norm_shift_partition, norm_shift_partition

    ws, shift = square(self.window_size), square(self.shift_size)
    if ws is None or shift is None:
        return None
    B, H, W, C = x.shape
    # written in the autocast dtype when the windows go straight into the qkv Linear, which would cast them;
    # else in the dtype torch's layer_norm gives under autocast
    to_linear = attn_input_goes_to_linear(self.attn)
    if pending is not None:
        x, windows = add_norm_shift_partition(x, pending, self.norm1.weight, self.norm1.bias, self.norm1.eps, ws, shift,
                                              norm_output_dtype(x, to_linear, torch.promote_types(x.dtype, pending.dtype)))
    else:
        windows = norm_shift_partition(x, self.norm1.weight, self.norm1.bias, self.norm1.eps, ws, shift,
                                       norm_output_dtype(x, to_linear))
    if getattr(self, "dynamic_mask", False):
        Hp, Wp = -(-H // ws) * ws, -(-W // ws) * ws
        # get_attn_mask reads only the shape, device and dtype of timm's padded, shifted x (x's dtype here)
        attn_mask = self.get_attn_mask(x.new_empty((1, Hp, Wp, 1)))
    else:
        attn_mask = self.attn_mask
    return self.attn(windows, mask=attn_mask), ws, shift, x


def _unfused(self, x, pending, defer):
    """The block's previous forward, after adding a pending branch; (x, None) when deferring."""
    if pending is not None:
        x = x + pending
    out = self._swinbench_forward_before_fused_window(x)
    return (out, None) if defer else out


def _as_map(t: torch.Tensor, B: int, H: int, W: int, C: int) -> torch.Tensor:
    """t as (B, H, W, C): t itself when it has that shape already (a reshape would still record a view)."""
    return t if t.dim() == 4 else t.reshape(B, H, W, C)


def _mlp_half(self, x, h, B, H, W, C, defer):
    """x + drop_path2(mlp(h)), or with `defer` (x, that branch) for the next block's norm to add. x and h
    may come as (B, H, W, C), (B, L, C) or token rows (B*L, C); the results are (B, H, W, C)."""
    branch = _as_map(self.drop_path2(self.mlp(h)), B, H, W, C)
    if defer:
        return _as_map(x, B, H, W, C), branch
    return _as_map(x, B, H, W, C) + branch


def swin_block_forward_fused_window(self, x: torch.Tensor, pending: torch.Tensor | None = None, defer: bool = False):
    """timm SwinTransformerBlock.forward with fused norm1+shift+partition and merge+unshift+add. x: (B, H, W, C).
    pending / defer: see swin_stage_forward_fused_window (called as blk(x) they are unused)."""
    from ..kernels.window import merge_roll, merge_unshift_add

    out = _window_attention_windows(self, x, pending)
    if out is None:
        return _unfused(self, x, pending, defer)
    attn_windows, ws, shift, x = out
    B, H, W, C = x.shape
    if inactive(self.drop_path1, self.training):
        x = merge_unshift_add(attn_windows, x, ws, shift, H, W)
    else:
        x = x + self.drop_path1(merge_roll(attn_windows, ws, shift, H, W))
    x = x.reshape(B, -1, C)
    return _mlp_half(self, x, self.norm2(x), B, H, W, C, defer)


def swin_block_forward_fused_window_add_norm2(self, x: torch.Tensor, pending: torch.Tensor | None = None,
                                              defer: bool = False):
    """As swin_block_forward_fused_window, keeping fused_layernorm's add+norm2 fusion. x: (B, H, W, C)."""
    from ..kernels.window import merge_roll

    out = _window_attention_windows(self, x, pending)
    if out is None:
        return _unfused(self, x, pending, defer)
    attn_windows, ws, shift, x = out
    B, H, W, C = x.shape
    if inactive(self.drop_path1, self.training) and not torch.compiler.is_compiling():
        x, h = _merge_add_norm2(self, attn_windows, x, ws, shift)
    else:
        branch = self.drop_path1(merge_roll(attn_windows, ws, shift, H, W))
        x, h = add_norm2(self, x, branch)
    return _mlp_half(self, x, h, B, H, W, C, defer)


def _merge_add_norm2(blk, attn_windows: torch.Tensor, x: torch.Tensor, ws: int, shift: int):
    """add_norm2(blk, x, merge_roll(attn_windows)) as one kernel each way (merge_add_norm) -> (sum (B, H, W, C),
    normed (B*H*W, C) token rows: the MLP's Linears take them without view nodes of their own), the normed
    output in the dtype add_norm2 would write."""
    from ..kernels.window import merge_add_norm

    norm2 = blk.norm2
    return merge_add_norm(attn_windows, x, norm2.weight, norm2.bias, norm2.eps, ws, shift,
                          norm2_output_dtype(blk, x, attn_windows.dtype), y_rows=True)


DEFERRING_FORWARDS = (swin_block_forward_fused_window, swin_block_forward_fused_window_add_norm2)


def _defers(blk) -> bool:
    """Whether blk's forward is still one of ours (a later pass, fused_block, may have replaced it)."""
    return getattr(vars(blk).get("forward"), "__func__", None) in DEFERRING_FORWARDS


def swin_stage_forward_fused_window(self, x: torch.Tensor) -> torch.Tensor:
    """timm SwinTransformerStage.forward where each fused block hands its MLP branch to the next one
    unadded, and the next block's norm kernel adds it (add_norm_shift_partition): the residual add after
    every MLP but a stage's last runs inside a kernel that reads those tensors anyway, and its backward
    joins the norm's, so eager mode saves the add's launch and the backward's gradient sum. Blocks are
    still called as modules (their hooks, NVTX ranges included, run). Under torch.compile, or with
    gradient checkpointing, the stage runs as timm's: Inductor fuses such adds itself."""
    if torch.compiler.is_compiling() or (getattr(self, "grad_checkpointing", False) and not torch.jit.is_scripting()):
        return self._swinbench_forward_before_fused_window(x)
    x = self.downsample(x)
    pending = None
    for blk in self.blocks:
        if _defers(blk):
            x, pending = blk(x, pending, True)
        else:
            if pending is not None:
                x, pending = x + pending, None
            x = blk(x)
    return x if pending is None else x + pending


def _norm1_fusable(norm) -> bool:
    shape = getattr(norm, "normalized_shape", None)
    return (
        shape is not None and len(tuple(shape)) == 1
        and getattr(norm, "weight", None) is not None and getattr(norm, "bias", None) is not None
        and hasattr(norm, "eps")
    )


def _patch_stages(model: torch.nn.Module) -> int:
    """Give every timm SwinTransformerStage with two or more of our blocks the deferring forward -> count."""
    from timm.models.swin_transformer import SwinTransformerStage

    n = 0
    for stage in model.modules():
        if not isinstance(stage, SwinTransformerStage) or "forward" in vars(stage):
            continue
        if sum(_defers(b) for b in getattr(stage, "blocks", [])) < 2:
            continue
        stage._swinbench_forward_before_fused_window = stage.forward
        stage.forward = types.MethodType(swin_stage_forward_fused_window, stage)
        n += 1
    return n


def apply(model: torch.nn.Module, ctx: PassContext) -> tuple[torch.nn.Module, PassResult]:
    """Patch every timm SwinTransformerBlock in `model` in place -> (model, PassResult)."""
    blocks = swin_blocks(model, ctx, "workbench.kernels.window", "fused window kernels")
    non_square = [i for i, b in enumerate(blocks) if square(b.window_size) is None or square(b.shift_size) is None]
    if non_square:
        raise PassUnavailable(f"{len(non_square)} block(s) with non-square window_size/shift_size: only square windows are fused")

    counts = {"blocks_patched": 0, "blocks_shifted": 0, "blocks_with_add_norm2": 0, "blocks_with_drop_path": 0,
              "blocks_dynamic_mask": 0, "blocks_forward_already_patched": 0, "blocks_norm1_not_fusable": 0,
              "blocks_already_fused_window": 0}
    for blk in blocks:
        if getattr(blk, "_swinbench_fused_window", False):
            counts["blocks_already_fused_window"] += 1
            continue
        add_norm2 = getattr(blk, "_swinbench_add_norm2", False)
        if "forward" in vars(blk) and not add_norm2:
            counts["blocks_forward_already_patched"] += 1
            continue
        if not _norm1_fusable(blk.norm1):
            counts["blocks_norm1_not_fusable"] += 1
            continue
        blk._swinbench_forward_before_fused_window = blk.forward
        fwd = swin_block_forward_fused_window_add_norm2 if add_norm2 else swin_block_forward_fused_window
        blk.forward = types.MethodType(fwd, blk)
        blk._swinbench_fused_window = True
        counts["blocks_patched"] += 1
        counts["blocks_shifted"] += int(any(blk.shift_size))
        counts["blocks_with_add_norm2"] += int(add_norm2)
        counts["blocks_with_drop_path"] += int(not isinstance(blk.drop_path1, torch.nn.Identity))
        counts["blocks_dynamic_mask"] += int(bool(getattr(blk, "dynamic_mask", False)))

    counts["stages_deferring_mlp_add"] = _patch_stages(model)
    changed = (f"{counts['blocks_patched']}/{len(blocks)} SwinTransformerBlock: norm1+roll+pad+partition -> "
               f"norm_shift_partition, merge+crop+roll+add -> merge_unshift_add (Triton, fwd+bwd)")
    if counts["blocks_with_add_norm2"]:
        changed += (f"; in {counts['blocks_with_add_norm2']} block(s) with fused_layernorm's add+norm2, merge + add + "
                    "norm2 -> merge_add_norm (eager)")
    if counts["stages_deferring_mlp_add"]:
        changed += (f"; in {counts['stages_deferring_mlp_add']} stage(s) each MLP's residual add goes into the next "
                    "block's norm kernel (add_norm_shift_partition, eager)")
    skipped = counts["blocks_forward_already_patched"] + counts["blocks_norm1_not_fusable"]
    if skipped:
        changed += f"; {skipped} left as they were"
    details = dict(counts, blocks_total=len(blocks),
                   implementation="workbench.kernels.window (Triton): norm_shift_partition, merge_unshift_add, "
                                  "add_norm_shift_partition, merge_add_norm")
    return model, PassResult(NAME, {}, changed, details)
