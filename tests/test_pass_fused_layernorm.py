"""The fused_layernorm pass on the tiny timm Swin: same logits and every parameter gradient as the
unpatched model (same seed, deep copies), with the Triton LayerNorm and the fused add+norm2.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import copy  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

import pytest  # noqa: E402
from torch import nn  # noqa: E402

from workbench.errors import UserError  # noqa: E402
from workbench.models import TINY_MODEL, build_model  # noqa: E402
from workbench.optimize.passes import apply_pass  # noqa: E402
from workbench.optimize.passes import fused_layernorm  # noqa: E402
from workbench.optimize.passes.block_plan import block_plans  # noqa: E402
from pass_helpers import assert_same_step, model_pair, pass_ctx, tiny_batch  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# 2 images: an odd-free but small batch; the tiny Swin has 11 LayerNorms (patch embed, 2 per block x 4,
# patch merging, final) and 4 blocks.
BATCH = 2
N_LAYER_NORMS = 11
N_BLOCKS = 4


def _inputs(model, seed=1):
    x, target = tiny_batch(model, BATCH, DEVICE, seed)
    return x, target


def _assert_same_training_step(ref, fused, atol, rtol, autocast=None, train=False, rng_seed=None):
    ref.train(train)
    fused.train(train)
    x, target = _inputs(ref)
    assert_same_step(ref, fused, x, target, atol, rtol, autocast, rng_seed)


def test_triton_fused_residual_matches_unpatched_fp32():
    ref, model = model_pair(DEVICE)
    state_keys = list(model.state_dict())
    model, result = fused_layernorm.apply(model, pass_ctx(DEVICE), impl="triton", fuse_residual=True)
    assert result.name == "fused_layernorm" and result.available
    d = result.details
    assert d["implementation"] == "triton"
    assert d["replaced"] == N_LAYER_NORMS and d["fused_residual_blocks"] == N_BLOCKS
    assert list(model.state_dict()) == state_keys
    from workbench.kernels.layer_norm import TritonLayerNorm

    assert sum(isinstance(m, TritonLayerNorm) for m in model.modules()) == N_LAYER_NORMS
    plans = block_plans(model)
    for name, blk in model.named_modules():
        if type(blk).__name__ == "SwinTransformerBlock":
            assert plans.plan(name).add_norm2 is True and "forward" in vars(blk)
    _assert_same_training_step(ref, model, atol=1e-5, rtol=1e-5)


def test_triton_without_residual_fusion_matches_unpatched():
    ref, model = model_pair(DEVICE, seed=2)
    model, result = fused_layernorm.apply(model, pass_ctx(DEVICE), impl="triton", fuse_residual=False)
    assert result.details["replaced"] == N_LAYER_NORMS and result.details["fused_residual_blocks"] == 0
    assert not any("forward" in vars(m) for m in model.modules())
    _assert_same_training_step(ref, model, atol=1e-5, rtol=1e-5)


def test_drop_path_in_training_matches_unpatched():
    """The patched block applies drop_path1/drop_path2 as timm does: same RNG draws, same result."""
    torch.manual_seed(3)
    ref = build_model(TINY_MODEL).to(DEVICE)
    from timm.layers import DropPath

    for blk in ref.modules():
        if type(blk).__name__ == "SwinTransformerBlock":
            blk.drop_path1, blk.drop_path2 = DropPath(0.3), DropPath(0.3)
    model = copy.deepcopy(ref)
    model, result = fused_layernorm.apply(model, pass_ctx(DEVICE), impl="triton")
    assert result.details["fused_residual_blocks"] == N_BLOCKS
    _assert_same_training_step(ref, model, atol=1e-5, rtol=1e-5, train=True, rng_seed=7)


def test_bf16_autocast_close_to_unpatched():
    """Under autocast the patched model agrees with the unpatched one at bf16 tolerance."""
    ref, model = model_pair(DEVICE, seed=4)
    model, _ = fused_layernorm.apply(model, pass_ctx(DEVICE, "bf16"), impl="triton")
    ref.eval()
    model.eval()
    x, _ = _inputs(ref)
    with torch.no_grad(), torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        logits_ref, logits = ref(x).float(), model(x).float()
    torch.testing.assert_close(logits, logits_ref, atol=5e-2, rtol=5e-2)


def test_apply_pass_twice_changes_nothing_more():
    _, model = model_pair(DEVICE, seed=5)
    model, _ = apply_pass("fused_layernorm", model, pass_ctx(DEVICE), {"impl": "triton"})
    model, result = apply_pass("fused_layernorm", model, pass_ctx(DEVICE), {"impl": "triton"})
    assert result.details["replaced"] == 0 and result.details["fused_residual_blocks"] == 0


def test_earlier_forward_patch_is_left_alone():
    """A block whose forward was replaced outside its plan keeps it (and its plan no add_norm2)."""
    _, model = model_pair(DEVICE, seed=6)
    blocks = [m for m in model.modules() if type(m).__name__ == "SwinTransformerBlock"]
    marker = types.MethodType(lambda self, x: x, blocks[0])
    blocks[0].forward = marker
    model, result = fused_layernorm.apply(model, pass_ctx(DEVICE), impl="triton")
    assert result.details["blocks_forward_already_patched"] == 1
    assert result.details["fused_residual_blocks"] == N_BLOCKS - 1
    plan = block_plans(model).plan("layers.0.blocks.0")
    assert blocks[0].forward is marker and not plan.add_norm2 and dict(plan.fallbacks).get("add_norm2")


def test_impl_torch_keeps_model():
    _, model = model_pair(DEVICE, seed=7)
    before = [type(m) for m in model.modules()]
    out, result = fused_layernorm.apply(model, pass_ctx(DEVICE), impl="torch")
    assert out is model and [type(m) for m in out.modules()] == before
    assert result.details["implementation"] == "torch" and result.details["replaced"] == 0


def test_auto_on_cpu_without_interpreter_is_not_available(monkeypatch):
    """torch's LayerNorm kept under this pass's name would be reported as a fused stage (patch_swin listed
    it as applied): not available, like every pass whose kernels cannot run here."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(fused_layernorm, "_apex_layer_norm_class", lambda: None)
    with pytest.raises(fused_layernorm.PassUnavailable, match="need a CUDA GPU"):
        fused_layernorm.resolve_impl("auto", torch.device("cpu"))
    assert fused_layernorm.resolve_impl("torch", torch.device("cpu")) == "torch"
    with pytest.raises(fused_layernorm.PassUnavailable):
        fused_layernorm.resolve_impl("triton", torch.device("cpu"))
    assert fused_layernorm.resolve_impl("auto", torch.device("cuda")) == fused_layernorm.AUTO_GPU_IMPL


