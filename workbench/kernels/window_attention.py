"""Fused window attention (Swin W-MSA / SW-MSA) forward and backward in Triton.

    out = softmax(q @ k^T * scale + rel_bias[h] + mask[b % nW]) @ v

per batch-window b and head h, with q, k, v of shape (B*nW, nH, N, d): N is the window area
(49 for a 7x7 window, 144 for 12x12; any N <= 256), d a power of two in 16..128.

Design (why it is shaped this way):
  * A window is small (N <= 256): the N x N scores live in registers only and are never written to
    global memory; neither is an expanded bias or mask. Padded keys get -inf.
  * Programs loop over G batch-windows b = i * nW + w, i in [g*G, (g+1)*G), of one window position w
    and head h. All of them share rel_bias[h] and mask[w], so a bias/mask tile is loaded once per
    program (or per query tile) and kept in registers.
  * Up to 64 keys (N <= 64): grid (nW * n_groups, nH), one program owns whole windows, N is padded to
    BLOCK_N = next_pow2(N) (49 -> 64) and keys are never tiled: the softmax is exact (no online
    rescaling). Queries run in tiles of BLOCK_M rows (one 64-row tile, or 32-row tiles; the backward's
    autotuner picks).
  * Beyond 64 keys (N in 65..256) padding every window to one next_pow2(N) tile wastes work (144 -> 256
    keys) and makes a one-kernel backward hold (256, d) fp32 dk/dv accumulators per program and, with
    several query tiles, read-modify-write its whole N x N fp32 d_bias slot for every window. So the
    keys run in blocks of KB = 64 (at most 4), the last one KT = next_pow2 of what is left, at least 16
    (144 = 64 + 64 + 16: nothing padded), and query tiles are a grid axis:
      - forward: grid (nW * n_groups, nH, cdiv(N, BLOCK_M)); per window an online softmax over the key
        blocks (running max and sum in base 2), the bias/mask tile of each (query tile, key block)
        loaded once per program.
      - backward in two kernels, without atomics. dq + d_bias (same grid): per window and key block it
        recomputes P from the LSE, ds = P * (dP - delta) with delta = rowsum(dO * O), which it also stores
        (fp32, (B*nW, nH, N)), dq += ds K; the d_bias of its rows is summed over the G windows in registers
        (one (BLOCK_M, KB) accumulator per key block) and stored once into those rows of its slot. dk, dv
        (grid (nW * n_groups, nH, cdiv(N, 64))): a program owns one key block and runs over every query of
        its windows, in 64-row blocks unrolled like the key blocks, their bias tiles held in registers
        across the windows (or in BLOCK_M-row tiles loaded per window): dv += P^T dO, dk += ds^T Q.
    BLOCK_M and where the bias tiles live (BIAS_REGS) are config values of these kernels.
  * Forward saves the row logsumexp (fp32, base-2, shape (B*nW, nH, N)); backward recomputes P.
    With every key in one tile (N <= 64) the backward takes rowsum(dO * O) as rowsum(P * dP) in fp32,
    which needs no read of O and is exact against the unrounded output; the key-tiled dq kernel reads O.
  * d_bias without a float-atomic storm: every backward program sums dS over its G windows in
    registers (one query tile) or in its own slot of a partial buffer (several tiles), and writes
    one fp32 slot of shape (N, N) into partial[g, w, h] (beyond 64 keys, the programs of the query
    tiles each write their own rows of it). A torch .sum over (g, w) finishes it.
    Nothing is contended, and the result is deterministic (same order every run).
  * The output is allocated as (B*nW, N, nH, d) and returned as the (B*nW, nH, N, d) view, so
    timm's `x.transpose(1, 2).reshape(B_, N, C)` after attention is free (no copy).
  * fp16/bf16 inputs use tensor-core dots with fp32 accumulation; fp32 inputs use
    input_precision="ieee" (no TF32) so results meet fp32 tolerances.

  * Entry points: `fused_window_attention(q, k, v, ...)` and `fused_window_attention_qkv(qkv, ...)`
    for timm's packed (B*nW, N, 3, nH, d) qkv, whose backward writes dq, dk, dv straight into one
    packed gradient (no autograd stack + reshape copies). Their host functions are torch.library
    operators (_common.kernel_op): under torch.compile on a GPU they are triton_ops, which Inductor
    traces into and launches itself; under Triton's CPU interpreter or with symbolic shapes each call is
    one opaque custom op.

Autotuning (num_warps x num_stages x windows-per-program G, and BLOCK_M where a config sets it) is keyed
on (N, D, NH, NW). It is off under TRITON_INTERPRET=1, where a single config keeps CPU tests fast, and
SWINBENCH_AUTOTUNE=0 pins the first config of each kernel on a GPU (docs/debugging.md).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from workbench.kernels.quant import quantize_static
from workbench.kernels._common import (_INTERPRET, AUTOTUNE, SOFT_RTNE, cdiv, require_compute_dtype, kernel_op, launch, next_pow2, to_dtype,
                                      tracing)

# Test hook: when True, every buffer a kernel must fill is NaN-filled first, so an element the
# kernel forgets to write fails the comparison instead of passing by luck.
POISON_BUFFERS = False

LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot with fp32 accumulation. UPCAST (interpreter + bf16 only): the Triton CPU interpreter
    multiplies bf16 operands as raw integers, so upcast them to fp32 there."""
    if UPCAST:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a, b, input_precision=PRECISION)
    return r


@triton.jit
def _bias_mask_tile(BIAS, MASK, INDEX, h, w, offs_m, offs_n, N, NH, HAS_MASK: tl.constexpr, TABLE: tl.constexpr):
    """fp32 (BLOCK_M, BLOCK_N) tile of (rel_bias[h] + mask[w]) * log2(e); padded keys -> -inf.
    TABLE: BIAS is the relative-position table (n_table, NH) and rel_bias[h, i, j] = BIAS[INDEX[i, j], h],
    gathered here (once per tile and program) instead of from an (NH, N, N) tensor built beforehand."""
    row_ok = offs_m < N
    key_ok = offs_n < N
    ij = offs_m[:, None] * N + offs_n[None, :]
    ok = row_ok[:, None] & key_ok[None, :]
    if TABLE:
        idx = tl.load(INDEX + ij, mask=ok, other=0)
        t = tl.load(BIAS + idx * NH + h, mask=ok, other=0.0).to(tl.float32)
    else:
        t = tl.load(BIAS + h * N * N + ij, mask=ok, other=0.0).to(tl.float32)
    if HAS_MASK:
        t += tl.load(MASK + w * N * N + ij, mask=ok, other=0.0).to(tl.float32)
    t = t * 1.4426950408889634
    return tl.where(key_ok[None, :], t, float("-inf"))


@triton.jit
def _load_rows(PTR, b, h, s_b, s_h, s_n, s_d, offs, N, D: tl.constexpr):
    """(len(offs), D) rows offs of one (window, head) matrix; rows past N read as 0."""
    offs_d = tl.arange(0, D)
    return tl.load(PTR + b * s_b + h * s_h + offs[:, None] * s_n + offs_d[None, :] * s_d,
                   mask=(offs < N)[:, None], other=0.0)


@triton.jit
def _store_rows(PTR, x, b, h, s_b, s_h, s_n, s_d, offs, N, D: tl.constexpr):
    offs_d = tl.arange(0, D)
    tl.store(PTR + b * s_b + h * s_h + offs[:, None] * s_n + offs_d[None, :] * s_d,
             x.to(PTR.dtype.element_ty), mask=(offs < N)[:, None])


@triton.jit
def _widen(x, IN_Q: tl.constexpr):
    """IN_Q: rows loaded as e4m3 (as bytes under the interpreter) to bf16, which holds every e4m3 value
    exactly (their static scale is applied to the logits and the output, not here)."""
    if IN_Q:
        if x.dtype == tl.uint8:
            x = x.to(tl.float8e4nv, bitcast=True)
        x = x.to(tl.bfloat16)
    return x


@triton.jit
def _store_out(O, o, b, h, so_b, so_h, so_n, so_d, offs, N, D: tl.constexpr, OS, OUT_Q: tl.constexpr):
    """The output rows, in O's dtype; OUT_Q: quantized to e4m3 at the static scale *OS (the next Linear's
    input, quantize_static's math)."""
    if OUT_Q:
        o = quantize_static(o, OS, 448.0, False)
    _store_rows(O, o, b, h, so_b, so_h, so_n, so_d, offs, N, D)


