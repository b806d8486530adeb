"""patch_swin: a recipe's model passes on a Swin inside a model of the user's own (a features_only backbone,
a detector's backbone), in place: timm's features and gradients, the weights and state_dict untouched, and
the recipe's step passes (autocast, fused optimizer, master weights, compile, CUDA graphs) left to the
user's loop with one line each."""
import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from workbench.api import RecipeUnavailable, SwinPatch, patch_swin  # noqa: E402
from workbench.errors import UserError  # noqa: E402
from pass_helpers import rel_err  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def tiny_backbone(seed: int = 0):
    """timm's features_only Swin (a FeatureListNet) at 64 px, window 4, two stages: stage 1 shifted and
    padded to no remainder, stage 2 one window."""
    import timm

    torch.manual_seed(seed)
    return timm.create_model("swin_tiny_patch4_window7_224", features_only=True, img_size=64, window_size=4,
                             embed_dim=32, depths=(2, 2), num_heads=(2, 4), out_indices=(0, 1),
                             drop_path_rate=0.0).to(DEVICE)


class TinyDetector(torch.nn.Module):
    """A backbone and one 1x1 head per feature level: what a detection model's forward looks like to the
    passes (the Swin blocks sit two modules down)."""

    def __init__(self):
        super().__init__()
        self.backbone = tiny_backbone()
        self.heads = torch.nn.ModuleList(torch.nn.Linear(c, 5) for c in (32, 64)).to(DEVICE)

    def forward(self, x):
        return [head(f) for head, f in zip(self.heads, self.backbone(x))]


def step(model, images, autocast=None):
    """Forward, a loss over every level's output, backward -> (outputs fp32, {name: grad fp32})."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE.type, dtype=autocast, enabled=autocast is not None):
        outs = model(images)
        loss = sum(o.float().pow(2).mean() for o in outs)
    loss.backward()
    return [o.detach().float() for o in outs], {n: p.grad.float() for n, p in model.named_parameters()}


def images(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, 3, 64, 64), generator=g).to(DEVICE)


def test_a_detector_s_backbone_runs_the_kernels_with_timm_s_numbers():
    plain = TinyDetector()
    model = copy.deepcopy(plain)
    patch = patch_swin(model, "dense", dtype="fp32")
    assert isinstance(patch, SwinPatch) and patch.model is model and patch.notes == []
    applied = [r.name for r in patch.applied]
    for name in ("fused_layernorm", "fused_window", "fused_attention", "fused_linear", "patch_embed"):
        assert name in applied, patch.describe()
    assert model.state_dict().keys() == plain.state_dict().keys()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    x = images()
    outs_ref, grads_ref = step(plain, x)
    outs, grads = step(model, x)
    for o, o_ref in zip(outs, outs_ref):
        assert rel_err(o, o_ref) < 1e-5
    for name, g in grads_ref.items():
        assert rel_err(grads[name], g) < 1e-4, name


def test_under_the_user_s_autocast_the_patched_backbone_tracks_timm():
    """The loop the patch asks for (bf16 autocast around the forward and the loss): features and gradients
    as close to timm's under the same autocast as bf16 rounding allows."""
    plain = tiny_backbone()
    model = copy.deepcopy(plain)
    patch = patch_swin(model, "fmha")
    assert patch.dtype == "bf16"
    x = images(2)
    outs_ref, grads_ref = step(plain, x, torch.bfloat16)
    outs, grads = step(model, x, torch.bfloat16)
    for o, o_ref in zip(outs, outs_ref):
        assert rel_err(o, o_ref) < 2e-2
    for name, g in grads_ref.items():
        assert rel_err(grads[name], g) < 5e-2, name


@pytest.mark.parametrize("recipe, loop", [
    ("fmha", ["amp", "fused_adamw", "master_weights"]),
    ("fmha-compile", ["amp", "fused_adamw", "master_weights", "compile"]),
    ("fmha-graph", ["amp", "fused_adamw", "master_weights", "cuda_graph"]),
])
def test_the_step_passes_are_left_to_your_loop_with_a_line_each(recipe, loop):
    patch = patch_swin(tiny_backbone(), recipe)
    assert [name for name, _ in patch.in_your_loop] == loop
    lines = dict(patch.in_your_loop)
    assert "torch.autocast(device_type, dtype=torch.bfloat16)" in lines["amp"]
    assert "fused=True" in lines["fused_adamw"] and "stay fp32" in lines["master_weights"]
    if "compile" in lines:
        assert "torch.compile(mode='default')" in lines["compile"]
    text = patch.describe()
    assert text.startswith(f"recipe {recipe} (bf16)") and "left to your loop:" in text
    assert all(p.dtype == torch.float32 for p in patch.model.parameters())


