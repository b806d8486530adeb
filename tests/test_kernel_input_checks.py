"""The kernels' host functions take only what their kernels index correctly: strided weights, biases and
scales are copied (the kernels read element i at offset i), and shapes or dtypes they cannot compute are
a ValueError, never wrong numbers. Under TRITON_INTERPRET=1 on a machine without a GPU."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from workbench.kernels.layer_norm import add_layer_norm, layer_norm  # noqa: E402
from workbench.kernels.quant import int8_dequant, int8_dequant_torch, quant_matmul, quantize_rows  # noqa: E402
from workbench.kernels.window import merge_roll, norm_shift_partition  # noqa: E402
from workbench.kernels.window_attention import fused_window_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("seed", [1, 2])
def test_layer_norm_reads_a_strided_weight_and_bias_as_their_values(seed):
    g = torch.Generator().manual_seed(seed)
    C = 32
    x = torch.randn(4, C, generator=g).to(DEVICE).requires_grad_()
    r = torch.randn(4, C, generator=g).to(DEVICE)
    packed = torch.randn(C, 2, generator=g).to(DEVICE)
    w, b = packed[:, 0].requires_grad_(), packed[:, 1]          # (C,) with stride 2
    want = F.layer_norm(x.double(), (C,), w.double(), b.double())
    got = layer_norm(x, w, b)
    assert (got.double() - want).abs().max() < 1e-5
    g_out = torch.randn_like(got)
    assert all((a.double() - c).abs().max() < 1e-4 for a, c in zip(torch.autograd.grad(got, [x, w], g_out),
                                                                   torch.autograd.grad(want, [x, w], g_out.double())))
    s, y = add_layer_norm(x.detach(), r, w.detach(), b)
    assert (y.double() - F.layer_norm((x + r).double(), (C,), w.double(), b.double())).abs().max() < 1e-5


def test_fp64_is_refused_not_computed_at_fp32():
    x = torch.randn(4, 32, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        layer_norm(x, torch.ones(32, dtype=torch.float64, device=DEVICE), None)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):     # an fp64 residual alone too
        add_layer_norm(x.float(), x, torch.ones(32, device=DEVICE), None)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        norm_shift_partition(torch.randn(1, 7, 7, 8, dtype=torch.float64, device=DEVICE), torch.ones(8, device=DEVICE),
                             torch.zeros(8, device=DEVICE), 1e-5, 7, 0)
    q = torch.randn(2, 1, 49, 16, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        fused_window_attention(q, q, q, None, None)


def _int8_operands(seed: int, M: int = 5, K: int = 40, N: int = 7):
    g = torch.Generator().manual_seed(seed)
    x_q, x_s = quantize_rows(torch.randn(M, K, generator=g).to(DEVICE), "int8")
    w_q, w_s = quantize_rows(torch.randn(N, K, generator=g).to(DEVICE), "int8")
    return x_q, x_s, w_q, w_s.reshape(1, N).contiguous(), torch.randn(N, generator=g).to(DEVICE)


@pytest.mark.parametrize("seed", [1, 2])
def test_quantized_epilogues_read_strided_scales_as_their_values(seed):
    x_q, x_s, w_q, w_s, bias = _int8_operands(seed)
    want = quant_matmul(x_q, x_s, w_q, w_s, bias)
    strided = torch.cat([x_s, x_s * 0 + 1e3], 1)[:, :1]            # (M, 1), stride 2
    assert torch.equal(quant_matmul(x_q, strided, w_q, w_s, bias), want)
    acc = torch.randint(-1000, 1000, (6, 7), dtype=torch.int32, generator=torch.Generator().manual_seed(seed))
    scale = torch.rand(6, 2, generator=torch.Generator().manual_seed(seed))
    acc, scale = acc.to(DEVICE), scale.to(DEVICE)
    assert torch.equal(int8_dequant(acc, scale[:, :1], w_s, None), int8_dequant_torch(acc, scale[:, :1], w_s, None))


def test_quantized_gemm_refuses_operands_that_do_not_match():
    x_q, x_s, w_q, w_s, bias = _int8_operands(3)
    with pytest.raises(ValueError, match="w_q must be"):
        quant_matmul(x_q, x_s, w_q[:, :32].contiguous(), w_s, bias)       # K 40 against 32
    with pytest.raises(ValueError, match="w_scale and bias"):
        quant_matmul(x_q, x_s, w_q, w_s[:, :3], bias)


def test_window_ops_refuse_windows_of_another_size_and_norms_without_weights():
    with pytest.raises(ValueError, match="do not tile"):
        merge_roll(torch.randn(4, 16, 8, device=DEVICE), 8, 0, 8, 8)    # 4x4 windows named ws=8
    with pytest.raises(ValueError, match="weight and bias are required"):
        norm_shift_partition(torch.randn(1, 7, 7, 8, device=DEVICE), None, None, 1e-5, 7, 0)
