"""What a planned timm SwinTransformerBlock runs: the forwards `block_plan.BlockPlans.bind` builds from a
`BlockPlan`'s fields, for the block, its attention, its MLP and its stage, and the block as one autograd
Function (`SwinBlockFunction`).

A block's forward is built in layers, each falling back to the one below where it cannot run now:

    timm's own forward
    add_norm2    the residual add before norm2 and norm2 as one add_layer_norm
    window       norm1 + roll + pad + partition and the merge back as fused kernels (window.py); with
                 add_norm2, the attention merge, residual add and norm2 as one merge_add_norm
    whole_block  the block as one SwinBlockFunction

Each forward is a closure over plain values (the plan's flags and the function it falls back to), never
over modules or tensors, so a deep copy of a bound model shares the functions and rebinds them to its
own modules. x is (B, H, W, C) throughout, the layout timm's blocks take and return.
"""
from __future__ import annotations

from typing import Callable

import torch

from workbench.kernels._common import traced
from workbench.optimize.passes._swin import (autocast_input_dtype, drop_path, drop_path_keep,
                                             gather_rel_pos_bias, hands_quantized_rows_on, inactive,
                                             input_goes_to_qkv, reads_quantized_qkv, takes_quantized_qkv,
                                             takes_quantized_rows,
                                             merging_forward_of_the_pass, norm_output_dtype, rel_pos_bias,
                                             rel_pos_inverse_buffer, scatter_rel_pos_grad, square, timm_drop_path,
                                             v2_attention_classes)

# ------------------------------------------------------------------------------------ the block


def block_forward(add_norm2: bool, window: bool, whole_block: bool, attn_to_linear: bool,
                  mlp_to_linear: bool, window_under_compile: bool = False) -> Callable | None:
    """The forward of a timm SwinTransformerBlock with these plan fields, to bind with types.MethodType;
    None where timm's own runs. attn_to_linear / mlp_to_linear: whether the attention module and the MLP
    hand their input straight to an nn.Linear (qkv, fc1), so that the norm before each can write that
    Linear's autocast dtype itself (`_swin.norm_output_dtype`). window_under_compile: the window forward
    keeps merge_add_norm while torch.compile traces (BlockPlans.window_under_compile)."""
    forward = None
    if add_norm2:
        forward = _add_norm2_forward(mlp_to_linear)
    if window:
        forward = _window_forward(add_norm2, attn_to_linear, mlp_to_linear, forward or timm_block_forward,
                                  window_under_compile)
    if whole_block:
        forward = _whole_block_forward(forward or timm_block_forward)
    return forward


def timm_block_forward(self, x: torch.Tensor) -> torch.Tensor:
    """The block's class forward (timm's), what a planned forward falls back to last."""
    return type(self).forward(self, x)


