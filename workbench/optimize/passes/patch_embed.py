"""Pass `patch_embed`: the patch embedding's convolution as one gather and one GEMM.

timm's PatchEmbed runs a Conv2d whose kernel equals its stride (4x4, stride 4 for Swin), then permutes
its NCHW output to the NHWC layout the blocks take. For such a convolution every output pixel is the dot
product of one non-overlapping patch with each filter, so the layer is a GEMM: (B * H/p * W/p, C * p * p)
patches against the (embed_dim, C * p * p) weight. cuDNN runs that shape as a general convolution (on
Swin-B at batch 64 on an H200, about 110 us for what moves under 100 MB), and the permute and the bias add
are more passes over the (B, H/p, W/p, embed_dim) output. Here the forward is:

  * one copy kernel that gathers the image into patch rows, cast to the compute dtype on the way
    (autocast's dtype, else the weight's and the image's promoted dtype);
  * one addmm with the bias in its epilogue, written straight in NHWC (no permute);
  * the module's norm, as before (a Triton LayerNorm when fused_layernorm ran first).

Exact up to the order of the sums: the same products, accumulated in fp32 by the GEMM as by the
convolution. Autograd differentiates it as written (the weight's gradient is one GEMM). Images whose
size is not a multiple of the patch are cropped as the strided convolution crops them (or padded first
where the module pads: dynamic_img_pad). A PatchEmbed whose projection is not such a convolution (kernel
other than stride, padding, dilation, groups) keeps timm's forward and is counted. swin_transformer_v2_cr's
own PatchEmbed (the convolution, its norm over channels last, NCHW out) gets the same gather and GEMM, its
norm on the NHWC result and the NCHW output a view of it (cr_patch_gemm_forward).
"""
from __future__ import annotations

import types

import torch

from workbench.optimize.passes import PassContext, PassResult, PassUnavailable

NAME = "patch_embed"
FORWARD_ATTR = "_swinbench_patch_gemm"


def _is_patch_conv(conv) -> bool:
    return (isinstance(conv, torch.nn.Conv2d) and tuple(conv.kernel_size) == tuple(conv.stride)
            and tuple(conv.padding) == (0, 0) and tuple(conv.dilation) == (1, 1) and conv.groups == 1
            and conv.padding_mode == "zeros")


def _patch_gemm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The kernel-equals-stride convolution `module.proj` of the image x (B, C, H, W), cropped to whole
    patches, as one gather and one GEMM -> (B, H/p, W/p, embed_dim), NHWC."""
    B, C, H, W = x.shape
    ph, pw = module.patch_size
    hp, wp = H // ph, W // pw
    weight = module.proj.weight
    dev = x.device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else torch.promote_types(x.dtype, weight.dtype)
    with torch.autocast(dev, enabled=False):
        patches = torch.empty((B, hp, wp, C, ph, pw), dtype=dt, device=x.device)
        patches.copy_(x[:, :, :hp * ph, :wp * pw].reshape(B, C, hp, ph, wp, pw).permute(0, 2, 4, 1, 3, 5))
        rows = patches.view(B * hp * wp, C * ph * pw)
        w2 = weight.reshape(weight.shape[0], -1).to(dt)
        bias = module.proj.bias
        out = torch.addmm(bias.to(dt), rows, w2.t()) if bias is not None else rows @ w2.t()
    return out.view(B, hp, wp, -1)


def patch_gemm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """timm PatchEmbed.forward with the convolution as gather + GEMM (same size checks and layouts)."""
    import torch.nn.functional as F
    from timm.layers import Format

    B, C, H, W = x.shape
    ph, pw = self.patch_size
    if self.img_size is not None and self.strict_img_size and (H, W) != tuple(self.img_size):
        raise AssertionError(f"Input size ({H}x{W}) doesn't match model ({self.img_size[0]}x{self.img_size[1]}).")
    if self.img_size is not None and not self.strict_img_size and not self.dynamic_img_pad and (H % ph or W % pw):
        raise AssertionError(f"Input size ({H}x{W}) should be divisible by patch size ({ph}x{pw}).")
    if self.dynamic_img_pad:
        x = F.pad(x, (0, (pw - W % pw) % pw, 0, (ph - H % ph) % ph))
    out = _patch_gemm(self, x)                                        # NHWC
    hp, wp = out.shape[1:3]
    if self.flatten:
        out = out.view(B, hp * wp, -1)                                # NLC
    elif self.output_fmt == Format.NCHW:
        out = out.permute(0, 3, 1, 2)
    elif self.output_fmt != Format.NHWC:
        from timm.layers.format import nhwc_to

        out = nhwc_to(out, self.output_fmt)
    return self.norm(out)


def cr_patch_gemm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """swin_transformer_v2_cr's PatchEmbed.forward (the convolution, its norm over channels last, NCHW
    out) with the convolution as gather + GEMM: the norm runs on the GEMM's NHWC output and the NCHW
    result is a view of it, which the first stage's permute to NHWC makes contiguous again for free."""
    _, _, H, W = x.shape
    if self.strict_img_size and (H, W) != tuple(self.img_size):
        raise AssertionError(f"Input size ({H}x{W}) doesn't match model ({self.img_size[0]}x{self.img_size[1]}).")
    return self.norm(_patch_gemm(self, x)).permute(0, 3, 1, 2)


def _embeddings(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, object]]:
    """(name, module, the forward to bind) of every patch embedding the pass knows: timm's PatchEmbed and
    swin_transformer_v2_cr's own."""
    from timm.layers import PatchEmbed
    from timm.models.swin_transformer_v2_cr import PatchEmbed as CrPatchEmbed

    out = []
    for name, m in model.named_modules():
        if isinstance(m, PatchEmbed):
            out.append((name, m, patch_gemm_forward))
        elif type(m) is CrPatchEmbed:
            out.append((name, m, cr_patch_gemm_forward))
    return out


def apply(model: torch.nn.Module, ctx: PassContext) -> tuple[torch.nn.Module, PassResult]:
    try:
        embeds = _embeddings(model)
    except ImportError as exc:
        raise PassUnavailable(f"timm's PatchEmbed not importable: {exc}") from exc
    if not embeds:
        raise PassUnavailable("no timm PatchEmbed in this model")
    patched, kept = [], []
    for name, m, forward in embeds:
        if getattr(m, FORWARD_ATTR, False):
            patched.append(name)
        elif _is_patch_conv(m.proj):
            m.forward = types.MethodType(forward, m)
            setattr(m, FORWARD_ATTR, True)
            patched.append(name)
        else:
            kept.append(name)
    if not patched:
        raise PassUnavailable("the patch embedding's projection is not a kernel-equals-stride convolution")
    p = embeds[0][1].patch_size
    changed = f"patch embedding {p[0]}x{p[1]}/{p[0]} convolution -> patch gather + one GEMM (NHWC out)"
    if kept:
        changed += f"; {len(kept)} kept on timm's convolution (not kernel = stride)"
    return model, PassResult(NAME, {}, changed, {"patched": len(patched), "kept": len(kept),
                                                 "implementation": "torch: one gather copy + torch.addmm"})
