"""SwinV2's cosine attention inputs, one launch per tensor each way: q and k rows L2-normalized, q scaled per head.

    cosine_qk(q, k, scale, out_dtype) -> (q / max(||q||, eps) * scale[h], k / max(||k||, eps))

q, k: (B_, H, N, D) in any strides (the views of a packed qkv); scale: (H,) fp32 (SwinV2's
exp(min(logit_scale, log 100)), computed by the caller so that autograd carries its gradient to the
logit scale); out_dtype: the attention kernel's input dtype. The outputs are contiguous (B_, H, N, D).

What it replaces: F.normalize of q and of k (a norm, a clamp and a division each), the multiplication by
the logit scale and the casts, about ten full passes over q and k and their launches per block in each
direction. Here a program reads BLOCK_R rows of D values once, computes in fp32 and writes the rows once
(rounded once to out_dtype); the backward reads the raw rows, the output gradient and the saved inverse
norms once and writes dq, dk and, per row, dy . q_hat for the scale's gradient (summed per head in torch).

Gradient of y = x / max(||x||, eps) * s, with x_hat = x / ||x|| and g = dy * s:
    dx = (g - x_hat (g . x_hat)) / ||x||     where ||x|| > eps
    dx = g / eps                              where the norm is clamped (eps is then a constant)
    ds = sum over the head's rows of dy . x_hat
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from workbench.kernels import _common
from workbench.kernels._common import SOFT_RTNE, cdiv, kernel_op, launch, to_dtype

EPS = 1e-12                       # F.normalize's default
_ROWS_PER_PROGRAM_ELEMS = 4096    # rows x D values a program holds


@triton.jit
def _rows(n_rows, N, H, BLOCK_R: tl.constexpr):
    """This program's rows of the (B_, H, N) row space -> (rows, in range, b, h, n), b h n as int64."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    return rows, rows < n_rows, (rows // (N * H)).to(tl.int64), ((rows // N) % H).to(tl.int64), (rows % N).to(tl.int64)


@triton.jit
def _load_rows(X, b, h, n, ok, s_b, s_h, s_n, s_d, D: tl.constexpr):
    """(BLOCK_R, D) fp32 rows of a strided (B_, H, N, D) tensor."""
    cols = tl.arange(0, D)
    return tl.load(X + (b * s_b + h * s_h + n * s_n)[:, None] + cols[None, :] * s_d, mask=ok[:, None],
                   other=0.0).to(tl.float32)


@triton.jit
def _cosine_fwd_kernel(X, OUT, RNORM, SCALE, n_rows, N, H, sx_b, sx_h, sx_n, sx_d, eps,
                       HAS_SCALE: tl.constexpr, SOFT_RTNE: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr):
    rows, ok, b, h, n = _rows(n_rows, N, H, BLOCK_R)
    cols = tl.arange(0, D)
    x = _load_rows(X, b, h, n, ok, sx_b, sx_h, sx_n, sx_d, D)
    norm = tl.sqrt(tl.sum(x * x, 1))
    r = 1.0 / tl.maximum(norm, eps)
    y = x * r[:, None]
    if HAS_SCALE:
        y = y * tl.load(SCALE + h, mask=ok, other=1.0)[:, None]
    dst = rows.to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(OUT + dst, to_dtype(y, OUT.dtype.element_ty, SOFT_RTNE), mask=ok[:, None])
    tl.store(RNORM + rows, r, mask=ok)


@triton.jit
def _cosine_bwd_kernel(X, DY, RNORM, SCALE, DX, ROWDOT, n_rows, N, H, sx_b, sx_h, sx_n, sx_d,
                       sd_b, sd_h, sd_n, sd_d, inv_eps, HAS_SCALE: tl.constexpr, SOFT_RTNE: tl.constexpr,
                       BLOCK_R: tl.constexpr, D: tl.constexpr):
    rows, ok, b, h, n = _rows(n_rows, N, H, BLOCK_R)
    cols = tl.arange(0, D)
    x = _load_rows(X, b, h, n, ok, sx_b, sx_h, sx_n, sx_d, D)
    dy = _load_rows(DY, b, h, n, ok, sd_b, sd_h, sd_n, sd_d, D)
    r = tl.load(RNORM + rows, mask=ok, other=1.0)
    x_hat = x * r[:, None]
    g = dy
    if HAS_SCALE:
        g = dy * tl.load(SCALE + h, mask=ok, other=1.0)[:, None]
        tl.store(ROWDOT + rows, tl.sum(dy * x_hat, 1), mask=ok)
    dot = tl.sum(g * x_hat, 1)
    clamped = r >= inv_eps
    dx = tl.where(clamped[:, None], g, g - x_hat * dot[:, None]) * r[:, None]
    dst = rows.to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(DX + dst, to_dtype(dx, DX.dtype.element_ty, SOFT_RTNE), mask=ok[:, None])


