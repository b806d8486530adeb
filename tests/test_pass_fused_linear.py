"""The fused Linear backward: the bias-gradient (+ GELU backward) reduction against PyTorch on odd shapes
and every dtype, poisoned outputs; the Function against F.linear forward and backward, with and without
autocast; the fused_linear pass on the tiny Swin against the unpatched model, same seed."""
import dataclasses
import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from workbench.models import TINY_MODEL, build_model  # noqa: E402
from workbench.optimize.passes import apply_pass  # noqa: E402
from pass_helpers import assert_step_close, mlp_kernel_calls, model_pair, pass_ctx, rel_err, tiny_batch  # noqa: E402

lin = importlib.import_module("workbench.kernels.linear")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ULP = {"fp32": 1e-6, "bf16": 2 ** -7, "fp16": 2 ** -10}


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the kernels write starts as NaN: an element they forget fails the comparison."""
    monkeypatch.setattr(importlib.import_module("workbench.kernels._common"), "new_output", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("rows,cols", [(1, 7), (77, 45), (300, 600), (1029, 96)])
@pytest.mark.parametrize("gelu", [False, True])
def test_bias_grad_matches_torch(poisoned, dtype, rows, cols, gelu):
    dt = DTYPES[dtype]
    g = torch.Generator(device="cpu").manual_seed(rows * 1000 + cols)
    dy = (torch.randn(rows, cols, generator=g) * 3).to(DEVICE, dt)
    pre = (torch.randn(rows, cols, generator=g) * 2).to(DEVICE, dt) if gelu else None
    dpre, db = lin.bias_grad(dy, pre, torch.float32)
    if gelu:
        p = pre.float().requires_grad_()
        torch.nn.functional.gelu(p).backward(dy.float())
        ref = p.grad.to(dt)
        # the kernel's erf and torch's may differ by one rounding of the result
        assert (dpre.float() - ref.float()).abs().max().item() <= 4 * ULP[dtype] * ref.float().abs().max().item() + 1e-6
        assert not dpre.isnan().any()
    else:
        assert dpre.data_ptr() == dy.data_ptr()           # no GELU: dy itself, no copy
        ref = dy
    assert db.dtype == torch.float32 and db.shape == (cols,)
    torch.testing.assert_close(db, dpre.float().sum(0), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows,cols", [(77, 45), (1029, 96)])
def test_bias_grad_host_casts_dy_in_the_same_pass(poisoned, rows, cols):
    g = torch.Generator(device="cpu").manual_seed(rows + cols)
    d = (torch.randn(rows, cols, generator=g) * 3).to(DEVICE)
    dy, db = lin.bias_grad_host(d, None, torch.float32, out_dtype=torch.bfloat16)
    assert dy.dtype == torch.bfloat16 and torch.equal(dy, d.to(torch.bfloat16))
    torch.testing.assert_close(db, dy.float().sum(0), rtol=1e-5, atol=1e-4)
    same, _ = lin.bias_grad_host(d, None, torch.float32, out_dtype=torch.float32)
    assert same.data_ptr() == d.data_ptr()


def test_bias_grad_over_leading_dims_and_rejects_mismatch():
    dy = torch.randn(3, 5, 16, device=DEVICE)
    dpre, db = lin.bias_grad(dy)
    assert dpre.shape == dy.shape
    torch.testing.assert_close(db, dy.sum((0, 1)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="differ"):
        lin.bias_grad(dy, torch.randn(3, 5, 15, device=DEVICE))
    empty = torch.randn(0, 16, device=DEVICE)
    d, db = lin.bias_grad(empty, torch.randn(0, 16, device=DEVICE))
    assert d.shape == (0, 16) and torch.equal(db, torch.zeros(16, device=DEVICE))


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_f_linear_fp32(gelu, bias):
    torch.manual_seed(0)
    x = torch.randn(3, 11, 20, device=DEVICE, requires_grad=True)
    w = torch.randn(33, 20, device=DEVICE, requires_grad=True)
    b = torch.randn(33, device=DEVICE, requires_grad=True) if bias else None
    gout = torch.randn(3, 11, 33, device=DEVICE)
    leaves = [t for t in (x, w, b) if t is not None]

    def run(fn):
        for t in leaves:
            t.grad = None
        y = fn()
        y.backward(gout)
        return y.detach(), [t.grad.clone() for t in leaves]

    y, grads = run(lambda: lin.linear(x, w, b, gelu))
    ref = (lambda: torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b))) if gelu else \
        (lambda: torch.nn.functional.linear(x, w, b))
    y_ref, grads_ref = run(ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,cols", [(77, 45), (1029, 96)])
def test_bias_grad_against_float64(poisoned, rows, cols):
    """fp32 dy and pre: the GELU backward (erf) and the bias gradient's fp32 column sums against float64
    autograd, by the normwise relative error (the test above compares with torch's fp32 result)."""
    g = torch.Generator(device="cpu").manual_seed(rows + 7 * cols)
    dy = (torch.randn(rows, cols, generator=g) * 3).to(DEVICE)
    pre = (torch.randn(rows, cols, generator=g) * 2 + 0.3).to(DEVICE)
    dpre, db = lin.bias_grad(dy, pre, torch.float32)
    p64 = pre.double().requires_grad_()
    (ref,) = torch.autograd.grad(torch.nn.functional.gelu(p64), p64, dy.double())
    assert rel_err(dpre, ref) < 1e-6 and rel_err(db, ref.sum(0)) < 1e-6
    _, db_plain = lin.bias_grad(dy, None, torch.float32)
    assert rel_err(db_plain, dy.double().sum(0)) < 1e-6


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_against_float64(gelu, bias):
    """linear's forward and its fused backward (x, weight, bias) on fp32 inputs of odd sizes against F.linear
    (and the exact GELU) in float64."""
    g = torch.Generator().manual_seed(11 + 2 * gelu + bias)
    x = torch.randn(5, 13, 37, generator=g).to(DEVICE).requires_grad_()
    w = (torch.randn(51, 37, generator=g) * 37 ** -0.5).to(DEVICE).requires_grad_()
    b = torch.randn(51, generator=g).to(DEVICE).requires_grad_() if bias else None
    leaves = [t for t in (x, w, b) if t is not None]
    refs = [t.detach().double().requires_grad_() for t in leaves]
    y = lin.linear(x, w, b, gelu)
    y_ref = torch.nn.functional.linear(refs[0], refs[1], refs[2] if bias else None)
    y_ref = torch.nn.functional.gelu(y_ref) if gelu else y_ref
    assert y.dtype == torch.float32 and y.shape == (5, 13, 51)
    assert rel_err(y, y_ref) < 1e-6
    gout = torch.randn(y.shape, generator=g).to(DEVICE)
    for name, got, want in zip(("dx", "dweight", "dbias"), torch.autograd.grad(y, leaves, gout),
                               torch.autograd.grad(y_ref, refs, gout.double())):
        assert got.dtype == torch.float32 and rel_err(got, want) < 1e-5, name

def test_linear_under_autocast_casts_as_f_linear_does():
    """fp32 x and parameters under bf16 autocast: the output is bf16 like F.linear's, each gradient comes
    back in its input's dtype, and values agree with autograd's to bf16 precision."""
    torch.manual_seed(0)
    x = torch.randn(4, 9, 24, device=DEVICE, requires_grad=True)
    w = torch.randn(40, 24, device=DEVICE, requires_grad=True)
    b = torch.randn(40, device=DEVICE, requires_grad=True)
    gout = torch.randn(4, 9, 40, device=DEVICE)
    outs = {}
    for name, fn in (("fused", lambda: lin.linear(x, w, b, gelu=True)),
                     ("torch", lambda: torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b)))):
        x.grad = w.grad = b.grad = None
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            y = fn()
        y.float().backward(gout)
        outs[name] = (y, x.grad.clone(), w.grad.clone(), b.grad.clone())
    (y, gx, gw, gb), (y_ref, gx_ref, gw_ref, gb_ref) = outs["fused"], outs["torch"]
    assert y.dtype == y_ref.dtype == torch.bfloat16
    assert gx.dtype == gw.dtype == gb.dtype == torch.float32
    assert rel_err(y, y_ref) < 1e-2
    for got, want in ((gx, gx_ref), (gw, gw_ref), (gb, gb_ref)):
        assert rel_err(got, want) < 2e-2