def test_apex_missing_is_unavailable_and_bad_params_are_user_errors(monkeypatch):
    monkeypatch.setattr(fused_layernorm, "_apex_layer_norm_class", lambda: None)
    _, model = model_pair(DEVICE, seed=8)
    out, result = apply_pass("fused_layernorm", model, pass_ctx(DEVICE), {"impl": "apex"})
    assert out is model and not result.available and "apex" in result.changed
    with pytest.raises(UserError):
        fused_layernorm.apply(model, pass_ctx(DEVICE), impl="cudnn")
    with pytest.raises(UserError):
        fused_layernorm.apply(model, pass_ctx(DEVICE), impl="torch", fuse_residul=True)


def test_apex_path_swaps_and_copies_weights(monkeypatch):
    """With apex importable, every LayerNorm becomes apex's FusedLayerNorm with the same weights (a stand-in
    apex module here: this machine has none)."""

    class FakeFusedLayerNorm(nn.LayerNorm):
        pass

    apex = types.ModuleType("apex")
    apex.normalization = types.ModuleType("apex.normalization")
    apex.normalization.FusedLayerNorm = FakeFusedLayerNorm
    monkeypatch.setitem(sys.modules, "apex", apex)
    monkeypatch.setitem(sys.modules, "apex.normalization", apex.normalization)
    ref, model = model_pair(DEVICE, seed=9)
    model, result = fused_layernorm.apply(model, pass_ctx(DEVICE), impl="apex")
    assert result.details["implementation"] == "apex" and result.details["replaced"] == N_LAYER_NORMS
    assert sum(isinstance(m, FakeFusedLayerNorm) for m in model.modules()) == N_LAYER_NORMS
    _assert_same_training_step(ref, model, atol=1e-6, rtol=1e-6)


def _dtype_flow(model, x, device_type):
    """Output dtypes of the patch embedding, every block and the final norm, in order, under bf16 autocast."""
    seen = []
    mods = [model.patch_embed] + [m for m in model.modules() if type(m).__name__ == "SwinTransformerBlock"] + [model.norm]
    # a fused_window block inside its stage's loop returns (residual stream, MLP branch not yet added)
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.append((out[0] if isinstance(out, tuple) else out).dtype))
             for m in mods]
    with torch.no_grad(), torch.autocast(device_type, dtype=torch.bfloat16):
        model(x)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("chain", ["apex", "fmha"])
