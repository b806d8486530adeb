"""kernels/quant.py against float64 references: scales, fp8 e4m3 and int8 rounding and saturation, the
calibration observers, and the two quantized GEMMs (torch._scaled_mm and torch._int_mm run on the CPU
too, so their operand layouts and scale shapes are checked here; the CUDA-only shape rules are in
tests/test_quant_gpu.py)."""
import math

import numpy as np
import pytest
import torch

from workbench.kernels.quant import (AbsMaxObserver, PercentileObserver, absmax_scale, dequantize, fake_quantize,
                                     fp8_linear, int8_linear, make_observer, quantize, scale_from_amax)

SHAPES = [(7, 13), (49, 96), (3, 1), (1, 5), (64, 33)]
QMAX = {"fp8": 448.0, "int8": 127.0}


def rand(shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * scale


def e4m3_round_ref(v: np.ndarray) -> np.ndarray:
    """float64 rounding to float8 e4m3fn: 3 mantissa bits, exponent bias 7, normals from 2^-6, subnormals
    in steps of 2^-9, round to nearest even, saturated to +-448 (as quantize saturates before the cast)."""
    v = np.clip(v.astype(np.float64), -448.0, 448.0)
    a = np.abs(v)
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    step = np.exp2(np.maximum(e, -6.0) - 3.0)
    return np.sign(v) * np.round(a / step) * step   # np.round is half to even


def scale_ref(x: np.ndarray, fmt: str, per_row: bool) -> np.ndarray:
    amax = np.abs(x).max(axis=1, keepdims=True) if per_row else np.abs(x).max()
    s = np.maximum(amax / QMAX[fmt], np.finfo(np.float32).tiny)
    return np.where(amax == 0, 1.0, s)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_scale_and_quantize_match_float64(fmt, per_row, shape):
    x = rand(shape, seed=shape[0] * 1000 + shape[1] * 10 + per_row + (fmt == "fp8") * 7, scale=3.0)
    scale = absmax_scale(x, fmt, dim=-1 if per_row else None)
    ref_scale = scale_ref(x.double().numpy(), fmt, per_row)
    assert scale.dtype == torch.float32 and tuple(scale.shape) == ((shape[0], 1) if per_row else ())
    np.testing.assert_allclose(scale.double().numpy(), ref_scale, rtol=1e-6)

    q = quantize(x, scale, fmt)
    assert q.dtype == (torch.float8_e4m3fn if fmt == "fp8" else torch.int8)
    # the quotient is fp32 in both: round that same quotient in float64
    quotient = (x.float() / scale).double().numpy()
    ref_q = e4m3_round_ref(quotient) if fmt == "fp8" else np.clip(np.round(quotient), -127, 127)
    np.testing.assert_array_equal(q.double().numpy(), ref_q)
    # the amax of each row (or of the tensor) lands on the format's largest value
    assert q.double().abs().max().item() == QMAX[fmt]

    # the round trip: at most half a step of the format (relative 2^-4 for e4m3 normals, scale/2 for int8)
    back = dequantize(q, scale).double().numpy()
    xs = x.double().numpy()
    s = ref_scale
    if fmt == "int8":
        assert np.all(np.abs(back - xs) <= s / 2 * (1 + 1e-6))
    else:
        assert np.all(np.abs(back - xs) <= np.maximum(np.abs(xs) * 2.0**-4, s * 2.0**-10) * (1 + 1e-6))
    assert torch.equal(fake_quantize(x, scale, fmt), dequantize(q, scale))


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_all_zero_rows_get_scale_one(fmt):
    x = rand((5, 16), seed=1)
    x[1] = 0
    x[4] = 0
    scale = absmax_scale(x, fmt, dim=-1)
    assert scale[1].item() == 1.0 and scale[4].item() == 1.0
    assert torch.equal(fake_quantize(x, scale, fmt)[1], torch.zeros(16))
    assert absmax_scale(torch.zeros(3, 4), fmt).item() == 1.0


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_denormal_amax_keeps_the_scale_normal(fmt):
    x = torch.full((2, 3), 1e-44)
    scale = absmax_scale(x, fmt, dim=-1)
    assert torch.all(scale >= torch.finfo(torch.float32).tiny)
    assert torch.isfinite(fake_quantize(x, scale, fmt)).all()


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_non_finite_input_is_refused(fmt, bad):
    x = rand((4, 8), seed=2)
    x[2, 3] = bad
    with pytest.raises(ValueError, match="inf or NaN"):
        absmax_scale(x, fmt, dim=-1)
    with pytest.raises(ValueError, match="inf or NaN"):
        absmax_scale(x, fmt)
    obs = AbsMaxObserver()
    obs.observe(x)
    with pytest.raises(ValueError, match="inf or NaN"):
        obs.scale(fmt)


def test_unknown_format_and_method():
    with pytest.raises(ValueError, match="unknown quantization format"):
        scale_from_amax(torch.tensor(1.0), "int4")
    with pytest.raises(ValueError, match="unknown calibration method"):
        make_observer("mse")
    with pytest.raises(ValueError, match="percentile"):
        PercentileObserver(0)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_saturation_past_the_scale(fmt):
    # a static scale smaller than the data's amax: the outliers clip to +-qmax, never NaN or wrap around
    x = torch.tensor([[-1000.0, -3.0, 0.5, 3.0, 1000.0]])
    q = quantize(x, torch.tensor(1.0), fmt).double()
    assert q[0, 0].item() == -QMAX[fmt] and q[0, -1].item() == QMAX[fmt]
    assert torch.isfinite(q).all()


def test_max_observer_over_batches():
    batches = [rand((3, 7, 5), seed=s, scale=s + 1) for s in range(4)]
    obs = make_observer("max")
    for b in batches:
        obs.observe(b)
    ref = max(np.abs(b.double().numpy()).max() for b in batches)
    assert obs.batches == 4
    assert obs.amax.item() == pytest.approx(ref, rel=1e-7)
    np.testing.assert_allclose(obs.scale("int8").item(), ref / 127, rtol=1e-6)


@pytest.mark.parametrize("percentile", [99.99, 99.9, 50.0, 100.0])
@pytest.mark.parametrize("n", [1, 7, 13 * 49, 100003])
def test_percentile_observer_matches_numpy(percentile, n):
    batches = [rand((n,), seed=10 + s, scale=2.0) for s in range(3)]
    obs = make_observer("percentile", percentile)
    for b in batches:
        obs.observe(b.reshape(1, -1) if n % 7 else b.reshape(7, -1))
    refs = [np.percentile(np.abs(b.double().numpy()), percentile, method="inverted_cdf") for b in batches]
    assert obs.batches == 3
    assert obs.amax.item() == pytest.approx(float(np.mean(refs)), rel=1e-6)
    assert obs.scale("fp8").item() == pytest.approx(float(np.mean(refs)) / 448, rel=1e-6)


def test_percentile_clips_an_outlier():
    x = rand((100000,), seed=3)
    x[17] = 1e4
    obs = PercentileObserver(99.99)
    obs.observe(x)
    assert obs.amax.item() < 10


@pytest.mark.parametrize("fmt, route", [("fp8", "simulate"), ("fp8", "scaled_mm"), ("int8", "simulate"),
                                        ("int8", "int_mm")])
def test_quant_linear_weight_is_quantized_per_output_channel(fmt, route):
    """QuantLinear's weight: one scale per output feature (row of the (N, K) weight), each row's amax over qmax
    in float64, a zero row at scale 1, an outlier row not coarsening the others; its values the float64
    rounding of the fp32 quotients; simulate keeps q * scale."""
    from workbench.kernels.quant import QuantLinear

    lin = torch.nn.Linear(37, 11)
    with torch.no_grad():
        lin.weight.copy_(rand((11, 37), seed=21, scale=0.2))
        lin.weight[3] = 0
        lin.weight[5, 7] = 40.0
    w = lin.weight.detach()
    ql = QuantLinear(lin, fmt, route)
    ref_scale = scale_ref(w.double().numpy(), fmt, per_row=True)           # (N, 1)
    assert ql.weight_scale.dtype == torch.float32 and ql.weight_scale.shape == (1, 11)
    np.testing.assert_allclose(ql.weight_scale.double().numpy(), ref_scale.T, rtol=1e-6)
    assert ql.weight_scale[0, 3].item() == 1.0
    quotient = (w.float() / ql.weight_scale.t()).double().numpy()
    ref_q = e4m3_round_ref(quotient) if fmt == "fp8" else np.clip(np.round(quotient), -127, 127)
    if route == "simulate":
        np.testing.assert_array_equal(ql.weight_dq.double().numpy(), (torch.from_numpy(ref_q).float()
                                                                       * ql.weight_scale.t()).double().numpy())
    else:
        assert ql.weight_q.dtype == (torch.float8_e4m3fn if fmt == "fp8" else torch.int8)
        np.testing.assert_array_equal(ql.weight_q.double().numpy(), ref_q)
        assert np.all(np.abs(ref_q).max(axis=1)[np.arange(11) != 3] == QMAX[fmt])   # every row's amax at qmax


# --------------------------------------------------------------------------- the quantized GEMMs

GEMM_SHAPES = [(7, 32, 16), (49, 96, 288), (3, 16, 48), (17, 64, 32)]


def quantized_operands(M, K, N, fmt, seed):
    x, w, b = rand((M, K), seed), rand((N, K), seed + 1, scale=K ** -0.5), rand((N,), seed + 2)
    xs, ws = absmax_scale(x, fmt, dim=-1), absmax_scale(w, fmt, dim=-1)
    return x, w, b, quantize(x, xs, fmt), xs, quantize(w, ws, fmt), ws


def dequantized_reference(xq, xs, wq, ws, b):
    """The float64 GEMM of the dequantized operands: what an exact accumulation gives."""
    return dequantize(xq, xs).double() @ dequantize(wq, ws).double().t() + b.double()


@pytest.mark.parametrize("M,K,N", GEMM_SHAPES)
def test_int8_linear_is_the_dequantized_gemm(M, K, N):
    x, w, b, xq, xs, wq, ws = quantized_operands(M, K, N, "int8", seed=M * K)
    out = int8_linear(xq, xs, wq, ws.t().contiguous(), b)
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    ref = dequantized_reference(xq, xs, wq, ws, b)
    torch.testing.assert_close(out.double(), ref, rtol=2 ** -8, atol=1e-5)   # bf16 output rounding
    # and close to the float Linear: int8's own error
    rel = (out.double() - (x.double() @ w.double().t() + b.double())).norm() / ref.norm()
    assert rel < 0.03


@pytest.mark.parametrize("M,K,N", GEMM_SHAPES)
def test_fp8_linear_is_the_dequantized_gemm(M, K, N):
    x, w, b, xq, xs, wq, ws = quantized_operands(M, K, N, "fp8", seed=M * K + 1)
    out = fp8_linear(xq, xs, wq, ws.t().contiguous(), b.bfloat16())
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    ref = dequantized_reference(xq, xs, wq, ws, b.bfloat16().float())
    torch.testing.assert_close(out.double(), ref, rtol=2 ** -7, atol=1e-4)
    rel = (out.double() - (x.double() @ w.double().t() + b.double())).norm() / ref.norm()
    assert rel < 0.08


def test_int8_linear_static_scale_and_few_rows():
    # a per-tensor activation scale (shape ()) and M <= 16 rows (padded to 17 inside)
    x, w = rand((3, 24), 5), rand((16, 24), 6)
    xs = absmax_scale(x, "int8")
    ws = absmax_scale(w, "int8", dim=-1)
    out = int8_linear(quantize(x, xs, "int8"), xs, quantize(w, ws, "int8"), ws.t().contiguous(), None)
    ref = dequantize(quantize(x, xs, "int8"), xs).double() @ dequantize(quantize(w, ws, "int8"), ws).double().t()
    assert out.shape == (3, 16)
    torch.testing.assert_close(out.double(), ref, rtol=2 ** -8, atol=1e-5)
    assert math.isfinite(out.float().sum().item())


def test_review_static_rows_nan_calibration_and_dtype_casts():
    """A static input that is a transposed view is read as rows; percentile calibration refuses inf/NaN as
    the max observer does; .to(dtype) moves a QuantLinear without casting its quantized buffers."""
    from workbench.kernels.quant import QuantLinear, make_observer

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(1, 64, 40).transpose(1, 2)
    for fmt in ("int8", "fp8"):
        q = QuantLinear(lin, fmt, "triton", torch.tensor(0.03))
        assert torch.equal(q(x), q(x.contiguous()))
    bad = torch.randn(10_000)
    bad[5] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        make_observer("percentile").observe(bad)
    q = QuantLinear(lin, "fp8", "triton")
    y = torch.randn(20, 64)
    before = {k: v.clone() for k, v in q.state_dict().items()}
    q.to(torch.bfloat16)
    assert all(torch.equal(v, before[k]) and v.dtype == before[k].dtype for k, v in q.state_dict().items())
    a, b = q(y.bfloat16()).float(), q(y).float()     # bf16 input: fp8's rounding of other values, no more
    assert ((a - b).norm() / b.norm()).item() < 3e-2
