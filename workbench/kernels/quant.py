"""Symmetric quantization for inference GEMMs: scales, quantize / dequantize, calibration observers, and
the quantized matmuls (FP8 through torch._scaled_mm, INT8 through torch._int_mm, either through
quant_matmul's Triton GEMM with a fused epilogue).

    absmax_scale(x, fmt, dim=None)      -> fp32 scale: amax(|x|) / qmax, per tensor (dim None, shape ())
                                           or per row (dim=-1 over a 2-D x: shape (rows, 1))
    quantize(x, scale, fmt)             -> x / scale rounded to the format (fp8 e4m3fn or int8), saturated
    dequantize(q, scale)                -> q * scale in fp32
    fake_quantize(x, scale, fmt)        -> dequantize(quantize(x, scale, fmt), scale): the error the format adds
    AbsMaxObserver, PercentileObserver  -> per-tensor activation amax over calibration batches
    fp8_linear(x_q, x_scale, w_q, w_scale, bias)   (M, K) e4m3 @ (N, K)^T -> (M, N) bf16, torch._scaled_mm
    int8_linear(x_q, x_scale, w_q, w_scale, bias)  (M, K) int8 @ (N, K)^T -> (M, N) bf16, torch._int_mm
    quantize_rows(x2, fmt)              -> (x_q, x_scale): absmax_scale(x2, fmt, dim=-1, check=False) and
                                           quantize(x2, x_scale, fmt) in one Triton launch, bit for bit
    gelu_quantize_rows(h2, fmt)         -> quantize_rows(GELU(h2), fmt) in one launch: an MLP's activation
                                           and fc2's input quantization (QuantLinear.forward_quantized)
    int8_dequant(acc, x_scale, w_scale, bias)      int8_linear's fp32 epilogue in one Triton launch, bit for bit
    quant_matmul(x_q, x_scale, w_q, w_scale, bias) either format's GEMM in Triton with that epilogue fused:
                                           (M, N) bf16 written once (int8: int8_linear's bits); on Hopper
                                           a persistent TMA kernel where it times faster
    quant_matmul_act(..., gelu, out_scale)  the same with an MLP's GELU and the next Linear's static
                                           quantization in the epilogue: fc1 writing fc2's input

Formats (`fmt`): "fp8" is float8 e4m3fn (largest finite 448, no inf: a value past 448 would become NaN,
so quantize saturates first); "int8" is symmetric int8, [-127, 127] (-128 unused so that the range is
symmetric and a negated weight quantizes to the negated integer).

Scale guards: an all-zero row or tensor has amax 0; its scale is 1 (any scale gives back zeros). A
scale never falls below the smallest normal fp32 (a denormal amax would give a zero scale and inf
quotients). A non-finite amax (an inf or NaN in x) is refused with ValueError where `check` is on
(weights and calibration, once); the dynamic per-row path of a forward passes check=False, since the
check is a host sync (and CUDA graphs cannot capture one): a NaN activation stays NaN, as it would in bf16,
except under a static int8 scale, where the cast to int8 maps it to 0 (no per-row reduction carries it).

Weights are quantized per output channel (per row of the (N, K) weight): one scale per output feature,
applied after the GEMM. Activations are quantized per row (per token, dynamic: computed each forward)
or per tensor (static: calibrated once). Both GEMMs accumulate exactly (fp8 products in fp32, int8 in
int32), so a matmul of the dequantized operands in fp32 computes what they compute, up to the order of
the sums: that is the simulate mode's matmul (`fake_quantize` both operands, then F.linear).

Triton (where kernels run: a CUDA tensor, or any tensor under TRITON_INTERPRET=1, `kernels_run`): the
GEMM routes quantize dynamic activations with `quantize_rows`, one launch that reads x once and writes
x_q and the (M, 1) scales, instead of the chain of full-size torch ops (abs, amax, cast to fp32, divide,
round, clamp, cast); `int8_linear` applies its scales and bias with `int8_dequant`, one pass over the
int32 accumulator instead of several fp32 ones. Both give the torch ops' bits: the same fp32 operations
in the same order, each rounded once (on the GPU through libdevice's correctly rounded div_rn / mul_rn /
add_rn, which ptxas never contracts into an FMA; torch's CUDA kernels divide an fp32 tensor by a Python
scalar as a multiplication by its fp32 reciprocal, so the scale does the same there). The static
per-tensor path and the simulate route keep the torch ops. Both host functions are torch.library
operators (`_common.kernel_op`): no host sync, so they run under CUDA-graph capture and torch.compile.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from workbench.kernels import _common
from workbench.kernels._common import (_INTERPRET, SOFT_RTNE, cdiv, kernel_op, launch, next_pow2, sm_count,
                                       to_dtype)

FORMATS = ("fp8", "int8")
QMAX = {"fp8": 448.0, "int8": 127.0}
QDTYPE = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
# the smallest scale: the smallest normal fp32, so x / scale stays finite for every finite x that is
# itself at most qmax * scale
MIN_SCALE = torch.finfo(torch.float32).tiny


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}: choose {' or '.join(FORMATS)}")


def scale_from_amax(amax: torch.Tensor, fmt: str, check: bool = True) -> torch.Tensor:
    """fp32 scale amax / qmax (same shape as amax); 1 where amax is 0; at least MIN_SCALE.
    ValueError for a non-finite amax when `check` (a host sync)."""
    _check_format(fmt)
    amax = amax.float()
    if check and not bool(torch.isfinite(amax).all()):
        raise ValueError("cannot quantize a tensor that holds inf or NaN")
    scale = (amax / QMAX[fmt]).clamp_min(MIN_SCALE)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def absmax_scale(x: torch.Tensor, fmt: str, dim: int | None = None, check: bool = True) -> torch.Tensor:
    """The scale that maps amax(|x|) to the format's largest value. dim None: one scale, shape ();
    dim=-1 on a 2-D (rows, K) x: one per row, shape (rows, 1). Any float dtype in; fp32 out."""
    if dim is None:
        amax = x.detach().abs().amax().float()
    else:
        amax = x.detach().abs().amax(dim=dim, keepdim=True).float()
    return scale_from_amax(amax, fmt, check=check)


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """x / scale in the format: fp8 e4m3fn (round to nearest even, saturated to +-448) or int8 (rounded half
    to even, clamped to +-127). scale broadcasts against x (shape () or (rows, 1)). The quotient is fp32."""
    _check_format(fmt)
    q = x.float() / scale
    if fmt == "int8":
        return q.round_().clamp_(-127, 127).to(torch.int8)
    return q.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * scale in fp32."""
    return q.float() * scale


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """dequantize(quantize(x)): x with the format's rounding and saturation, fp32."""
    return dequantize(quantize(x, scale, fmt), scale)


# ------------------------------------------------------------------------------ calibration


class AbsMaxObserver:
    """The largest |x| over every observed tensor: the per-tensor amax of a static activation scale."""

    def __init__(self):
        self.amax: torch.Tensor | None = None
        self.batches = 0

    def observe(self, x: torch.Tensor) -> None:
        a = x.detach().abs().amax().float()
        self.amax = a if self.amax is None else torch.maximum(self.amax, a)
        self.batches += 1

    def scale(self, fmt: str) -> torch.Tensor:
        if self.amax is None:
            raise ValueError("no batch was observed")
        return scale_from_amax(self.amax, fmt)