def test_fused_linear_pass_matches_timm_in_fp32():
    plain, patched = model_pair(DEVICE, drop_path_rate=0.0)
    patched, result = apply_pass("fused_linear", patched, pass_ctx(DEVICE))
    assert result.available, result.changed
    assert result.details["linears"] == 16 and result.details["mlps_fused"] == 4  # 4 blocks x qkv/proj/fc1/fc2
    assert patched.state_dict().keys() == plain.state_dict().keys()

    assert_step_close(plain, patched, *tiny_batch(plain, 2, DEVICE))


def test_fused_linear_pass_leaves_other_mlps_on_timms_forward():
    model = build_model(TINY_MODEL, drop_path_rate=0.0)
    model.layers[0].blocks[0].mlp.act = torch.nn.GELU(approximate="tanh")
    model, result = apply_pass("fused_linear", model, pass_ctx(DEVICE))
    assert result.details["mlps_fused"] == 3 and result.details["mlps_kept"] == 1
    assert "kept on timm's forward" in result.changed


def test_gelu_epilogue_applies_only_to_gpu_inference_in_a_half_dtype():
    """addmm_gelu (the GEMM-epilogue GELU, tanh form) runs only where nothing records a gradient, on a
    GPU, in bf16/fp16, with a bias: training, fp32 and the CPU keep the exact erf GELU."""
    x = torch.randn(5, 8)
    w, b = torch.randn(16, 8), torch.randn(16)
    assert not lin.epilogue_gelu_applies(x, torch.bfloat16, b, True)               # CPU
    with torch.no_grad():
        y = lin.linear(x, w, b, gelu=True)                                          # the exact GELU on the CPU
    torch.testing.assert_close(y, torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b)))
    if not torch.cuda.is_available():
        return
    xc, bc = x.cuda(), b.cuda()
    assert lin.epilogue_gelu_applies(xc, torch.bfloat16, bc, True)
    assert lin.epilogue_gelu_applies(xc, torch.float16, bc, True)
    assert not lin.epilogue_gelu_applies(xc, torch.bfloat16, bc, False)            # a gradient recorded
    assert not lin.epilogue_gelu_applies(xc, torch.float32, bc, True)              # fp32
    assert not lin.epilogue_gelu_applies(xc, torch.bfloat16, None, True)           # no bias


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GEMM-epilogue GELU runs on a GPU")
@pytest.mark.parametrize("rows,k,n", [(1, 32, 64), (77, 48, 200), (3136, 128, 512)])
def test_gelu_epilogue_is_the_gelu_within_half_precision(rows, k, n):
    """Fresh random inputs, odd shapes: the epilogue GELU against the exact GELU of the fp64 GEMM is as
    close as bf16's rounding of the separate path (the tanh form is within 5e-4 of erf)."""
    torch.manual_seed(rows)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * k ** -0.5).bfloat16()
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.functional.gelu(torch.nn.functional.linear(x.double(), w.double(), b.double()))
    with torch.inference_mode():
        got = lin.linear(x, w, b, gelu=True)
        separate = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    err, err_separate = (got.double() - ref).abs().max().item(), (separate.double() - ref).abs().max().item()
    assert err <= 1.5 * err_separate + 1e-3, (err, err_separate)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GEMM-epilogue GELU runs on a GPU")