@triton.jit(do_not_specialize=["B_PER_W", "NW", "NH"])
def _window_attention_fwd_kernel(
    Q, K, V, BIAS, MASK, INDEX, O, LSE, COS,
    sq_b, sq_h, sq_n, sq_d,
    sk_b, sk_h, sk_n, sk_d,
    sv_b, sv_h, sv_n, sv_d,
    so_b, so_h, so_n, so_d,
    scale, B_PER_W, G: tl.constexpr,
    NW, NH, N: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, TABLE: tl.constexpr, COSINE: tl.constexpr = False, SOFT_RTNE: tl.constexpr = False,
    QS=None, OS=None, IN_Q: tl.constexpr = False, OUT_Q: tl.constexpr = False,
):
    """COSINE: q and k come raw and are normalized here (_cosine; q times the logit scale COS[h]). IN_Q:
    q, k and v in e4m3 at the static scale *QS (the qkv GEMM's output, written quantized); OUT_Q: the
    output written in e4m3 at the static scale *OS (inference: no LSE)."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    w = pid % NW
    g = pid // NW
    i_start = g * G
    i_end = tl.minimum(i_start + G, B_PER_W)
    offs_n = tl.arange(0, BLOCK_N)
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    qk_scale = scale * 1.4426950408889634
    v_scale = 1.0
    if IN_Q:
        v_scale = tl.load(QS)
        qk_scale = qk_scale * v_scale * v_scale
    # Query tiles outer, windows inner: the bias/mask tile is loaded once per tile per program.
    for m0 in range(0, N, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        row_ok = offs_m < N
        bias = _bias_mask_tile(BIAS, MASK, INDEX, h, w, offs_m, offs_n, N, NH, HAS_MASK, TABLE)
        for i in range(i_start, i_end):
            b = (i * NW + w).to(tl.int64)
            q = _widen(_load_rows(Q, b, h, sq_b, sq_h, sq_n, sq_d, offs_m, N, D), IN_Q)
            k = _widen(_load_rows(K, b, h, sk_b, sk_h, sk_n, sk_d, offs_n, N, D), IN_Q)
            v = _widen(_load_rows(V, b, h, sv_b, sv_h, sv_n, sv_d, offs_n, N, D), IN_Q)
            if COSINE:
                q = _cosine(q, COS, h, True, SOFT_RTNE)
                k = _cosine(k, COS, h, False, SOFT_RTNE)
            s = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale + bias  # base-2 logits
            m = tl.max(s, 1)
            p = tl.exp2(s - m[:, None])
            l = tl.sum(p, 1)
            o = _dot(p.to(v.dtype), v, PRECISION, UPCAST) / l[:, None]
            if IN_Q:
                o = o * v_scale
            _store_out(O, o, b, h, so_b, so_h, so_n, so_d, offs_m, N, D, OS, OUT_Q)
            if not OUT_Q:
                tl.store(LSE + (b * NH + h) * N + offs_m, m + tl.log2(l), mask=row_ok)


@triton.jit(do_not_specialize=["B_PER_W", "NW", "NH", "FILL_SLOTS"])
def _window_attention_bwd_kernel(
    Q, K, V, O, DO, LSE, BIAS, MASK, INDEX, DQ, DK, DV, DBIAS_PARTIAL,
    sq_b, sq_h, sq_n, sq_d,
    sk_b, sk_h, sk_n, sk_d,
    sv_b, sv_h, sv_n, sv_d,
    so_b, so_h, so_n, so_d,
    sdo_b, sdo_h, sdo_n, sdo_d,
    sdq_b, sdq_h, sdq_n, sdq_d,
    sdk_b, sdk_h, sdk_n, sdk_d,
    sdv_b, sdv_h, sdv_n, sdv_d,
    scale, B_PER_W, G: tl.constexpr, FILL_SLOTS, dkv_off,
    NW, NH, N: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, COMPUTE_DBIAS: tl.constexpr, PACKED: tl.constexpr, TABLE: tl.constexpr,
):
    # PACKED: dq, dk, dv live in one buffer passed as DQ, dk at DQ + dkv_off and dv at DQ + 2 dkv_off
    # elements (DK and DV are not written), so that a traced launch mutates one whole tensor rather
    # than three views of it (Inductor would copy views in and out around the kernel).
    if PACKED:
        DK = DQ + dkv_off
        DV = DQ + 2 * dkv_off
    pid = tl.program_id(0)
    h = tl.program_id(1)
    w = pid % NW
    g = pid // NW
    i_start = g * G
    i_end = tl.minimum(i_start + G, B_PER_W)
    offs_n = tl.arange(0, BLOCK_N)
    key_ok = offs_n < N
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    qk_scale = scale * 1.4426950408889634
    SINGLE_TILE: tl.constexpr = BLOCK_M == BLOCK_N
    # This program's own (N, N) slot of the d_bias partial buffer (n_groups, NW, NH, N, N).
    dbias_slot = DBIAS_PARTIAL + ((g * NW + w) * NH + h).to(tl.int64) * N * N
    if SINGLE_TILE:
        offs_m0 = tl.arange(0, BLOCK_M)
        bias0 = _bias_mask_tile(BIAS, MASK, INDEX, h, w, offs_m0, offs_n, N, NH, HAS_MASK, TABLE)
        dbias_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(i_start, i_end):
        b = (i * NW + w).to(tl.int64)
        k = _load_rows(K, b, h, sk_b, sk_h, sk_n, sk_d, offs_n, N, D)
        v = _load_rows(V, b, h, sv_b, sv_h, sv_n, sv_d, offs_n, N, D)
        dk = tl.zeros((BLOCK_N, D), dtype=tl.float32)
        dv = tl.zeros((BLOCK_N, D), dtype=tl.float32)
        for m0 in range(0, N, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            row_ok = offs_m < N
            if SINGLE_TILE:
                bias = bias0
            else:
                bias = _bias_mask_tile(BIAS, MASK, INDEX, h, w, offs_m, offs_n, N, NH, HAS_MASK, TABLE)
            q = _load_rows(Q, b, h, sq_b, sq_h, sq_n, sq_d, offs_m, N, D)
            do = _load_rows(DO, b, h, sdo_b, sdo_h, sdo_n, sdo_d, offs_m, N, D)
            lse = tl.load(LSE + (b * NH + h) * N + offs_m, mask=row_ok, other=0.0)
            s = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale + bias
            p = tl.exp2(s - lse[:, None])  # padded keys: exp2(-inf) = 0; padded rows: do = 0
            dv += _dot(tl.trans(p.to(do.dtype)), do, PRECISION, UPCAST)
            dp = _dot(do, tl.trans(v), PRECISION, UPCAST)
            # Every key of the row is in this tile, so rowsum(dO * O) is taken as rowsum(P * dP) in
            # fp32: the same sum against the unrounded output, not the stored half-precision one.
            delta = tl.sum(p * dp, 1)
            ds = p * (dp - delta[:, None])  # d loss / d (scores + bias + mask)
            dq = _dot(ds.to(k.dtype), k, PRECISION, UPCAST) * scale
            _store_rows(DQ, dq, b, h, sdq_b, sdq_h, sdq_n, sdq_d, offs_m, N, D)
            dk += _dot(tl.trans(ds.to(q.dtype)), q, PRECISION, UPCAST)
            if COMPUTE_DBIAS:
                if SINGLE_TILE:
                    dbias_acc += ds
                else:
                    # Several query tiles: read-modify-write this program's own slot (no other
                    # program touches it). The barrier orders one thread's store before another
                    # thread's load of the same address in the next window.
                    ij = offs_m[:, None] * N + offs_n[None, :]
                    ok = row_ok[:, None] & key_ok[None, :]
                    prev = tl.load(dbias_slot + ij, mask=ok & (i > i_start), other=0.0)
                    tl.store(dbias_slot + ij, prev + ds, mask=ok)
                    tl.debug_barrier()
        _store_rows(DK, dk * scale, b, h, sdk_b, sdk_h, sdk_n, sdk_d, offs_n, N, D)
        _store_rows(DV, dv, b, h, sdv_b, sdv_h, sdv_n, sdv_d, offs_n, N, D)
    if COMPUTE_DBIAS:
        if SINGLE_TILE:
            ij = offs_m0[:, None] * N + offs_n[None, :]
            ok = (offs_m0 < N)[:, None] & key_ok[None, :]
            tl.store(dbias_slot + ij, dbias_acc, mask=ok)
        # Slots past this G's groups, up to FILL_SLOTS, are zeroed by the last group's programs, so that
        # the host can sum FILL_SLOTS slots without knowing which G the autotuner chose (traced calls).
        n_groups = tl.cdiv(B_PER_W, G)
        if g == n_groups - 1:
            for s in range(n_groups, FILL_SLOTS):
                slot = DBIAS_PARTIAL + ((s * NW + w) * NH + h).to(tl.int64) * N * N
                for m0 in range(0, N, BLOCK_M):
                    offs_m = m0 + tl.arange(0, BLOCK_M)
                    ok = (offs_m < N)[:, None] & key_ok[None, :]
                    tl.store(slot + offs_m[:, None] * N + offs_n[None, :],
                             tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), mask=ok)


# --------------------------------------------------------------------------------------------
# Kernels for windows of more than 64 tokens: keys in blocks of KB = 64
# --------------------------------------------------------------------------------------------
@triton.jit
def _cosine(x, COS, h, SCALED: tl.constexpr, SOFT_RTNE: tl.constexpr):
    """SwinV2's cosine-attention input from raw rows x (R, D): x / max(||x||, 1e-12) (F.normalize's eps),
    times the head's logit scale COS[h] when SCALED (q), in fp32 and rounded once to x's dtype: the bits
    kernels.cosine's cosine_rows_fwd writes (same order of operations)."""
    xf = x.to(tl.float32)
    r = 1.0 / tl.maximum(tl.sqrt(tl.sum(xf * xf, 1)), 1e-12)
    y = xf * r[:, None]
    if SCALED:
        y = y * tl.load(COS + h)
    return to_dtype(y, x.dtype, SOFT_RTNE)


@triton.jit
def _store_dbias_tile(SLOT, x, offs_m, n0, N, KB: tl.constexpr):
    """Rows offs_m, columns [n0, n0 + KB) of one (N, N) d_bias slot; outside N x N nothing."""
    offs_n = n0 + tl.arange(0, KB)
    ok = (offs_m < N)[:, None] & (offs_n < N)[None, :]
    tl.store(SLOT + offs_m[:, None] * N + offs_n[None, :], x, mask=ok)


@triton.jit
def _key_block_bias(BIAS, MASK, INDEX, h, w, offs_m, j: tl.constexpr, N, NH, HAS_MASK: tl.constexpr,
                    TABLE: tl.constexpr, KT: tl.constexpr):
    """The bias/mask tile of query rows offs_m against key block j of the key-tiled kernels: keys
    [64 j, 64 j + 64), the last block (j = cdiv(N, 64) - 1) KT wide."""
    KB: tl.constexpr = 64
    LAST: tl.constexpr = (N + KB - 1) // KB - 1
    WJ: tl.constexpr = KT if j == LAST else KB
    return _bias_mask_tile(BIAS, MASK, INDEX, h, w, offs_m, j * KB + tl.arange(0, WJ), N, NH, HAS_MASK, TABLE)


@triton.jit
def _key_block_biases(BIAS, MASK, INDEX, h, w, offs_m, N, NH, HAS_MASK: tl.constexpr, TABLE: tl.constexpr,
                      KT: tl.constexpr):
    """The tiles of every key block (_key_block_bias), for a program that holds them across its windows;
    blocks past the last are returned as block 0's tile (never used)."""
    NKB: tl.constexpr = (N + 63) // 64
    b0 = _key_block_bias(BIAS, MASK, INDEX, h, w, offs_m, 0, N, NH, HAS_MASK, TABLE, KT)
    b1 = _key_block_bias(BIAS, MASK, INDEX, h, w, offs_m, 1, N, NH, HAS_MASK, TABLE, KT)
    if NKB > 2:
        b2 = _key_block_bias(BIAS, MASK, INDEX, h, w, offs_m, 2, N, NH, HAS_MASK, TABLE, KT)
    else:
        b2 = b0
    if NKB > 3:
        b3 = _key_block_bias(BIAS, MASK, INDEX, h, w, offs_m, 3, N, NH, HAS_MASK, TABLE, KT)
    else:
        b3 = b0
    return b0, b1, b2, b3


@triton.jit
def _fwd_key_block(q, acc, m_i, l_i, bias, K, V, b, h, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
                   n0, qk_scale, N, D: tl.constexpr, KB: tl.constexpr, PRECISION: tl.constexpr,
                   UPCAST: tl.constexpr, COSINE: tl.constexpr, SOFT_RTNE: tl.constexpr, IN_Q: tl.constexpr = False):
    """One online-softmax step over keys [n0, n0 + KB): (acc, running max, running sum), base 2.
    COSINE: the keys come raw and are normalized here. IN_Q: keys and values in e4m3 (_widen)."""
    offs_n = n0 + tl.arange(0, KB)
    k = _widen(_load_rows(K, b, h, sk_b, sk_h, sk_n, sk_d, offs_n, N, D), IN_Q)
    if COSINE:
        k = _cosine(k, K, h, False, SOFT_RTNE)
    v = _widen(_load_rows(V, b, h, sv_b, sv_h, sv_n, sv_d, offs_n, N, D), IN_Q)
    s = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale + bias  # padded keys: bias is -inf
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row with no finite key yet (a -inf mask over the whole block): subtract 0, not -inf (-inf - -inf is NaN)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)  # 0 on the first block (m_i = -inf)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
    return acc, m_new, l_i


@triton.jit
def _tile_program(NW, N_TILES: tl.constexpr, TILE_FASTEST: tl.constexpr):
    """(w, g, tile) of a key-tiled program. TILE_FASTEST: the grid is (N_TILES * nW * n_groups, nH, 1) with
    the tile varying fastest, so a window's tiles run side by side and re-read its keys and values (or
    queries) from L2; else (nW * n_groups, nH, N_TILES), the tile slowest."""
    if TILE_FASTEST:
        pid = tl.program_id(0)
        tile = pid % N_TILES
        rest = pid // N_TILES
    else:
        rest = tl.program_id(0)
        tile = tl.program_id(2)
    return rest % NW, rest // NW, tile


