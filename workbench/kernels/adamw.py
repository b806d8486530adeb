"""AdamW on one flat fp32 master whose gradient and working copy are low precision, in one pass.

    adamw_flat_step(grad, master, exp_avg, exp_avg_sq, step, out, lr=, betas=, eps=, weight_decay=)
    GradLayout(sizes, device)          the parameters' places in the flat master, cut into chunks
    adamw_grads_step(grads, layout, master, exp_avg, exp_avg_sq, step, out, lr=, ...)
                                       the same step reading each parameter's gradient where autograd
                                       left it (no flat gradient gathered first)

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

Gathering the parameters' gradients into one flat tensor first (a torch.cat) costs a pass of its own, 4
bytes an element (read and write, bf16) beside the step's 28, and launches with about 128 gradients each.
`adamw_grads_step` reads them in place instead: the flat tensors are cut into chunks of BLOCK elements
that never straddle two parameters (a parameter's last chunk is short), and each program finds its
parameter's gradient through a table of addresses (int64, one per parameter, `grad_table`: written on the
device by kernels that take the addresses as arguments, so that a CUDA graph can capture it), read as a
pointer of the gradients' dtype. Where a parameter's size and flat offset are multiples of 8 elements
(`GradLayout.aligned`), its chunks' loads and stores move 16-byte vectors as the flat kernel's do; the
others run in a second launch, element by element.

Kernels run on the GPU, and on the CPU with TRITON_INTERPRET=1 set before this module is imported (slow).
"""
from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

from workbench.kernels._common import _INTERPRET, SOFT_RTNE, TL_DTYPES, cdiv, launch, to_dtype

_BLOCK = 2048   # elements a program updates: 16 per thread at 4 warps


@triton.jit
def _adamw_flat_kernel(G, P, M, V, OUT, STEP, step_value, LR, lr_value, start, n, beta1, beta2, log2_beta1,
                       log2_beta2, eps, weight_decay, STEP_ON_DEVICE: tl.constexpr,
                       LR_ON_DEVICE: tl.constexpr, SOFT_RTNE: tl.constexpr, BLOCK: tl.constexpr):
    """Elements start + [0, n - start) of the flat tensors, BLOCK a program."""
    offs = start + tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    _update(g, offs, ok, P, M, V, OUT, STEP, step_value, LR, lr_value, beta1, beta2, log2_beta1, log2_beta2, eps,
            weight_decay, STEP_ON_DEVICE, LR_ON_DEVICE, SOFT_RTNE)


@triton.jit
def _adamw_grads_kernel(GRADS, PARAM_OF, FIRST, START, SIZE, P, M, V, OUT, STEP, step_value, LR, lr_value, beta1,
                        beta2, log2_beta1, log2_beta2, eps, weight_decay, GRAD_DTYPE: tl.constexpr,
                        ALIGNED: tl.constexpr, STEP_ON_DEVICE: tl.constexpr, LR_ON_DEVICE: tl.constexpr,
                        SOFT_RTNE: tl.constexpr, BLOCK: tl.constexpr):
    """Chunk c = program 0 of a GradLayout group: of parameter j = PARAM_OF[c], elements [i, i + BLOCK) with
    i = (c - FIRST[j]) * BLOCK, below SIZE[j]; its gradient at the address GRADS[j], its flat place from
    START[j] + i. ALIGNED: the group's sizes and starts are multiples of 8 and its gradients 16-byte
    aligned, which the hints below tell Triton, so that the loads and stores move 16 bytes."""
    c = tl.program_id(0)
    j = tl.load(PARAM_OF + c)
    i = (c - tl.load(FIRST + j)).to(tl.int64) * BLOCK
    size = tl.load(SIZE + j)
    start = tl.load(START + j) + i
    grad = tl.load(GRADS + j).to(tl.pointer_type(GRAD_DTYPE))
    if ALIGNED:
        size = tl.multiple_of(size, 8)
        start = tl.multiple_of(start, 8)
        grad = tl.multiple_of(grad, 16)
    lane = tl.arange(0, BLOCK)
    ok = lane < size - i
    g = tl.load(grad + i + lane, mask=ok, other=0.0).to(tl.float32)
    _update(g, start + lane, ok, P, M, V, OUT, STEP, step_value, LR, lr_value, beta1, beta2, log2_beta1, log2_beta2,
            eps, weight_decay, STEP_ON_DEVICE, LR_ON_DEVICE, SOFT_RTNE)


