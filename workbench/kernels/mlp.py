"""A Swin block's whole MLP in one kernel, for inference: fc1, its bias and GELU, and fc2, with the hidden
activation (4x the block's width, the widest tensor of the block) kept on chip instead of written and
read back.

    fused_mlp(x2, w1, b1, w2, b2)                       -> fc2(GELU_tanh(fc1(x2)))       bf16 / fp16
    quantized_mlp(x_q, x_scale, w1_q, w1_scale, b1,     -> the same on e4m3 operands: the quantized MLP pair
                  h_scale, w2_q, w2_scale, b2)             (kernels.quant: fc1's epilogue writes fc2's input
                                                           at the static scale h_scale), in one launch

Each program holds BLOCK_M rows of x and their whole output row (the block's width, C <= MAX_FEATURES) and
walks the hidden features BLOCK_H at a time: h = GELU(x @ W1[j]^T + b1[j]) in fp32, rounded once (to the
input's dtype, or quantized to e4m3 at h_scale), then acc += h @ W2[:, j]^T. The GELU is the tanh form that
dense's fc1 applies in inference (cuBLASLt's GELU epilogue) and the quantized pair's epilogue computes
(quant._gelu_tanh), and every rounding is the one the two-GEMM form makes, so the fused MLP differs from
it only by the order of fc2's sums. Wider blocks (Swin's stages 3 and 4) keep the two GEMMs: their output
row does not fit one program's registers, and their GEMMs are compute-bound, where writing the hidden
costs little.

Inference only (no backward): the passes bind it where no gradient is recorded and the measured
selection found it faster than the two GEMMs for the shape.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels import _common
from workbench.kernels._common import _INTERPRET, SOFT_RTNE, cdiv, launch, next_pow2, to_dtype
from workbench.kernels.quant import QDTYPE, QMAX, _epilogue, _gelu_tanh, quantize_static

MAX_FEATURES = 256      # widest MLP input and output the kernel holds in one program (Swin's stages 1 and 2)
MIN_FEATURES = 16       # narrowest: the tensor cores' K step

# (BLOCK_M, BLOCK_H, warps, stages) the autotuner times per shape on the GPU
# (those whose tiles fit the GPU's shared memory: _fitting; the 32-row tiles only for a few rows, where
# the 64-row ones leave most SMs idle); the interpreter takes one
_CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_H": bh}, num_warps=nw, num_stages=ns)
            for bm, bh, nw, ns in ((128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3),
                                   (64, 128, 4, 3), (128, 32, 4, 3), (64, 32, 4, 3), (256, 64, 8, 2),
                                   (32, 64, 4, 3), (32, 128, 4, 3))]
SMALL_ROWS = 8192           # M_BUCKET up to which the 32-row tiles are timed too
M_BUCKETS = 1 << 16         # rows are keyed by their next power of two up to this (a batch's own configs)
SHARED_BYTES = 232448      # an sm_90 block's shared memory (227 KB), where the device does not say
_SCRATCH = 1024            # shared memory Triton takes beside the tiles (256 bytes seen on sm_90)
_UPCAST = tl.constexpr(_INTERPRET)
_INTERPRET_CONFIG = {"BLOCK_M": 16, "BLOCK_H": 32}
_KEY = ["C", "N", "HID", "QUANT", "M_BUCKET"]


@triton.jit
def _dot(a, b, acc):
    """tl.dot accumulating in fp32 (into acc unless None). Under the interpreter, which multiplies 16-bit
    float operands as raw integers, on their exact fp32 values."""
    if _UPCAST:
        if a.dtype == tl.bfloat16 or a.dtype == tl.float16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        r = tl.dot(a, b, acc, input_precision="ieee")
    else:
        r = tl.dot(a, b, acc)
    return r


@triton.jit
def _mlp_kernel(X, XS, W1, W1S, B1, HS, W2, W2S, B2, OUT, M, C, HID, N, M_BUCKET, qmax,
                QUANT: tl.constexpr, ROW_SCALE: tl.constexpr, SOFT_RTNE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr):
    """OUT (M, N) = fc2(GELU_tanh(fc1(X))) for BLOCK_M rows a program. X (M, C), W1 (HID, C), W2 (N, HID),
    all row-major; QUANT: e4m3 operands (bytes under the interpreter, bitcast here), XS the input's scale
    per row (ROW_SCALE) or one static scale, W1S / W2S per output channel, HS the hidden's static scale."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    ks = tl.arange(0, BLOCK_C)
    cols = tl.arange(0, BLOCK_N)
    k_mask = ks < C
    col_mask = cols < N
    x = tl.load(X + rows.to(tl.int64)[:, None] * C + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                other=0.0)
    if QUANT:
        x = x.to(tl.float8e4nv, bitcast=True)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for h0 in range(0, HID, BLOCK_H):
        hs_ = h0 + tl.arange(0, BLOCK_H)
        h_mask = hs_ < HID
        w1 = tl.load(W1 + hs_[:, None] * C + ks[None, :], mask=h_mask[:, None] & k_mask[None, :], other=0.0)
        w2 = tl.load(W2 + cols[:, None] * HID + hs_[None, :], mask=col_mask[:, None] & h_mask[None, :], other=0.0)
        if QUANT:
            w1 = w1.to(tl.float8e4nv, bitcast=True)
            w2 = w2.to(tl.float8e4nv, bitcast=True)
            a1 = _epilogue(tl.dot(x, w1.T), rows, hs_, row_mask, h_mask, XS, W1S, B1, ROW_SCALE, True,
                           BLOCK_M, BLOCK_H)
            h = quantize_static(_gelu_tanh(a1), HS, qmax, False)     # padding columns: GELU(0) = 0
        else:
            a1 = _dot(x, w1.T, None) + tl.load(B1 + hs_, mask=h_mask, other=0.0).to(tl.float32)[None, :]
            h = to_dtype(_gelu_tanh(a1), X.dtype.element_ty, SOFT_RTNE)
        acc = _dot(h, w2.T, acc)
    if QUANT:
        out = _epilogue(acc, rows, cols, row_mask, col_mask, HS, W2S, B2, False, True, BLOCK_M, BLOCK_N)
    else:
        out = acc + tl.load(B2 + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + rows.to(tl.int64)[:, None] * N + cols[None, :], to_dtype(out, OUT.dtype.element_ty, SOFT_RTNE),
             mask=row_mask[:, None] & col_mask[None, :])