@triton.jit(do_not_specialize=["B_PER_W", "NW", "NH"])
def _window_attention_fwd_tiled_kernel(
    Q, K, V, BIAS, MASK, INDEX, O, LSE, COS,
    sq_b, sq_h, sq_n, sq_d,
    sk_b, sk_h, sk_n, sk_d,
    sv_b, sv_h, sv_n, sv_d,
    so_b, so_h, so_n, so_d,
    scale, B_PER_W, G: tl.constexpr,
    NW, NH, N: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, TABLE: tl.constexpr, KT: tl.constexpr, BIAS_REGS: tl.constexpr,
    COSINE: tl.constexpr = False, SOFT_RTNE: tl.constexpr = False, TILE_FASTEST: tl.constexpr = False,
    QS=None, OS=None, IN_Q: tl.constexpr = False, OUT_Q: tl.constexpr = False,
):
    """Forward for 64 < N <= 256. Grid (nW * n_groups, nH, cdiv(N, BLOCK_M)) (or the tiles fastest along
    axis 0, TILE_FASTEST: _tile_program): program (w, g, h, m) owns
    query rows [m*BLOCK_M, (m+1)*BLOCK_M) of its G windows; keys in NKB <= 4 blocks, 64 wide but the
    last KT wide, with an online softmax. BIAS_REGS: the bias/mask tile of each (query tile, key block) is
    loaded once per program and held in registers, else once per window (from cache). IN_Q / OUT_Q: as
    the small kernel's."""
    KB: tl.constexpr = 64
    NKB: tl.constexpr = (N + KB - 1) // KB
    W1: tl.constexpr = KT if NKB == 2 else KB  # key block widths: block 0 is always full (N > 64)
    W2: tl.constexpr = KT if NKB == 3 else KB
    h = tl.program_id(1)
    w, g, m = _tile_program(NW, (N + BLOCK_M - 1) // BLOCK_M, TILE_FASTEST)
    i_start = g * G
    i_end = tl.minimum(i_start + G, B_PER_W)
    offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    qk_scale = scale * 1.4426950408889634
    v_scale = 1.0
    if IN_Q:
        v_scale = tl.load(QS)
        qk_scale = qk_scale * v_scale * v_scale
    if BIAS_REGS:
        bias0, bias1, bias2, bias3 = _key_block_biases(BIAS, MASK, INDEX, h, w, offs_m, N, NH, HAS_MASK, TABLE, KT)
    for i in range(i_start, i_end):
        b = (i * NW + w).to(tl.int64)
        q = _widen(_load_rows(Q, b, h, sq_b, sq_h, sq_n, sq_d, offs_m, N, D), IN_Q)
        if COSINE:
            q = _cosine(q, COS, h, True, SOFT_RTNE)
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        if not BIAS_REGS:
            bias0 = _key_block_bias(BIAS, MASK, INDEX, h, w, offs_m, 0, N, NH, HAS_MASK, TABLE, KT)
        acc, m_i, l_i = _fwd_key_block(q, acc, m_i, l_i, bias0, K, V, b, h, sk_b, sk_h, sk_n, sk_d,
                                       sv_b, sv_h, sv_n, sv_d, 0, qk_scale, N, D, KB, PRECISION, UPCAST,
                                       COSINE, SOFT_RTNE, IN_Q)
        if not BIAS_REGS:
            bias1 = _key_block_bias(BIAS, MASK, INDEX, h, w, offs_m, 1, N, NH, HAS_MASK, TABLE, KT)
        acc, m_i, l_i = _fwd_key_block(q, acc, m_i, l_i, bias1, K, V, b, h, sk_b, sk_h, sk_n, sk_d,
                                       sv_b, sv_h, sv_n, sv_d, KB, qk_scale, N, D, W1, PRECISION, UPCAST,
                                       COSINE, SOFT_RTNE, IN_Q)
        if NKB > 2:
            if not BIAS_REGS:
                bias2 = _key_block_bias(BIAS, MASK, INDEX, h, w, offs_m, 2, N, NH, HAS_MASK, TABLE, KT)
            acc, m_i, l_i = _fwd_key_block(q, acc, m_i, l_i, bias2, K, V, b, h, sk_b, sk_h, sk_n, sk_d,
                                           sv_b, sv_h, sv_n, sv_d, 2 * KB, qk_scale, N, D, W2, PRECISION, UPCAST,
                                           COSINE, SOFT_RTNE, IN_Q)
        if NKB > 3:
            if not BIAS_REGS:
                bias3 = _key_block_bias(BIAS, MASK, INDEX, h, w, offs_m, 3, N, NH, HAS_MASK, TABLE, KT)
            acc, m_i, l_i = _fwd_key_block(q, acc, m_i, l_i, bias3, K, V, b, h, sk_b, sk_h, sk_n, sk_d,
                                           sv_b, sv_h, sv_n, sv_d, 3 * KB, qk_scale, N, D, KT, PRECISION, UPCAST,
                                           COSINE, SOFT_RTNE, IN_Q)
        o = acc / l_i[:, None]
        if IN_Q:
            o = o * v_scale
        _store_out(O, o, b, h, so_b, so_h, so_n, so_d, offs_m, N, D, OS, OUT_Q)
        if not OUT_Q:
            tl.store(LSE + (b * NH + h) * N + offs_m, m_i + tl.log2(l_i), mask=offs_m < N)


@triton.jit
def _bwd_dq_key_block(q, do, lse, delta, dq, bias, K, V, b, h, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
                      n0, qk_scale, N, D: tl.constexpr, KB: tl.constexpr, PRECISION: tl.constexpr,
                      UPCAST: tl.constexpr):
    """Keys [n0, n0 + KB) of one query tile: (dq + ds @ k, ds), ds = d loss / d (scores + bias + mask)."""
    offs_n = n0 + tl.arange(0, KB)
    k = _load_rows(K, b, h, sk_b, sk_h, sk_n, sk_d, offs_n, N, D)
    v = _load_rows(V, b, h, sv_b, sv_h, sv_n, sv_d, offs_n, N, D)
    s = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale + bias
    p = tl.exp2(s - lse[:, None])  # padded keys: exp2(-inf) = 0; padded rows: do = 0
    dp = _dot(do, tl.trans(v), PRECISION, UPCAST)
    ds = p * (dp - delta[:, None])
    dq += _dot(ds.to(k.dtype), k, PRECISION, UPCAST)
    return dq, ds


@triton.jit(do_not_specialize=["B_PER_W", "NW", "NH", "FILL_SLOTS"])
def _window_attention_bwd_dq_kernel(
    Q, K, V, O, DO, LSE, BIAS, MASK, INDEX, DQ, DBIAS_PARTIAL, DELTA,
    sq_b, sq_h, sq_n, sq_d,
    sk_b, sk_h, sk_n, sk_d,
    sv_b, sv_h, sv_n, sv_d,
    so_b, so_h, so_n, so_d,
    sdo_b, sdo_h, sdo_n, sdo_d,
    sdq_b, sdq_h, sdq_n, sdq_d,
    scale, B_PER_W, G: tl.constexpr, FILL_SLOTS,
    NW, NH, N: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, COMPUTE_DBIAS: tl.constexpr, TABLE: tl.constexpr, BIAS_REGS: tl.constexpr,
    KT: tl.constexpr, TILE_FASTEST: tl.constexpr = False,
):
    """Backward for 64 < N <= 256, part 1: dq, d_bias and delta = rowsum(dO * O) (fp32, (B*nW, nH, N), for
    the dk/dv kernel). Grid as the tiled forward's; program (w, g, h, m) owns query rows
    [m*BLOCK_M, (m+1)*BLOCK_M) of its G windows. The d_bias of its rows, summed over the G windows in
    registers (one accumulator per key block), is stored once into those rows of the program's (N, N) slot
    partial[g, w, h]. BIAS_REGS: the bias/mask tiles stay in registers across the windows, else they are
    loaded again per window (fewer registers beside the d_bias accumulators; a config value).
    With a packed gradient DQ is the packed buffer itself (dq at offset 0)."""
    KB: tl.constexpr = 64
    NKB: tl.constexpr = (N + KB - 1) // KB
    W1: tl.constexpr = KT if NKB == 2 else KB  # key block widths: block 0 is always full (N > 64)
    W2: tl.constexpr = KT if NKB == 3 else KB
    h = tl.program_id(1)
    w, g, m = _tile_program(NW, (N + BLOCK_M - 1) // BLOCK_M, TILE_FASTEST)
    i_start = g * G
    i_end = tl.minimum(i_start + G, B_PER_W)
    offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < N
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    qk_scale = scale * 1.4426950408889634
    if BIAS_REGS:
        bias0, bias1, bias2, bias3 = _key_block_biases(BIAS, MASK, INDEX, h, w, offs_m, N, NH, HAS_MASK, TABLE, KT)
    if COMPUTE_DBIAS:
        db0 = tl.zeros((BLOCK_M, KB), dtype=tl.float32)
        db1 = tl.zeros((BLOCK_M, W1), dtype=tl.float32)
        if NKB > 2:
            db2 = tl.zeros((BLOCK_M, W2), dtype=tl.float32)
        if NKB > 3:
            db3 = tl.zeros((BLOCK_M, KT), dtype=tl.float32)
    for i in range(i_start, i_end):
        b = (i * NW + w).to(tl.int64)
        q = _load_rows(Q, b, h, sq_b, sq_h, sq_n, sq_d, offs_m, N, D)
        o = _load_rows(O, b, h, so_b, so_h, so_n, so_d, offs_m, N, D)
        do = _load_rows(DO, b, h, sdo_b, sdo_h, sdo_n, sdo_d, offs_m, N, D)
        lse = tl.load(LSE + (b * NH + h) * N + offs_m, mask=row_ok, other=0.0)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
        tl.store(DELTA + (b * NH + h) * N + offs_m, delta, mask=row_ok)
        dq = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        if not BIAS_REGS:
            bias0 = _key_block_bias(BIAS, MASK, INDEX, h, w, offs_m, 0, N, NH, HAS_MASK, TABLE, KT)
        dq, ds = _bwd_dq_key_block(q, do, lse, delta, dq, bias0, K, V, b, h, sk_b, sk_h, sk_n, sk_d,
                                   sv_b, sv_h, sv_n, sv_d, 0, qk_scale, N, D, KB, PRECISION, UPCAST)
        if COMPUTE_DBIAS:
            db0 += ds
        if not BIAS_REGS:
            bias1 = _key_block_bias(BIAS, MASK, INDEX, h, w, offs_m, 1, N, NH, HAS_MASK, TABLE, KT)
        dq, ds = _bwd_dq_key_block(q, do, lse, delta, dq, bias1, K, V, b, h, sk_b, sk_h, sk_n, sk_d,
                                   sv_b, sv_h, sv_n, sv_d, KB, qk_scale, N, D, W1, PRECISION, UPCAST)
        if COMPUTE_DBIAS:
            db1 += ds
        if NKB > 2:
            if not BIAS_REGS:
                bias2 = _key_block_bias(BIAS, MASK, INDEX, h, w, offs_m, 2, N, NH, HAS_MASK, TABLE, KT)
            dq, ds = _bwd_dq_key_block(q, do, lse, delta, dq, bias2, K, V, b, h, sk_b, sk_h, sk_n, sk_d,
                                       sv_b, sv_h, sv_n, sv_d, 2 * KB, qk_scale, N, D, W2, PRECISION, UPCAST)
            if COMPUTE_DBIAS:
                db2 += ds
        if NKB > 3:
            if not BIAS_REGS:
                bias3 = _key_block_bias(BIAS, MASK, INDEX, h, w, offs_m, 3, N, NH, HAS_MASK, TABLE, KT)
            dq, ds = _bwd_dq_key_block(q, do, lse, delta, dq, bias3, K, V, b, h, sk_b, sk_h, sk_n, sk_d,
                                       sv_b, sv_h, sv_n, sv_d, 3 * KB, qk_scale, N, D, KT, PRECISION, UPCAST)
            if COMPUTE_DBIAS:
                db3 += ds
        _store_rows(DQ, dq * scale, b, h, sdq_b, sdq_h, sdq_n, sdq_d, offs_m, N, D)
    if COMPUTE_DBIAS:
        slot = DBIAS_PARTIAL + ((g * NW + w) * NH + h).to(tl.int64) * N * N
        _store_dbias_tile(slot, db0, offs_m, 0, N, KB)
        _store_dbias_tile(slot, db1, offs_m, KB, N, W1)
        if NKB > 2:
            _store_dbias_tile(slot, db2, offs_m, 2 * KB, N, W2)
        if NKB > 3:
            _store_dbias_tile(slot, db3, offs_m, 3 * KB, N, KT)
        # Slots past this G's groups, up to FILL_SLOTS, are zeroed by the last group's programs (each its
        # own rows), so that traced calls can sum FILL_SLOTS slots whatever G the autotuner chose.
        n_groups = tl.cdiv(B_PER_W, G)
        if g == n_groups - 1:
            for s in range(n_groups, FILL_SLOTS):
                slot = DBIAS_PARTIAL + ((s * NW + w) * NH + h).to(tl.int64) * N * N
                for n0 in range(0, N, KB):
                    _store_dbias_tile(slot, tl.zeros((BLOCK_M, KB), dtype=tl.float32), offs_m, n0, N, KB)


@triton.jit
def _dkv_query_block(k, v, dk, dv, bias, Q, DO, LSE, DELTA, b, h, sq_b, sq_h, sq_n, sq_d,
                     sdo_b, sdo_h, sdo_n, sdo_d, m0, qk_scale, N, NH, D: tl.constexpr, QB: tl.constexpr,
                     PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Queries [m0, m0 + QB) against one key block: (dk + ds^T q, dv + p^T dO), unscaled."""
    offs_m = m0 + tl.arange(0, QB)
    row_ok = offs_m < N
    q = _load_rows(Q, b, h, sq_b, sq_h, sq_n, sq_d, offs_m, N, D)
    do = _load_rows(DO, b, h, sdo_b, sdo_h, sdo_n, sdo_d, offs_m, N, D)
    lse = tl.load(LSE + (b * NH + h) * N + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + (b * NH + h) * N + offs_m, mask=row_ok, other=0.0)
    s = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale + bias
    p = tl.exp2(s - lse[:, None])  # padded keys: exp2(-inf) = 0; padded rows: do = 0
    dv += _dot(tl.trans(p.to(do.dtype)), do, PRECISION, UPCAST)
    dp = _dot(do, tl.trans(v), PRECISION, UPCAST)
    ds = p * (dp - delta[:, None])
    dk += _dot(tl.trans(ds.to(q.dtype)), q, PRECISION, UPCAST)
    return dk, dv


@triton.jit
def _dkv_key_block(Q, K, V, DO, LSE, DELTA, BIAS, MASK, INDEX, DK, DV,
                   sq_b, sq_h, sq_n, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
                   sdo_b, sdo_h, sdo_n, sdo_d, sdk_b, sdk_h, sdk_n, sdk_d, sdv_b, sdv_h, sdv_n, sdv_d,
                   w, h, i_start, i_end, n0, scale, qk_scale, NW, NH, N: tl.constexpr, D: tl.constexpr,
                   KW: tl.constexpr, KT: tl.constexpr, BLOCK_M: tl.constexpr, HAS_MASK: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, TABLE: tl.constexpr, BIAS_REGS: tl.constexpr):
    """dk, dv of keys [n0, n0 + KW) of windows i_start..i_end-1. BIAS_REGS: queries in blocks of 64 (the
    last KT high), the bias/mask tile of each held in registers across the windows; else queries in tiles
    of BLOCK_M rows, each tile's bias/mask loaded per window (from cache)."""
    QB: tl.constexpr = 64
    NQB: tl.constexpr = (N + QB - 1) // QB
    H1: tl.constexpr = KT if NQB == 2 else QB  # query block heights: block 0 is always full (N > 64)
    H2: tl.constexpr = KT if NQB == 3 else QB
    offs_n = n0 + tl.arange(0, KW)
    if BIAS_REGS:
        bias0 = _bias_mask_tile(BIAS, MASK, INDEX, h, w, tl.arange(0, QB), offs_n, N, NH, HAS_MASK, TABLE)
        bias1 = _bias_mask_tile(BIAS, MASK, INDEX, h, w, QB + tl.arange(0, H1), offs_n, N, NH, HAS_MASK, TABLE)
        if NQB > 2:
            bias2 = _bias_mask_tile(BIAS, MASK, INDEX, h, w, 2 * QB + tl.arange(0, H2), offs_n, N, NH, HAS_MASK,
                                    TABLE)
        if NQB > 3:
            bias3 = _bias_mask_tile(BIAS, MASK, INDEX, h, w, 3 * QB + tl.arange(0, KT), offs_n, N, NH, HAS_MASK,
                                    TABLE)
    for i in range(i_start, i_end):
        b = (i * NW + w).to(tl.int64)
        k = _load_rows(K, b, h, sk_b, sk_h, sk_n, sk_d, offs_n, N, D)
        v = _load_rows(V, b, h, sv_b, sv_h, sv_n, sv_d, offs_n, N, D)
        dk = tl.zeros((KW, D), dtype=tl.float32)
        dv = tl.zeros((KW, D), dtype=tl.float32)
        if BIAS_REGS:
            dk, dv = _dkv_query_block(k, v, dk, dv, bias0, Q, DO, LSE, DELTA, b, h, sq_b, sq_h, sq_n, sq_d,
                                      sdo_b, sdo_h, sdo_n, sdo_d, 0, qk_scale, N, NH, D, QB, PRECISION, UPCAST)
            dk, dv = _dkv_query_block(k, v, dk, dv, bias1, Q, DO, LSE, DELTA, b, h, sq_b, sq_h, sq_n, sq_d,
                                      sdo_b, sdo_h, sdo_n, sdo_d, QB, qk_scale, N, NH, D, H1, PRECISION, UPCAST)
            if NQB > 2:
                dk, dv = _dkv_query_block(k, v, dk, dv, bias2, Q, DO, LSE, DELTA, b, h, sq_b, sq_h, sq_n, sq_d,
                                          sdo_b, sdo_h, sdo_n, sdo_d, 2 * QB, qk_scale, N, NH, D, H2, PRECISION,
                                          UPCAST)
            if NQB > 3:
                dk, dv = _dkv_query_block(k, v, dk, dv, bias3, Q, DO, LSE, DELTA, b, h, sq_b, sq_h, sq_n, sq_d,
                                          sdo_b, sdo_h, sdo_n, sdo_d, 3 * QB, qk_scale, N, NH, D, KT, PRECISION,
                                          UPCAST)
        else:
            for m0 in range(0, N, BLOCK_M):
                bias = _bias_mask_tile(BIAS, MASK, INDEX, h, w, m0 + tl.arange(0, BLOCK_M), offs_n, N, NH,
                                       HAS_MASK, TABLE)
                dk, dv = _dkv_query_block(k, v, dk, dv, bias, Q, DO, LSE, DELTA, b, h, sq_b, sq_h, sq_n, sq_d,
                                          sdo_b, sdo_h, sdo_n, sdo_d, m0, qk_scale, N, NH, D, BLOCK_M, PRECISION,
                                          UPCAST)
        _store_rows(DK, dk * scale, b, h, sdk_b, sdk_h, sdk_n, sdk_d, offs_n, N, D)
        _store_rows(DV, dv, b, h, sdv_b, sdv_h, sdv_n, sdv_d, offs_n, N, D)


@triton.jit(do_not_specialize=["B_PER_W", "NW", "NH"])
def _window_attention_bwd_dkv_kernel(
    Q, K, V, DO, LSE, DELTA, BIAS, MASK, INDEX, DK, DV,
    sq_b, sq_h, sq_n, sq_d,
    sk_b, sk_h, sk_n, sk_d,
    sv_b, sv_h, sv_n, sv_d,
    sdo_b, sdo_h, sdo_n, sdo_d,
    sdk_b, sdk_h, sdk_n, sdk_d,
    sdv_b, sdv_h, sdv_n, sdv_d,
    scale, B_PER_W, G: tl.constexpr, dkv_off,
    NW, NH, N: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, PACKED: tl.constexpr, TABLE: tl.constexpr, KT: tl.constexpr, BIAS_REGS: tl.constexpr,
    TILE_FASTEST: tl.constexpr = False,
):
    """Backward for 64 < N <= 256, part 2: dk and dv, with delta = rowsum(dO * O) from the dq kernel (O is
    not read). Grid (nW * n_groups, nH, cdiv(N, 64)) (or TILE_FASTEST, _tile_program): program (w, g, h, j)
    owns key block j of its G
    windows (64 keys, the last block KT) and runs over every query of each.
    PACKED: DK is the packed gradient buffer, dk at DK + dkv_off and dv at DK + 2 dkv_off (DV unused)."""
    KB: tl.constexpr = 64
    NKB: tl.constexpr = (N + KB - 1) // KB
    if PACKED:
        DV = DK + 2 * dkv_off
        DK = DK + dkv_off
    h = tl.program_id(1)
    w, g, j = _tile_program(NW, NKB, TILE_FASTEST)
    i_start = g * G
    i_end = tl.minimum(i_start + G, B_PER_W)
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    qk_scale = scale * 1.4426950408889634
    if KT == KB:  # every block 64 keys wide
        _dkv_key_block(Q, K, V, DO, LSE, DELTA, BIAS, MASK, INDEX, DK, DV,
                       sq_b, sq_h, sq_n, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
                       sdo_b, sdo_h, sdo_n, sdo_d, sdk_b, sdk_h, sdk_n, sdk_d, sdv_b, sdv_h, sdv_n, sdv_d,
                       w, h, i_start, i_end, j * KB, scale, qk_scale, NW, NH, N, D, KB, KT, BLOCK_M, HAS_MASK,
                       PRECISION, UPCAST, TABLE, BIAS_REGS)
    elif j < NKB - 1:  # a full block
        _dkv_key_block(Q, K, V, DO, LSE, DELTA, BIAS, MASK, INDEX, DK, DV,
                       sq_b, sq_h, sq_n, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
                       sdo_b, sdo_h, sdo_n, sdo_d, sdk_b, sdk_h, sdk_n, sdk_d, sdv_b, sdv_h, sdv_n, sdv_d,
                       w, h, i_start, i_end, j * KB, scale, qk_scale, NW, NH, N, D, KB, KT, BLOCK_M, HAS_MASK,
                       PRECISION, UPCAST, TABLE, BIAS_REGS)
    else:  # the last, narrower block
        _dkv_key_block(Q, K, V, DO, LSE, DELTA, BIAS, MASK, INDEX, DK, DV,
                       sq_b, sq_h, sq_n, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
                       sdo_b, sdo_h, sdo_n, sdo_d, sdk_b, sdk_h, sdk_n, sdk_d, sdv_b, sdv_h, sdv_n, sdv_d,
                       w, h, i_start, i_end, (NKB - 1) * KB, scale, qk_scale, NW, NH, N, D, KT, KT, BLOCK_M,
                       HAS_MASK, PRECISION, UPCAST, TABLE, BIAS_REGS)


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------
# nW, nH and B_PER_W are plain (non-specialized) ints, so one binary per (N, d, dtype, mask, G,
# num_warps, num_stages) serves every Swin stage: autotuning costs a few compiles, then only timed
# runs. Windows per program G is a constexpr: Inductor, launching the kernels of a traced step,
# passes autotuned config values only as constexprs. num_stages is the depth of Triton's prefetch of the
# windows' q/k/v(/o/dO) tiles into shared memory (cp.async): the pipeliner issues a window's loads at the
# end of the previous window's loop body, so at num_stages = 2 the loop waits for them as soon as they are
# issued (an async_wait of 0 outstanding groups in the sm_90 TTGIR) and only num_stages >= 3 keeps the next
# window's loads in flight while a window computes.
# Backward G starts at 8: the d_bias partial buffer costs 4*N*N/G bytes per (window, head), about
# 10% of the backward's own traffic at G = 8, and the autotuner times only the kernel, not the sum.
# Kept small: every config costs a compile and a timed run at each new shape (a model's first step).
# The forward (about 125 registers at 4 warps: four programs per SM) gains less from the deeper prefetch
# than the backward: timed alone on an H100 (Swin-B b64, masked, table bias), G = 16 with num_stages = 3
# took 34.5 us at stage 3 against 37.1 for the best config at 2 (G = 8); at stage 1 the best of each depth
# lie within 3% (108-111 us).
_FWD_CONFIGS = [triton.Config({"G": g}, num_warps=nw, num_stages=ns)
                for nw, ns, gs in ((4, 2, (4, 8, 16)), (8, 2, (4, 8)), (4, 3, (4, 8, 16))) for g in gs]
# Windows of up to 64 tokens (Swin's 7x7) fit one 64-row query tile, whose fp32 d_bias accumulator stays
# in registers across the program's windows, beside the bias tile; compiled for sm_90 that backward takes
# 249-255 registers at 4 warps and 234 at 8, without spilling (Triton 3.8; `tests/aot_compile_kernels.py
# --resources`): two programs per SM at 4 warps, one at 8. 32-row tiles take as many registers and add
# the d_bias slot's read-modify-write per window. The autotuner times both (the query-tile height is a
# config value there, not a host choice). Timed alone on an H100 (Triton 3.6; Swin-B b64's window-7 shapes,
# masked, table bias, the backward's host function with its table-gradient launch), 64-row tiles at 4 warps
# and G = 16 are the fastest: 188 us at stage 1 (4096 windows x 4 heads) and 55 us at stage 3 (256 x 16) with
# num_stages = 3, against 226 and 66 us at num_stages = 2 (no load in flight, above), 232 and 69 at 1, and 239
# and 72 at 3 with registers capped at 168; 8 warps took 1.7-2x as long, 32-row tiles 4-5x.
_BWD_SMALL_CONFIGS = ([triton.Config({"G": 16, "BLOCK_M": 64}, num_warps=4, num_stages=2, maxnreg=r) for r in (None, 168)]
                      + [triton.Config({"G": g, "BLOCK_M": 64}, num_warps=nw, num_stages=ns)
                       for nw, ns in ((4, 1), (8, 2), (4, 3)) for g in (8, 16)]
                      + [triton.Config({"G": g, "BLOCK_M": 32}, num_warps=8, num_stages=2) for g in (8, 16)])
# fp32 inputs (input_precision="ieee": CUDA-core dots, operands twice as wide) need more registers than the
# others: compiled for sm_90, the 4-warp configs at num_stages >= 2 leave ptxas at 32 registers and a 9 KB
# stack, and on an H100 (Triton 3.6) they gave wrong gradients for masked windows at d = 32 (all three of
# them; the key-tiled kernels' fp32 configs all match). fp32 takes the others, 8 warps first; a register
# cap is not relied on (Inductor drops maxnreg, above).
_BWD_SMALL_FP32_CONFIGS = sorted((c for c in _BWD_SMALL_CONFIGS if c.maxnreg is None and (c.num_warps == 8 or c.num_stages == 1)),
                                 key=lambda c: (-c.num_warps, -c.kwargs["BLOCK_M"], -c.kwargs["G"]))
# Windows of more than 64 tokens (the key-tiled kernels): the query-tile height is a config value, and
# BIAS_REGS whether a program holds its bias/mask tiles in registers across its windows (else it loads them
# again per window, from cache). Timed on an H200 at Swin-B 384's window-12 shapes (N = 144, d = 32,
# masked, table bias; Triton 3.6), the first config of each list was the fastest at stages 1 and 3: the
# forward's 64-row tiles at 4 warps with registers capped at 168 (3 programs per SM instead of 2; 1.2-1.5x
# the uncapped one), the dq/d_bias kernel's 16-row tiles (the only height that does not spill there: 168
# registers against 255 and a stack at 32 or 64 rows), and the dk/dv kernel with its 64-row query blocks
# unrolled and their bias tiles held over 16 windows (7x the per-window loop with 32-row tiles).
# num_stages = 1 lost everywhere. Inductor, which autotunes these kernels itself under torch.compile,
# drops maxnreg (a capped config runs uncapped there). At d = 128 the 64-row configs ask for more shared
# memory than an H200 has (their num_stages = 2 prefetch of every key block); Triton's autotuner drops a
# config that cannot launch (OutOfResources).
_FWD_TILED_CONFIGS = [triton.Config({"G": g, "BLOCK_M": bm, "BIAS_REGS": True}, num_warps=nw, num_stages=2, maxnreg=r)
                      for bm, nw, g, r in ((64, 4, 8, 168), (64, 4, 8, None), (64, 4, 4, 168), (32, 4, 8, None),
                                           (64, 8, 4, None))]
_BWD_DQ_CONFIGS = [triton.Config({"G": g, "BLOCK_M": bm, "BIAS_REGS": br}, num_warps=nw, num_stages=2, maxnreg=r)
                   for bm, nw, g, br, r in ((16, 4, 8, True, 128), (16, 4, 8, True, None), (16, 4, 16, True, None),
                                            (32, 4, 8, True, None), (64, 8, 16, True, None), (16, 4, 8, False, None))]
_BWD_DKV_CONFIGS = [triton.Config({"G": g, "BLOCK_M": bm, "BIAS_REGS": br}, num_warps=nw, num_stages=2, maxnreg=r)
                    for bm, nw, g, br, r in ((64, 4, 16, True, None), (64, 4, 8, True, None), (64, 4, 16, True, 168),
                                             (64, 8, 8, True, None), (32, 4, 4, False, None))]
# Each key-tiled list also holds its first two configs with the tiles fastest in the grid (TILE_FASTEST,
# _tile_program): where a stage's windows outgrow the L2 between a window's first and last tile (Swin-B
# 384's stage 1: 2,048 windows of 4 heads), the tiles slowest re-read every window's keys and values (the
# forward's and dq's) or queries (dk/dv's) from memory once per tile; side by side they share them in L2.
# The autotuner times both orders per shape; on an H100 it took the tiles fastest for 12 of Swin-B 384's 14
# (kernel, shape) pairs, so those copies come first and the config used untuned (SWINBENCH_AUTOTUNE=0) is one.
# Those two copies follow again at num_stages = 3 (the next window's tiles in flight while one computes:
# num_stages above). Timed on an H100 at Swin-B 384's stages 1 and 3 (batch 32; each kernel's config changed
# alone, the others at their first), they took the backward from 921 to 862 us at stage 1 and from 296 to
# 275 at stage 3 (dk/dv), from 920 to 879 and 297 to 288 (dq), and the forward from 272 to 262 and 85 to 84.
# At d = 128 they ask for more shared memory still; the untuned config stays one at num_stages = 2.
def _key_tiled_variants(configs: list) -> list:
    """configs, after their first two with the tiles fastest in the grid, then those two at num_stages = 3."""
    fastest = [triton.Config({**c.kwargs, "TILE_FASTEST": True}, num_warps=c.num_warps, num_stages=c.num_stages,
                             maxnreg=c.maxnreg) for c in configs[:2]]
    deeper = [triton.Config(c.kwargs, num_warps=c.num_warps, num_stages=3, maxnreg=c.maxnreg) for c in fastest]
    return fastest + deeper + configs


_FWD_TILED_CONFIGS = _key_tiled_variants(_FWD_TILED_CONFIGS)
_BWD_DQ_CONFIGS = _key_tiled_variants(_BWD_DQ_CONFIGS)
_BWD_DKV_CONFIGS = _key_tiled_variants(_BWD_DKV_CONFIGS)
_INTERPRET_CONFIG = {"G": 2, "num_warps": 4}
# The key-tiled kernels' config values under the interpreter (BIAS_REGS: every kernel's bias tiles held in
# registers; tests switch it off, with 32-row tiles, to run the per-window paths).
_TILED_INTERPRET_CONFIG = {"G": 2, "BLOCK_M": 64, "BIAS_REGS": True, "num_warps": 4}
_KEY_BLOCK = 64  # KB of the key-tiled kernels
_AUTOTUNE_KEY = ["N", "D", "NH", "NW"]
# The d_bias partial buffer has ceil(B_PER_W / G) slots per (w, h); sized for the smallest G of the
# kernels that write it.
_BWD_MIN_G = min(c.kwargs["G"] for c in _BWD_SMALL_CONFIGS + _BWD_DQ_CONFIGS)


def _quick_bench(fn, quantiles=None):
    # Short timing for autotune: candidates differ by tens of percent, not by noise.
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


if _INTERPRET:
    _fwd = _window_attention_fwd_kernel
    _bwd_small = _bwd_small_fp32 = _window_attention_bwd_kernel
    _fwd_tiled = _window_attention_fwd_tiled_kernel
    _bwd_dq = _window_attention_bwd_dq_kernel
    _bwd_dkv = _window_attention_bwd_dkv_kernel
elif not AUTOTUNE:
    _fwd = triton.autotune(_FWD_CONFIGS[:1], key=_AUTOTUNE_KEY)(_window_attention_fwd_kernel)
    _bwd_small = triton.autotune(_BWD_SMALL_CONFIGS[:1], key=_AUTOTUNE_KEY)(_window_attention_bwd_kernel)
    _bwd_small_fp32 = triton.autotune(_BWD_SMALL_FP32_CONFIGS[:1], key=_AUTOTUNE_KEY)(_window_attention_bwd_kernel)
    _fwd_tiled = triton.autotune(_FWD_TILED_CONFIGS[:1], key=_AUTOTUNE_KEY)(_window_attention_fwd_tiled_kernel)
    _bwd_dq = triton.autotune(_BWD_DQ_CONFIGS[:1], key=_AUTOTUNE_KEY)(_window_attention_bwd_dq_kernel)
    _bwd_dkv = triton.autotune(_BWD_DKV_CONFIGS[:1], key=_AUTOTUNE_KEY)(_window_attention_bwd_dkv_kernel)
else:
    _fwd = triton.autotune(_FWD_CONFIGS, key=_AUTOTUNE_KEY, do_bench=_quick_bench)(_window_attention_fwd_kernel)
    _bwd_small = triton.autotune(_BWD_SMALL_CONFIGS, key=_AUTOTUNE_KEY, do_bench=_quick_bench)(
        _window_attention_bwd_kernel)
    _bwd_small_fp32 = triton.autotune(_BWD_SMALL_FP32_CONFIGS, key=_AUTOTUNE_KEY, do_bench=_quick_bench)(
        _window_attention_bwd_kernel)
    _fwd_tiled = triton.autotune(_FWD_TILED_CONFIGS, key=_AUTOTUNE_KEY, do_bench=_quick_bench)(
        _window_attention_fwd_tiled_kernel)
    _bwd_dq = triton.autotune(_BWD_DQ_CONFIGS, key=_AUTOTUNE_KEY, do_bench=_quick_bench)(
        _window_attention_bwd_dq_kernel)
    _bwd_dkv = triton.autotune(_BWD_DKV_CONFIGS, key=_AUTOTUNE_KEY, do_bench=_quick_bench)(
        _window_attention_bwd_dkv_kernel)


def key_tiled_autotuners(keep) -> dict:
    """{module attribute: autotuner} of the three key-tiled kernels (_fwd_tiled, _bwd_dq, _bwd_dkv), each
    autotuned over the configs of its list that `keep(config)` accepts (a test or benchmark sets them in
    place of the module's own to run one kind of config alone)."""
    return {name: triton.autotune([c for c in configs if keep(c)], key=_AUTOTUNE_KEY)(kernel)
            for name, kernel, configs in (("_fwd_tiled", _window_attention_fwd_tiled_kernel, _FWD_TILED_CONFIGS),
                                          ("_bwd_dq", _window_attention_bwd_dq_kernel, _BWD_DQ_CONFIGS),
                                          ("_bwd_dkv", _window_attention_bwd_dkv_kernel, _BWD_DKV_CONFIGS))}


def _bwd_kernel(block_n: int, dtype: torch.dtype):
    """The backward launcher that writes the d_bias partials: up to 64 keys the one-tile kernel, whose
    configs also choose the query-tile height (_BWD_SMALL_CONFIGS; _BWD_SMALL_FP32_CONFIGS for fp32
    inputs), else the key-tiled dq/d_bias kernel."""
    if block_n > _KEY_BLOCK:
        return _bwd_dq
    return _bwd_small_fp32 if dtype == torch.float32 else _bwd_small


def _block_sizes(n: int) -> tuple[int, int]:
    block_n = max(16, next_pow2(n))
    # One query tile up to 64 keys. Beyond 64 keys only BLOCK_N is read (it picks the key-tiled kernels,
    # which take their query-tile height from their configs).
    block_m = block_n if block_n <= 64 else 32
    return block_m, block_n


def _precision(dtype: torch.dtype) -> str:
    # fp32 must not silently drop to TF32; half types ignore the setting (None = Triton default).
    return "ieee" if dtype == torch.float32 else None


def _new_buffer(shape, dtype, device) -> torch.Tensor:
    if POISON_BUFFERS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


MAX_WINDOW_TOKENS = 256   # the largest window (tokens) the kernels take: four 64-key blocks


def _check_inputs(q, k, v, rel_bias, mask, compute_dtype: bool = True):
    """The shapes (and, where compute_dtype, a compute dtype: quantized_window_attention's are e4m3)."""
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must share one (B*nW, nH, N, d) shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    bnw, nh, n, d = q.shape
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError("q, k and v must share one dtype")
    if compute_dtype:
        require_compute_dtype("q, k, v", q)
    if d < 16 or d > 128 or d & (d - 1):
        raise ValueError(f"head width d must be a power of two in 16..128, got {d}")
    if n > MAX_WINDOW_TOKENS:
        raise ValueError(f"window area N must be <= {MAX_WINDOW_TOKENS}, got {n}")
    if rel_bias is not None and tuple(rel_bias.shape) != (nh, n, n):
        raise ValueError(f"rel_bias must be (nH, N, N) = {(nh, n, n)}, got {tuple(rel_bias.shape)}")
    if mask is not None:
        if mask.dim() != 3 or tuple(mask.shape[1:]) != (n, n) or bnw % mask.shape[0]:
            raise ValueError(f"mask must be (nW, N, N) with B*nW divisible by nW, got {tuple(mask.shape)}")


def _strides(t: torch.Tensor):
    return tuple(t.stride())


# --------------------------------------------------------------------------------------------
# Host functions
# --------------------------------------------------------------------------------------------
def window_attention_fwd(q, k, v, rel_bias, mask, scale, index=None, cosine=None, in_scale=None, out_scale=None):
    """q, k, v: (B*nW, nH, N, d) fp16/bf16/fp32, any strides. rel_bias: (nH, N, N), or with `index`
    (N, N) the relative-position table (n_table, nH) that the kernel gathers from (rel_bias[h, i, j] =
    table[index[i, j], h]). mask: (nW, N, N) or None. cosine: SwinV2's per-head logit scale (nH,) fp32, or
    None: with it q and k come raw and the kernel normalizes them (q times the scale) as it loads them.
    in_scale: q, k, v in e4m3 at this static () fp32 scale (inference); out_scale: the output written in
    e4m3 at this static () scale, and no lse (inference).
    -> (out (B*nW, nH, N, d) in q.dtype (bf16 from e4m3 q, e4m3 with out_scale; a view of a (B*nW, N, nH,
    d) buffer), lse (B*nW, nH, N) fp32 base-2 logsumexp, or None with out_scale)."""
    bnw, nh, n, d = q.shape
    if n > MAX_WINDOW_TOKENS:   # the kernels hold at most four 64-key blocks: refuse, never drop keys
        raise ValueError(f"window area N must be <= {MAX_WINDOW_TOKENS}, got {n}")
    nw = 1 if mask is None else mask.shape[0]
    b_per_w = bnw // nw
    rel_bias = rel_bias.contiguous()
    mask_arg = rel_bias if mask is None else mask.contiguous()  # dummy pointer when no mask
    index_arg = rel_bias if index is None else index.contiguous()  # dummy pointer without a table
    cos_arg = rel_bias if cosine is None else cosine.contiguous()  # dummy pointer without cosine scores
    variant = dict(COSINE=cosine is not None, SOFT_RTNE=SOFT_RTNE)
    in_q, out_q = in_scale is not None, out_scale is not None
    variant.update(QS=in_scale if in_q else rel_bias, OS=out_scale if out_q else rel_bias, IN_Q=in_q, OUT_Q=out_q)
    wide = torch.bfloat16 if in_q else q.dtype
    if in_q and _INTERPRET:     # numpy has no e4m3: the interpreter loads the bytes (the kernel bitcasts them)
        q, k, v = (t.view(torch.uint8) for t in (q, k, v))
    # The kernel writes the (B*nW, N, nH, d) buffer itself, through the strides of its permuted view:
    # a traced launch must mutate whole tensors, not views (Inductor copies views in and out).
    out_buf = _new_buffer((bnw, n, nh, d), torch.float8_e4m3fn if out_q else wide, q.device)
    out = out_buf.permute(0, 2, 1, 3)
    lse = out_buf if out_q else _new_buffer((bnw, nh, n), torch.float32, q.device)
    block_m, block_n = _block_sizes(n)
    if block_n > _KEY_BLOCK:  # keys in blocks of 64, query tiles across the grid
        extra = dict(_TILED_INTERPRET_CONFIG) if _INTERPRET else {}
        grid = lambda meta: _tiled_grid(meta, nw * cdiv(b_per_w, meta["G"]), nh, cdiv(n, meta["BLOCK_M"]))  # noqa: E731
        launch(_fwd_tiled)[grid](
            q, k, v, rel_bias, mask_arg, index_arg, out_buf, lse, cos_arg,
            *_strides(q), *_strides(k), *_strides(v), *_strides(out),
            float(scale), b_per_w, NW=nw, NH=nh, N=n, D=d,
            HAS_MASK=mask is not None, PRECISION=_precision(q.dtype),
            UPCAST=_INTERPRET and wide == torch.bfloat16, TABLE=index is not None, KT=_tail_width(n), **variant,
            **extra,
        )
        return out, None if out_q else lse
    extra = dict(_INTERPRET_CONFIG) if _INTERPRET else {}
    grid = lambda meta: (nw * cdiv(b_per_w, meta["G"]), nh)  # noqa: E731
    launch(_fwd)[grid](
        q, k, v, rel_bias, mask_arg, index_arg, out_buf, lse, cos_arg,
        *_strides(q), *_strides(k), *_strides(v), *_strides(out),
        float(scale), b_per_w, NW=nw, NH=nh, N=n, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_MASK=mask is not None, PRECISION=_precision(q.dtype),
        UPCAST=_INTERPRET and wide == torch.bfloat16, TABLE=index is not None, **variant, **extra,
    )
    return out, None if out_q else lse


def window_attention_bwd(q, k, v, out, lse, dout, rel_bias, mask, scale, compute_dbias=True, dqkv=None,
                         index=None, inverse=None):
    """Gradients of window attention. Shapes as in `window_attention_fwd`; dout like out, any strides.
    dqkv: optional (B*nW, N, 3, nH, d) buffer to write dq, dk, dv into (timm's packed qkv layout).
    index, inverse: rel_bias is the relative-position table, gathered through index (as in the forward);
    its gradient is summed from the per-program partials straight into the table's shape by
    `rel_pos_table_grad` over `inverse` (`rel_pos_inverse(index)`).
    -> (dq, dk, dv in q.dtype, d_rel_bias (nH, N, N) fp32, or with a table (n_table, nH) in its dtype;
    None without compute_dbias)."""
    bnw, nh, n, d = q.shape
    if n > MAX_WINDOW_TOKENS:   # the kernels hold at most four 64-key blocks: refuse, never drop keys
        raise ValueError(f"window area N must be <= {MAX_WINDOW_TOKENS}, got {n}")
    nw = 1 if mask is None else mask.shape[0]
    b_per_w = bnw // nw
    rel_bias = rel_bias.contiguous()
    mask_arg = rel_bias if mask is None else mask.contiguous()
    index_arg = rel_bias if index is None else index.contiguous()
    if dqkv is None:
        dq, dk, dv = (_new_buffer((bnw, nh, n, d), q.dtype, q.device) for _ in range(3))
        grads, dkv_off = (dq, dk, dv), 0
    else:  # one packed buffer, written whole (PACKED): the views give the strides and the results
        dq, dk, dv = dqkv.permute(2, 0, 3, 1, 4).unbind(0)
        grads, dkv_off = (dqkv, out, out), dk.storage_offset() - dq.storage_offset()
    max_slots = cdiv(b_per_w, 1 if _INTERPRET else _BWD_MIN_G)  # 1: the CPU tests reach the fill path
    partial = _new_buffer((max_slots if compute_dbias else 1, nw, nh, n, n), torch.float32, q.device)
    # Traced (torch.compile: Inductor autotunes G later), the kernel zeroes the slots its G leaves unused
    # and all are summed; eager, only the slots of the G the autotuner chose are summed.
    traced = tracing()
    fill_slots = max_slots if traced and compute_dbias else 0
    block_m, block_n = _block_sizes(n)
    kernel = _bwd_kernel(block_n, q.dtype)  # the one that writes the partials: its G sets their count
    if block_n > _KEY_BLOCK:
        _bwd_tiled(q, k, v, out, lse, dout, rel_bias, mask_arg, index_arg, grads, dkv_off, dqkv is not None,
                   partial, fill_slots, scale, b_per_w, nw, mask is not None, compute_dbias, index is not None)
        g_interpret = _TILED_INTERPRET_CONFIG["G"]
    else:
        g_interpret = _INTERPRET_CONFIG["G"]
        _bwd_single(kernel, q, k, v, out, lse, dout, rel_bias, mask_arg, index_arg, grads, dq, dk, dv, dkv_off,
                    dqkv is not None, partial, fill_slots, scale, b_per_w, nw, mask is not None, compute_dbias,
                    index is not None, block_m, block_n)
    dbias = None
    if compute_dbias:
        if not traced:
            g = g_interpret if _INTERPRET else kernel.best_config.kwargs["G"]
            partial = partial[: cdiv(b_per_w, g)]
        if index is None:
            dbias = partial.sum(dim=(0, 1))
        else:  # slots and windows summed with the table rows (rel_pos_table_grad_host)
            dbias = rel_pos_table_grad_host(partial.view(-1, nh, n * n), inverse, rel_bias.dtype)
    return dq, dk, dv, dbias


def _bwd_single(kernel, q, k, v, out, lse, dout, rel_bias, mask_arg, index_arg, grads, dq, dk, dv, dkv_off,
                packed, partial, fill_slots, scale, b_per_w, nw, has_mask, compute_dbias, table, block_m, block_n):
    """Up to 64 keys: one backward kernel, the window's keys in one tile."""
    bnw, nh, n, d = q.shape
    extra = dict(_INTERPRET_CONFIG) if _INTERPRET else {}
    if _INTERPRET:  # else the autotuner's config gives BLOCK_M
        extra["BLOCK_M"] = block_m
    grid = lambda meta: (nw * cdiv(b_per_w, meta["G"]), nh)  # noqa: E731
    launch(kernel)[grid](
        q, k, v, out, dout, lse, rel_bias, mask_arg, index_arg, *grads, partial,
        *_strides(q), *_strides(k), *_strides(v), *_strides(out), *_strides(dout),
        *_strides(dq), *_strides(dk), *_strides(dv),
        float(scale), b_per_w, FILL_SLOTS=fill_slots, dkv_off=dkv_off, PACKED=packed,
        NW=nw, NH=nh, N=n, D=d, BLOCK_N=block_n,
        HAS_MASK=has_mask, PRECISION=_precision(q.dtype),
        UPCAST=_INTERPRET and q.dtype == torch.bfloat16, COMPUTE_DBIAS=compute_dbias, TABLE=table,
        **extra,
    )


def _tiled_grid(meta: dict, programs: int, heads: int, tiles: int) -> tuple[int, ...]:
    """The launch grid of a key-tiled kernel (_tile_program): the tiles along axis 0, fastest, where the
    config's TILE_FASTEST says so, else along axis 2 (three axes either way: one grid rank for every config
    of a kernel, as Inductor's launcher of a traced call expects)."""
    return (programs * tiles, heads, 1) if meta.get("TILE_FASTEST") else (programs, heads, tiles)


def _tail_width(n: int) -> int:
    """KT of the key-tiled kernels: the width of the last 64-key block (and height of the last 64-row query
    block where a kernel unrolls them), a power of two >= 16 (the smallest tensor-core operand): 144 tokens
    run as 64 + 64 + 16, not padded to 192."""
    return max(16, next_pow2(n - _KEY_BLOCK * (cdiv(n, _KEY_BLOCK) - 1)))


def _bwd_tiled(q, k, v, out, lse, dout, rel_bias, mask_arg, index_arg, grads, dkv_off, packed, partial,
               fill_slots, scale, b_per_w, nw, has_mask, compute_dbias, table):
    """More than 64 keys: dq, the d_bias partials and delta = rowsum(dO * O) (_bwd_dq), then dk and dv from
    delta (_bwd_dkv). grads: (dq, dk, dv), or (the packed buffer, _, _) with dk and dv dkv_off and 2 dkv_off
    elements past dq."""
    bnw, nh, n, d = q.shape
    dq, dk, dv = grads
    # Strides of the dq, dk, dv views: the packed buffer's come from its unbound views.
    views = grads if not packed else grads[0].permute(2, 0, 3, 1, 4).unbind(0)
    delta = _new_buffer((bnw, nh, n), torch.float32, q.device)
    common = dict(NW=nw, NH=nh, N=n, D=d, HAS_MASK=has_mask, PRECISION=_precision(q.dtype),
                  UPCAST=_INTERPRET and q.dtype == torch.bfloat16, TABLE=table, KT=_tail_width(n))
    extra = dict(_TILED_INTERPRET_CONFIG) if _INTERPRET else {}
    grid = lambda meta: _tiled_grid(meta, nw * cdiv(b_per_w, meta["G"]), nh, cdiv(n, meta["BLOCK_M"]))  # noqa: E731
    launch(_bwd_dq)[grid](
        q, k, v, out, dout, lse, rel_bias, mask_arg, index_arg, dq, partial, delta,
        *_strides(q), *_strides(k), *_strides(v), *_strides(out), *_strides(dout), *_strides(views[0]),
        float(scale), b_per_w, FILL_SLOTS=fill_slots, COMPUTE_DBIAS=compute_dbias, **common, **extra,
    )
    grid = lambda meta: _tiled_grid(meta, nw * cdiv(b_per_w, meta["G"]), nh, cdiv(n, _KEY_BLOCK))  # noqa: E731
    launch(_bwd_dkv)[grid](
        q, k, v, dout, lse, delta, rel_bias, mask_arg, index_arg, dq if packed else dk, dv,
        *_strides(q), *_strides(k), *_strides(v), *_strides(dout),
        *_strides(views[1]), *_strides(views[2]),
        float(scale), b_per_w, dkv_off=dkv_off, PACKED=packed, **common, **extra,
    )


# One operator per host function (_common.kernel_op): traced into by torch.compile on a GPU (triton_op,
# Inductor autotunes G itself, hence FILL_SLOTS), opaque otherwise, where the fake implementations give
# the output shapes and strides.
@kernel_op("swinbench::window_attention_fwd")
def _window_attention_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel_bias: torch.Tensor,
                             mask: Optional[torch.Tensor], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return window_attention_fwd(q, k, v, rel_bias, mask, scale)


def _fwd_outputs_like(q):
    """Fake (out, lse) of a forward op: out a permuted view of a (B*nW, N, nH, d) buffer, lse fp32."""
    bnw, nh, n, d = q.shape
    return q.new_empty((bnw, n, nh, d)).permute(0, 2, 1, 3), q.new_empty((bnw, nh, n), dtype=torch.float32)


@_window_attention_fwd_op.register_fake
def _(q, k, v, rel_bias, mask, scale):
    return _fwd_outputs_like(q)


@kernel_op("swinbench::window_attention_bwd")
def _window_attention_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                             lse: torch.Tensor, dout: torch.Tensor, rel_bias: torch.Tensor,
                             mask: Optional[torch.Tensor], scale: float, compute_dbias: bool
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dbias = window_attention_bwd(q, k, v, out, lse, dout, rel_bias, mask, scale, compute_dbias)
    return dq, dk, dv, (dbias.to(rel_bias.dtype) if dbias is not None else rel_bias.new_zeros(0))


@_window_attention_bwd_op.register_fake
def _(q, k, v, out, lse, dout, rel_bias, mask, scale, compute_dbias):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(q, memory_format=torch.contiguous_format),
            rel_bias.new_empty(rel_bias.shape if compute_dbias else (0,)))


@kernel_op("swinbench::window_attention_qkv_bwd")
def _window_attention_qkv_bwd_op(qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                                 rel_bias: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                                 compute_dbias: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _qkv_bwd(qkv, out, lse, dout, rel_bias, mask, scale, compute_dbias)


def _qkv_bwd(qkv, out, lse, dout, bias, mask, scale, compute_dbias, index=None, inverse=None):
    """(dqkv written whole in timm's packed layout, the bias's gradient in its dtype, or an empty tensor
    without compute_dbias); with index/inverse, bias is the table (window_attention_bwd)."""
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    dqkv = _new_buffer(qkv.shape, qkv.dtype, qkv.device)
    _, _, _, dbias = window_attention_bwd(q, k, v, out, lse, dout, bias, mask, scale, compute_dbias, dqkv=dqkv,
                                          index=index, inverse=inverse)
    return dqkv, (dbias.to(bias.dtype) if dbias is not None else bias.new_zeros(0))


def _qkv_bwd_outputs_like(qkv, bias, compute_dbias):
    return (torch.empty_like(qkv, memory_format=torch.contiguous_format),
            bias.new_empty(bias.shape if compute_dbias else (0,)))


@_window_attention_qkv_bwd_op.register_fake
def _(qkv, out, lse, dout, rel_bias, mask, scale, compute_dbias):
    return _qkv_bwd_outputs_like(qkv, rel_bias, compute_dbias)


@kernel_op("swinbench::window_attention_table_fwd")
def _window_attention_table_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                                   index: torch.Tensor, mask: Optional[torch.Tensor], scale: float
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    return window_attention_fwd(q, k, v, table, mask, scale, index=index)


@_window_attention_table_fwd_op.register_fake
def _(q, k, v, table, index, mask, scale):
    return _fwd_outputs_like(q)


@kernel_op("swinbench::window_attention_cosine_fwd")
def _window_attention_cosine_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                                    index: torch.Tensor, mask: Optional[torch.Tensor], logit_scale: torch.Tensor
                                    ) -> torch.Tensor:
    return window_attention_fwd(q, k, v, table, mask, 1.0, index=index, cosine=logit_scale)[0]


@_window_attention_cosine_fwd_op.register_fake
def _(q, k, v, table, index, mask, logit_scale):
    return _fwd_outputs_like(q)[0]


@kernel_op("swinbench::window_attention_qkv_table_bwd")
def _window_attention_qkv_table_bwd_op(qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                                       table: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor,
                                       mask: Optional[torch.Tensor], scale: float, compute_dbias: bool
                                       ) -> tuple[torch.Tensor, torch.Tensor]:
    return _qkv_bwd(qkv, out, lse, dout, table, mask, scale, compute_dbias, index=index, inverse=inverse)


@_window_attention_qkv_table_bwd_op.register_fake
def _(qkv, out, lse, dout, table, index, inverse, mask, scale, compute_dbias):
    return _qkv_bwd_outputs_like(qkv, table, compute_dbias)


@kernel_op("swinbench::window_attention_table_bwd")
def _window_attention_table_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                                   lse: torch.Tensor, dout: torch.Tensor, table: torch.Tensor, index: torch.Tensor,
                                   inverse: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                                   compute_dbias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dtable = window_attention_bwd(q, k, v, out, lse, dout, table, mask, scale, compute_dbias,
                                              index=index, inverse=inverse)
    return dq, dk, dv, (dtable.to(table.dtype) if dtable is not None else table.new_zeros(0))


@_window_attention_table_bwd_op.register_fake
def _(q, k, v, out, lse, dout, table, index, inverse, mask, scale, compute_dbias):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(q, memory_format=torch.contiguous_format),
            table.new_empty(table.shape if compute_dbias else (0,)))


class WindowAttentionFunction(torch.autograd.Function):
    """Autograd for fused window attention: saves q, k, v, out, lse and calls the kernel ops."""

    @staticmethod
    def forward(ctx, q, k, v, rel_bias, mask, scale):
        out, lse = _window_attention_fwd_op(q, k, v, rel_bias, mask, scale)
        ctx.save_for_backward(q, k, v, out, lse, rel_bias, mask)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, rel_bias, mask = ctx.saved_tensors
        compute_dbias = ctx.needs_input_grad[3]
        dq, dk, dv, dbias = _window_attention_bwd_op(q, k, v, out, lse, dout, rel_bias, mask, ctx.scale,
                                                     compute_dbias)
        return dq, dk, dv, (dbias if compute_dbias else None), None, None


class WindowAttentionQKVFunction(torch.autograd.Function):
    """As WindowAttentionFunction, for q, k, v packed in one (B*nW, N, 3, nH, d) tensor (timm's
    qkv Linear output, reshaped). The gradient is written straight into one packed buffer, which
    saves autograd's stack of dq, dk, dv and the copy its reshape back to (B*nW, N, 3C) needs.
    With index and inverse, `bias` is the relative-position table itself: the kernels gather the bias
    from it through the index, and the backward sums the per-program bias partials straight into the
    table's gradient (one launch), so no (nH, N, N) bias exists in memory."""

    @staticmethod
    def forward(ctx, qkv, bias, mask, scale, index, inverse, tokens):
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        if index is None:
            out, lse = _window_attention_fwd_op(q, k, v, bias, mask, scale)
        else:
            out, lse = _window_attention_table_fwd_op(q, k, v, bias, index, mask, scale)
        ctx.save_for_backward(qkv, out, lse, bias, mask, index, inverse)
        ctx.scale, ctx.tokens = scale, tokens
        if tokens:  # the output buffer is (B*nW, N, nH, d): its rows are the tokens, no copy
            bnw, nh, n, d = out.shape
            return out.transpose(1, 2).reshape(bnw * n, nh * d)
        return out

    @staticmethod
    def backward(ctx, dout):
        qkv, out, lse, bias, mask, index, inverse = ctx.saved_tensors
        if ctx.tokens:
            bnw, nh, n, d = out.shape
            dout = dout.view(bnw, n, nh, d).transpose(1, 2)
        compute_dbias = ctx.needs_input_grad[1]
        if index is None:
            dqkv, dbias = _window_attention_qkv_bwd_op(qkv, out, lse, dout, bias, mask, ctx.scale, compute_dbias)
        else:
            dqkv, dbias = _window_attention_qkv_table_bwd_op(qkv, out, lse, dout, bias, index, inverse, mask,
                                                             ctx.scale, compute_dbias)
        return dqkv, (dbias if compute_dbias else None), None, None, None, None, None


class WindowAttentionTableFunction(torch.autograd.Function):
    """WindowAttentionFunction with the bias read from a relative-position table through its index inside
    the kernels, and the table's gradient summed from the backward's partials in one launch (as
    WindowAttentionQKVFunction does for packed qkv), for q, k, v given apart."""

    @staticmethod
    def forward(ctx, q, k, v, table, index, inverse, mask, scale):
        out, lse = _window_attention_table_fwd_op(q, k, v, table, index, mask, scale)
        ctx.save_for_backward(q, k, v, out, lse, table, index, inverse, mask)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, table, index, inverse, mask = ctx.saved_tensors
        compute_dbias = ctx.needs_input_grad[3]
        dq, dk, dv, dtable = _window_attention_table_bwd_op(q, k, v, out, lse, dout, table, index, inverse, mask,
                                                            ctx.scale, compute_dbias)
        return dq, dk, dv, (dtable if compute_dbias else None), None, None, None, None


def _check_table(table, index, inverse, n: int, nh: int) -> None:
    """The table (n_table, nH), index (N, N) and, unless None (a forward without backward), inverse
    (n_table, P) of a bias read from a relative-position table."""
    if table.dim() != 2 or table.shape[1] != nh:
        raise ValueError(f"table must be (n_table, nH={nh}), got {tuple(table.shape)}")
    if tuple(index.shape) != (n, n) or (inverse is not None and (inverse.dim() != 2
                                                                 or inverse.shape[0] != table.shape[0])):
        raise ValueError(f"index must be ({n}, {n}) and inverse ({table.shape[0]}, P), got "
                         f"{tuple(index.shape)} and {None if inverse is None else tuple(inverse.shape)}")


def _packed_qkv(qkv):
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must be (B*nW, N, 3, nH, d), got {tuple(qkv.shape)}")
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)


