"""sdpa_attention on SwinV2: the cosine attention on F.scaled_dot_product_attention computes timm's function
(logits and every parameter gradient in fp32, shifted and unshifted windows, separate q/k/v bias add),
under autocast and torch.compile too; modules it cannot take keep timm's forward with their reason, and
fused_attention takes over a module it bound."""
import copy
import os
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from workbench.optimize.passes import PassUnavailable, apply_pass, get_pass  # noqa: E402
from workbench.optimize.passes.fused_attention import v2_attention_forward  # noqa: E402
from workbench.optimize.passes.sdpa_attention import v2_sdpa_forward  # noqa: E402
from pass_helpers import assert_step_close, pass_ctx, rel_err  # noqa: E402
from test_pass_fused_attention_swinv2 import DEVICE, batch, grad_tol, tiny_v2, v2_attentions  # noqa: E402


def bound(m) -> object:
    return getattr(vars(m).get("forward"), "__func__", None)


@pytest.mark.parametrize("img, window, separate", [(32, 4, False), (48, 6, True), (72, 9, False)],
                         ids=["window4", "window6-qkv_bias_separate", "window9"])
def test_swinv2_on_sdpa_matches_timm_in_fp32(img, window, separate):
    plain = tiny_v2(img, window)
    if separate:
        for attn in v2_attentions(plain)[::2]:
            attn.qkv_bias_separate = True
    patched, result = apply_pass("sdpa_attention", copy.deepcopy(plain), pass_ctx(DEVICE))
    assert result.available and result.details == {"swinv2_modules": 4, "swinv2_left_on_timm": {}}
    assert "4 SwinV2 attention modules run their cosine attention on F.scaled_dot_product_attention" in result.changed
    assert all(bound(m) is v2_sdpa_forward for m in v2_attentions(patched))
    assert patched.state_dict().keys() == plain.state_dict().keys()
    for seed in (1, 2):
        assert_step_close(plain, patched, *batch(img, seed), grad_tol=grad_tol)


def test_near_the_logit_scale_clamp_sdpa_stays_near_fp64():
    plain = tiny_v2(log_scales=(4.0, 4.7))          # 4.7 > log 100: the clamp holds
    patched, _ = apply_pass("sdpa_attention", copy.deepcopy(plain), pass_ctx(DEVICE))
    truth = copy.deepcopy(patched).double()
    images, _ = batch(32, 1)
    with torch.no_grad():
        want = copy.deepcopy(plain).double()(images.double())
        assert rel_err(truth(images.double()), want) < 1e-12
        assert rel_err(patched(images), want) < 1e-5


def test_under_bf16_autocast_and_compile():
    plain = tiny_v2(48, 6)
    patched, _ = apply_pass("sdpa_attention", copy.deepcopy(plain), pass_ctx(DEVICE))
    images, _ = batch(48, 3)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        want, got = plain(images), patched(images)
        got.float().sum().backward()
    assert got.dtype == torch.bfloat16 and rel_err(got.float(), want.float()) < 3e-2
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in patched.parameters() if p.requires_grad)
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(patched).eval(), backend="aot_eager")
    with torch.no_grad():
        assert rel_err(compiled(images), plain.eval()(images)) < 1e-5


def test_attention_dropout_runs_as_sdpa_dropout():
    model = tiny_v2()
    for attn in v2_attentions(model):
        attn.attn_drop.p = 0.5
    model, result = apply_pass("sdpa_attention", model, pass_ctx(DEVICE))
    assert result.details["swinv2_modules"] == 4
    images, _ = batch(32, 1)
    model.train()
    torch.manual_seed(0)
    a = model(images)
    torch.manual_seed(1)
    assert not torch.equal(a, model(images))            # dropped differently
    model.eval()
    assert torch.equal(model(images), model(images))    # no dropout in eval


def test_modules_it_cannot_take_keep_timms_forward_with_their_reason():
    from timm.models.swin_transformer_v2 import WindowAttention

    class Own(WindowAttention):
        pass

    model = tiny_v2()
    attns = v2_attentions(model)
    attns[0].__class__ = Own
    attns[1].forward = types.MethodType(WindowAttention.forward, attns[1])
    model, result = apply_pass("sdpa_attention", model, pass_ctx(DEVICE))
    assert result.details["swinv2_modules"] == 2
    assert result.details["swinv2_left_on_timm"] == {"a subclass of timm's WindowAttention": 1,
                                                     "its forward was replaced elsewhere": 1}
    assert "; 1 left on timm's path (a subclass of timm's WindowAttention)" in result.changed
    assert "\n" not in result.changed


def test_fused_attention_takes_over_what_sdpa_bound():
    plain = tiny_v2()
    model, _ = apply_pass("sdpa_attention", copy.deepcopy(plain), pass_ctx(DEVICE))
    model, result = apply_pass("fused_attention", model, pass_ctx(DEVICE), {"route": "kernel"})
    assert result.details["swinv2_patched_modules"] == 4 and result.details["swinv2_left_on_timm"] == {}
    assert all(bound(m) is v2_attention_forward for m in v2_attentions(model))
    assert_step_close(plain, model, *batch(32, 1), grad_tol=grad_tol)


def test_a_shape_measured_faster_on_sdpa_runs_sdpa(monkeypatch):
    from workbench.optimize.passes import _route, fused_attention

    def measured(blocks, ctx, images, v2, kernel_forward):
        assert v2
        return {_route.block_shape(b): {"kernel_us": 120.0, "pytorch_us": 80.0, "route": "pytorch", "blocks": 1}
                for _, b in blocks}
    monkeypatch.setattr(fused_attention, "measure_routes", measured)
    plain = tiny_v2()
    model, result = apply_pass("fused_attention", copy.deepcopy(plain), pass_ctx(DEVICE))
    assert result.details["swinv2_patched_modules"] == 0 and result.details["swinv2_sdpa_measured_faster"] == 4
    assert result.details["swinv2_left_on_timm"] == {}
    assert "4 on PyTorch's SDPA: measured faster at this shape on this GPU" in result.changed
    assert all(bound(m) is v2_sdpa_forward for m in v2_attentions(model))
    assert_step_close(plain, model, *batch(32, 2), grad_tol=grad_tol)


def test_the_route_times_swinv2_against_its_sdpa_form():
    from workbench.optimize.passes import _route

    attn = v2_attentions(tiny_v2())[0]
    assert _route.pytorch_forward(attn, v2=True).__func__ is v2_sdpa_forward


def test_a_model_without_window_attention_is_unavailable():
    with pytest.raises(PassUnavailable, match="Swin v1 or SwinV2"):
        get_pass("sdpa_attention").apply(torch.nn.Sequential(torch.nn.Linear(4, 4)), pass_ctx(DEVICE))
