"""fused_window_attention against the plain formula in float64, forward and every gradient.

On a machine without a GPU the Triton kernels run under TRITON_INTERPRET=1 (set here, before
Triton is imported) on small shapes; with a GPU the Swin-B stage shapes are checked as well.
"""
import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from workbench.kernels import window_attention as wa  # noqa: E402
from workbench.kernels.window_attention import fused_window_attention, fused_window_attention_qkv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (dtype, output rtol, gradient rtol): relative Frobenius error against the float64 reference.
DTYPE_TOLERANCES = [
    (torch.float32, 1e-4, 1e-4),
    (torch.float16, 1e-2, 2e-2),
    (torch.bfloat16, 1e-2, 2e-2),
]

# (B*nW, nH, N, d, nW or None, layout). Odd on purpose: nW of 3 and 6, B*nW/nW not a multiple of
# the windows-per-program group, N = 49 (7x7, padded to 64), 20 (padded to 32), 144 (12x12,
# several query tiles), one and three heads, q/k/v as timm's strided views of one qkv tensor
# ("timm_qkv") or that tensor itself through fused_window_attention_qkv ("packed").
SHAPES = [
    (6, 3, 49, 32, 3, "timm_qkv"),
    (5, 1, 49, 16, None, "contiguous"),
    (12, 3, 49, 16, 6, "contiguous"),
    (10, 1, 49, 32, 2, "packed"),
    (3, 3, 20, 16, 3, "contiguous"),
    (4, 2, 144, 32, 2, "packed"),
]


def make_inputs(bnw, nh, n, d, nw, layout, dtype, device=DEVICE, seed=0):
    """Fresh random q, k, v (leaf tensors), rel_bias (fp32 leaf, as timm's table gather gives it
    under autocast) and a timm-like -100/0 mask."""
    gen = torch.Generator().manual_seed(seed)
    if layout in ("timm_qkv", "packed"):
        qkv = torch.randn(bnw, n, 3, nh, d, generator=gen).to(device=device, dtype=dtype)
        qkv.requires_grad_()
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        leaves = [qkv]
    else:
        q, k, v = (torch.randn(bnw, nh, n, d, generator=gen).to(device=device, dtype=dtype).requires_grad_()
                   for _ in range(3))
        leaves = [q, k, v]
    rel_bias = (0.5 * torch.randn(nh, n, n, generator=gen)).to(device).requires_grad_()
    mask = None
    if nw is not None:
        mask = torch.where(torch.rand(nw, n, n, generator=gen) < 0.3, -100.0, 0.0).to(device)
    return q, k, v, rel_bias, mask, leaves


def reference_window_attention(q, k, v, rel_bias, mask, scale):
    """The plain formula in float64 (timm's eager path)."""
    q, k, v, rel_bias = (t.double() for t in (q, k, v, rel_bias))
    scores = q @ k.transpose(-2, -1) * scale + rel_bias
    if mask is not None:
        nw = mask.shape[0]
        scores = (scores.view(-1, nw, *scores.shape[1:]) + mask.double()[None, :, None]).view(scores.shape)
    return scores.softmax(-1) @ v


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(autouse=True)
def poison_buffers(monkeypatch):
    """NaN-fill every output buffer before the kernels write it: an unwritten element fails."""
    monkeypatch.setattr(wa, "POISON_BUFFERS", True)


def check_against_reference(shape, dtype, out_tol, grad_tol, seed=0, mask=None):
    """mask: an (nW, N, N) mask to use instead of a random one (shape's nW then None)."""
    bnw, nh, n, d, nw, layout = shape
    q, k, v, rel_bias, random_mask, leaves = make_inputs(bnw, nh, n, d, nw, layout, dtype, seed=seed)
    mask = random_mask if mask is None else mask
    scale = d ** -0.5
    if layout == "packed":
        out = fused_window_attention_qkv(leaves[0], rel_bias, mask)
    else:
        out = fused_window_attention(q, k, v, rel_bias, mask)
    assert out.shape == (bnw, nh, n, d) and out.dtype == dtype
    gen = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(out.shape, generator=gen).to(device=out.device, dtype=dtype)
    grads = torch.autograd.grad(out, [*leaves, rel_bias], dout)

    ref = reference_window_attention(q, k, v, rel_bias, mask, scale)
    ref_grads = torch.autograd.grad(ref, [*leaves, rel_bias], dout.double())

    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < out_tol
    names = (["dqkv"] if len(leaves) == 1 else ["dq", "dk", "dv"]) + ["d_rel_bias"]
    for name, g, rg in zip(names, grads, ref_grads):
        assert torch.isfinite(g).all(), name
        err = rel_err(g, rg)
        assert err < grad_tol, f"{name}: relative error {err:.2e} >= {grad_tol}"
    assert grads[-1].dtype == rel_bias.dtype