def _apply_qkv(qkv, bias, mask, scale, index=None, inverse=None, tokens=False):
    if scale is None:
        scale = qkv.shape[-1] ** -0.5  # d ** -0.5
    return WindowAttentionQKVFunction.apply(qkv, bias, None if mask is None else mask.detach(), float(scale),
                                            index, inverse, bool(tokens))


def fused_window_attention_qkv(qkv, rel_bias, mask=None, scale=None, tokens=False):
    """fused_window_attention on q, k, v packed as timm packs them: qkv (B*nW, N, 3, nH, d), i.e.
    `self.qkv(x).reshape(B_, N, 3, nH, d)`. Returns (B*nW, nH, N, d) in qkv.dtype, or with `tokens`
    the same values as (B*nW*N, nH*d) rows, timm's `transpose(1, 2).reshape(B_, N, C)` flattened: the
    kernel writes that layout, so the rows cost no copy and no autograd view nodes on the way to proj."""
    q, k, v = _packed_qkv(qkv)
    _check_inputs(q, k, v, rel_bias, mask)
    return _apply_qkv(qkv, rel_bias, mask, scale, tokens=tokens)


def fused_window_attention_table(qkv, table, index, inverse, mask=None, scale=None, tokens=False):
    """fused_window_attention_qkv with the bias gathered from the relative-position table inside the
    kernels: table (n_table, nH) (timm's relative_position_bias_table), index (N, N) (timm's
    relative_position_index, values < n_table), inverse = rel_pos_inverse(index, n_table). The table
    gets the gradient; returns (B*nW, nH, N, d) in qkv.dtype (or rows, with `tokens`)."""
    q, k, v = _packed_qkv(qkv)
    _check_table(table, index, inverse, q.shape[2], q.shape[1])
    _check_inputs(q, k, v, None, mask)
    return _apply_qkv(qkv, table, mask, scale, index, inverse, tokens)


