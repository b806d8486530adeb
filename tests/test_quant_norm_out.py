"""The norm kernels that write a QuantLinear's input already quantized: norm_shift_partition_quant (norm1
+ shift + partition, the qkv input) and merge_add_norm_quant (merge + residual add + norm2, the fc1 input)
give the bits of the unquantized kernel's output (rounded to the autocast dtype) then quantize_rows, in
e4m3 and int8, on odd shapes: padded windows, shifted and not, fp32 and bf16 residual streams, rows with a
zero (padding tokens: scale 1)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from workbench.kernels import quant  # noqa: E402
from workbench.kernels import window as win  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (B, H, W, C, window, shift): Swin's 7x7 windows, a grid that does not tile (padding), one window
SHAPES = [(2, 14, 14, 32, 7, 3), (1, 9, 11, 24, 7, 0), (2, 7, 7, 48, 7, 0), (1, 12, 12, 16, 6, 3)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_norm_shift_partition_quant_is_norm_then_quantize_rows(shape, fmt, x_dtype):
    B, H, W, C, ws, shift = shape
    gen = torch.Generator().manual_seed(sum(shape))
    x = (3 * torch.randn(B, H, W, C, generator=gen)).to(DEVICE, x_dtype)
    w, b = torch.randn(C, generator=gen).to(DEVICE), torch.randn(C, generator=gen).to(DEVICE)
    windows, _, _ = win.norm_shift_partition_fwd(x, w, b, 1e-5, ws, shift, out_dtype=torch.bfloat16)
    want_q, want_s = quant.quantize_rows(windows.reshape(-1, C), fmt)
    none, got_q, got_s = win.norm_shift_partition_quant(x, w, b, 1e-5, ws, shift, fmt, torch.bfloat16)
    assert none is None
    assert got_q.shape == windows.shape and got_q.dtype == quant.QDTYPE[fmt] and got_s.shape == (windows.shape[0] * ws * ws, 1)
    assert torch.equal(_bits(got_q).reshape(-1, C), _bits(want_q)) and torch.equal(got_s, want_s)
    if H % ws or W % ws:  # padding tokens: all zero, scale 1
        assert (got_s == 1).any()


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("keep", [False, True], ids=["no-drop-path", "drop-path"])
def test_with_the_residual_add_is_add_norm_shift_partition_then_quantize_rows(shape, fmt, keep):
    """The previous block's MLP branch added in the same kernel (times its stochastic-depth factors)."""
    B, H, W, C, ws, shift = shape
    gen = torch.Generator().manual_seed(sum(shape) + 2)
    x = torch.randn(B, H, W, C, generator=gen).to(DEVICE)
    branch = torch.randn(B, H, W, C, generator=gen).to(DEVICE, torch.bfloat16)
    factors = torch.tensor([0.0, 1.25] * B)[:B].to(DEVICE, torch.bfloat16) if keep else None
    w, b = torch.randn(C, generator=gen).to(DEVICE), torch.randn(C, generator=gen).to(DEVICE)
    s, windows, _, _ = win.add_norm_shift_partition_fwd(x, branch, w, b, 1e-5, ws, shift, out_dtype=torch.bfloat16,
                                                        keep=factors)
    want_q, want_s = quant.quantize_rows(windows.reshape(-1, C), fmt)
    got = win.norm_shift_partition_quant(x, w, b, 1e-5, ws, shift, fmt, torch.bfloat16, residual=branch, keep=factors)
    assert torch.equal(got[0], s)
    assert torch.equal(_bits(got[1]).reshape(-1, C), _bits(want_q)) and torch.equal(got[2], want_s)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("s_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_merge_add_norm_quant_is_merge_add_norm_then_quantize_rows(shape, fmt, s_dtype):
    B, H, W, C, ws, shift = shape
    gen = torch.Generator().manual_seed(sum(shape) + 1)
    hp, wp = -(-H // ws) * ws, -(-W // ws) * ws
    windows = torch.randn(B * hp * wp // (ws * ws), ws * ws, C, generator=gen).to(DEVICE, torch.bfloat16)
    shortcut = torch.randn(B, H, W, C, generator=gen).to(DEVICE, s_dtype)
    w, b = torch.randn(C, generator=gen).to(DEVICE), torch.randn(C, generator=gen).to(DEVICE)
    s, y, _, _ = win.merge_add_norm_fwd(windows, shortcut, w, b, 1e-5, ws, shift, y_dtype=torch.bfloat16)
    want_q, want_s = quant.quantize_rows(y.reshape(-1, C), fmt)
    got = win.merge_add_norm_quant(windows, shortcut, w, b, 1e-5, ws, shift, fmt, torch.bfloat16)
    assert torch.equal(got[0], s) and got[1].shape == y.shape and got[2].shape == (B * H * W, 1)
    assert torch.equal(_bits(got[1]).reshape(-1, C), _bits(want_q)) and torch.equal(got[2], want_s)


def test_quantized_rows_stand_for_their_tensor():
    """QuantizedRows answers what the modules between a norm and its Linear ask of their input."""
    x_q, scale = torch.zeros(12, 8, dtype=torch.int8), torch.ones(12, 1)
    rows = quant.QuantizedRows(x_q, scale, (3, 4, 8), torch.bfloat16)
    assert rows.shape == (3, 4, 8) and rows.numel() == 96 and rows.dtype == torch.bfloat16
    assert rows.reshape(12, 8).shape == (12, 8) and rows.reshape(-1, 8).shape == (12, 8)
    assert rows.reshape((2, 6, 8)).x_q is x_q
    with pytest.raises(ValueError, match="its rows stay rows"):
        rows.reshape(8, 12)
    lin = quant.QuantLinear(torch.nn.Linear(8, 4), "int8", "simulate")
    with pytest.raises(ValueError):       # simulate takes the float input
        lin(rows)
