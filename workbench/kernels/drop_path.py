"""Stochastic depth's per-sample multiply in one vectorized pass each way.

    scale_samples(x, keep) -> x * keep.view(B, 1, ..., 1)     x (B, ...), keep (B,)

timm's DropPath multiplies a residual branch by a (B, 1, 1) tensor holding 0 or 1/keep_prob per sample.
torch runs that broadcast multiply in its generic elementwise kernel, which does not vectorize a
broadcast operand, forward and again in the backward (the gradient times the same tensor): in a fused
Swin training step with timm's default stochastic depth those multiplies are the largest kernels left
besides the GEMMs and the bias gradients. Here each program covers one contiguous chunk of one sample:
it loads the sample's factor once and streams the chunk through in wide loads and stores.

Numerics: the product is computed in fp32 and rounded once to x's dtype, as torch computes a bf16 or
fp16 multiply, and the product of two such values is exact in fp32, so the result equals torch's bit
for bit (fp32 inputs: one IEEE multiply either way). The backward is the same kernel on the output
gradient, which is what autograd computes for torch's multiply.
Kernels run on the GPU, and on the CPU with TRITON_INTERPRET=1 set before this module is imported (slow).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels import _common
from workbench.kernels._common import SOFT_RTNE, cdiv, launch, to_dtype, traced

_BLOCK = 2048   # elements a program streams: 16 per thread at 4 warps, two 16-byte vectors in bf16


@triton.jit
def _scale_samples_kernel(X, KEEP, OUT, per_sample, SOFT_RTNE: tl.constexpr, BLOCK: tl.constexpr):
    """OUT[b, i] = X[b, i] * KEEP[b] for i in this program's chunk of sample b = program_id(1)."""
    b = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < per_sample
    base = b.to(tl.int64) * per_sample
    k = tl.load(KEEP + b).to(tl.float32)
    x = tl.load(X + base + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + base + offs, to_dtype(x * k, OUT.dtype.element_ty, SOFT_RTNE), mask=ok)


def scale_samples_host(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """x (B, ...) (made contiguous), keep (B,) -> x * keep per sample, contiguous, in x's dtype."""
    if keep.dim() != 1 or keep.shape[0] != x.shape[0]:
        raise ValueError(f"scale_samples: keep must be ({x.shape[0]},), one factor per sample, got "
                         f"{tuple(keep.shape)}")
    x = x.contiguous()
    keep = keep.contiguous()
    out = _common.new_output(x.shape, x.dtype, x.device)
    n = x.shape[0]
    per_sample = x.numel() // n if n else 0
    if per_sample:
        launch(_scale_samples_kernel)[(cdiv(per_sample, _BLOCK), n)](
            x, keep, out, per_sample, SOFT_RTNE=SOFT_RTNE, BLOCK=_BLOCK, num_warps=4)
    return out


class ScaleSamplesFunction(torch.autograd.Function):
    """x * keep per sample, forward and backward by scale_samples_host (keep gets no gradient: it is
    DropPath's random draw)."""

    @staticmethod
    def forward(ctx, x, keep):
        ctx.save_for_backward(keep)
        return scale_samples_host(x, keep)

    @staticmethod
    def backward(ctx, dy):
        (keep,) = ctx.saved_tensors
        return scale_samples_host(dy, keep), None


def scale_samples(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """x * keep.view(B, 1, ..., 1) with autograd (eager: under torch.compile, multiply in torch, which
    Inductor fuses into its neighbours)."""
    if traced():
        return x * keep.view((-1,) + (1,) * (x.dim() - 1))
    return ScaleSamplesFunction.apply(x, keep)
