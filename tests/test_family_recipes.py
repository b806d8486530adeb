"""Every Swin family timm builds against every recipe's model passes: Swin v1 (at a size padded inside its
windows), SwinV2, swinv2_cr and swin_s3 (a window per stage), each with stochastic depth on, patched by
patch_swin with the fused stacks (fmha, dense, block), the PyTorch-alone SDPA form and INT8 fake
quantization: timm's loss and gradients in training and timm's logits in inference, in fp32 (the
quantized layers within the INT8 recipe's error, in bf16); and each family resized after the passes bound
it (timm's set_input_size: another resolution and window) still computes timm's function."""
import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from workbench.api import patch_swin  # noqa: E402
from pass_helpers import rel_err, resize_like_timm  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INT8_SIM = "tests/data/recipes/int8-sim.yaml"


def v1():
    from timm.models.swin_transformer import SwinTransformer

    return SwinTransformer(img_size=60, patch_size=4, window_size=4, embed_dim=32, depths=(2, 2), num_heads=(2, 4),
                           num_classes=10, drop_path_rate=0.1)


def v2():
    from timm.models.swin_transformer_v2 import SwinTransformerV2

    return SwinTransformerV2(img_size=32, patch_size=4, window_size=4, embed_dim=32, depths=(2, 2), num_heads=(2, 4),
                             num_classes=10, drop_path_rate=0.1)


def cr():
    from timm.models.swin_transformer_v2_cr import SwinTransformerV2Cr

    return SwinTransformerV2Cr(img_size=(32, 32), window_size=4, embed_dim=32, depths=(2, 2), num_heads=(2, 4),
                               num_classes=10, drop_path_rate=0.1)


def s3():
    import timm

    return timm.create_model("swin_s3_tiny_224", img_size=64, window_size=(4, 4, 2, 2), embed_dim=32,
                             depths=(1, 1, 2, 1), num_heads=(2, 2, 4, 4), num_classes=10, drop_path_rate=0.1)


FAMILIES = {"v1-padded": v1, "v2": v2, "v2-cr": cr, "s3": s3}


def pair(family: str):
    torch.manual_seed(0)
    plain = FAMILIES[family]().to(DEVICE)
    g = torch.Generator().manual_seed(1)
    images = torch.randn((2, 3, *plain.patch_embed.img_size), generator=g).to(DEVICE)
    return plain, copy.deepcopy(plain), images, torch.tensor([1, 2], device=DEVICE)


def loss_and_grads(model, images, labels):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)       # stochastic depth: the same samples dropped in both models
    loss = torch.nn.functional.cross_entropy(model(images).float(), labels)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recipe", ["fmha", "dense", "block", "torch-sdpa"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_trains_and_infers_as_timm(family, recipe):
    plain, model, images, labels = pair(family)
    patch = patch_swin(model, recipe, dtype="fp32")
    assert patch.applied, patch.describe()
    # fused_block stands aside on SwinV2's post-norm blocks, in one line
    assert [n.split(":")[0] for n in patch.notes] == (["pass fused_block not applied"]
                                                      if recipe == "block" and family.startswith("v2") else [])
    loss_ref, grads_ref = loss_and_grads(plain.train(), images, labels)
    loss, grads = loss_and_grads(model.train(), images, labels)
    assert loss == pytest.approx(loss_ref, rel=1e-5)
    assert grads.keys() == grads_ref.keys()
    for name, g in grads_ref.items():
        if g.norm() > 0:
            assert rel_err(grads[name], g) < 1e-4, name
    with torch.no_grad():
        assert rel_err(model.eval()(images), plain.eval()(images)) < 1e-5


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_quantizes_for_inference(family):
    plain, model, images, _ = pair(family)
    patch = patch_swin(model, INT8_SIM, training=False)
    assert [r.name for r in patch.applied] == ["quantize_linear"], patch.describe()
    with torch.no_grad():
        ref = plain.eval()(images)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            got = model.eval()(images).float()
    assert 1e-4 < rel_err(got, ref) < 0.05


# (family, the new resolution, the new window) for set_input_size after the passes
RESIZES = {"v1-padded": ((68, 68), 6), "v2": ((48, 48), 6), "v2-cr": ((48, 48), 6), "s3": ((96, 96), 6)}


def table_rows(attn) -> int:
    from workbench.optimize.passes._swin import v2_attention_classes, v2_table_rows

    return v2_table_rows(attn) if isinstance(attn, v2_attention_classes()) else attn.relative_position_bias_table.shape[0]


@pytest.mark.filterwarnings("ignore::UserWarning:timm.layers.interpolate")   # timm's table resize, not ours
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_resized_after_the_passes_runs_at_its_new_window(family):
    """The window kernels take the new window, the attention reads the new index through its inverse (made
    again for the new window), SwinV2's cached inference terms follow the new coordinates. The first forward
    after the resize is a validation pass under torch.inference_mode, which must not leave the rebuilt
    buffers as inference tensors that the training step after it cannot save."""
    plain, model, _, labels = pair(family)
    patch_swin(model, "dense", dtype="fp32")
    img, window = RESIZES[family]
    for m in (plain, model):
        resize_like_timm(m, DEVICE, img_size=img, window_size=window)
    images = torch.randn((2, 3, *img), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.inference_mode():
        model.eval()(images)
    loss_ref, grads_ref = loss_and_grads(plain.train(), images, labels)
    loss, grads = loss_and_grads(model.train(), images, labels)
    assert loss == pytest.approx(loss_ref, rel=1e-5)
    for name, g in grads_ref.items():
        if g.norm() > 0:
            assert rel_err(grads[name], g) < 1e-4, name
    with torch.no_grad():
        assert rel_err(model.eval()(images), plain.eval()(images)) < 1e-5
    inverses = [(m.relative_position_inverse.shape[0], table_rows(m)) for m in model.modules()
                if "relative_position_inverse" in m._buffers]
    assert inverses and all(have == want for have, want in inverses), inverses