@pytest.mark.parametrize("dtype, out_tol, grad_tol", DTYPE_TOLERANCES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(str(x) for x in s))
def test_fused_window_attention_matches_reference(shape, dtype, out_tol, grad_tol):
    check_against_reference(shape, dtype, out_tol, grad_tol)


def test_output_is_transpose_friendly_view():
    """The output is a (B*nW, nH, N, d) view of a (B*nW, N, nH, d) buffer, so timm's following
    transpose(1, 2).reshape(B_, N, C) needs no copy."""
    q, k, v, rel_bias, mask, _ = make_inputs(4, 2, 49, 16, 2, "timm_qkv", torch.float32)
    out = fused_window_attention(q, k, v, rel_bias, mask)
    assert out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("mode", ["bias", "table"])
def test_token_rows_are_the_same_values_and_gradients(mode):
    """tokens=True returns the output as (B*nW*N, nH*d) rows, timm's transpose(1, 2).reshape(B_, N, C)
    flattened: the same values bit for bit, and a gradient given in that layout gives the same gradients as
    it given to the (B*nW, nH, N, d) output."""
    from timm.models.swin_transformer import get_relative_position_index

    bnw, nh, n, d, nw = 6, 3, 49, 16, 3
    _, _, _, rel_bias, mask, (qkv,) = make_inputs(bnw, nh, n, d, nw, "packed", torch.float32, seed=4)
    if mode == "table":
        index = get_relative_position_index(7, 7).to(DEVICE)
        table = (0.5 * torch.randn(169, nh)).to(DEVICE).requires_grad_()
        run = lambda tokens: wa.fused_window_attention_table(qkv, table, index, wa.rel_pos_inverse(index, 169), mask,  # noqa: E731
                                                             tokens=tokens)
        bias = table
    else:
        run = lambda tokens: fused_window_attention_qkv(qkv, rel_bias, mask, tokens=tokens)  # noqa: E731
        bias = rel_bias
    out, rows = run(False), run(True)
    assert rows.shape == (bnw * n, nh * d) and rows.is_contiguous()
    assert torch.equal(rows, out.transpose(1, 2).reshape(bnw * n, nh * d))
    drows = torch.randn(rows.shape).to(DEVICE)
    g_rows = torch.autograd.grad(rows, [qkv, bias], drows)
    g_out = torch.autograd.grad(out, [qkv, bias], drows.view(bnw, n, nh, d).transpose(1, 2))
    for a, b in zip(g_rows, g_out):
        assert torch.equal(a, b)


def test_bias_without_grad_and_low_precision_bias():
    """A frozen bias gets no gradient (the d_bias pass is skipped); a bf16 bias gets a bf16 one."""
    q, k, v, rel_bias, mask, _ = make_inputs(6, 3, 49, 16, 3, "contiguous", torch.bfloat16)
    frozen = rel_bias.detach()
    out = fused_window_attention(q, k, v, frozen, mask)
    dq, = torch.autograd.grad(out, [q], torch.ones_like(out))
    assert torch.isfinite(dq).all()
    bias16 = rel_bias.detach().bfloat16().requires_grad_()
    out = fused_window_attention(q, k, v, bias16, mask)
    dbias, = torch.autograd.grad(out, [bias16], torch.ones_like(out))
    assert dbias.dtype == torch.bfloat16 and torch.isfinite(dbias).all()


