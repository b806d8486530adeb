"""Linear backward with the bias gradient in one reduction, fused with the GELU backward in an MLP.

    linear(x, weight, bias, gelu=False)      -> F.linear(x, weight, bias)            (gelu: F.gelu of it, exact erf)
    addmm_gelu(x2, weight, bias)             -> GELU(x2 @ weight^T + bias) in one GEMM epilogue (inference, tanh GELU)
    bias_grad(dy, pre=None, bias_dtype)      -> (dpre, db): db = dpre.sum(0), dpre = dy * gelu'(pre) when pre is given

Why: in an autocast training step every nn.Linear's backward computes its bias gradient as a separate
`sum(0)` over the (rows, out_features) output gradient, in the half dtype (rounded to bf16, then cast
to the fp32 parameter). Once the window and attention kernels are fused, those column reductions are
the largest single kernel of a Swin step besides the GEMMs, and the MLP's GELU backward is another
elementwise pass over the same (rows, 4C) tensor just before. Here one kernel reads
the output gradient (and, for fc1, the pre-activation), writes the GELU backward's result (the
gradient the two GEMMs then use) and accumulates the bias gradient in fp32 per program, added
atomically into one zeroed fp32 row (_common.column_sums; per-program rows summed in a fixed order
under deterministic mode). The GEMMs for dx and dweight stay cuBLAS (torch.mm).

Numerics: the GEMMs see exactly the tensors autograd would give them (dpre rounded to the activation
dtype); the bias gradient is summed in fp32 from those same rounded values and cast once to the
parameter dtype, where autograd rounds the sum to bf16 first. Under autocast the Function casts x,
weight and bias to the autocast dtype itself, as F.linear's autocast rule does, and returns each
gradient in its input's dtype.

Kernels run on the GPU, and on the CPU with TRITON_INTERPRET=1 set before this module is imported (slow).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from workbench.kernels import _common
from workbench.kernels._common import SOFT_RTNE as _SOFT_RTNE
from workbench.kernels._common import (cdiv, column_sums, emit_column_sum, finish_column_sums, host_cache, kernel_op, launch, next_pow2, sm_count,
                      to_dtype)

# Elements per (rows x cols) tile: 2048 over 4 warps is 16 fp32 accumulators per thread.
_TILE_ELEMS = 2048
_MAX_BLOCK_N = 256
# Programs per SM: the loop has no cross-thread reduction per step, so many small programs keep enough
# loads in flight; each adds its (out_features,) fp32 sums into the one bias-gradient row.
_PROGRAMS_PER_SM = 8
_MIN_ROWS_PER_PROGRAM = 32


@triton.jit
def _bias_grad_kernel(
    DY, PRE, DPRE, SUMS, n_rows, n_cols, rows_per_prog,
    GELU: tl.constexpr, CAST: tl.constexpr, SOFT_RTNE: tl.constexpr, ATOMIC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (pm, pn) sums rows [pm * rows_per_prog, +rows_per_prog) of columns [pn * BLOCK_N, +BLOCK_N).
    With GELU, the summed value is dpre = dy * gelu'(pre) rounded to DPRE's dtype, which it also stores;
    with CAST, it is dy rounded to DPRE's dtype, also stored (the cast and the bias gradient in one pass)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    row_start = pid_m * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, n_rows)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(row_start, row_end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        mask = (rows < row_end)[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        g = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        if GELU:
            x = tl.load(PRE + offs, mask=mask, other=0.0).to(tl.float32)
            cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
            pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
            d = (g * (cdf + x * pdf)).to(DPRE.dtype.element_ty)
            tl.store(DPRE + offs, d, mask=mask)
            g = d.to(tl.float32)
        elif CAST:
            d = to_dtype(g, DPRE.dtype.element_ty, SOFT_RTNE)
            tl.store(DPRE + offs, d, mask=mask)
            g = d.to(tl.float32)
        acc += g
    emit_column_sum(SUMS, pid_m, n_cols, cols, tl.sum(acc, axis=0), col_mask, ATOMIC)


@host_cache
def _grid(n_rows: int, n_cols: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, row programs, column blocks, rows per program)."""
    block_n = min(_MAX_BLOCK_N, next_pow2(n_cols))
    block_m = max(1, _TILE_ELEMS // block_n)
    col_blocks = cdiv(n_cols, block_n)
    row_programs = max(1, min(cdiv(n_rows, _MIN_ROWS_PER_PROGRAM),
                              cdiv(_PROGRAMS_PER_SM * sm_count(device), col_blocks)))
    rows_per_prog = cdiv(cdiv(n_rows, row_programs), block_m) * block_m
    return block_m, block_n, cdiv(n_rows, rows_per_prog), col_blocks, rows_per_prog


def bias_grad_host(dy: torch.Tensor, pre: Optional[torch.Tensor], bias_dtype: torch.dtype,
                   sums_into: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """dy (M, N) contiguous, pre (M, N) like dy or None -> (dpre (M, N) in dy.dtype, or dy itself
    when pre is None; db (N,) in bias_dtype). sums_into: a zeroed (N,) fp32 tensor for the column sums.
    out_dtype (without pre): dpre is dy cast to it in the same pass, and db sums the cast values."""
    n_rows, n_cols = dy.shape
    if n_rows == 0:
        return (dy.clone() if pre is not None else dy), torch.zeros(n_cols, dtype=bias_dtype, device=dy.device)
    block_m, block_n, row_programs, col_blocks, rows_per_prog = _grid(n_rows, n_cols, dy.device)
    sums, atomic = column_sums(row_programs, n_cols, dy.device, sums_into)
    cast = pre is None and out_dtype is not None and out_dtype != dy.dtype
    if pre is not None or cast:
        dpre = _common.new_output(dy.shape, out_dtype if cast else dy.dtype, dy.device)
    else:
        dpre = dy
    launch(_bias_grad_kernel)[(row_programs, col_blocks)](
        dy, pre if pre is not None else dy, dpre, sums, n_rows, n_cols, rows_per_prog,
        GELU=pre is not None, CAST=cast, SOFT_RTNE=_SOFT_RTNE, ATOMIC=atomic,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
    )
    db = finish_column_sums(sums, atomic)
    return dpre, (db if bias_dtype == torch.float32 else db.to(bias_dtype))


@kernel_op("swinbench::bias_grad", eager=bias_grad_host)
def _bias_grad_op(dy: torch.Tensor, pre: Optional[torch.Tensor], bias_dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    dpre, db = bias_grad_host(dy, pre, bias_dtype)
    return (dpre if pre is not None else dy.clone()), db   # an op may not return an input


@_bias_grad_op.register_fake
def _(dy, pre, bias_dtype):
    return dy.new_empty(dy.shape), dy.new_empty((dy.shape[1],), dtype=bias_dtype)


def bias_grad(dy: torch.Tensor, pre: Optional[torch.Tensor] = None, bias_dtype: torch.dtype = torch.float32
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dpre, db) for dy (..., N) [and the GELU input pre, same shape]: dpre = dy * gelu'(pre) (dy when
    pre is None), db = dpre summed over every leading dim, in fp32, cast to bias_dtype."""
    n = dy.shape[-1]
    dy2 = dy.reshape(-1, n)
    dy2 = dy2 if dy2.is_contiguous() else dy2.contiguous()
    pre2 = None
    if pre is not None:
        if pre.shape != dy.shape:
            raise ValueError(f"bias_grad: pre {tuple(pre.shape)} and dy {tuple(dy.shape)} differ")
        pre2 = pre.reshape(-1, n)
        pre2 = pre2 if pre2.is_contiguous() else pre2.contiguous()
    dpre, db = _bias_grad_op(dy2, pre2, bias_dtype)   # eager: bias_grad_host, which hands dy back without GELU
    return dpre.view(dy.shape), db


def compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype F.linear computes in: the autocast dtype when autocast is on for x's device, else the
    promoted dtype of x and weight."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(x.dtype, weight.dtype)


class LinearFunction(torch.autograd.Function):
    """F.linear (optionally followed by exact GELU) whose backward computes the bias gradient, and the
    GELU backward, in one Triton reduction; dx and dweight are two cuBLAS GEMMs."""

    @staticmethod
    def forward(ctx, x, weight, bias, gelu):
        dt = compute_dtype(x, weight)
        n_out, n_in = weight.shape
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, n_in).to(dt)
            w = weight.to(dt)
            if bias is not None:
                pre = torch.addmm(bias.to(dt), x2, w.t())
            else:
                pre = x2 @ w.t()
            out = torch.nn.functional.gelu(pre) if gelu else pre
        ctx.save_for_backward(x2, w, pre if gelu else None)
        ctx.gelu = gelu
        ctx.shapes = (x.shape, x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return out.view(*x.shape[:-1], n_out)

    @staticmethod
    def backward(ctx, dout):
        x2, w, pre = ctx.saved_tensors
        x_shape, x_dtype, w_dtype, b_dtype = ctx.shapes
        dy = dout.reshape(-1, w.shape[0]).to(w.dtype)
        dy = dy if dy.is_contiguous() else dy.contiguous()
        if ctx.gelu or b_dtype is not None:
            dpre, db = bias_grad(dy, pre, b_dtype or torch.float32)
        else:
            dpre, db = dy, None
        dx = (dpre @ w).view(x_shape).to(x_dtype) if ctx.needs_input_grad[0] else None
        dw = (dpre.t() @ x2).to(w_dtype) if ctx.needs_input_grad[1] else None
        db = db if (b_dtype is not None and ctx.needs_input_grad[2]) else None
        return dx, dw, db, None


EPILOGUE_DTYPES = (torch.bfloat16, torch.float16)


def epilogue_gelu_applies(x: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None, infer: bool) -> bool:
    """Whether an MLP's fc1 + GELU runs the bias and GELU in the GEMM's epilogue (addmm_gelu): inference
    (`infer`: no gradient is recorded), a CUDA input, a half compute dtype and a bias."""
    return infer and bias is not None and x.is_cuda and dtype in EPILOGUE_DTYPES


def addmm_gelu(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """GELU(x2 @ weight^T + bias) for inference as one cuBLASLt GEMM with the bias and the GELU in its
    epilogue (torch._addmm_activation): the (rows, out_features) pre-activation is never written and read
    back, which for a Swin MLP's fc1 saves an elementwise pass over its widest activation. cuBLASLt's
    GELU is the tanh form, which differs from the exact erf GELU by at most 5e-4 (absolute), under a
    bf16 output's rounding for |GELU| > 0.13. x2 (M, K), weight (N, K), bias (N,), one half dtype."""
    return torch._addmm_activation(bias, x2, weight.t(), use_gelu=True)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gelu: bool = False) -> torch.Tensor:
    """F.linear(x, weight, bias) (then exact GELU when gelu=True), with the fused backward. In inference
    on a GPU (no gradient recorded, half dtype) the GELU runs in the GEMM's epilogue instead (addmm_gelu)."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: x has {x.shape[-1]} features, weight expects {weight.shape[1]}")
    if gelu and not torch.is_grad_enabled():      # inference: the training hot path skips this check
        dt = compute_dtype(x, weight)
        if epilogue_gelu_applies(x, dt, bias, True):
            with torch.autocast(x.device.type, enabled=False):
                out = addmm_gelu(x.reshape(-1, x.shape[-1]).to(dt), weight.to(dt), bias.to(dt))
            return out.view(*x.shape[:-1], weight.shape[0])
    return LinearFunction.apply(x, weight, bias, bool(gelu))


class BiasGradLinear(torch.nn.Linear):
    """nn.Linear whose backward computes the bias gradient in one fused reduction. Same parameters and
    state_dict keys as the module it replaces; `from_linear` keeps the very Parameter objects."""

    @classmethod
    def from_linear(cls, lin: torch.nn.Linear) -> "BiasGradLinear":
        new = cls(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
        new.weight = lin.weight
        new.bias = lin.bias
        new.train(lin.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
