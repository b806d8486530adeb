"""Fused window attention vs the float64 formula on the shapes the tiny test model uses (d=16) and
Swin's (d=32), fp32 and bf16, with and without mask: one line of relative errors per case."""
import torch

from workbench.kernels.window_attention import fused_window_attention, fused_window_attention_qkv


def ref(q, k, v, bias, mask, scale):
    q, k, v, bias = (t.double() for t in (q, k, v, bias))
    s = q @ k.transpose(-1, -2) * scale + bias
    if mask is not None:
        nw = mask.shape[0]
        s = (s.view(-1, nw, *s.shape[1:]) + mask.double()[None, :, None]).view(s.shape)
    return torch.softmax(s, -1) @ v


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


torch.manual_seed(0)
for bnw, nh, n, d, nw in ((8, 2, 49, 16, 4), (2, 4, 49, 16, 0), (8, 4, 49, 32, 4), (64, 8, 49, 32, 16)):
    for dtype in (torch.float32, torch.bfloat16):
        for packed in (False, True):
            qkv = torch.randn(bnw, n, 3, nh, d, device="cuda", dtype=dtype, requires_grad=True)
            bias = torch.randn(nh, n, n, device="cuda", requires_grad=True)
            mask = (torch.randint(0, 2, (nw, n, n), device="cuda").float() * -100.0) if nw else None
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            scale = d ** -0.5
            out = fused_window_attention_qkv(qkv, bias, mask, scale) if packed else \
                fused_window_attention(q, k, v, bias, mask, scale)
            dout = torch.randn_like(out)
            g = torch.autograd.grad(out, (qkv, bias), dout)
            r = ref(q, k, v, bias, mask, scale)
            gr = torch.autograd.grad(r, (qkv, bias), dout.double())
            print(f"bnw={bnw:3d} nh={nh} d={d} nw={nw} {str(dtype)[6:]:8s} packed={packed!s:5s} out {rel(out, r):.1e} "
                  f"dqkv {rel(g[0], gr[0]):.1e} dbias {rel(g[1], gr[1]):.1e}")
