"""layer_norm, add_layer_norm and post_add_layer_norm vs plain PyTorch (F.layer_norm; x + r then F.layer_norm;
r + F.layer_norm(x), the post-norm residual): output and every
gradient (x, residual, weight, bias), on fresh random inputs, odd row counts and odd C.

For fp16/bf16 the reference is the same PyTorch computation run in fp32 on the same (rounded) inputs,
its results cast to the dtype: torch's own bf16 CPU LayerNorm rounds its intermediates and is itself up
to ~5e-2 off the fp32 result on dweight/dbias, more than ours is.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is
imported). Note the interpreter rounds fp32 -> bf16 toward zero where the GPU rounds to nearest even, so
bf16 results differ from torch's by up to one bf16 ulp more than on the GPU; the 2e-2 tolerance covers it.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from workbench.kernels.layer_norm import TritonLayerNorm, add_layer_norm, layer_norm, post_add_layer_norm  # noqa: E402

# The module itself (workbench.kernels re-exports a function of the same name).
layer_norm_module = importlib.import_module("workbench.kernels.layer_norm")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"

# (leading dims..., C): odd and prime row counts, odd C, and the Swin widths.
SHAPES = [(1, 33), (7, 100), (3, 5, 96), (2, 7, 7, 128), (13, 33), (5, 1536)]
DTYPES = [
    (torch.float32, 1e-5, 1e-5),
    (torch.bfloat16, 2e-2, 2e-2),
    (torch.float16, 2e-2, 2e-2),
]
EPS = 1e-5


def _rand(shape, dtype, seed_offset=0, scale=1.0, shift=0.0):
    """Fresh random tensor (never zeros), off-center so the mean subtraction matters."""
    g = torch.Generator().manual_seed(1234 + seed_offset)
    t = torch.randn(shape, generator=g) * scale + shift
    return t.to(device=DEVICE, dtype=dtype)


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _params(C, dtype, seed=0):
    w = _rand((C,), dtype, 100 + seed, scale=0.5, shift=1.0)
    b = _rand((C,), dtype, 200 + seed, scale=0.5)
    return w, b


def _assert_close(actual, expected, atol, rtol, what):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert not torch.isnan(actual).any(), f"{what}: NaN in result"
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_layer_norm_matches_torch(shape, dtype, atol, rtol):
    C = shape[-1]
    x = _rand(shape, dtype, 1, scale=2.0, shift=0.5)
    w, b = _params(C, dtype)
    dy = _rand(shape, dtype, 2)

    ours = [_leaf(t) for t in (x, w, b)]
    ref = [_leaf(t.float()) for t in (x, w, b)]
    y = layer_norm(ours[0], ours[1], ours[2], EPS)
    y_ref = F.layer_norm(ref[0], (C,), ref[1], ref[2], EPS)
    _assert_close(y, y_ref.to(dtype), atol, rtol, "y")
    y.backward(dy)
    y_ref.backward(dy.float())
    for name, a, e in zip(("dx", "dweight", "dbias"), ours, ref):
        _assert_close(a.grad, e.grad.to(dtype), atol, rtol, name)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_add_layer_norm_matches_torch(shape, dtype, atol, rtol):
    C = shape[-1]
    x = _rand(shape, dtype, 3, scale=2.0, shift=0.5)
    r = _rand(shape, dtype, 4)
    w, b = _params(C, dtype, seed=1)
    ds, dy = _rand(shape, dtype, 5), _rand(shape, dtype, 6)

    ours = [_leaf(t) for t in (x, r, w, b)]
    ref = [_leaf(t.float()) for t in (x, r, w, b)]
    s, y = add_layer_norm(*ours, EPS)
    s_ref = (ref[0] + ref[1]).to(dtype).float()  # the sum is stored in `dtype`, as torch's add would
    _assert_close(s, s_ref.to(dtype), atol, rtol, "sum")
    # Normalize the very sum the kernel stored (gradient passes straight through). On the GPU the two
    # sums are bit-equal; the interpreter's round-toward-zero makes some differ by one bf16/fp16 ulp,
    # which summed over rows would blur the dweight check.
    s_ref = s_ref + (s.detach().float() - s_ref).detach()
    y_ref = F.layer_norm(s_ref, (C,), ref[2], ref[3], EPS)
    _assert_close(y, y_ref.to(dtype), atol, rtol, "normed")
    torch.autograd.backward((s, y), (ds, dy))
    torch.autograd.backward((s_ref, y_ref), (ds.float(), dy.float()))
    for name, a, e in zip(("dx", "dresidual", "dweight", "dbias"), ours, ref):
        _assert_close(a.grad, e.grad.to(dtype), atol, rtol, name)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_post_add_layer_norm_matches_torch(shape, dtype, atol, rtol):
    """r + LayerNorm(x), summed in fp32 and rounded once: against the fp32 computation on the same inputs."""
    C = shape[-1]
    x = _rand(shape, dtype, 31, scale=2.0, shift=0.5)
    r = _rand(shape, dtype, 32, scale=3.0)
    w, b = _params(C, dtype, seed=3)
    dout = _rand(shape, dtype, 33)
    ours = [_leaf(t) for t in (x, r, w, b)]
    ref = [_leaf(t.float()) for t in (x, r, w, b)]
    out = post_add_layer_norm(*ours, EPS)
    out_ref = ref[1] + F.layer_norm(ref[0], (C,), ref[2], ref[3], EPS)
    _assert_close(out, out_ref.to(dtype), atol, rtol, "out")
    out.backward(dout)
    out_ref.backward(dout.float())
    for name, a, e in zip(("dx", "dresidual", "dweight", "dbias"), ours, ref):
        _assert_close(a.grad, e.grad.to(dtype), atol, rtol, name)


def test_post_add_layer_norm_like_autocast():
    """SwinV2 under CUDA autocast: a bf16 branch (the proj or fc2 output), an fp32 residual stream, fp32
    norm parameters: the sum is fp32, torch's result (its norm output is fp32 there), and the branch's
    gradient comes back in bf16, the residual's in fp32."""
    shape, C = (3, 7, 96), 96
    x = _leaf(_rand(shape, torch.bfloat16, 34, scale=2.0))
    r = _leaf(_rand(shape, torch.float32, 35))
    w, b = (_leaf(p) for p in _params(C, torch.float32, seed=4))
    xr, rr, wr, br = (_leaf(t) for t in (x, r, w, b))
    out = post_add_layer_norm(x, r, w, b, EPS)
    out_ref = rr + F.layer_norm(xr.float(), (C,), wr, br, EPS)
    _assert_close(out, out_ref, 1e-5, 1e-5, "out")
    dout = _rand(shape, torch.float32, 36)
    out.backward(dout)
    out_ref.backward(dout)
    assert x.grad.dtype == torch.bfloat16 and r.grad.dtype == torch.float32
    _assert_close(x.grad, xr.grad, 2e-2, 2e-2, "dx (bf16)")
    _assert_close(r.grad, rr.grad, 0, 0, "dresidual")
    _assert_close(w.grad, wr.grad, 1e-5, 1e-5, "dweight")
    _assert_close(b.grad, br.grad, 1e-5, 1e-5, "dbias")