def fused_window_attention_from_table(q, k, v, table, index, inverse, mask=None, scale=None):
    """fused_window_attention with the bias gathered from a relative-position table inside the kernels, q,
    k, v given apart ((B*nW, nH, N, d), strided views are fine): table (n_table, nH) gets the gradient,
    index (N, N), inverse = rel_pos_inverse(index, n_table). Returns (B*nW, nH, N, d) in q.dtype."""
    _check_table(table, index, inverse, q.shape[2], q.shape[1])
    _check_inputs(q, k, v, None, mask)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return WindowAttentionTableFunction.apply(q, k, v, table, index, inverse,
                                              None if mask is None else mask.detach(), float(scale))


def quantized_window_attention(qkv_q, in_scale, rel_bias, mask, scale, out_scale, index=None):
    """Window attention for FP8 inference on e4m3 operands, one kernel: qkv_q (B*nW, N, 3, nH, d) e4m3fn,
    timm's packed qkv as the qkv GEMM wrote it quantized at the static () fp32 scale in_scale; the output
    (B*nW*N, nH*d) token rows (proj's input layout) in e4m3 at the static () scale out_scale (proj's
    calibrated input scale). The kernel widens q, k and v to bf16 as it loads them (exact), applies
    in_scale to the logits and the output, and quantizes the output in its epilogue (quantize_static):
    the attention's reads and writes are one byte a value. rel_bias (nH, N, N), or with `index` (N, N)
    the relative-position table (n_table, nH) read through it. No backward."""
    q, k, v = _packed_qkv(qkv_q)
    if qkv_q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"quantized_window_attention: qkv_q must be e4m3fn, got {qkv_q.dtype}")
    for name, t in (("in_scale", in_scale), ("out_scale", out_scale)):
        if t.numel() != 1 or t.dtype != torch.float32:
            raise ValueError(f"quantized_window_attention: {name} must be one fp32 value, got {tuple(t.shape)} {t.dtype}")
    bnw, nh, n, d = q.shape
    if index is not None:
        _check_table(rel_bias, index, None, n, nh)
    _check_inputs(q, k, v, None if index is not None else rel_bias, mask, compute_dtype=False)
    out, _ = window_attention_fwd(q, k, v, rel_bias, mask, float(scale), index=index, in_scale=in_scale.reshape(()),
                                  out_scale=out_scale.reshape(()))
    return out.permute(0, 2, 1, 3).reshape(bnw * n, nh * d)


