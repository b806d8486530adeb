"""kernels.drop_path (stochastic depth's per-sample multiply) against torch, and the passes' drop_path
helper against timm's DropPath: bit for bit, forward and backward, on fresh random inputs and odd shapes.
Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from timm.layers import DropPath  # noqa: E402

from workbench.kernels import drop_path as dp  # noqa: E402
from workbench.optimize.passes._swin import drop_path  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _exact(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b), (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 7, 5), (2, 3, 33, 37), (5, 2100), (1, 1)])
def test_scale_samples_matches_torch_forward_and_backward(dtype, shape):
    g = torch.Generator().manual_seed(hash((str(dtype), shape)) % 2**31)
    x = torch.randn(shape, generator=g).to(DEVICE, dtype).requires_grad_()
    keep = torch.empty(shape[0]).bernoulli_(0.6, generator=g).to(DEVICE, dtype)
    keep = keep / torch.tensor(0.6, dtype=dtype, device=DEVICE)   # 0 or 1/keep_prob, rounded as timm's div_
    dy = torch.randn(shape, generator=g).to(DEVICE, dtype)
    x_ref = x.detach().clone().requires_grad_()
    ref = x_ref * keep.view((-1,) + (1,) * (len(shape) - 1))
    out = dp.scale_samples(x, keep)
    _exact(out, ref)
    ref.backward(dy)
    out.backward(dy)
    _exact(x.grad, x_ref.grad)


def test_scale_samples_takes_non_contiguous_input_and_checks_keep():
    x = torch.randn(4, 6, 10, device=DEVICE).transpose(1, 2)
    keep = torch.tensor([0.0, 2.0, 1.0, 0.5], device=DEVICE)
    _exact(dp.scale_samples(x, keep), x * keep.view(-1, 1, 1))
    with pytest.raises(ValueError, match="one factor per sample"):
        dp.scale_samples_host(x, keep[:3])


@pytest.mark.parametrize("prob,scale_by_keep", [(0.3, True), (0.5, False), (1.0, True)])
def test_drop_path_helper_is_timms_drop_path_bit_for_bit(prob, scale_by_keep):
    """Same seed -> the same samples dropped, the same output and input gradient as timm's module."""
    m = DropPath(prob, scale_by_keep=scale_by_keep).train()
    x0 = torch.randn(8, 13, 24, device=DEVICE, dtype=torch.bfloat16)
    dy = torch.randn_like(x0)
    outs, grads = [], []
    for run in (lambda x: m(x), lambda x: drop_path(m, x)):
        x = x0.clone().requires_grad_()
        torch.manual_seed(11)
        out = run(x)
        out.backward(dy)
        outs.append(out)
        grads.append(x.grad)
    _exact(outs[1], outs[0])
    _exact(grads[1], grads[0])


def test_drop_path_helper_leaves_inactive_and_other_modules_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(dp, "scale_samples", lambda *a: calls.append(a))
    x = torch.randn(2, 3, device=DEVICE)
    assert drop_path(DropPath(0.3).eval(), x) is x
    assert drop_path(DropPath(0.0).train(), x) is x
    assert drop_path(torch.nn.Identity(), x) is x
    torch.testing.assert_close(drop_path(torch.nn.Dropout(0.0), x), x)
    assert not calls