def test_rejects_bad_shapes():
    q = torch.randn(4, 2, 49, 24)
    with pytest.raises(ValueError, match="power of two"):
        fused_window_attention(q, q, q, torch.zeros(2, 49, 49))
    q = torch.randn(4, 2, 49, 16)
    with pytest.raises(ValueError, match="rel_bias"):
        fused_window_attention(q, q, q, torch.zeros(2, 48, 48))
    with pytest.raises(ValueError, match="mask"):
        fused_window_attention(q, q, q, torch.zeros(2, 49, 49), mask=torch.zeros(3, 49, 49))
    # more keys than four 64-key blocks: refused by the entry points the whole-block Function calls too,
    # which would otherwise run the tiled kernels without the fifth block
    q = torch.randn(1, 2, 289, 16)
    with pytest.raises(ValueError, match="window area N must be <= 256, got 289"):
        wa.window_attention_fwd(q, q, q, torch.zeros(2, 289, 289), None, 0.25)
    with pytest.raises(ValueError, match="window area N must be <= 256, got 289"):
        wa.window_attention_bwd(q, q, q, q, torch.zeros(1, 2, 289), q, torch.zeros(2, 289, 289), None, 0.25)


# Swin-B stage shapes (at batch 2 to keep it short) and a 12x12 window; GPU only.
GPU_SHAPES = [
    (128, 4, 49, 32, 64, "timm_qkv"),
    (32, 8, 49, 32, 16, "timm_qkv"),
    (8, 16, 49, 32, 4, "packed"),
    (2, 32, 49, 32, None, "timm_qkv"),
    (72, 6, 144, 32, 36, "packed"),
    (50, 5, 49, 64, 25, "contiguous"),
    (33, 2, 100, 128, 11, "contiguous"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, out_tol, grad_tol", DTYPE_TOLERANCES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(str(x) for x in s))
def test_fused_window_attention_gpu_shapes(shape, dtype, out_tol, grad_tol):
    check_against_reference(shape, dtype, out_tol, grad_tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_d_rel_bias_is_deterministic():
    q, k, v, rel_bias, mask, _ = make_inputs(256, 4, 49, 32, 64, "timm_qkv", torch.bfloat16)
    out = fused_window_attention(q, k, v, rel_bias, mask)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, [rel_bias], dout, retain_graph=True)[0]
    second = torch.autograd.grad(out, [rel_bias], dout)[0]
    assert torch.equal(first, second)


@pytest.mark.parametrize("bnw, n", [(18, 49), (6, 144)], ids=["N49", "N144"])
@pytest.mark.parametrize("nw", [None, 3])
def test_traced_backward_sums_every_slot(monkeypatch, nw, bnw, n):
    """Traced by torch.compile (triton_op), the backward cannot know the G Inductor's autotuning will
    pick: it sums every slot of the d_bias partial buffer, and the kernel zeroes those its G leaves
    unused. With the buffers NaN-poisoned, an unzeroed slot would show. N = 144: the key-tiled kernels,
    whose query-tile programs each zero their own rows."""
    ops = importlib.import_module("workbench.kernels._common")
    q, k, v, rel_bias, mask, _ = make_inputs(bnw, 2, n, 16, nw, "separate", torch.float32)
    scale = 16 ** -0.5
    out, lse = wa.window_attention_fwd(q, k, v, rel_bias, mask, scale)
    dout = torch.randn_like(out)
    *_, eager_dbias = wa.window_attention_bwd(q, k, v, out, lse, dout, rel_bias, mask, scale)
    monkeypatch.setattr(ops._STATE, "tracing", True, raising=False)
    *_, traced_dbias = wa.window_attention_bwd(q, k, v, out, lse, dout, rel_bias, mask, scale)
    assert torch.isfinite(traced_dbias).all()
    torch.testing.assert_close(traced_dbias, eager_dbias, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["packed", "timm_qkv"])
def test_traces_under_torch_compile(layout):
    """The kernels are custom ops: torch.compile records them in one graph (no graph break, no
    tracing into the autotuner) and gives the same output and gradients as eager."""
    q, k, v, rel_bias, mask, leaves = make_inputs(6, 3, 49, 16, 3, layout, torch.float32)

    def attention(*tensors):
        if layout == "packed":
            return fused_window_attention_qkv(tensors[0], tensors[-1], mask)
        qq, kk, vv = tensors[0].permute(2, 0, 3, 1, 4).unbind(0)
        return fused_window_attention(qq, kk, vv, tensors[-1], mask)

    compiled = torch.compile(attention, backend="aot_eager", fullgraph=True)
    eager_out = attention(leaves[0], rel_bias)
    out = compiled(leaves[0], rel_bias)
    dout = torch.randn_like(out)
    assert torch.allclose(out, eager_out, rtol=1e-5, atol=1e-6)
    for got, want in zip(torch.autograd.grad(out, [leaves[0], rel_bias], dout),
                         torch.autograd.grad(eager_out, [leaves[0], rel_bias], dout)):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


TABLE_SHAPES = [  # (B*nW, nH, window side(s), d, nW or None): square and oblong windows, masks, odd nW
    (6, 3, 7, 32, 3),
    (5, 2, 7, 16, None),
    (4, 2, 12, 32, 2),
    (6, 1, (4, 5), 16, 3),
]


@pytest.mark.parametrize("dtype, out_tol, grad_tol", DTYPE_TOLERANCES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", TABLE_SHAPES, ids=lambda s: "x".join(str(x) for x in s))
def test_table_mode_matches_reference(shape, dtype, out_tol, grad_tol):
    """fused_window_attention_table: the kernels gather the bias from timm's table through the index and
    the backward sums its gradient into the table. Against the float64 formula on the gathered bias:
    output, dqkv and the table's gradient (the sum over every window and pair that reads a row)."""
    check_table_against_reference(shape, dtype, out_tol, grad_tol)


def check_table_against_reference(shape, dtype, out_tol, grad_tol, mask=None):
    """mask: as in check_against_reference."""
    from timm.models.swin_transformer import get_relative_position_index

    bnw, nh, ws, d, nw = shape
    wh, ww = (ws, ws) if isinstance(ws, int) else ws
    n, n_table = wh * ww, (2 * wh - 1) * (2 * ww - 1)
    _, _, _, _, random_mask, (qkv,) = make_inputs(bnw, nh, n, d, nw, "packed", dtype, seed=wh * 7 + ww)
    mask = random_mask if mask is None else mask
    gen = torch.Generator().manual_seed(n)
    table = (0.5 * torch.randn(n_table, nh, generator=gen)).to(DEVICE).requires_grad_()
    index = get_relative_position_index(wh, ww).to(DEVICE)
    inverse = wa.rel_pos_inverse(index, n_table)
    out = wa.fused_window_attention_table(qkv, table, index, inverse, mask)
    assert out.shape == (bnw, nh, n, d) and out.dtype == dtype
    dout = torch.randn(out.shape, generator=gen).to(device=out.device, dtype=dtype)
    grads = torch.autograd.grad(out, [qkv, table], dout)

    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    bias = table[index.view(-1)].view(n, n, nh).permute(2, 0, 1)
    ref = reference_window_attention(q, k, v, bias, mask, d ** -0.5)
    ref_grads = torch.autograd.grad(ref, [qkv, table], dout.double())
    assert rel_err(out, ref) < out_tol
    for name, g, rg in zip(("dqkv", "d_table"), grads, ref_grads):
        assert torch.isfinite(g).all(), name
        assert rel_err(g, rg) < grad_tol, (name, rel_err(g, rg))
    assert grads[1].dtype == table.dtype



def swinv2_shift_mask(window: int, side: int) -> torch.Tensor:
    """The SW-MSA mask timm's SwinV2 block builds for a side x side map ((side/window)^2, N, N; -100 between
    tokens the cyclic shift brought together, 0 elsewhere)."""
    from timm.models.swin_transformer_v2 import SwinTransformerV2Block

    block = SwinTransformerV2Block(dim=32, input_resolution=side, num_heads=1, window_size=window,
                                   shift_size=window // 2)
    return block.attn_mask.to(DEVICE)


# SwinV2-T/S/B's window 8 (N = 64: one whole 64-key tile, nothing padded, the largest window of the one-tile
# kernels) at SwinV2's head width 32 (every timm swinv2 config but swinv2_cr_huge_224's 44), one image's
# 16x16 map: 4 windows, one per position (a group of one window). fp32 and bf16 (fp16 takes bf16's dots).
@pytest.mark.parametrize("dtype, out_tol, grad_tol", [DTYPE_TOLERANCES[0], DTYPE_TOLERANCES[2]], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shifted", [False, True], ids=["W-MSA", "SW-MSA"])
@pytest.mark.parametrize("entry", ["packed", "timm_qkv", "table"])
def test_swinv2_window8_matches_reference(entry, shifted, dtype, out_tol, grad_tol):
    """N = 64, d = 32 against the float64 formula, forward and every gradient, with timm's own shift mask
    (not a random one) and without, through the packed-qkv, strided-view and table entry points."""
    mask = swinv2_shift_mask(8, 16) if shifted else None
    assert mask is None or mask.shape == (4, 64, 64)
    if entry == "table":
        check_table_against_reference((4, 2, 8, 32, None), dtype, out_tol, grad_tol, mask=mask)
    else:
        check_against_reference((4, 2, 64, 32, None, entry), dtype, out_tol, grad_tol, seed=64, mask=mask)

@pytest.mark.parametrize("bnw, ws", [(18, 7), (6, 12)], ids=["N49", "N144"])
@pytest.mark.parametrize("nw", [None, 3])
def test_table_mode_traced_backward_sums_every_slot(monkeypatch, nw, bnw, ws):
    """As test_traced_backward_sums_every_slot, for the table's gradient: traced, every partial slot is
    summed (the unused ones zeroed by the kernel), and the result is the eager one."""
    from timm.models.swin_transformer import get_relative_position_index

    ops = importlib.import_module("workbench.kernels._common")
    n, n_table = ws * ws, (2 * ws - 1) ** 2
    q, k, v, _, mask, _ = make_inputs(bnw, 2, n, 16, nw, "separate", torch.float32)
    table = torch.randn(n_table, 2, device=DEVICE)
    index = get_relative_position_index(ws, ws).to(DEVICE)
    inverse = wa.rel_pos_inverse(index, n_table)
    scale = 16 ** -0.5
    out, lse = wa.window_attention_fwd(q, k, v, table, mask, scale, index=index)
    dout = torch.randn_like(out)
    *_, eager = wa.window_attention_bwd(q, k, v, out, lse, dout, table, mask, scale, index=index, inverse=inverse)
    monkeypatch.setattr(ops._STATE, "tracing", True, raising=False)
    *_, traced = wa.window_attention_bwd(q, k, v, out, lse, dout, table, mask, scale, index=index, inverse=inverse)
    assert eager.shape == (n_table, 2) and torch.isfinite(traced).all()
    torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cfg", range(len(wa._BWD_SMALL_CONFIGS)),
                         ids=lambda i: "BLOCK_M{BLOCK_M}-G{G}".format(**wa._BWD_SMALL_CONFIGS[i].kwargs)
                         + f"-w{wa._BWD_SMALL_CONFIGS[i].num_warps}-s{wa._BWD_SMALL_CONFIGS[i].num_stages}"
                         + f"-r{wa._BWD_SMALL_CONFIGS[i].maxnreg}")
def test_every_small_window_backward_config_matches_reference(cfg, monkeypatch):
    """Up to 64 keys the backward's autotuner also picks the query-tile height: one 64-row tile with the
    d_bias accumulator in registers, or 32-row tiles that read-modify-write the d_bias slot. Each config
    alone, against the float64 formula (mask, gathered bias and table). On a GPU the autotuner is given
    that config only; under the interpreter the host's tile height and G are set to it."""
    config = wa._BWD_SMALL_CONFIGS[cfg]
    if wa._INTERPRET:
        monkeypatch.setattr(wa, "_block_sizes", lambda n: (config.kwargs["BLOCK_M"], 64) if n <= 64 else (32, 256))
        monkeypatch.setattr(wa, "_INTERPRET_CONFIG", {"G": 2, "num_warps": config.num_warps})
    else:
        import triton

        monkeypatch.setattr(wa, "_bwd_small", triton.autotune([config], key=wa._AUTOTUNE_KEY)(
            wa._window_attention_bwd_kernel))
    check_against_reference((12, 3, 49, 16, 4, "packed"), torch.bfloat16, 1e-2, 2e-2, seed=cfg)
    if not wa._INTERPRET:
        assert wa._bwd_small.best_config is not None


@pytest.mark.parametrize("cfg", range(len(wa._BWD_SMALL_FP32_CONFIGS)),
                         ids=lambda i: "BLOCK_M{BLOCK_M}-G{G}".format(**wa._BWD_SMALL_FP32_CONFIGS[i].kwargs)
                         + f"-w{wa._BWD_SMALL_FP32_CONFIGS[i].num_warps}-s{wa._BWD_SMALL_FP32_CONFIGS[i].num_stages}")
def test_every_fp32_small_window_backward_config_matches_reference(cfg, monkeypatch):
    """fp32 inputs take their own configs (_BWD_SMALL_FP32_CONFIGS): each alone, masked, table bias, d = 32
    (the case some 4-warp configs got wrong on a GPU), against the float64 formula at fp32 tolerance."""
    config = wa._BWD_SMALL_FP32_CONFIGS[cfg]
    assert config.maxnreg is None and (config.num_warps == 8 or config.num_stages == 1)
    if wa._INTERPRET:
        monkeypatch.setattr(wa, "_block_sizes", lambda n: (config.kwargs["BLOCK_M"], 64) if n <= 64 else (32, 256))
    else:
        import triton

        monkeypatch.setattr(wa, "_bwd_small_fp32", triton.autotune([config], key=wa._AUTOTUNE_KEY)(
            wa._window_attention_bwd_kernel))
    check_table_against_reference((6, 3, 7, 32, 3), *DTYPE_TOLERANCES[0])


def test_fp32_backward_takes_its_own_configs():
    assert wa._bwd_kernel(64, torch.float32) is wa._bwd_small_fp32
    assert wa._bwd_kernel(64, torch.bfloat16) is wa._bwd_small and wa._bwd_kernel(256, torch.float32) is wa._bwd_dq


# Windows of more than 64 tokens run the key-tiled kernels (keys in blocks of 64, query tiles a grid axis,
# backward split into dq/d_bias and dk/dv): N = 65 (a last key block and query tile of one), 100 (10x10,
# two key blocks, the second 36 keys), 144 (12x12, three, the last 16 keys), 256 (16x16, four full ones);
# with and without a mask, q/k/v separate, as timm's strided views and packed. Small batches: the
# interpreter is slow.
TILED_SHAPES = [
    (2, 1, 65, 16, 2, "contiguous"),
    (3, 2, 100, 16, None, "contiguous"),
    (4, 2, 100, 32, 2, "timm_qkv"),
    (3, 2, 144, 16, None, "timm_qkv"),
    (4, 2, 144, 16, 2, "contiguous"),
    (2, 2, 256, 16, 2, "packed"),
    (2, 1, 256, 32, None, "contiguous"),
]
TILED_DTYPES = [DTYPE_TOLERANCES[0], DTYPE_TOLERANCES[2]]


@pytest.mark.parametrize("dtype, out_tol, grad_tol", TILED_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", TILED_SHAPES, ids=lambda s: "x".join(str(x) for x in s))
def test_key_tiled_matches_reference(shape, dtype, out_tol, grad_tol):
    check_against_reference(shape, dtype, out_tol, grad_tol, seed=shape[2])


TILED_TABLE_SHAPES = [(3, 2, 10, 16, None), (4, 2, 12, 16, 2), (2, 2, 16, 16, 2), (4, 1, (9, 12), 16, 2)]


@pytest.mark.parametrize("dtype, out_tol, grad_tol", TILED_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", TILED_TABLE_SHAPES, ids=lambda s: "x".join(str(x) for x in s))
def test_key_tiled_table_mode_matches_reference(shape, dtype, out_tol, grad_tol):
    check_table_against_reference(shape, dtype, out_tol, grad_tol)


@pytest.mark.parametrize("n, nw", [(100, None), (144, 2), (256, 2)])
def test_key_tiled_lse_is_the_base2_logsumexp(n, nw):
    """The forward's saved LSE means the same for every N: the fp32 base-2 logsumexp of each score row."""
    q, k, v, rel_bias, mask, _ = make_inputs(4, 2, n, 16, nw, "contiguous", torch.float32, seed=n)
    scale = 16 ** -0.5
    _, lse = wa.window_attention_fwd(q, k, v, rel_bias, mask, scale)
    scores = q.double() @ k.double().transpose(-2, -1) * scale + rel_bias.double()
    if mask is not None:
        scores = (scores.view(-1, nw, *scores.shape[1:]) + mask.double()[None, :, None]).view(scores.shape)
    ref = torch.logsumexp(scores, -1) / torch.log(torch.tensor(2.0, dtype=torch.float64))
    assert lse.dtype == torch.float32 and lse.shape == (4, 2, n)
    torch.testing.assert_close(lse.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["bias", "table"])
def test_key_tiled_32_row_tiles_and_odd_groups(mode, monkeypatch):
    """The GPU configs also run 32-row query tiles, and every key-tiled kernel with its bias tiles loaded per
    window (BIAS_REGS off; the dk/dv kernel then loops over query tiles of BLOCK_M rows); here with G = 3
    windows per program, which leaves a last group of one window (5 windows per position), against the
    float64 formula."""
    monkeypatch.setattr(wa, "_TILED_INTERPRET_CONFIG", {"G": 3, "BLOCK_M": 32, "BIAS_REGS": False, "num_warps": 4})
    if mode == "table":
        check_table_against_reference((10, 2, 12, 16, 2), torch.float32, 1e-4, 1e-4)
    else:
        check_against_reference((10, 2, 144, 16, 2, "packed"), torch.bfloat16, 1e-2, 2e-2, seed=3)


@pytest.mark.parametrize("mode", ["bias", "table"])
def test_key_tiled_kernels_with_the_tiles_fastest_in_the_grid(mode, monkeypatch):
    """The autotuner's TILE_FASTEST configs (a window's query tiles, or the dk/dv kernel's key blocks, side by
    side along the grid's first axis) compute the same function: on a GPU each key-tiled kernel is
    autotuned over such configs alone, under the interpreter the interpreter's config takes the flag; against the
    float64 formula, with a last group of one window."""
    if torch.cuda.is_available():
        for name, tuned in wa.key_tiled_autotuners(lambda c: bool(c.kwargs.get("TILE_FASTEST"))).items():
            assert tuned.configs, name
            monkeypatch.setattr(wa, name, tuned)
    else:
        monkeypatch.setattr(wa, "_TILED_INTERPRET_CONFIG", {**wa._TILED_INTERPRET_CONFIG, "TILE_FASTEST": True})
    if mode == "table":
        check_table_against_reference((10, 2, 12, 16, 2), torch.float32, 1e-4, 1e-4)
    else:
        check_against_reference((10, 2, 144, 16, 2, "packed"), torch.bfloat16, 1e-2, 2e-2, seed=3)


def test_key_tiled_frozen_bias_skips_d_bias():
    """Without a bias gradient the dq/d_bias kernel skips the d_bias work; dq, dk, dv are unchanged."""
    q, k, v, rel_bias, mask, _ = make_inputs(4, 2, 144, 16, 2, "contiguous", torch.bfloat16, seed=5)
    scale = 16 ** -0.5
    out, lse = wa.window_attention_fwd(q, k, v, rel_bias, mask, scale)
    dout = torch.randn_like(out)
    with_bias = wa.window_attention_bwd(q, k, v, out, lse, dout, rel_bias, mask, scale, True)
    frozen = wa.window_attention_bwd(q, k, v, out, lse, dout, rel_bias, mask, scale, False)
    assert frozen[3] is None
    for a, b in zip(frozen[:3], with_bias[:3]):
        assert torch.equal(a, b)


def test_key_tiled_d_rel_bias_is_deterministic():
    """N = 144: the bias and table gradients are the same bits on every run (per-program partials, no
    atomics). On a GPU at a size where many programs run at once."""
    from timm.models.swin_transformer import get_relative_position_index

    bnw, nw = (144, 36) if torch.cuda.is_available() else (4, 2)
    q, k, v, rel_bias, mask, (qkv,) = make_inputs(bnw, 2, 144, 32, nw, "packed", torch.bfloat16, seed=7)
    index = get_relative_position_index(12, 12).to(DEVICE)
    table = (0.5 * torch.randn(529, 2)).to(DEVICE).requires_grad_()
    inverse = wa.rel_pos_inverse(index, 529)
    for bias, run in ((rel_bias, lambda: fused_window_attention_qkv(qkv, rel_bias, mask)),
                      (table, lambda: wa.fused_window_attention_table(qkv, table, index, inverse, mask))):
        out = run()
        dout = torch.randn_like(out)
        first = torch.autograd.grad(out, [bias], dout, retain_graph=True)[0]
        second = torch.autograd.grad(out, [bias], dout)[0]
        assert torch.isfinite(first).all() and torch.equal(first, second)


@pytest.mark.parametrize("n", [100, 144])
def test_key_tiled_rows_whose_first_key_block_is_all_minus_inf(n):
    """A -inf mask over a row's whole first key block (SDPA's convention, not timm's -100): the online
    softmax must not subtract -inf from -inf (NaN rows, then NaN in every dk and dv)."""
    g = torch.Generator().manual_seed(n)
    d = 16
    q, k, v = (torch.randn(2, 1, n, d, generator=g).to(DEVICE).requires_grad_() for _ in range(3))
    bias = torch.randn(1, n, n, generator=g).to(DEVICE).requires_grad_()
    mask = torch.zeros(1, n, n, device=DEVICE)
    mask[0, :8, :64] = float("-inf")       # rows 0-7 see only keys 64 and on
    mask[0, 20:24, 70:] = float("-inf")    # and rows 20-23 none of the later blocks
    out = fused_window_attention(q, k, v, bias, mask)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    qd, kd, vd, bd = ref_in
    ref = ((qd @ kd.transpose(-2, -1)) * d ** -0.5 + bd + mask.double()).softmax(-1) @ vd
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [q, k, v, bias], grad)
    want = torch.autograd.grad(ref, ref_in, grad.double())
    assert torch.isfinite(out).all() and (out.double() - ref).abs().max() < 1e-5
    for a, b in zip(got, want):
        assert torch.isfinite(a).all() and (a.double() - b).abs().max() < 1e-5


@pytest.mark.parametrize("bnw,n,nh,d,nw,table", [(8, 49, 4, 32, 4, False), (4, 144, 2, 32, 2, True),
                                                  (6, 36, 2, 16, 1, True), (3, 81, 1, 64, 3, False)])
def test_quantized_window_attention_against_float64(bnw, n, nh, d, nw, table):
    """FP8 inference's attention: e4m3 q, k, v at a static scale in (the qkv GEMM's quantized output), e4m3
    token rows at a static scale out (proj's input), against float64 attention of the same quantized
    operands: within one e4m3 step of the exact value, plus the bf16 softmax-times-v arithmetic (2^-8 of
    the row's largest output). Small and key-tiled kernels, dense bias and table, with and without mask."""
    from workbench.kernels import quant

    g = torch.Generator().manual_seed(bnw * n + d)
    qkv = torch.randn(bnw, n, 3, nh, d, generator=g) * 2
    s_in = (qkv.abs().amax() / 448).float()
    qkv_q = quant.quantize(qkv, s_in, "fp8")
    mask = (torch.rand(nw, n, n, generator=g) < 0.2).float() * -100 if nw > 1 else None
    if table:
        tab = torch.randn(97, nh, generator=g)
        idx = torch.randint(0, 97, (n, n), generator=g)
        bias = tab[idx].permute(2, 0, 1)
    else:
        bias, tab, idx = torch.randn(nh, n, n, generator=g), None, None
    q, k, v = (qkv_q.double() * s_in.double()).permute(2, 0, 3, 1, 4).unbind(0)
    att = (q @ k.transpose(-1, -2)) * d ** -0.5 + bias.double()
    if mask is not None:
        att = (att.view(bnw // nw, nw, nh, n, n) + mask.double()[None, :, None]).view(bnw, nh, n, n)
    o64 = (att.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(bnw * n, nh * d)
    s_out = (o64.abs().amax() / 400).float()
    o64 = o64 / s_out.double()
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    out = wa.quantized_window_attention(dev(qkv_q), dev(s_in), dev(tab if table else bias), dev(mask), d ** -0.5,
                                        dev(s_out), index=dev(idx)).cpu()
    assert out.dtype == torch.float8_e4m3fn and out.shape == (bnw * n, nh * d)
    got = out.double()
    step = torch.exp2(torch.floor(torch.log2(torch.maximum(got.abs(), o64.abs()).clamp_min(2.0 ** -6))) - 3)
    rowmax = o64.abs().amax(-1, keepdim=True)
    assert ((got - o64).abs() <= step + rowmax * 2.0 ** -8).all()


def test_quantized_window_attention_refuses_a_wide_qkv():
    qkv = torch.randn(2, 49, 3, 2, 16, device=DEVICE, dtype=torch.bfloat16)
    one = torch.ones((), device=DEVICE)
    with pytest.raises(ValueError, match="qkv_q must be e4m3fn"):
        wa.quantized_window_attention(qkv, one, torch.zeros(2, 49, 49, device=DEVICE), None, 0.25, one)
