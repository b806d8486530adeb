"""The two ways a backward kernel reduces its column gradients (LayerNorm dweight/dbias, a Linear's bias
gradient) agree: per-program sums added atomically into one zeroed row (the default), and per-program
rows summed in a fixed order (under torch.use_deterministic_algorithms), which is bit-reproducible.

Runs the Triton kernels on the CPU under TRITON_INTERPRET=1 without a GPU, on the GPU with one.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib  # noqa: E402

import pytest  # noqa: E402

ln = importlib.import_module("workbench.kernels.layer_norm")
win = importlib.import_module("workbench.kernels.window")
lin = importlib.import_module("workbench.kernels.linear")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rand(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) + 0.3).to(device=DEVICE, dtype=dtype)


def _layer_norm(C=100, rows=203):
    x, dy = _rand((rows, C), 1), _rand((rows, C), 2)
    w, b = _rand((C,), 3), _rand((C,), 4)
    _, _, mean, rstd = ln.layer_norm_fwd(x, None, w, b, 1e-5, x.dtype)
    return lambda: ln.layer_norm_bwd(dy, x, w, b, mean, rstd, None, x.dtype)[1]


def _norm_shift_partition(B=2, H=9, W=11, C=40, ws=4, shift=2):
    x, w, b = _rand((B, H, W, C), 5), _rand((C,), 6), _rand((C,), 7)
    windows, mean, rstd = win.norm_shift_partition_fwd(x, w, b, 1e-5, ws, shift)
    dwin = _rand(windows.shape, 8)
    return lambda: win.norm_shift_partition_bwd(dwin, x, w, mean, rstd, ws, shift)[1]


def _bias_grad(rows=300, N=70):
    dy, pre = _rand((rows, N), 9, torch.bfloat16), _rand((rows, N), 10, torch.bfloat16)
    return lambda: lin.bias_grad_host(dy, pre, torch.float32)[1]


@pytest.mark.parametrize("make", [_layer_norm, _norm_shift_partition, _bias_grad],
                         ids=["layer_norm", "norm_shift_partition", "bias_grad"])
def test_atomic_and_deterministic_sums_agree(monkeypatch, make):
    run = make()
    atomic = run()
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    det1, det2 = run(), run()
    assert torch.equal(det1, det2), "deterministic column sums differ between two runs"
    torch.testing.assert_close(atomic, det1, rtol=1e-5, atol=1e-4)


def test_deterministic_mode_is_read_at_call_time(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: calls.append(1) or False)
    buf, atomic = ln.column_sums(5, 8, torch.device(DEVICE))
    assert calls and atomic and buf.shape == (1, 8) and not buf.any()


def test_sums_into_a_shared_zeroed_buffer(monkeypatch):
    """A caller with several reductions zeroes one buffer and hands each its slice; the results are the
    same as with a fresh buffer each, and land in the slices. Deterministic mode ignores the slices."""
    dy, pre = _rand((300, 70), 9, torch.bfloat16), _rand((300, 70), 10, torch.bfloat16)
    ref = lin.bias_grad_host(dy, pre, torch.float32)[1]
    shared = torch.zeros(3 * 70, device=DEVICE)
    first, second, third = shared.split(70)
    got = lin.bias_grad_host(dy, pre, torch.float32, sums_into=second)[1]
    assert got.data_ptr() == second.data_ptr()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    assert not first.any() and not third.any()
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    fresh = torch.zeros(70, device=DEVICE)
    det = lin.bias_grad_host(dy, pre, torch.float32, sums_into=fresh)[1]
    assert not fresh.any() and det.data_ptr() != fresh.data_ptr()
    torch.testing.assert_close(det, ref, rtol=1e-5, atol=1e-4)