def _feature_blocks(c: int, n: int, quant: bool) -> tuple[int, int]:
    """(BLOCK_C, BLOCK_N): the input and output widths padded to powers of two, at least the tensor cores'
    K step (32 for e4m3)."""
    return max(next_pow2(c), 32 if quant else MIN_FEATURES), max(next_pow2(n), MIN_FEATURES)


def shared_bytes(block_m: int, block_c: int, block_n: int, block_h: int, stages: int, elem: int) -> int:
    """The shared memory a config's tiles take (as Triton lays them out on sm_90): x's tile, held for the
    whole loop, and `stages` buffers of each weight chunk (W1's BLOCK_H x BLOCK_C, W2's BLOCK_N x BLOCK_H).
    Triton adds a little scratch of its own (_SCRATCH leaves room for it)."""
    return elem * (block_m * block_c + stages * block_h * (block_c + block_n))


def _fitting(configs, named_args, **kwargs):
    """The autotuner's early prune: the configs whose tiles fit the device's shared memory at this shape
    (a bf16 MLP 256 wide fits few), the first where none does; 32-row tiles only up to SMALL_ROWS rows."""
    x = named_args["X"]
    elem = x.element_size()
    block_c, block_n = _feature_blocks(named_args["C"], named_args["N"], elem == 1)
    limit = SHARED_BYTES
    if x.is_cuda:
        limit = getattr(torch.cuda.get_device_properties(x.device), "shared_memory_per_block_optin", limit)
    configs = [c for c in configs if c.kwargs["BLOCK_M"] >= 64 or named_args["M_BUCKET"] <= SMALL_ROWS]
    fit = [c for c in configs if shared_bytes(c.kwargs["BLOCK_M"], block_c, block_n, c.kwargs["BLOCK_H"],
                                              c.num_stages, elem) + _SCRATCH <= limit]
    return fit or configs[:1]


if _INTERPRET:
    _mlp = _mlp_kernel
elif not _common.AUTOTUNE:
    _mlp = triton.autotune(_CONFIGS[6:7], key=_KEY)(_mlp_kernel)
else:
    _mlp = triton.autotune(_CONFIGS, key=_KEY, prune_configs_by={"early_config_prune": _fitting})(_mlp_kernel)


def applies(in_features: int, hidden: int, out_features: int) -> bool:
    """Whether the fused kernel takes an MLP of these widths: input and output within
    MIN_FEATURES..MAX_FEATURES, a hidden of at least MIN_FEATURES."""
    return (MIN_FEATURES <= in_features <= MAX_FEATURES and MIN_FEATURES <= out_features <= MAX_FEATURES
            and hidden >= MIN_FEATURES)


def _check(x2, w1, b1, w2, b2, what: str) -> tuple[int, int, int, int]:
    if x2.dim() != 2 or w1.dim() != 2 or w2.dim() != 2:
        raise ValueError(f"{what}: x2, w1 and w2 must be 2-D, got {x2.dim()}, {w1.dim()}, {w2.dim()} dimensions")
    M, C = x2.shape
    HID, N = w1.shape[0], w2.shape[0]
    if w1.shape[1] != C or w2.shape[1] != HID or b1.numel() != HID or b2.numel() != N:
        raise ValueError(f"{what}: shapes do not chain: x2 {tuple(x2.shape)}, w1 {tuple(w1.shape)}, b1 "
                         f"{tuple(b1.shape)}, w2 {tuple(w2.shape)}, b2 {tuple(b2.shape)}")
    if not applies(C, HID, N):
        raise ValueError(f"{what}: widths {C} -> {HID} -> {N} outside the kernel's {MIN_FEATURES}..{MAX_FEATURES} "
                         f"input and output")
    return M, C, HID, N


