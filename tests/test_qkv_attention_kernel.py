"""kernels/qkv_attention.py's qkv projection + window attention in one launch, against float64 on fresh
random inputs (odd window counts, windows of 49, 36 and 64 tokens, masks of 3 and 4 window positions,
widths that are not multiples of the projection's K step, with and without the qkv bias, the bias as a
dense tensor and through the relative-position table), and against the qkv Linear followed by the
attention kernel it replaces.

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from workbench.kernels import window_attention as wa  # noqa: E402
from workbench.kernels.qkv_attention import applies, qkv_window_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}    # relative Frobenius error
# (windows, tokens, channels, heads, window positions of the mask or None, qkv bias, table bias)
SHAPES = [(12, 49, 64, 2, 4, True, False), (5, 16, 32, 1, None, False, False), (6, 64, 96, 3, 3, True, True),
          (4, 36, 160, 5, 2, True, False)]


def _inputs(windows, n, c, heads, nw, qkv_bias, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(windows, n, c, generator=g)
    weight = torch.randn(3 * c, c, generator=g) / c ** 0.5
    bias = torch.randn(3 * c, generator=g) * 0.1 if qkv_bias else None
    rel_bias = torch.randn(heads, n, n, generator=g)
    mask = None if nw is None else torch.where(torch.rand(nw, n, n, generator=g) < 0.3, -100.0, 0.0)
    cast = (lambda t: None if t is None else t.to(dtype).to(DEVICE))
    return cast(x), cast(weight), cast(bias), rel_bias.to(DEVICE), None if mask is None else mask.to(DEVICE)


def _reference(x, weight, bias, rel_bias, mask, scale, heads):
    """timm's qkv Linear (its output rounded to x's dtype, as the GEMM writes it) and attention, in float64."""
    windows, n, c = x.shape
    qkv = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    qkv = qkv.to(x.dtype).double().view(windows, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
    scores = qkv[0] @ qkv[1].transpose(-2, -1) * scale + rel_bias.double()
    if mask is not None:
        nw = mask.shape[0]
        scores = (scores.view(-1, nw, *scores.shape[1:]) + mask.double()[None, :, None]).view(scores.shape)
    return (scores.softmax(-1) @ qkv[2]).transpose(1, 2).reshape(windows, n, c)


def _rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("windows,n,c,heads,nw,qkv_bias,table", SHAPES)
def test_against_float64_and_the_two_kernels(monkeypatch, dtype, windows, n, c, heads, nw, qkv_bias, table):
    monkeypatch.setattr(wa, "POISON_BUFFERS", True)     # an unwritten output element is NaN
    x, weight, bias, rel_bias, mask = _inputs(windows, n, c, heads, nw, qkv_bias, dtype, windows * n + c)
    scale = (c // heads) ** -0.5
    index = None
    if table:       # rel_bias[h, i, j] = table[index[i, j], h]
        index = torch.randperm(n * n, generator=torch.Generator().manual_seed(1)).view(n, n).to(DEVICE)
        table_rows = torch.empty(n * n, heads, device=DEVICE)
        table_rows[index.view(-1)] = rel_bias.reshape(heads, -1).t()
        out = qkv_window_attention(x, weight, bias, table_rows, mask, scale, heads, index=index)
    else:
        out = qkv_window_attention(x, weight, bias, rel_bias, mask, scale, heads)
    assert out.shape == (windows, n, c) and out.dtype == dtype and torch.isfinite(out).all()
    assert _rel_err(out, _reference(x, weight, bias, rel_bias, mask, scale, heads)) < TOLERANCE[dtype]
    qkv = torch.nn.functional.linear(x, weight, bias).view(windows, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
    two, _ = wa.window_attention_fwd(qkv[0], qkv[1], qkv[2], rel_bias, mask, scale)
    assert _rel_err(out, two.transpose(1, 2).reshape(windows, n, c)) < TOLERANCE[dtype]


def test_which_blocks_it_takes_and_one_line_errors():
    assert applies(49, 96, 3) and applies(64, 512, 16) and not applies(144, 128, 4) and not applies(49, 96, 4)
    x, weight, bias, rel_bias, _ = _inputs(2, 49, 64, 2, None, True, torch.float32, 0)
    with pytest.raises(ValueError, match="weight must be"):
        qkv_window_attention(x, weight[:64], bias, rel_bias, None, 0.1, 2)
    with pytest.raises(ValueError, match="tokens"):
        qkv_window_attention(x, weight, bias, rel_bias, None, 0.1, 3)
    with pytest.raises(ValueError, match="mask"):
        qkv_window_attention(x, weight, bias, rel_bias, torch.zeros(3, 49, 49, device=DEVICE), 0.1, 2)
    with pytest.raises(ValueError, match="dtype"):
        qkv_window_attention(x, weight.double(), bias, rel_bias, None, 0.1, 2)
