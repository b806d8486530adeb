"""A Swin block's qkv projection and window attention in one kernel, for inference.

    qkv_window_attention(x, weight, bias, rel_bias, mask, scale, num_heads)  -> (B*nW, N, C)

x holds the block's normed windows (B*nW, N, C), as norm1's partition kernel writes them for the qkv
Linear; weight (3C, C) and bias (3C,) are that Linear's. Each program owns one head of G windows that share
a window position: per window it computes the head's q, k and v (N x d each) from x and the head's rows of
the weight, adds their bias and rounds them once to x's dtype (what the qkv GEMM writes), then runs the
attention as kernels.window_attention's forward does (the relative-position bias and the mask in registers
for all of the program's windows, the scores never written). The packed qkv (three times the block's width
per token, the widest tensor around the attention) is neither written nor read back, and there is one launch
fewer per block, which is most of what a block costs at batch 1.

The projection's work grows with C while the attention's does not: a head of G windows reads the head's
3d x C weight rows once per window (from L2) and multiplies N-row tiles padded to 64 (49 of them used at
window 7). Narrow blocks gain (Swin's stages 1 and 2, and every block at small batches); wide ones may not,
so the passes use it only where it measured faster than the qkv GEMM and the attention kernel.

Windows of up to 64 tokens (window 7 or 8), head width d a power of two in 16..128, bf16 or fp16 (fp32 with
IEEE dots, for the tests); no gradient.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels import _common
from workbench.kernels._common import _INTERPRET, SOFT_RTNE, cdiv, launch, next_pow2, to_dtype
from workbench.kernels.window_attention import (_FWD_CONFIGS, _bias_mask_tile, _dot, _new_buffer, _precision,
                                                _quick_bench, _store_rows)

MAX_TOKENS = 64         # windows of up to 64 tokens: one 64-row tile holds every query and key
_INTERPRET_CONFIG = {"G": 2, "num_warps": 4}
_KEY = ["N", "D", "NH", "NW", "C"]


@triton.jit
def _project(acc, x, W, rows, offs_k, k_ok, C, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + x @ W[rows, offs_k]^T (W row-major, C columns)."""
    w = tl.load(W + rows[:, None] * C + offs_k[None, :], mask=k_ok[None, :], other=0.0)
    return acc + _dot(x, tl.trans(w), PRECISION, UPCAST)


@triton.jit
def _finish(acc, BQKV, rows, dtype: tl.constexpr, HAS_QKV_BIAS: tl.constexpr, SOFT_RTNE: tl.constexpr):
    """The projection's fp32 sum plus its bias, rounded once to the activations' dtype."""
    if HAS_QKV_BIAS:
        acc = acc + tl.load(BQKV + rows).to(tl.float32)[None, :]
    return to_dtype(acc, dtype, SOFT_RTNE)