@triton.jit
def _update(g, offs, ok, P, M, V, OUT, STEP, step_value, LR, lr_value, beta1, beta2, log2_beta1, log2_beta2, eps,
            weight_decay, STEP_ON_DEVICE: tl.constexpr, LR_ON_DEVICE: tl.constexpr, SOFT_RTNE: tl.constexpr):
    """The update of the flat tensors' elements offs (where ok) from their fp32 gradient g."""
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


def _prepare(what: str, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, low: dict,
             step: torch.Tensor, lr, betas, eps, weight_decay) -> tuple[tuple, dict]:
    """Check the flat tensors against master (low: {name: tensor} of any dtype), count the step, and return
    the kernel's scalar arguments (step pointer and value, lr pointer and value, the hyperparameters) and
    its constexpr flags."""
    n = master.numel()
    for name, t, dtype in (("master", master, torch.float32), ("exp_avg", exp_avg, torch.float32),
                           ("exp_avg_sq", exp_avg_sq, torch.float32), *((k, t, None) for k, t in low.items())):
        if t.numel() != n or not t.is_contiguous() or t.device != master.device or (dtype and t.dtype != dtype):
            raise ValueError(f"{what}: {name} must be a contiguous {dtype or 'tensor'} of {n} values on "
                             f"{master.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    # the betas as fp32, which the kernel computes with (and torch's fused AdamW, powf included)
    beta1, beta2 = (_fp32(_scalar(b, "betas")) for b in betas)
    if not (0.0 < beta1 < 1.0 and 0.0 < beta2 < 1.0):
        raise ValueError(f"{what}: betas must lie in (0, 1), got {beta1}, {beta2}")
    step.add_(1)
    step_on_device = step.device == master.device
    lr_on_device = torch.is_tensor(lr)
    if lr_on_device and lr.device != master.device:
        lr, lr_on_device = float(lr), False
    step_args = (step, 0.0) if step_on_device else (master, float(step))
    lr_args = (lr, 0.0) if lr_on_device else (master, float(lr))
    hyper = (beta1, beta2, math.log2(beta1), math.log2(beta2), _scalar(eps, "eps"), _scalar(weight_decay, "weight_decay"))
    flags = dict(STEP_ON_DEVICE=step_on_device, LR_ON_DEVICE=lr_on_device, SOFT_RTNE=SOFT_RTNE, BLOCK=_BLOCK)
    return (*step_args, *lr_args, *hyper), flags


def adamw_flat_step(grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    step: torch.Tensor, out: torch.Tensor, *, lr, betas, eps, weight_decay) -> None:
    """One AdamW step of the flat fp32 `master` (in place, with its moments `exp_avg`, `exp_avg_sq`) from
    the low-precision gradient `grad`, and `out` (the low-precision weights) set to the result rounded.
    `step` (a 0-dim fp32 tensor, on the master's device or the CPU) is incremented first, as torch's
    optimizers count; `lr` is a number or a 0-dim tensor on the master's device. All of grad, master,
    exp_avg, exp_avg_sq and out are contiguous and of one size."""
    n = master.numel()
    args, flags = _prepare("adamw_flat_step", master, exp_avg, exp_avg_sq, {"grad": grad, "out": out}, step, lr,
                           betas, eps, weight_decay)
    # Two launches: the whole blocks, whose bound is a multiple of BLOCK (Triton then knows the mask is
    # constant over 16 elements and moves 16-byte vectors), and the last partial block, masked per element.
    whole = n - n % _BLOCK
    for start, end in ((0, whole), (whole, n)):
        if end > start:
            launch(_adamw_flat_kernel)[(cdiv(end - start, _BLOCK),)](
                grad, master, exp_avg, exp_avg_sq, out, *args[:4], start, end, *args[4:], **flags, num_warps=4)


class GradLayout:
    """Parameters of `sizes` elements laid end to end in a flat master (each at the sum of the sizes
    before it), cut into chunks of BLOCK elements for `adamw_grads_step`: chunk tables on `device`, made
    once, in two groups launched apart. `aligned` (a bool per parameter): its size and flat offset are
    multiples of 8 elements, which lets the kernel move 16-byte vectors (the first group); the others
    (a 10-class head's bias, and whatever follows it) take a launch without that promise."""

    def __init__(self, sizes: list[int], device: torch.device):
        self.sizes = [int(n) for n in sizes]
        self.numel = sum(self.sizes)
        starts = [sum(self.sizes[:j]) for j in range(len(self.sizes))]
        self.aligned = [n % 8 == 0 and s % 8 == 0 for n, s in zip(self.sizes, starts)]
        first = [0] * len(self.sizes)
        self.groups = []   # (aligned, chunk -> parameter table (int32), number of chunks)
        for aligned in (True, False):
            param_of = []
            for j, n in enumerate(self.sizes):
                if self.aligned[j] == aligned:
                    first[j] = len(param_of)
                    param_of += [j] * cdiv(n, _BLOCK)
            if param_of:
                self.groups.append((aligned, torch.tensor(param_of, dtype=torch.int32, device=device), len(param_of)))
        self.first = torch.tensor(first, dtype=torch.int64, device=device)
        self.start = torch.tensor(starts, dtype=torch.int64, device=device)
        self.size = torch.tensor(self.sizes, dtype=torch.int64, device=device)


_TABLE_CHUNK = 128   # addresses a launch of _addresses_kernel writes (1 KiB of kernel arguments)


@triton.jit
def _addresses_kernel(T, ADDRS, N: tl.constexpr):
    """T[0:N] = the N int64 values of the tuple ADDRS (kernel arguments)."""
    for i in tl.static_range(N):
        tl.store(T + i, ADDRS[i])


def grad_table(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The gradients' addresses as an int64 tensor on `device`, for `adamw_grads_step`. On a GPU (and under
    TRITON_INTERPRET=1) they are written by kernels that take them as arguments, 128 a launch: no host memory
    is involved, so a CUDA graph captures the table's making with the step that reads it, and its replays
    write the same addresses again."""
    addresses = [g.data_ptr() for g in grads]
    if device.type != "cuda" and not _INTERPRET:
        return torch.tensor(addresses, dtype=torch.int64, device=device)
    n = len(addresses)
    table = torch.empty(cdiv(n, _TABLE_CHUNK) * _TABLE_CHUNK, dtype=torch.int64, device=device)
    for i in range(0, n, _TABLE_CHUNK):
        chunk = addresses[i:i + _TABLE_CHUNK]
        launch(_addresses_kernel)[(1,)](table[i:], tuple(chunk + chunk[-1:] * (_TABLE_CHUNK - len(chunk))), N=_TABLE_CHUNK)
    return table[:n]


def adamw_grads_step(grads: torch.Tensor, layout: GradLayout, master: torch.Tensor, exp_avg: torch.Tensor,
                     exp_avg_sq: torch.Tensor, step: torch.Tensor, out: torch.Tensor, *, grad_dtype: torch.dtype,
                     lr, betas, eps, weight_decay) -> None:
    """adamw_flat_step with the gradient read in place: `grads` the table of `grad_table` over one
    contiguous gradient of `grad_dtype` per parameter of `layout` (in its order, of its sizes), whose
    flat places the master and the other tensors hold; the gradients of its aligned parameters 16-byte
    aligned. The caller keeps the gradients alive and as they are until the kernels have run (their
    addresses are all the kernels know of them)."""
    if layout.numel != master.numel() or grads.numel() != len(layout.sizes) or grads.dtype != torch.int64:
        raise ValueError(f"adamw_grads_step: a layout of {layout.numel} values in {len(layout.sizes)} parameters "
                         f"and an int64 table of as many addresses, for a master of {master.numel()} values")
    args, flags = _prepare("adamw_grads_step", master, exp_avg, exp_avg_sq, {"out": out}, step, lr, betas, eps,
                           weight_decay)
    for aligned, param_of, chunks in layout.groups:
        launch(_adamw_grads_kernel)[(chunks,)](
            grads, param_of, layout.first, layout.start, layout.size, master, exp_avg, exp_avg_sq, out, *args,
            GRAD_DTYPE=TL_DTYPES[grad_dtype], ALIGNED=aligned, **flags, num_warps=4)