def _launch(x, xs, w1, w1s, b1, hs, w2, w2s, b2, out, M, C, HID, N, quant: bool):
    if M == 0:
        return out
    extra = dict(_INTERPRET_CONFIG) if _INTERPRET else {}
    grid = lambda meta: (cdiv(M, meta["BLOCK_M"]),)  # noqa: E731
    as_bytes = (lambda t: t.view(torch.uint8)) if quant and _INTERPRET else (lambda t: t)
    block_c, block_n = _feature_blocks(C, N, quant)
    launch(_mlp)[grid](as_bytes(x), xs, as_bytes(w1), w1s, b1, hs, as_bytes(w2), w2s, b2, out, M, C, HID, N,
                       min(next_pow2(max(M, 1)), M_BUCKETS), QMAX["fp8"], QUANT=quant,
                       ROW_SCALE=xs.numel() != 1, SOFT_RTNE=SOFT_RTNE,
                       BLOCK_C=block_c, BLOCK_N=block_n, **extra)
    return out


def fused_mlp(x2: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """fc2(GELU_tanh(fc1(x2))) in one launch: x2 (M, C), w1 (HID, C), b1 (HID,), w2 (N, HID), b2 (N,), all
    in one half dtype (bf16 / fp16) -> (M, N) in it. fc1's result and GELU in fp32, rounded once to the
    dtype (as cuBLASLt's GELU epilogue writes it), fc2 accumulated in fp32 and its bias added there."""
    M, C, HID, N = _check(x2, w1, b1, w2, b2, "fused_mlp")
    dt = x2.dtype
    if dt not in (torch.bfloat16, torch.float16) or any(t.dtype != dt for t in (w1, b1, w2, b2)):
        raise ValueError(f"fused_mlp: x2, weights and biases must share one half dtype, got {x2.dtype}, "
                         f"{w1.dtype}, {b1.dtype}, {w2.dtype}, {b2.dtype}")
    x2, w1, w2 = x2.contiguous(), w1.contiguous(), w2.contiguous()
    out = _common.new_output((M, N), dt, x2.device)
    return _launch(x2, b1, w1, b1, b1.contiguous(), b1, w2, b2, b2.contiguous(), out, M, C, HID, N, False)


def quantized_mlp(x_q: torch.Tensor, x_scale: torch.Tensor, w1_q: torch.Tensor, w1_scale: torch.Tensor,
                  b1: torch.Tensor, h_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor,
                  b2: torch.Tensor) -> torch.Tensor:
    """The e4m3 MLP pair in one launch: x_q (M, C) e4m3fn at x_scale ((M, 1) per row or () static, fp32),
    w1_q (HID, C) / w2_q (N, HID) e4m3fn at w1_scale (HID) / w2_scale (N) per output channel, biases b1 /
    b2 (bf16 or fp32), h_scale the hidden's () static scale -> (M, N) bf16: fc1's epilogue (scales, bias,
    GELU_tanh, quantized at h_scale by its reciprocal) and fc2's (scales, bias) as quant_matmul_act and
    quant_matmul compute them."""
    M, C, HID, N = _check(x_q, w1_q, b1, w2_q, b2, "quantized_mlp")
    if any(t.dtype != QDTYPE["fp8"] for t in (x_q, w1_q, w2_q)):
        raise ValueError(f"quantized_mlp: x_q, w1_q and w2_q must be e4m3fn, got {x_q.dtype}, {w1_q.dtype}, "
                         f"{w2_q.dtype}")
    if x_scale.numel() not in (1, M) or w1_scale.numel() != HID or w2_scale.numel() != N or h_scale.numel() != 1:
        raise ValueError(f"quantized_mlp: scales must hold 1 or {M} (x), {HID} (w1), {N} (w2) and 1 (hidden) "
                         f"values, got {x_scale.numel()}, {w1_scale.numel()}, {w2_scale.numel()}, {h_scale.numel()}")
    f32 = [t.float().contiguous() for t in (x_scale, w1_scale, h_scale, w2_scale)]
    out = _common.new_output((M, N), torch.bfloat16, x_q.device)
    return _launch(x_q.contiguous(), f32[0], w1_q.contiguous(), f32[1], b1.contiguous(), f32[2], w2_q.contiguous(),
                   f32[3], b2.contiguous(), out, M, C, HID, N, True)
