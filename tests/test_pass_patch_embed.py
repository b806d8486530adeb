"""The patch_embed pass: timm's PatchEmbed as a patch gather and one GEMM, against the convolution it
replaces, forward and backward, fresh random images, odd sizes, every output layout, fp32 and bf16."""
import pytest
import torch
from timm.layers import PatchEmbed

from pass_helpers import pass_ctx
from workbench.models import TINY_MODEL, build_model
from workbench.optimize.passes import apply_pass

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _pair(**kwargs):
    torch.manual_seed(0)
    ref = PatchEmbed(**kwargs).to(DEVICE)
    new = PatchEmbed(**kwargs).to(DEVICE)
    new.load_state_dict(ref.state_dict())
    holder = torch.nn.Sequential(new)
    _, result = apply_pass("patch_embed", holder, pass_ctx(DEVICE))
    assert result.available and result.details["patched"] == 1, result.changed
    return ref, new


@pytest.mark.parametrize("kwargs,size", [
    (dict(img_size=32, patch_size=4, in_chans=3, embed_dim=24, output_fmt="NHWC", flatten=False,
          norm_layer=torch.nn.LayerNorm), (32, 32)),
    (dict(img_size=None, patch_size=4, in_chans=3, embed_dim=20, output_fmt="NHWC", flatten=False,
          strict_img_size=False), (30, 37)),                                     # cropped as the conv crops
    (dict(img_size=None, patch_size=(3, 5), in_chans=2, embed_dim=16, dynamic_img_pad=True,
          strict_img_size=False), (13, 22)),                                     # padded, NLC out
    (dict(img_size=28, patch_size=7, in_chans=3, embed_dim=8, output_fmt="NCHW", flatten=False), (28, 28)),
])
def test_gather_gemm_matches_the_convolution_forward_and_backward(kwargs, size):
    ref, new = _pair(**kwargs)
    x = torch.randn(3, kwargs["in_chans"], *size, device=DEVICE, requires_grad=True)
    y_ref, y = ref(x), new(x)
    assert y.shape == y_ref.shape
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y_ref)
    grads_ref = torch.autograd.grad(y_ref, [x, *ref.parameters()], g)
    grads = torch.autograd.grad(y, [x, *new.parameters()], g)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_under_bf16_autocast_it_computes_in_bf16_like_the_convolution():
    ref, new = _pair(img_size=32, patch_size=4, in_chans=3, embed_dim=24, output_fmt="NHWC", flatten=False)
    x = torch.randn(2, 3, 32, 32, device=DEVICE)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        y_ref, y = ref(x), new(x)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2)


def test_the_pass_on_a_swin_counts_and_keeps_what_is_not_a_patch_convolution():
    model = build_model(TINY_MODEL).to(DEVICE)
    _, result = apply_pass("patch_embed", model, pass_ctx(DEVICE))
    assert result.available and result.details == {"patched": 1, "kept": 0, "implementation": result.details["implementation"]}
    _, again = apply_pass("patch_embed", model, pass_ctx(DEVICE))        # applying twice patches once
    assert again.details["patched"] == 1
    odd = PatchEmbed(img_size=32, patch_size=4, in_chans=3, embed_dim=8)
    odd.proj = torch.nn.Conv2d(3, 8, 4, stride=4, padding=1)
    _, result = apply_pass("patch_embed", torch.nn.Sequential(odd), pass_ctx("cpu"))
    assert not result.available and "kernel-equals-stride" in result.changed


def test_an_input_timm_refuses_is_refused_too():
    """timm asserts that a non-strict model's input divides by the patch (without dynamic padding); the
    gather + GEMM would crop it instead."""
    from timm.layers import PatchEmbed

    from workbench.optimize.passes.patch_embed import patch_gemm_forward

    embed = PatchEmbed(img_size=32, patch_size=4, in_chans=3, embed_dim=8, strict_img_size=False)
    x = torch.randn(1, 3, 34, 32)
    with pytest.raises(AssertionError, match="divisible by patch size"):
        embed(x)
    with pytest.raises(AssertionError, match="divisible by patch size"):
        patch_gemm_forward(embed, x)