def test_fused_chain_keeps_autocast_s_dtypes(chain):
    """The fused stages keep every dtype that autocast gives the unpatched model: under CUDA autocast the
    patch embedding's LayerNorm returns fp32, so stage 1's residual stream is fp32 (stages 2-4 start from
    the patch merging's Linear, bf16), and the final norm's output is fp32. A fused LayerNorm that
    returned its input's dtype would run stage 1 and the pooling in bf16: another precision, not a fusion."""
    from workbench.optimize.recipes import resolve_chain

    ref, model = model_pair(DEVICE, drop_path_rate=0.0)
    ctx = pass_ctx(DEVICE, "bf16")
    for stage in resolve_chain(chain):
        for p in stage.passes:
            if p.name in ("fused_layernorm", "fused_window", "fused_attention"):
                model, result = apply_pass(p.name, model, ctx, {**p.params, **({"impl": "triton"} if p.name == "fused_layernorm" else {})})
                assert result.available, p.name
    x, _ = tiny_batch(ref, 2, DEVICE)
    want = _dtype_flow(ref, x, DEVICE.type)
    assert _dtype_flow(model, x, DEVICE.type) == want
    if DEVICE.type == "cuda":
        assert want[0] == torch.float32 and want[-1] == torch.float32


def test_patch_merging_norm_writes_the_reduction_linear_s_dtype(monkeypatch):
    """Each PatchMerging's norm feeds its reduction Linear directly: under autocast it writes bf16 itself
    (no cast kernels), the same step as the model whose norm returns fp32 for autocast to cast
    (`assert_same_as_the_cast_path`). Without autocast it is a plain LayerNorm."""
    import importlib

    from pass_helpers import assert_same_as_the_cast_path, train_step

    from workbench.kernels.layer_norm import TritonLayerNorm

    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    monkeypatch.setattr(importlib.import_module("workbench.kernels.layer_norm"), "AUTOCAST_FP32_NORM_DEVICES", ("cuda", "cpu"))
    ref, model = model_pair(DEVICE, drop_path_rate=0.0)
    for m in (ref, model):
        _, result = apply_pass("fused_layernorm", m, pass_ctx(DEVICE, "bf16"), {"impl": "triton"})
    assert result.details["merging_norms_into_linear"] == 1  # the tiny Swin's one downsample
    mergings = [m for m in model.modules() if type(m).__name__ == "PatchMerging"]
    assert all(isinstance(m.norm, TritonLayerNorm) and m.norm.into_linear for m in mergings)
    for m in ref.modules():
        if type(m).__name__ == "PatchMerging":
            m.norm.into_linear = False  # the cast path: fp32 out, the Linear casts
    seen = []
    for m in mergings:
        m.reduction.register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
    x, target = _inputs(ref)
    logits, grads = train_step(model, x, target, torch.bfloat16, None)
    assert seen == [torch.bfloat16]
    logits_ref, grads_ref = train_step(ref, x, target, torch.bfloat16, None)
    assert_same_as_the_cast_path(logits, grads, logits_ref, grads_ref, DEVICE)
    with torch.no_grad():  # no autocast: the input's dtype, as torch's LayerNorm
        y = mergings[0].norm(torch.randn(2, 3, 3, mergings[0].norm.normalized_shape[0], device=DEVICE))
    assert y.dtype == torch.float32


@pytest.mark.parametrize("img", [56, (60, 68)], ids=["even-maps", "odd-maps-padded"])
def test_patch_merging_gathers_inside_its_norm_in_inference(img):
    """Without autograd each PatchMerging runs pad + 2x2 gather + norm as one Triton pass (merging_layer_norm):
    the same logits as timm; with autograd, and for a second application of the pass, its forward stays
    bound and trains as timm's."""
    from workbench.kernels._common import launch_log
    from workbench.optimize.passes.block_forward import merging_forward

    size = (img, img) if isinstance(img, int) else img
    torch.manual_seed(3)
    ref = build_model(TINY_MODEL, img_size=size, drop_path_rate=0.0).to(DEVICE).eval()
    model = copy.deepcopy(ref)
    model, result = apply_pass("fused_layernorm", model, pass_ctx(DEVICE), {"impl": "triton"})
    model, result = apply_pass("fused_layernorm", model, pass_ctx(DEVICE), {"impl": "triton"})  # again: no change
    mergings = [m for m in model.modules() if type(m).__name__ == "PatchMerging"]
    assert mergings and all(vars(m)["forward"].__func__ is merging_forward for m in mergings)
    assert result.details["merging_norms_into_linear"] == len(mergings)
    x = torch.randn(2, 3, *size, device=DEVICE)
    with torch.no_grad(), launch_log() as log:
        got = model(x)
    assert sum(e["kernel"] == "_merging_norm_fwd_kernel" for e in log) == len(mergings)
    with torch.no_grad():
        torch.testing.assert_close(got, ref(x), rtol=1e-5, atol=1e-5)
    model.train(), ref.train()
    assert_same_step(ref, model, x, torch.randint(0, 10, (2,), device=DEVICE), 1e-5, 1e-5)
