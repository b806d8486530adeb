"""Pass `fused_window`: each timm SwinTransformerBlock's window plumbing runs as two fused kernels.

timm's attention half is, per block (x: (B, H, W, C)):
    LayerNorm -> roll(-shift) -> pad -> window_partition -> attn -> window_reverse -> crop -> roll(+shift) -> + x
about eight full passes over the activations besides the attention itself. Planned (`window` in the
block's plan, block_plan.py; the forward is block_forward.py's), it is
    windows = norm_shift_partition(x, norm1.weight, norm1.bias, norm1.eps, ws, shift)   # one kernel
    attn    = blk.attn(windows, mask=attn_mask)                                          # the attention module
    x       = merge_unshift_add(attn, x, ws, shift, H, W)                                # one kernel
and the MLP half is timm's. `blk.attn(...)` is called as a module: whatever attention the plan gives it
(timm's, SDPA, fused_attention's) runs there.

Details the planned forward keeps from timm:
  * drop_path1 active (stochastic depth, training): timm's DropPath multiplies inside merge_add_norm
    (with add_norm2) or in kernels.drop_path before the add (merge_roll, then x + branch); another module
    there is called as it is.
  * dynamic_mask: the mask is built from the padded shape, as timm does (`get_attn_mask`).
  * window_size / shift_size are timm tuples; only square ones are fused. apply() raises
    PassUnavailable for a model whose blocks are all non-square; a non-square block beside square ones (a
    rectangular image's last stage) keeps timm's forward, said per block, and a block made non-square
    later (set_input_size) runs the forward its plan has without `window`.
  * Autocast: timm's LayerNorm gives fp32 under autocast (layer_norm autocasts to fp32) and the qkv
    Linear then casts it to the autocast dtype. norm_shift_partition computes in fp32 too and, when
    the windows go straight into that Linear (timm's or fused_attention's forward), writes them in the
    autocast dtype itself: the same bits as the cast, without the cast's pass over the activation or
    the backward's cast back (`_swin.autocast_input_dtype`). add_layer_norm does the same for norm2's
    output when it goes straight into the MLP's fc1. merge_unshift_add adds the (bf16/fp16) attention
    output into the fp32 residual and returns fp32, as `x + attn` does.
  * Residual add after the MLP: in eager mode (and under torch.compile with the compile pass's
    fused_window) each stage hands a block's MLP branch to the next block unadded, whose norm kernel
    adds it (`add_norm_shift_partition`, `block_forward.stage_forward`); the stage's last block adds its
    own, except in inference, where it goes to the next stage unadded (`block_forward.stages_forward`) and
    that stage's patch merging adds it in its gather-and-norm pass (fused_layernorm's merging_forward;
    stage 1's, an fp32 stream plus a bf16 branch, is the largest add of the model). Same values as
    `x + branch`; one launch and one autograd node fewer per block each way. Inside that loop a block returns (x, branch): a forward hook on a block sees that
    pair (the stages' outputs are whole).
  * With fused_layernorm's add_norm2 in the plan, in eager mode, `merge_add_norm` merges the attention
    windows back, adds them into x and runs norm2 in one kernel, whose backward writes the gradient of
    the sum once in token order (the residual's) and once in window order (the attention output's). That
    saves, per block, the merged branch's write and read forward, and the cast and re-partition of its
    gradient backward: three launches and one autograd node. Under torch.compile (unless the compile
    pass's fused_window keeps this chain, traced as operators), or with an active drop_path1 other than
    timm's DropPath, the branch is merged with merge_roll and `add_layer_norm(x, branch, norm2...)` does
    the add and norm2.
A block whose forward was replaced outside the plans is left alone and counted in
details["blocks_forward_already_patched"].

SwinV2 (a model of timm's SwinTransformerV2Blocks only, or of swin_transformer_v2_cr's blocks, whose
`_shifted_window_attn` is the same method under another name): the block is post-norm,
    x = x + drop_path1(norm1(_attn(x))),   _attn: roll(-shift) -> pad -> window_partition -> attn
                                                  -> window_reverse -> crop -> roll(+shift)
so there is no norm before the partition to fold, and the residual add comes after norm1. Each block of
exactly timm's class with square window_size and shift_size gets, bound on the instance (no new parameters
or buffers: state_dict is unchanged), v2_window_attn as its `_attn`:
    windows = roll_partition(x, ws, shift)                # one kernel (roll + pad + partition)
    attn    = self.attn(windows, mask=attn_mask)           # the attention module, timm's or fused_attention's
    x       = merge_roll(attn, ws, shift, H, W)            # one kernel (reverse + crop + roll)
with timm's mask: the block's attn_mask, or get_attn_mask over the padded shape with dynamic_mask. Where the
attention's input goes straight into its qkv Linear (timm's forward, or the fused or SDPA one), the windows
are written under autocast in the Linear's dtype (the bits its cast gives, without the cast's pass over
the fp32 stream). norm1 and the residual add are fused_layernorm's (post_add_layer_norm, or with these
kernels merge_norm_add, the merge, norm1 and the add in one pass), the MLP fused_linear's. The forwards
live in block_forward. Blocks of a subclass, with an `_attn` or `forward` replaced elsewhere, or with a
non-square window or shift keep timm's `_attn`, counted by reason in the result; a block made non-square
after the pass (set_input_size) runs timm's `_attn` from then on.
"""
from __future__ import annotations