def cosine_window_attention(q, k, v, table, index, logit_scale, mask=None):
    """SwinV2's cosine window attention for inference, one kernel: softmax(normalize(q) * logit_scale[h]
    @ normalize(k)^T + table[index] + mask) @ v, with q and k raw (the views of the packed qkv) and
    normalized in the kernel as it loads them (the bits kernels.cosine's cosine_qk would write, so the
    same output as cosine_qk followed by fused_window_attention_from_table at scale 1), no launch or pass
    of their own. No backward: training keeps cosine_qk, whose backward carries the logit scale's
    gradient. q, k, v (B*nW, nH, N, d) in one dtype; logit_scale (nH,) (exp of the clamped logit scale);
    table (n_table, nH); index (N, N)."""
    nh = q.shape[1]
    _check_table(table, index, None, q.shape[2], nh)
    _check_inputs(q, k, v, None, mask)
    scale = logit_scale.detach().reshape(-1).float()
    if scale.numel() != nh:
        raise ValueError(f"logit_scale must have nH={nh} values, got {scale.numel()}")
    return _window_attention_cosine_fwd_op(q, k, v, table.detach(), index, None if mask is None else mask.detach(),
                                           scale)


def fused_window_attention(q, k, v, rel_bias, mask=None, scale=None):
    """softmax(q @ k^T * scale + rel_bias + mask[b % nW]) @ v, fused, forward and backward.

    q, k, v: (B*nW, nH, N, d) fp16/bf16/fp32 (strided views are fine). rel_bias: (nH, N, N), any
    float dtype, gets a gradient. mask: (nW, N, N) additive, batch-window b uses mask[b % nW]; no
    gradient. scale: default d ** -0.5. Returns (B*nW, nH, N, d) in q.dtype.
    """
    _check_inputs(q, k, v, rel_bias, mask)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if mask is not None:
        mask = mask.detach()
    return WindowAttentionFunction.apply(q, k, v, rel_bias, mask, float(scale))


