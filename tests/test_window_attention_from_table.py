"""fused_window_attention_from_table (q, k, v given apart, the bias read from a relative-position table
through its index inside the kernels, the table's gradient summed in one launch) against plain PyTorch
attention with the gathered bias, in float64 terms: forward and backward to q, k, v and the table, one
key tile (N = 16) and the key-tiled path (N = 81), masked and not, fresh random inputs."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from workbench.kernels.window_attention import fused_window_attention_from_table, rel_pos_inverse  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rel_index(w: int) -> torch.Tensor:
    """timm's relative-position index of a w x w window: (N, N) into a (2w-1)^2 table."""
    coords = torch.stack(torch.meshgrid(torch.arange(w), torch.arange(w), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (w - 1)
    return rel[..., 0] * (2 * w - 1) + rel[..., 1]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("w, masked", [(4, False), (4, True), (9, True)])
def test_matches_pytorch_with_the_gathered_bias(w, masked):
    n, nh, d, nw, per_w = w * w, 2, 16, 2, 2
    gen = torch.Generator().manual_seed(w * 10 + masked)
    packed = torch.randn(nw * per_w, n, 3, nh, d, generator=gen).to(DEVICE).requires_grad_(True)
    q, k, v = packed.permute(2, 0, 3, 1, 4).unbind(0)                       # strided views
    table = (torch.randn((2 * w - 1) ** 2, nh, generator=gen) * 2).to(DEVICE).requires_grad_(True)
    index = rel_index(w).to(DEVICE)
    mask = None
    if masked:
        mask = torch.where(torch.rand(nw, n, n, generator=gen) < 0.3, -100.0, 0.0).to(DEVICE)
    scale = d ** -0.5
    out = fused_window_attention_from_table(q, k, v, table, index, rel_pos_inverse(index, table.shape[0]), mask, scale)
    g = torch.randn(out.shape, generator=gen).to(DEVICE)
    (out * g).sum().backward()
    got = out.detach(), packed.grad.clone(), table.grad.clone()

    p64, t64 = packed.detach().double().requires_grad_(True), table.detach().double().requires_grad_(True)
    q64, k64, v64 = p64.permute(2, 0, 3, 1, 4).unbind(0)
    bias = t64[index.reshape(-1)].view(n, n, nh).permute(2, 0, 1)
    scores = q64 @ k64.transpose(-1, -2) * scale + bias
    if mask is not None:
        scores = scores.view(per_w, nw, nh, n, n) + mask.double()[None, :, None]
        scores = scores.view(-1, nh, n, n)
    want = scores.softmax(-1) @ v64
    (want * g.double()).sum().backward()
    assert rel(got[0], want) < 1e-5 and rel(got[1], p64.grad) < 1e-5 and rel(got[2], t64.grad) < 1e-5


@pytest.mark.parametrize("w, n_lead", [(7, 1), (7, 5), (12, 1), (12, 3)])
def test_the_table_gradient_sums_every_slice_and_pair_of_its_rows(w, n_lead):
    # past 64 tokens (window 12) the leading slices are summed before the gather: both paths, float64 terms
    from workbench.kernels.window_attention import rel_pos_table_grad_host

    n, nh, n_table = w * w, 3, (2 * w - 1) ** 2
    index = rel_index(w).to(DEVICE)
    d_rel = torch.randn(n_lead, nh, n * n, generator=torch.Generator().manual_seed(w + n_lead)).to(DEVICE)
    got = rel_pos_table_grad_host(d_rel, rel_pos_inverse(index, n_table), torch.float32)
    want = torch.zeros(n_table, nh, dtype=torch.float64, device=DEVICE).index_add_(
        0, index.reshape(-1), d_rel.double().sum(0).reshape(nh, -1).t())
    assert got.shape == (n_table, nh) and rel(got, want) < 1e-6