import types

import torch

from workbench.optimize.passes import PassContext, PassResult, PassUnavailable
from workbench.optimize.passes._swin import feature_map, square, swin_blocks, v2_block_classes
from workbench.optimize.passes.block_forward import v2_attn_method, v2_block_forward, v2_window_attn, v2_window_attn_bound
from workbench.optimize.passes.block_plan import block_plans

NAME = "fused_window"
OWN_KERNELS = True   # runs swinbench kernels: a stage with it is not PyTorch alone


def _norm1_fusable(norm) -> bool:
    shape = getattr(norm, "normalized_shape", None)
    return (
        shape is not None and len(tuple(shape)) == 1
        and getattr(norm, "weight", None) is not None and getattr(norm, "bias", None) is not None
        and hasattr(norm, "eps")
    )


def apply(model: torch.nn.Module, ctx: PassContext) -> tuple[torch.nn.Module, PassResult]:
    """Plan `window` for every timm SwinTransformerBlock in `model` and bind the plans -> (model, PassResult)."""
    blocks = swin_blocks(model, ctx, "workbench.kernels.window", "fused window kernels")
    if not blocks:  # SwinV2 blocks only (swin_transformer_v2's or -CR's)
        return model, _v2_result(model)
    non_square = {n for n, b in blocks if square(b.window_size) is None or square(b.shift_size) is None}
    if len(non_square) == len(blocks):
        raise PassUnavailable(f"{len(non_square)} block(s) with non-square window_size/shift_size: only square windows are fused")

    plans = block_plans(model)
    counts = {"blocks_patched": 0, "blocks_shifted": 0, "blocks_with_add_norm2": 0, "blocks_with_drop_path": 0,
              "blocks_dynamic_mask": 0, "blocks_forward_already_patched": 0, "blocks_norm1_not_fusable": 0,
              "blocks_already_fused_window": 0, "blocks_non_square": 0}
    for name, blk in blocks:
        plan = plans.plan(name)
        if plan.window:
            counts["blocks_already_fused_window"] += 1
            continue
        if plans.forward_replaced_elsewhere(name, blk):
            counts["blocks_forward_already_patched"] += 1
            plans.fall_back(name, "window", "the block's forward was replaced outside its plan")
            continue
        if name in non_square:    # a rectangular image's last stage (224x448: a 7x14 map, shift (0, 3))
            counts["blocks_non_square"] += 1
            plans.fall_back(name, "window", "non-square window or shift: the kernels take one window side and one "
                                            "shift; timm's forward runs")
            continue
        if not _norm1_fusable(blk.norm1):
            counts["blocks_norm1_not_fusable"] += 1
            plans.fall_back(name, "window", "norm1 is not a LayerNorm with weight and bias")
            continue
        plans.update(name, window=True)
        counts["blocks_patched"] += 1
        counts["blocks_shifted"] += int(any(blk.shift_size))
        counts["blocks_with_add_norm2"] += int(plan.add_norm2)
        counts["blocks_with_drop_path"] += int(not isinstance(blk.drop_path1, torch.nn.Identity))
        counts["blocks_dynamic_mask"] += int(bool(getattr(blk, "dynamic_mask", False)))

    bound = plans.bind(model)
    counts["stages_deferring_mlp_add"] = bound["deferring_stages"]
    counts["stage_hand_offs"] = bound["stage_hand_offs"]
    changed = (f"{counts['blocks_patched']}/{len(blocks)} SwinTransformerBlock: norm1+roll+pad+partition -> "
               f"norm_shift_partition, merge+crop+roll+add -> merge_unshift_add (Triton, fwd+bwd)")
    if counts["blocks_with_add_norm2"]:
        changed += (f"; in {counts['blocks_with_add_norm2']} block(s) with fused_layernorm's add+norm2, merge + add + "
                    "norm2 -> merge_add_norm (eager)")
    if counts["stages_deferring_mlp_add"]:
        changed += (f"; in {counts['stages_deferring_mlp_add']} stage(s) each MLP's residual add goes into the next "
                    "block's norm kernel (add_norm_shift_partition, eager)")
    if counts["stage_hand_offs"]:
        changed += (f"; at {counts['stage_hand_offs']} stage boundaries a stage's last MLP add goes to the next "
                    "stage (inference: into its patch merging's norm pass where fused_layernorm runs it)")
    skipped = counts["blocks_forward_already_patched"] + counts["blocks_norm1_not_fusable"] + counts["blocks_non_square"]
    if skipped:
        changed += f"; {skipped} left as they were"
    details = dict(counts, blocks_total=len(blocks),
                   implementation="workbench.kernels.window (Triton): norm_shift_partition, merge_unshift_add, "
                                  "add_norm_shift_partition, merge_add_norm")
    return model, PassResult(NAME, {}, changed, details)