def _block_rows(d: int) -> int:
    return max(1, min(256, _ROWS_PER_PROGRAM_ELEMS // d))


def _check(x: torch.Tensor) -> None:
    if x.dim() != 4:
        raise ValueError(f"cosine_qk: expected (B_, H, N, D) tensors, got {tuple(x.shape)}")
    d = x.shape[-1]
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"cosine_qk: head width {d} is not a power of two from 16 to 256")


@kernel_op("swinbench::cosine_rows_fwd")
def cosine_rows_fwd(x: torch.Tensor, scale: Optional[torch.Tensor], out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B_, H, N, D) any strides -> (y (B_, H, N, D) contiguous in out_dtype, inverse norms (B_*H*N,) fp32)."""
    b_, h, n, d = x.shape
    y = _common.new_output((b_, h, n, d), out_dtype, x.device)
    rnorm = _common.new_output((b_ * h * n,), torch.float32, x.device)
    rows = b_ * h * n
    if rows:
        block = _block_rows(d)
        launch(_cosine_fwd_kernel)[(cdiv(rows, block),)](
            x, y, rnorm, scale if scale is not None else rnorm, rows, n, h, *x.stride(), EPS,
            HAS_SCALE=scale is not None, SOFT_RTNE=SOFT_RTNE, BLOCK_R=block, D=d, num_warps=4)
    return y, rnorm


@cosine_rows_fwd.register_fake
def _(x, scale, out_dtype):
    b_, h, n, d = x.shape
    return x.new_empty((b_, h, n, d), dtype=out_dtype), x.new_empty((b_ * h * n,), dtype=torch.float32)


@kernel_op("swinbench::cosine_rows_bwd")
def cosine_rows_bwd(x: torch.Tensor, dy: torch.Tensor, rnorm: torch.Tensor,
                    scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (dx (B_, H, N, D) contiguous in x's dtype, per-row dy . x_hat (B_*H*N,) fp32; zeros without scale)."""
    b_, h, n, d = x.shape
    dx = _common.new_output((b_, h, n, d), x.dtype, x.device)
    rowdot = _common.new_output((b_ * h * n,), torch.float32, x.device)
    rows = b_ * h * n
    if rows:
        if scale is None:
            rowdot.zero_()
        block = _block_rows(d)
        launch(_cosine_bwd_kernel)[(cdiv(rows, block),)](
            x, dy, rnorm, scale if scale is not None else rnorm, dx, rowdot, rows, n, h, *x.stride(), *dy.stride(),
            1.0 / EPS, HAS_SCALE=scale is not None, SOFT_RTNE=SOFT_RTNE, BLOCK_R=block, D=d, num_warps=4)
    return dx, rowdot


@cosine_rows_bwd.register_fake
def _(x, dy, rnorm, scale):
    b_, h, n, d = x.shape
    return x.new_empty(x.shape), x.new_empty((b_ * h * n,), dtype=torch.float32)


class CosineQKFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, scale, out_dtype):
        _check(q)
        _check(k)
        scale = scale.detach().float().contiguous()
        qn, rq = cosine_rows_fwd(q, scale, out_dtype)
        kn, rk = cosine_rows_fwd(k, None, out_dtype)
        ctx.save_for_backward(q, k, rq, rk, scale)
        return qn, kn

    @staticmethod
    def backward(ctx, dqn, dkn):
        q, k, rq, rk, scale = ctx.saved_tensors
        dq, rowdot = cosine_rows_bwd(q, dqn, rq, scale)
        dk, _ = cosine_rows_bwd(k, dkn, rk, None)
        b_, h, n, _ = q.shape
        dscale = rowdot.view(b_, h, n).sum((0, 2))
        return dq, dk, dscale, None


def cosine_qk(q: torch.Tensor, k: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype | None = None):
    """(normalize(q) * scale[h], normalize(k)) in out_dtype (default q's), contiguous (B_, H, N, D); see the
    module docstring. Differentiable in q, k and scale."""
    return CosineQKFunction.apply(q, k, scale.reshape(-1), out_dtype or q.dtype)


def cosine_qk_torch(q: torch.Tensor, k: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype | None = None):
    """The same in torch ops (timm's SwinV2 arithmetic), for reference."""
    import torch.nn.functional as F

    out_dtype = out_dtype or q.dtype
    qn = F.normalize(q.float(), dim=-1, eps=EPS) * scale.reshape(1, -1, 1, 1).float()
    return qn.to(out_dtype), F.normalize(k.float(), dim=-1, eps=EPS).to(out_dtype)