def test_post_add_layer_norm_float64_truth():
    """fp32 inputs against the same math in float64: the kernel's one rounding keeps it within fp32's."""
    shape, C = (45, 133), 133
    x, r = _rand(shape, torch.float32, 37, scale=4.0, shift=1.0), _rand(shape, torch.float32, 38)
    w, b = _params(C, torch.float32, seed=6)
    out = post_add_layer_norm(x, r, w, b, EPS)
    truth = r.double() + F.layer_norm(x.double(), (C,), w.double(), b.double(), EPS)
    assert (out.double() - truth).abs().max().item() <= 4e-6 * truth.abs().max().item()


def test_add_layer_norm_only_normed_output_used():
    """When only the normed output feeds the loss, the gradient at the sum arrives as zeros."""
    shape, C = (11, 100), 100
    ours = [_leaf(t) for t in (_rand(shape, torch.float32, 7), _rand(shape, torch.float32, 8), *_params(C, torch.float32))]
    ref = [_leaf(t) for t in ours]
    _, y = add_layer_norm(*ours, EPS)
    y_ref = F.layer_norm(ref[0] + ref[1], (C,), ref[2], ref[3], EPS)
    dy = _rand(shape, torch.float32, 9)
    y.backward(dy)
    y_ref.backward(dy)
    for name, a, e in zip(("dx", "dresidual", "dweight", "dbias"), ours, ref):
        _assert_close(a.grad, e.grad, 1e-5, 1e-5, name)


