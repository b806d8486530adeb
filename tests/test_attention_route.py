"""fused_attention's measured route: a window shape where PyTorch's own attention is faster on the GPU stays
on it, the plan and the pass result say so with the times, the model still computes timm's function, and
without a GPU nothing is timed and the record says so. On a GPU the measurement itself runs (timed copies
of the model's attention shapes, the model untouched)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from workbench.optimize.passes import _route, apply_pass, fused_attention  # noqa: E402
from workbench.optimize.passes.block_plan import block_plans  # noqa: E402
from workbench.optimize.passes._swin import named_swin_blocks  # noqa: E402
from pass_helpers import model_pair, pass_ctx, rel_err, tiny_batch, train_step  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_shapes_of_the_tiny_swin():
    model, _ = model_pair("cpu", drop_path_rate=0.0)
    shapes = [_route.block_shape(b) for _, b in named_swin_blocks(model)]
    # stage 1: 14x14 tokens in 7x7 windows (4 per image), shifted every other block; stage 2: one window
    assert shapes == [_route.Shape(49, 2, 16, 4, False), _route.Shape(49, 2, 16, 4, True),
                      _route.Shape(49, 4, 16, 1, False), _route.Shape(49, 4, 16, 1, False)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path; on a GPU machine the kernels want CUDA tensors")
def test_without_a_gpu_nothing_is_timed_and_the_record_says_so():
    _, patched = model_pair("cpu", drop_path_rate=0.0)
    _, result = apply_pass("fused_attention", patched, pass_ctx("cpu"))
    assert result.details["route"] == "auto" and result.details["routes_measured"] is False
    assert "not measured" in result.details["routes_note"] and result.details["patched_modules"] == 4
    _, result = apply_pass("fused_attention", model_pair("cpu")[1], pass_ctx("cpu"), {"route": "kernel"})
    assert result.params == {"route": "kernel"} and result.details["routes_measured"] is False


def test_a_shape_measured_faster_on_pytorch_stays_there_and_the_model_is_unchanged(monkeypatch):
    plain, patched = model_pair(DEVICE, drop_path_rate=0.0)
    masked = _route.Shape(49, 2, 16, 4, True)

    def measured(blocks, ctx, images, v2, kernel_forward):
        shapes = {_route.block_shape(b) for _, b in blocks}
        return {s: {"kernel_us": 120.0, "pytorch_us": 80.0 if s == masked else 200.0,
                    "route": "pytorch" if s == masked else "kernel", "blocks": 1} for s in shapes}
    monkeypatch.setattr(fused_attention, "measure_routes", measured)
    ctx = pass_ctx(DEVICE)
    patched, result = apply_pass("fused_attention", patched, ctx)
    assert result.details["sdpa_measured_faster"] == 1 and result.details["patched_modules"] == 3
    assert "1 on PyTorch's SDPA, faster at their shapes on this GPU (measured)" in result.changed
    plans = block_plans(patched).plans
    assert plans["layers.0.blocks.1"].sdpa and plans["layers.0.blocks.1"].attention == "timm"
    assert "PyTorch's SDPA 80 us against the kernel's 120 us" in dict(plans["layers.0.blocks.1"].fallbacks)["attention"]
    images, labels = tiny_batch(plain, 2, DEVICE)
    plain_logits, plain_grads = train_step(plain, images, labels)
    fused_logits, fused_grads = train_step(patched, images, labels)
    assert rel_err(fused_logits, plain_logits) < 1e-4
    assert all(rel_err(fused_grads[n], plain_grads[n]) < 1e-4 for n in plain_grads)


def test_the_whole_block_function_stands_aside_where_attention_runs_pytorch(monkeypatch):
    plain, patched = model_pair(DEVICE, drop_path_rate=0.0)
    masked = _route.Shape(49, 2, 16, 4, True)
    monkeypatch.setattr(fused_attention, "measure_routes", lambda blocks, ctx, images, v2, kernel_forward: {
        masked: {"kernel_us": 120.0, "pytorch_us": 80.0, "route": "pytorch", "blocks": 1}})
    ctx = pass_ctx(DEVICE)
    for name in ("fused_window", "fused_attention", "fused_block"):
        patched, result = apply_pass(name, patched, ctx)
        assert result.available, result.changed
    assert result.details["blocks_patched"] == 3
    assert "its attention stays on PyTorch's path (measured on this GPU" in result.changed
    images, labels = tiny_batch(plain, 2, DEVICE)
    plain_logits, _ = train_step(plain, images, labels)
    fused_logits, _ = train_step(patched, images, labels)
    assert rel_err(fused_logits, plain_logits) < 1e-4


def test_the_margin_keeps_a_near_tie_on_the_kernel():
    assert _route.choose(100.0, 100.0 * (1 - _route.ROUTE_MARGIN / 2)) == "kernel"
    assert _route.choose(100.0, 100.0 * (1 - 2 * _route.ROUTE_MARGIN)) == "pytorch"
    assert _route.choose(100.0, 150.0) == "kernel"


def test_another_form_of_the_kernel_must_beat_the_first_by_its_margin():
    near = 100.0 * (1 - _route.VARIANT_MARGIN / 2)
    assert _route.choose_form({"table": 100.0, "gather": near}) == "table"
    assert _route.choose_form({"table": 100.0, "gather": 100.0 * (1 - 2 * _route.VARIANT_MARGIN)}) == "gather"
    assert _route.choose_form({"table": 100.0, "gather": 130.0}) == "table"


def test_the_bias_form_measured_faster_reaches_each_blocks_plan(monkeypatch):
    """bias auto with measured routes: a shape whose gathered bias measured faster gathers it, the others
    read the table; the result lists each shape's form and the model computes timm's function."""
    plain, patched = model_pair(DEVICE, drop_path_rate=0.0)
    masked = _route.Shape(49, 2, 16, 4, True)
    seen = []

    def measured(blocks, ctx, images, v2, kernel_forward):
        seen.append(sorted(kernel_forward))
        return {s: {"table_us": 120.0, "gather_us": 90.0 if s == masked else 125.0,
                    "form": "gather" if s == masked else "table", "kernel_us": 90.0 if s == masked else 120.0,
                    "pytorch_us": 200.0, "route": "kernel", "blocks": 1}
                for s in {_route.block_shape(b) for _, b in blocks}}
    monkeypatch.setattr(fused_attention, "measure_routes", measured)
    patched, result = apply_pass("fused_attention", patched, pass_ctx(DEVICE))
    assert seen == [["gather", "table"]]
    assert result.details["gather_modules"] == 1 and result.details["table_modules"] == 3
    assert "measured per window shape" in result.details["bias_rule"]
    assert "1 with the bias gathered before the kernel (measured faster at their shapes)" in result.changed
    assert {r["form"] for r in result.details["routes"]} == {"table", "gather"}
    plans = block_plans(patched).plans
    assert plans["layers.0.blocks.1"].attention_bias == "gather" and plans["layers.0.blocks.0"].attention_bias == "table"
    images, labels = tiny_batch(plain, 2, DEVICE)
    plain_logits, plain_grads = train_step(plain, images, labels)
    fused_logits, fused_grads = train_step(patched, images, labels)
    assert rel_err(fused_logits, plain_logits) < 1e-4
    assert all(rel_err(fused_grads[n], plain_grads[n]) < 1e-4 for n in plain_grads)


@pytest.mark.gpu
@pytest.mark.routes
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("training", [True, False])
def test_the_routes_are_measured_on_the_gpu(training):
    from workbench.models import build_model
    from workbench.precision import resolve_precision
    from workbench.optimize.passes import PassContext

    model = build_model("swin_tiny_patch4_window7_224", drop_path_rate=0.0).cuda()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ctx = PassContext(device=torch.device("cuda"), precision=resolve_precision("bf16"), training=training, batch=8)
    model, result = apply_pass("fused_attention", model, ctx)
    routes = result.details["routes"]
    # stages 1-3 shifted and not; stage 4 is one window per image, never shifted
    assert result.details["routes_measured"] and len(routes) == 7
    assert all(r["kernel_us"] > 0 and r["pytorch_us"] > 0 and r["route"] in ("kernel", "pytorch") for r in routes)
    assert all(r["form"] in ("table", "gather") and r["kernel_us"] == r[f"{r['form']}_us"] for r in routes)
    assert sum(r["blocks"] for r in routes) == 12
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("v2", [False, True])
def test_the_timed_forwards_run_on_copies_of_every_shape(monkeypatch, training, v2):
    """_measure's copies, inputs, masks and both forwards, run once each on this device (the CUDA-event
    clock replaced): v1's kernel against SDPA, SwinV2's against its cosine attention on SDPA."""
    from workbench.optimize.passes.fused_attention import _v1_kernel, v2_attention_forward
    import types

    calls = []

    def run_once(fn, x, mask, train, autocast):
        out = fn(x, mask)
        assert out.shape == x.shape and torch.isfinite(out).all()
        if train:
            out.float().sum().backward()
        calls.append(fn.__func__.__name__)
        return 100.0 if "fused" in fn.__func__.__name__ or "v2_attention" in fn.__func__.__name__ else 50.0
    monkeypatch.setattr(_route, "_time", run_once)
    if v2:
        import timm
        from timm.models.swin_transformer_v2 import SwinTransformerV2Block

        torch.manual_seed(0)
        model = timm.create_model("swinv2_tiny_window8_256", img_size=64, window_size=4, embed_dim=32,
                                  depths=(2, 2), num_heads=(2, 4), num_classes=10).to(DEVICE)
        blocks = [(n, b) for n, b in model.named_modules() if isinstance(b, SwinTransformerV2Block)]
        kernel = lambda attn: types.MethodType(v2_attention_forward, attn)  # noqa: E731
    else:
        model, _ = model_pair(DEVICE, drop_path_rate=0.0)
        blocks = named_swin_blocks(model)
        kernel = {"table": _v1_kernel(True), "gather": _v1_kernel(False)}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ctx = pass_ctx(DEVICE)
    ctx.training = training
    routes = _route._measure(blocks, ctx, 2, v2, kernel)
    assert sum(r["blocks"] for r in routes.values()) == len(blocks)
    assert all(r["route"] == "pytorch" and r["kernel_us"] == 100.0 for r in routes.values())
    forms = 1 if v2 else 2            # v1 times both bias forms of its kernel
    assert len(calls) == (forms + 1) * len(routes)
    assert v2 or all(r["form"] == "table" and r["gather_us"] == 100.0 for r in routes.values())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())      # copies only


def test_the_api_passes_the_training_batch_to_the_route_timing(monkeypatch):
    from workbench.api import optimize_swin
    from workbench.errors import UserError

    seen = []
    monkeypatch.setattr(fused_attention, "measure_routes",
                        lambda blocks, ctx, images, v2, kernel_forward: seen.append(images) or {})
    model, _ = model_pair(DEVICE, drop_path_rate=0.0)
    optimize_swin(model, "fmha", batch=48, device=DEVICE)
    assert seen == [48]
    with pytest.raises(UserError, match="batch must be an integer >= 1"):
        optimize_swin(model_pair(DEVICE)[0], "fmha", batch=0, device=DEVICE)


def test_a_padded_shifted_block_is_timed_with_its_padded_mask(monkeypatch):
    """A block that builds its shift mask per call (timm's swinv2_cr) on a map the windows pad (10 x 10 in
    windows of 4): the route timing builds the mask from the padded shape, as the block's forward does,
    never from the unpadded map (which some timm versions do when given no input, and fail)."""
    from test_swinv2_cr import tiny_cr

    model = tiny_cr(40, 4)
    blocks = [b for b in model.modules() if type(b).__name__ == "SwinTransformerV2CrBlock" and any(b.shift_size)]
    assert blocks
    for blk in blocks:
        real = type(blk).get_attn_mask

        def from_input_only(self, x=None, device=None, dtype=None, real=real):
            assert x is not None, "built without the padded input"
            return real(self, x)
        monkeypatch.setattr(type(blk), "get_attn_mask", from_input_only)
        shape = _route.block_shape(blk)
        mask = _route._mask(blk, shape, torch.device("cpu"))
        h, w = _route.feature_map(blk)
        padded = (-(-h // 4) * 4, -(-w // 4) * 4)
        assert padded != (h, w)                     # 10 x 10 -> 12 x 12, 5 x 5 -> 8 x 8
        assert mask.shape == (shape.windows, shape.tokens, shape.tokens)
        assert torch.equal(mask, real(blk, torch.empty(1, *padded, 1)))