def test_fp32_leaves_out_autocast_and_fp16_asks_for_a_grad_scaler():
    fp32 = dict(patch_swin(tiny_backbone(), "fmha", dtype="fp32").in_your_loop)
    assert "amp" not in fp32 and "master_weights" not in fp32     # no autocast, so nothing of its casts
    assert "GradScaler" in dict(patch_swin(tiny_backbone(), "fmha", dtype="fp16").in_your_loop)["amp"]


def test_a_patch_for_inference_leaves_the_optimizer_out_of_its_lines():
    lines = dict(patch_swin(tiny_backbone(), "fmha-graph", dtype="fp16", training=False).in_your_loop)
    assert list(lines) == ["amp", "cuda_graph"]
    assert "GradScaler" not in lines["amp"] and "capture your forward" in lines["cuda_graph"]


def test_bad_input_is_one_user_error():
    with pytest.raises(UserError, match="torch.nn.Module"):
        patch_swin("swin_tiny", "fmha")
    with pytest.raises(UserError, match="dtype must be"):
        patch_swin(tiny_backbone(), "fmha", dtype="int4")
    with pytest.raises(UserError, match="batch must be"):
        patch_swin(tiny_backbone(), "fmha", batch=0)
    for training in ("no", 0, None):      # not taken as True (or False) by their truth
        with pytest.raises(UserError, match="training must be True or False") as info:
            patch_swin(tiny_backbone(), "fmha", training=training)
        assert "\n" not in str(info.value)
    with pytest.raises(UserError, match="recipe"):
        patch_swin(tiny_backbone(), "no-such-recipe")


def test_a_model_without_swin_blocks_is_refused():
    with pytest.raises(UserError, match="Linear holds no timm Swin block"):
        patch_swin(torch.nn.Linear(4, 4).to(DEVICE), "fmha")


def test_passes_that_cannot_run_here_are_refused_or_noted(monkeypatch):
    """Without the Triton kernels (no GPU, no interpreter) the recipe is unavailable, or with allow_unavailable
    the passes that need them are noted and the rest apply."""
    import workbench.optimize.passes as passes

    monkeypatch.setattr(passes, "triton_runs_on", lambda device: False)
    with pytest.raises(RecipeUnavailable, match="fused_window not available: the Triton kernels need"):
        patch_swin(tiny_backbone(), "fmha")
    patch = patch_swin(tiny_backbone(), "fmha", allow_unavailable=True)
    assert any(n.startswith("pass fused_attention left out") for n in patch.notes), patch.notes


def test_a_swinv2_backbone_and_an_inference_recipe():
    """A features_only SwinV2 takes the fused stack in fp32 with timm's features; with training=False a
    quantizing recipe (fake quantization, which runs anywhere) swaps its Linears and leaves the head-less
    backbone's features within the recipe's error."""
    import timm

    def backbone():
        torch.manual_seed(0)
        return timm.create_model("swinv2_tiny_window8_256", features_only=True, img_size=32, window_size=4,
                                 embed_dim=32, depths=(2, 2), num_heads=(2, 4), out_indices=(0, 1),
                                 drop_path_rate=0.0).to(DEVICE).eval()

    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    plain = backbone()
    with torch.no_grad():
        ref = plain(x)
    patch = patch_swin(backbone(), "fmha", dtype="fp32", training=False)
    assert "fused_attention" in [r.name for r in patch.applied]
    with torch.no_grad():
        for got, want in zip(patch.model(x), ref):
            assert rel_err(got, want) < 1e-5
    recipe = "tests/data/recipes/int8-sim.yaml"
    untouched = backbone()
    with pytest.raises(RecipeUnavailable, match="inference only.*the model is unchanged"):
        patch_swin(untouched, recipe)
    assert all(type(m).__name__ not in ("TritonLayerNorm", "QuantLinear") for m in untouched.modules())
    patch = patch_swin(backbone(), recipe, training=False)
    assert [r.name for r in patch.applied] == ["quantize_linear"] and patch.dtype == "bf16"
    with torch.no_grad(), torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        for got, want in zip(patch.model(x), ref):
            assert rel_err(got.float(), want) < 0.1