def test_add_layer_norm_mixed_dtypes_like_autocast():
    """Under autocast the residual stream is fp32 and the attention output bf16: the sum and the normed
    output are fp32 (as torch's promotion gives) and each input gets its gradient in its own dtype."""
    shape, C = (3, 7, 96), 96
    x = _leaf(_rand(shape, torch.float32, 10, scale=2.0))
    r = _leaf(_rand(shape, torch.bfloat16, 11))
    w, b = (_leaf(p) for p in _params(C, torch.float32, seed=2))
    xr, rr, wr, br = (_leaf(t) for t in (x, r, w, b))
    s, y = add_layer_norm(x, r, w, b, EPS)
    s_ref = xr + rr
    y_ref = F.layer_norm(s_ref, (C,), wr, br, EPS)
    _assert_close(s, s_ref, 1e-5, 1e-5, "sum")
    _assert_close(y, y_ref, 1e-5, 1e-5, "normed")
    ds, dy = _rand(shape, torch.float32, 12), _rand(shape, torch.float32, 13)
    torch.autograd.backward((s, y), (ds, dy))
    torch.autograd.backward((s_ref, y_ref), (ds, dy))
    _assert_close(x.grad, xr.grad, 1e-5, 1e-5, "dx")
    _assert_close(r.grad, rr.grad, 2e-2, 2e-2, "dresidual (bf16)")
    _assert_close(w.grad, wr.grad, 1e-5, 1e-5, "dweight")
    _assert_close(b.grad, br.grad, 1e-5, 1e-5, "dbias")


def test_layer_norm_bf16_input_fp32_params():
    """bf16 activations with fp32 parameters (an autocast model): output bf16, grads in each input's dtype."""
    shape, C = (9, 128), 128
    x = _leaf(_rand(shape, torch.bfloat16, 14, scale=2.0))
    w, b = (_leaf(p) for p in _params(C, torch.float32, seed=3))
    xr, wr, br = (_leaf(t) for t in (x, w, b))
    y = layer_norm(x, w, b, EPS)
    y_ref = F.layer_norm(xr.float(), (C,), wr, br, EPS)
    _assert_close(y, y_ref.to(torch.bfloat16), 2e-2, 2e-2, "y")
    dy = _rand(shape, torch.bfloat16, 15)
    y.backward(dy)
    y_ref.backward(dy.float())
    _assert_close(x.grad, xr.grad, 2e-2, 2e-2, "dx")
    _assert_close(w.grad, wr.grad, 2e-2, 2e-2, "dweight")
    _assert_close(b.grad, br.grad, 2e-2, 2e-2, "dbias")


def test_without_weight_and_bias():
    shape, C = (7, 33), 33
    x = _leaf(_rand(shape, torch.float32, 16, scale=3.0))
    r = _leaf(_rand(shape, torch.float32, 17))
    xr, rr = _leaf(x), _leaf(r)
    s, y = add_layer_norm(x, r, None, None, EPS)
    y_ref = F.layer_norm(xr + rr, (C,), None, None, EPS)
    _assert_close(y, y_ref, 1e-5, 1e-5, "normed")
    dy = _rand(shape, torch.float32, 18)
    y.backward(dy)
    y_ref.backward(dy)
    _assert_close(x.grad, xr.grad, 1e-5, 1e-5, "dx")
    _assert_close(layer_norm(x, None, None, EPS), F.layer_norm(x, (C,), None, None, EPS), 1e-5, 1e-5, "y")