def test_dense_and_block_inference_with_the_epilogue_match_the_training_forward():
    """The dense and block stages' inference forward (GELU in fc1's epilogue) against the same model's
    forward with gradients recorded (exact GELU), bf16 autocast, same weights and images."""
    torch.manual_seed(0)
    model = build_model(TINY_MODEL, drop_path_rate=0.0).cuda().eval()
    x = torch.randn(2, 3, *model.patch_embed.img_size, device="cuda")
    for name in ("fused_linear", "fused_block"):
        model, result = apply_pass(name, model, dataclasses.replace(pass_ctx(DEVICE), training=False))
        assert result.available, result.changed
        with torch.autocast("cuda", dtype=torch.bfloat16):
            with torch.inference_mode():
                fast = model(x).float()
            exact = model(x).float()
        assert rel_err(fast, exact) < 2e-2, name


def test_inference_runs_each_mlp_measured_faster_as_one_kernel(monkeypatch):
    """In GPU inference (forced here: the kernel runs in the interpreter) the pass times each narrow MLP shape
    both ways and plans the one-kernel MLP where it is faster by the margin: stage 1's MLPs here (kernel
    5 us against 10), not stage 2's (9.9 against 10). The blocks planned call kernels.mlp.fused_mlp in an
    inference forward, the others do not, and the logits stay within the tanh GELU's distance of the
    two-GEMM forward's."""
    from workbench.optimize.passes import _route, block_forward, fused_linear
    from workbench.optimize.passes.block_plan import block_plans
    from workbench.optimize.recipes import apply_chain_passes, resolve_chain
    from workbench.optimize.workload import Workload, WorkloadConfig

    monkeypatch.setattr(fused_linear, "_inference_epilogue", lambda ctx, n, dtypes: True)
    monkeypatch.setattr(fused_linear, "measure_qkv_kernel", lambda *a: {})     # the MLPs' measurement alone
    times = iter([10.0, 5.0, 10.0, 9.9])
    monkeypatch.setattr(_route, "median_us", lambda call: call() is None or next(times))
    w = Workload.build(WorkloadConfig(model=TINY_MODEL, mode="infer", batch=2, precision="bf16", device="cpu", seed=0))
    w.model, results = apply_chain_passes(w.model, w.ctx, resolve_chain("dense"))
    res = results[-1]
    assert res.details["mlp_kernel_blocks"] == 2
    assert [(s["rows"], s["c"], s["hidden"], s["choice"]) for s in res.details["mlp_kernel_shapes"]] == [
        (392, 32, 128, "kernel"), (98, 64, 256, "two_gemms")]
    assert "inference: 2 MLP as one kernel" in res.changed
    plans = block_plans(w.model)
    assert plans.plan("layers.0.blocks.1").mlp_kernel and not plans.plan("layers.1.blocks.0").mlp_kernel
    assert vars(w.model.layers[0].blocks[0].mlp)["forward"].__func__ is block_forward.mlp_forward_whole
    assert vars(w.model.layers[1].blocks[0].mlp)["forward"].__func__ is block_forward.mlp_forward_fused
    calls, logits, two_gemms = mlp_kernel_calls(monkeypatch, w, "fused_mlp", ("layers.0.blocks.0", "layers.0.blocks.1"))
    assert calls == [(392, 32), (392, 32)] and rel_err(logits, two_gemms) < 1e-2


