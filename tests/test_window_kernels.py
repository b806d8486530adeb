"""Fused Swin window kernels vs the eager timm ops they replace, forward and backward.

Data movement (roll/pad/partition and inverse, and the residual add) must be bit-exact; the
LayerNorm op is checked at the tolerance next to each dtype. Kernels write into NaN-filled
buffers through the host functions' `out=` so that an element the kernel forgets fails.
Runs on the CPU under TRITON_INTERPRET=1 (small shapes), and on the GPU when there is one.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
from timm.models.swin_transformer import window_partition  # noqa: E402

from workbench.kernels.window import (  # noqa: E402
    add_norm_shift_partition,
    add_norm_shift_partition_fwd,
    merge_add_norm,
    merge_add_norm_bwd,
    merge_add_norm_fwd,
    merge_norm_add,
    merge_norm_add_bwd,
    merge_norm_add_fwd,
    merge_roll_reference,
    roll_partition_reference,
    merge_roll,
    merge_roll_fwd,
    merge_unshift_add,
    norm_shift_partition,
    norm_shift_partition_bwd,
    norm_shift_partition_fwd,
    roll_partition,
    roll_partition_fwd,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (B, H, W, C, window_size, shift): square and odd maps, H/W not multiples of ws (padded),
# batch 1, Swin's C and odd C.
SHAPES = [
    (2, 14, 14, 96, 7, 3),
    (1, 9, 15, 33, 4, 2),
    (1, 15, 9, 100, 4, 0),
    (2, 7, 7, 32, 7, 0),
    (1, 7, 9, 300, 4, 2),  # C in (256, 1024]: the 2-warp, 4-row backward tiles
]
if DEVICE == "cuda":
    SHAPES += [
        (4, 56, 56, 128, 7, 3),
        (3, 15, 15, 768, 7, 3),
        (2, 7, 7, 1536, 7, 0),
        (1, 30, 17, 1024, 12, 6),
    ]
DTYPES = [
    (torch.float32, 1e-5, 1e-5),
    (torch.bfloat16, 2e-2, 2e-2),
    (torch.float16, 2e-2, 2e-2),
]


def _ids(shape):
    return "B{}_H{}_W{}_C{}_ws{}_s{}".format(*shape)


# ------------------------------------------------------------------------------ eager references


eager_roll_partition = roll_partition_reference
eager_merge_roll = merge_roll_reference


def _randn(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=DEVICE, dtype=dtype)


def _nan_like(t):
    return torch.full_like(t, float("nan"))


def _pad_rows(B, H, W, ws):
    """Boolean (B*nW, ws*ws) mask of window tokens that are padding."""
    Hp, Wp = -(-H // ws) * ws, -(-W // ws) * ws
    valid = torch.zeros(B, Hp, Wp, 1, dtype=torch.bool)
    valid[:, :H, :W] = True
    return ~window_partition(valid, (ws, ws)).view(-1, ws * ws).to(DEVICE)


# ------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("shape", SHAPES[:3], ids=_ids)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_roll_partition_writes_the_linear_s_dtype(shape, out_dtype):
    """fp32 x, windows in a half dtype: the bits of partition-then-cast, rounded once; the gradient back
    in fp32, the cast's backward's bits."""
    B, H, W, C, ws, shift = shape
    x = _randn((B, H, W, C), torch.float32, 2).requires_grad_(True)
    ref = eager_roll_partition(x, ws, shift).to(out_dtype)
    out = roll_partition(x, ws, shift, out_dtype)
    assert out.dtype == out_dtype and torch.equal(out, ref)
    dout = _randn(ref.shape, out_dtype, 3)
    (dx_ref,) = torch.autograd.grad(ref, x, dout)
    (dx,) = torch.autograd.grad(out, x, dout)
    assert dx.dtype == torch.float32 and torch.equal(dx, dx_ref)


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_roll_partition(shape, dtype):
    B, H, W, C, ws, shift = shape
    x = _randn((B, H, W, C), dtype, 0).requires_grad_(True)
    ref = eager_roll_partition(x, ws, shift)
    out = roll_partition(x, ws, shift)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.equal(out, ref)
    assert torch.equal(roll_partition_fwd(x.detach(), ws, shift, out=_nan_like(ref.detach())), ref.detach())

    dout = _randn(ref.shape, dtype, 1)
    (dx_ref,) = torch.autograd.grad(ref, x, dout)
    (dx,) = torch.autograd.grad(out, x, dout)
    assert torch.equal(dx, dx_ref)


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_merge_roll(shape, dtype):
    B, H, W, C, ws, shift = shape
    n_windows = B * -(-H // ws) * -(-W // ws)
    win = _randn((n_windows, ws * ws, C), dtype, 2).requires_grad_(True)
    ref = eager_merge_roll(win, ws, shift, H, W)
    out = merge_roll(win, ws, shift, H, W)
    assert out.shape == (B, H, W, C) and out.dtype == dtype
    assert torch.equal(out, ref)
    assert torch.equal(merge_roll_fwd(win.detach(), ws, shift, H, W, out=_nan_like(ref.detach())), ref.detach())

    dout = _randn((B, H, W, C), dtype, 3)
    (dwin_ref,) = torch.autograd.grad(ref, win, dout)
    (dwin,) = torch.autograd.grad(out, win, dout)
    assert torch.equal(dwin, dwin_ref)  # padding rows get exactly zero gradient
    assert not dwin[_pad_rows(B, H, W, ws)].any()


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize(
    "win_dtype, shortcut_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.float32),  # autocast: bf16 attention output added to the fp32 residual
    ],
)
def test_merge_unshift_add(shape, win_dtype, shortcut_dtype):
    B, H, W, C, ws, shift = shape
    n_windows = B * -(-H // ws) * -(-W // ws)
    win = _randn((n_windows, ws * ws, C), win_dtype, 4).requires_grad_(True)
    shortcut = _randn((B, H, W, C), shortcut_dtype, 5).requires_grad_(True)
    ref = shortcut + eager_merge_roll(win, ws, shift, H, W)
    out = merge_unshift_add(win, shortcut, ws, shift, H, W)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.equal(out, ref)
    poisoned = merge_roll_fwd(win.detach(), ws, shift, H, W, shortcut.detach(), out=_nan_like(ref.detach()))
    assert torch.equal(poisoned, ref.detach())

    dout = _randn(ref.shape, ref.dtype, 6)
    dwin_ref, dsc_ref = torch.autograd.grad(ref, (win, shortcut), dout)
    dwin, dsc = torch.autograd.grad(out, (win, shortcut), dout)
    assert dwin.dtype == win_dtype and dsc.dtype == shortcut_dtype
    assert torch.equal(dwin, dwin_ref)
    assert torch.equal(dsc, dsc_ref)


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_norm_shift_partition(shape, dtype, atol, rtol):
    B, H, W, C, ws, shift = shape
    eps = 1e-5
    # a non-zero mean and non-unit scale, so that fp32 statistics matter
    x = (_randn((B, H, W, C), torch.float32, 7) * 2.0 + 0.5).to(dtype).requires_grad_(True)
    weight = (1.0 + 0.5 * _randn((C,), torch.float32, 8)).to(dtype).requires_grad_(True)
    bias = (0.5 * _randn((C,), torch.float32, 9)).to(dtype).requires_grad_(True)
    # reference: timm's order (LayerNorm, then roll, pad, partition) in fp32 from the same inputs
    x32, w32, b32 = (t.detach().float().requires_grad_(True) for t in (x, weight, bias))
    ref = eager_roll_partition(F.layer_norm(x32, (C,), w32, b32, eps), ws, shift)
    out = norm_shift_partition(x, weight, bias, eps, ws, shift)
    assert out.shape == ref.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
    pad = _pad_rows(B, H, W, ws)
    assert not out[pad].any(), "padded window tokens must be 0, not LN(0) = bias"

    poisoned, mean, rstd = norm_shift_partition_fwd(
        x.detach(), weight.detach(), bias.detach(), eps, ws, shift, out=_nan_like(out.detach())
    )
    torch.testing.assert_close(poisoned.float(), ref.detach(), atol=atol, rtol=rtol)

    dout = _randn(ref.shape, dtype, 10)
    grads_ref = torch.autograd.grad(ref, (x32, w32, b32), dout.float())
    grads = torch.autograd.grad(out, (x, weight, bias), dout)
    for name, g, g_ref, t in zip(("dx", "dweight", "dbias"), grads, grads_ref, (x, weight, bias)):
        assert g.dtype == t.dtype, name
        # dweight/dbias sum over all tokens: scale the tolerance with the reference magnitude
        scale = 1.0 if name == "dx" else max(1.0, g_ref.abs().max().item())
        torch.testing.assert_close(g.float(), g_ref, atol=atol * scale, rtol=rtol, msg=lambda m: f"{name}: {m}")

    dx, _ = norm_shift_partition_bwd(
        dout, x.detach(), weight.detach(), mean, rstd, ws, shift, dx=_nan_like(x.detach())
    )
    torch.testing.assert_close(dx.float(), grads_ref[0], atol=atol, rtol=rtol)

    # ds: a second gradient of x (the block's residual path), added in the same pass
    ds = _randn(x.shape, dtype, 11)
    dx_ds, _ = norm_shift_partition_bwd(
        dout, x.detach(), weight.detach(), mean, rstd, ws, shift, dx=_nan_like(x.detach()), ds=ds
    )
    torch.testing.assert_close(dx_ds.float(), grads_ref[0] + ds.float(), atol=2 * atol, rtol=rtol)


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float32, torch.bfloat16)], ids=["fp32", "bf16", "fp32+bf16"])
def test_add_norm_shift_partition(shape, dtypes):
    """s = x + r and LayerNorm + shift + partition of s in one kernel (a residual add folded into the next
    block's norm): s bit-exact with torch's add (into a NaN-filled buffer), the windows against the fp32
    reference, and x, r, weight and bias gradients against autograd through `x + r` and the reference,
    with the gradient arriving at s (the residual stream) added in."""
    B, H, W, C, ws, shift = shape
    x_dt, r_dt = dtypes
    eps, tol = 1e-5, (1e-5 if r_dt == torch.float32 else 2e-2)
    x = (_randn((B, H, W, C), torch.float32, 21) * 2.0 + 0.5).to(x_dt).requires_grad_(True)
    r = _randn((B, H, W, C), torch.float32, 22).to(r_dt).requires_grad_(True)
    weight = (1.0 + 0.5 * _randn((C,), torch.float32, 23)).requires_grad_(True)
    bias = (0.5 * _randn((C,), torch.float32, 24)).requires_grad_(True)
    s_ref = x + r
    s, win = add_norm_shift_partition(x, r, weight, bias, eps, ws, shift)
    assert s.dtype == s_ref.dtype and torch.equal(s, s_ref)
    xs, w32, b32 = s_ref.detach().float().requires_grad_(True), weight.detach().requires_grad_(True), bias.detach().requires_grad_(True)
    ref = eager_roll_partition(F.layer_norm(xs, (C,), w32, b32, eps), ws, shift)
    assert win.dtype == s.dtype and win.shape == ref.shape
    torch.testing.assert_close(win.float(), ref, atol=tol, rtol=tol)
    assert not win[_pad_rows(B, H, W, ws)].any()
    s_p, win_p, _, _ = add_norm_shift_partition_fwd(x.detach(), r.detach(), weight.detach(), bias.detach(), eps, ws, shift,
                                                    out=_nan_like(win.detach()), s_out=_nan_like(s.detach()))
    assert torch.equal(s_p, s_ref.detach()) and torch.equal(win_p, win.detach())

    dwin, ds = _randn(ref.shape, win.dtype, 25), _randn(s.shape, s.dtype, 26)
    gx, gr, gw, gb = torch.autograd.grad((s, win), (x, r, weight, bias), (ds, dwin))
    g_ln, gw_ref, gb_ref = torch.autograd.grad(ref, (xs, w32, b32), dwin.float())
    d_s = g_ln + ds.float()
    assert gx.dtype == x_dt and gr.dtype == r_dt
    torch.testing.assert_close(gx.float(), d_s, atol=2 * tol, rtol=tol)
    torch.testing.assert_close(gr.float(), d_s, atol=2 * tol, rtol=tol)
    for g, g_ref in ((gw, gw_ref), (gb, gb_ref)):
        scale = max(1.0, g_ref.abs().max().item())
        torch.testing.assert_close(g, g_ref, atol=tol * scale, rtol=tol)


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32, None), (torch.bfloat16, torch.bfloat16, None),
                                    (torch.bfloat16, torch.float32, torch.bfloat16), (torch.float16, torch.float16, None)],
                         ids=["fp32", "bf16", "bf16win+fp32stream->bf16", "fp16"])
def test_merge_add_norm(shape, dtypes):
    """A block's attention merge, residual add and norm2 in one kernel each way: s = shortcut +
    merge_roll(windows) bit-exact with torch's add (into NaN-filled buffers), y against the fp32
    LayerNorm of it; the windows', shortcut's, weight's and bias's gradients against autograd through
    the eager ops, with a gradient arriving at s as well. The gradient of s goes out twice from one fp32
    value: the windows' is exactly the shortcut's (cast to the windows' dtype) partitioned back, 0 on
    padding rows."""
    B, H, W, C, ws, shift = shape
    win_dt, sc_dt, y_dt = dtypes
    eps, tol = 1e-5, (1e-5 if win_dt == torch.float32 and y_dt is None else 2e-2)
    Hp, Wp = -(-H // ws) * ws, -(-W // ws) * ws
    windows = _randn((B * (Hp // ws) * (Wp // ws), ws * ws, C), torch.float32, 41).to(win_dt).requires_grad_(True)
    sc = (_randn((B, H, W, C), torch.float32, 42) * 2.0 + 0.5).to(sc_dt).requires_grad_(True)
    weight = (1.0 + 0.5 * _randn((C,), torch.float32, 43)).requires_grad_(True)
    bias = (0.5 * _randn((C,), torch.float32, 44)).requires_grad_(True)
    s_ref = sc + eager_merge_roll(windows, ws, shift, H, W)
    s, y = merge_add_norm(windows, sc, weight, bias, eps, ws, shift, y_dt)
    assert s.dtype == s_ref.dtype and torch.equal(s, s_ref)
    assert y.dtype == (y_dt or s_ref.dtype) and y.shape == (B, H, W, C)
    xs, w32, b32 = (t.detach().float().requires_grad_(True) for t in (s_ref, weight, bias))
    y_ref = F.layer_norm(xs, (C,), w32, b32, eps)
    torch.testing.assert_close(y.float(), y_ref, atol=tol, rtol=tol)
    s_p, y_p, _, _ = merge_add_norm_fwd(windows.detach(), sc.detach(), weight.detach(), bias.detach(), eps, ws, shift,
                                        y_dtype=y_dt, s_out=_nan_like(s.detach()), y_out=_nan_like(y.detach()))
    assert torch.equal(s_p, s.detach()) and torch.equal(y_p, y.detach())

    ds, dy = _randn(s.shape, s.dtype, 45), _randn(y.shape, y.dtype, 46)
    gwin, gsc, gw, gb = torch.autograd.grad((s, y), (windows, sc, weight, bias), (ds, dy))
    g_ln, gw_ref, gb_ref = torch.autograd.grad(y_ref, (xs, w32, b32), dy.float())
    d_s = g_ln + ds.float()
    assert gwin.dtype == win_dt and gsc.dtype == sc_dt and gwin.shape == windows.shape
    torch.testing.assert_close(gsc.float(), d_s, atol=2 * tol, rtol=tol)
    assert torch.equal(gwin, eager_roll_partition(gsc.detach().to(win_dt), ws, shift))
    assert not gwin[_pad_rows(B, H, W, ws)].any()
    for g, g_ref in ((gw, gw_ref), (gb, gb_ref)):
        scale = max(1.0, g_ref.abs().max().item())
        torch.testing.assert_close(g, g_ref, atol=tol * scale, rtol=tol)
    # no gradient at s: the windows' and the shortcut's gradients are the norm's alone
    _, _, mean, rstd = merge_add_norm_fwd(windows.detach(), sc.detach(), weight.detach(), bias.detach(), eps, ws, shift,
                                          y_dtype=y_dt)
    dsc0, dwin0, _ = merge_add_norm_bwd(dy, s.detach(), weight.detach(), mean, rstd, ws, shift, None, win_dt, sc_dt)
    torch.testing.assert_close(dsc0.float(), g_ln, atol=2 * tol, rtol=tol)
    assert torch.equal(dwin0, eager_roll_partition(dsc0.to(win_dt), ws, shift))


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("win_dt", [torch.float32, torch.bfloat16], ids=["fp32", "bf16win+fp32stream"])
def test_merge_norm_add(shape, win_dt):
    """SwinV2's post-norm attention half in one kernel each way: out = shortcut + LayerNorm(merge_roll(
    windows)) against the fp32 computation (the stream fp32, as under autocast), into a NaN-filled buffer;
    the windows', weight's and bias's gradients against autograd through the eager ops, 0 on padding
    rows; the shortcut's is the output's own."""
    B, H, W, C, ws, shift = shape
    eps, tol = 1e-5, (1e-5 if win_dt == torch.float32 else 2e-2)
    Hp, Wp = -(-H // ws) * ws, -(-W // ws) * ws
    windows = _randn((B * (Hp // ws) * (Wp // ws), ws * ws, C), torch.float32, 51) * 3 + 1
    windows = windows.to(win_dt).requires_grad_(True)
    sc = _randn((B, H, W, C), torch.float32, 52).requires_grad_(True)
    weight = (1.0 + 0.5 * _randn((C,), torch.float32, 53)).requires_grad_(True)
    bias = (0.5 * _randn((C,), torch.float32, 54)).requires_grad_(True)
    out = merge_norm_add(windows, sc, weight, bias, eps, ws, shift, torch.float32)
    wr, scr, w32, b32 = (t.detach().float().requires_grad_(True) for t in (windows, sc, weight, bias))
    ref = scr + F.layer_norm(eager_merge_roll(wr, ws, shift, H, W), (C,), w32, b32, eps)
    assert out.dtype == torch.float32 and out.shape == (B, H, W, C)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    dout = _randn(out.shape, torch.float32, 55)
    gwin, gsc, gw, gb = torch.autograd.grad(out, (windows, sc, weight, bias), dout)
    gwin_ref, gw_ref, gb_ref = torch.autograd.grad(ref, (wr, w32, b32), dout)
    assert torch.equal(gsc, dout) and gwin.dtype == win_dt and gwin.shape == windows.shape
    torch.testing.assert_close(gwin.float(), gwin_ref, atol=tol * max(1.0, gwin_ref.abs().max().item()), rtol=tol)
    assert not gwin[_pad_rows(B, H, W, ws)].any()
    for g, g_ref in ((gw, gw_ref), (gb, gb_ref)):
        torch.testing.assert_close(g, g_ref, atol=1e-4 * max(1.0, g_ref.abs().max().item()), rtol=1e-4)
    # every element written: into a NaN-filled buffer; the host backward gives the Function's bits
    out_p, mean, rstd = merge_norm_add_fwd(windows.detach(), sc.detach(), weight.detach(), bias.detach(), eps, ws,
                                           shift, torch.float32, out=_nan_like(out.detach()))
    assert torch.equal(out_p, out.detach())
    dwin, sums = merge_norm_add_bwd(dout, windows.detach(), weight.detach(), mean, rstd, ws, shift)
    assert torch.equal(dwin, gwin) and sums.shape == (2 * C,)


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], SHAPES[4]], ids=_ids)
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32, None), (torch.bfloat16, torch.float32, torch.bfloat16),
                                    (torch.float16, torch.float16, None)], ids=["fp32", "bf16win+fp32stream->bf16", "fp16"])
def test_merge_add_norm_with_stochastic_depth(shape, dtypes):
    """keep (timm's DropPath factors, one per sample, 0 for a dropped one) multiplies the merged windows
    before the add: s bit for bit torch's shortcut + merge_roll(windows) * keep, and the windows' gradient
    torch's (the gradient of s in the windows' dtype, times keep, partitioned back), from the same
    kernels each way."""
    B, H, W, C, ws, shift = shape
    B = max(B, 3)
    win_dt, sc_dt, y_dt = dtypes
    Hp, Wp = -(-H // ws) * ws, -(-W // ws) * ws
    windows = _randn((B * (Hp // ws) * (Wp // ws), ws * ws, C), torch.float32, 51).to(win_dt).requires_grad_(True)
    sc = _randn((B, H, W, C), torch.float32, 52).to(sc_dt).requires_grad_(True)
    weight, bias = (1.0 + 0.5 * _randn((C,), torch.float32, 53)), 0.5 * _randn((C,), torch.float32, 54)
    keep = torch.tensor([1 / 0.7, 0.0] + [1 / 0.7] * (B - 2), device=DEVICE).to(win_dt)
    branch = eager_merge_roll(windows, ws, shift, H, W) * keep.view(-1, 1, 1, 1)
    s_ref = sc + branch
    s, y = merge_add_norm(windows, sc, weight, bias, 1e-5, ws, shift, y_dt, keep=keep)
    assert torch.equal(s, s_ref)
    ds, dy = _randn(s.shape, s.dtype, 55), _randn(y.shape, y.dtype, 56)
    gwin, gsc = torch.autograd.grad((s, y), (windows, sc), (ds, dy))
    (gb_ref,) = torch.autograd.grad(branch, windows, gsc.detach().to(win_dt))   # torch's multiply backward
    assert torch.equal(gwin, gb_ref)
    assert not gwin.view(B, -1, C)[1].any()   # the dropped sample's windows get no gradient
    with pytest.raises(ValueError, match="factors for a batch"):
        merge_add_norm_fwd(windows.detach(), sc.detach(), weight, bias, 1e-5, ws, shift, keep=keep[:2])


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[4]], ids=_ids)
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16)],
                         ids=["fp32", "fp32stream+bf16branch"])
def test_add_norm_shift_partition_with_stochastic_depth(shape, dtypes):
    """keep (the previous block's drop_path2 factors) multiplies the residual branch before the add: s bit
    for bit torch's x + r * keep, the windows those of s, x's gradient torch's and r's gradient torch's
    multiply backward (the gradient of s in r's dtype, times keep) bit for bit, from the same kernels."""
    B, H, W, C, ws, shift = shape
    B = max(B, 3)
    x_dt, r_dt = dtypes
    x = _randn((B, H, W, C), torch.float32, 61).to(x_dt).requires_grad_(True)
    r = _randn((B, H, W, C), torch.float32, 62).to(r_dt).requires_grad_(True)
    weight, bias = (1.0 + 0.5 * _randn((C,), torch.float32, 63)), 0.5 * _randn((C,), torch.float32, 64)
    keep = torch.tensor([1 / 0.7, 0.0] + [1 / 0.7] * (B - 2), device=DEVICE).to(r_dt)
    branch = r * keep.view(-1, 1, 1, 1)
    s_ref = x + branch
    s, win = add_norm_shift_partition(x, r, weight, bias, 1e-5, ws, shift, keep=keep)
    assert torch.equal(s, s_ref)
    s0, win0 = add_norm_shift_partition(s_ref.detach(), torch.zeros_like(s_ref), weight, bias, 1e-5, ws, shift)
    assert torch.equal(win, win0)
    ds, dwin = _randn(s.shape, s.dtype, 65), _randn(win.shape, win.dtype, 66)
    gx, gr = torch.autograd.grad((s, win), (x, r), (ds, dwin))
    s1 = s_ref.detach().requires_grad_(True)
    s1b, win1 = add_norm_shift_partition(s1, torch.zeros_like(s1), weight, bias, 1e-5, ws, shift)
    (g_s,) = torch.autograd.grad((s1b, win1), (s1,), (ds, dwin))
    assert torch.equal(gx, g_s.to(x_dt))
    (gr_ref,) = torch.autograd.grad(branch, r, g_s.to(r_dt))     # torch's multiply backward
    assert torch.equal(gr, gr_ref)
    assert not gr[1].any()   # the dropped sample's branch gets no gradient


def _rel64(a, ref):
    return ((a.detach().double() - ref.detach()).norm() / ref.detach().norm()).item()


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], SHAPES[4]], ids=_ids)
@pytest.mark.parametrize("op", ["norm_shift_partition", "add_norm_shift_partition", "merge_add_norm", "merge_norm_add"])
def test_window_norms_against_float64(op, shape):
    """fp32 inputs against the eager ops (timm's LayerNorm, roll, pad, partition and their inverses) run in
    float64 on the same values: every output and every gradient by the normwise relative error, which fp32
    arithmetic keeps near 1e-7 (the tests above compare with torch's own fp32 result)."""
    B, H, W, C, ws, shift = shape
    Hp, Wp = -(-H // ws) * ws, -(-W // ws) * ws
    leaves = {"x": _randn((B, H, W, C), torch.float32, 81) * 2.0 + 0.5,
              "r": _randn((B, H, W, C), torch.float32, 82),
              "windows": _randn((B * (Hp // ws) * (Wp // ws), ws * ws, C), torch.float32, 83) * 2.0 + 0.5,
              "weight": 1.0 + 0.5 * _randn((C,), torch.float32, 84), "bias": 0.5 * _randn((C,), torch.float32, 85)}
    ours = {k: t.clone().requires_grad_(True) for k, t in leaves.items()}
    ref = {k: t.double().requires_grad_(True) for k, t in leaves.items()}

    def run(t, kernel):
        ln = lambda v: F.layer_norm(v, (C,), t["weight"], t["bias"], 1e-5)  # noqa: E731
        if op == "norm_shift_partition":
            names = ("x", "weight", "bias")
            outs = ((norm_shift_partition(t["x"], t["weight"], t["bias"], 1e-5, ws, shift),) if kernel
                    else (eager_roll_partition(ln(t["x"]), ws, shift),))
        elif op == "add_norm_shift_partition":
            names = ("x", "r", "weight", "bias")
            if kernel:
                outs = add_norm_shift_partition(t["x"], t["r"], t["weight"], t["bias"], 1e-5, ws, shift)
            else:
                s = t["x"] + t["r"]
                outs = (s, eager_roll_partition(ln(s), ws, shift))
        elif op == "merge_add_norm":
            names = ("windows", "x", "weight", "bias")
            if kernel:
                outs = merge_add_norm(t["windows"], t["x"], t["weight"], t["bias"], 1e-5, ws, shift)
            else:
                s = t["x"] + eager_merge_roll(t["windows"], ws, shift, H, W)
                outs = (s, ln(s))
        else:
            names = ("windows", "x", "weight", "bias")
            outs = ((merge_norm_add(t["windows"], t["x"], t["weight"], t["bias"], 1e-5, ws, shift),) if kernel
                    else (t["x"] + ln(eager_merge_roll(t["windows"], ws, shift, H, W)),))
        return names, outs

    names, outs = run(ours, True)
    _, refs = run(ref, False)
    ups = [_randn(o.shape, torch.float32, 90 + i) for i, o in enumerate(outs)]
    grads = torch.autograd.grad(outs, [ours[n] for n in names], ups)
    ref_grads = torch.autograd.grad(refs, [ref[n] for n in names], [u.double() for u in ups])
    for i, (o, e) in enumerate(zip(outs, refs)):
        assert o.dtype == torch.float32 and o.shape == e.shape
        assert _rel64(o, e) < 1e-6, f"output {i}: {_rel64(o, e):.2e}"
    for name, g, e in zip(names, grads, ref_grads):
        assert g.dtype == torch.float32 and torch.isfinite(g).all(), name
        assert _rel64(g, e) < 1e-5, f"d{name}: {_rel64(g, e):.2e}"

def test_non_contiguous_input():
    B, H, W, C, ws, shift = 1, 9, 15, 33, 4, 2
    x = _randn((B, C, H, W), torch.float32, 11).permute(0, 2, 3, 1)  # (B, H, W, C), channels strided
    assert not x.is_contiguous()
    assert torch.equal(roll_partition(x, ws, shift), eager_roll_partition(x, ws, shift))
    weight, bias = _randn((C,), torch.float32, 12), _randn((C,), torch.float32, 13)
    torch.testing.assert_close(
        norm_shift_partition(x, weight, bias, 1e-5, ws, shift),
        eager_roll_partition(F.layer_norm(x, (C,), weight, bias, 1e-5), ws, shift),
        atol=1e-5, rtol=1e-5,
    )


def test_shift_larger_than_map_wraps_like_torch_roll():
    B, H, W, C, ws = 1, 5, 6, 16, 4
    x = _randn((B, H, W, C), torch.float32, 14)
    shift = 7  # > H and > W: torch.roll wraps modulo the size
    assert torch.equal(roll_partition(x, ws, shift), eager_roll_partition(x, ws, shift))
    win = roll_partition(x, ws, shift)
    assert torch.equal(merge_roll(win, ws, shift, H, W), x)


def test_norm_backward_grid_and_register_cap(monkeypatch):
    """The norm+partition backward's grid at Swin-B's stages (batch 64, 132 SMs): one wave of programs,
    each a band of whole tiles, every token once; maxnreg sized for the programs per SM the grid actually
    puts there. Stages 1-2: 3 per SM, one row of column sums. Stages 3-4 (ROW_SUMS): 8 warps' worth of
    programs per SM, evenly loaded (4 of 2 warps, 2 of 4 warps), the sums over 4 and 2 rows."""
    import importlib

    win = importlib.import_module("workbench.kernels.window")
    monkeypatch.setattr(win, "sm_count", lambda device: 132)
    win._norm_bwd_config.cache_clear()
    try:
        cpu = torch.device("cpu")
        for n_tok, C, programs, maxnreg, row_sums, slots in (
                (64 * 56 * 56, 128, 392, 168, False, 1), (64 * 28 * 28, 256, 392, 168, False, 1),
                (64 * 14 * 14, 512, 523, 255, True, 4), (64 * 7 * 7, 1024, 262, 255, True, 2)):
            block_t, _, warps, nprog, tiles, cap, _, rs, sl = win._norm_bwd_config(n_tok, C, 2, cpu)
            assert (nprog, cap, rs, sl) == (programs, maxnreg, row_sums, slots)
            assert nprog * tiles * block_t >= n_tok > (nprog - 1) * tiles * block_t      # every token, once
            per_sm = -(-nprog // 132)
            assert per_sm * warps * 32 * cap <= 65536                                   # all resident
    finally:
        win._norm_bwd_config.cache_clear()


@pytest.mark.parametrize("op, C", [("norm_shift_partition", 40), ("layer_norm", 40), ("add_layer_norm", 40),
                                   ("merge_add_norm", 40), ("norm_shift_partition", 300), ("merge_add_norm", 300)])
def test_forward_zeroes_the_backward_column_sums(monkeypatch, request, op, C):
    """Eager, the forward kernel zeroes the fp32 buffer its backward adds dweight/dbias into, so the
    backward launches no memset: with that buffer NaN-filled when allocated, the gradients still match,
    the backward adds into exactly that buffer, and a second backward through a retained graph (which
    must not add onto the first one's sums) gives the same gradients again. C = 300: the window norms'
    backward spreads its sums over several rows (slots), a buffer the forward's programs zero in turn."""
    import importlib

    lnm = importlib.import_module("workbench.kernels.layer_norm")   # the package exports a function of that name
    winm = importlib.import_module("workbench.kernels.window")
    common = importlib.import_module("workbench.kernels._common")

    monkeypatch.setattr(common, "new_output", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))
    intos = []
    for mod in (lnm, winm):
        real = mod.column_sums
        monkeypatch.setattr(mod, "column_sums", lambda *a, _real=real, **k: (intos.append(a[3] if len(a) > 3 else k.get("into")), _real(*a, **k))[1])
    B, H, W, ws, shift = 2, 9, 11, 7, 3
    if C == 300:  # a row of sums per 2 programs: several rows even for this small grid
        monkeypatch.setattr(winm, "_NORM_BWD_PER_SLOT", 2)
        winm._norm_bwd_config.cache_clear()
        request.addfinalizer(winm._norm_bwd_config.cache_clear)  # no grid cached with the patched constant
        x_like = torch.empty(B, H, W, C)
        assert winm._norm_bwd_slots(x_like) > 1 and winm._norm_bwd_slots(x_like) * 2 * C > 512  # several blocks
    x = (_randn((B, H, W, C), torch.float32, 31) * 2 + 0.5).requires_grad_(True)
    r = _randn((B, H, W, C), torch.float32, 32).requires_grad_(True)
    w = (1 + 0.5 * _randn((C,), torch.float32, 33)).requires_grad_(True)
    b = (0.5 * _randn((C,), torch.float32, 34)).requires_grad_(True)
    x32, r32, w32, b32 = (t.detach().clone().requires_grad_(True) for t in (x, r, w, b))
    if op == "norm_shift_partition":
        out, ref = norm_shift_partition(x, w, b, 1e-5, ws, shift), eager_roll_partition(F.layer_norm(x32, (C,), w32, b32, 1e-5), ws, shift)
        leaves, ref_leaves = (x, w, b), (x32, w32, b32)
    elif op == "layer_norm":
        out, ref = lnm.layer_norm(x, w, b, 1e-5), F.layer_norm(x32, (C,), w32, b32, 1e-5)
        leaves, ref_leaves = (x, w, b), (x32, w32, b32)
    elif op == "add_layer_norm":
        out, ref = lnm.add_layer_norm(x, r, w, b, 1e-5)[1], F.layer_norm(x32 + r32, (C,), w32, b32, 1e-5)
        leaves, ref_leaves = (x, r, w, b), (x32, r32, w32, b32)
    else:  # the windows are roll_partition(r): the merge gives r back
        win, win32 = (eager_roll_partition(t, ws, shift).detach().requires_grad_(True) for t in (r, r32))
        out = merge_add_norm(win, x, w, b, 1e-5, ws, shift)[1]
        ref = F.layer_norm(x32 + eager_merge_roll(win32, ws, shift, H, W), (C,), w32, b32, 1e-5)
        leaves, ref_leaves = (win, x, w, b), (win32, x32, w32, b32)
    dout = _randn(ref.shape, torch.float32, 35)
    want = torch.autograd.grad(ref, ref_leaves, dout)
    first = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    assert intos[0] is not None, "the first backward must add into the buffer its forward zeroed"
    if C == 300:
        assert intos[0].numel() == winm._norm_bwd_slots(x) * 2 * C
    second = torch.autograd.grad(out, leaves, dout)
    assert intos[1] is None, "a second backward gets a fresh zeroed buffer"
    for g1, g2, e in zip(first, second, want):
        torch.testing.assert_close(g1, e, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(g2, e, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("op", ["norm_shift_partition", "add_layer_norm"])
def test_output_in_the_autocast_dtype_matches_the_cast_bit_for_bit(op, monkeypatch):
    """out_dtype / y_dtype: the fp32 op's result written in bf16 is exactly `.to(bfloat16)` of the fp32
    result, and the backward from a bf16 gradient equals the fp32 op's backward through that cast. The
    weight and bias sums in their fixed-order (deterministic) mode: on a GPU the atomic ones add in
    whatever order the programs finish, which is not the same bits twice."""
    import importlib

    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)

    lnm = importlib.import_module("workbench.kernels.layer_norm")
    B, H, W, C, ws, shift = 2, 9, 11, 40, 7, 3
    leaves = [(_randn((B, H, W, C), torch.float32, 41) * 2 + 0.5), _randn((B, H, W, C), torch.float32, 42),
              1 + 0.5 * _randn((C,), torch.float32, 43), 0.5 * _randn((C,), torch.float32, 44)]

    def run(direct: bool):
        x, r, w, b = (t.clone().requires_grad_(True) for t in leaves)
        dt = torch.bfloat16 if direct else None
        if op == "norm_shift_partition":
            out, ins = norm_shift_partition(x, w, b, 1e-5, ws, shift, dt), (x, w, b)
        else:
            out, ins = lnm.add_layer_norm(x, r, w, b, 1e-5, dt)[1], (x, r, w, b)
        out = out if direct else out.to(torch.bfloat16)
        assert out.dtype == torch.bfloat16
        return (out.detach(), *torch.autograd.grad(out, ins, _randn(out.shape, torch.bfloat16, 45)))

    for a, e in zip(run(True), run(False)):
        assert a.dtype == e.dtype and torch.equal(a, e)


def test_no_column_sum_buffer_without_a_backward(monkeypatch):
    """Under no_grad (inference) the forward allocates and zeroes nothing for a backward that won't run."""
    import importlib

    lnm = importlib.import_module("workbench.kernels.layer_norm")
    common = importlib.import_module("workbench.kernels._common")
    made = []
    real = common.new_output
    monkeypatch.setattr(common, "new_output", lambda shape, dtype, device: made.append(shape) or real(shape, dtype, device))
    x, w, b = _randn((1, 7, 7, 16), torch.float32, 51), _randn((16,), torch.float32, 52), _randn((16,), torch.float32, 53)
    with torch.no_grad():
        norm_shift_partition(x, w, b, 1e-5, 7, 0)
        lnm.layer_norm(x, w, b)
    assert (32,) not in made
    x.requires_grad_(True)
    norm_shift_partition(x, w, b, 1e-5, 7, 0)
    assert (32,) in made


def _ln_op_grads(op, shape, dtype, seed):
    """(outputs, every gradient) of a window LayerNorm op through autograd, parameters in `dtype`."""
    B, H, W, C, ws, shift = shape
    Hp, Wp = -(-H // ws) * ws, -(-W // ws) * ws
    x = (_randn((B, H, W, C), torch.float32, seed) * 2.0 + 0.5).to(dtype).requires_grad_(True)
    r = _randn((B, H, W, C), torch.float32, seed + 1).to(dtype).requires_grad_(True)
    windows = _randn((B * (Hp // ws) * (Wp // ws), ws * ws, C), torch.float32, seed + 2).to(dtype).requires_grad_(True)
    weight = (1.0 + 0.5 * _randn((C,), torch.float32, seed + 3)).to(dtype).requires_grad_(True)
    bias = (0.5 * _randn((C,), torch.float32, seed + 4)).to(dtype).requires_grad_(True)
    if op == "norm":
        outs, leaves = (norm_shift_partition(x, weight, bias, 1e-5, ws, shift),), (x, weight, bias)
    elif op == "add_norm":
        outs, leaves = add_norm_shift_partition(x, r, weight, bias, 1e-5, ws, shift), (x, r, weight, bias)
    else:
        outs, leaves = merge_add_norm(windows, x, weight, bias, 1e-5, ws, shift), (windows, x, weight, bias)
    ups = tuple(_randn(o.shape, o.dtype, seed + 5 + i) for i, o in enumerate(outs))
    grads = torch.autograd.grad(outs, leaves, ups)
    return [o.detach() for o in outs] + list(grads)


@pytest.mark.skipif(DEVICE != "cuda", reason="programmatic dependent launch is a GPU launch attribute")
@pytest.mark.parametrize("op", ["norm", "add_norm", "merge_add_norm"])
def test_pdl_launches_match_plain_launches(monkeypatch, op):
    """The window kernels launched with programmatic dependent launch give the plain launches' results
    (every kernel waits for the previous one before its first load): outputs and dx bit for bit, the
    parameters' gradients to a bf16 ulp (fp32 atomic sums in another order)."""
    import workbench.kernels._common as ops

    if not ops.pdl_supported():
        pytest.skip("no programmatic dependent launch on this GPU / Triton")
    shape = (4, 14, 14, 256, 7, 3)
    monkeypatch.setattr(ops, "PDL_LAUNCH", False)
    ref = _ln_op_grads(op, shape, torch.bfloat16, 70)
    monkeypatch.setattr(ops, "PDL_LAUNCH", True)
    got = _ln_op_grads(op, shape, torch.bfloat16, 70)
    for i, (a, b) in enumerate(zip(ref, got)):
        if i >= len(ref) - 2:
            torch.testing.assert_close(b.float(), a.float(), atol=1e-2 * max(1.0, a.float().abs().max().item()), rtol=1e-2)
        else:
            assert torch.equal(a, b), i
    x = _randn((4, 14, 14, 96), torch.bfloat16, 71)
    win = roll_partition(x, 7, 3)
    assert torch.equal(win, roll_partition_reference(x, 7, 3))
    assert torch.equal(merge_roll(win, 7, 3, 14, 14), x)


# ------------------------------------------------------------------- the operators torch.compile traces


def _chain_inputs(op, shape, dtype, keep, seed):
    """Leaves and arguments of add_norm_shift_partition / merge_add_norm for the operator tests: the residual
    stream in fp32, the branch (or windows) and parameters in `dtype`; keep: (B,) factors in the branch's
    dtype (one sample dropped) or None."""
    B, H, W, C, ws, shift = shape
    Hp, Wp = -(-H // ws) * ws, -(-W // ws) * ws
    x = (_randn((B, H, W, C), torch.float32, seed) * 2.0 + 0.5).requires_grad_(True)
    branch_shape = (B, H, W, C) if op == "add_norm" else (B * (Hp // ws) * (Wp // ws), ws * ws, C)
    branch = _randn(branch_shape, torch.float32, seed + 1).to(dtype).requires_grad_(True)
    weight = (1.0 + 0.5 * _randn((C,), torch.float32, seed + 2)).to(dtype).requires_grad_(True)
    bias = (0.5 * _randn((C,), torch.float32, seed + 3)).to(dtype).requires_grad_(True)
    factors = None if not keep else torch.tensor([1 / 0.7, 0.0] + [1 / 0.7] * (B - 2), device=DEVICE).to(dtype)
    return x, branch, weight, bias, factors


def _chain_run(op, shape, dtype, keep, with_ds, seed=80):
    """Outputs and every gradient of the op's autograd Function (the block forwards' arguments: the
    autocast-style output dtype, y as token rows), the gradient at s given or not."""
    B, H, W, C, ws, shift = shape
    x, branch, weight, bias, factors = _chain_inputs(op, shape, dtype, keep, seed)
    if op == "add_norm":
        outs = add_norm_shift_partition(x, branch, weight, bias, 1e-5, ws, shift, dtype, factors)
        leaves = (x, branch, weight, bias)
    else:
        outs = merge_add_norm(branch, x, weight, bias, 1e-5, ws, shift, dtype, y_rows=True, keep=factors)
        leaves = (branch, x, weight, bias)
    ups = tuple(_randn(o.shape, o.dtype, seed + 5 + i) for i, o in enumerate(outs))
    if not with_ds:   # only the second output takes a gradient (autograd hands the Function zeros for s)
        outs, ups = outs[1:], ups[1:]
    grads = torch.autograd.grad(outs, leaves, ups)
    return [o.detach() for o in outs] + list(grads)


CHAIN_SHAPES = [(3, 9, 15, 33, 4, 2), (2, 14, 14, 96, 7, 3)]   # padded and non-square; Swin's layout


def _same(a, b, what, parameter_grad):
    """Bit for bit; on a GPU a parameter gradient's fp32 atomic sums add up in any order (one bf16 ulp)."""
    if parameter_grad and DEVICE == "cuda":
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2 * max(1.0, b.float().abs().max().item()), rtol=1e-2)
    else:
        assert a.dtype == b.dtype and torch.equal(a, b), what


@pytest.mark.parametrize("shape", CHAIN_SHAPES, ids=_ids)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("keep", [False, True], ids=["no_keep", "keep"])
@pytest.mark.parametrize("op", ["add_norm", "merge_add_norm"])
def test_traced_chain_functions_match_eager_bit_for_bit(op, keep, dtype, shape):
    """add_norm_shift_partition and merge_add_norm where torch.compile traces them (`as_compiled`: no column-sum
    buffer on ctx, so through their operators, whose host functions run here as the compiled graph calls
    them back on the CPU) give the eager Functions' outputs and gradients bit for bit, with and without
    stochastic-depth factors, with and without a gradient at s."""
    from workbench.kernels._common import as_compiled, launch_log

    for with_ds in (True, False):
        with launch_log() as eager_log:
            eager = _chain_run(op, shape, dtype, keep, with_ds)
        with as_compiled(), launch_log() as traced_log:
            traced = _chain_run(op, shape, dtype, keep, with_ds)
        n_out = len(eager) - 4
        for i, (a, b) in enumerate(zip(traced, eager)):
            _same(a, b, f"{op} with_ds={with_ds}: output/gradient {i}", i >= len(eager) - 2)
        assert n_out == (2 if with_ds else 1)
        # the same fused kernels each way (eager zeroes the column sums in the forward kernel instead)
        fused = {"_partition_fwd_kernel", "_merge_norm_fwd_kernel", "_norm_partition_bwd_kernel"}
        assert ([e["kernel"] for e in traced_log if e["kernel"] in fused]
                == [e["kernel"] for e in eager_log if e["kernel"] in fused])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("keep", [False, True], ids=["no_keep", "keep"])
@pytest.mark.parametrize("op", ["add_norm", "merge_add_norm"])
def test_chain_operators_match_their_host_functions_and_fakes(op, keep, dtype):
    """Each operator of the chain called through the dispatcher (what a compiled graph calls) gives its host
    function's results bit for bit, ds None or given, keep None or given; its fake implementation gives
    the real outputs' shapes, dtypes and strides (the padded, non-square shape)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import workbench.kernels.window as wk

    shape = CHAIN_SHAPES[0]
    B, H, W, C, ws, shift = shape
    x, branch, weight, bias, factors = (t.detach() if t is not None else None
                                        for t in _chain_inputs(op, shape, dtype, keep, 90))
    if op == "add_norm":
        fwd_args = (x, branch, weight, bias, 1e-5, ws, shift, dtype, factors)
        fwd_op, host = wk._add_norm_shift_partition_fwd_op, wk.add_norm_shift_partition_fwd
        ref = host(x, branch, weight, bias, 1e-5, ws, shift, out_dtype=dtype, keep=factors)
        s, out, mean, rstd = ref
        g = _randn(out.shape, out.dtype, 91)
    else:
        fwd_args = (branch, x, weight, bias, 1e-5, ws, shift, dtype, factors)
        fwd_op, host = wk._merge_add_norm_fwd_op, wk.merge_add_norm_fwd
        ref = host(branch, x, weight, bias, 1e-5, ws, shift, y_dtype=dtype, keep=factors)
        s, out, mean, rstd = ref
        g = _randn((B * H * W, C), out.dtype, 91)   # dy as token rows, as the block forward hands it
    calls = [(fwd_op, fwd_args, ref)]
    for ds in (None, _randn(s.shape, s.dtype, 92)):
        if op == "merge_add_norm":
            args = (g, s, weight, mean, rstd, ws, shift, ds, factors, branch.dtype, x.dtype)
            want = merge_add_norm_bwd(g, s, weight, mean, rstd, ws, shift, ds, branch.dtype, x.dtype, keep=factors)
            calls.append((wk._merge_add_norm_bwd_op, args, want))
        elif factors is None:
            args = (g, s, weight, mean, rstd, ws, shift, ds)
            want = norm_shift_partition_bwd(g, s, weight, mean, rstd, ws, shift, ds=ds)
            calls.append((wk._add_norm_shift_partition_bwd_op, args, want))
        else:
            args = (g, s, weight, mean, rstd, ws, shift, ds, factors, branch.dtype)
            want = wk._add_norm_keep_bwd(g, s, weight, mean, rstd, ws, shift, ds, factors, branch.dtype, None, False)
            calls.append((wk._add_norm_shift_partition_keep_bwd_op, args, want))
    for kop, args, want in calls:
        got = kop.opaque(*args)
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want)):
            _same(a, b, f"{kop.__name__} output {i}", kop is not fwd_op and i == len(want) - 1)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
            fakes = kop.opaque(*fake_args)
        for i, (f, b) in enumerate(zip(fakes, want)):
            assert (f.shape, f.dtype, f.stride()) == (b.shape, b.dtype, b.stride()), f"{kop.__name__} fake output {i}"