@triton.jit(do_not_specialize=["B_PER_W", "NW", "NH"])
def _qkv_attention_fwd_kernel(
    X, W, BQKV, BIAS, MASK, INDEX, O,
    so_b, so_h, so_n, so_d,
    scale, B_PER_W, G: tl.constexpr, NW, NH, C: tl.constexpr, N: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr, HAS_QKV_BIAS: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, TABLE: tl.constexpr, SOFT_RTNE: tl.constexpr,
):
    """Program (window group, head h): for windows b = i * NW + w, i in the group, x (N, C) rows of X
    (B*nW, N, C) -> q, k, v of head h (rows h*D, C + h*D, 2C + h*D of W (3C, C)) -> softmax(q k^T * scale
    + bias[h] + mask[w]) v -> O's rows (b, :, h, :)."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    w = pid % NW
    i_start = (pid // NW) * G
    i_end = tl.minimum(i_start + G, B_PER_W)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    row_ok = offs_n < N
    q_rows = h * D + offs_d
    k_rows = C + q_rows
    v_rows = 2 * C + q_rows
    dtype: tl.constexpr = X.dtype.element_ty
    qk_scale = tl.cast(scale, tl.float32) * 1.4426950408889634
    bias = _bias_mask_tile(BIAS, MASK, INDEX, h, w, offs_n, offs_n, N, NH, HAS_MASK, TABLE)
    for i in range(i_start, i_end):
        b = (i * NW + w).to(tl.int64)
        q = tl.zeros((BLOCK_N, D), dtype=tl.float32)
        k = tl.zeros((BLOCK_N, D), dtype=tl.float32)
        v = tl.zeros((BLOCK_N, D), dtype=tl.float32)
        for k0 in range(0, C, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < C
            x = tl.load(X + b * N * C + offs_n[:, None] * C + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            q = _project(q, x, W, q_rows, offs_k, k_ok, C, PRECISION, UPCAST)
            k = _project(k, x, W, k_rows, offs_k, k_ok, C, PRECISION, UPCAST)
            v = _project(v, x, W, v_rows, offs_k, k_ok, C, PRECISION, UPCAST)
        q = _finish(q, BQKV, q_rows, dtype, HAS_QKV_BIAS, SOFT_RTNE)
        k = _finish(k, BQKV, k_rows, dtype, HAS_QKV_BIAS, SOFT_RTNE)
        v = _finish(v, BQKV, v_rows, dtype, HAS_QKV_BIAS, SOFT_RTNE)
        # rows past N hold the bias alone: their keys are -inf in `bias`, their outputs are not stored
        s = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale + bias     # base-2 logits
        m = tl.max(s, 1)
        p = tl.exp2(s - m[:, None])
        o = _dot(p.to(dtype), v, PRECISION, UPCAST) / tl.sum(p, 1)[:, None]
        _store_rows(O, o, b, h, so_b, so_h, so_n, so_d, offs_n, N, D)


if _INTERPRET:
    _kernel = _qkv_attention_fwd_kernel
elif not _common.AUTOTUNE:
    _kernel = triton.autotune(_FWD_CONFIGS[:1], key=_KEY)(_qkv_attention_fwd_kernel)
else:
    _kernel = triton.autotune(_FWD_CONFIGS, key=_KEY, do_bench=_quick_bench)(_qkv_attention_fwd_kernel)


def applies(tokens: int, channels: int, num_heads: int) -> bool:
    """Whether the kernel takes a block of windows of `tokens` tokens, `channels` wide in `num_heads` heads."""
    if num_heads < 1 or channels % num_heads:
        return False
    d = channels // num_heads
    return 0 < tokens <= MAX_TOKENS and 16 <= d <= 128 and d & (d - 1) == 0 and channels % 16 == 0


def qkv_window_attention(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rel_bias: torch.Tensor,
                         mask: torch.Tensor | None, scale: float, num_heads: int,
                         index: torch.Tensor | None = None) -> torch.Tensor:
    """x (B*nW, N, C) windows, weight (3C, C), bias (3C,) or None: timm's qkv Linear and window attention of
    num_heads heads in one launch -> (B*nW, N, C) in x's dtype, each token's heads side by side (the proj
    Linear's input). rel_bias (nH, N, N), or with `index` (N, N) the relative-position table (n_table, nH);
    mask (nW, N, N) or None (B*nW divisible by nW). Inference: no gradient is recorded."""
    if x.dim() != 3 or weight.dim() != 2:
        raise ValueError(f"qkv_window_attention: x must be (B*nW, N, C) and weight (3C, C), got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")
    bnw, n, c = x.shape
    if tuple(weight.shape) != (3 * c, c) or (bias is not None and tuple(bias.shape) != (3 * c,)):
        raise ValueError(f"qkv_window_attention: weight must be (3C, C) = {(3 * c, c)} and bias (3C,), got "
                         f"{tuple(weight.shape)} and {None if bias is None else tuple(bias.shape)}")
    if not applies(n, c, num_heads):
        raise ValueError(f"qkv_window_attention: {n} tokens, {c} channels in {num_heads} heads: the kernel takes "
                         f"windows of up to {MAX_TOKENS} tokens and head widths that are powers of two in 16..128")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or weight.dtype != x.dtype:
        raise ValueError(f"qkv_window_attention: x and weight must share one float dtype, got {x.dtype} and "
                         f"{weight.dtype}")
    if mask is not None and (mask.dim() != 3 or tuple(mask.shape[1:]) != (n, n) or bnw % mask.shape[0]):
        raise ValueError(f"qkv_window_attention: mask must be (nW, N, N) with B*nW divisible by nW, got "
                         f"{tuple(mask.shape)}")
    d = c // num_heads
    nw = 1 if mask is None else mask.shape[0]
    x, weight, rel_bias = x.contiguous(), weight.contiguous(), rel_bias.contiguous()
    out = _new_buffer((bnw, n, num_heads, d), x.dtype, x.device)
    if bnw == 0:
        return out.view(bnw, n, c)
    extra = dict(_INTERPRET_CONFIG) if _INTERPRET else {}
    grid = lambda meta: (nw * cdiv(bnw // nw, meta["G"]), num_heads)  # noqa: E731
    launch(_kernel)[grid](
        x, weight, bias.contiguous() if bias is not None else weight, rel_bias,
        mask.contiguous() if mask is not None else rel_bias, index.contiguous() if index is not None else rel_bias,
        out, out.stride(0), out.stride(2), out.stride(1), out.stride(3),
        float(scale), bnw // nw, NW=nw, NH=num_heads, C=c, N=n, D=d, BLOCK_N=max(16, next_pow2(n)),
        BLOCK_K=min(64, max(16, next_pow2(c))), HAS_MASK=mask is not None, HAS_QKV_BIAS=bias is not None,
        PRECISION=_precision(x.dtype), UPCAST=_INTERPRET and x.dtype == torch.bfloat16, TABLE=index is not None,
        SOFT_RTNE=SOFT_RTNE, **extra,
    )
    return out.view(bnw, n, c)