def test_inference_runs_the_qkv_inside_the_attention_where_measured_faster(monkeypatch):
    """In GPU inference (forced here: the kernels run in the interpreter) the pass times each attention shape
    with its qkv GEMM and with the qkv projection inside the attention kernel, and plans the latter where it
    is faster by the margin: stage 1's unshifted blocks and stage 2's here (5 us against 10), not stage 1's
    shifted one (9.9 against 10). The blocks planned call kernels.qkv_attention in an inference forward, the
    logits within bf16's reach of the two-kernel forward's."""
    import importlib

    from workbench.optimize.passes import _route, block_forward, fused_linear
    from workbench.optimize.passes.block_plan import block_plans
    from workbench.optimize.recipes import apply_chain_passes, resolve_chain
    from workbench.optimize.workload import Workload, WorkloadConfig

    monkeypatch.setattr(fused_linear, "_inference_epilogue", lambda ctx, n, dtypes: True)
    monkeypatch.setattr(fused_linear, "measure_mlp_kernel", lambda *a: {})
    times = iter([10.0, 5.0, 10.0, 9.9, 10.0, 5.0])     # per shape in block order: the two kernels, then one
    monkeypatch.setattr(_route, "median_us", lambda call: call() is None or next(times))
    w = Workload.build(WorkloadConfig(model=TINY_MODEL, mode="infer", batch=2, precision="bf16", device="cpu", seed=0))
    w.model, results = apply_chain_passes(w.model, w.ctx, resolve_chain("dense"))
    res = results[-1]
    assert [(s["windows"], s["c"], s["masked"], s["choice"]) for s in res.details["qkv_kernel_shapes"]] == [
        (8, 32, False, "kernel"), (8, 32, True, "two_kernels"), (2, 64, False, "kernel")]
    assert res.details["qkv_kernel_blocks"] == 3 and "3 qkv Linear inside the attention kernel" in res.changed
    plans = block_plans(w.model)
    assert [plans.plan(f"layers.{s}.blocks.{b}").qkv_kernel for s in (0, 1) for b in (0, 1)] == [True, False, True, True]
    assert "with qkv" in plans.plan("layers.0.blocks.0").describe()
    assert vars(w.model.layers[0].blocks[0].attn)["forward"].__name__ == "window_attention_forward_qkv_kernel"
    kernel = importlib.import_module("workbench.kernels.qkv_attention")
    calls, real = [], kernel.qkv_window_attention
    monkeypatch.setattr(kernel, "qkv_window_attention", lambda *a, **k: calls.append(tuple(a[0].shape)) or real(*a, **k))
    w.prepare()
    with torch.inference_mode():
        logits, _ = w.forward_loss()
    for name in ("layers.0.blocks.0", "layers.1.blocks.0", "layers.1.blocks.1"):
        plans.update(name, qkv_kernel=False)
    plans.bind(w.model)
    with torch.inference_mode():
        two, _ = w.forward_loss()
    assert calls == [(8, 49, 32), (2, 49, 64), (2, 49, 64)] and rel_err(logits.double(), two.double()) < 2e-2
    with torch.no_grad():
        assert block_forward.qkv_kernel_runs(w.model.layers[0].blocks[0].attn,
                                             torch.zeros(8, 49, 32, dtype=torch.bfloat16))
    with torch.enable_grad():       # training: the two kernels
        assert not block_forward.qkv_kernel_runs(w.model.layers[0].blocks[0].attn,
                                                 torch.zeros(8, 49, 32, dtype=torch.bfloat16))
