"""kernels/mlp.py's fused MLP against float64 (bf16 / fp16) and against the quantized MLP pair it replaces
(e4m3: quant_matmul_act writing fc2's input, then quant_matmul), on fresh random inputs of odd widths:
inputs and outputs not powers of two, hiddens not multiples of the kernel's step, row counts not
multiples of its tile.

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from workbench.kernels import mlp, quant  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 16, 64, 16), (37, 40, 160, 24), (70, 96, 384, 96), (130, 128, 96, 128), (9, 256, 80, 200)]


def _gelu_tanh64(y: torch.Tensor) -> torch.Tensor:
    """nn.GELU(approximate='tanh') in float64, as x / (1 + exp(-2u))."""
    x = y.double()
    return x / (1 + torch.exp(-2 * x * (0.7978845608028654 + 0.0356774081363001 * x * x)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,C,HID,N", SHAPES)
def test_fused_mlp_against_float64(dtype, M, C, HID, N):
    """fc1 and its bias in fp32, GELU's tanh form (on a GPU the hardware's tanh: about 2^-12 |y| off), one
    rounding of the hidden to the dtype, fc2 in fp32 and its bias, one rounding: each hidden value within a
    step of the dtype of float64's, so the output within a step of its own plus a step of fc2's sum of
    magnitudes."""
    g = torch.Generator().manual_seed(M * 7 + C + HID + N)
    x = torch.randn(M, C, generator=g).to(dtype)
    w1 = (torch.randn(HID, C, generator=g) / C ** 0.5).to(dtype)
    b1 = (torch.randn(HID, generator=g) * 0.5).to(dtype)
    w2 = (torch.randn(N, HID, generator=g) / HID ** 0.5).to(dtype)
    b2 = (torch.randn(N, generator=g) * 0.5).to(dtype)
    out = mlp.fused_mlp(*(t.to(DEVICE) for t in (x, w1, b1, w2, b2))).cpu()
    assert out.dtype == dtype and out.shape == (M, N)
    y1 = x.double() @ w1.double().t() + b1.double()
    h = _gelu_tanh64(y1)
    ref = h @ w2.double().t() + b2.double()
    size = h.abs() @ w2.double().abs().t() + b2.double().abs()
    step = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    tanh = 2.0 ** -11 * (y1.abs() @ w2.double().abs().t()) if DEVICE == "cuda" else 0.0
    assert ((out.double() - ref).abs() <= ref.abs() * step + size * step + tanh + 1e-6).all()


@pytest.mark.parametrize("row_scale", [True, False])
@pytest.mark.parametrize("M,C,HID,N", SHAPES)
def test_quantized_mlp_is_the_pair_in_one_launch(row_scale, M, C, HID, N):
    """The same fc1 epilogue (scales, bias, GELU_tanh, the hidden quantized at its static scale by the
    reciprocal) and fc2 epilogue as the pair: the output is the pair's up to the order of fc2's fp32 sums
    (and, where that order moves fc1's fp32 result across a rounding boundary of e4m3, one step of a
    hidden value): within a bf16 step of the pair's, plus 2^-6 of fc2's sum of magnitudes for those
    rare steps, and nearly all values within the bf16 step alone."""
    g = torch.Generator().manual_seed(M * 11 + C + HID + N)
    x = torch.randn(M, C, generator=g)
    x[0] *= 30
    x_q, x_scale = quant.quantize_rows_torch(x, "fp8")
    if not row_scale:
        x_scale = torch.tensor(0.02)
        x_q = quant.quantize(x, x_scale, "fp8")
    ws = []
    for n, k in ((HID, C), (N, HID)):
        w = torch.randn(n, k, generator=g) / k ** 0.5
        s = quant.absmax_scale(w, "fp8", dim=-1)
        ws += [quant.quantize(w, s, "fp8").contiguous(), s.reshape(1, -1).contiguous()]
    w1_q, w1_s, w2_q, w2_s = ws
    b1 = (torch.randn(HID, generator=g) * 0.5).to(torch.bfloat16)
    b2 = (torch.randn(N, generator=g) * 0.5).to(torch.bfloat16)
    h_scale = torch.tensor(0.011)       # the largest hiddens saturate
    dev = [t.to(DEVICE) for t in (x_q, x_scale, w1_q, w1_s, b1, h_scale, w2_q, w2_s, b2)]
    out = mlp.quantized_mlp(*dev).cpu()
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    h_q = quant.quant_matmul_act(dev[0], dev[1], dev[2], dev[3], dev[4], True, dev[5])
    pair = quant.quant_matmul(h_q, dev[5], dev[6], dev[7], dev[8]).cpu().double()
    size = (h_q.cpu().double().abs() @ w2_q.double().abs().t()) * h_scale.double() * w2_s.double() + b2.double().abs()
    narrow = size * 2.0 ** -12 if DEVICE == "cuda" else 0.0
    diff = (out.double() - pair).abs()
    assert (diff <= pair.abs() * 2.0 ** -7 + size * 2.0 ** -6 + narrow + 1e-6).all()
    assert (diff <= pair.abs() * 2.0 ** -7 + narrow + 1e-6).double().mean() > 0.97


def test_bad_operands_are_one_value_error():
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    w1, b1 = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    w2, b2 = torch.randn(32, 64, dtype=torch.bfloat16), torch.randn(32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not chain"):
        mlp.fused_mlp(x, w1, b1, w2[:, :40], b2)
    with pytest.raises(ValueError, match="outside"):
        mlp.fused_mlp(torch.randn(4, 512, dtype=torch.bfloat16), torch.randn(64, 512, dtype=torch.bfloat16), b1,
                      w2, b2)
    with pytest.raises(ValueError, match="half dtype"):
        mlp.fused_mlp(x.float(), w1, b1, w2, b2)
    with pytest.raises(ValueError, match="e4m3"):
        mlp.quantized_mlp(x, torch.ones(4, 1), w1, torch.ones(64), b1, torch.tensor(1.0), w2, torch.ones(32), b2)
    assert mlp.applies(128, 512, 128) and mlp.applies(96, 384, 96)
    assert not mlp.applies(512, 2048, 512) and not mlp.applies(8, 32, 8)


def test_the_autotuner_times_only_configs_that_fit_shared_memory():
    """shared_bytes as ptxas reported it for sm_90 (tests/aot_compile_kernels.py --resources; Triton's own
    scratch, 256 bytes where it takes any, aside): x's tile plus `stages` buffers of both weight chunks; a
    bf16 MLP 256 wide leaves the deeper configs out, e4m3 (one byte a value) keeps them all."""
    assert mlp.shared_bytes(128, 128, 128, 64, 3, 2) == 131072
    assert mlp.shared_bytes(64, 128, 128, 128, 3, 2) == 213248 - 256
    assert mlp.shared_bytes(128, 256, 256, 64, 3, 2) == 262144
    few = {"M_BUCKET": 4096}
    bf16 = mlp._fitting(mlp._CONFIGS, {"X": torch.empty(1, 256, dtype=torch.bfloat16), "C": 256, "N": 256, **few})
    fp8 = mlp._fitting(mlp._CONFIGS, {"X": torch.empty(1, 256, dtype=torch.float8_e4m3fn), "C": 256, "N": 256, **few})
    narrow = mlp._fitting(mlp._CONFIGS, {"X": torch.empty(1, 96, dtype=torch.bfloat16), "C": 96, "N": 96, **few})
    many = mlp._fitting(mlp._CONFIGS, {"X": torch.empty(1, 96, dtype=torch.bfloat16), "C": 96, "N": 96,
                                       "M_BUCKET": mlp.M_BUCKETS})
    assert 0 < len(bf16) < len(mlp._CONFIGS) and len(fp8) == len(narrow) == len(mlp._CONFIGS)
    assert any(c.kwargs["BLOCK_M"] == 32 for c in narrow) and all(c.kwargs["BLOCK_M"] >= 64 for c in many)
    assert all(mlp.shared_bytes(c.kwargs["BLOCK_M"], 256, 256, c.kwargs["BLOCK_H"], c.num_stages, 2)
               + mlp._SCRATCH <= mlp.SHARED_BYTES for c in bf16)
