"""A Swin MLP's training step with its GELU in the epilogues of two GEMMs (Triton).

    gemm_gelu(x2, w1, b1)                 -> (GELU(pre), pre), pre = x2 @ w1^T + b1: fc1's GEMM writes both
    gemm_dgelu(dy, w2, pre, bias_dtype)   -> (dpre, db1): dpre = (dy @ w2) * GELU'(pre), db1 = dpre summed
                                             over the rows: fc2's input-gradient GEMM with fc1's GELU
                                             backward and bias-gradient sums in its epilogue
    gelu_mlp(x, w1, b1, w2, b2)           -> fc2(GELU(fc1(x))) as one autograd Function that uses both

Why: with the window and attention kernels fused, the MLP's GELU is the largest elementwise work left in
a Swin training step. Run beside cuBLAS GEMMs it costs three passes over the MLP's widest activation
(rows x 4C) in the forward (the GEMM writes pre; GELU reads it and writes its output) and four in the
backward (the GEMM writes fc2's input gradient; the fused GELU backward reads it and pre and writes dpre,
summing fc1's bias gradient on the way: `linear.bias_grad`). In the epilogues the forward writes pre and
GELU(pre) straight from the accumulators (two passes) and the backward reads pre and writes dpre (two):
three passes of rows x 4C fewer a block, whatever the GEMMs cost otherwise. fc2's forward GEMM, both
weight-gradient GEMMs and fc1's input-gradient GEMM stay cuBLAS; fc2's bias gradient stays one Triton
column sum (`linear.bias_grad`).

Numerics, as the torch ops they replace (the MLP that `linear.linear(..., gelu=True)` then fc2 computes):
pre is the fp32 accumulator plus the bias, rounded once to the compute dtype; GELU is the exact erf form
of that rounded value, computed in fp32 and rounded once. In the backward the accumulator of dy @ w2 is
rounded to the compute dtype first (the tensor autograd would hand the GELU backward), then multiplied
by GELU'(pre) in fp32 and rounded (`linear.bias_grad`'s formula); db1 sums those rounded values in fp32
over fixed 64-row slices (each stored, no atomics: the same bits from run to run) and casts once. The
GEMMs' own sums run in another order than cuBLAS's, so results differ from the unfused MLP by the
rounding of the compute dtype, not more (tests/test_mlp_kernel.py holds both to float64).

Kernels run on the GPU, and on the CPU with TRITON_INTERPRET=1 set before this module is imported (slow).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels import _common
from workbench.kernels._common import _INTERPRET, AUTOTUNE, SOFT_RTNE, cdiv, grouped_tile, kernel_op, launch, to_dtype
from workbench.kernels.linear import bias_grad, compute_dtype

# Rows of one column-sum partial: a program of BLOCK_M rows stores BLOCK_M // 64 of them, so that the
# partials' count does not depend on which tile the autotuner picked.
_SUM_ROWS = 64
DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _gemm_gelu_kernel(A, B, BIAS, PRE, OUT, PARTIALS, M, N, K, s_am, s_bk, s_bn,
                      DGELU: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, SOFT_RTNE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      SUM_ROWS: tl.constexpr):
    """acc = A (M, K) @ B (K, N) in fp32, B addressed through strides (s_bk, s_bn) (fc1's weight (N, K) as
    its transpose, fc2's (K, N) as it is). Forward (not DGELU): PRE = round(acc + BIAS), OUT = round(GELU(PRE)).
    DGELU: OUT = round(round(acc) * GELU'(PRE)), and PARTIALS[r, :] = the column sums of OUT over rows
    [r * SUM_ROWS, +SUM_ROWS). Programs walk the tiles in groups of GROUP_M rows of tiles (L2 reuse)."""
    rows, cols = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    ks = tl.arange(0, BLOCK_K)
    # rows and columns past the edge read a valid one (their results are not stored): no load masks
    a_ptr = A + (rows % M).to(tl.int64)[:, None] * s_am + ks[None, :]
    b_ptr = B + ks.to(tl.int64)[:, None] * s_bk + (cols % N).to(tl.int64)[None, :] * s_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptr)
            b = tl.load(b_ptr)
        else:
            a = tl.load(a_ptr, mask=ks[None, :] < K - k0, other=0.0)
            b = tl.load(b_ptr, mask=ks[:, None] < K - k0, other=0.0)
        if UPCAST:   # the CPU interpreter multiplies bf16 operands as raw integers
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc=acc)
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K * s_bk
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    dtype = PRE.dtype.element_ty
    if DGELU:
        dh = to_dtype(acc, dtype, SOFT_RTNE).to(tl.float32)
        x = tl.load(PRE + offs, mask=mask, other=0.0).to(tl.float32)
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
        d = to_dtype(dh * (cdf + x * pdf), dtype, SOFT_RTNE)
        tl.store(OUT + offs, d, mask=mask)
        d32 = tl.where(mask, d.to(tl.float32), 0.0)
        SLICES: tl.constexpr = BLOCK_M // SUM_ROWS
        sums = tl.sum(tl.reshape(d32, (SLICES, SUM_ROWS, BLOCK_N)), axis=1)
        slice_rows = tl.min(rows, axis=0) // SUM_ROWS + tl.arange(0, SLICES)
        tl.store(PARTIALS + slice_rows.to(tl.int64)[:, None] * N + cols[None, :], sums,
                 mask=(slice_rows < tl.cdiv(M, SUM_ROWS))[:, None] & col_mask[None, :])
    else:
        acc += tl.load(BIAS + cols % N).to(tl.float32)[None, :]
        pre = to_dtype(acc, dtype, SOFT_RTNE)
        tl.store(PRE + offs, pre, mask=mask)
        x = pre.to(tl.float32)
        tl.store(OUT + offs, to_dtype(0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476)), dtype, SOFT_RTNE),
                 mask=mask)


# Hopper tiles for 2-byte operands, BLOCK_K 64 (128 bytes of a row a step); each keeps its accumulator
# and the epilogue's temporaries in registers (no spills at sm_90: tests/aot_compile_kernels.py --resources;
# 128 x 256 over 8 warps spills 224-776 bytes).
_BLOCK_K = 64
_CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": _BLOCK_K, "GROUP_M": 8}, num_warps=nw, num_stages=ns)
            for bm, bn, nw, ns in ((128, 128, 8, 4), (128, 128, 8, 3), (64, 256, 8, 3), (64, 128, 4, 4),
                                   (128, 64, 4, 4))]
_INTERPRET_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2}
_KEY = ["M", "N", "K", "DGELU"]


def _bench(fn, quantiles=None):
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


if _INTERPRET:
    _kernel = _gemm_gelu_kernel
elif not AUTOTUNE:
    _kernel = triton.autotune(_CONFIGS[:1], key=_KEY)(_gemm_gelu_kernel)
else:
    _kernel = triton.autotune(_CONFIGS, key=_KEY, do_bench=_bench)(_gemm_gelu_kernel)


def _check(what: str, a: torch.Tensor, b: torch.Tensor, a_cols: int, b_shape: tuple) -> None:
    if a.dim() != 2 or a.shape[1] != a_cols or tuple(b.shape) != b_shape:
        raise ValueError(f"{what}: shapes {tuple(a.shape)} and {tuple(b.shape)} do not multiply as (M, {a_cols}) "
                         f"by {b_shape}")
    if a.dtype not in DTYPES or b.dtype != a.dtype:
        raise ValueError(f"{what}: operands must share a half dtype (bf16 or fp16), got {a.dtype} and {b.dtype}")


def _launch(a, b, s_bk, s_bn, bias, pre, out, partials, n, k, dgelu: bool) -> None:
    m = a.shape[0]
    extra = dict(_INTERPRET_CONFIG) if _INTERPRET else {}
    block_k = extra["BLOCK_K"] if _INTERPRET else _BLOCK_K
    grid = lambda meta: (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    launch(_kernel)[grid](
        a, b, bias, pre, out, partials, m, n, k, a.stride(0), s_bk, s_bn, DGELU=dgelu, EVEN_K=k % block_k == 0,
        UPCAST=_INTERPRET and a.dtype == torch.bfloat16, SOFT_RTNE=SOFT_RTNE, SUM_ROWS=_SUM_ROWS, **extra)


@kernel_op("swinbench::gemm_gelu")
def gemm_gelu(x2: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(GELU(pre), pre) with pre = x2 @ w1^T + b1, from one GEMM whose epilogue writes both: x2 (M, K) with
    contiguous rows, w1 (N, K) contiguous, b1 (N,), one half dtype; both results (M, N) in that dtype."""
    n, k = w1.shape
    _check("gemm_gelu", x2, w1, k, (n, k))
    if b1.shape != (n,) or b1.dtype != x2.dtype:
        raise ValueError(f"gemm_gelu: bias must be ({n},) {x2.dtype}, got {tuple(b1.shape)} {b1.dtype}")
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    w1, b1 = w1.contiguous(), b1.contiguous()
    m = x2.shape[0]
    pre = _common.new_output((m, n), x2.dtype, x2.device)
    out = _common.new_output((m, n), x2.dtype, x2.device)
    if m > 0:
        _launch(x2, w1, 1, k, b1, pre, out, out, n, k, dgelu=False)
    return out, pre


@gemm_gelu.register_fake
def _(x2, w1, b1):
    shape = (x2.shape[0], w1.shape[0])
    return x2.new_empty(shape), x2.new_empty(shape)


@kernel_op("swinbench::gemm_dgelu")
def gemm_dgelu(dy: torch.Tensor, w2: torch.Tensor, pre: torch.Tensor, bias_dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dpre, db1): dpre = (dy @ w2) * GELU'(pre) and db1 = dpre summed over its rows, in fp32, cast to
    bias_dtype, from one GEMM whose epilogue reads pre. dy (M, K) with contiguous rows, w2 (K, N)
    contiguous (fc2's weight: K = its out_features), pre (M, N) contiguous, one half dtype."""
    k, n = w2.shape
    _check("gemm_dgelu", dy, w2, k, (k, n))
    m = dy.shape[0]
    if pre.shape != (m, n) or pre.dtype != dy.dtype:
        raise ValueError(f"gemm_dgelu: pre must be ({m}, {n}) {dy.dtype}, got {tuple(pre.shape)} {pre.dtype}")
    if dy.stride(1) != 1:
        dy = dy.contiguous()
    w2, pre = w2.contiguous(), pre.contiguous()
    dpre = _common.new_output((m, n), dy.dtype, dy.device)
    partials = _common.new_output((cdiv(m, _SUM_ROWS), n), torch.float32, dy.device)
    if m == 0:
        return dpre, torch.zeros(n, dtype=bias_dtype, device=dy.device)
    _launch(dy, w2, n, 1, pre, pre, dpre, partials, n, k, dgelu=True)
    return dpre, partials.sum(0).to(bias_dtype)


@gemm_dgelu.register_fake
def _(dy, w2, pre, bias_dtype):
    return dy.new_empty((dy.shape[0], w2.shape[1])), dy.new_empty((w2.shape[1],), dtype=bias_dtype)


def applies(x: torch.Tensor, dtype: torch.dtype, b1: torch.Tensor | None) -> bool:
    """Whether gelu_mlp runs the epilogue GEMMs: the kernels run on x's device (a GPU, or any under the
    interpreter), a half compute dtype, and fc1 has a bias."""
    return b1 is not None and dtype in DTYPES and (x.is_cuda or _INTERPRET)


class GeluMlpFunction(torch.autograd.Function):
    """fc2(GELU(fc1(x))) with fc1's GEMM, bias and GELU as gemm_gelu and fc2's input-gradient GEMM with the
    GELU backward and fc1's bias gradient as gemm_dgelu; fc2's forward, both weight gradients and fc1's
    input gradient are cuBLAS GEMMs, fc2's bias gradient one Triton column sum. Under autocast x and the
    parameters are cast to the autocast dtype, as F.linear's rule does; each gradient returns in its
    input's dtype."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2):
        dt = compute_dtype(x, w1)
        hidden, n_in = w1.shape
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, n_in).to(dt)
            x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
            w1c, w2c = w1.to(dt), w2.to(dt)
            h, pre = gemm_gelu(x2, w1c, b1.to(dt))
            y = torch.addmm(b2.to(dt), h, w2c.t()) if b2 is not None else h @ w2c.t()
        ctx.save_for_backward(x2, w1c, pre, h, w2c)
        ctx.meta = (x.shape, x.dtype, w1.dtype, b1.dtype, w2.dtype, None if b2 is None else b2.dtype)
        return y.view(*x.shape[:-1], w2.shape[0])

    @staticmethod
    def backward(ctx, dout):
        x2, w1c, pre, h, w2c = ctx.saved_tensors
        x_shape, x_dtype, w1_dtype, b1_dtype, w2_dtype, b2_dtype = ctx.meta
        need = ctx.needs_input_grad
        dy = dout.reshape(-1, w2c.shape[0]).to(w2c.dtype)
        dy = dy if dy.is_contiguous() else dy.contiguous()
        db2 = bias_grad(dy, None, b2_dtype)[1] if b2_dtype is not None and need[4] else None
        dw2 = (dy.t() @ h).to(w2_dtype) if need[3] else None
        dpre, db1 = gemm_dgelu(dy, w2c, pre, b1_dtype)
        dx = (dpre @ w1c).view(x_shape).to(x_dtype) if need[0] else None
        dw1 = (dpre.t() @ x2).to(w1_dtype) if need[1] else None
        return dx, dw1, (db1 if need[2] else None), dw2, db2


def gelu_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
             b2: torch.Tensor | None) -> torch.Tensor:
    """fc2(GELU(fc1(x))) (exact GELU) as GeluMlpFunction: x (..., C_in), w1 (H, C_in), b1 (H,), w2 (C_out, H),
    b2 (C_out,) or None. The caller checks `applies` first."""
    if x.shape[-1] != w1.shape[1] or w2.shape[1] != w1.shape[0]:
        raise ValueError(f"gelu_mlp: x {tuple(x.shape)}, fc1 {tuple(w1.shape)} and fc2 {tuple(w2.shape)} do not chain")
    return GeluMlpFunction.apply(x, w1, b1, w2, b2)
