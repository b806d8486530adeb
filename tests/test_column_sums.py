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
common = importlib.import_module("workbench.kernels._common")

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
    buf, atomic = common.column_sums(5, 8, torch.device(DEVICE))
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


def test_slot_rows_buffer_shapes():
    """slots > 1: a fresh (slots, n) buffer, or `into` viewed as (slots, n) where it holds slots * n
    elements and as one row where it holds n (a slice of a caller's shared buffer)."""
    dev = torch.device(DEVICE)
    buf, atomic = common.column_sums(50, 8, dev, None, 4)
    assert atomic and buf.shape == (4, 8) and not buf.any()
    assert common.column_sums(50, 8, dev, torch.zeros(32, device=DEVICE), 4)[0].shape == (4, 8)
    assert common.column_sums(50, 8, dev, torch.zeros(8, device=DEVICE), 4)[0].shape == (1, 8)


@pytest.mark.parametrize("rows, n, dtype", [(1, 70, torch.bfloat16), (3, 2 * 300, torch.float32),
                                            (4, 2 * 1000, torch.bfloat16), (200, 66, torch.float16)])
def test_sum_rows_adds_the_rows_then_casts_once(rows, n, dtype):
    """_common.sum_rows (sum_partials on blocks for a few rows): the fp32 sum over the rows, rounded once
    to the output dtype (odd widths, more rows than one step takes)."""
    src = _rand((rows, n), 11)
    got = common.sum_rows(src, dtype)
    assert got.dtype == dtype and got.shape == (n,)
    want = src.sum(0)
    if rows == 1:  # a plain cast: exactly torch's rounding
        assert torch.equal(got, want.to(dtype))
    else:
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=1e-5)


@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16])
def test_norm_grads_from_slot_rows(pdtype):
    """_norm_grads takes the (rows, 2C) sums as the backward left them: dweight and dbias are the rows'
    sums, in the parameters' dtype."""
    C = 37
    rows = _rand((4, 2 * C), 12)
    w, b = torch.ones(C, dtype=pdtype, device=DEVICE), torch.zeros(C, dtype=pdtype, device=DEVICE)
    dw, db = win._norm_grads(rows, w, b)
    assert dw.dtype == db.dtype == pdtype and dw.shape == db.shape == (C,)
    tol = {"rtol": 1e-2, "atol": 1e-2} if pdtype != torch.float32 else {"rtol": 1e-6, "atol": 1e-5}
    torch.testing.assert_close(dw.float(), rows.sum(0)[:C], **tol)
    torch.testing.assert_close(db.float(), rows.sum(0)[C:], **tol)


def test_norm_backward_over_several_slot_rows_matches_one_row(monkeypatch):
    """The norm + partition backward's column sums spread over several rows (a row per 2 programs here)
    add up to those of one row, and dx is the same bit for bit; raw_sums hands back the rows."""
    B, H, W, C, ws, shift = 2, 9, 11, 300, 4, 2
    x, w, b = _rand((B, H, W, C), 13), _rand((C,), 14), _rand((C,), 15)
    windows, mean, rstd = win.norm_shift_partition_fwd(x, w, b, 1e-5, ws, shift)
    dwin = _rand(windows.shape, 16)
    monkeypatch.setattr(win, "_NORM_BWD_MAX_SLOTS", 1)
    win._norm_bwd_config.cache_clear()
    try:
        dx1, sums1 = win.norm_shift_partition_bwd(dwin, x, w, mean, rstd, ws, shift)
        monkeypatch.setattr(win, "_NORM_BWD_MAX_SLOTS", 16)
        monkeypatch.setattr(win, "_NORM_BWD_PER_SLOT", 2)
        win._norm_bwd_config.cache_clear()
        slots = win._norm_bwd_slots(x)
        assert slots > 1
        dx2, sums2 = win.norm_shift_partition_bwd(dwin, x, w, mean, rstd, ws, shift)
        dx3, raw = win.norm_shift_partition_bwd(dwin, x, w, mean, rstd, ws, shift, raw_sums=True)
    finally:
        win._norm_bwd_config.cache_clear()
    assert torch.equal(dx1, dx2) and torch.equal(dx1, dx3)
    assert raw.shape == (slots, 2 * C)
    torch.testing.assert_close(sums2, sums1, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(raw.sum(0), sums1, rtol=1e-5, atol=1e-4)


def test_finish_column_sums_adds_up_atomic_rows():
    """finish_column_sums: one atomic row as it is, several (slots) added up by sum_rows, per-program
    partials by sum_partials; all three give the column totals in fp32."""
    rows = _rand((4, 2 * 70), 12)
    assert torch.equal(common.finish_column_sums(rows[:1], True), rows[0])
    for atomic in (True, False):
        got = common.finish_column_sums(rows, atomic)
        assert got.dtype == torch.float32 and got.shape == (2 * 70,)
        torch.testing.assert_close(got, rows.sum(0), rtol=1e-6, atol=1e-5)
