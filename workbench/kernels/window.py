"""Fused Swin window data movement: cyclic shift + pad + window partition, its inverse, and the
LayerNorm / residual add that sit next to them in every SwinTransformerBlock.

Four ops, each a Triton kernel pair behind an autograd Function and a plain function:

  roll_partition(x, ws, shift)                       (B, H, W, C) -> (B*nW, ws*ws, C)
  merge_roll(windows, ws, shift, H, W)               (B*nW, ws*ws, C) -> (B, H, W, C)
  norm_shift_partition(x, weight, bias, eps, ws, shift)   LayerNorm(C) then roll_partition
  merge_unshift_add(windows, shortcut, ws, shift, H, W)   shortcut + merge_roll(windows)

Semantics are timm's (`SwinTransformerBlock._attn`): roll by -shift on H and W, *then* zero-pad
H and W up to multiples of ws, then `window_partition`; the inverse reverses the partition, crops
the padding and rolls by +shift. Padded window tokens are exactly 0 (timm pads after the norm,
so a padded token is 0, not LN(0) = bias).

Every op is a row gather: one program handles BLOCK_T tokens of the tensor it *writes* (so
writes are contiguous and padding is written as 0 without a separate fill), computes for each
token the source row with integer arithmetic, and moves BLOCK_C contiguous channels per row
(coalesced along C, masked for odd C). LayerNorm's dweight/dbias are per-program sums (a band of
tiles per program, one wave of programs) added atomically into one zeroed fp32 buffer
(`_common.column_sums`; per-program rows summed in a fixed order under deterministic mode).

Backward of each op is a forward of another: d(roll_partition) = merge_roll(dout);
d(merge_roll) = roll_partition(dout); merge_unshift_add's dshortcut is dout itself (no copy).
The autograd Functions call the host functions through torch.library operators (swinbench::
roll_partition_fwd, merge_roll_fwd, norm_shift_partition_fwd/_bwd, add_norm_shift_partition_fwd/_bwd/_keep_bwd,
merge_add_norm_fwd/_bwd; see _common.py) while torch.compile traces: on a GPU Inductor launches the kernels
itself, elsewhere each call is one opaque op. merge_norm_add (SwinV2) is eager only.

Launches: on Hopper and newer, with programmatic dependent launch (`_common.pdl_launch`, SWINBENCH_PDL=0 turns it
off): every kernel waits for the previous one before its first load and releases the next after its last
store (`pdl_enter` / `pdl_exit`), so that launches overlap the kernels' tails.

Dtypes: fp32, fp16, bf16; math in fp32; outputs in the input dtype (merge_unshift_add:
the promoted dtype of windows and shortcut, as `shortcut + windows` would give).
Autocast: these Functions do not cast. timm's LayerNorm under autocast computes in fp32 and
returns fp32 for an fp32 input, which is what norm_shift_partition returns for fp32 x (the
fused_window pass feeds it the block input, fp32 in an fp32 model under autocast). For a half
input we return half (F.layer_norm under autocast would return fp32): the next op, the qkv
Linear, casts to the autocast dtype anyway, so the values it sees are identical.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from workbench.kernels._common import (_INTERPRET, TL_DTYPES, SOFT_RTNE as _SOFT_RTNE, cdiv, require_compute_dtype, column_sums, eager_column_sums, emit_column_sum,
                      finish_column_sums, host_cache, kernel_op, launch, launch_options, next_pow2, pdl_enter, pdl_exit, pdl_launch,
                      sm_count, split_norm_grads, sum_rows, to_dtype, traced, zero_column_sums)
from workbench.kernels.quant import quantize_tile

# ----------------------------------------------------------------------------------- kernels

_INTERPRET_C = tl.constexpr(_INTERPRET)

@triton.jit
def _add_pair(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _norm_rows(x, w_ptr, b_ptr, c, c_mask, C, eps):
    """LayerNorm of whole rows x (tokens x BLOCK_C, columns c < C valid) in fp32 -> (y, mean, rstd)."""
    xf = x.to(tl.float32)
    mean = tl.sum(xf, axis=1) / C
    xc = tl.where(c_mask[None, :], xf - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / C
    rstd = 1.0 / tl.sqrt(var + tl.cast(eps, tl.float32))  # fp32 even if passed as fp64 (Inductor)
    w = tl.load(w_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
    bb = tl.load(b_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
    return xc * rstd[:, None] * w[None, :] + bb[None, :], mean, rstd


@triton.jit
def _store_normed(ptrs, mask, y, scale_ptr, rows, row_mask, qmax, inv_qmax, min_scale, QUANT: tl.constexpr,
                  Q_ROUND: tl.constexpr, INT8: tl.constexpr, RECIPROCAL: tl.constexpr, SOFT_RTNE: tl.constexpr):
    """A norm kernel's fp32 output rows y stored at ptrs, rounded once to their dtype; with QUANT rounded to
    Q_ROUND, then quantized per row (quant.quantize_tile), row i's fp32 scale at scale_ptr[rows[i]]."""
    if QUANT:
        yq, scale = quantize_tile(to_dtype(y, Q_ROUND, SOFT_RTNE).to(tl.float32), qmax, inv_qmax, min_scale, INT8,
                                  RECIPROCAL)
        tl.store(ptrs, yq, mask=mask)
        tl.store(scale_ptr + rows, scale, mask=row_mask)
    else:
        tl.store(ptrs, to_dtype(y, ptrs.dtype.element_ty, SOFT_RTNE), mask=mask)


@triton.jit
def _partition_fwd_kernel(
    x_ptr, out_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, sums_ptr, r_ptr, s_ptr, keep_ptr,
    n_out_tokens, C, eps, n_sums,
    H: tl.constexpr, W: tl.constexpr, n_win_h: tl.constexpr, n_win_w: tl.constexpr,
    shift_h: tl.constexpr, shift_w: tl.constexpr, WS: tl.constexpr, NORM: tl.constexpr, SOFT_RTNE: tl.constexpr,
    ZERO_SUMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    PDL: tl.constexpr = False, KEEP: tl.constexpr = False,
    qscale_ptr=None, qmax=0.0, inv_qmax=0.0, min_scale=0.0, QUANT: tl.constexpr = False,
    Q_ROUND: tl.constexpr = None, INT8: tl.constexpr = False, RECIPROCAL: tl.constexpr = False,
    STATS: tl.constexpr = True,
):
    """Writes window tokens [pid0*BLOCK_T, +BLOCK_T) x channels [pid1*BLOCK_C, +BLOCK_C).

    Window token t = (((b*nWh + wh)*nWw + ww)*WS + i)*WS + j sits at padded position
    (hp, wp) = (wh*WS + i, ww*WS + j); it is 0 if hp >= H or wp >= W, else it is
    x[b, (hp + shift) % H, (wp + shift) % W]. With NORM, BLOCK_C covers all of C and the row
    is layer-normalized; mean and rstd are stored at the source token (each valid source
    token is read by exactly one window token). With ZERO_SUMS, the programs also zero the backward's
    column-sum buffer (_common.zero_column_sums). With HAS_RESIDUAL (NORM only), the
    token normalized is s = x + r, rounded to s_ptr's dtype as torch's add would round it, and s is
    stored at the source token too (the residual stream after the add, written once). With KEEP, r is
    first multiplied by its sample's stochastic-depth factor keep_ptr[b] and rounded to r's dtype (timm's
    DropPath on the branch r, then the add). With QUANT (NORM only), the normalized row is rounded to
    Q_ROUND (the dtype the norm would write) and written quantized per window token (quant.quantize_tile:
    e4m3, or int8 with INT8) with its fp32 scale at qscale_ptr[t], the bits of the norm's output then
    quant.quantize_rows. STATS False: mean and rstd are not stored (inference).
    """
    pdl_enter(PDL)
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    zero_column_sums(sums_ptr, n_sums, pid_t, tl.num_programs(0), ZERO_SUMS, BLOCK_C)  # NORM only: pid_c == 0
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < n_out_tokens
    j = t % WS
    r = t // WS
    i = r % WS
    r = r // WS
    ww = r % n_win_w
    r = r // n_win_w
    wh = r % n_win_h
    b = r // n_win_h
    hp = wh * WS + i
    wp = ww * WS + j
    valid = t_mask & (hp < H) & (wp < W)
    hs = hp + shift_h
    hs = tl.where(hs >= H, hs - H, hs)
    wsrc = wp + shift_w
    wsrc = tl.where(wsrc >= W, wsrc - W, wsrc)
    src = (b * H + hs) * W + wsrc

    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < C
    src_off = src.to(tl.int64)[:, None] * C + c[None, :]
    out_off = t.to(tl.int64)[:, None] * C + c[None, :]
    ld_mask = valid[:, None] & c_mask[None, :]
    st_mask = t_mask[:, None] & c_mask[None, :]
    x = tl.load(x_ptr + src_off, mask=ld_mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + src_off, mask=ld_mask, other=0.0)
        if KEEP:
            k = tl.load(keep_ptr + b, mask=valid, other=0.0).to(tl.float32)
            r = to_dtype(r.to(tl.float32) * k[:, None], r_ptr.dtype.element_ty, SOFT_RTNE)
        x = to_dtype(x.to(tl.float32) + r.to(tl.float32), s_ptr.dtype.element_ty, SOFT_RTNE)
        tl.store(s_ptr + src_off, x, mask=ld_mask)
    if NORM:
        y, mean, rstd = _norm_rows(x, w_ptr, b_ptr, c, c_mask, C, eps)
        y = tl.where(valid[:, None], y, 0.0)  # padded tokens are 0, not LN(0) = bias
        if STATS:
            tl.store(mean_ptr + src, mean, mask=valid)
            tl.store(rstd_ptr + src, rstd, mask=valid)
        _store_normed(out_ptr + out_off, st_mask, y, qscale_ptr, t, t_mask, qmax, inv_qmax, min_scale, QUANT, Q_ROUND,
                      INT8, RECIPROCAL, SOFT_RTNE)
    else:
        tl.store(out_ptr + out_off, to_dtype(x, out_ptr.dtype.element_ty, SOFT_RTNE), mask=st_mask)
    pdl_exit(PDL)