def _v2_why_not(blk: torch.nn.Module) -> str | None:
    """None when v2_window_attn can replace this SwinV2 block's _attn (-CR: _shifted_window_attn), else why
    it keeps timm's."""
    classes = v2_block_classes()
    if type(blk) not in classes:
        return f"a subclass of timm's {next(c for c in classes if isinstance(blk, c)).__name__}"
    forward = vars(blk).get("forward")
    # fused_layernorm's post-norm forward calls self._attn: the two compose
    if (v2_attn_method(blk) in vars(blk) and not v2_window_attn_bound(blk)) or (
            forward is not None and getattr(forward, "__func__", None) is not v2_block_forward):
        return "its _attn or forward was replaced elsewhere"
    if square(blk.window_size) is None or square(blk.shift_size) is None:
        return "non-square window_size/shift_size: the kernels take one window side and one shift"
    return None


def _v2_result(model: torch.nn.Module) -> PassResult:
    """Bind v2_window_attn as `_attn` (-CR: `_shifted_window_attn`) on every SwinV2 block that qualifies ->
    the pass's result. A block this pass bound before counts as patched."""
    blocks = [m for m in model.modules() if isinstance(m, v2_block_classes())]
    patched, shifted, padded, dynamic, left = 0, 0, 0, 0, {}
    for blk in blocks:
        reason = _v2_why_not(blk)
        if reason is not None:
            if v2_window_attn_bound(blk):   # made non-square since: timm's _attn again
                delattr(blk, v2_attn_method(blk))
            left[reason] = left.get(reason, 0) + 1
            continue
        if not v2_window_attn_bound(blk):
            setattr(blk, v2_attn_method(blk), types.MethodType(v2_window_attn, blk))
        ws, (h, w) = square(blk.window_size), feature_map(blk)
        patched += 1
        shifted += int(any(blk.shift_size))
        padded += int(bool(h % ws or w % ws))
        dynamic += int(bool(getattr(blk, "dynamic_mask", False)))
    changed = (f"{patched}/{len(blocks)} SwinV2 block: roll+pad+partition -> roll_partition, reverse+crop+roll -> "
               "merge_roll (Triton, fwd+bwd); post-norm: norm1 and the residual add are fused_layernorm's, the MLP "
               "fused_linear's")
    for reason, count in sorted(left.items()):
        changed += f"; {count} left on timm's path ({reason})"
    details = {"swinv2_patched_blocks": patched, "swinv2_blocks_shifted": shifted, "swinv2_blocks_padded": padded,
               "swinv2_blocks_dynamic_mask": dynamic, "swinv2_left_on_timm": left, "blocks_total": len(blocks),
               "implementation": "workbench.kernels.window (Triton): roll_partition, merge_roll"}
    return PassResult(NAME, {}, changed, details)