def test_non_contiguous_input():
    C = 100
    base = _rand((C, 15), torch.float32, 19, scale=2.0)
    x_leaf, xr_leaf = _leaf(base), _leaf(base)
    w, b = _params(C, torch.float32, seed=4)
    y = layer_norm(x_leaf.t(), w, b, EPS)  # (15, C), not contiguous
    y_ref = F.layer_norm(xr_leaf.t(), (C,), w, b, EPS)
    _assert_close(y, y_ref, 1e-5, 1e-5, "y")
    dy = _rand((15, C), torch.float32, 20)
    y.backward(dy)
    y_ref.backward(dy)
    _assert_close(x_leaf.grad, xr_leaf.grad, 1e-5, 1e-5, "dx")


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("fn", ["layer_norm", "add_layer_norm", "post_add_layer_norm"])
def test_kernels_write_every_element(monkeypatch, fn, deterministic):
    """Every buffer the kernels write (outputs, mean/rstd, dx, and in deterministic mode the per-program
    dweight/dbias rows) starts as NaN."""
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: deterministic)

    def nan_filled(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(importlib.import_module("workbench.kernels._common"), "new_output", nan_filled)
    shape, C = (2, 37, 100), 100  # 74 rows: several backward programs, a ragged last one
    x = _leaf(_rand(shape, torch.float32, 21, scale=2.0))
    r = _leaf(_rand(shape, torch.float32, 22))
    w, b = (_leaf(p) for p in _params(C, torch.float32, seed=5))
    xr, rr, wr, br = (_leaf(t) for t in (x, r, w, b))
    if fn == "layer_norm":
        outs, refs = (layer_norm(x, w, b, EPS),), (F.layer_norm(xr, (C,), wr, br, EPS),)
        leaves = (("dx", x, xr), ("dweight", w, wr), ("dbias", b, br))
    elif fn == "post_add_layer_norm":
        outs, refs = (post_add_layer_norm(x, r, w, b, EPS),), (rr + F.layer_norm(xr, (C,), wr, br, EPS),)
        leaves = (("dx", x, xr), ("dresidual", r, rr), ("dweight", w, wr), ("dbias", b, br))
    else:
        outs = add_layer_norm(x, r, w, b, EPS)
        s_ref = xr + rr
        refs = (s_ref, F.layer_norm(s_ref, (C,), wr, br, EPS))
        leaves = (("dx", x, xr), ("dresidual", r, rr), ("dweight", w, wr), ("dbias", b, br))
    grads = [_rand(shape, torch.float32, 23 + i) for i in range(len(outs))]
    for i, (o, e) in enumerate(zip(outs, refs)):
        _assert_close(o, e, 1e-5, 1e-5, f"output {i}")
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(refs, grads)
    for name, a, e in leaves:
        _assert_close(a.grad, e.grad, 1e-5, 1e-5, name)


def test_triton_layer_norm_module_keeps_parameters():
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(96, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        ln.weight.normal_(1.0, 0.2)
        ln.bias.normal_(0.0, 0.2)
    tln = TritonLayerNorm.from_layer_norm(ln)
    assert tln.weight is ln.weight and tln.bias is ln.bias
    assert list(tln.state_dict()) == list(ln.state_dict()) == ["weight", "bias"]
    assert isinstance(tln, torch.nn.LayerNorm) and tln.eps == 1e-6
    x = _rand((5, 7, 96), torch.float32, 30, scale=2.0)
    _assert_close(tln(x), ln(x), 1e-5, 1e-5, "module output")


def test_module_under_autocast_returns_torch_s_dtype():
    """Under autocast TritonLayerNorm returns the dtype torch's LayerNorm returns on this device (fp32 under
    CUDA autocast, whose layer_norm runs in fp32; the input's dtype under the CPU's), with the same values:
    swapping it in keeps a model's dtypes, and its residual stream's precision, as autocast has them."""
    ln = torch.nn.LayerNorm(100).to(DEVICE)
    tln = TritonLayerNorm.from_layer_norm(ln)
    x = _rand((9, 100), torch.bfloat16, 31, scale=2.0)
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        y_ref = ln(x)
        y = tln(x)
    assert y.dtype == y_ref.dtype
    tol = 1e-5 if y.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y, y_ref, atol=tol, rtol=tol)


def test_layer_norm_out_dtype_fp32_from_bf16():
    """out_dtype=fp32 on a bf16 x: F.layer_norm of the upcast x, in fp32; dx in bf16; rounding that output
    to bf16 gives exactly the default (bf16) output, each rounded once from the same fp32 values."""
    shape, C = (2, 7, 96), 96
    x = _leaf(_rand(shape, torch.bfloat16, 16, scale=2.0, shift=0.5))
    w, b = (_leaf(p) for p in _params(C, torch.float32, seed=4))
    xr, wr, br = (_leaf(t) for t in (x, w, b))
    y = layer_norm(x, w, b, EPS, torch.float32)
    y_ref = F.layer_norm(xr.float(), (C,), wr, br, EPS)
    _assert_close(y, y_ref, 1e-5, 1e-5, "y")
    assert torch.equal(y.to(torch.bfloat16), layer_norm(x.detach(), w.detach(), b.detach(), EPS))
    dy = _rand(shape, torch.float32, 17)
    y.backward(dy)
    y_ref.backward(dy)
    _assert_close(x.grad, xr.grad, 2e-2, 2e-2, "dx")
    _assert_close(w.grad, wr.grad, 1e-4, 1e-4, "dweight")
    _assert_close(b.grad, br.grad, 1e-4, 1e-4, "dbias")


def test_too_wide_rows_rejected():
    C = layer_norm_module.MAX_COLS + 1
    x = torch.randn(1, C, device=DEVICE)
    with pytest.raises(ValueError, match="MAX_COLS"):
        layer_norm(x, None, None, EPS)


# Bigger, Swin-sized shapes: only worth running on a GPU.
SWIN_SHAPES = [(2 * 56 * 56 + 3, 128), (4 * 28 * 28, 256), (8 * 14 * 14 + 1, 512), (16 * 49, 1024), (97, 1536)]


def _check_against_float64(op, shape, dtype, tol):
    """Output and every gradient vs the same computation in float64 on upcast inputs, by the normwise
    relative error ||ours - ref|| / ||ref||. Used where rows are many: dweight/dbias then sum ~2e5 fp32
    terms, and two fp32 summation orders (ours blocked per program, torch's its own) differ by ~1e-5 of
    the sum, which an elementwise 1e-5 check against torch's own fp32 result rejects (seen on an H200 at
    200704 rows: 4.2e-5 abs) although both are right to fp32 accuracy. Against float64, fp32 arithmetic
    lands far under `tol`."""
    C = shape[-1]
    x = _rand(shape, dtype, 40, scale=2.0, shift=0.5)
    r = _rand(shape, dtype, 41)
    w, b = _params(C, dtype, seed=6)
    ds, dy = _rand(shape, dtype, 42), _rand(shape, dtype, 43)
    ours = [_leaf(t) for t in (x, r, w, b)]
    ref = [_leaf(t.double()) for t in (x, r, w, b)]
    if op == "layer_norm":
        outs = (layer_norm(ours[0], ours[2], ours[3], EPS),)
        refs = (F.layer_norm(ref[0], (C,), ref[2], ref[3], EPS),)
        names, grads = ("dx", "dweight", "dbias"), (dy,)
        pairs = [(ours[0], ref[0]), (ours[2], ref[2]), (ours[3], ref[3])]
    elif op == "post_add_layer_norm":
        outs = (post_add_layer_norm(*ours, EPS),)
        refs = (ref[1] + F.layer_norm(ref[0], (C,), ref[2], ref[3], EPS),)
        names, grads = ("dx", "dresidual", "dweight", "dbias"), (dy,)
        pairs = list(zip(ours, ref))
    else:
        outs = add_layer_norm(*ours, EPS)
        s_ref = ref[0] + ref[1]
        refs = (s_ref, F.layer_norm(s_ref, (C,), ref[2], ref[3], EPS))
        names, grads = ("dx", "dresidual", "dweight", "dbias"), (ds, dy)
        pairs = list(zip(ours, ref))
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(refs, tuple(g.double() for g in grads))
    checks = [(f"out{i}", o, e) for i, (o, e) in enumerate(zip(outs, refs))]
    checks += [(n, a.grad, e.grad) for n, (a, e) in zip(names, pairs)]
    for name, a, e in checks:
        assert a.dtype == dtype and not torch.isnan(a).any(), name
        err = ((a.detach().double() - e.detach()).norm() / e.detach().norm()).item()
        assert err <= tol, f"{op} {shape} {name}: ||ours - ref64|| / ||ref64|| = {err:.2e} > {tol}"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", SWIN_SHAPES)
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_add_layer_norm_swin_shapes_gpu(shape, dtype, atol, rtol):
    if dtype == torch.float32:
        # fp32 at up to 2e5 rows: against float64, normwise (see _check_against_float64); fp32 math
        # gives ~1e-7..1e-6, so 1e-5 leaves room for the reduction order and nothing for a bug.
        for op in ("add_layer_norm", "layer_norm"):
            _check_against_float64(op, shape, dtype, 1e-5)
        return
    test_add_layer_norm_matches_torch(shape, dtype, atol, rtol)
    test_layer_norm_matches_torch(shape, dtype, atol, rtol)


@pytest.mark.parametrize("shape", [(37, 100), (3, 5, 33)])
@pytest.mark.parametrize("op", ["add_layer_norm", "layer_norm", "post_add_layer_norm"])
def test_float64_check_on_cpu_shape(op, shape):
    """The float64 comparison itself, on small odd shapes (runs without a GPU too); post_add_layer_norm's
    gradients are otherwise checked against torch's fp32 only."""
    _check_against_float64(op, shape, torch.float32, 1e-5)


def _timm_merging_gather(x: torch.Tensor) -> torch.Tensor:
    """timm PatchMerging's zero pad to even sides and 2x2 gather, (B, H, W, C) -> (B, H/2, W/2, 4C)."""
    B, H, W, C = x.shape
    x = F.pad(x, (0, 0, 0, W % 2, 0, H % 2))
    return x.reshape(B, (H + H % 2) // 2, 2, (W + W % 2) // 2, 2, C).permute(0, 1, 3, 4, 2, 5).flatten(3)


@pytest.mark.parametrize("shape", [(2, 8, 8, 16), (1, 7, 9, 24), (3, 5, 5, 8), (2, 14, 14, 96)],
                         ids=["even", "odd-h-and-w", "odd-square", "swin-t-stage-3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_merging_layer_norm_is_timm_s_pad_gather_and_norm(shape, dtype):
    """merging_layer_norm against float64 torch over timm's own pad and gather, padded rows' zeros counted in
    the statistics; in every dtype bit for bit what layer_norm writes for the gathered rows, fp32 and
    bf16 out of a bf16 input too."""
    from workbench.kernels.layer_norm import merging_layer_norm

    torch.manual_seed(sum(shape))
    C = shape[-1]
    x = (torch.randn(shape) * 2 + 0.5).to(dtype).to(DEVICE)
    w, b = (torch.randn(4 * C).to(DEVICE) for _ in range(2))
    gathered = _timm_merging_gather(x)
    truth = F.layer_norm(gathered.double(), (4 * C,), w.double(), b.double(), EPS)
    y = merging_layer_norm(x, w, b, EPS)
    assert y.shape == gathered.shape and y.dtype == dtype
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(y.double(), truth, atol=tol, rtol=tol)
    for out in (None, torch.float32, torch.bfloat16):
        assert torch.equal(merging_layer_norm(x, w, b, EPS, out), layer_norm(gathered.contiguous(), w, b, EPS, out))
    assert torch.equal(merging_layer_norm(x, None, None, EPS), layer_norm(gathered.contiguous(), None, None, EPS))
    with pytest.raises(ValueError, match="expected"):
        merging_layer_norm(x, w[:C], b, EPS)


@pytest.mark.parametrize("shape", [(2, 8, 8, 16), (1, 7, 9, 24), (2, 14, 14, 96)],
                         ids=["even", "odd-h-and-w", "swin-t-stage-3"])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                    (torch.float16, torch.float16)], ids=["fp32+bf16", "bf16+bf16", "fp16+fp16"])
def test_merging_layer_norm_adds_a_residual_as_torch_would(shape, dtypes):
    """merging_layer_norm(x, ..., residual=r) is merging_layer_norm(x + r) bit for bit: each sum rounded to
    torch's result dtype of x + r (fp32 for a stage-1 fp32 stream plus a bf16 branch), padded rows zero."""
    from workbench.kernels.layer_norm import merging_layer_norm

    torch.manual_seed(sum(shape) + 1)
    C = shape[-1]
    x = (torch.randn(shape) * 2 + 0.5).to(dtypes[0]).to(DEVICE)
    r = torch.randn(shape).to(dtypes[1]).to(DEVICE)
    w, b = (torch.randn(4 * C).to(DEVICE) for _ in range(2))
    for out in (None, torch.bfloat16):
        fused = merging_layer_norm(x, w, b, EPS, out, residual=r)
        assert fused.dtype == (out or (x + r).dtype)
        assert torch.equal(fused, merging_layer_norm(x + r, w, b, EPS, out))
    with pytest.raises(ValueError, match="residual"):
        merging_layer_norm(x, w, b, EPS, residual=r[:, :1])
