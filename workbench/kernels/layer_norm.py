"""LayerNorm over the last dim, and residual add + LayerNorm fused, in Triton (forward and backward).

    layer_norm(x, weight, bias, eps)                     -> y          == F.layer_norm(x, (C,), weight, bias, eps)
    add_layer_norm(x, residual, weight, bias, eps)       -> (s, y)     == (x + residual, F.layer_norm(x + residual, ...))
    post_add_layer_norm(x, residual, weight, bias, eps)  -> out        == residual + F.layer_norm(x, ...) (post-norm)
    TritonLayerNorm                                      an nn.LayerNorm whose forward calls layer_norm

Shapes: x (and residual) are (..., C), any leading dims (rows = their product), contiguous or not (copied
if not). weight/bias: (C,) or None. C up to MAX_COLS; Swin uses 96..1536.
Dtypes: fp32, fp16, bf16 for x/residual/weight/bias, in any mix. All math is fp32; mean and rstd are
kept in fp32 for the backward. Outputs are in the input dtype (for add_layer_norm, in the promoted dtype of
x and residual, as `x + residual` would be) unless out_dtype / y_dtype says otherwise: the result is then
rounded once from fp32 into that dtype. Under CUDA autocast torch's layer_norm runs in fp32 and returns
fp32 even for a bf16 input; TritonLayerNorm does the same (`autocast_norm_dtype`), so that swapping it in
keeps the model's dtypes, and with them the residual stream's precision, as autocast has them.

Why fuse the add: in a Swin block `x = x + attn_out; h = norm2(x)` reads x and attn_out, writes x, then reads
x again for the norm. add_layer_norm reads both once and writes s and y in the same pass (one fewer read of
the residual stream forward); its backward adds the gradient arriving at s to the LayerNorm's dx in the same
kernel, so the residual's gradient costs no extra pass either.

Backward: one kernel computes dx per row and, per program, the sums of dweight/dbias over the rows it
owns (one wave of 2-3 programs per SM, each looping over a contiguous band of rows with the next block
prefetched). Each program adds its fp32 sums atomically into one zeroed (2C,) buffer (`column_sums`):
one memset and no reduction launch. Under torch.use_deterministic_algorithms(True) each program stores
its own row of a (G, 2C) buffer instead and `sum_partials` adds the rows in a fixed order.

The autograd Functions call the host functions through torch.library operators (swinbench::layer_norm_fwd,
add_layer_norm_fwd, layer_norm_bwd; see _common.py): under torch.compile on a GPU Inductor launches the
kernels itself, elsewhere each call is one opaque op.

Kernels run on the GPU, and on the CPU with TRITON_INTERPRET=1 set before this module is imported (slow).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from workbench.kernels import _common
from workbench.kernels._common import (SOFT_RTNE, cdiv, column_sums, eager_column_sums, emit_column_sum, finish_column_sums, host_cache, kernel_op,
                      TL_DTYPES, launch, launch_options, next_pow2, sm_count, split_norm_grads, to_dtype,
                      zero_column_sums)

# Widest row one program holds in registers. Swin needs 1536 (-> 2048); wider rows would want a
# column loop, which no Swin needs.
MAX_COLS = 16384
# Elements per (rows x cols) tile that one program handles per step: small C packs several rows per
# program so each program still moves a useful amount of memory. 2048 with 8 warps (8 elements per thread
# per tensor) compiles for sm_90 to ~50-80 registers forward and ~80-115 backward, no spills: 2-3 programs
# per SM stay resident. 4096 needed 128/180-250 registers (one backward program per SM).
_TILE_ELEMS = 2048
# Backward grid: the fewest rows one program should own (its (C,) partials cost as much traffic as a
# few rows). Programs per SM: see bwd_occupancy.
_BWD_MIN_ROWS_PER_PROGRAM = 16


@triton.jit
def _layer_norm_fwd_kernel(
    X, R, S, Y, W, B, Mean, Rstd, SUMS,
    n_rows, n_cols, eps, n_sums,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_SUMS: tl.constexpr,
    SOFT_RTNE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, POST_ADD: tl.constexpr = False,
):
    """BLOCK_M rows per program. With HAS_RESIDUAL, s = x + r is rounded to S's dtype (as torch's add
    would), stored, and normalized; otherwise x is normalized. Y gets the output, Mean/Rstd fp32 per row.
    With POST_ADD (a post-norm residual, SwinV2's x + norm(branch)), Y gets r + the normalized x instead,
    summed in fp32 and rounded once. With ZERO_SUMS, the programs also zero SUMS, the backward's
    column-sum buffer (zero_column_sums)."""
    pid = tl.program_id(0)
    zero_column_sums(SUMS, n_sums, pid, tl.num_programs(0), ZERO_SUMS, BLOCK_N)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]

    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
        s = to_dtype(x + r, S.dtype.element_ty, SOFT_RTNE)
        tl.store(S + offs, s, mask=mask)
        x = s.to(tl.float32)

    mean = tl.sum(x, axis=1) / n_cols
    xc = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / n_cols
    rstd = 1.0 / tl.sqrt(var + tl.cast(eps, tl.float32))  # fp32 even if passed as fp64 (Inductor)
    y = xc * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = y * w[None, :]
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = y + b[None, :]
    if POST_ADD:
        y = y + tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, to_dtype(y, Y.dtype.element_ty, SOFT_RTNE), mask=mask)
    tl.store(Mean + rows, mean, mask=row_mask)
    tl.store(Rstd + rows, rstd, mask=row_mask)


@triton.jit
def _merging_norm_fwd_kernel(
    X, R, Y, W, B, n_rows, H, Wd, Ho, Wo, C, eps,
    HAS_RESIDUAL: tl.constexpr, SUM_DTYPE: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    SOFT_RTNE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """timm PatchMerging's gather and norm: BLOCK_M rows (b, i, j) of the merged (B, Ho, Wo, 4C) map per
    program, row = x[b, 2i + dh, 2j + dw, :] for the channel blocks (dh, dw) = (0, 0), (1, 0), (0, 1),
    (1, 1) of the contiguous (B, H, Wd, C) x, zero past H or Wd (timm's zero pad to even sides, counted in
    the statistics), normalized over its 4C values as _layer_norm_fwd_kernel normalizes a row.
    HAS_RESIDUAL: x is X + R (R of X's shape), each sum rounded once to SUM_DTYPE as torch's add writes it."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    n_cols = 4 * C
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    j = rows % Wo
    i = (rows // Wo) % Ho
    b = (rows // (Wo * Ho)).to(tl.int64)
    k = cols // C
    h = 2 * i[:, None] + (k % 2)[None, :]
    w = 2 * j[:, None] + (k // 2)[None, :]
    src = ((b[:, None] * H + h) * Wd + w) * C + (cols % C)[None, :]
    inside = mask & (h < H) & (w < Wd)
    x = tl.load(X + src, mask=inside, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = x + tl.load(R + src, mask=inside, other=0.0).to(tl.float32)
        if SUM_DTYPE != tl.float32:
            x = to_dtype(x, SUM_DTYPE, SOFT_RTNE).to(tl.float32)

    mean = tl.sum(x, axis=1) / n_cols
    xc = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / n_cols
    rstd = 1.0 / tl.sqrt(var + tl.cast(eps, tl.float32))
    y = xc * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    tl.store(Y + offs, to_dtype(y, Y.dtype.element_ty, SOFT_RTNE), mask=mask)


@triton.jit
def _layer_norm_bwd_kernel(
    DY, X, W, Mean, Rstd, DS, DX, SUMS,
    n_rows, n_cols, rows_per_program,
    HAS_DS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program p owns rows [p * rows_per_program, (p + 1) * rows_per_program) (a multiple of BLOCK_M).
    dx = rstd * (w*dy - xhat * mean(xhat * w*dy) - mean(w*dy)) (+ ds, the gradient that reached x + r
    directly). The program's dweight/dbias sums go to columns [0, C) / [C, 2C) of SUMS (emit_column_sum).
    The next block's x/dy/mean/rstd are loaded before the current block is computed (software
    prefetch: two blocks of loads in flight per program, the loop is otherwise latency bound)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    mask = row_mask[:, None] & col_mask[None, :]
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    x_nxt = tl.load(X + offs, mask=mask, other=0.0)
    dy_nxt = tl.load(DY + offs, mask=mask, other=0.0)
    mean_nxt = tl.load(Mean + rows, mask=row_mask, other=0.0)
    rstd_nxt = tl.load(Rstd + rows, mask=row_mask, other=0.0)
    for _ in range(0, rows_per_program, BLOCK_M):
        x = x_nxt.to(tl.float32)
        dy = dy_nxt.to(tl.float32)
        mean = mean_nxt
        rstd = rstd_nxt
        cur_mask = mask
        cur_offs = offs
        # prefetch the next block (masked off past this program's rows: no memory traffic)
        rows += BLOCK_M
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        x_nxt = tl.load(X + offs, mask=mask, other=0.0)
        dy_nxt = tl.load(DY + offs, mask=mask, other=0.0)
        mean_nxt = tl.load(Mean + rows, mask=row_mask, other=0.0)
        rstd_nxt = tl.load(Rstd + rows, mask=row_mask, other=0.0)

        xhat = tl.where(cur_mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_WEIGHT:
            wdy = dy * w[None, :]
        else:
            wdy = dy
        c1 = tl.sum(xhat * wdy, axis=1) / n_cols
        c2 = tl.sum(wdy, axis=1) / n_cols
        dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        if HAS_DS:
            dx += tl.load(DS + cur_offs, mask=cur_mask, other=0.0).to(tl.float32)
        tl.store(DX + cur_offs, dx.to(DX.dtype.element_ty), mask=cur_mask)
        if HAS_WEIGHT:
            dw_acc += dy * xhat
        if HAS_BIAS:
            db_acc += dy
    if HAS_WEIGHT:
        emit_column_sum(SUMS, pid, 2 * n_cols, cols, tl.sum(dw_acc, axis=0), col_mask, ATOMIC)
    if HAS_BIAS:
        emit_column_sum(SUMS, pid, 2 * n_cols, n_cols + cols, tl.sum(db_acc, axis=0), col_mask, ATOMIC)


# ---------------------------------------------------------------------------------------------------------
# Host side: plain functions the autograd Functions call.


@host_cache
def _tile(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for rows of n_cols elements (cached: no per-call arithmetic)."""
    if n_cols > MAX_COLS:
        raise ValueError(f"layer_norm: C={n_cols} is wider than MAX_COLS={MAX_COLS}")
    block_n = next_pow2(n_cols)
    block_m = max(1, min(64, _TILE_ELEMS // block_n))
    num_warps = min(8, max(4, block_m * block_n // 256))
    return block_m, block_n, num_warps


def bwd_occupancy(elt: int) -> tuple[int, int | None]:
    """(programs per SM, maxnreg) for the persistent LayerNorm backward kernels (8 warps, ~2048-element
    tiles) by input element size. Every program has equal work, so the grid is exactly one wave of
    resident programs. Half precision: sm_90 ptxas gives 71-80 registers (triton 3.8, prefetch included),
    so a cap of 80 keeps 3 programs (24 warps) per SM: 50% more loads in flight than 2, which the
    latency-bound loop needs. fp32: 95-96 registers, 2 per SM."""
    return (3, 80) if elt <= 2 else (2, None)


@host_cache
def _bwd_grid(n_rows: int, n_cols: int, elt: int, device: torch.device) -> tuple[int, int, int | None]:
    """(programs, rows_per_program) for the backward: a few programs per SM, each owning a contiguous
    band of whole blocks and at least _BWD_MIN_ROWS_PER_PROGRAM rows."""
    block_m = _tile(n_cols)[0]
    per_sm, maxnreg = bwd_occupancy(elt)
    row_blocks = cdiv(n_rows, block_m)
    programs = max(1, min(per_sm * sm_count(device), row_blocks, cdiv(n_rows, _BWD_MIN_ROWS_PER_PROGRAM)))
    rows_per_program = cdiv(row_blocks, programs) * block_m
    return max(1, cdiv(n_rows, rows_per_program)), rows_per_program, maxnreg


def _as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    t = t.reshape(-1, n_cols)
    return t if t.is_contiguous() else t.contiguous()


def _dense(t: torch.Tensor | None) -> torch.Tensor | None:
    """weight or bias as the kernels read it, element i at offset i: a strided view (every other element
    of a packed tensor, say) is copied first (C values: nothing to save by reading it strided)."""
    return t if t is None or t.is_contiguous() else t.contiguous()


def _check(x: torch.Tensor, weight, bias, n_cols: int | None = None) -> int:
    """The row width (x's last dim, or n_cols), after checking that weight and bias are that wide and that
    x is a dtype the kernels compute (fp16, bf16, fp32: an fp64 input would come back at fp32's precision)."""
    _common.require_compute_dtype("layer_norm", x)
    n_cols = x.shape[-1] if n_cols is None else n_cols
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(p.shape) != (n_cols,):
            raise ValueError(f"layer_norm: {name} has shape {tuple(p.shape)}, expected ({n_cols},)")
    return n_cols


def layer_norm_fwd(x2, residual2, weight, bias, eps: float, out_dtype: torch.dtype, y_dtype: torch.dtype | None = None,
                   zero_sums: torch.Tensor | None = None):
    """x2 (and residual2): (M, C) contiguous -> (s or None, y, mean, rstd). s is x2 + residual2 in out_dtype;
    y is in y_dtype (default out_dtype: the next layer's input can come out already in its compute dtype).
    zero_sums: a contiguous fp32 buffer that the kernel zeroes for the backward (eager_column_sums)."""
    weight, bias = _dense(weight), _dense(bias)
    n_rows, n_cols = x2.shape
    block_m, block_n, num_warps = _tile(n_cols)
    device = x2.device
    y = _common.new_output((n_rows, n_cols), y_dtype or out_dtype, device)
    s = _common.new_output((n_rows, n_cols), out_dtype, device) if residual2 is not None else None
    mean = _common.new_output((n_rows,), torch.float32, device)
    rstd = _common.new_output((n_rows,), torch.float32, device)
    if n_rows > 0:
        launch(_layer_norm_fwd_kernel)[(cdiv(n_rows, block_m),)](
            x2, residual2 if residual2 is not None else x2, s if s is not None else y, y,
            weight if weight is not None else x2, bias if bias is not None else x2, mean, rstd,
            zero_sums if zero_sums is not None else mean,
            n_rows, n_cols, eps, zero_sums.numel() if zero_sums is not None else 0,
            HAS_RESIDUAL=residual2 is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            ZERO_SUMS=zero_sums is not None, SOFT_RTNE=SOFT_RTNE, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=num_warps,
        )
    elif zero_sums is not None:
        zero_sums.zero_()
    return s, y, mean, rstd


def merging_layer_norm(x: torch.Tensor, weight, bias, eps: float, out_dtype: torch.dtype | None = None,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
    """timm PatchMerging up to its reduction, in one pass and without autograd (inference): x (B, H, W, C)
    padded with zeros to even H and W, gathered 2x2 into (B, ceil(H/2), ceil(W/2), 4C) (channel blocks
    (dh, dw) = (0, 0), (1, 0), (0, 1), (1, 1), timm's order) and normalized over the 4C, weight and bias
    of 4C; output in out_dtype (default x.dtype), rounded once from fp32. Where timm copies x twice (the
    pad, the gather) before its norm reads it, this reads x once. residual: a tensor of x's shape added to
    x first, each sum rounded to the dtype torch's x + residual would have (the previous stage's last
    residual add, which then is never written)."""
    weight, bias = _dense(weight), _dense(bias)
    B, H, Wd, C = x.shape
    n_cols = _check(x, weight, bias, 4 * C)
    x = x.contiguous()
    sum_dtype = x.dtype
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"merging_layer_norm: residual {tuple(residual.shape)} is not x's shape {tuple(x.shape)}")
        sum_dtype = torch.promote_types(x.dtype, residual.dtype)
        if sum_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"merging_layer_norm: x {x.dtype} + residual {residual.dtype} is not a float32, "
                             "bfloat16 or float16 sum")
        residual = residual.contiguous()
    ho, wo = -(-H // 2), -(-Wd // 2)
    n_rows = B * ho * wo
    block_m, block_n, num_warps = _tile(n_cols)
    y = _common.new_output((B, ho, wo, n_cols), out_dtype or sum_dtype, x.device)
    if n_rows > 0:
        launch(_merging_norm_fwd_kernel)[(cdiv(n_rows, block_m),)](
            x, residual if residual is not None else x, y, weight if weight is not None else x,
            bias if bias is not None else x, n_rows, H, Wd, ho, wo, C, eps,
            HAS_RESIDUAL=residual is not None, SUM_DTYPE=TL_DTYPES[sum_dtype], HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None, SOFT_RTNE=SOFT_RTNE, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )
    return y


def post_add_layer_norm_fwd(x2, residual2, weight, bias, eps: float, out_dtype: torch.dtype,
                            zero_sums: torch.Tensor | None = None):
    """x2, residual2: (M, C) contiguous -> (out, mean, rstd), out = residual2 + LayerNorm(x2) in out_dtype,
    one pass (the normalized x is never written). zero_sums as in layer_norm_fwd."""
    weight, bias = _dense(weight), _dense(bias)
    n_rows, n_cols = x2.shape
    block_m, block_n, num_warps = _tile(n_cols)
    device = x2.device
    out = _common.new_output((n_rows, n_cols), out_dtype, device)
    mean = _common.new_output((n_rows,), torch.float32, device)
    rstd = _common.new_output((n_rows,), torch.float32, device)
    if n_rows > 0:
        launch(_layer_norm_fwd_kernel)[(cdiv(n_rows, block_m),)](
            x2, residual2, out, out, weight if weight is not None else x2, bias if bias is not None else x2,
            mean, rstd, zero_sums if zero_sums is not None else mean,
            n_rows, n_cols, eps, zero_sums.numel() if zero_sums is not None else 0,
            HAS_RESIDUAL=False, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            ZERO_SUMS=zero_sums is not None, SOFT_RTNE=SOFT_RTNE, BLOCK_M=block_m, BLOCK_N=block_n,
            POST_ADD=True, num_warps=num_warps,
        )
    elif zero_sums is not None:
        zero_sums.zero_()
    return out, mean, rstd


def layer_norm_bwd(dy2, x2, weight, bias, mean, rstd, ds2, dx_dtype: torch.dtype, sums_into=None):
    """dy2, x2 (the normalized input: x, or s = x + r), ds2 (gradient at s, or None): (M, C) contiguous.
    -> (dx (M, C) in dx_dtype, (2C,) fp32 column sums: dweight then dbias; see split_norm_grads).
    sums_into: a zeroed (2C,) fp32 tensor for the sums (column_sums)."""
    weight, bias = _dense(weight), _dense(bias)
    n_rows, n_cols = x2.shape
    device = x2.device
    dx = _common.new_output((n_rows, n_cols), dx_dtype, device)
    if n_rows == 0:
        return dx, torch.zeros(2 * n_cols, dtype=torch.float32, device=device)
    block_m, block_n, num_warps = _tile(n_cols)
    programs, rows_per_program, maxnreg = _bwd_grid(n_rows, n_cols, max(x2.element_size(), dy2.element_size()), device)
    sums, atomic = column_sums(programs, 2 * n_cols, device, sums_into)
    launch(_layer_norm_bwd_kernel)[(programs,)](
        dy2, x2, weight if weight is not None else x2, mean, rstd,
        ds2 if ds2 is not None else dy2, dx, sums,
        n_rows, n_cols, rows_per_program,
        HAS_DS=ds2 is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, ATOMIC=atomic,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, **launch_options(maxnreg),
    )
    return dx, finish_column_sums(sums, atomic)


# One operator per host function (_common.kernel_op): traced into by torch.compile on a GPU (triton_op),
# opaque otherwise, where the fake implementations give the output shapes and dtypes. Inputs are (M, C)
# rows (the autograd Functions reshape); outputs are fresh contiguous tensors. dweight and dbias come back
# as one (2C,) fp32 tensor (two views of one buffer may not both be outputs of an op); the Functions split
# and cast it.


@kernel_op("swinbench::layer_norm_fwd")
def _layer_norm_fwd_op(x2: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                       eps: float, y_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, y, mean, rstd = layer_norm_fwd(x2, None, weight, bias, eps, x2.dtype, y_dtype)
    return y, mean, rstd


@_layer_norm_fwd_op.register_fake
def _(x2, weight, bias, eps, y_dtype):
    n_rows = x2.shape[0]
    return (x2.new_empty(x2.shape, dtype=y_dtype), x2.new_empty((n_rows,), dtype=torch.float32),
            x2.new_empty((n_rows,), dtype=torch.float32))


@kernel_op("swinbench::add_layer_norm_fwd")
def _add_layer_norm_fwd_op(x2: torch.Tensor, residual2: torch.Tensor, weight: Optional[torch.Tensor],
                           bias: Optional[torch.Tensor], eps: float, y_dtype: torch.dtype
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return layer_norm_fwd(x2, residual2, weight, bias, eps, torch.promote_types(x2.dtype, residual2.dtype), y_dtype)


@_add_layer_norm_fwd_op.register_fake
def _(x2, residual2, weight, bias, eps, y_dtype):
    n_rows = x2.shape[0]
    out_dtype = torch.promote_types(x2.dtype, residual2.dtype)
    return (x2.new_empty(x2.shape, dtype=out_dtype), x2.new_empty(x2.shape, dtype=y_dtype),
            x2.new_empty((n_rows,), dtype=torch.float32), x2.new_empty((n_rows,), dtype=torch.float32))


@kernel_op("swinbench::post_add_layer_norm_fwd")
def _post_add_layer_norm_fwd_op(x2: torch.Tensor, residual2: torch.Tensor, weight: Optional[torch.Tensor],
                                bias: Optional[torch.Tensor], eps: float, out_dtype: torch.dtype
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return post_add_layer_norm_fwd(x2, residual2, weight, bias, eps, out_dtype)


@_post_add_layer_norm_fwd_op.register_fake
def _(x2, residual2, weight, bias, eps, out_dtype):
    n_rows = x2.shape[0]
    return (x2.new_empty(x2.shape, dtype=out_dtype), x2.new_empty((n_rows,), dtype=torch.float32),
            x2.new_empty((n_rows,), dtype=torch.float32))


@kernel_op("swinbench::layer_norm_bwd")
def _layer_norm_bwd_op(dy2: torch.Tensor, x2: torch.Tensor, weight: Optional[torch.Tensor],
                       bias: Optional[torch.Tensor], mean: torch.Tensor, rstd: torch.Tensor,
                       ds2: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return layer_norm_bwd(dy2, x2, weight, bias, mean, rstd, ds2, x2.dtype)


@_layer_norm_bwd_op.register_fake
def _(dy2, x2, weight, bias, mean, rstd, ds2):
    return x2.new_empty(x2.shape), mean.new_empty((2 * x2.shape[1],))


def _pair_rows(what: str, x: torch.Tensor, residual: torch.Tensor, weight, bias):
    """(C, x as (M, C) rows, residual as rows) after checking the shapes of a norm with a residual."""
    if x.shape != residual.shape:
        raise ValueError(f"{what}: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    _check(residual, None, None)      # its dtype too: the sum is computed in fp32
    n_cols = _check(x, weight, bias)
    return n_cols, _as_rows(x, n_cols), _as_rows(residual, n_cols)


def _norm_backward(ctx, dy: torch.Tensor):
    """(dx, dweight, dbias) of a LayerNorm of the saved (x2, weight, bias, mean, rstd), for the gradient dy
    at its output (LayerNormFunction's, and PostAddLayerNormFunction's, whose residual passes dy on)."""
    x2, weight, bias, mean, rstd = ctx.saved_tensors
    dy2, into, ctx.sums = _as_rows(dy, x2.shape[1]), ctx.sums, None
    if into is None:
        dx, sums = _layer_norm_bwd_op(dy2, x2, weight, bias, mean, rstd, None)
    else:
        dx, sums = layer_norm_bwd(dy2, x2, weight, bias, mean, rstd, None, x2.dtype, sums_into=into)
    dw, db = split_norm_grads(sums, weight, bias)
    return dx.view(ctx.x_shape), dw, db


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, out_dtype):
        n_cols = _check(x, weight, bias)
        x2 = _as_rows(x, n_cols)
        out_dtype = out_dtype or x.dtype
        ctx.sums = eager_column_sums(2 * n_cols, x.device, ctx, weight, bias)
        if ctx.sums is None:
            y, mean, rstd = _layer_norm_fwd_op(x2, weight, bias, eps, out_dtype)
        else:
            _, y, mean, rstd = layer_norm_fwd(x2, None, weight, bias, eps, x2.dtype, out_dtype, zero_sums=ctx.sums)
        ctx.save_for_backward(x2, weight, bias, mean, rstd)
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        return (*_norm_backward(ctx, dy), None, None)


class AddLayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, y_dtype):
        n_cols, x2, r2 = _pair_rows("add_layer_norm", x, residual, weight, bias)
        out_dtype = torch.promote_types(x.dtype, residual.dtype)
        y_dtype = y_dtype or out_dtype
        ctx.sums = eager_column_sums(2 * n_cols, x.device, ctx, weight, bias)
        if ctx.sums is None:
            s, y, mean, rstd = _add_layer_norm_fwd_op(x2, r2, weight, bias, eps, y_dtype)
        else:
            s, y, mean, rstd = layer_norm_fwd(x2, r2, weight, bias, eps, out_dtype, y_dtype, zero_sums=ctx.sums)
        ctx.save_for_backward(s, weight, bias, mean, rstd)
        ctx.x_shape = x.shape
        ctx.dtypes = (x.dtype, residual.dtype)
        return s.view(x.shape), y.view(x.shape)

    @staticmethod
    def backward(ctx, ds, dy):
        s2, weight, bias, mean, rstd = ctx.saved_tensors
        n_cols = s2.shape[1]
        dy2, ds2, into, ctx.sums = _as_rows(dy, n_cols), _as_rows(ds, n_cols), ctx.sums, None
        if into is None:
            dsum, sums = _layer_norm_bwd_op(dy2, s2, weight, bias, mean, rstd, ds2)
        else:
            dsum, sums = layer_norm_bwd(dy2, s2, weight, bias, mean, rstd, ds2, s2.dtype, sums_into=into)
        dsum = dsum.view(ctx.x_shape)
        dw, db = split_norm_grads(sums, weight, bias)
        x_dtype, r_dtype = ctx.dtypes
        # Like torch's add: the same gradient flows to both inputs (cast where autocast mixed dtypes).
        return dsum.to(x_dtype), dsum.to(r_dtype), dw, db, None, None


class PostAddLayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, out_dtype):
        n_cols, x2, r2 = _pair_rows("post_add_layer_norm", x, residual, weight, bias)
        ctx.sums = eager_column_sums(2 * n_cols, x.device, ctx, weight, bias)
        if ctx.sums is None:
            out, mean, rstd = _post_add_layer_norm_fwd_op(x2, r2, weight, bias, eps, out_dtype)
        else:
            out, mean, rstd = post_add_layer_norm_fwd(x2, r2, weight, bias, eps, out_dtype, zero_sums=ctx.sums)
        ctx.save_for_backward(x2, weight, bias, mean, rstd)
        ctx.x_shape = x.shape
        ctx.r_dtype = residual.dtype
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, dout):
        dx, dw, db = _norm_backward(ctx, dout)
        # the residual's gradient is the output's: no pass of its own (a cast only where dtypes differ)
        return dx, dout.to(ctx.r_dtype), dw, db, None, None


def post_add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                        bias: torch.Tensor | None, eps: float = 1e-5, out_dtype: torch.dtype | None = None
                        ) -> torch.Tensor:
    """residual + F.layer_norm(x, (C,), weight, bias, eps), both (..., C), in one pass: a post-norm block's
    residual add (SwinV2: x + norm1(attn(x))). The sum is taken in fp32 from the normalized x and the
    residual and rounded once into out_dtype (default: the promoted dtype of x and residual), which is
    torch's result wherever the norm's output is at least as wide as out_dtype (under CUDA autocast the
    norm's output is fp32). dx comes back in x.dtype, the residual's gradient in its dtype."""
    out_dtype = out_dtype or torch.promote_types(x.dtype, residual.dtype)
    return PostAddLayerNormFunction.apply(x, residual, weight, bias, float(eps), out_dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float = 1e-5, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """F.layer_norm(x, (C,), weight, bias, eps) for x (..., C) fp32/fp16/bf16; output in out_dtype (default
    x.dtype), rounded once from fp32; dx comes back in x.dtype."""
    return LayerNormFunction.apply(x, weight, bias, float(eps), out_dtype)


# Devices whose autocast runs torch's layer_norm in fp32 (its output fp32 for an fp16/bf16 input): CUDA's
# autocast lists layer_norm among the ops that autocast to float32; the CPU's does not.
AUTOCAST_FP32_NORM_DEVICES = ("cuda",)


def autocast_norm_dtype(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.dtype | None:
    """The dtype torch's layer_norm returns, under the autocast state in effect, for an input on x's device
    in `dtype` (default x.dtype), where it differs from that dtype: fp32 for fp16/bf16 while autocast is on
    for the device and the device's autocast runs layer_norm in fp32 (AUTOCAST_FP32_NORM_DEVICES); None
    otherwise."""
    dev, dtype = x.device.type, dtype or x.dtype
    if dtype in (torch.float16, torch.bfloat16) and dev in AUTOCAST_FP32_NORM_DEVICES and torch.is_autocast_enabled(dev):
        return torch.float32
    return None


def autocast_linear_input_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype an autocast nn.Linear casts an fp32 input to (bf16 or fp16) when autocast is on for x's
    device; None otherwise. A fused kernel whose output goes straight into such a Linear can write that
    dtype itself: rounding once from its fp32 result gives the bits the Linear's cast would, and it saves
    the cast's pass over the activation and its backward's (four launches per block and step)."""
    dev = x.device.type
    if x.dtype != torch.float32 or not torch.is_autocast_enabled(dev):
        return None
    dt = torch.get_autocast_dtype(dev)
    return dt if dt in (torch.bfloat16, torch.float16) else None


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                   bias: torch.Tensor | None, eps: float = 1e-5, y_dtype: torch.dtype | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, F.layer_norm(s, (C,), weight, bias, eps)) with s = x + residual, both (..., C), in one pass.
    s is in the promoted dtype of x and residual, and so is the normalized output unless y_dtype says
    otherwise (rounded once from fp32, the bits `.to(y_dtype)` would give); both are differentiable."""
    return AddLayerNormFunction.apply(x, residual, weight, bias, float(eps), y_dtype)


class TritonLayerNorm(torch.nn.LayerNorm):
    """nn.LayerNorm over the last dim whose forward runs `layer_norm`. Same parameters and state_dict
    keys (`weight`, `bias`) as the module it replaces; `from_layer_norm` keeps the very Parameter objects.

    Its output has the dtype torch's LayerNorm would return under autocast (fp32 under CUDA autocast),
    unless `into_linear` is set (by the pass that knows the module's output goes straight into an
    nn.Linear): then, under autocast, it writes the dtype that Linear casts its input to, the same bits
    without the cast (`autocast_linear_input_dtype`; the input's dtype for a half-precision input)."""

    into_linear = False

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias,
                         device=device, dtype=dtype)
        if len(self.normalized_shape) != 1:
            raise ValueError("TritonLayerNorm normalizes over the last dim only")

    @classmethod
    def from_layer_norm(cls, ln: torch.nn.LayerNorm) -> "TritonLayerNorm":
        new = cls(ln.normalized_shape, eps=ln.eps, elementwise_affine=ln.elementwise_affine,
                  bias=getattr(ln, "bias", None) is not None, device="meta")
        new.weight = ln.weight
        new.bias = ln.bias
        new.train(ln.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = autocast_linear_input_dtype(x) if self.into_linear else autocast_norm_dtype(x)
        return layer_norm(x, self.weight, self.bias, self.eps, dtype)
