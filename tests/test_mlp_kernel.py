"""kernels/mlp.py: the GEMMs with the GELU in their epilogues against float64 and against the torch ops they
replace, and the MLP Function's forward and backward against autograd, on odd shapes (rows past a tile,
K past BLOCK_K, columns not a multiple of the tile), bf16 and fp16, fresh random inputs.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from workbench.kernels import mlp  # noqa: E402
from workbench.kernels.linear import linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF = (torch.bfloat16, torch.float16)
SHAPES = [(70, 40, 96), (130, 96, 64), (1, 32, 48), (200, 72, 160)]   # (M, K, N)


def ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of t's dtype at t's magnitude, in fp32."""
    mant = {torch.bfloat16: 8, torch.float16: 11}[t.dtype]
    e = torch.floor(torch.log2(t.float().abs().clamp_min(2.0 ** -14)))
    return torch.pow(2.0, e - (mant - 1))


def gelu_grad_ref(dh: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    x = pre.float()
    return (dh.float() * (0.5 * (1 + torch.erf(x * 0.7071067811865476))
                          + x * torch.exp(-0.5 * x * x) * 0.3989422804014327)).to(pre.dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape", SHAPES)
def test_gemm_gelu_writes_pre_rounded_once_and_its_exact_gelu(dtype, shape):
    M, K, N = shape
    g = torch.Generator().manual_seed(M * 131 + K * 7 + N + (dtype == torch.float16))
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype).to(DEVICE)
    b = torch.randn(N, generator=g).to(dtype).to(DEVICE)
    h, pre = mlp.gemm_gelu(x, w, b)
    assert h.shape == pre.shape == (M, N) and h.dtype == pre.dtype == dtype
    exact = x.double() @ w.double().t() + b.double()
    # pre: the fp32 sum rounded once, so within one unit of its dtype of the exact value (fp32 order)
    assert ((pre.double() - exact).abs() <= ulp(pre).double() * 0.5 + 1e-5 * exact.abs() + 1e-6).all()
    # GELU of the rounded pre in fp32, rounded once: the exact GELU of that tensor within one unit, plus
    # fp32's cancellation in 1 + erf(x / sqrt 2) far in the negative tail (torch's own GELU has it too)
    ref = F.gelu(pre.double())
    tol = ulp(ref.to(dtype)).double() + pre.double().abs() * 2.0 ** -22
    assert ((h.double() - ref).abs() <= tol).all()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape", SHAPES)
def test_gemm_dgelu_matches_the_gelu_backward_and_its_bias_gradient(dtype, shape):
    M, K, N = shape   # dy (M, K) @ w2 (K, N): K is fc2's out_features
    g = torch.Generator().manual_seed(M * 17 + K * 3 + N + 5 * (dtype == torch.float16))
    dy = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    w2 = (torch.randn(K, N, generator=g) / N ** 0.5).to(dtype).to(DEVICE)
    pre = (torch.randn(M, N, generator=g) * 2).to(dtype).to(DEVICE)
    dpre, db = mlp.gemm_dgelu(dy, w2, pre, torch.float32)
    assert dpre.shape == (M, N) and dpre.dtype == dtype and db.shape == (N,) and db.dtype == torch.float32
    dh = (dy.double() @ w2.double()).to(dtype)          # the gradient autograd would hand the GELU backward
    ref = gelu_grad_ref(dh, pre)
    # the accumulator may round to the neighbour of dh (another summation order): one unit of dh, scaled
    tol = (ulp(dh) * gelu_grad_ref(torch.ones_like(dh), pre).float().abs() + ulp(ref) * 2).double()
    assert ((dpre.double() - ref.double()).abs() <= tol).all()
    # db: dpre's rounded values summed in fp32
    assert torch.allclose(db.double(), dpre.double().sum(0), rtol=1e-5, atol=1e-4)
    db16 = mlp.gemm_dgelu(dy, w2, pre, dtype)[1]
    assert db16.dtype == dtype and torch.equal(db16, db.to(dtype))   # summed in fp32, cast once


def test_gemm_dgelu_bias_gradient_is_the_same_bits_each_run():
    g = torch.Generator().manual_seed(3)
    dy = torch.randn(300, 48, generator=g).to(torch.bfloat16).to(DEVICE)
    w2 = (torch.randn(48, 80, generator=g) / 9).to(torch.bfloat16).to(DEVICE)
    pre = torch.randn(300, 80, generator=g).to(torch.bfloat16).to(DEVICE)
    a, b = mlp.gemm_dgelu(dy, w2, pre, torch.float32), mlp.gemm_dgelu(dy, w2, pre, torch.float32)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _mlp_inputs(seed, rows, c_in, hidden, c_out, dtype=torch.float32, lead=(2,)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, rows, c_in, generator=g).to(dtype)
    params = [torch.randn(hidden, c_in, generator=g) / c_in ** 0.5, torch.randn(hidden, generator=g) * 0.1,
              torch.randn(c_out, hidden, generator=g) / hidden ** 0.5, torch.randn(c_out, generator=g) * 0.1]
    return [t.to(DEVICE).requires_grad_() for t in (x, *params)]


def _rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("amp", HALF)
@pytest.mark.parametrize("dims", [(37, 40, 160, 40), (65, 96, 384, 96), (9, 32, 72, 24)])
def test_gelu_mlp_under_autocast_matches_float64_and_the_unfused_mlp(amp, dims):
    rows, c_in, hidden, c_out = dims
    inputs = _mlp_inputs(rows + hidden, rows, c_in, hidden, c_out)
    gout = torch.randn(2, rows, c_out, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
    with torch.autocast(DEVICE, dtype=amp):
        y = mlp.gelu_mlp(*inputs)
        y_unfused = linear(linear(inputs[0], inputs[1], inputs[2], gelu=True), inputs[3], inputs[4])
    assert y.dtype == y_unfused.dtype == amp and y.shape == (2, rows, c_out)
    grads = torch.autograd.grad(y, inputs, gout.to(amp))
    grads_unfused = torch.autograd.grad(y_unfused, inputs, gout.to(amp))
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    y_ref = F.linear(F.gelu(F.linear(ref_in[0], ref_in[1], ref_in[2])), ref_in[3], ref_in[4])
    refs = torch.autograd.grad(y_ref, ref_in, gout.double())
    tol = 1e-2 if amp == torch.bfloat16 else 2e-3
    assert _rel(y, y_ref) < tol
    for got, unfused, ref, t in zip(grads, grads_unfused, refs, inputs):
        assert got.dtype == t.dtype and got.shape == t.shape
        assert _rel(got, ref) < tol
        # as close to float64 as the MLP it replaces (rounding of the compute dtype, not more)
        assert _rel(got, ref) < 1.5 * _rel(unfused, ref) + 1e-3


def test_gelu_mlp_without_fc2_bias_and_with_frozen_weights():
    x, w1, b1, w2, _ = _mlp_inputs(4, 20, 32, 64, 32)
    w1.requires_grad_(False)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = mlp.gelu_mlp(x, w1, b1, w2, None)
    dx, db1, dw2 = torch.autograd.grad(y.float().square().sum(), (x, b1, w2))
    assert dx.shape == x.shape and db1.shape == b1.shape and dw2.shape == w2.shape


def test_gelu_mlp_in_bf16_without_autocast_returns_bf16_gradients():
    x, w1, b1, w2, b2 = [t.detach().to(torch.bfloat16).requires_grad_() for t in _mlp_inputs(9, 33, 48, 96, 48)]
    y = mlp.gelu_mlp(x, w1, b1, w2, b2)
    assert y.dtype == torch.bfloat16
    grads = torch.autograd.grad(y.float().sum(), (x, w1, b1, w2, b2))
    assert all(g.dtype == torch.bfloat16 for g in grads)


def test_applies_only_where_the_kernels_run_in_a_half_dtype():
    x = torch.zeros(2, 8, device=DEVICE)
    b = torch.zeros(8, device=DEVICE)
    assert mlp.applies(x, torch.bfloat16, b) and mlp.applies(x, torch.float16, b)
    assert not mlp.applies(x, torch.float32, b)
    assert not mlp.applies(x, torch.bfloat16, None)


@pytest.mark.parametrize("call, message", [
    (lambda: mlp.gemm_gelu(torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(16, 6, dtype=torch.bfloat16),
                           torch.zeros(16, dtype=torch.bfloat16)), "do not multiply"),
    (lambda: mlp.gemm_gelu(torch.zeros(4, 8), torch.zeros(16, 8), torch.zeros(16)), "half dtype"),
    (lambda: mlp.gemm_gelu(torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(16, 8, dtype=torch.bfloat16),
                           torch.zeros(15, dtype=torch.bfloat16)), "bias must be"),
    (lambda: mlp.gemm_dgelu(torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(8, 16, dtype=torch.bfloat16),
                            torch.zeros(4, 15, dtype=torch.bfloat16), torch.float32), "pre must be"),
    (lambda: mlp.gelu_mlp(torch.zeros(4, 8), torch.zeros(16, 8), torch.zeros(16), torch.zeros(8, 12), None),
     "do not chain"),
])
def test_bad_operands_are_refused_in_one_line(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_gelu_mlp_compiles_into_one_graph_and_matches_eager():
    inputs = _mlp_inputs(11, 20, 32, 64, 32)

    def f(*a):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            return mlp.gelu_mlp(*a)

    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    y = torch.compile(f, backend=backend, fullgraph=True)(*inputs)
    grads = torch.autograd.grad(y.float().sum(), inputs)
    y0 = f(*inputs)
    grads0 = torch.autograd.grad(y0.float().sum(), inputs)
    assert torch.equal(y, y0)
    for a, b in zip(grads, grads0):
        assert torch.allclose(a, b, rtol=1e-2, atol=1e-2)