def test_a_quantizing_recipe_quantizes_the_swin_only_and_calibrates_through_it(tmp_path):
    """Static calibration on a detector: random images go through the backbone (in eval mode), not the
    detector's forward; the detector's own heads stay nn.Linear; the Swin's Linears are quantized."""
    recipe = tmp_path / "int8-static.yaml"
    recipe.write_text("name: int8-static\nextends: amp\ndescription: static INT8 fake quantization\n"
                      "passes:\n  - name: quantize_linear\n    params: {dtype: int8, simulate: true, "
                      "activations: static, calibration_batches: 1, calibration_batch: 2}\n")
    detector = TinyDetector()
    detector.train()
    detector.backbone.layers_0.eval()        # a user's own choice inside: each module's mode is put back
    patch = patch_swin(detector, str(recipe), training=False)
    assert all(type(h) is torch.nn.Linear for h in detector.heads)
    assert detector.backbone.training and detector.training and not detector.backbone.layers_0.training
    quantized = [n for n, m in detector.named_modules() if type(m).__name__ == "QuantLinear"]
    assert quantized and all(n.startswith("backbone.") for n in quantized)
    assert "static per-tensor" in patch.applied[0].changed


def test_a_failing_selection_leaves_the_swinv2_attentions_as_timm_built_them(monkeypatch):
    """The SwinV2 qkv switch comes before the measured selection; when that fails (here: no GPU behind a
    faked GPU route) every attention is timm's own again."""
    import timm

    import workbench.optimize.passes.quantize_linear as ql

    torch.manual_seed(0)
    backbone = timm.create_model("swinv2_tiny_window8_256", features_only=True, img_size=32, window_size=4,
                                 embed_dim=32, depths=(2, 2), num_heads=(2, 4), out_indices=(0, 1)).to(DEVICE)

    def fail(*args, **kwargs):
        raise RuntimeError("no GPU to time on")
    monkeypatch.setattr(ql, "gpu_route", lambda dtype, device: "int_mm")
    monkeypatch.setattr(ql, "measure_layers", fail)
    with pytest.raises(RuntimeError, match="no GPU to time on"):
        patch_swin(backbone, "int8", training=False)
    assert not any(m.qkv_bias_separate for m in backbone.modules() if type(m).__name__ == "WindowAttention")


def test_every_swin_of_a_model_is_calibrated_and_nothing_else_is_quantized(tmp_path):
    """Two backbones (a Swin and a ViT, then two Swins): the Linears of each Swin are quantized, each
    calibrated through its own forward; the ViT's stay as they are. A classifier's keep pattern head.fc is
    not reported as matching nothing."""
    import timm

    recipe = tmp_path / "int8-static.yaml"
    recipe.write_text("name: int8-static\nextends: amp\ndescription: static INT8 fake quantization\n"
                      "passes:\n  - name: quantize_linear\n    params: {dtype: int8, simulate: true, keep: [head.fc], "
                      "activations: static, calibration_batches: 1, calibration_batch: 2}\n")

    class Two(torch.nn.Module):
        def __init__(self, first):
            super().__init__()
            self.first, self.second = first, tiny_backbone(seed=1)

    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2,
                            num_classes=0).to(DEVICE)
    for first, quantized_first in ((vit, False), (tiny_backbone(), True)):
        model = Two(first)
        patch_swin(model, str(recipe), training=False)
        kinds = {n.split(".")[0]: set() for n, _ in model.named_children()}
        for name, module in model.named_modules():
            if type(module).__name__ in ("Linear", "QuantLinear") and "." in name:
                kinds[name.split(".")[0]].add(type(module).__name__)
        assert kinds["second"] == {"QuantLinear"}
        assert ("QuantLinear" in kinds["first"]) == quantized_first
    classifier = timm.create_model("swin_tiny_patch4_window7_224", img_size=64, window_size=4, embed_dim=32,
                                   depths=(2, 2), num_heads=(2, 4), num_classes=10).to(DEVICE)
    changed = patch_swin(classifier, str(recipe), training=False).applied[0].changed
    assert "matching nothing" not in changed and type(classifier.head.fc) is torch.nn.Linear
