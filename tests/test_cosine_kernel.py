"""kernels.cosine (SwinV2's normalized q and k, q scaled per head) against torch's F.normalize arithmetic in
float64: forward and backward (q, k and the scale), fresh random inputs, the strided views of a packed qkv,
odd window sizes, every head width SwinV2 uses, a zero row (the clamped norm)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from workbench.kernels.cosine import EPS, cosine_qk, cosine_qk_torch  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def packed(windows, heads, tokens, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(windows, tokens, 3, heads, d, generator=gen) * 3
    base[0, 1, 0, 0] = 0                 # a zero q row: the clamped norm
    base[-1, -1, 1, -1] = 0              # and a zero k row
    return base.to(DEVICE, dtype).requires_grad_(True)


@pytest.mark.parametrize("windows, heads, tokens, d", [(3, 2, 9, 16), (4, 3, 36, 32), (2, 6, 49, 32),
                                                       (2, 4, 64, 64), (1, 2, 25, 128)])
def test_forward_and_backward_match_torch_in_float64(windows, heads, tokens, d):
    qkv = packed(windows, heads, tokens, d, torch.float32, seed=windows * 100 + d)
    q, k, _ = qkv.permute(2, 0, 3, 1, 4).unbind(0)          # strided views, as the attention takes them
    log_scale = (torch.rand(heads, generator=torch.Generator().manual_seed(d)) * 4).to(DEVICE).requires_grad_(True)
    qn, kn = cosine_qk(q, k, log_scale.exp(), torch.float32)
    assert qn.is_contiguous() and qn.shape == (windows, heads, tokens, d)
    gq, gk = torch.randn_like(qn), torch.randn_like(kn)
    ((qn * gq).sum() + (kn * gk).sum()).backward()
    got = qkv.grad.clone(), log_scale.grad.clone()

    ref_qkv = qkv.detach().double().requires_grad_(True)
    ref_scale = log_scale.detach().double().requires_grad_(True)
    rq_, rk_, _ = ref_qkv.permute(2, 0, 3, 1, 4).unbind(0)
    rq, rk = cosine_qk_torch(rq_.double(), rk_.double(), ref_scale.exp(), torch.float64)
    ((rq * gq.double()).sum() + (rk * gk.double()).sum()).backward()
    assert rel(qn, rq) < 1e-6 and rel(kn, rk) < 1e-6
    assert rel(got[0], ref_qkv.grad) < 1e-5 and rel(got[1], ref_scale.grad) < 1e-5
    assert torch.all(qn[0, 0, 1] == 0) and torch.isfinite(got[0]).all()


def test_bf16_rounds_once_from_fp32():
    qkv = packed(2, 3, 49, 32, torch.bfloat16, seed=7)
    q, k, _ = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    scale = torch.full((3,), 10.0, device=DEVICE)
    qn, kn = cosine_qk(q, k, scale, torch.bfloat16)
    rq, rk = cosine_qk_torch(q.detach().float(), k.detach().float(), scale, torch.float32)
    assert qn.dtype == torch.bfloat16 and rel(qn, rq) < 4e-3 and rel(kn, rk) < 4e-3
    assert torch.equal(qn, rq.to(torch.bfloat16)) or rel(qn, rq.to(torch.bfloat16)) < 1e-3


def test_shapes_it_does_not_take_are_refused():
    with pytest.raises(ValueError, match="head width 24"):
        cosine_qk(torch.zeros(1, 1, 4, 24), torch.zeros(1, 1, 4, 24), torch.ones(1))
    with pytest.raises(ValueError, match=r"\(B_, H, N, D\)"):
        cosine_qk(torch.zeros(4, 32), torch.zeros(4, 32), torch.ones(1))
    assert EPS == 1e-12


def _attention_float64(q, k, v, scale, table, index, mask):
    """timm's SwinV2 attention core in float64: cosine scores times the logit scale, + the table's bias
    (and the window's mask), softmax, @ v."""
    import torch.nn.functional as F

    qn = F.normalize(q.double(), dim=-1, eps=EPS) * scale.double().reshape(1, -1, 1, 1)
    kn = F.normalize(k.double(), dim=-1, eps=EPS)
    s = qn @ kn.transpose(-2, -1) + table.double()[index].permute(2, 0, 1).unsqueeze(0)
    if mask is not None:
        nw = mask.shape[0]
        s = (s.view(-1, nw, *s.shape[1:]) + mask.double().unsqueeze(1).unsqueeze(0)).view_as(s)
    return s.softmax(-1) @ v.double()


@pytest.mark.parametrize("windows, heads, tokens, d, masked", [(4, 2, 9, 16, True), (4, 3, 36, 32, False),
                                                               (2, 6, 49, 32, True), (2, 4, 64, 64, True),
                                                               (2, 2, 81, 32, True), (2, 3, 144, 16, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cosine_window_attention_is_cosine_qk_then_the_kernel(windows, heads, tokens, d, masked, dtype):
    """Inference's one kernel (q and k normalized as the attention kernel loads them) gives the bits of
    cosine_qk followed by the table kernel at scale 1 (on the interpreter; within rounding on a GPU), and the float64 truth within the dtype's rounding:
    fresh inputs, the packed qkv's strided views, zero rows, windows of 9 to 144 tokens."""
    from workbench.kernels.window_attention import (cosine_window_attention, fused_window_attention_from_table,
                                                    rel_pos_inverse)

    qkv = packed(windows, heads, tokens, d, dtype, seed=tokens * 10 + d).detach()
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    gen = torch.Generator().manual_seed(tokens + heads)
    n_table = 4 * tokens
    table = (torch.randn(n_table, heads, generator=gen) * 2).to(DEVICE)
    index = torch.randint(0, n_table, (tokens, tokens), generator=gen).to(DEVICE)
    mask = (torch.where(torch.rand(2, tokens, tokens, generator=gen) > 0.7, -100.0, 0.0).to(DEVICE)
            if masked else None)
    scale = (torch.rand(heads, generator=gen) * 15 + 3).to(DEVICE)
    out = cosine_window_attention(q, k, v, table, index, scale, mask)
    qn, kn = cosine_qk(q, k, scale, dtype)
    ref = fused_window_attention_from_table(qn, kn, v, table, index, rel_pos_inverse(index, n_table), mask, scale=1.0)
    assert out.dtype == dtype and out.shape == (windows, heads, tokens, d)
    if DEVICE.type == "cpu":
        assert torch.equal(out, ref)
    else:   # compiled, the two kernels may round q and k's norms differently (rsqrt, FMA contraction)
        assert rel(out, ref) < (1e-6 if dtype == torch.float32 else 1e-2)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert rel(out, _attention_float64(q, k, v, scale, table, index, mask)) < tol


def test_cosine_window_attention_refuses_a_scale_per_other_heads():
    from workbench.kernels.window_attention import cosine_window_attention

    q = torch.zeros(1, 2, 16, 16, device=DEVICE)
    with pytest.raises(ValueError, match="nH=2"):
        cosine_window_attention(q, q, q, torch.zeros(49, 2, device=DEVICE),
                                torch.zeros(16, 16, dtype=torch.long, device=DEVICE), torch.ones(3, device=DEVICE))