class PercentileObserver:
    """The `percentile`-th percentile of |x| per observed tensor, averaged over the tensors: a static scale
    that clips the rarest outliers (0.01% of the values at 99.99) for a finer step on the rest. The
    percentile of n values is the k-th smallest, k = ceil(n * percentile / 100) (numpy's 'inverted_cdf')."""

    def __init__(self, percentile: float = 99.99):
        if not 0 < percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {percentile}")
        self.percentile = percentile
        self.values: list[torch.Tensor] = []

    @property
    def batches(self) -> int:
        return len(self.values)

    def observe(self, x: torch.Tensor) -> None:
        flat = x.detach().reshape(-1).abs().float()
        n = flat.numel()
        if n == 0:
            return
        if not bool(torch.isfinite(flat).all()):
            # kthvalue sorts inf and NaN above every number: a few would drop out of the percentile unseen
            raise ValueError("an observed activation holds inf or NaN: no scale can be calibrated from it")
        k = min(n, max(1, -(-int(round(n * self.percentile * 1e4)) // int(1e6))))
        self.values.append(flat.kthvalue(k).values)

    @property
    def amax(self) -> torch.Tensor | None:
        return torch.stack(self.values).mean() if self.values else None

    def scale(self, fmt: str) -> torch.Tensor:
        if not self.values:
            raise ValueError("no batch was observed")
        return scale_from_amax(self.amax, fmt)


def make_observer(method: str, percentile: float = 99.99):
    """'max' -> AbsMaxObserver, 'percentile' -> PercentileObserver(percentile)."""
    if method == "max":
        return AbsMaxObserver()
    if method == "percentile":
        return PercentileObserver(percentile)
    raise ValueError(f"unknown calibration method {method!r}: choose max or percentile")


# ------------------------------------------------------------------------------ Triton kernels

# GPU arithmetic in the kernels: libdevice's correctly rounded operations (never contracted into FMAs)
# on the GPU; under the interpreter numpy's fp32 operations, which are correctly rounded already.
_GPU_MATH = tl.constexpr(not _INTERPRET)
# Widest row quantize_rows holds in one block (Swin's widest Linear input: 4C = 6144 for Swin-L's last
# stage); wider rows keep the torch ops.
MAX_QUANT_COLS = 16384
_TILE_ELEMS = 4096  # elements a program handles per tile (rows x columns)
# 1.5 * 2^23: v + this - this rounds |v| <= 2^22 to an integer, half to even (fp32 round to nearest)
_RINT_MAGIC = 12582912.0


def kernels_run(device: torch.device) -> bool:
    """Whether the Triton kernels run for tensors on `device`: a CUDA device, or any under TRITON_INTERPRET=1."""
    return device.type == "cuda" or _INTERPRET


@triton.jit
def _rint(v):
    """v rounded to an integer, half to even (torch.round). Under the interpreter by the magic-number
    addition, exact for |v| <= 2^22 (the callers clamp to +-127 first)."""
    if _GPU_MATH:
        out = tl.extra.cuda.libdevice.rint(v)
    else:
        out = (v + _RINT_MAGIC) - _RINT_MAGIC
    return out


@triton.jit
def _to_e4m3(q):
    """q (fp32, |q| <= 448 or NaN) to float8 e4m3fn, rounded to nearest even. On the GPU the hardware cast;
    under the interpreter by hand (its cast neither carries a rounded-up mantissa into the exponent nor
    rounds subnormals): round to the step of q's binade (2^(e-3), at least 2^-9) in fp32, then pack the bits."""
    if _GPU_MATH:
        out = q.to(tl.float8e4nv)
    else:
        u = q.to(tl.uint32, bitcast=True)
        sign = (u >> 31).to(tl.uint32) << 7
        e = ((u >> 23) & 0xFF).to(tl.int32) - 127
        step_exp = tl.maximum(e, -6) - 3
        step = ((step_exp + 127) << 23).to(tl.float32, bitcast=True)
        inv_step = ((127 - step_exp) << 23).to(tl.float32, bitcast=True)
        r = tl.abs(_rint(q * inv_step) * step)          # exact: scaling by powers of two
        ru = r.to(tl.uint32, bitcast=True)
        re = ((ru >> 23) & 0xFF).to(tl.int32) - 127
        normal = ((re + 7) << 3).to(tl.uint32) | ((ru >> 20) & 7)
        sub = (r * 512.0).to(tl.uint32)                 # r < 2^-6: a multiple of 2^-9, 0..7
        bits = tl.where(r >= 0.015625, normal, sub) | sign
        bits = tl.where(q != q, sign | 0x7F, bits)
        out = bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return out


@triton.jit
def _gelu_erf(x):
    """GELU with the exact erf, in fp32, as torch's CUDA kernel writes it: (0.5 x) (1 + erf(x / sqrt 2)).
    On the GPU erf is libdevice's erff, the one torch's kernel calls (tl.math.erf differs in the last bit
    in the tail, x < -3)."""
    if _GPU_MATH:
        e = tl.extra.cuda.libdevice.erf(x * 0.7071067811865476)
    else:
        e = tl.math.erf(x * 0.7071067811865476)
    return (0.5 * x) * (1.0 + e)


@triton.jit
def _quantize_rows_kernel(X, XQ, SCALE, n_rows, n_cols, qmax, inv_qmax, min_scale,
                          INT8: tl.constexpr, RECIPROCAL: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, GELU: tl.constexpr = False, SOFT_RTNE: tl.constexpr = False):
    """BLOCK_M whole rows per program, quantized per row (quantize_tile). GELU: x is first GELU(x) in
    fp32, rounded to X's dtype (what an nn.GELU in that dtype would have written)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        x = to_dtype(_gelu_erf(x), X.dtype.element_ty, SOFT_RTNE).to(tl.float32)
    xq, scale = quantize_tile(x, qmax, inv_qmax, min_scale, INT8, RECIPROCAL)
    tl.store(XQ + offs, xq, mask=mask)
    tl.store(SCALE + rows, scale, mask=row_mask)


@triton.jit
def quantize_tile(x, qmax, inv_qmax, min_scale, INT8: tl.constexpr, RECIPROCAL: tl.constexpr):
    """quantize_rows of a tile of whole rows x (rows, cols) in fp32, its padding columns 0 -> (x_q, scale
    (rows,) fp32): amax(|x|) per row (NaN where the row holds one, as torch's amax), scale = amax / qmax
    (times the fp32 reciprocal where RECIPROCAL, as torch's CUDA division by a scalar), at least
    min_scale, 1 where amax is 0; then x / scale correctly rounded, clamped to +-qmax (NaN kept), rounded
    half to even (INT8) or cast to e4m3 (round to nearest even). Kernels that produce a Linear's input
    call it to write that input quantized (quantize_args gives the scalars)."""
    amax = tl.max(tl.abs(x), axis=1)
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    amax = tl.where(has_nan, float("nan"), amax)
    if RECIPROCAL:
        scale = amax * inv_qmax
    elif _GPU_MATH:
        scale = tl.math.div_rn(amax, tl.full(amax.shape, qmax, tl.float32))
    else:
        scale = amax / qmax
    scale = tl.maximum(scale, min_scale, propagate_nan=tl.PropagateNan.ALL)
    scale = tl.where(amax == 0, 1.0, scale)
    return _divide_round(x, tl.broadcast_to(scale[:, None], x.shape), qmax, INT8), scale


@triton.jit
def quantize_static(x, SCALE, qmax, INT8: tl.constexpr):
    """A tile x (fp32) quantized at the static fp32 scale *SCALE: x times the scale's correctly rounded
    reciprocal, clamped and rounded as _divide_round does. One multiplication an element instead of a
    division; the product differs from the correctly rounded quotient by an fp32 ulp at most, which moves a
    value to the neighbouring step of the format only where the quotient lies that close to a rounding
    boundary."""
    if _GPU_MATH:
        inv_scale = tl.math.div_rn(1.0, tl.load(SCALE))
    else:
        inv_scale = 1.0 / tl.load(SCALE)
    return _round_to_format(x * inv_scale, qmax, INT8)


@triton.jit
def _divide_round(x, div, qmax, INT8: tl.constexpr):
    """x / div (both fp32, one shape) correctly rounded, clamped to +-qmax (NaN kept), rounded half to even
    (INT8) or cast to e4m3 (round to nearest even)."""
    if _GPU_MATH:
        q = tl.math.div_rn(x, div)
    else:
        q = x / div
    return _round_to_format(q, qmax, INT8)


@triton.jit
def _round_to_format(q, qmax, INT8: tl.constexpr):
    """q (fp32) clamped to +-qmax (NaN kept), rounded half to even (INT8) or cast to e4m3 (round to nearest
    even)."""
    q = tl.clamp(q, -qmax, qmax, propagate_nan=tl.PropagateNan.ALL)
    if INT8:
        xq = _rint(q).to(tl.int8)
    else:
        xq = _to_e4m3(q)
    return xq


def quantize_args(fmt: str, device: torch.device) -> dict:
    """The scalars and flags quantize_tile takes for `fmt` on `device`, as keyword arguments (qmax,
    inv_qmax, min_scale, INT8, RECIPROCAL): what quantize_rows passes its kernel."""
    _check_format(fmt)
    qmax = QMAX[fmt]
    # torch's CUDA kernels divide by a Python scalar as a multiplication by its fp32 reciprocal
    return dict(qmax=qmax, inv_qmax=float(np.float32(1.0) / np.float32(qmax)), min_scale=MIN_SCALE,
                INT8=fmt == "int8", RECIPROCAL=device.type == "cuda" or not _INTERPRET)


@triton.jit
def _epilogue(acc, rows, cols, row_mask, col_mask, XS, WS, B, ROW_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """((acc as fp32) * xs) * ws (+ bias as fp32), each product and sum rounded once to fp32: the math of
    _int8_dequant_kernel (and of int8_dequant_torch's separate ops)."""
    acc = acc.to(tl.float32)
    if ROW_SCALE:
        xs = tl.load(XS + rows, mask=row_mask, other=1.0)
    else:
        xs = tl.load(XS + tl.zeros([BLOCK_M], dtype=tl.int32))
    xs = tl.broadcast_to(xs[:, None], (BLOCK_M, BLOCK_N))
    ws = tl.broadcast_to(tl.load(WS + cols, mask=col_mask, other=1.0)[None, :], (BLOCK_M, BLOCK_N))
    if _GPU_MATH:
        out = tl.extra.cuda.libdevice.mul_rn(tl.extra.cuda.libdevice.mul_rn(acc, xs), ws)
    else:
        out = acc * xs * ws
    if HAS_BIAS:
        b = tl.broadcast_to(tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :], (BLOCK_M, BLOCK_N))
        if _GPU_MATH:
            out = tl.extra.cuda.libdevice.add_rn(out, b)
        else:
            out = out + b
    return out


@triton.jit
def _int8_dequant_kernel(ACC, XS, WS, B, OUT, n_rows, n_cols, ROW_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                         SOFT_RTNE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT = ((ACC as fp32) * xs) * ws (+ bias as fp32), each product and sum rounded once to fp32 (as
    torch's separate ops), rounded to OUT's dtype. xs: XS[row] (ROW_SCALE) or XS[0]; ws: WS[col]."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    acc = tl.load(ACC + offs, mask=mask, other=0)
    out = _epilogue(acc, rows, cols, row_mask, col_mask, XS, WS, B, ROW_SCALE, HAS_BIAS, BLOCK_M, BLOCK_N)
    tl.store(OUT + offs, to_dtype(out, OUT.dtype.element_ty, SOFT_RTNE), mask=mask)


def _tile(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for whole rows of n_cols elements."""
    block_n = next_pow2(max(1, n_cols))
    block_m = max(1, min(64, _TILE_ELEMS // block_n))
    return block_m, block_n, min(16, max(4, block_m * block_n // 512))


def quantize_rows_torch(x2: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """What quantize_rows computes, in torch ops: (quantize(x2, s, fmt), s), s = absmax_scale per row."""
    scale = absmax_scale(x2, fmt, dim=-1, check=False)
    return quantize(x2, scale, fmt), scale


def _scales_for(n_rows: int, n_cols: int, x_scale, w_scale, bias, what: str):
    """The epilogue's operands as the kernels index them (row i of x_scale at i, column j of w_scale and
    bias at j): shapes checked (ValueError), strided views copied (they are M or N values)."""
    if x_scale.numel() not in (1, n_rows) or w_scale.numel() != n_cols or (bias is not None and bias.numel() != n_cols):
        raise ValueError(f"{what}: x_scale must hold 1 or {n_rows} values, w_scale and bias {n_cols}; got "
                         f"{tuple(x_scale.shape)}, {tuple(w_scale.shape)}, "
                         f"{None if bias is None else tuple(bias.shape)}")
    return x_scale.contiguous(), w_scale.contiguous(), None if bias is None else bias.contiguous()


def int8_dequant_torch(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """What int8_dequant computes, in torch ops (full-size fp32 passes)."""
    out = acc.float() * x_scale * w_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(torch.bfloat16)


@kernel_op("swinbench::quantize_rows")
def quantize_rows(x2: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q, x_scale) = quantize(x2, s, fmt), s = absmax_scale(x2, fmt, dim=-1, check=False), in one launch
    and bit for bit: x2 (M, K) fp32/fp16/bf16 contiguous, K <= MAX_QUANT_COLS -> x_q (M, K) e4m3fn or
    int8, x_scale (M, 1) fp32. No host sync."""
    return _quantize_rows(x2, fmt, gelu=False)


def _quantize_rows(x2: torch.Tensor, fmt: str, gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows (gelu False) and gelu_quantize_rows (True): one launch of _quantize_rows_kernel."""
    _check_format(fmt)
    x2 = x2.contiguous()
    n_rows, n_cols = x2.shape
    if n_cols > MAX_QUANT_COLS:
        raise ValueError(f"{'gelu_' if gelu else ''}quantize_rows: K={n_cols} is wider than "
                         f"MAX_QUANT_COLS={MAX_QUANT_COLS}")
    x_q = _common.new_output((n_rows, n_cols), QDTYPE[fmt], x2.device)
    scale = _common.new_output((n_rows, 1), torch.float32, x2.device)
    if n_rows > 0:
        block_m, block_n, num_warps = _tile(n_cols)
        q = quantize_args(fmt, x2.device)
        launch(_quantize_rows_kernel)[(cdiv(n_rows, block_m),)](
            x2, x_q, scale, n_rows, n_cols, q["qmax"], q["inv_qmax"], q["min_scale"], INT8=q["INT8"],
            RECIPROCAL=q["RECIPROCAL"], BLOCK_M=block_m, BLOCK_N=block_n, GELU=gelu, SOFT_RTNE=SOFT_RTNE,
            num_warps=num_warps)
    return x_q, scale


@quantize_rows.register_fake
def _(x2, fmt):
    return x2.new_empty(x2.shape, dtype=QDTYPE[fmt]), x2.new_empty((x2.shape[0], 1), dtype=torch.float32)


def gelu_quantize_rows_torch(h2: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """What gelu_quantize_rows computes, in torch ops: quantize_rows_torch of GELU(h2) in h2's dtype."""
    return quantize_rows_torch(torch.nn.functional.gelu(h2), fmt)


@kernel_op("swinbench::gelu_quantize_rows")
def gelu_quantize_rows(h2: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows(GELU(h2), fmt) in one launch, GELU (exact erf) written to h2's dtype first as an
    nn.GELU would: the MLP's activation fused with fc2's input quantization. h2 (M, K) bf16/fp16/fp32
    contiguous, K <= MAX_QUANT_COLS -> (x_q (M, K), x_scale (M, 1) fp32). No host sync. The bits of nn.GELU
    then quantize_rows but for rare values in GELU's tail (x < -3, where 1 + erf(x / sqrt 2) cancels, so
    erf's last bit decides GELU's bf16 rounding): libdevice's erff and the one torch's CUDA kernel calls
    (and numpy's under the interpreter) differ there, and such a value lands one quantization step away
    (on an H200, 65 of 25.7 million fp8 values; none of int8's, whose step is coarser)."""
    return _quantize_rows(h2, fmt, gelu=True)


@gelu_quantize_rows.register_fake
def _(h2, fmt):
    return h2.new_empty(h2.shape, dtype=QDTYPE[fmt]), h2.new_empty((h2.shape[0], 1), dtype=torch.float32)


@kernel_op("swinbench::int8_dequant")
def int8_dequant(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                 bias: Optional[torch.Tensor]) -> torch.Tensor:
    """(acc.float() * x_scale * w_scale [+ bias.float()]).to(bf16) in one launch and bit for bit: acc (M, N)
    int32 contiguous, x_scale (M, 1) or () fp32, w_scale (1, N) fp32, bias (N,) or None."""
    n_rows, n_cols = acc.shape
    x_scale, w_scale, bias = _scales_for(n_rows, n_cols, x_scale, w_scale, bias, "int8_dequant")
    acc = acc.contiguous()
    out = _common.new_output((n_rows, n_cols), torch.bfloat16, acc.device)
    if n_rows > 0 and n_cols > 0:
        block_n = min(256, next_pow2(n_cols))
        block_m = max(1, min(64, _TILE_ELEMS // block_n))
        launch(_int8_dequant_kernel)[(cdiv(n_rows, block_m), cdiv(n_cols, block_n))](
            acc, x_scale, w_scale, bias if bias is not None else w_scale, out, n_rows, n_cols,
            ROW_SCALE=x_scale.numel() != 1, HAS_BIAS=bias is not None,
            SOFT_RTNE=SOFT_RTNE, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=8)
    return out


@int8_dequant.register_fake
def _(acc, x_scale, w_scale, bias):
    return acc.new_empty(acc.shape, dtype=torch.bfloat16)


# ------------------------------------------------------------------------------ quantized GEMMs


@triton.jit
def _gelu_tanh(x):
    """GELU in its tanh form, in fp32: (0.5 x) (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), what
    nn.GELU(approximate='tanh') computes and cuBLASLt's GELU epilogue applies (dense's fused fc1 in
    inference). On the GPU tanh is the hardware's tanh.approx.f32 (one special-function instruction; its
    absolute error, about 2^-11, gives GELU an absolute error of about 2^-12 |x|, below the bf16 step at x
    itself); under the interpreter the same function as x / (1 + exp(-2u)), exact to a few fp32 ulps."""
    u = x * (0.7978845608028654 + 0.0356774081363001 * (x * x))
    if _GPU_MATH:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [u], dtype=tl.float32, is_pure=True,
                                      pack=1)
        y = (0.5 * x) * (1.0 + t)
    else:
        y = x / (1.0 + tl.exp(tl.minimum(-2.0 * u, 88.0)))
    return y


@triton.jit
def _tile_position(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The (row, column) tile of the (M, N) output that program-tile `tile` computes: tiles walked in groups
    of GROUP_M rows of tiles, so that the A rows and W columns a group reads stay in L2."""
    grid_m = tl.cdiv(M, BLOCK_M)
    width = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (tile // width) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    return first_m + (tile % width) % size_m, (tile % width) // size_m


@triton.jit
def _qmm_output(acc, rows, cols, M, N, XS, WS, B, OS, qmax, ROW_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                INT8: tl.constexpr, SOFT_RTNE: tl.constexpr, GELU: tl.constexpr, OUT_Q: tl.constexpr,
                OUT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The quantized GEMMs' epilogue on an accumulator tile: the scales and the bias (_epilogue), then, in
    fp32, GELU (the tanh form) where asked, then either one rounding to OUT_DTYPE or, OUT_Q, quantization
    to the operands' format at the static scale *OS (quantize_static, by its reciprocal). As a GEMM with a
    fused activation computes it (cuBLASLt's GELU epilogue): no bf16 rounding between the Linear and the
    GELU. -> the tile as written, in OUT_DTYPE."""
    out = _epilogue(acc, rows, cols, rows < M, cols < N, XS, WS, B, ROW_SCALE, HAS_BIAS, BLOCK_M, BLOCK_N)
    if GELU:
        out = _gelu_tanh(out)
    if OUT_Q:
        y = quantize_static(out, OS, qmax, INT8)
    else:
        y = to_dtype(out, OUT_DTYPE, SOFT_RTNE)
    return y


@triton.jit
def _quant_matmul_kernel(A, W, XS, WS, B, OUT, OS, M, N, K, s_am, s_wn, qmax, ROW_SCALE: tl.constexpr,
                         HAS_BIAS: tl.constexpr, INT8: tl.constexpr, EVEN_K: tl.constexpr, SOFT_RTNE: tl.constexpr,
                         GELU: tl.constexpr, OUT_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """OUT (M, N) = epilogue(A (M, K) @ W (N, K)^T) (_qmm_output), one output tile per program, operands
    through pointers: int8 operands accumulate exactly in int32, e4m3 ones in fp32. The interpreter's GEMM,
    and the GPU's where the TMA kernel does not apply (torch.compile's trace, a GPU before Hopper, rows not
    16-byte aligned)."""
    pid_m, pid_n = _tile_position(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # rows and columns past the edge read a valid one (their results are not stored): no load masks
    a_ptr = A + (rows % M).to(tl.int64)[:, None] * s_am + ks[None, :]
    w_ptr = W + (cols % N).to(tl.int64)[None, :] * s_wn + ks[:, None]
    if INT8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptr)
            w = tl.load(w_ptr)
        else:   # the K tail: zeros past K (an int8 0; an e4m3 0.0, whose bits are those of int8's 0)
            zero = 0 if INT8 else 0.0
            a = tl.load(a_ptr, mask=ks[None, :] < K - k0, other=zero)
            w = tl.load(w_ptr, mask=ks[:, None] < K - k0, other=zero)
        if INT8:
            acc = tl.dot(a, w, acc=acc, out_dtype=tl.int32)
        else:   # e4m3 (bytes under the interpreter: the bitcast); each BLOCK_K step's products are summed
            # by the tensor cores (whose e4m3 accumulation on sm_90 keeps fewer bits than fp32) and added to
            # the fp32 accumulator here, so no more than 128 products ever share the narrow accumulation
            acc += tl.dot(a.to(tl.float8e4nv, bitcast=True), w.to(tl.float8e4nv, bitcast=True))
        a_ptr += BLOCK_K
        w_ptr += BLOCK_K
    y = _qmm_output(acc, rows, cols, M, N, XS, WS, B, OS, qmax, ROW_SCALE, HAS_BIAS, INT8, SOFT_RTNE, GELU, OUT_Q,
                    OUT.dtype.element_ty, BLOCK_M, BLOCK_N)
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(OUT + offs, y, mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def _quant_matmul_tma_kernel(a_desc, w_desc, o_desc, XS, WS, B, OS, M, N, K, qmax, ROW_SCALE: tl.constexpr,
                             HAS_BIAS: tl.constexpr, INT8: tl.constexpr, SOFT_RTNE: tl.constexpr, GELU: tl.constexpr,
                             OUT_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr,
                             PROMOTE: tl.constexpr):
    """_quant_matmul_kernel's GEMM for Hopper: operands and output through TMA descriptors (a_desc (M, K),
    w_desc (N, K), o_desc (M, N); blocks past an edge load zeros and store nothing, so K needs no masked
    tail), PROGRAMS persistent programs walking the output tiles (the next tile's loads overlap this one's
    epilogue), the accumulator kept in the tensor cores' registers across K. e4m3: the tensor cores' own
    accumulation on sm_90 keeps fewer bits than fp32; PROMOTE adds each K step's sum into an fp32
    accumulator instead."""
    out_dtype: tl.constexpr = o_desc.dtype
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_position(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        if INT8:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
            w = w_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
            if INT8:
                acc = tl.dot(a, w.T, acc, out_dtype=tl.int32)
            elif PROMOTE:
                acc += tl.dot(a, w.T)
            else:
                acc = tl.dot(a, w.T, acc)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        y = _qmm_output(acc, rows, cols, M, N, XS, WS, B, OS, qmax, ROW_SCALE, HAS_BIAS, INT8, SOFT_RTNE, GELU,
                        OUT_Q, out_dtype, BLOCK_M, BLOCK_N)
        o_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], y)


# Tiles of the pointer kernel (BLOCK_K 128 in every config: one 128-byte row of each operand per step, and
# the host knows whether K needs the masked tail); the autotuner picks per (M, N, K) in the first calls (a
# stage's warm-up), before any graph capture.
_QMM_BLOCK_K = 128
_QMM_CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": _QMM_BLOCK_K, "GROUP_M": 8}, num_warps=nw,
                              num_stages=ns)
                for bm, bn, nw, ns in ((128, 256, 8, 3), (128, 128, 8, 4), (128, 128, 4, 4), (64, 128, 4, 4),
                                       (128, 64, 4, 4), (64, 64, 4, 5), (256, 128, 8, 3))]
_QMM_INTERPRET_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2}
_QMM_KEY = ["M", "N", "K", "GELU", "OUT_Q"]


def _qmm_bench(fn, quantiles=None):
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


if _INTERPRET:
    _qmm = _quant_matmul_kernel
elif not _common.AUTOTUNE:
    _qmm = triton.autotune(_QMM_CONFIGS[:1], key=_QMM_KEY)(_quant_matmul_kernel)
else:
    _qmm = triton.autotune(_QMM_CONFIGS, key=_QMM_KEY, do_bench=_qmm_bench)(_quant_matmul_kernel)

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:     # a Triton without host-side TMA descriptors: the pointer kernel everywhere
    TensorDescriptor = None

# The TMA kernel's tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), the first the default. Its descriptors
# carry the block shape, so the host chooses the config itself (_gemm_config: timing each, and the pointer
# kernel, on a shape's first eager call, outside graph capture, as the autotuner would) and builds the
# descriptors for it.
TMA_CONFIGS = ((128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 256, 128, 8, 3), (128, 256, 64, 8, 4),
               (128, 64, 128, 4, 4), (64, 128, 128, 4, 4))
TMA_INTERPRET_CONFIG = (32, 32, 32, 4, 1)
# e4m3: True adds each K step's sum into an fp32 accumulator (as the pointer kernel does); False (measured
# 20-30% faster on an H100) keeps the whole K in the tensor cores' accumulator (see the kernel)
TMA_PROMOTE = False
# Whether the GEMMs may take the TMA kernel: None on Hopper GPUs where it times faster than the pointer
# kernel, never under the interpreter; True wherever it applies, the interpreter included; False nowhere
# (tests and benchmarks set it to compare the two kernels)
USE_TMA: bool | None = None
_TMA_CHOSEN: dict = {}


@_common.host_cache
def _hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def _tma_applies(x_q: torch.Tensor, w_q: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether _quant_matmul_tma_kernel runs this GEMM: eager (not torch.compile's trace), a Hopper or newer
    GPU (or the interpreter where USE_TMA asks), each operand's rows 16-byte aligned as TMA requires, K at
    least 32 (the tensor cores' K step for 1-byte operands)."""
    if TensorDescriptor is None or _common.tracing() or USE_TMA is False:
        return False
    if _INTERPRET:
        if not USE_TMA:
            return False
    elif not (x_q.is_cuda and _hopper(x_q.device)):
        return False
    return x_q.shape[1] >= 32 and all(t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
                                      and t.data_ptr() % 16 == 0 for t in (x_q, w_q, out))


def _quant_matmul_tma(x_q, x_scale, w_q, w_scale, bias, out, out_scale, gelu: bool, cfg):
    """One launch of _quant_matmul_tma_kernel at `cfg` (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)."""
    n_rows, k = x_q.shape
    n_cols = w_q.shape[0]
    int8 = x_q.dtype == torch.int8
    bm, bn, bk, warps, stages = cfg
    bk = min(bk, max(16, next_pow2(k)))
    programs = min(cdiv(n_rows, bm) * cdiv(n_cols, bn), sm_count(x_q.device))
    _quant_matmul_tma_kernel[(programs,)](
        TensorDescriptor.from_tensor(x_q, [bm, bk]), TensorDescriptor.from_tensor(w_q, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]), x_scale, w_scale, bias if bias is not None else w_scale,
        out_scale if out_scale is not None else w_scale, n_rows, n_cols, k, QMAX["int8" if int8 else "fp8"],
        ROW_SCALE=x_scale.numel() != 1, HAS_BIAS=bias is not None, INT8=int8, SOFT_RTNE=SOFT_RTNE, GELU=gelu,
        OUT_Q=out_scale is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, PROGRAMS=programs,
        PROMOTE=TMA_PROMOTE and not int8, num_warps=warps, num_stages=stages)
    return out


def _quant_matmul_pointer(x_q, x_scale, w_q, w_scale, bias, out, out_scale, gelu: bool):
    """One launch of _quant_matmul_kernel (autotuned per (M, N, K))."""
    n_rows, k = x_q.shape
    n_cols = w_q.shape[0]
    int8 = x_q.dtype == torch.int8
    extra = dict(_QMM_INTERPRET_CONFIG) if _INTERPRET else {}
    grid = lambda meta: (cdiv(n_rows, meta["BLOCK_M"]) * cdiv(n_cols, meta["BLOCK_N"]),)  # noqa: E731
    # e4m3 goes in as itself (its loads feed the tensor cores straight from shared memory); the
    # interpreter reads it as bytes (uint8 views), bitcast back in the kernel
    bytes_ = _INTERPRET and not int8
    launch(_qmm)[grid](
        x_q.view(torch.uint8) if bytes_ else x_q, w_q.view(torch.uint8) if bytes_ else w_q, x_scale, w_scale,
        bias if bias is not None else w_scale, out, out_scale if out_scale is not None else w_scale,
        n_rows, n_cols, k, x_q.stride(0), w_q.stride(0), QMAX["int8" if int8 else "fp8"],
        ROW_SCALE=x_scale.numel() != 1, HAS_BIAS=bias is not None, INT8=int8,
        EVEN_K=k % (extra["BLOCK_K"] if _INTERPRET else _QMM_BLOCK_K) == 0, SOFT_RTNE=SOFT_RTNE,
        GELU=gelu, OUT_Q=out_scale is not None, **extra)
    return out


def _gemm_config(args) -> tuple | None:
    """The kernel and tiles for a GEMM the TMA kernel can take: a TMA_CONFIGS entry, or None for the pointer
    kernel. Timed over all of them (graph-replayed) on a shape's first eager call (a config that fails to
    compile or does not fit the GPU's shared memory skipped), so that the TMA kernel runs only where it is
    the faster (USE_TMA True: the TMA configs alone); the first TMA config under the interpreter, with
    autotuning off, or while a CUDA graph is being captured."""
    x_q, x_scale, w_q, _, bias, _, out_scale, gelu = args
    key = (*x_q.shape, w_q.shape[0], x_q.dtype, gelu, out_scale is not None, x_scale.numel() != 1, bias is not None,
           USE_TMA)
    if key in _TMA_CHOSEN:
        return _TMA_CHOSEN[key]
    if _INTERPRET:
        return TMA_INTERPRET_CONFIG
    if not _common.AUTOTUNE or torch.cuda.is_current_stream_capturing():
        return TMA_CONFIGS[0]
    # GPU time graph-replayed, as the stages run (an eager launch of the TMA kernel costs the host more than
    # a cached one of the pointer kernel: that must not decide)
    times = {} if USE_TMA else {None: _common.cuda_graph_us([lambda: _quant_matmul_pointer(*args)], replays=5,
                                                            calls=8)[0]}
    for cfg in TMA_CONFIGS:
        try:
            times[cfg] = _common.cuda_graph_us([lambda: _quant_matmul_tma(*args, cfg=cfg)], replays=5, calls=8)[0]
        except Exception:   # noqa: BLE001  (a config that does not fit this GPU)
            continue
    chosen = _TMA_CHOSEN[key] = min(times, key=times.get)
    return chosen


@kernel_op("swinbench::quant_matmul")
def quant_matmul(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                 bias: Optional[torch.Tensor]) -> torch.Tensor:
    """(x_q @ w_q^T) * x_scale * w_scale (+ bias) in one Triton GEMM, bf16 out: the scales and the bias
    applied to the accumulator before it leaves the registers, so the (M, N) result is written once, in
    bf16 (int8_linear writes an int32 accumulator and reads it back; fp8_linear's _scaled_mm applies its
    epilogue too). x_q (M, K) int8 or e4m3fn, rows contiguous; x_scale (M, 1) or () fp32; w_q (N, K) of
    x_q's dtype, rows contiguous; w_scale (1, N) fp32; bias (N,) or None. int8 gives int8_linear's bits
    (the same exact int32 sums, the same fp32 epilogue); e4m3 sums in fp32 in its own order. On Hopper
    (eager) the persistent TMA kernel, else the pointer kernel. No host sync."""
    return _quant_matmul(x_q, x_scale, w_q, w_scale, bias, False, None)


@quant_matmul.register_fake
def _(x_q, x_scale, w_q, w_scale, bias):
    return x_q.new_empty((x_q.shape[0], w_q.shape[0]), dtype=torch.bfloat16)


@kernel_op("swinbench::quant_matmul_act")
def quant_matmul_act(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                     bias: Optional[torch.Tensor], gelu: bool, out_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """quant_matmul with an MLP's activation and the next Linear's input quantization in its epilogue: the
    Linear's result in fp32, then its GELU in the tanh form where `gelu` (nn.GELU(approximate='tanh'): the
    GELU dense's cuBLASLt epilogue applies in inference; no bf16 rounding in between, as there), then one
    rounding: to bf16, or, where `out_scale` (a () fp32 static scale) is given, to x_q's format at that
    scale (quantize's clamping and rounding of y times the scale's fp32 reciprocal) -> (M, N) bf16, or
    e4m3fn / int8 with out_scale. One launch: the (M, N) activation is written once, in one byte a value
    where it is quantized. No host sync."""
    return _quant_matmul(x_q, x_scale, w_q, w_scale, bias, gelu, out_scale)


@quant_matmul_act.register_fake
def _(x_q, x_scale, w_q, w_scale, bias, gelu, out_scale):
    return x_q.new_empty((x_q.shape[0], w_q.shape[0]), dtype=torch.bfloat16 if out_scale is None else x_q.dtype)


def _quant_matmul(x_q, x_scale, w_q, w_scale, bias, gelu: bool, out_scale):
    """quant_matmul (gelu False, out_scale None) and quant_matmul_act: one launch of a Triton GEMM."""
    n_rows, k = x_q.shape
    n_cols = w_q.shape[0]
    x_scale, w_scale, bias = _scales_for(n_rows, n_cols, x_scale, w_scale, bias, "quant_matmul")
    if w_q.dim() != 2 or w_q.shape[1] != k or w_q.dtype != x_q.dtype:
        raise ValueError(f"quant_matmul: w_q must be (N, {k}) {x_q.dtype} like x_q's K, got {tuple(w_q.shape)} "
                         f"{w_q.dtype}")
    if out_scale is not None and (out_scale.numel() != 1 or out_scale.dtype != torch.float32):
        raise ValueError(f"quant_matmul: out_scale must be one fp32 value, got {tuple(out_scale.shape)} "
                         f"{out_scale.dtype}")
    if x_q.stride(1) != 1 or w_q.stride(1) != 1:      # the kernels walk each row's K elements one apart
        x_q, w_q = x_q.contiguous(), w_q.contiguous()
    int8 = x_q.dtype == torch.int8
    out_dtype = torch.bfloat16 if out_scale is None else x_q.dtype
    out = _common.new_output((n_rows, n_cols), out_dtype, x_q.device)
    if n_rows == 0 or n_cols == 0:
        return out
    args = (x_q, x_scale, w_q, w_scale, bias, out, out_scale, gelu)
    cfg = _gemm_config(args) if _tma_applies(x_q, w_q, out) else None
    if cfg is not None:
        return _quant_matmul_tma(*args, cfg=cfg)
    return _quant_matmul_pointer(*args)


def fp8_linear(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """(x_q * x_scale) @ (w_q * w_scale)^T + bias in one torch._scaled_mm, bf16 out.
    x_q (M, K) e4m3fn row-major; x_scale (M, 1) fp32 (rowwise); w_q (N, K) e4m3fn contiguous, so that
    w_q.t() is the column-major (K, N) second operand _scaled_mm requires; w_scale (1, N) fp32; bias (N,)
    bf16 or None. On CUDA, K and N must be multiples of 16 (the pass checks before choosing this route)."""
    return torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale, bias=bias, out_dtype=torch.bfloat16)


INT8_MIN_ROWS = 17  # torch._int_mm on CUDA needs more than 16 rows in its first operand


def int8_linear(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """(x_q @ w_q^T) in int32 by torch._int_mm, then * x_scale * w_scale (+ bias) in fp32, bf16 out.
    x_q (M, K) int8; x_scale (M, 1) or () fp32; w_q (N, K) int8 contiguous (w_q.t() is the column-major
    second operand); w_scale (1, N) fp32; bias (N,) or None. On CUDA, K and N must be multiples of 8; a
    batch of at most 16 rows is padded with zero rows to 17 (its extra outputs dropped). Where the kernels
    run (`kernels_run`) the epilogue is one `int8_dequant` launch (the same bits)."""
    M = x_q.shape[0]
    if M < INT8_MIN_ROWS:
        x_q = torch.nn.functional.pad(x_q, (0, 0, 0, INT8_MIN_ROWS - M))
    acc = torch._int_mm(x_q, w_q.t())[:M]
    if kernels_run(acc.device) and not torch.compiler.is_compiling():
        return int8_dequant(acc, x_scale, w_scale, bias)
    return int8_dequant_torch(acc, x_scale, w_scale, bias)


# ------------------------------------------------------------------------------ the module

ROUTES = ("scaled_mm", "int_mm", "triton", "simulate")


class QuantizedRows:
    """A Linear's input that its producer wrote quantized per row (a norm kernel: window.
    norm_shift_partition_quant): x_q (rows, K) e4m3fn or int8 and scale (rows, 1) fp32, as quantize_rows
    writes them, standing for a float tensor of `shape` and `dtype` (the dtype the producer rounded to
    before quantizing). It goes where that tensor would, up to the QuantLinear that reads it
    (QuantLinear.forward): `shape`, `dtype`, `device`, `numel` and `reshape` as the tensor's. Inference only."""

    __slots__ = ("x_q", "scale", "shape", "dtype")

    def __init__(self, x_q: torch.Tensor, scale: torch.Tensor, shape, dtype: torch.dtype):
        self.x_q, self.scale, self.shape, self.dtype = x_q, scale, torch.Size(shape), dtype

    @property
    def device(self) -> torch.device:
        return self.x_q.device

    def numel(self) -> int:
        return self.x_q.numel()

    def reshape(self, *shape) -> "QuantizedRows":
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
        if -1 in shape:
            known = math.prod(n for n in shape if n != -1)
            shape = tuple(self.x_q.numel() // known if n == -1 else n for n in shape)
        if math.prod(shape) != self.x_q.numel() or shape[-1] != self.shape[-1]:
            raise ValueError(f"QuantizedRows of shape {tuple(self.shape)} cannot be reshaped to {shape}: its rows stay rows")
        return QuantizedRows(self.x_q, self.scale, shape, self.dtype)


class QuantLinear(torch.nn.Module):
    """An inference-only nn.Linear with its weight quantized per output channel and its input quantized per
    row (dynamic: `input_scale` None) or per tensor (static: a calibrated () scale), run by one route:

        scaled_mm  FP8 e4m3 GEMM, torch._scaled_mm with rowwise scales (CUDA, capability >= 8.9)
        int_mm     INT8 GEMM, torch._int_mm in int32, the scales applied after (CUDA)
        triton     either format on quant_matmul: one Triton GEMM with the scales and the bias in its
                   epilogue, bf16 written once (where the kernels run)
        simulate   the same quantize-dequantize math, then an fp32 F.linear (fake quantization, any device)

    x (..., in_features) in any float dtype -> (..., out_features) in the autocast dtype where autocast is
    on (what nn.Linear would give), else in x's dtype. The float weight is not kept (no `weight`
    attribute: code that would read it fails instead of computing in bf16 behind the quantization).
    Where the Triton kernels run (`kernels_run`), the GEMM routes quantize a dynamic input with one
    `quantize_rows` launch and int_mm applies its scales with one `int8_dequant` launch (the torch ops'
    bits); extra_repr says which implementation a module runs. Under torch.compile both are torch ops
    instead, which Inductor fuses into the kernels that produce the input and consume the output (the
    LayerNorm, the GELU, the residual add): one opaque launch would stop that fusion."""

    def __init__(self, linear: torch.nn.Linear, fmt: str, route: str, input_scale: torch.Tensor | None = None):
        super().__init__()
        _check_format(fmt)
        if route not in ROUTES:
            raise ValueError(f"unknown route {route!r}: choose from {', '.join(ROUTES)}")
        self.fmt, self.route = fmt, route
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        w_scale = absmax_scale(w, fmt, dim=-1)                          # (N, 1), refuses inf/NaN weights
        w_q = quantize(w, w_scale, fmt).contiguous()
        if route == "simulate":
            self.register_buffer("weight_dq", dequantize(w_q, w_scale))   # fp32 (N, K)
        else:
            self.register_buffer("weight_q", w_q)
        self.register_buffer("weight_scale", w_scale.reshape(1, -1).contiguous())   # (1, N)
        bias = linear.bias.detach() if linear.bias is not None else None
        # _scaled_mm adds a bf16 bias in its epilogue, int8 adds it in fp32 (quant_matmul takes either
        # and adds it in fp32); simulate rounds it as its format's GEMM route would
        self.register_buffer("bias", None if bias is None else
                             bias.to(torch.bfloat16 if fmt == "fp8" else torch.float32))
        self.register_buffer("input_scale", None if input_scale is None else input_scale.detach().float().reshape(()))
        self.gelu = False
        self.register_buffer("output_scale", None)

    def fuse_output(self, gelu: bool, output_scale: torch.Tensor | None = None) -> None:
        """Make this layer an MLP's fc1 that runs its activation, and fc2's input quantization, itself: the
        forward then gives GELU(linear(x)) (the tanh form, rounded to bf16: nn.GELU(approximate='tanh') after
        the Linear, the GELU dense's cuBLASLt epilogue computes in inference), and with
        output_scale (the next QuantLinear's static () input scale) hands that on quantized at it, as a
        QuantizedRows the next layer reads. Where the kernels run (eager) both happen in the GEMM's epilogue
        (quant_matmul_act: the triton route only); under torch.compile, on the simulate route or where the
        kernels do not run, the GELU is torch's and the output stays bf16 (the next layer quantizes it)."""
        if (gelu or output_scale is not None) and self.route not in ("triton", "simulate"):
            raise ValueError(f"fuse_output: the {self.route} route has no epilogue of ours; use route='triton'")
        self.gelu = bool(gelu)
        self.output_scale = None if output_scale is None else output_scale.detach().float().reshape(()).to(
            self.weight_scale.device)

    def _apply(self, fn, recurse=True):
        """Module.to / .half() / .cuda(): the buffers move, and keep their dtypes (a cast would turn the e4m3
        weight into bf16 values the GEMM then reads as e4m3 bits, and round the scales)."""
        kept = {name: b for name, b in self._buffers.items() if b is not None}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after.dtype != before.dtype:     # the values as they were, on the device the call chose
                self._buffers[name] = before.to(after.device)
        return self

    def fused_quantize(self, device: torch.device) -> bool:
        """Whether a forward on `device` quantizes its input with `quantize_rows` (one Triton launch)
        rather than torch ops: a GEMM route, dynamic activations, kernels running there, K in one block."""
        return (self.route != "simulate" and self.input_scale is None and kernels_run(device)
                and self.in_features <= MAX_QUANT_COLS and not torch.compiler.is_compiling())

    def extra_repr(self) -> str:
        acts = "dynamic per-row" if self.input_scale is None else "static per-tensor"
        device = self.weight_scale.device
        how = "quantized by torch ops"
        if self.fused_quantize(device):
            how = "quantized by one Triton launch (quantize_rows)"
        text = (f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}, route={self.route}, "
                f"activations {acts}")
        if self.route != "simulate":
            text += f", {how}"
            if self.route == "int_mm" and kernels_run(device):
                text += ", int8 epilogue by one Triton launch (int8_dequant)"
            if self.route == "triton":
                text += ", GEMM and epilogue by one Triton launch (quant_matmul)"
        if self.gelu:
            text += ", then GELU" + (" in the epilogue" if self.epilogue_fused(device) else "")
        if self.output_scale is not None:
            text += (", output quantized at the next layer's static scale"
                     + (" in the epilogue" if self.epilogue_fused(device) else " (by the next layer)"))
        return text

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor | QuantizedRows:
        if isinstance(x, QuantizedRows):    # quantized by its producer, in this module's format and scaling
            static = self.input_scale is not None
            if x.x_q.dtype != QDTYPE[self.fmt] or static != (x.scale.numel() == 1 and x.scale.dim() == 0):
                raise ValueError(f"{self.fmt} QuantLinear with {'static' if static else 'dynamic'} activations given "
                                 f"{'a tensor' if x.scale.dim() == 0 else 'rows'} quantized to {x.x_q.dtype}")
            return self.forward_quantized(x.x_q.view(-1, self.in_features), x.scale, x.shape[:-1], x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        fused = self.fused_quantize(x2.device)
        if fused:
            x_q, x_scale = quantize_rows(x2, self.fmt)
        elif self.input_scale is None:
            x_q, x_scale = None, absmax_scale(x2, self.fmt, dim=-1, check=False)
        else:
            x_q, x_scale = None, self.input_scale
        return self._matmul(x2, x_q, x_scale, lead, x.dtype, x.device.type)

    def forward_quantized(self, x_q: torch.Tensor, x_scale: torch.Tensor, lead, like) -> torch.Tensor | QuantizedRows:
        """The GEMM on an input already quantized (x_q (M, K); x_scale (M, 1) per row, as quantize_rows
        writes them, or () at this layer's static scale; a GEMM route only): (*lead, out_features) in the
        dtype forward would give for `like` (a tensor or QuantizedRows)."""
        if self.route == "simulate":
            raise ValueError("forward_quantized: the simulate route takes the float input (forward)")
        return self._matmul(None, x_q, x_scale, lead, like.dtype, like.device.type)

    def epilogue_fused(self, device: torch.device) -> bool:
        """Whether a forward on `device` runs this layer's GELU / output quantization (fuse_output) in its
        GEMM's epilogue (quant_matmul_act)."""
        return (self.route == "triton" and (self.gelu or self.output_scale is not None) and kernels_run(device)
                and not torch.compiler.is_compiling())

    def _matmul(self, x2, x_q, x_scale, lead, in_dtype, device_type):
        """The rest of forward: x2 (or x_q, quantized already) at x_scale through the route."""
        M = (x2 if x2 is not None else x_q).shape[0]
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else in_dtype
        fused = x_q is not None
        epilogue = self.epilogue_fused((x2 if x2 is not None else x_q).device)
        if self.route == "simulate":
            with torch.autocast(device_type, enabled=False):
                bias = None if self.bias is None else self.bias.float()
                out = torch.nn.functional.linear(fake_quantize(x2, x_scale, self.fmt), self.weight_dq, bias)
            # the GPU routes write bf16
            out = out.to(torch.bfloat16)
        else:
            if not fused:
                x_q = quantize(x2, x_scale, self.fmt).contiguous()    # the GEMMs read rows of stride 1
            if self.route == "triton":
                scale = x_scale if x_scale.dim() == 2 else x_scale.reshape(())
                if epilogue:    # GELU and the output's quantization in the GEMM's epilogue (fuse_output)
                    out = quant_matmul_act(x_q, scale, self.weight_q, self.weight_scale, self.bias, self.gelu,
                                           self.output_scale)
                    if self.output_scale is not None:
                        return QuantizedRows(out, self.output_scale, (*lead, self.out_features), torch.bfloat16)
                else:
                    out = quant_matmul(x_q, scale, self.weight_q, self.weight_scale, self.bias)
            elif self.route == "scaled_mm":
                # rowwise scaling takes an (M, 1) scale for the first operand: a static one is repeated
                rows = x_scale if x_scale.dim() == 2 else x_scale.reshape(1, 1).expand(M, 1).contiguous()
                out = fp8_linear(x_q, rows, self.weight_q, self.weight_scale, self.bias)
            else:
                out = int8_linear(x_q, x_scale, self.weight_q, self.weight_scale, self.bias)
        if self.gelu and not epilogue:     # the tanh-form GELU on the layer's bf16 output
            out = torch.nn.functional.gelu(out, approximate="tanh")
        return out.to(out_dtype).reshape(*lead, self.out_features)
