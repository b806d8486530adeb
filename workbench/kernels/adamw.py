"""AdamW on one flat fp32 master whose gradient and working copy are low precision, in one pass.

    adamw_flat_step(grad, master, exp_avg, exp_avg_sq, step, out, lr=, betas=, eps=, weight_decay=)

Under master weights (bf16 GEMM weights, fp32 masters) torch's optimizer steps an fp32 master whose
fp32 gradient had to be widened from the bf16 gradients first, and whose result has to be narrowed back
into the bf16 weights after: two full passes over the master (6 bytes an element each) around the
update's own 28. This kernel reads the bf16 gradient, updates the master and both moments in fp32 and
writes the bf16 weights from the updated master, in one pass of 28 bytes an element.

The update is torch's fused AdamW (`torch.optim.AdamW(fused=True)`), in its order and fp32:

    p  -= lr * weight_decay * p
    m   = beta1 * m + (1 - beta1) * g
    v   = beta2 * v + (1 - beta2) * g * g
    p  -= (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    out = p rounded to out's dtype

with t the step count after this step's increment. `step` and `lr` may live on the device (a CUDA graph
replays the step with the counter and learning rate it reads there): the kernel reads them, so the
host never syncs. The betas are rounded to fp32 first, as torch's kernel holds them (1 - beta2 is then
0.00099998713 for 0.999, not 0.001). The bias corrections are computed as 2^(t log2 beta) in fp32 (torch
calls powf): within a few units in the last place. sqrt and the divisions round to nearest.

Kernels run on the GPU, and on the CPU with TRITON_INTERPRET=1 set before this module is imported (slow).
"""
from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

from workbench.kernels._common import SOFT_RTNE, cdiv, launch, to_dtype

_BLOCK = 2048   # elements a program updates: 16 per thread at 4 warps


@triton.jit
def _adamw_flat_kernel(G, P, M, V, OUT, STEP, step_value, LR, lr_value, start, n, beta1, beta2, log2_beta1,
                       log2_beta2, eps, weight_decay, STEP_ON_DEVICE: tl.constexpr,
                       LR_ON_DEVICE: tl.constexpr, SOFT_RTNE: tl.constexpr, BLOCK: tl.constexpr):
    """Elements start + [0, n - start) of the flat tensors, BLOCK a program."""
    offs = start + tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    if STEP_ON_DEVICE:
        t = tl.load(STEP).to(tl.float32)
    else:
        t = step_value
    if LR_ON_DEVICE:
        lr = tl.load(LR).to(tl.float32)
    else:
        lr = lr_value
    bias_correction1 = 1.0 - tl.exp2(t * log2_beta1)
    bias_correction2_sqrt = tl.sqrt_rn(1.0 - tl.exp2(t * log2_beta2))
    step_size = tl.div_rn(lr, bias_correction1)

    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    p = tl.load(P + offs, mask=ok, other=0.0)
    m = tl.load(M + offs, mask=ok, other=0.0)
    v = tl.load(V + offs, mask=ok, other=0.0)
    p = p - lr * weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - tl.div_rn(step_size * m, denom)
    tl.store(P + offs, p, mask=ok)
    tl.store(M + offs, m, mask=ok)
    tl.store(V + offs, v, mask=ok)
    tl.store(OUT + offs, to_dtype(p, OUT.dtype.element_ty, SOFT_RTNE), mask=ok)


def _fp32(value: float) -> float:
    """value rounded to the nearest fp32 (saturating to inf past its range, as a cast does)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _scalar(value, name: str) -> float:
    if torch.is_tensor(value):
        raise ValueError(f"adamw_flat_step: {name} must be a number, got a tensor")
    return float(value)


def adamw_flat_step(grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    step: torch.Tensor, out: torch.Tensor, *, lr, betas, eps, weight_decay) -> None:
    """One AdamW step of the flat fp32 `master` (in place, with its moments `exp_avg`, `exp_avg_sq`) from
    the low-precision gradient `grad`, and `out` (the low-precision weights) set to the result rounded.
    `step` (a 0-dim fp32 tensor, on the master's device or the CPU) is incremented first, as torch's
    optimizers count; `lr` is a number or a 0-dim tensor on the master's device. All of grad, master,
    exp_avg, exp_avg_sq and out are contiguous and of one size."""
    n = master.numel()
    for name, t, dtype in (("master", master, torch.float32), ("exp_avg", exp_avg, torch.float32),
                           ("exp_avg_sq", exp_avg_sq, torch.float32), ("grad", grad, None), ("out", out, None)):
        if t.numel() != n or not t.is_contiguous() or t.device != master.device or (dtype and t.dtype != dtype):
            raise ValueError(f"adamw_flat_step: {name} must be a contiguous {dtype or 'tensor'} of {n} values on "
                             f"{master.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    # the betas as fp32, which the kernel computes with (and torch's fused AdamW, powf included)
    beta1, beta2 = (_fp32(_scalar(b, "betas")) for b in betas)
    if not (0.0 < beta1 < 1.0 and 0.0 < beta2 < 1.0):
        raise ValueError(f"adamw_flat_step: betas must lie in (0, 1), got {beta1}, {beta2}")
    step.add_(1)
    step_on_device = step.device == master.device
    lr_on_device = torch.is_tensor(lr)
    if lr_on_device and lr.device != master.device:
        lr, lr_on_device = float(lr), False
    if n == 0:
        return
    step_args = (step, 0.0) if step_on_device else (master, float(step))
    lr_args = (lr, 0.0) if lr_on_device else (master, float(lr))
    hyper = (beta1, beta2, math.log2(beta1), math.log2(beta2), _scalar(eps, "eps"), _scalar(weight_decay, "weight_decay"))
    # Two launches: the whole blocks, whose bound is a multiple of BLOCK (Triton then knows the mask is
    # constant over 16 elements and moves 16-byte vectors), and the last partial block, masked per element.
    whole = n - n % _BLOCK
    for start, end in ((0, whole), (whole, n)):
        if end > start:
            launch(_adamw_flat_kernel)[(cdiv(end - start, _BLOCK),)](
                grad, master, exp_avg, exp_avg_sq, out, *step_args, *lr_args, start, end, *hyper,
                STEP_ON_DEVICE=step_on_device, LR_ON_DEVICE=lr_on_device, SOFT_RTNE=SOFT_RTNE, BLOCK=_BLOCK,
                num_warps=4)