def add_norm2(blk, x: torch.Tensor, branch: torch.Tensor, mlp_to_linear: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's `x + branch` and its norm2 of that sum in one add_layer_norm -> (sum, normed), both
    (B, L, C): the normed output in the dtype its consumer wants (`_swin.norm_output_dtype`: the autocast
    dtype when it goes straight into the MLP's fc1)."""
    from workbench.kernels.layer_norm import add_layer_norm

    B, C = x.shape[0], x.shape[-1]
    return add_layer_norm(x.reshape(B, -1, C), branch.reshape(B, -1, C), blk.norm2.weight, blk.norm2.bias,
                          blk.norm2.eps, _norm2_dtype(x, branch.dtype, mlp_to_linear))


def _norm2_dtype(x: torch.Tensor, branch_dtype: torch.dtype, mlp_to_linear: bool) -> torch.dtype | None:
    """The dtype a fused add + norm2 writes for the residual x plus a branch in branch_dtype."""
    return norm_output_dtype(x, mlp_to_linear, torch.promote_types(x.dtype, branch_dtype))


def _add_norm2_forward(mlp_to_linear: bool) -> Callable:
    def swin_block_forward_add_norm2(self, x: torch.Tensor) -> torch.Tensor:
        """timm SwinTransformerBlock.forward with the add before norm2 fused into norm2 (add_layer_norm).
        drop_path1 applies to the attention branch before the add, drop_path2 to the MLP output, as in timm."""
        B, H, W, C = x.shape
        x, h = add_norm2(self, x, drop_path(self.drop_path1, self._attn(self.norm1(x))), mlp_to_linear)
        x = x + drop_path(self.drop_path2, self.mlp(h))
        return x.reshape(B, H, W, C)
    return swin_block_forward_add_norm2


def _window_forward(add_norm2_fused: bool, attn_to_linear: bool, mlp_to_linear: bool, fallback: Callable,
                    under_compile: bool = False) -> Callable:
    def swin_block_forward_fused_window(self, x: torch.Tensor, pending: torch.Tensor | None = None,
                                        defer: bool = False):
        """timm SwinTransformerBlock.forward with norm1 + roll + pad + partition as one kernel
        (norm_shift_partition) and the merge back, crop, roll and residual add as another
        (merge_unshift_add), or, with add_norm2, merge, add and norm2 as one (merge_add_norm: eager, and
        under torch.compile too where bound with under_compile; timm's stochastic depth multiplies inside
        it). The attention module is called as a module (its hooks run). pending / defer: see stage_forward
        (called as blk(x) they are unused)."""
        from workbench.kernels.window import merge_roll, merge_unshift_add

        out = _window_attention_windows(self, x, pending, attn_to_linear)
        if out is None:  # made non-square after binding (set_input_size)
            if pending is not None:
                x = x + scaled_branch(pending)
            out = fallback(self, x)
            return (out, None) if defer else out
        attn_windows, ws, shift, x = out
        B, H, W, C = x.shape
        if add_norm2_fused:
            if (under_compile or not traced()) and (inactive(self.drop_path1, self.training)
                                                    or timm_drop_path(self.drop_path1)):
                keep = drop_path_keep(self.drop_path1, attn_windows, (B, H, W, C))
                x, h = _merge_add_norm2(self, attn_windows, x, ws, shift, mlp_to_linear, keep)
            else:
                branch = drop_path(self.drop_path1, merge_roll(attn_windows, ws, shift, H, W))
                x, h = add_norm2(self, x, branch, mlp_to_linear)
        else:
            if inactive(self.drop_path1, self.training):
                x = merge_unshift_add(attn_windows, x, ws, shift, H, W)
            else:
                x = x + drop_path(self.drop_path1, merge_roll(attn_windows, ws, shift, H, W))
            x = x.reshape(B, -1, C)
            h = self.norm2(x)
        return _mlp_half(self, x, h, B, H, W, C, defer)
    setattr(swin_block_forward_fused_window, _NORM1_TO_QKV, attn_to_linear)
    setattr(swin_block_forward_fused_window, _NORM2_TO_FC1, add_norm2_fused and mlp_to_linear)
    return swin_block_forward_fused_window


# on a bound window forward: its norm1 writes the qkv Linear's input; its merge + add + norm2 the fc1's
_NORM1_TO_QKV, _NORM2_TO_FC1 = "_swinbench_norm1_to_qkv", "_swinbench_norm2_to_fc1"


def _attn_hands_rows_on(blk) -> bool:
    """Whether the block's attention forward hands its windows to qkv untouched (hands_quantized_rows_on)."""
    return takes_quantized_rows(getattr(vars(blk.attn).get("forward"), "__func__", None))


def _mlp_hands_rows_on(blk) -> bool:
    """Whether the block's MLP forward hands its input to fc1 untouched: timm's Mlp with timm's forward, or
    one marked hands_quantized_rows_on."""
    from timm.layers import Mlp

    forward = vars(blk.mlp).get("forward")
    return type(blk.mlp) is Mlp and (forward is None or takes_quantized_rows(getattr(forward, "__func__", None)))


# the Linear a fused norm kernel feeds, by its name's end: (the window forward's flag, the check that the
# module between them hands the input on, the Linear of a block)
_NORM_FEEDS = {".attn.qkv": (_NORM1_TO_QKV, _attn_hands_rows_on, lambda blk: blk.attn.qkv),
               ".mlp.fc1": (_NORM2_TO_FC1, _mlp_hands_rows_on, lambda blk: blk.mlp.fc1)}


def _feeds(blk, flag: str, hands_on) -> bool:
    """Whether the block's bound window forward has `flag` and the module after the norm hands its input on."""
    return bool(getattr(getattr(vars(blk).get("forward"), "__func__", None), flag, False)) and hands_on(blk)


def _dynamic(linear, device: torch.device) -> bool:
    """Whether `linear` is a QuantLinear that quantizes its input per row with one launch on `device`."""
    from workbench.kernels.quant import QuantLinear

    return type(linear) is QuantLinear and linear.fused_quantize(device)


def _eager_inference(blk) -> bool:
    return not (blk.training or torch.is_grad_enabled() or traced())


def norm1_quantizes_qkv(blk, x: torch.Tensor):
    """The block's qkv, a kernels.quant.QuantLinear, where norm1's kernel writes that Linear's input
    quantized (window.norm_shift_partition_quant) in this call, else None: inference without autograd and
    not traced (under torch.compile QuantLinear quantizes with torch ops, which Inductor fuses into the
    norm itself), an attention forward that hands its windows to qkv untouched (hands_quantized_rows_on),
    and a qkv that would quantize its input per row with one launch (QuantLinear.fused_quantize)."""
    from workbench.kernels.window_attention import MAX_WINDOW_TOKENS

    if not (_eager_inference(blk) and _attn_hands_rows_on(blk) and _dynamic(blk.attn.qkv, x.device)):
        return None
    ws = square(blk.window_size)
    return blk.attn.qkv if ws is not None and ws * ws <= MAX_WINDOW_TOKENS else None


def norm2_quantizes_fc1(blk, x: torch.Tensor):
    """The block's MLP fc1, a kernels.quant.QuantLinear, where the merge + add + norm2 kernel writes that
    Linear's input quantized (window.merge_add_norm_quant) in this call, else None: as norm1_quantizes_qkv,
    with an MLP whose forward hands its input to fc1 untouched."""
    if _eager_inference(blk) and _mlp_hands_rows_on(blk) and _dynamic(blk.mlp.fc1, x.device):
        return blk.mlp.fc1
    return None


def norm_writes_input(model: torch.nn.Module, name: str, handed_on: bool = False) -> bool:
    """Whether the Linear `name` of a Swin block takes its input from a fused norm kernel that would write it
    quantized once the Linear is a dynamically quantized QuantLinear: a block's attn.qkv behind a window
    forward whose norm1 writes it and an attention forward that hands it on (norm1_quantizes_qkv), or its
    mlp.fc1 behind merge + add + norm2 and an MLP that does (norm2_quantizes_fc1). Static: what is bound;
    handed_on: the module between them taken to hand the input on (a forward the caller is about to bind)."""
    for suffix, (flag, hands_on, _) in _NORM_FEEDS.items():
        if name.endswith(suffix):
            try:
                blk = model.get_submodule(name[: -len(suffix)])
            except AttributeError:
                return False
            return _feeds(blk, flag, (lambda blk: True) if handed_on else hands_on)
    return False


def quantized_norm_blocks(model: torch.nn.Module, device: torch.device) -> tuple[int, int]:
    """How many of the model's Swin blocks run norm1_quantizes_qkv's path, and how many
    norm2_quantizes_fc1's, in inference on `device`: what is bound (norm_writes_input) and a Linear that
    quantizes dynamically with one launch."""
    from workbench.optimize.passes._swin import named_swin_blocks

    blocks = [blk for _, blk in named_swin_blocks(model)]
    return tuple(sum(1 for blk in blocks if _feeds(blk, flag, hands_on) and _dynamic(linear(blk), device))
                 for flag, hands_on, linear in _NORM_FEEDS.values())


def _window_attention_windows(self, x: torch.Tensor, pending: torch.Tensor | None, to_linear: bool):
    """-> (attn_windows (B*nW, ws*ws, C), ws, shift, x), or None when this block's window or shift is not
    square now. pending: the previous block's MLP branch and its stochastic-depth factors (or None), not
    yet added to x (stage_forward): the multiply and the add are done by the norm's kernel, and the x
    returned is the sum (the residual stream). The windows are
    written in the autocast dtype when they go straight into the qkv Linear (to_linear), which would cast
    them; else in the dtype torch's layer_norm gives under autocast."""
    from workbench.kernels.window import add_norm_shift_partition, norm_shift_partition

    ws, shift = square(self.window_size), square(self.shift_size)
    if ws is None or shift is None:
        return None
    B, H, W, C = x.shape
    qkv = norm1_quantizes_qkv(self, x) if to_linear else None
    if qkv is not None:
        from workbench.kernels.quant import QuantizedRows
        from workbench.kernels.window import norm_shift_partition_quant

        branch, keep = pending if pending is not None else (None, None)
        s_dtype = x.dtype if branch is None else torch.promote_types(x.dtype, branch.dtype)
        round_dtype = norm_output_dtype(x, True, s_dtype) or s_dtype
        s, windows_q, scale = norm_shift_partition_quant(x, self.norm1.weight, self.norm1.bias, self.norm1.eps, ws,
                                                         shift, qkv.fmt, round_dtype, residual=branch, keep=keep)
        x = x if s is None else s
        windows = QuantizedRows(windows_q.view(-1, C), scale, windows_q.shape, round_dtype)
        return self.attn(windows, mask=_attn_mask(self, x, H, W, ws)), ws, shift, x
    if pending is not None:
        branch, keep = pending
        x, windows = add_norm_shift_partition(x, branch, self.norm1.weight, self.norm1.bias, self.norm1.eps, ws, shift,
                                              norm_output_dtype(x, to_linear, torch.promote_types(x.dtype, branch.dtype)),
                                              keep)
    else:
        windows = norm_shift_partition(x, self.norm1.weight, self.norm1.bias, self.norm1.eps, ws, shift,
                                       norm_output_dtype(x, to_linear))
    return self.attn(windows, mask=_attn_mask(self, x, H, W, ws)), ws, shift, x


def _attn_mask(blk, x: torch.Tensor, H: int, W: int, ws: int) -> torch.Tensor | None:
    """The block's shift mask: with timm's dynamic_mask built from the padded shape, as timm does
    (get_attn_mask reads only the shape, device and dtype of its padded, shifted input: x's dtype here)."""
    if getattr(blk, "dynamic_mask", False):
        Hp, Wp = -(-H // ws) * ws, -(-W // ws) * ws
        return blk.get_attn_mask(x.new_empty((1, Hp, Wp, 1)))
    return blk.attn_mask


def _as_map(t: torch.Tensor, B: int, H: int, W: int, C: int) -> torch.Tensor:
    """t as (B, H, W, C): t itself when it has that shape already (a reshape would still record a view)."""
    return t if t.dim() == 4 else t.reshape(B, H, W, C)


def _mlp_half(self, x, h, B, H, W, C, defer):
    """x + drop_path2(mlp(h)), or with `defer` (x, (mlp(h), drop_path2's factors or None)) for the next
    block's norm kernel to scale and add (a drop path other than timm's is applied here, factors None).
    x and h may come as (B, H, W, C), (B, L, C) or token rows (B*L, C); the results are (B, H, W, C)."""
    # the drop path on the (B, H, W, C) map: its factors are per sample, whatever layout h came in
    mlp = _as_map(self.mlp(h), B, H, W, C)
    if defer:
        keep = drop_path_keep(self.drop_path2, mlp, (B, H, W, C))
        return _as_map(x, B, H, W, C), (drop_path(self.drop_path2, mlp) if keep is None else mlp, keep)
    return _as_map(x, B, H, W, C) + drop_path(self.drop_path2, mlp)


def scaled_branch(pending: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    """A deferred MLP branch (branch, factors or None) as the tensor to add: branch * factors[b]."""
    branch, keep = pending
    if keep is None:
        return branch
    from workbench.kernels.drop_path import scale_samples

    return scale_samples(branch, keep)


def _merge_add_norm2(blk, attn_windows: torch.Tensor, x: torch.Tensor, ws: int, shift: int, mlp_to_linear: bool,
                     keep: torch.Tensor | None = None):
    """add_norm2(blk, x, merge_roll(attn_windows) * keep[b]) as one kernel each way (merge_add_norm) -> (sum
    (B, H, W, C), normed (B*H*W, C) token rows: the MLP's Linears take them without view nodes of their own),
    the normed output in the dtype add_norm2 would write. keep: drop_path1's factors, or None."""
    from workbench.kernels.window import merge_add_norm

    norm2 = blk.norm2
    fc1 = norm2_quantizes_fc1(blk, x) if mlp_to_linear and keep is None else None
    if fc1 is not None:
        from workbench.kernels.quant import QuantizedRows
        from workbench.kernels.window import merge_add_norm_quant

        round_dtype = _norm2_dtype(x, attn_windows.dtype, True) or torch.promote_types(x.dtype, attn_windows.dtype)
        s, y_q, scale = merge_add_norm_quant(attn_windows, x, norm2.weight, norm2.bias, norm2.eps, ws, shift,
                                             fc1.fmt, round_dtype)
        return s, QuantizedRows(y_q.view(-1, y_q.shape[-1]), scale, (y_q.numel() // y_q.shape[-1], y_q.shape[-1]),
                                round_dtype)
    return merge_add_norm(attn_windows, x, norm2.weight, norm2.bias, norm2.eps, ws, shift,
                          _norm2_dtype(x, attn_windows.dtype, mlp_to_linear), y_rows=True, keep=keep)


def _whole_block_forward(fallback: Callable) -> Callable:
    def swin_block_forward_fused_block(self, x: torch.Tensor) -> torch.Tensor:
        """timm SwinTransformerBlock.forward as one SwinBlockFunction, timm's stochastic depth (DropPath)
        included: its factors drawn with timm's calls in timm's order (drop_path1, then drop_path2), in the
        compute dtype, as timm draws them on the branches. Falls back while torch.compile traces (the
        Function is not traced; the fallback's kernels are custom ops there), while a dropout (or a drop
        path other than timm's) is active, and for a block made non-square, or of a window larger than the
        attention kernel takes, after binding."""
        from workbench.kernels.linear import compute_dtype

        if traced() or not _dropouts_supported(self):
            return fallback(self, x)
        from workbench.kernels.window_attention import MAX_WINDOW_TOKENS

        ws, shift = square(self.window_size), square(self.shift_size)
        if ws is None or shift is None or ws * ws > MAX_WINDOW_TOKENS:
            return fallback(self, x)
        B, H, W, C = x.shape
        mask = _attn_mask(self, x, H, W, ws)
        attn, mlp = self.attn, self.mlp
        # infer: nothing records a gradient here (inside the Function's forward grad mode is always off,
        # and needs_input_grad follows the parameters' requires_grad even under inference_mode)
        dt = compute_dtype(x, attn.qkv.weight)
        geom = (ws, shift, attn.num_heads, float(attn.scale), float(self.norm1.eps), float(self.norm2.eps),
                dt, not torch.is_grad_enabled())
        like = x.new_empty((), dtype=dt)
        keep1 = drop_path_keep(self.drop_path1, like, (B, H, W, C))
        keep2 = drop_path_keep(self.drop_path2, like, (B, H, W, C))
        return SwinBlockFunction.apply(
            x, mask.detach() if mask is not None else None, attn.relative_position_index, geom,
            self.norm1.weight, self.norm1.bias, attn.qkv.weight, attn.qkv.bias, attn.relative_position_bias_table,
            attn.proj.weight, attn.proj.bias, self.norm2.weight, self.norm2.bias,
            mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias, keep1, keep2)
    return swin_block_forward_fused_block


def _dropouts_supported(blk) -> bool:
    """Whether the block Function computes blk's forward now: every dropout inactive, each drop path
    inactive or timm's DropPath (whose factors the Function takes)."""
    training = blk.training
    mods = (blk.attn.attn_drop, blk.attn.proj_drop, getattr(blk.mlp, "drop1", None), getattr(blk.mlp, "drop2", None))
    return (all(inactive(m, training) for m in mods)
            and all(inactive(m, training) or timm_drop_path(m) for m in (blk.drop_path1, blk.drop_path2)))


# ----------------------------------------------------------------------------- the block's stage


def stage_forward(defers: tuple[bool, ...], under_compile: bool = False) -> Callable:
    """The forward of a timm SwinTransformerStage whose blocks i with defers[i] run the window forward:
    each such block hands its MLP branch to the next one unadded, and the next block's norm kernel adds it
    (add_norm_shift_partition), so the residual add after every MLP but a stage's last runs inside a
    kernel that reads those tensors anyway, and its backward joins the norm's; so does timm's stochastic
    depth on that branch (its factors travel with it). Blocks are still called as
    modules (their hooks, NVTX ranges included, run); inside the loop a deferring block returns
    (x, branch). While torch.compile traces, the stage runs as timm's (each add an Inductor kernel of its
    own) unless bound with under_compile (BlockPlans.window_under_compile, the compile pass's
    fused_window): then the deferred adds stay in the fused chain's operators. With gradient checkpointing
    it always runs as timm's.

    The stage's last add can cross into the next stage (stages_forward, inference): called as
    stage(x, pending, hand_on), the stage takes the previous stage's last branch unadded (its PatchMerging
    adds it in its norm pass where merging_forward is bound: merging_takes_residual) and, with hand_on,
    returns (x, its own last branch or None) instead of adding it."""
    def swin_stage_forward_fused_window(self, x: torch.Tensor, pending_in=None, hand_on: bool = False):
        if ((traced() and not under_compile)
                or (getattr(self, "grad_checkpointing", False) and not torch.jit.is_scripting())):
            x = type(self).forward(self, x if pending_in is None else x + scaled_branch(pending_in))
            return (x, None) if hand_on else x
        if pending_in is None:
            x = self.downsample(x)
        elif merging_takes_residual(self.downsample):
            x = self.downsample(x, pending_in)
        else:
            x = self.downsample(x + scaled_branch(pending_in))
        pending = None
        for blk, defer in zip(self.blocks, defers):
            if defer:
                x, pending = blk(x, pending, True)
            else:
                if pending is not None:
                    x, pending = x + scaled_branch(pending), None
                x = blk(x)
        if hand_on:
            return x, pending
        return x if pending is None else x + scaled_branch(pending)
    swin_stage_forward_fused_window.takes_pending = True
    return swin_stage_forward_fused_window


def stage_hands_on(stage: torch.nn.Module) -> bool:
    """Whether a stage runs stage_forward's fused forward (it takes and hands on a pending branch)."""
    return getattr(getattr(vars(stage).get("forward"), "__func__", None), "takes_pending", False)


def stages_forward(self, x: torch.Tensor) -> torch.Tensor:
    """nn.Sequential.forward over timm SwinTransformerStages (a Swin's `layers`), where stage_forward runs
    two neighbours: without autograd and outside torch.compile's tracing, each such stage hands its last
    MLP branch to the next unadded, and the next stage's PatchMerging adds it in its gather-and-norm pass
    (merging_forward), so that add is never written and read back; otherwise the stages run in turn."""
    if torch.is_grad_enabled() or traced():
        return torch.nn.Sequential.forward(self, x)
    stages, pending = list(self), None
    for i, stage in enumerate(stages):
        hand_on = stage_hands_on(stage) and i + 1 < len(stages) and stage_hands_on(stages[i + 1])
        if pending is not None or hand_on:
            out = stage(x, pending, hand_on)
            x, pending = out if hand_on else (out, None)
        else:
            x = stage(x)
    return x


# ------------------------------------------------------------------------- attention and MLP


def _around_the_core(self, x: torch.Tensor, core, quantized_core) -> torch.Tensor:
    """timm WindowAttention.forward around an attention core: qkv Linear, core(qkv) -> (B_*N, C) token
    rows, proj Linear, proj_drop. x: (B*nW, N, C). The Linears take token rows (a 3-D input costs two
    autograd view nodes inside each Linear); q, k, v are strided views of the packed qkv. Where the qkv
    Linear writes its output quantized (a QuantizedRows: FP8 inference, quantize_linear's attention
    triples), quantized_core(qkv_q, its scale, proj's input scale) runs the attention on it and writes
    proj's input in e4m3, which proj reads as it is."""
    from workbench.kernels.quant import QuantizedRows

    B_, N, C = x.shape
    qkv = self.qkv(x.reshape(B_ * N, C))
    if isinstance(qkv, QuantizedRows):
        scale = self.proj.input_scale
        rows = quantized_core(qkv.x_q.view(B_, N, 3, self.num_heads, -1), qkv.scale, scale)
        x = self.proj(QuantizedRows(rows, scale, (B_ * N, C), qkv.dtype))
    else:
        x = self.proj(core(qkv.view(B_, N, 3, self.num_heads, -1)))
    x = self.proj_drop(x)
    return x.view(B_, N, -1)


def attention_forward(table: bool, has_inverse: bool) -> Callable:
    """timm WindowAttention.forward with the fused Triton kernel (x: (B*nW, N, C); mask: (nW, N, N) or
    None): with `table`, the kernels read the relative-position table through its index themselves and
    the backward sums the table's gradient from the kernel's partials in one launch
    (`fused_window_attention_table`); else the (nH, N, N) bias is gathered first (`_swin.RelPosBias`),
    its backward one launch over the index's inverse where the module has it (has_inverse), else a
    memset and an index_add_. Both read the inverse buffer (INVERSE_BUFFER) that binding registers."""
    if table:
        return fused_window_attention_forward_table

    @reads_quantized_qkv
    @hands_quantized_rows_on
    def fused_window_attention_forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        from workbench.kernels.window_attention import (MAX_WINDOW_TOKENS, fused_window_attention_qkv,
                                                        quantized_window_attention)

        if x.shape[1] > MAX_WINDOW_TOKENS:      # a window resized past the kernels after binding: timm's own
            return type(self).forward(self, x, mask)
        inverse = rel_pos_inverse_buffer(self) if has_inverse else None
        # the kernel's output comes as token rows, the layout it writes (no copy)
        return _around_the_core(
            self, x,
            lambda qkv: fused_window_attention_qkv(qkv, rel_pos_bias(self, inverse), mask, self.scale, tokens=True),
            lambda qkv_q, s_in, s_out: quantized_window_attention(qkv_q, s_in, rel_pos_bias(self, inverse), mask,
                                                                  self.scale, s_out))
    return fused_window_attention_forward


@reads_quantized_qkv
@hands_quantized_rows_on
def fused_window_attention_forward_table(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """timm WindowAttention.forward with the bias gathered from the table inside the kernels
    (attention_forward with table)."""
    from workbench.kernels.window_attention import (MAX_WINDOW_TOKENS, fused_window_attention_table,
                                                    quantized_window_attention)

    if x.shape[1] > MAX_WINDOW_TOKENS:          # a window resized past the kernels after binding: timm's own
        return type(self).forward(self, x, mask)
    return _around_the_core(self, x, lambda qkv: fused_window_attention_table(
        qkv, self.relative_position_bias_table, self.relative_position_index, rel_pos_inverse_buffer(self), mask,
        self.scale, tokens=True), lambda qkv_q, s_in, s_out: quantized_window_attention(
        qkv_q, s_in, self.relative_position_bias_table, mask, self.scale, s_out, index=self.relative_position_index))


def qkv_kernel_runs(attn: torch.nn.Module, x) -> bool:
    """Whether the qkv projection and the attention may run as one kernel (kernels.qkv_attention) for this
    call: no gradient recorded and no tracing, x plain windows (B*nW, N, C) in the dtype of a float qkv
    Linear's weight (not quantize_linear's QuantLinear), a shape the kernel takes."""
    from workbench.kernels.qkv_attention import applies

    qkv = attn.qkv
    return (isinstance(x, torch.Tensor) and x.dim() == 3 and not torch.is_grad_enabled() and not traced()
            and isinstance(qkv, torch.nn.Linear) and type(qkv.weight.data) is torch.Tensor   # not a quantized
            and x.dtype == qkv.weight.dtype and applies(x.shape[1], x.shape[2], attn.num_heads))  # tensor subclass


def qkv_kernel_forward(base: Callable) -> Callable:
    """A timm WindowAttention forward (x: (B*nW, N, C); mask: (nW, N, N) or None) whose qkv Linear and
    attention run as one kernel (kernels.qkv_attention.qkv_window_attention: the packed qkv never written)
    where qkv_kernel_runs, then proj; `base` (an attention_forward) runs every other call. The bias is read
    through the relative-position table where `base` reads it so, else gathered first."""
    def window_attention_forward_qkv_kernel(self, x, mask: torch.Tensor | None = None):
        if not qkv_kernel_runs(self, x):
            return base(self, x, mask)
        from workbench.kernels.qkv_attention import qkv_window_attention

        B_, N, C = x.shape
        if base is fused_window_attention_forward_table:
            out = qkv_window_attention(x, self.qkv.weight, self.qkv.bias, self.relative_position_bias_table, mask,
                                       self.scale, self.num_heads, index=self.relative_position_index)
        else:
            out = qkv_window_attention(x, self.qkv.weight, self.qkv.bias, rel_pos_bias(self), mask, self.scale,
                                       self.num_heads)
        x = self.proj_drop(self.proj(out.view(B_ * N, C)))
        return x.view(B_, N, -1)
    # every other input as base takes it: the same marks
    if takes_quantized_rows(base):
        hands_quantized_rows_on(window_attention_forward_qkv_kernel)
    if takes_quantized_qkv(base):
        reads_quantized_qkv(window_attention_forward_qkv_kernel)
    return window_attention_forward_qkv_kernel


def mlp_forward_fused(self, x: torch.Tensor) -> torch.Tensor:
    """timm Mlp.forward (fc1 -> GELU -> fc2, no dropout, no hidden norm) with fc1 and GELU as one Function."""
    from workbench.kernels.linear import linear

    return self.fc2(linear(x, self.fc1.weight, self.fc1.bias, gelu=True))


@hands_quantized_rows_on
def mlp_forward_quantized(self, x):
    """timm Mlp.forward (fc1 -> GELU -> fc2, no dropout, no hidden norm) whose fc1 is a kernels.quant.
    QuantLinear that applies the GELU itself (QuantLinear.fuse_output: in its GEMM's epilogue where the
    kernels run, with fc2's input quantized there at fc2's static scale): fc1, then fc2. Inference only.
    It hands its input to fc1 untouched, so that norm2's kernel may write it quantized."""
    return self.fc2(self.fc1(x))


def mlp_forward_whole(self, x: torch.Tensor) -> torch.Tensor:
    """mlp_forward_fused as one kernel (kernels.mlp.fused_mlp: fc1, bias, GELU's tanh form, fc2, the hidden
    never written) where nothing records a gradient and nothing traces; else mlp_forward_fused. The fused
    stage's inference computes the same GELU in fc1's GEMM epilogue (cuBLASLt), so the two differ only by
    the order of fc2's sums."""
    from workbench.kernels.linear import compute_dtype
    from workbench.kernels.mlp import fused_mlp

    fc1, fc2 = self.fc1, self.fc2
    if (torch.is_grad_enabled() or traced() or not isinstance(getattr(fc2, "weight", None), torch.Tensor)
            or fc1.bias is None or fc2.bias is None):
        return mlp_forward_fused(self, x)
    dt = compute_dtype(x, fc1.weight)
    if dt not in (torch.bfloat16, torch.float16):
        return mlp_forward_fused(self, x)
    out = fused_mlp(x.reshape(-1, x.shape[-1]).to(dt), fc1.weight.to(dt), fc1.bias.to(dt), fc2.weight.to(dt),
                    fc2.bias.to(dt))
    return out.view(*x.shape[:-1], out.shape[-1])


@hands_quantized_rows_on
def mlp_forward_quantized_whole(self, x):
    """mlp_forward_quantized as one kernel (kernels.mlp.quantized_mlp: fc1's GEMM and epilogue, the hidden
    quantized at fc2's static scale and kept on chip, fc2's GEMM and epilogue) where the kernels run
    eagerly; else mlp_forward_quantized. x: as norm2's kernel hands it (a QuantizedRows in fc1's format,
    per row), or a tensor, quantized per row here as fc1 would."""
    from workbench.kernels.mlp import quantized_mlp
    from workbench.kernels.quant import QuantizedRows, kernels_run, quantize_rows

    fc1, fc2 = self.fc1, self.fc2
    device = (x.x_q if isinstance(x, QuantizedRows) else x).device
    if (traced() or not kernels_run(device) or not fc1.epilogue_fused(device) or fc1.output_scale is None
            or fc1.bias is None or fc2.bias is None):
        return mlp_forward_quantized(self, x)
    if isinstance(x, QuantizedRows):
        x_q, x_scale, lead = x.x_q.view(-1, fc1.in_features), x.scale, x.shape[:-1]
    else:
        lead = x.shape[:-1]
        x_q, x_scale = quantize_rows(x.reshape(-1, fc1.in_features), fc1.fmt)
    out = quantized_mlp(x_q, x_scale, fc1.weight_q, fc1.weight_scale, fc1.bias, fc1.output_scale, fc2.weight_q,
                        fc2.weight_scale, fc2.bias)
    return out.view(*lead, out.shape[-1])


@merging_forward_of_the_pass
def merging_forward(self, x: torch.Tensor, pending=None) -> torch.Tensor:
    """timm PatchMerging.forward whose norm is a TritonLayerNorm. Without autograd (inference, eager or
    captured in a graph) the zero pad, the 2x2 gather and the norm are one Triton pass over x
    (kernels.layer_norm.merging_layer_norm; timm copies x twice before its norm reads it), written in the
    dtype the norm writes for the reduction Linear; with autograd, or while torch.compile traces (Inductor
    fuses the copies itself), timm's forward. pending: the previous stage's last MLP branch (branch,
    drop-path factors or None) not yet added to x (stages_forward): that pass adds it as it reads x."""
    from timm.models.swin_transformer import PatchMerging

    if torch.is_grad_enabled() or traced():
        return PatchMerging.forward(self, x if pending is None else x + scaled_branch(pending))
    from workbench.kernels.layer_norm import merging_layer_norm

    residual = None
    if pending is not None and pending[1] is None and torch.promote_types(x.dtype, pending[0].dtype) == x.dtype:
        residual = pending[0]       # the sum in x's dtype, as x + branch writes it
    elif pending is not None:
        x = x + scaled_branch(pending)
    norm = self.norm
    dtype = autocast_input_dtype(x) if norm.into_linear else None
    return self.reduction(merging_layer_norm(x, norm.weight, norm.bias, norm.eps, dtype, residual=residual))


def merging_takes_residual(merging: torch.nn.Module) -> bool:
    """Whether a stage's downsample runs merging_forward (it takes a pending branch and adds it itself)."""
    return getattr(vars(merging).get("forward"), "__func__", None) is merging_forward


# ------------------------------------------------------------------ the block as one Function


class SwinBlockFunction(torch.autograd.Function):
    """One timm SwinTransformerBlock (x: (B, H, W, C) -> (B, H, W, C)), forward and backward by hand, with
    the kernels of the passes it replaces and cuBLAS GEMMs: autograd records one node per block, and the
    block's Python runs once per direction.

    apply(x, mask, index, geom, n1w, n1b, qkv_w, qkv_b, table, proj_w, proj_b, n2w, n2b,
          fc1_w, fc1_b, fc2_w, fc2_b, keep1, keep2)
    geom = (window, shift, heads, scale, eps1, eps2, compute dtype, infer); infer: no gradient is recorded
    (fc1's GELU then runs in its GEMM's epilogue). mask: (nW, N, N) or None; index: the relative-position
    index (N*N,) into table (rows, heads). keep1, keep2: stochastic depth's per-sample factors for the
    attention and the MLP branch ((B,) in the compute dtype, as timm's DropPath draws them: 0 or 1/keep
    probability), or None; each branch is multiplied by them in the compute dtype before its residual add
    (the attention's in window order, before the merge: a permutation, so the same products), and its
    gradient after the residual's, each by one Triton pass (kernels.drop_path).

    Numerics are those of the dense stage under autocast: GEMMs in the compute dtype on weights cast once
    per call, LayerNorm statistics and the residual stream in fp32, the attention in the fused kernel,
    bias gradients summed in fp32. The LayerNorms write their outputs straight in the GEMMs' dtype (one
    rounding, as autocast's cast would do)."""

    @staticmethod
    def forward(ctx, x, mask, index, geom, n1w, n1b, qkv_w, qkv_b, table, proj_w, proj_b, n2w, n2b,
                fc1_w, fc1_b, fc2_w, fc2_b, keep1=None, keep2=None):
        from workbench.kernels.drop_path import scale_samples_host
        from workbench.kernels.layer_norm import layer_norm_fwd
        from workbench.kernels.linear import addmm_gelu, epilogue_gelu_applies
        from workbench.kernels.window import merge_roll_fwd, norm_shift_partition_fwd
        from workbench.kernels.window_attention import window_attention_fwd

        ws, shift, heads, scale, eps1, eps2, dt, infer = geom
        B, H, W, C = x.shape
        with torch.autocast(x.device.type, enabled=False):
            x = x.contiguous()
            w_qkv, w_proj, w_fc1, w_fc2 = (w.to(dt) for w in (qkv_w, proj_w, fc1_w, fc2_w))
            win, mean1, rstd1 = norm_shift_partition_fwd(x, n1w, n1b, eps1, ws, shift, out_dtype=dt)
            bnw, n, _ = win.shape
            win2 = win.view(-1, C)
            head_dim = w_qkv.shape[0] // (3 * heads)     # timm's head_dim: C // heads unless given
            qkv = torch.addmm(qkv_b.to(dt), win2, w_qkv.t()).view(bnw, n, 3, heads, head_dim)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            rel = gather_rel_pos_bias(table, index, n)
            attn, lse = window_attention_fwd(q, k, v, rel, mask, scale)   # a (bnw, heads, n, d) view
            o = attn.transpose(1, 2).reshape(bnw * n, heads * head_dim)   # of a (bnw, n, heads, d) buffer
            proj = torch.addmm(proj_b.to(dt), o, w_proj.t())
            if keep1 is not None:   # windows are sample-major: B runs of bnw / B windows
                proj = scale_samples_host(proj.view(B, -1), keep1)
            branch = merge_roll_fwd(proj.view(bnw, n, C), ws, shift, H, W)
            s, h, mean2, rstd2 = layer_norm_fwd(x.view(-1, C), branch.view(-1, C), n2w, n2b, eps2,
                                                torch.promote_types(x.dtype, dt), y_dtype=dt)
            # inference: the GELU runs in fc1's GEMM epilogue and the pre-activation is never written
            if epilogue_gelu_applies(h, dt, fc1_b, infer):
                pre = None
                act = addmm_gelu(h, w_fc1, fc1_b.to(dt))
            else:
                pre = torch.addmm(fc1_b.to(dt), h, w_fc1.t())
                act = torch.nn.functional.gelu(pre)
            mlp = torch.addmm(fc2_b.to(dt), act, w_fc2.t())
            if keep2 is not None:   # token rows are sample-major too
                mlp = scale_samples_host(mlp.view(B, -1), keep2).view(-1, C)
            out = s + mlp
        ctx.save_for_backward(x, n1w, n1b, mean1, rstd1, win2, w_qkv, qkv, attn, lse, rel, o, w_proj, s,
                              n2w, n2b, mean2, rstd2, h, w_fc1, pre, act, w_fc2, mask, index, table, keep1, keep2)
        ctx.geom = geom
        ctx.dtypes = tuple(t.dtype for t in (qkv_w, qkv_b, proj_w, proj_b, fc1_w, fc1_b, fc2_w, fc2_b))
        return out.view(B, H, W, C)

    @staticmethod
    def backward(ctx, dout):
        from workbench.kernels._common import split_column_sums, split_norm_grads
        from workbench.kernels.drop_path import scale_samples_host
        from workbench.kernels.layer_norm import layer_norm_bwd
        from workbench.kernels.linear import bias_grad_host
        from workbench.kernels.window import _norm_bwd_slots, norm_shift_partition_bwd, roll_partition_fwd
        from workbench.kernels.window_attention import window_attention_bwd

        (x, n1w, n1b, mean1, rstd1, win2, w_qkv, qkv, attn, lse, rel, o, w_proj, s, n2w, n2b, mean2, rstd2,
         h, w_fc1, pre, act, w_fc2, mask, index, table, keep1, keep2) = ctx.saved_tensors
        ws, shift, heads, scale, eps1, eps2, dt, _ = ctx.geom
        t_qkv_w, t_qkv_b, t_proj_w, t_proj_b, t_fc1_w, t_fc1_b, t_fc2_w, t_fc2_b = ctx.dtypes
        B, H, W, C = x.shape
        bnw, n = qkv.shape[:2]
        with torch.autocast(dout.device.type, enabled=False):
            d = dout.reshape(-1, C).contiguous()
            # Every column reduction of the block (four bias gradients, two LayerNorms' dweight/dbias)
            # adds into one zeroed fp32 buffer: one memset for the block instead of six. The bias sums
            # come first, so that low-precision biases take their gradients in one cast (split_column_sums).
            # The table's gradient shares the memset when the table is fp32 (index_add_ adds into it).
            # norm1's backward spreads its sums over several rows where it has many programs (slots).
            n_table = table.numel() if table.dtype == torch.float32 else 0
            n_n1 = 2 * C * _norm_bwd_slots(x)
            hidden, n_qkv = w_fc1.shape[0], w_qkv.shape[0]     # timm's mlp_ratio * C and 3 * heads * head_dim
            head_dim = n_qkv // (3 * heads)
            widths = (C, hidden, C, n_qkv)                       # the bias sums: fc2, fc1, proj, qkv
            sums = torch.zeros(sum(widths) + 2 * C + n_n1 + n_table, dtype=torch.float32, device=d.device)
            s_fc2, s_fc1, s_proj, s_qkv, s_n2, s_n1, s_table = sums.split((*widths, 2 * C, n_n1, n_table))
            # MLP: fc2 (its bias gradient and dy = d in the compute dtype in one pass), GELU + fc1 bias (one
            # fused reduction), fc1
            # (under stochastic depth the MLP branch's gradient is d in the compute dtype times its factors)
            d_mlp = d if keep2 is None else scale_samples_host(d.to(dt).view(B, -1), keep2).view(-1, C)
            dy, _ = bias_grad_host(d_mlp, None, torch.float32, sums_into=s_fc2, out_dtype=dt)
            d_act = dy @ w_fc2
            d_fc2_w = (dy.t() @ act).to(t_fc2_w)
            d_pre, _ = bias_grad_host(d_act, pre, torch.float32, sums_into=s_fc1)
            d_h = d_pre @ w_fc1
            d_fc1_w = (d_pre.t() @ h).to(t_fc1_w)
            # add + norm2: the residual gradient d joins the LayerNorm's dx in the same kernel
            d_s, sums2 = layer_norm_bwd(d_h, s, n2w, n2b, mean2, rstd2, d, s.dtype, sums_into=s_n2)
            d_n2w, d_n2b = split_norm_grads(sums2, n2w, n2b)
            # merge_roll's backward is roll_partition; then proj
            d_proj = roll_partition_fwd(d_s.view(B, H, W, C), ws, shift, out_dtype=dt).view(-1, C)
            if keep1 is not None:
                d_proj = scale_samples_host(d_proj.view(B, -1), keep1).view(-1, C)
            d_o = d_proj @ w_proj
            d_proj_w = (d_proj.t() @ o).to(t_proj_w)
            bias_grad_host(d_proj, None, torch.float32, sums_into=s_proj)
            # attention, written straight into the packed qkv gradient
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            dqkv = torch.empty_like(qkv)
            d_attn = d_o.view(bnw, n, heads, head_dim).transpose(1, 2)
            _, _, _, d_rel = window_attention_bwd(q, k, v, attn, lse, d_attn, rel, mask, scale, True, dqkv=dqkv)
            # the table gather's backward: a memset and one index_add_ (_swin.scatter_rel_pos_grad)
            d_table = scatter_rel_pos_grad(d_rel, index, table.shape, table.dtype,
                                           into=s_table.view(table.shape) if n_table else None)
            dqkv2 = dqkv.view(-1, n_qkv)
            d_win = dqkv2 @ w_qkv
            d_qkv_w = (dqkv2.t() @ win2).to(t_qkv_w)
            bias_grad_host(dqkv2, None, torch.float32, sums_into=s_qkv)
            d_fc2_b, d_fc1_b, d_proj_b, d_qkv_b = split_column_sums(
                sums[:sum(widths)], widths, (t_fc2_b, t_fc1_b, t_proj_b, t_qkv_b))
            # norm1 + shift + partition
            # (the residual path's gradient d_s joins dx inside the same kernel)
            dx, sums1 = norm_shift_partition_bwd(d_win.view(bnw, n, C), x, n1w, mean1, rstd1, ws, shift,
                                                 sums_into=s_n1, ds=d_s.view(B, H, W, C))
            d_n1w, d_n1b = split_norm_grads(sums1, n1w, n1b)
        return (dx, None, None, None, d_n1w, d_n1b, d_qkv_w, d_qkv_b, d_table, d_proj_w, d_proj_b,
                d_n2w, d_n2b, d_fc1_w, d_fc1_b, d_fc2_w, d_fc2_b, None, None)


# ------------------------------------------------------------------ SwinV2's window attention


def v2_attn_method(blk: torch.nn.Module) -> str:
    """The method a timm SwinV2 block computes its shifted window attention in (x (B, H, W, C) -> the same):
    swin_transformer_v2's `_attn`, -CR's `_shifted_window_attn` (the same steps)."""
    return "_shifted_window_attn" if hasattr(type(blk), "_shifted_window_attn") else "_attn"


def v2_window_attn(self, x: torch.Tensor) -> torch.Tensor:
    """timm's SwinTransformerV2Block._attn (-CR's _shifted_window_attn) with its data movement fused:
    roll(-shift) + pad + window_partition as roll_partition, window_reverse + crop + roll(+shift) as
    merge_roll (one Triton kernel each way, forward and backward), timm's mask and `self.attn` between
    them. A window or shift that is not square (set after binding) runs timm's own method."""
    from workbench.kernels.window import merge_roll

    parts = v2_attention_windows(self, x)
    if parts is None:
        return getattr(type(self), v2_attn_method(self))(self, x)
    windows, ws, shift = parts
    return merge_roll(windows, ws, shift, x.shape[1], x.shape[2])


def v2_attention_windows(self, x: torch.Tensor):
    """The first part of v2_window_attn: roll_partition, timm's mask and the attention -> (the attention's
    output windows (B*nW, ws*ws, C), ws, shift), for the caller to merge back (merge_roll, or
    merge_norm_add with the post-norm add); None where the window or shift is not square."""
    from workbench.kernels.window import roll_partition

    ws, shift = square(self.window_size), square(self.shift_size)
    if ws is None or shift is None:
        return None
    _, H, W, _ = x.shape
    # the windows go straight into the attention's qkv Linear: under autocast they are written in its dtype
    dtype = autocast_input_dtype(x) if v2_attention_takes_linear_input(self.attn) else None
    windows = roll_partition(x, ws, shift, dtype)
    if getattr(self, "dynamic_mask", False):   # timm builds it from the padded x: its shape, dtype, device
        attn_mask = self.get_attn_mask(x.new_empty((1, -(-H // ws) * ws, -(-W // ws) * ws, 0)))
    else:
        attn_mask = self.attn_mask
    return self.attn(windows, mask=attn_mask), ws, shift


def v2_attention_takes_linear_input(attn: torch.nn.Module) -> bool:
    """Whether a SwinV2 WindowAttention does nothing with its input but pass it to its qkv Linear (so that
    the windows can come in the Linear's autocast dtype): timm's own forward, or a forward the attention
    passes bind that says so (_swin.passes_input_to_qkv: the fused and the SDPA one), over a plain or
    fused-backward Linear."""
    from workbench.kernels.linear import BiasGradLinear

    if (type(attn) not in v2_attention_classes()
            or type(getattr(attn, "qkv", None)) not in (torch.nn.Linear, BiasGradLinear)):
        return False
    forward = vars(attn).get("forward")
    return forward is None or input_goes_to_qkv(getattr(forward, "__func__", None))


def v2_window_attn_bound(blk: torch.nn.Module) -> bool:
    """Whether fused_window bound v2_window_attn as this SwinV2 block's _attn (-CR: _shifted_window_attn)."""
    return getattr(vars(blk).get(v2_attn_method(blk)), "__func__", None) is v2_window_attn


# ------------------------------------------------------------------ SwinV2's post-norm block


def _post_add_dtype(dp: torch.nn.Module, branch: torch.Tensor, x: torch.Tensor, training: bool) -> torch.dtype | None:
    """The dtype of a post-norm residual x + dp(norm(branch)) where one fused pass gives torch's result:
    the drop path inactive and the norm's output (fp32 under CUDA autocast) at least as wide as the sum.
    None otherwise (timm's ops then)."""
    from workbench.kernels.layer_norm import autocast_norm_dtype

    norm_dtype = autocast_norm_dtype(branch) or branch.dtype
    out_dtype = torch.promote_types(norm_dtype, x.dtype)
    return out_dtype if inactive(dp, training) and out_dtype == norm_dtype else None


def _post_norm_add(norm: torch.nn.Module, dp: torch.nn.Module, branch: torch.Tensor, x: torch.Tensor,
                   training: bool) -> torch.Tensor:
    """x + dp(norm(branch)), a post-norm residual, as one post_add_layer_norm where _post_add_dtype allows,
    otherwise as timm computes it."""
    from workbench.kernels.layer_norm import post_add_layer_norm

    out_dtype = _post_add_dtype(dp, branch, x, training)
    if out_dtype is not None:
        return post_add_layer_norm(branch, x, norm.weight, norm.bias, norm.eps, out_dtype)
    return x + drop_path(dp, norm(branch))


def _v2_attention_half(blk: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x + drop_path1(norm1(_attn(x))). Where fused_window bound the block's _attn (eagerly) and
    _post_add_dtype allows: the merge of the attention's windows, norm1 and the add as one kernel
    (merge_norm_add); the merged branch is never written."""
    if v2_window_attn_bound(blk) and not traced():
        parts = v2_attention_windows(blk, x)
        if parts is not None:
            from workbench.kernels.window import merge_norm_add, merge_roll

            windows, ws, shift = parts
            out_dtype = _post_add_dtype(blk.drop_path1, windows, x, blk.training)
            if out_dtype is not None:
                return merge_norm_add(windows, x, blk.norm1.weight, blk.norm1.bias, blk.norm1.eps, ws, shift, out_dtype)
            branch = merge_roll(windows, ws, shift, x.shape[1], x.shape[2])
            return _post_norm_add(blk.norm1, blk.drop_path1, branch, x, blk.training)
    return _post_norm_add(blk.norm1, blk.drop_path1, getattr(blk, v2_attn_method(blk))(x), x, blk.training)


def v2_block_forward(self, x: torch.Tensor) -> torch.Tensor:
    """timm's SwinTransformerV2Block.forward (x: (B, H, W, C)) with each post-norm residual add, x +
    norm(branch), as one LayerNorm pass that writes the sum (fused_layernorm): the normalized branch is
    never written and read back; with fused_window's kernels the attention's windows are merged back in
    that pass too (_v2_attention_half). -CR's block ends with its norm3 (an Identity but in some blocks of
    the largest models)."""
    B, H, W, C = x.shape
    x = _v2_attention_half(self, x)
    x = x.reshape(B, -1, C)
    x = _post_norm_add(self.norm2, self.drop_path2, self.mlp(x), x, self.training)
    norm3 = getattr(self, "norm3", None)
    if norm3 is not None:
        x = norm3(x)
    return x.reshape(B, H, W, C)