# --------------------------------------------------------------------------------------------
# The relative-position table's gradient
# --------------------------------------------------------------------------------------------
@triton.jit
def _rel_pos_grad_kernel(D_REL, INV, OUT, n_table, n_lead, n_pairs, n_heads,
                         P: tl.constexpr, LB: tl.constexpr, BLOCK_T: tl.constexpr):
    """OUT[t, h] = sum over s < n_lead of D_REL[s, h, i*N + j] over the pairs (i, j) whose relative
    position is table row t, listed in INV[t, :P] (-1 padded). D_REL is (n_lead, n_heads, n_pairs): one
    bias gradient (n_lead 1), or the attention backward's per-program partials (slots x windows). A
    program takes BLOCK_T rows of one head (1 on a GPU: hundreds of programs), LB leading slices per
    step; every row is written once, summed in a fixed order: no memset, no atomics, the same bits on
    every run."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    t_ok = t < n_table
    pairs = tl.load(INV + t[:, None] * P + tl.arange(0, P)[None, :], mask=t_ok[:, None], other=-1)
    valid = pairs >= 0
    acc = tl.zeros([LB, BLOCK_T, P], dtype=tl.float32)
    for s0 in range(0, n_lead, LB):
        s = s0 + tl.arange(0, LB)
        rows = (s * n_heads + h).to(tl.int64) * n_pairs
        acc += tl.load(D_REL + rows[:, None, None] + pairs[None, :, :],
                       mask=(s < n_lead)[:, None, None] & valid[None, :, :], other=0.0).to(tl.float32)
    tl.store(OUT + t * n_heads + h, tl.sum(tl.sum(acc, axis=2), axis=0).to(OUT.dtype.element_ty), mask=t_ok)


def rel_pos_inverse(index: torch.Tensor, n_table: int) -> torch.Tensor:
    """The inverse of a relative-position index (N, N) with values in [0, n_table): (n_table, P) int32
    whose row t lists the flat pairs i*N + j with index[i, j] == t, in increasing order, -1 padded to P
    (a power of two). Computed once per module (it reads the index's values), on the index's device."""
    flat = index.reshape(-1).to(torch.int64)
    counts = torch.bincount(flat, minlength=n_table)
    width = next_pow2(max(1, int(counts.max())))
    order = torch.argsort(flat, stable=True)
    rows = flat[order]
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(flat.numel(), device=flat.device) - starts[rows]
    inverse = torch.full((n_table, width), -1, dtype=torch.int32, device=flat.device)
    inverse[rows, slot] = order.to(torch.int32)
    return inverse


def rel_pos_table_grad_host(d_rel: torch.Tensor, inverse: torch.Tensor, table_dtype: torch.dtype) -> torch.Tensor:
    """(n_table, nH) in table_dtype: the sum over d_rel's leading slices (n_lead, nH, N*N) of the table
    rows' pairs (`_rel_pos_grad_kernel`): one launch, two past 64 tokens a window (the slices summed first)."""
    n_lead, n_heads, n_pairs = d_rel.shape
    n_table, width = inverse.shape
    d_rel = d_rel.contiguous()
    if n_lead > 1 and n_pairs > _KEY_BLOCK * _KEY_BLOCK:
        # Past 64 tokens a window's pairs lie too far apart for the gather's sectors to be shared: summing
        # the leading slices first, in one coalesced pass, leaves it an eighth of the bytes or less (H100,
        # window 12: 20 against 32 µs). Deterministic all the same: the sum has a fixed order.
        d_rel = d_rel.sum(0, keepdim=True)
        n_lead = 1
    out = _new_buffer((n_table, n_heads), table_dtype, d_rel.device)
    # Rows per program and leading slices per step (loads in flight, not a long loop). On a GPU one row of
    # a single slice, or two rows of eight slices at a time (H100, window 7: 8.6 against 10.6 µs for one
    # row of sixteen); the CPU interpreter pays per program, so it takes 32 rows.
    if _INTERPRET:
        block_t, lead_block = 32, min(16, next_pow2(n_lead))
    else:
        block_t, lead_block = (1, 1) if n_lead == 1 else (2, min(8, next_pow2(n_lead)))
    launch(_rel_pos_grad_kernel)[(cdiv(n_table, block_t), n_heads)](
        d_rel, inverse, out, n_table, n_lead, n_pairs, n_heads, P=width, LB=lead_block, BLOCK_T=block_t,
        num_warps=4 if lead_block > 1 else 1)
    return out


@kernel_op("swinbench::rel_pos_table_grad")
def rel_pos_table_grad(d_rel: torch.Tensor, inverse: torch.Tensor, table_dtype: torch.dtype) -> torch.Tensor:
    """The relative-position table's gradient (n_table, nH) in table_dtype from the bias's (nH, N, N)
    gradient and `rel_pos_inverse`: one launch (instead of a memset and an index_add_), deterministic."""
    return rel_pos_table_grad_host(d_rel.reshape(1, d_rel.shape[0], -1), inverse, table_dtype)


@rel_pos_table_grad.register_fake
def _(d_rel, inverse, table_dtype):
    return d_rel.new_empty((inverse.shape[0], d_rel.shape[0]), dtype=table_dtype)