@triton.jit
def _window_row_of_token(s, H: tl.constexpr, W: tl.constexpr, n_win_h: tl.constexpr, n_win_w: tl.constexpr,
                         shift_h: tl.constexpr, shift_w: tl.constexpr, WS: tl.constexpr):
    """Window-token row holding image token s = (b*H + h)*W + w after roll(-shift) and partition."""
    w = s % W
    r = s // W
    h = r % H
    b = r // H
    hp = h - shift_h
    hp = tl.where(hp < 0, hp + H, hp)
    wp = w - shift_w
    wp = tl.where(wp < 0, wp + W, wp)
    wh = hp // WS
    i = hp % WS
    ww = wp // WS
    j = wp % WS
    return (((b * n_win_h + wh) * n_win_w + ww) * WS + i) * WS + j


@triton.jit
def _merge_fwd_kernel(
    win_ptr, shortcut_ptr, out_ptr,
    n_tokens, C,
    H: tl.constexpr, W: tl.constexpr, n_win_h: tl.constexpr, n_win_w: tl.constexpr,
    shift_h: tl.constexpr, shift_w: tl.constexpr, WS: tl.constexpr, ADD: tl.constexpr, SOFT_RTNE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out[s] = windows[row(s)] (+ shortcut[s]) for image tokens s in this program's block."""
    pdl_enter(PDL)
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    s = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    s_mask = s < n_tokens
    row = _window_row_of_token(s, H, W, n_win_h, n_win_w, shift_h, shift_w, WS)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < C
    mask = s_mask[:, None] & c_mask[None, :]
    win_off = row.to(tl.int64)[:, None] * C + c[None, :]
    out_off = s.to(tl.int64)[:, None] * C + c[None, :]
    y = tl.load(win_ptr + win_off, mask=mask, other=0.0)
    if ADD:
        sc = tl.load(shortcut_ptr + out_off, mask=mask, other=0.0)
        y = sc.to(tl.float32) + y.to(tl.float32)
    tl.store(out_ptr + out_off, to_dtype(y, out_ptr.dtype.element_ty, SOFT_RTNE), mask=mask)
    pdl_exit(PDL)


@triton.jit
def _merge_norm_fwd_kernel(
    win_ptr, shortcut_ptr, s_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, sums_ptr, keep_ptr,
    n_tokens, C, eps, n_sums,
    H: tl.constexpr, W: tl.constexpr, n_win_h: tl.constexpr, n_win_w: tl.constexpr,
    shift_h: tl.constexpr, shift_w: tl.constexpr, WS: tl.constexpr, ZERO_SUMS: tl.constexpr,
    SOFT_RTNE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    PDL: tl.constexpr = False, KEEP: tl.constexpr = False, POST: tl.constexpr = False,
    qscale_ptr=None, qmax=0.0, inv_qmax=0.0, min_scale=0.0, QUANT: tl.constexpr = False,
    Q_ROUND: tl.constexpr = None, INT8: tl.constexpr = False, RECIPROCAL: tl.constexpr = False,
    STATS: tl.constexpr = True,
):
    """s = shortcut + windows merged back (window_reverse, crop, roll(+shift)), rounded to s_ptr's dtype
    as torch's add rounds it, then y = LayerNorm(s), for the image tokens of this program's block (whole
    rows: BLOCK_C covers C). Stores s, y, and fp32 mean/rstd per token. With POST (SwinV2's post-norm
    block, merge_norm_add), the norm comes first: s = shortcut + LayerNorm(merged windows), summed in fp32
    and rounded once, stored with the norm's mean/rstd (y_ptr is not written). With ZERO_SUMS, the programs also
    zero the backward's column-sum buffer (_common.zero_column_sums). With KEEP, the merged windows are
    first multiplied by their sample's stochastic-depth factor keep_ptr[b] and rounded to the windows'
    dtype, as timm's DropPath multiplies the branch before the add. With QUANT (not POST), y is rounded to
    Q_ROUND and written quantized per token with its fp32 scale at qscale_ptr (as in _partition_fwd_kernel).
    STATS False: mean and rstd are not stored (inference)."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    zero_column_sums(sums_ptr, n_sums, pid, tl.num_programs(0), ZERO_SUMS, BLOCK_C)
    s = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    s_mask = s < n_tokens
    row = _window_row_of_token(s, H, W, n_win_h, n_win_w, shift_h, shift_w, WS)
    c = tl.arange(0, BLOCK_C)
    c_mask = c < C
    mask = s_mask[:, None] & c_mask[None, :]
    off = s.to(tl.int64)[:, None] * C + c[None, :]
    win = tl.load(win_ptr + row.to(tl.int64)[:, None] * C + c[None, :], mask=mask, other=0.0)
    if KEEP:
        k = tl.load(keep_ptr + s // (H * W), mask=s_mask, other=0.0).to(tl.float32)
        win = to_dtype(win.to(tl.float32) * k[:, None], win_ptr.dtype.element_ty, SOFT_RTNE)
    sc = tl.load(shortcut_ptr + off, mask=mask, other=0.0)
    if POST:
        y, mean, rstd = _norm_rows(win, w_ptr, b_ptr, c, c_mask, C, eps)
        tl.store(s_ptr + off, to_dtype(sc.to(tl.float32) + y, s_ptr.dtype.element_ty, SOFT_RTNE), mask=mask)
    else:
        x = to_dtype(sc.to(tl.float32) + win.to(tl.float32), s_ptr.dtype.element_ty, SOFT_RTNE)
        tl.store(s_ptr + off, x, mask=mask)
        y, mean, rstd = _norm_rows(x, w_ptr, b_ptr, c, c_mask, C, eps)
        _store_normed(y_ptr + off, mask, y, qscale_ptr, s, s_mask, qmax, inv_qmax, min_scale, QUANT, Q_ROUND,
                      INT8, RECIPROCAL, SOFT_RTNE)
    if STATS:
        tl.store(mean_ptr + s, mean, mask=s_mask)
        tl.store(rstd_ptr + s, rstd, mask=s_mask)
    pdl_exit(PDL)


@triton.jit
def _norm_bwd_tile(g, x, w, mean, rstd, mask, C):
    """LayerNorm backward of one (tokens x C) tile, fp32: (dx, g * xhat, g) -- the last two summed over
    tokens give dweight and dbias."""
    xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    wg = g * w[None, :]
    if _INTERPRET_C:  # numpy sums (the interpreter runs a combine function element by element in Python)
        c1 = tl.sum(xhat * wg, axis=1) / C
        c2 = tl.sum(wg, axis=1) / C
    else:  # both row sums in one reduction: one exchange between warps instead of two
        c1, c2 = tl.reduce((xhat * wg, wg), 1, _add_pair)
        c1 = c1 / C
        c2 = c2 / C
    dx = (wg - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
    return dx, g * xhat, g


@triton.jit
def _norm_partition_bwd_kernel(
    dwin_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, ds_ptr, dx_ptr, dwo_ptr, sums_ptr, keep_ptr,
    n_tokens, tiles_per_prog, C,
    H: tl.constexpr, W: tl.constexpr, n_win_h: tl.constexpr, n_win_w: tl.constexpr,
    shift_h: tl.constexpr, shift_w: tl.constexpr, WS: tl.constexpr, SOFT_RTNE: tl.constexpr, ATOMIC: tl.constexpr,
    HAS_DS: tl.constexpr, MERGE: tl.constexpr, STAGES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    PDL: tl.constexpr = False, ROW_SUMS: tl.constexpr = False, SLOTS: tl.constexpr = 1,
    PDL_EARLY: tl.constexpr = False, KEEP: tl.constexpr = False, RES_OUT: tl.constexpr = False,
    POST: tl.constexpr = False,
):
    """LayerNorm backward with the gradient gathered from window order (d of the partition), plus, with
    HAS_DS, a gradient ds of x from elsewhere (the block's residual path) added into dx in the same pass.
    With RES_OUT (not MERGE), dx rounded to dwo's dtype, times keep_ptr[b] with KEEP and rounded again, is
    also stored at the token's row of dwo_ptr: the gradient of a residual branch that the forward
    multiplied by its stochastic-depth factors before the add (add_norm_shift_partition with keep).

    With MERGE, the backward of merge_add_norm instead (the norm's input was s = shortcut + merge of the
    windows): the gradient dwin_ptr points at is in token order (d of the norm's output), and dx, the
    gradient of s and so of the shortcut, is also stored at the token's window row of dwo_ptr (d of the
    windows, in that buffer's dtype); with KEEP, that value rounded to dwo's dtype is multiplied by the
    token's sample factor keep_ptr[b] and rounded again (the backward of timm's DropPath multiply).

    Program p owns the contiguous band of token tiles [p * tiles_per_prog, (p + 1) * tiles_per_prog).
    dweight/dbias partials are summed over the band in registers and go to columns [0, C) / [C, 2C) of
    sums_ptr once at the end (_common.emit_column_sum). Where every row of a tile lies within each
    thread (ROW_SUMS: a row spans all the program's threads, so the sum over a tile's rows needs no
    shuffle or shared memory), each tile is reduced to (BLOCK_C,) partials as it goes and the band's
    accumulators are two (BLOCK_C,) vectors; otherwise they are (BLOCK_T, BLOCK_C) and reduced across rows
    once at the end (a cross-warp reduction per tile would cost two shared-memory round trips per
    iteration). With SLOTS > 1 (atomic mode), program p adds into row p % SLOTS of sums_ptr's (SLOTS, 2C):
    fewer atomic adds queue on each address; the host adds the rows up (_common.sum_rows). Triton's
    pipelining (STAGES = 3) keeps the next tiles' loads in flight, as a hand-written one-tile prefetch
    would, at no cost in registers.

    PDL_EARLY: release the next kernel at the start instead of after the last store, where that kernel is
    the small one of _common.sum_partials (it waits for this grid to complete all the same).

    With POST (the backward of merge_norm_add, whose norm's input was the merged windows), the gradient
    dwin_ptr points at is in token order (d of the output), the norm's input x_ptr is the windows (window
    order), and dx goes to the token's window row of dx_ptr (d of the windows).
    """
    pdl_enter(PDL)
    if PDL_EARLY:  # the next kernel is the small one that adds up these sums: let it get resident now
        pdl_exit(PDL)
    pid = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    c_mask = c < C
    w = tl.load(w_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
    if ROW_SUMS:
        dw_acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
        db_acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    else:
        dw_acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        db_acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    tok_start = pid * tiles_per_prog * BLOCK_T
    tok_end = tl.minimum(tok_start + tiles_per_prog * BLOCK_T, n_tokens)
    # Loads at the top of the loop; Triton's pipeliner keeps STAGES - 1 tiles in flight (asynchronous
    # copies through shared memory, no extra registers).
    for t in tl.range(0, tiles_per_prog, num_stages=STAGES):
        s = tok_start + t * BLOCK_T + tl.arange(0, BLOCK_T)
        s_mask = s < tok_end
        cur_mask = s_mask[:, None] & c_mask[None, :]
        row = _window_row_of_token(s, H, W, n_win_h, n_win_w, shift_h, shift_w, WS)
        x_off = s.to(tl.int64)[:, None] * C + c[None, :]
        win_off = row.to(tl.int64)[:, None] * C + c[None, :]
        if MERGE or POST:
            g = tl.load(dwin_ptr + x_off, mask=cur_mask, other=0.0).to(tl.float32)
        else:
            g = tl.load(dwin_ptr + win_off, mask=cur_mask, other=0.0).to(tl.float32)
        if POST:
            x = tl.load(x_ptr + win_off, mask=cur_mask, other=0.0).to(tl.float32)
        else:
            x = tl.load(x_ptr + x_off, mask=cur_mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + s, mask=s_mask, other=0.0)
        rstd = tl.load(rstd_ptr + s, mask=s_mask, other=0.0)
        dx, dw_t, db_t = _norm_bwd_tile(g, x, w, mean, rstd, cur_mask, C)
        if HAS_DS:
            dx += tl.load(ds_ptr + x_off, mask=cur_mask, other=0.0).to(tl.float32)
        if POST:
            tl.store(dx_ptr + win_off, to_dtype(dx, dx_ptr.dtype.element_ty, SOFT_RTNE), mask=cur_mask)
        else:
            tl.store(dx_ptr + x_off, to_dtype(dx, dx_ptr.dtype.element_ty, SOFT_RTNE), mask=cur_mask)
        if MERGE or RES_OUT:
            dwo = to_dtype(dx, dwo_ptr.dtype.element_ty, SOFT_RTNE)
            if KEEP:
                k = tl.load(keep_ptr + s // (H * W), mask=s_mask, other=0.0).to(tl.float32)
                dwo = to_dtype(dwo.to(tl.float32) * k[:, None], dwo_ptr.dtype.element_ty, SOFT_RTNE)
            if MERGE:
                tl.store(dwo_ptr + win_off, dwo, mask=cur_mask)
            else:
                tl.store(dwo_ptr + x_off, dwo, mask=cur_mask)
        if ROW_SUMS:
            dw_acc += tl.sum(dw_t, axis=0)
            db_acc += tl.sum(db_t, axis=0)
        else:
            dw_acc += dw_t
            db_acc += db_t
    if not ROW_SUMS:
        dw_acc = tl.sum(dw_acc, axis=0)
        db_acc = tl.sum(db_acc, axis=0)
    slot_ptr = sums_ptr
    if SLOTS > 1:  # atomic adds spread over SLOTS rows of sums: fewer queued on each address
        slot_ptr += (pid % SLOTS) * 2 * C
    emit_column_sum(slot_ptr, pid, 2 * C, c, dw_acc, c_mask, ATOMIC)
    emit_column_sum(slot_ptr, pid, 2 * C, C + c, db_acc, c_mask, ATOMIC)
    if not PDL_EARLY:
        pdl_exit(PDL)


# ------------------------------------------------------------------------------ host functions


# Elements one data-movement program moves per tensor (16 KB in bf16, 32 KB in fp32): fewer, fatter
# programs than 4096 (8 KB) amortize the per-token index math and the block scheduling.
_COPY_TILE_ELEMS = 8192
# LayerNorm kernels hold whole rows over 4 warps: ~2048 elements per backward tile, ~4096 per forward
# tile. Tuned on Swin-B's four stages (bf16): 4 warps beat 8 and 16 at every stage, the forward is
# fastest on 4096-8192 element tiles; in the backward, band length, residency and pipelining depth matter
# little, and at C = 512-1024 fewer warps per row (a warp per 1024 elements) beat 4-warp 2048-element
# tiles (_norm_blocks).
_NORM_TILE_ELEMS = 2048
_NORM_FWD_TILE_ELEMS = 4096
_NORM_WARPS = 4
_NORM_SMALL_ROWS = 4
# Norm backward grid: 3 resident programs per SM (one wave), each a band of at least this many tokens
# (fewer, longer bands mean fewer atomic adds of the (2C,) column sums). 16 doubles the programs at
# stage 4 (3136 tokens) against 32, and costs nothing elsewhere.
_NORM_BWD_MIN_TOKENS = 16
_NORM_BWD_PER_SM = 3
_NORM_BWD_STAGES = 3
# Where ROW_SUMS holds (C = 512-1024, and Swin-L's 1536): programs of _NORM_BWD_WARPS_PER_SM // num_warps
# per SM, tiles shared out evenly, and the column sums spread over a row per _NORM_BWD_PER_SLOT programs
# (atomic adds onto one address queue one after another). Evenly loaded programs beat a grid of two
# programs on some SMs and one on the rest, and several rows of sums beat one at Swin-B's stages 3 and 4.
_NORM_BWD_WARPS_PER_SM = 8
_NORM_BWD_PER_SLOT = 256
_NORM_BWD_MAX_SLOTS = 16


@host_cache
def _copy_blocks(C: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_C, num_warps) for the pure data-movement kernels.

    BLOCK_C is the largest power-of-two divisor of C up to 512 when that is >= 32 (Swin's C =
    96 * 2^k splits into whole blocks, no idle lanes), else next_power_of_2(C) capped at 512
    with masks (odd C). 8192 elements per program over 8 warps = 32 per thread (four 16-byte
    vectors in bf16).
    """
    pow2_div = C & -C
    block_c = min(pow2_div, 512) if pow2_div >= 32 else min(next_pow2(C), 512)
    return max(1, _COPY_TILE_ELEMS // block_c), block_c, 8


@host_cache
def _norm_blocks(C: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_C, num_warps) for the LayerNorm backward tiles: whole rows, at least 2.

    * C <= 256: ~2048 elements over 4 warps.
    * 256 < C <= 1024 (Swin's stages 3 and 4): 32 elements per thread per tensor, a warp per 1024
      elements: 4 rows of 512 on 2 warps, 4 rows of 1024 on 4 warps, faster than 2048-element tiles on
      4 warps: fewer warps per row means cheaper row reductions.
    * C > 1024 (Swin-L's 1536): two rows over 8 warps, so that a thread's share stays in registers.
    """
    block_c = next_pow2(C)
    if 256 < block_c <= 1024:
        block_t = _NORM_SMALL_ROWS
        return block_t, block_c, block_t * block_c // 1024
    block_t = max(2, _NORM_TILE_ELEMS // block_c)
    return block_t, block_c, _NORM_WARPS if block_t * block_c <= _NORM_TILE_ELEMS else 8


@host_cache
def _geometry(H: int, W: int, window_size: int, shift: int):
    """(Hp, Wp, nWh, nWw, shift_h, shift_w): padded sizes, window counts, shifts reduced mod H, W."""
    ws = int(window_size)
    if ws <= 0:
        raise ValueError(f"window_size must be positive, got {window_size}")
    n_win_h, n_win_w = -(-H // ws), -(-W // ws)
    return n_win_h * ws, n_win_w * ws, n_win_h, n_win_w, int(shift) % H, int(shift) % W


def _pdl_args(maxnreg: int | None = None) -> dict:
    """The launch keywords every window kernel takes: its PDL constexpr and the matching launch options
    (pdl_launch; with the register cap, where given)."""
    pdl = pdl_launch()
    return {"PDL": pdl, **launch_options(maxnreg, pdl)}


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _norm_inputs(what: str, weight, bias, *tensors) -> None:
    """The fused norms are timm's affine LayerNorm over fp16, bf16 or fp32 activations: ValueError for a
    missing weight or bias, or another dtype (fp64 would come back at fp32's precision)."""
    if weight is None or bias is None:
        raise ValueError(f"{what}: weight and bias are required (an affine LayerNorm, as timm's blocks hold)")
    require_compute_dtype(what, *tensors)


def _keep(keep: torch.Tensor | None, batch: int, stand_in: torch.Tensor) -> torch.Tensor:
    """A kernel's keep_ptr: the (batch,) stochastic-depth factors, contiguous; without them `stand_in`, a
    tensor of the launch the kernel never reads through keep_ptr (KEEP off)."""
    if keep is None:
        return stand_in
    if keep.numel() != batch:
        raise ValueError(f"keep holds {keep.numel()} factors for a batch of {batch}")
    return keep.reshape(batch).contiguous()


def _check_out(out, shape, dtype, device):
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {tuple(shape)}")
    return out


def roll_partition_fwd(x: torch.Tensor, window_size: int, shift: int, *, out_dtype=None, out=None) -> torch.Tensor:
    """x (B, H, W, C) -> windows (B*nW, ws*ws, C) in `out_dtype` (default x.dtype)."""
    x = _contig(x)
    B, H, W, C = x.shape
    Hp, Wp, nwh, nww, sh, sw = _geometry(H, W, window_size, shift)
    ws = int(window_size)
    out = _check_out(out, (B * nwh * nww, ws * ws, C), out_dtype or x.dtype, x.device)
    n_out = B * Hp * Wp
    block_t, block_c, num_warps = _copy_blocks(C)
    grid = (cdiv(n_out, block_t), cdiv(C, block_c))
    launch(_partition_fwd_kernel)[grid](
        x, out, x, x, x, x, out, x, x, x, n_out, C, 0.0, 0,
        H=H, W=W, n_win_h=nwh, n_win_w=nww, shift_h=sh, shift_w=sw, WS=ws, NORM=False, SOFT_RTNE=_SOFT_RTNE,
        ZERO_SUMS=False, HAS_RESIDUAL=False, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=num_warps, **_pdl_args(),
    )
    return out


def merge_roll_fwd(
    windows: torch.Tensor, window_size: int, shift: int, H: int, W: int,
    shortcut: torch.Tensor | None = None, *, out_dtype=None, out=None,
) -> torch.Tensor:
    """windows (B*nW, ws*ws, C) -> (B, H, W, C) [+ shortcut (B, H, W, C)], one pass.

    Output dtype: out_dtype, else the promoted dtype of windows and shortcut."""
    windows = _contig(windows)
    C = windows.shape[-1]
    Hp, Wp, nwh, nww, sh, sw = _geometry(H, W, window_size, shift)
    ws = int(window_size)
    token_dims = {3: tuple(windows.shape[1:2]), 4: tuple(windows.shape[1:3])}.get(windows.dim())
    if windows.numel() % (Hp * Wp * C) or token_dims not in (None, (ws * ws,), (ws, ws)):
        raise ValueError(f"windows of shape {tuple(windows.shape)} do not tile a {H}x{W}x{C} map with ws={ws}")
    B = windows.numel() // (Hp * Wp * C)
    if shortcut is not None:
        shortcut = _contig(shortcut)
        if tuple(shortcut.shape) != (B, H, W, C):
            raise ValueError(f"shortcut shape {tuple(shortcut.shape)} != {(B, H, W, C)}")
        dtype = out_dtype or torch.promote_types(windows.dtype, shortcut.dtype)
    else:
        dtype = out_dtype or windows.dtype
    out = _check_out(out, (B, H, W, C), dtype, windows.device)
    n_tok = B * H * W
    block_t, block_c, num_warps = _copy_blocks(C)
    grid = (cdiv(n_tok, block_t), cdiv(C, block_c))
    launch(_merge_fwd_kernel)[grid](
        windows, shortcut if shortcut is not None else windows, out,
        n_tok, C,
        H=H, W=W, n_win_h=nwh, n_win_w=nww, shift_h=sh, shift_w=sw, WS=ws, ADD=shortcut is not None, SOFT_RTNE=_SOFT_RTNE, BLOCK_T=block_t, BLOCK_C=block_c,
        num_warps=num_warps, **_pdl_args(),
    )
    return out


def norm_shift_partition_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, window_size: int, shift: int,
    *, out_dtype=None, out=None, zero_sums=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (B, H, W, C), weight/bias (C,) -> (windows (B*nW, ws*ws, C) in out_dtype (default x.dtype),
    mean (B*H*W,) fp32, rstd fp32). zero_sums: a contiguous fp32 buffer the kernel zeroes for the
    backward's column sums (_common.eager_column_sums)."""
    _, out, mean, rstd = _norm_partition(x, None, weight, bias, eps, window_size, shift, out_dtype, out, None, zero_sums)
    return out, mean, rstd


def add_norm_shift_partition_fwd(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
    window_size: int, shift: int, *, out_dtype=None, out=None, s_out=None, zero_sums=None, keep=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """s = x + residual (both (B, H, W, C); s in their promoted dtype, rounded as torch's add rounds), then
    norm_shift_partition_fwd of s, in one pass -> (s, windows, mean, rstd). The backward is
    norm_shift_partition_bwd on s, whose dx is the gradient of both x and residual. keep: (B,)
    stochastic-depth factors of the residual branch (timm's DropPath draw, in residual's dtype): s = x +
    residual * keep[b], the product rounded to residual's dtype first, as timm's multiply then add."""
    return _norm_partition(x, residual, weight, bias, eps, window_size, shift, out_dtype, out, s_out, zero_sums, keep)


def norm_shift_partition_quant(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, window_size: int, shift: int,
    fmt: str, round_dtype: torch.dtype, residual: torch.Tensor | None = None, keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """norm_shift_partition_fwd's windows (of s = x + residual * keep[b] where a residual is given, as in
    add_norm_shift_partition_fwd), rounded to round_dtype, then quantized per token for a QuantLinear
    (quant.quantize_rows), in one pass and bit for bit -> (s (B, H, W, C) or None without a residual,
    windows_q (B*nW, ws*ws, C) e4m3fn or int8, scale (B*nW*ws*ws, 1) fp32). Inference: nothing is saved
    for a backward. The window tokens of padding are 0 (scale 1), as in the unquantized windows."""
    from workbench.kernels.quant import QDTYPE, quantize_args

    s, out, scale, _ = _norm_partition(x, residual, weight, bias, eps, window_size, shift, QDTYPE[fmt], None, None,
                                       None, keep, quant=(quantize_args(fmt, x.device), TL_DTYPES[round_dtype]))
    return s, out, scale


def _quant_args(quant: tuple, scale: torch.Tensor) -> dict:
    """The keyword arguments that make a norm kernel write its output quantized (QUANT), the scales into
    `scale` and no statistics: quant = (quant.quantize_args, the Triton dtype rounded to first)."""
    q, q_round = quant
    return dict(qscale_ptr=scale, qmax=q["qmax"], inv_qmax=q["inv_qmax"], min_scale=q["min_scale"], QUANT=True,
                Q_ROUND=q_round, INT8=q["INT8"], RECIPROCAL=q["RECIPROCAL"], STATS=False)


def _norm_partition(x, residual, weight, bias, eps, window_size, shift, out_dtype, out, s_out, zero_sums,
                    keep=None, quant=None):
    """The launch of _partition_fwd_kernel with its norm -> (s or None, windows, mean, rstd). quant:
    (quantize_args, the Triton dtype the windows are rounded to first): the windows quantized, their (window
    tokens, 1) scales in place of mean and rstd (both that tensor)."""
    x = _contig(x)
    B, H, W, C = x.shape
    Hp, Wp, nwh, nww, sh, sw = _geometry(H, W, window_size, shift)
    ws = int(window_size)
    s = None
    if residual is not None:
        if tuple(residual.shape) != tuple(x.shape):
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        residual = _contig(residual)
        s = _check_out(s_out, (B, H, W, C), torch.promote_types(x.dtype, residual.dtype), x.device)
    out = _check_out(out, (B * nwh * nww, ws * ws, C), out_dtype or (s if s is not None else x).dtype, x.device)
    n_out = B * Hp * Wp
    if quant is None:
        mean = torch.empty(B * H * W, dtype=torch.float32, device=x.device)
        rstd = torch.empty(B * H * W, dtype=torch.float32, device=x.device)
        qargs = {}
    else:
        mean = rstd = torch.empty((n_out, 1), dtype=torch.float32, device=x.device)
        qargs = _quant_args(quant, mean)
    block_t, block_c, num_warps = _norm_fwd_config(C)
    if n_out > 0:
        launch(_partition_fwd_kernel)[(cdiv(n_out, block_t), 1)](
            x, out, _contig(weight), _contig(bias), mean, rstd, zero_sums if zero_sums is not None else mean,
            residual if residual is not None else x, s if s is not None else x, _keep(keep, B, mean),
            n_out, C, float(eps), zero_sums.numel() if zero_sums is not None else 0,
            H=H, W=W, n_win_h=nwh, n_win_w=nww, shift_h=sh, shift_w=sw, WS=ws, NORM=True, SOFT_RTNE=_SOFT_RTNE,
            ZERO_SUMS=zero_sums is not None, HAS_RESIDUAL=residual is not None, BLOCK_T=block_t, BLOCK_C=block_c,
            KEEP=keep is not None, num_warps=num_warps, **qargs, **_pdl_args(),
        )
    elif zero_sums is not None:
        zero_sums.zero_()
    return s, out, mean, rstd


@host_cache
def _norm_fwd_config(C: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_C, num_warps) of the LayerNorm + shift + partition forward: whole rows, ~4096
    elements (at least 2 rows) over 4 warps, the fastest tiles at Swin-B's stages 2-4 (2048-element
    tiles were slower)."""
    block_c = next_pow2(C)
    return max(2, _NORM_FWD_TILE_ELEMS // block_c), block_c, _NORM_WARPS


@host_cache
def _norm_bwd_config(n_tok: int, C: int, elt: int, device: torch.device,
                     ) -> tuple[int, int, int, int, int, int | None, int, bool, int]:
    """(BLOCK_T, BLOCK_C, num_warps, programs, tiles_per_program, maxnreg, stages, row_sums, slots) of the
    backward: one wave of resident programs, each a contiguous band of whole tiles; stages: Triton's
    software pipelining of a band's loads. row_sums: the kernel's ROW_SUMS, where a row spans every
    thread of a program in 16-byte vectors of bf16 (BLOCK_C >= 8 * 32 * num_warps), so that a tile's rows
    lie within each thread and a band's sums take two (BLOCK_C,) vectors of registers; then
    _NORM_BWD_WARPS_PER_SM warps' worth of programs per SM, evenly loaded, and the column sums over
    `slots` rows. Otherwise _NORM_BWD_PER_SM programs per SM and one row of sums."""
    block_t, block_c, num_warps = _norm_blocks(C)
    n_tiles = cdiv(n_tok, block_t)
    row_sums = block_c >= 256 * num_warps
    if row_sums:
        programs = max(1, min(max(1, _NORM_BWD_WARPS_PER_SM // num_warps) * sm_count(device), n_tiles))
    else:
        programs = max(1, min(_NORM_BWD_PER_SM * sm_count(device), n_tiles, cdiv(n_tok, _NORM_BWD_MIN_TOKENS)))
    tiles_per_prog = cdiv(n_tiles, programs)
    programs = cdiv(n_tiles, tiles_per_prog)
    slots = min(_NORM_BWD_MAX_SLOTS, next_pow2(cdiv(programs, _NORM_BWD_PER_SLOT))) if row_sums else 1
    # The register cap only has to fit the programs each SM actually gets: a grid of fewer than
    # _NORM_BWD_PER_SM waves' worth (Swin-B stage 4: 196 programs on 132 SMs, 2 per SM) gets a looser
    # cap: capped for 3 per SM there (168 registers), the C=1024 variant spilled and ran slower.
    per_sm = cdiv(programs, sm_count(device))
    regs = 65536 // (per_sm * num_warps * 32)  # register file per resident program
    maxnreg = min(255, regs - regs % 8)
    return block_t, block_c, num_warps, programs, tiles_per_prog, maxnreg, _NORM_BWD_STAGES, row_sums, slots


def _norm_bwd_slots(x: torch.Tensor) -> int:
    """Rows of column sums the norm backward over x (B, H, W, C) adds into: the size of the buffer (times
    2C) that its forward zeroes for it (eager_column_sums)."""
    *lead, C = x.shape
    return _norm_bwd_config(math.prod(lead), C, x.element_size(), x.device)[8]


def norm_shift_partition_bwd(
    dwindows: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
    window_size: int, shift: int, *, dx=None, sums_into=None, ds=None, raw_sums=False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (dx (B, H, W, C) in x.dtype, (2C,) fp32 sums: dweight then dbias (_common.split_norm_grads)).
    Padding rows of dwindows are ignored. sums_into: a zeroed fp32 tensor of _norm_bwd_slots(x) * 2C
    elements for the sums (column_sums). ds: another gradient of x, (B, H, W, C), added into dx in the
    same pass (no separate add). raw_sums: the sums as the kernel left them, (rows, 2C), for _norm_grads
    to add up (and cast) in one launch."""
    x = _contig(x)
    dx = _check_out(dx, x.shape, x.dtype, x.device)
    return _norm_bwd(_contig(dwindows), x, weight, mean, rstd, window_size, shift, ds, dx, None, sums_into,
                     raw_sums)[::2]


def _norm_grads(sums: torch.Tensor, weight, bias) -> tuple:
    """(dweight, dbias) from the fp32 column sums, (2C,) or the (rows, 2C) the backward left them in
    (raw_sums), as _common.split_norm_grads gives them. Rows are added up by one sum_partials launch,
    which, where the kernels launch with PDL and both parameters are bf16 or fp16, also casts (torch's
    cast would be a plain launch that breaks the chain of PDL launches). While torch.compile traces,
    torch's sum and cast (Inductor schedules them with the rest)."""
    rows = sums.view(-1, sums.shape[-1])
    if traced():
        return split_norm_grads(rows.sum(0) if rows.shape[0] > 1 else rows[0], weight, bias)
    fold = (weight is not None and bias is not None and weight.dtype == bias.dtype
            and weight.dtype in (torch.bfloat16, torch.float16) and pdl_launch())
    if fold:
        out = sum_rows(rows, weight.dtype)
        n = out.numel()
        return out[: n // 2], out[n // 2:]
    return split_norm_grads(finish_column_sums(rows, True), weight, bias)


def _norm_bwd(g, x, weight, mean, rstd, window_size, shift, ds, dx, dwo, sums_into, raw_sums=False, keep=None,
              res_out=False, post=False):
    """The LayerNorm backward over x (B, H, W, C) of the window kernels: g is the gradient of the norm's
    output in window order, or with dwo (merge_add_norm_bwd) in token order, and dx then also goes to
    dwo's window rows; with res_out, g is in window order and dx also goes to dwo's token rows (times
    keep[b] where keep is given: add_norm_shift_partition's scaled residual). x, dx (B, H, W, C) contiguous. -> (dx, dwo, (2C,) fp32 column sums; with raw_sums,
    the atomic (rows, 2C) buffer as the kernel left it). With post (merge_norm_add_bwd), g (B, H, W, C) is
    the gradient of the output in token order, x the windows the norm read and dx the windows' gradient."""
    B, H, W, C = g.shape if post else x.shape
    Hp, Wp, nwh, nww, sh, sw = _geometry(H, W, window_size, shift)
    n_tok = B * H * W
    block_t, block_c, num_warps, nprog, tiles_per_prog, maxnreg, stages, row_sums, slots = _norm_bwd_config(
        n_tok, C, x.element_size(), x.device)
    sums, atomic = column_sums(nprog, 2 * C, x.device, sums_into, slots)
    if ds is not None:
        ds = _contig(ds)
        if tuple(ds.shape) != (B, H, W, C):
            raise ValueError(f"ds shape {tuple(ds.shape)} != {(B, H, W, C)}")
    # a sum_partials launch follows where the sums take several rows, or (raw_sums) where _norm_grads casts them
    half = weight.dtype in (torch.bfloat16, torch.float16)
    followed = atomic and (sums.shape[0] > 1 or (raw_sums and half))
    launch(_norm_partition_bwd_kernel)[(nprog,)](
        g, x, _contig(weight), mean, rstd, ds if ds is not None else x, dx, dwo if dwo is not None else dx, sums,
        _keep(keep, B, mean), n_tok, tiles_per_prog, C,
        H=H, W=W, n_win_h=nwh, n_win_w=nww, shift_h=sh, shift_w=sw, WS=int(window_size), SOFT_RTNE=_SOFT_RTNE,
        ATOMIC=atomic, HAS_DS=ds is not None, MERGE=dwo is not None and not res_out, STAGES=stages, BLOCK_T=block_t,
        BLOCK_C=block_c, ROW_SUMS=row_sums, SLOTS=sums.shape[0] if atomic else 1, PDL_EARLY=followed and pdl_launch(),
        KEEP=keep is not None, RES_OUT=res_out, POST=post, num_warps=num_warps, **_pdl_args(maxnreg),
    )
    return dx, dwo, sums if raw_sums and atomic else finish_column_sums(sums, atomic)


def merge_add_norm_fwd(
    windows: torch.Tensor, shortcut: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
    window_size: int, shift: int, *, y_dtype=None, s_out=None, y_out=None, zero_sums=None, keep=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """s = shortcut + merge_roll(windows) and y = LayerNorm(s) in one pass -> (s, y, mean, rstd).
    keep: (B,) stochastic-depth factors (timm's DropPath draw, in the windows' dtype) that multiply the
    merged windows of each sample before the add, or None.

    windows (B*nW, ws*ws, C) or (B*nW, ws, ws, C); shortcut (B, H, W, C). s: (B, H, W, C) in the promoted
    dtype of both, rounded as torch's add rounds it; y: (B, H, W, C) in y_dtype (default s's dtype),
    rounded once from fp32; mean, rstd: (B*H*W,) fp32. zero_sums: as in norm_shift_partition_fwd."""
    return _merge_norm(windows, shortcut, weight, bias, eps, window_size, shift, None, s_out, y_dtype, y_out,
                       zero_sums, keep, post=False)


def merge_add_norm_quant(
    windows: torch.Tensor, shortcut: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
    window_size: int, shift: int, fmt: str, round_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """merge_add_norm_fwd's s, and its y rounded to round_dtype then quantized per token for a QuantLinear
    (quant.quantize_rows), in one pass and bit for bit -> (s (B, H, W, C), y_q (B, H, W, C) e4m3fn or
    int8, scale (B*H*W, 1) fp32). Inference: nothing is saved for a backward."""
    from workbench.kernels.quant import QDTYPE, quantize_args

    q = quantize_args(fmt, shortcut.device)
    s, y, scale = _merge_norm(windows, shortcut, weight, bias, eps, window_size, shift, None, None, QDTYPE[fmt],
                              None, None, None, post=False, quant=(q, TL_DTYPES[round_dtype]))
    return s, y, scale


def _merge_norm(windows, shortcut, weight, bias, eps, window_size, shift, s_dtype, s_out, y_dtype, y_out, zero_sums,
                keep, post: bool, quant=None):
    """The launch of _merge_norm_fwd_kernel for merge_add_norm_fwd and (post) merge_norm_add_fwd, which
    writes no y -> (s, y (s itself with post), mean, rstd)."""
    shortcut = _contig(shortcut)
    windows = _contig(windows)
    B, H, W, C = shortcut.shape
    Hp, Wp, nwh, nww, sh, sw = _geometry(H, W, window_size, shift)
    ws = int(window_size)
    if windows.shape[-1] != C or windows.numel() != B * Hp * Wp * C:
        raise ValueError(f"windows of shape {tuple(windows.shape)} do not tile the {B}x{H}x{W}x{C} shortcut "
                         f"with ws={ws}")
    s_dtype = s_dtype or torch.promote_types(windows.dtype, shortcut.dtype)
    s = _check_out(s_out, (B, H, W, C), s_dtype, shortcut.device)
    y = s if post else _check_out(y_out, (B, H, W, C), y_dtype or s_dtype, shortcut.device)
    n_tok = B * H * W
    if quant is None:
        mean = torch.empty(n_tok, dtype=torch.float32, device=shortcut.device)
        rstd = torch.empty(n_tok, dtype=torch.float32, device=shortcut.device)
        qargs = {}
    else:  # (quantize_args, the Triton dtype y is rounded to first): y quantized, its scales in place of stats
        mean = rstd = torch.empty((n_tok, 1), dtype=torch.float32, device=shortcut.device)
        qargs = _quant_args(quant, mean)
    block_t, block_c, num_warps = _norm_fwd_config(C)
    if n_tok > 0:
        launch(_merge_norm_fwd_kernel)[(cdiv(n_tok, block_t),)](
            windows, shortcut, s, y, _contig(weight), _contig(bias), mean, rstd,
            zero_sums if zero_sums is not None else mean, _keep(keep, B, mean), n_tok, C, float(eps),
            zero_sums.numel() if zero_sums is not None else 0,
            H=H, W=W, n_win_h=nwh, n_win_w=nww, shift_h=sh, shift_w=sw, WS=ws, ZERO_SUMS=zero_sums is not None,
            SOFT_RTNE=_SOFT_RTNE, BLOCK_T=block_t, BLOCK_C=block_c, KEEP=keep is not None, POST=post,
            num_warps=num_warps, **qargs, **_pdl_args(),
        )
    elif zero_sums is not None:
        zero_sums.zero_()
    if quant is not None:
        return s, y, mean
    return s, y, mean, rstd


def merge_add_norm_bwd(
    dy: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
    window_size: int, shift: int, ds: torch.Tensor | None, windows_dtype: torch.dtype,
    shortcut_dtype: torch.dtype | None = None, *, sums_into=None, raw_sums=False, keep=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of merge_add_norm_fwd -> (d shortcut (B, H, W, C) in shortcut_dtype (default s's),
    d windows (B*nW, ws*ws, C) in windows_dtype, (2C,) fp32 column sums: dweight then dbias). sums_into
    and raw_sums: as in norm_shift_partition_bwd.
    dy: gradient of y; ds: gradient that reached s directly (or None). The gradient of s (the norm's dx
    plus ds) is the shortcut's and, partitioned back into windows, the windows'; both are written from
    one fp32 value in the same pass (the windows' times keep[b], as merge_add_norm_fwd's keep). Window rows
    that are padding get 0."""
    s = _contig(s)
    B, H, W, C = s.shape
    Hp, Wp, nwh, nww, _, _ = _geometry(H, W, window_size, shift)
    ws = int(window_size)
    shape = (B * nwh * nww, ws * ws, C)
    # padded window rows are cropped by the merge: their gradient is 0, and the kernel writes only valid rows
    dwo = (torch.empty(shape, dtype=windows_dtype, device=s.device) if (Hp, Wp) == (H, W)
           else torch.zeros(shape, dtype=windows_dtype, device=s.device))
    dx = torch.empty((B, H, W, C), dtype=shortcut_dtype or s.dtype, device=s.device)
    dy = _contig(dy)
    if tuple(dy.shape) != (B, H, W, C):
        dy = dy.reshape(B, H, W, C)
    if ds is not None and tuple(ds.shape) != (B, H, W, C):
        ds = ds.reshape(B, H, W, C)
    return _norm_bwd(dy, s, weight, mean, rstd, window_size, shift, ds, dx, dwo, sums_into, raw_sums, keep)


def merge_norm_add_fwd(
    windows: torch.Tensor, shortcut: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
    window_size: int, shift: int, out_dtype: torch.dtype, *, zero_sums=None, out=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out = shortcut + LayerNorm(merge_roll(windows)) in one pass -> (out, mean, rstd): SwinV2's post-norm
    attention half (x + norm1(attention merged back)). The sum is taken in fp32 and rounded once to
    out_dtype; the merged windows are never written. windows (B*nW, ws*ws, C) or (B*nW, ws, ws, C);
    shortcut (B, H, W, C); mean, rstd (B*H*W,) fp32, per token. zero_sums: as in norm_shift_partition_fwd;
    out: a (B, H, W, C) buffer in out_dtype to write (default a new one)."""
    out, _, mean, rstd = _merge_norm(windows, shortcut, weight, bias, eps, window_size, shift, out_dtype, out, None,
                                     None, zero_sums, None, post=True)
    return out, mean, rstd


def merge_norm_add_bwd(
    dout: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
    window_size: int, shift: int, *, sums_into=None, raw_sums=False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of merge_norm_add_fwd -> (d windows, in the windows' shape and dtype, (2C,) fp32 column sums:
    dweight then dbias). The shortcut's gradient is dout itself. dout (B, H, W, C); window rows that are
    padding get 0. sums_into and raw_sums: as in norm_shift_partition_bwd."""
    dout = _contig(dout)
    windows = _contig(windows)
    B, H, W, C = dout.shape
    Hp, Wp, _, _, _, _ = _geometry(H, W, window_size, shift)
    # padded window rows are cropped by the merge: their gradient is 0, and the kernel writes only valid rows
    dwin = torch.empty_like(windows) if (Hp, Wp) == (H, W) else torch.zeros_like(windows)
    _, _, sums = _norm_bwd(dout, windows, weight, mean, rstd, window_size, shift, None, dwin, None, sums_into,
                           raw_sums, post=True)
    return dwin, sums


# ------------------------------------------------------------------------------- operators

# One operator per host function (_common.kernel_op): traced into by torch.compile on a GPU (triton_op),
# opaque otherwise, where the fake implementations give the output shapes, dtypes and (contiguous)
# strides. Every op returns fresh tensors, never a view of an input.


def _windows_shape(B, H: int, W: int, C: int, window_size: int, shift: int):
    """Shape of roll_partition's output for a (B, H, W, C) input. Plain arithmetic, not the cached
    _geometry: under dynamic shapes the sizes may be SymInts."""
    ws = int(window_size)
    return (B * (-(-H // ws)) * (-(-W // ws)), ws * ws, C)


@kernel_op("swinbench::roll_partition_fwd")
def _roll_partition_op(x: torch.Tensor, window_size: int, shift: int, out_dtype: torch.dtype) -> torch.Tensor:
    return roll_partition_fwd(x, window_size, shift, out_dtype=out_dtype)


@_roll_partition_op.register_fake
def _(x, window_size, shift, out_dtype):
    B, H, W, C = x.shape
    return x.new_empty(_windows_shape(B, H, W, C, window_size, shift), dtype=out_dtype)


@kernel_op("swinbench::merge_roll_fwd")
def _merge_roll_op(windows: torch.Tensor, window_size: int, shift: int, H: int, W: int,
                   shortcut: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    return merge_roll_fwd(windows, window_size, shift, H, W, shortcut, out_dtype=out_dtype)


@_merge_roll_op.register_fake
def _(windows, window_size, shift, H, W, shortcut, out_dtype):
    C = windows.shape[-1]
    ws = int(window_size)
    return windows.new_empty((windows.numel() // ((-(-H // ws)) * ws * (-(-W // ws)) * ws * C), H, W, C),
                             dtype=out_dtype)


@kernel_op("swinbench::norm_shift_partition_fwd")
def _norm_shift_partition_fwd_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                                 window_size: int, shift: int, out_dtype: torch.dtype
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return norm_shift_partition_fwd(x, weight, bias, eps, window_size, shift, out_dtype=out_dtype)


@_norm_shift_partition_fwd_op.register_fake
def _(x, weight, bias, eps, window_size, shift, out_dtype):
    B, H, W, C = x.shape
    return (x.new_empty(_windows_shape(B, H, W, C, window_size, shift), dtype=out_dtype),
            x.new_empty((B * H * W,), dtype=torch.float32), x.new_empty((B * H * W,), dtype=torch.float32))


@kernel_op("swinbench::norm_shift_partition_bwd")
def _norm_shift_partition_bwd_op(dwindows: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                                 rstd: torch.Tensor, window_size: int, shift: int
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_shift_partition_bwd(dwindows, x, weight, mean, rstd, window_size, shift)


@_norm_shift_partition_bwd_op.register_fake
def _(dwindows, x, weight, mean, rstd, window_size, shift):
    return x.new_empty(x.shape), mean.new_empty((2 * x.shape[-1],))


@kernel_op("swinbench::add_norm_shift_partition_fwd")
def _add_norm_shift_partition_fwd_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                     bias: torch.Tensor, eps: float, window_size: int, shift: int,
                                     out_dtype: torch.dtype, keep: Optional[torch.Tensor]
                                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return add_norm_shift_partition_fwd(x, residual, weight, bias, eps, window_size, shift, out_dtype=out_dtype,
                                        keep=keep)


@_add_norm_shift_partition_fwd_op.register_fake
def _(x, residual, weight, bias, eps, window_size, shift, out_dtype, keep):
    B, H, W, C = x.shape
    return (x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype)),
            x.new_empty(_windows_shape(B, H, W, C, window_size, shift), dtype=out_dtype),
            x.new_empty((B * H * W,), dtype=torch.float32), x.new_empty((B * H * W,), dtype=torch.float32))


# The backward of add_norm_shift_partition in two operators (an op cannot return one tensor twice): without
# keep the residual's gradient is dx itself (cast by the caller), with keep the kernel writes it apart.
@kernel_op("swinbench::add_norm_shift_partition_bwd")
def _add_norm_shift_partition_bwd_op(dwindows: torch.Tensor, s: torch.Tensor, weight: torch.Tensor,
                                     mean: torch.Tensor, rstd: torch.Tensor, window_size: int, shift: int,
                                     ds: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_shift_partition_bwd(dwindows, s, weight, mean, rstd, window_size, shift, ds=ds)


@_add_norm_shift_partition_bwd_op.register_fake
def _(dwindows, s, weight, mean, rstd, window_size, shift, ds):
    return s.new_empty(s.shape), mean.new_empty((2 * s.shape[-1],))


@kernel_op("swinbench::add_norm_shift_partition_keep_bwd")
def _add_norm_shift_partition_keep_bwd_op(dwindows: torch.Tensor, s: torch.Tensor, weight: torch.Tensor,
                                          mean: torch.Tensor, rstd: torch.Tensor, window_size: int, shift: int,
                                          ds: Optional[torch.Tensor], keep: torch.Tensor, residual_dtype: torch.dtype
                                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _add_norm_keep_bwd(dwindows, s, weight, mean, rstd, window_size, shift, ds, keep, residual_dtype, None,
                              False)


@_add_norm_shift_partition_keep_bwd_op.register_fake
def _(dwindows, s, weight, mean, rstd, window_size, shift, ds, keep, residual_dtype):
    return (s.new_empty(s.shape), s.new_empty(s.shape, dtype=residual_dtype),
            mean.new_empty((2 * s.shape[-1],)))


def _add_norm_keep_bwd(dwindows, s, weight, mean, rstd, window_size, shift, ds, keep, residual_dtype, sums_into,
                       raw_sums):
    """add_norm_shift_partition's backward with stochastic-depth factors -> (dx in s's dtype, the residual's
    gradient dx * keep[b] in residual_dtype, column sums): both written by the one norm backward kernel."""
    s = _contig(s)
    dx = torch.empty_like(s)
    dres = torch.empty(s.shape, dtype=residual_dtype, device=s.device)
    return _norm_bwd(_contig(dwindows), s, weight, mean, rstd, window_size, shift,
                     _contig(ds) if ds is not None else None, dx, dres, sums_into, raw_sums=raw_sums, keep=keep,
                     res_out=True)


@kernel_op("swinbench::merge_add_norm_fwd")
def _merge_add_norm_fwd_op(windows: torch.Tensor, shortcut: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                           eps: float, window_size: int, shift: int, y_dtype: torch.dtype,
                           keep: Optional[torch.Tensor]
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return merge_add_norm_fwd(windows, shortcut, weight, bias, eps, window_size, shift, y_dtype=y_dtype, keep=keep)


@_merge_add_norm_fwd_op.register_fake
def _(windows, shortcut, weight, bias, eps, window_size, shift, y_dtype, keep):
    B, H, W, C = shortcut.shape
    return (shortcut.new_empty(shortcut.shape, dtype=torch.promote_types(windows.dtype, shortcut.dtype)),
            shortcut.new_empty(shortcut.shape, dtype=y_dtype),
            shortcut.new_empty((B * H * W,), dtype=torch.float32), shortcut.new_empty((B * H * W,), dtype=torch.float32))


@kernel_op("swinbench::merge_add_norm_bwd")
def _merge_add_norm_bwd_op(dy: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                           rstd: torch.Tensor, window_size: int, shift: int, ds: Optional[torch.Tensor],
                           keep: Optional[torch.Tensor], windows_dtype: torch.dtype, shortcut_dtype: torch.dtype
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return merge_add_norm_bwd(dy, s, weight, mean, rstd, window_size, shift, ds, windows_dtype, shortcut_dtype,
                              keep=keep)


@_merge_add_norm_bwd_op.register_fake
def _(dy, s, weight, mean, rstd, window_size, shift, ds, keep, windows_dtype, shortcut_dtype):
    B, H, W, C = s.shape
    return (s.new_empty(s.shape, dtype=shortcut_dtype),
            s.new_empty(_windows_shape(B, H, W, C, window_size, shift), dtype=windows_dtype),
            mean.new_empty((2 * C,)))


# ------------------------------------------------------------------------- autograd Functions


class RollPartitionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, window_size, shift, out_dtype):
        ctx.geom = (int(window_size), int(shift), x.shape[1], x.shape[2])
        ctx.x_dtype = x.dtype
        return _roll_partition_op(x, int(window_size), int(shift), out_dtype or x.dtype)

    @staticmethod
    def backward(ctx, dwindows):
        ws, shift, H, W = ctx.geom
        # the gradient comes back in x's dtype, as a cast's backward gives it (exact: a widening)
        return _merge_roll_op(dwindows, ws, shift, H, W, None, ctx.x_dtype), None, None, None


class MergeRollFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, windows, window_size, shift, H, W):
        ctx.geom = (int(window_size), int(shift))
        ctx.windows_shape = windows.shape
        return _merge_roll_op(windows, int(window_size), int(shift), int(H), int(W), None, windows.dtype)

    @staticmethod
    def backward(ctx, dout):
        ws, shift = ctx.geom
        return _roll_partition_op(dout, ws, shift, dout.dtype).view(ctx.windows_shape), None, None, None, None


class NormShiftPartitionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, window_size, shift, out_dtype):
        ctx.sums = eager_column_sums(2 * x.shape[-1], x.device, ctx, weight, bias, slots=_norm_bwd_slots(x))
        out_dtype = out_dtype or x.dtype
        if ctx.sums is None:
            windows, mean, rstd = _norm_shift_partition_fwd_op(x, weight, bias, float(eps), int(window_size), int(shift),
                                                               out_dtype)
        else:
            windows, mean, rstd = norm_shift_partition_fwd(x, weight, bias, float(eps), int(window_size), int(shift),
                                                           out_dtype=out_dtype, zero_sums=ctx.sums)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.geom = (int(window_size), int(shift))
        return windows

    @staticmethod
    def backward(ctx, dwindows):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        ws, shift = ctx.geom
        into, ctx.sums = ctx.sums, None
        if into is None:
            dx, sums = _norm_shift_partition_bwd_op(dwindows, x, weight, mean, rstd, ws, shift)
        else:
            dx, sums = norm_shift_partition_bwd(dwindows, x, weight, mean, rstd, ws, shift, sums_into=into,
                                                raw_sums=True)
        dw, db = _norm_grads(sums, weight, bias)
        return dx, dw, db, None, None, None, None


class AddNormShiftPartitionFunction(torch.autograd.Function):
    """(s, windows) = (x + residual [* keep[b]], norm_shift_partition(s)). While torch.compile traces (no
    column-sum buffer on ctx) through the operators swinbench::add_norm_shift_partition_fwd and _bwd
    (_keep_bwd with factors), as NormShiftPartitionFunction does."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, window_size, shift, out_dtype, keep=None):
        ctx.sums = eager_column_sums(2 * x.shape[-1], x.device, ctx, weight, bias, slots=_norm_bwd_slots(x))
        if ctx.sums is None:
            out_dtype = out_dtype or torch.promote_types(x.dtype, residual.dtype)
            s, windows, mean, rstd = _add_norm_shift_partition_fwd_op(x, residual, weight, bias, float(eps),
                                                                      int(window_size), int(shift), out_dtype, keep)
        else:
            s, windows, mean, rstd = add_norm_shift_partition_fwd(x, residual, weight, bias, float(eps),
                                                                  int(window_size), int(shift), out_dtype=out_dtype,
                                                                  zero_sums=ctx.sums, keep=keep)
        ctx.save_for_backward(s, weight, bias, mean, rstd, keep)
        ctx.geom = (int(window_size), int(shift))
        ctx.dtypes = (x.dtype, residual.dtype)
        return s, windows

    @staticmethod
    def backward(ctx, ds, dwindows):
        s, weight, bias, mean, rstd, keep = ctx.saved_tensors
        ws, shift = ctx.geom
        into, ctx.sums = ctx.sums, None
        x_dtype, r_dtype = ctx.dtypes
        if dwindows is None:
            dwindows = torch.zeros(_windows_shape(*s.shape, ws, shift), dtype=s.dtype, device=s.device)
        # the gradient arriving at s (the residual stream) joins the LayerNorm's dx in the same kernel
        if keep is None:
            if into is None:
                dx, sums = _add_norm_shift_partition_bwd_op(dwindows, s, weight, mean, rstd, ws, shift, ds)
            else:
                dx, sums = norm_shift_partition_bwd(dwindows, s, weight, mean, rstd, ws, shift, sums_into=into, ds=ds,
                                                    raw_sums=True)
            dres = dx.to(r_dtype)
        elif into is None:   # the residual's gradient, dx in its dtype times its factors, written by the same kernel
            dx, dres, sums = _add_norm_shift_partition_keep_bwd_op(dwindows, s, weight, mean, rstd, ws, shift, ds, keep,
                                                                   r_dtype)
        else:
            dx, dres, sums = _add_norm_keep_bwd(dwindows, s, weight, mean, rstd, ws, shift, ds, keep, r_dtype, into,
                                                True)
        dw, db = _norm_grads(sums, weight, bias)
        return dx.to(x_dtype), dres, dw, db, None, None, None, None, None


class MergeAddNormFunction(torch.autograd.Function):
    """(s, y) = (shortcut + merge_roll(windows), LayerNorm(s)). While torch.compile traces through the
    operators swinbench::merge_add_norm_fwd and _bwd, like AddNormShiftPartitionFunction."""

    @staticmethod
    def forward(ctx, windows, shortcut, weight, bias, eps, window_size, shift, y_dtype, y_rows, keep=None):
        ctx.sums = eager_column_sums(2 * shortcut.shape[-1], shortcut.device, ctx, weight, bias,
                                     slots=_norm_bwd_slots(shortcut))
        if ctx.sums is None:
            y_dtype = y_dtype or torch.promote_types(windows.dtype, shortcut.dtype)
            s, y, mean, rstd = _merge_add_norm_fwd_op(windows, shortcut, weight, bias, float(eps), int(window_size),
                                                      int(shift), y_dtype, keep)
        else:
            s, y, mean, rstd = merge_add_norm_fwd(windows, shortcut, weight, bias, float(eps), int(window_size),
                                                  int(shift), y_dtype=y_dtype, zero_sums=ctx.sums, keep=keep)
        ctx.save_for_backward(s, weight, bias, mean, rstd, keep)
        ctx.geom = (int(window_size), int(shift))
        ctx.windows_shape, ctx.dtypes = windows.shape, (windows.dtype, shortcut.dtype)
        return s, (y.view(-1, y.shape[-1]) if y_rows else y)

    @staticmethod
    def backward(ctx, ds, dy):
        s, weight, bias, mean, rstd, keep = ctx.saved_tensors
        ws, shift = ctx.geom
        into, ctx.sums = ctx.sums, None
        win_dtype, sc_dtype = ctx.dtypes
        if into is None:
            dsc, dwin, sums = _merge_add_norm_bwd_op(dy, s, weight, mean, rstd, ws, shift, ds, keep, win_dtype,
                                                     sc_dtype)
        else:
            dsc, dwin, sums = merge_add_norm_bwd(dy, s, weight, mean, rstd, ws, shift, ds, win_dtype, sc_dtype,
                                                 sums_into=into, raw_sums=True, keep=keep)
        dw, db = _norm_grads(sums, weight, bias)
        return dwin.view(ctx.windows_shape), dsc, dw, db, None, None, None, None, None, None


class MergeNormAddFunction(torch.autograd.Function):
    """out = shortcut + LayerNorm(merge_roll(windows)): eager only, no operator for torch.compile (the block
    forward that uses it takes merge_roll and post_add_layer_norm under torch.compile)."""

    @staticmethod
    def forward(ctx, windows, shortcut, weight, bias, eps, window_size, shift, out_dtype):
        ctx.sums = eager_column_sums(2 * shortcut.shape[-1], shortcut.device, ctx, weight, bias,
                                     slots=_norm_bwd_slots(shortcut))
        out, mean, rstd = merge_norm_add_fwd(windows, shortcut, weight, bias, float(eps), int(window_size), int(shift),
                                             out_dtype, zero_sums=ctx.sums)
        ctx.save_for_backward(windows, weight, bias, mean, rstd)
        ctx.geom = (int(window_size), int(shift))
        ctx.shortcut_dtype = shortcut.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        windows, weight, bias, mean, rstd = ctx.saved_tensors
        ws, shift = ctx.geom
        into, ctx.sums = ctx.sums, None
        dwin, sums = merge_norm_add_bwd(dout, windows, weight, mean, rstd, ws, shift, sums_into=into, raw_sums=True)
        dw, db = _norm_grads(sums, weight, bias)
        return dwin, dout.to(ctx.shortcut_dtype), dw, db, None, None, None, None


class MergeUnshiftAddFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, windows, shortcut, window_size, shift, H, W):
        ctx.geom = (int(window_size), int(shift))
        ctx.windows_shape, ctx.windows_dtype, ctx.shortcut_dtype = windows.shape, windows.dtype, shortcut.dtype
        return _merge_roll_op(windows, int(window_size), int(shift), int(H), int(W), shortcut,
                              torch.promote_types(windows.dtype, shortcut.dtype))

    @staticmethod
    def backward(ctx, dout):
        ws, shift = ctx.geom
        dwindows = _roll_partition_op(dout, ws, shift, ctx.windows_dtype).view(ctx.windows_shape)
        return dwindows, dout.to(ctx.shortcut_dtype), None, None, None, None


# ---------------------------------------------------------------------------------- public API


def roll_partition(x: torch.Tensor, window_size: int, shift: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.roll(x, (-shift, -shift), (1, 2)), zero-pad H, W to multiples of ws, timm window_partition.

    x: (B, H, W, C) fp32/fp16/bf16 -> (B*nW, ws*ws, C) in out_dtype (default x.dtype), rounded once: with
    the autocast dtype of the Linear the windows go into, the bits its input cast would give, without the
    cast's pass. The gradient comes back in x.dtype."""
    return RollPartitionFunction.apply(x, window_size, shift, out_dtype)


def merge_roll(windows: torch.Tensor, window_size: int, shift: int, H: int, W: int) -> torch.Tensor:
    """Inverse of roll_partition: window_reverse to (B, Hp, Wp, C), crop to (H, W), torch.roll(+shift).

    windows: (B*nW, ws*ws, C) or (B*nW, ws, ws, C) -> (B, H, W, C), same dtype."""
    return MergeRollFunction.apply(windows, window_size, shift, H, W)


def norm_shift_partition(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, window_size: int, shift: int,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """roll_partition(F.layer_norm(x, (C,), weight, bias, eps)) in one kernel; padded tokens are 0.

    x: (B, H, W, C); weight, bias: (C,). Statistics in fp32; output in out_dtype (default x.dtype),
    rounded once from fp32: `out_dtype=torch.bfloat16` on an fp32 x gives the bits that
    `.to(torch.bfloat16)` of the fp32 result would, without that cast's extra pass (and its backward's)."""
    _norm_inputs("norm_shift_partition", weight, bias, x)
    return NormShiftPartitionFunction.apply(x, weight, bias, eps, window_size, shift, out_dtype)


def add_norm_shift_partition(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
    window_size: int, shift: int, out_dtype: torch.dtype | None = None, keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, norm_shift_partition(s, ...)) with s = x + residual, in one kernel each way: a residual add
    folded into the next LayerNorm + shift + partition (eager, or as operators under torch.compile).
    s: (B, H, W, C) in the promoted dtype of x and residual; windows in out_dtype (default s's dtype); both
    differentiable. keep: the residual branch's (B,) stochastic-depth factors (timm's DropPath draw, in
    residual's dtype), applied in the same kernels each way: s = x + residual * keep[b]."""
    _norm_inputs("add_norm_shift_partition", weight, bias, x, residual)
    return AddNormShiftPartitionFunction.apply(x, residual, weight, bias, eps, window_size, shift, out_dtype, keep)


def merge_unshift_add(
    windows: torch.Tensor, shortcut: torch.Tensor, window_size: int, shift: int, H: int, W: int,
) -> torch.Tensor:
    """shortcut + merge_roll(windows, ...) in one pass. shortcut: (B, H, W, C) -> (B, H, W, C)
    in the promoted dtype of windows and shortcut."""
    return MergeUnshiftAddFunction.apply(windows, shortcut, window_size, shift, H, W)


def merge_add_norm(
    windows: torch.Tensor, shortcut: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
    window_size: int, shift: int, y_dtype: torch.dtype | None = None, y_rows: bool = False,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, F.layer_norm(s, (C,), weight, bias, eps)) with s = shortcut + merge_roll(windows, ...), in one
    kernel each way: a block's attention merge, residual add and norm2 (eager, or as operators under
    torch.compile). shortcut (B, H, W, C); s in the promoted dtype of windows and shortcut, y in y_dtype
    (default s's dtype, rounded once from fp32); both (B, H, W, C) and differentiable, or with y_rows y as
    (B*H*W, C) token rows (what a Linear takes without view nodes of its own). The backward writes the gradient of s once as the shortcut's
    and once, partitioned, as the windows'. keep: (B,) stochastic-depth factors (timm's DropPath draw, in
    the windows' dtype) multiplying the merged windows of each sample before the add, or None."""
    _norm_inputs("merge_add_norm", weight, bias, windows, shortcut)
    return MergeAddNormFunction.apply(windows, shortcut, weight, bias, eps, window_size, shift, y_dtype, bool(y_rows),
                                      keep)


def merge_norm_add(
    windows: torch.Tensor, shortcut: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
    window_size: int, shift: int, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """shortcut + F.layer_norm(merge_roll(windows, ...), (C,), weight, bias, eps), in one kernel each way:
    a SwinV2 (post-norm) block's attention merge, norm1 and residual add (eager mode). shortcut (B, H, W, C);
    out (B, H, W, C) in out_dtype (default the promoted dtype of windows and shortcut), summed in fp32 and
    rounded once. The backward writes the windows' gradient (the norm's, partitioned back) in one pass; the
    shortcut's is the output's."""
    out_dtype = out_dtype or torch.promote_types(windows.dtype, shortcut.dtype)
    _norm_inputs("merge_norm_add", weight, bias, windows, shortcut)
    return MergeNormAddFunction.apply(windows, shortcut, weight, bias, eps, window_size, shift, out_dtype)


# ---------------------------------------------------------------------------------------------------------
# The plain PyTorch computations these kernels replace (timm's order of windows and tokens): the tests
# compare the kernels with them and the benchmarks time them.


def roll_partition_reference(x: torch.Tensor, window_size: int, shift: int) -> torch.Tensor:
    """Eager roll(-shift) + zero pad to a multiple of the window + timm's window_partition.
    x (B, H, W, C) -> (B*nW, ws*ws, C)."""
    from timm.models.swin_transformer import window_partition

    ws = window_size
    C = x.shape[-1]
    H, W = x.shape[1], x.shape[2]
    if shift:
        x = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
    x = torch.nn.functional.pad(x, (0, 0, 0, (ws - W % ws) % ws, 0, (ws - H % ws) % ws))
    return window_partition(x, (ws, ws)).view(-1, ws * ws, C)


def merge_roll_reference(windows: torch.Tensor, window_size: int, shift: int, H: int, W: int) -> torch.Tensor:
    """Eager timm window_reverse + crop to (H, W) + roll(+shift). windows (B*nW, ws*ws, C) -> (B, H, W, C)."""
    from timm.models.swin_transformer import window_reverse

    ws = window_size
    C = windows.shape[-1]
    Hp, Wp = -(-H // ws) * ws, -(-W // ws) * ws
    x = window_reverse(windows.view(-1, ws, ws, C), (ws, ws), Hp, Wp)[:, :H, :W, :].contiguous()
    return torch.roll(x, shifts=(shift, shift), dims=(1, 2)) if shift else x
