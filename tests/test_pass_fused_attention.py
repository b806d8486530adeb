"""The fused_attention pass on the tiny Swin: same logits and same gradient for every parameter
(relative_position_bias_table included) as the unpatched model, on the same seed, in fp32."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from workbench.models import TINY_MODEL, build_model  # noqa: E402
from workbench.optimize.passes import apply_pass  # noqa: E402
from workbench.optimize.passes import fused_attention  # noqa: E402
from pass_helpers import model_pair, pass_ctx, rel_err, resize_like_timm, tiny_batch, train_step  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("bias", ["gather", "table"])
def test_fused_attention_pass_matches_timm_in_fp32(bias):
    # drop_path_rate=0: the model trains, and stochastic depth would drop a different sample's path in
    # each run (that, not the kernel, is what a first version of this test tripped over on the GPU)
    plain, patched = model_pair(DEVICE, drop_path_rate=0.0)
    # route kernel: on a GPU the route measurement may send a tiny shape to PyTorch's SDPA
    patched, result = apply_pass("fused_attention", patched, pass_ctx(DEVICE), {"bias": bias, "route": "kernel"})
    assert result.available, result.changed
    assert result.details["patched_modules"] == 4  # two blocks in each of the two stages
    assert result.details["table_modules"] == (4 if bias == "table" else 0)

    images, labels = tiny_batch(plain, 2, DEVICE)
    plain_logits, plain_grads = train_step(plain, images, labels)
    fused_logits, fused_grads = train_step(patched, images, labels)

    assert rel_err(fused_logits, plain_logits) < 1e-4
    assert plain_grads.keys() == fused_grads.keys()
    assert any("relative_position_bias_table" in name for name in fused_grads)
    for name in plain_grads:
        err = rel_err(fused_grads[name], plain_grads[name])
        assert err < 1e-4, f"{name}: relative gradient error {err:.2e}"


def test_attention_dropout_runs_timm_s_sdpa_path():
    """The kernel has no attention dropout: such a module keeps timm's forward with its SDPA switch on
    (F.scaled_dot_product_attention with dropout_p), not timm's eager attention."""
    model = build_model(TINY_MODEL)
    attn = next(m for m in model.modules() if type(m).__name__ == "WindowAttention")
    attn.attn_drop.p = 0.1
    ctx = pass_ctx(DEVICE)
    model, result = fused_attention.apply(model, ctx)
    assert result.details == {**result.details, "patched_modules": 3, "skipped_attn_dropout": 1}
    assert "1 on timm's SDPA path (attn_drop > 0: the kernel has no dropout)" in result.changed
    assert "forward" not in vars(attn) and attn.fused_attn is True


@pytest.mark.parametrize("name", ["fused_attention", "fused_window", "fused_linear"])
def test_kernel_passes_reject_parameters_when_the_recipe_loads(tmp_path, name):
    """A parameter these passes do not take is a user's mistake: one clear error when the YAML loads,
    not a stage that silently reports itself unavailable."""
    from workbench.errors import UserError
    from workbench.optimize.recipes import resolve_chain

    path = tmp_path / "typo.yaml"
    path.write_text(f"name: typo\nextends: fmha\npasses: [{{name: {name}, params: {{bogus: 1}}}}]\n")
    with pytest.raises(UserError, match=f"pass '{name}' takes no parameter 'bogus'"):
        resolve_chain(str(path))


def features_and_table_grads(model, images, labels, autocast: bool):
    """forward_features (B, H, W, C: layer-normed, well conditioned, unlike the tiny model's ~0.1-norm
    logits) and the relative-position-table gradients of a cross-entropy step."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
        feats = model.forward_features(images)
        loss = torch.nn.functional.cross_entropy(model.forward_head(feats), labels)
    loss.backward()
    return feats.detach().float(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                    if "relative_position_bias_table" in n}


@pytest.mark.parametrize("bias", ["gather", "table"])
def test_fused_attention_pass_under_bf16_autocast(bias):
    """Under autocast q/k/v are bf16 and the bias fp32. Held to the fp32 truth, the fused model must be
    at least as close to it as timm's own bf16 path (plus a little)."""
    plain, patched = model_pair(DEVICE, drop_path_rate=0.0)
    patched, _ = apply_pass("fused_attention", patched, pass_ctx(DEVICE, "bf16"), {"bias": bias, "route": "kernel"})
    images, labels = tiny_batch(plain, 2, DEVICE)
    truth, truth_grads = features_and_table_grads(plain, images, labels, autocast=False)
    plain_f, plain_g = features_and_table_grads(plain, images, labels, autocast=True)
    fused_f, fused_g = features_and_table_grads(patched, images, labels, autocast=True)
    plain_err, fused_err = rel_err(plain_f, truth), rel_err(fused_f, truth)
    assert fused_err <= 1.5 * plain_err + 1e-2, (fused_err, plain_err)
    for name in truth_grads:
        assert fused_g[name].dtype == torch.float32
        pe, fe = rel_err(plain_g[name], truth_grads[name]), rel_err(fused_g[name], truth_grads[name])
        assert fe <= 1.5 * pe + 2e-2, (name, fe, pe)


def test_rel_pos_bias_matches_timm_gather_forward_and_backward():
    """_swin.RelPosBias (one gather; memset + index_add_ backward) against timm's _get_rel_pos_bias."""
    from workbench.optimize.passes._swin import rel_pos_bias

    torch.manual_seed(0)
    model = build_model(TINY_MODEL).to(DEVICE)
    attn = next(m for m in model.modules() if type(m).__name__ == "WindowAttention")
    with torch.no_grad():
        attn.relative_position_bias_table.normal_()
    ref = attn._get_rel_pos_bias()[0]
    d = torch.randn_like(ref)
    (ref_grad,) = torch.autograd.grad(ref, attn.relative_position_bias_table, d)
    ours = rel_pos_bias(attn)
    assert ours.is_contiguous() and torch.equal(ours, ref)
    (grad,) = torch.autograd.grad(ours, attn.relative_position_bias_table, d)
    assert grad.is_contiguous()
    # index_add_'s atomics (on a GPU) against the indexing backward's sorted sums: fp32 rounding apart
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5)
    # with the index's inverse (what fused_attention adds): one Triton launch, the same gradient
    from workbench.optimize.passes._swin import INVERSE_BUFFER, add_rel_pos_inverse

    assert add_rel_pos_inverse(attn) and getattr(attn, INVERSE_BUFFER) is not None
    assert INVERSE_BUFFER not in attn.state_dict()
    ours = rel_pos_bias(attn, getattr(attn, INVERSE_BUFFER))
    (grad2,) = torch.autograd.grad(ours, attn.relative_position_bias_table, d)
    # summed in another order than index_add_'s atomics: fp32 rounding apart (1.5e-6 seen on the H200)
    torch.testing.assert_close(grad2, ref_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ws", [7, 12, (5, 9)])
def test_rel_pos_table_grad_is_the_index_add_and_deterministic(ws, monkeypatch):
    """rel_pos_inverse + rel_pos_table_grad against index_add_ on timm's index, square and oblong windows,
    fp32 and bf16 tables; twice the same bits; every table row written (no memset needed)."""
    from timm.models.swin_transformer import get_relative_position_index

    from workbench.kernels import window_attention as wa

    wh, ww = (ws, ws) if isinstance(ws, int) else ws
    index = get_relative_position_index(wh, ww).to(DEVICE)
    n_table, n, heads = (2 * wh - 1) * (2 * ww - 1), wh * ww, 2
    inverse = wa.rel_pos_inverse(index, n_table)
    assert inverse.dtype == torch.int32 and inverse.shape[0] == n_table
    assert sorted(inverse[inverse >= 0].tolist()) == list(range(n * n))     # every pair listed once
    g = torch.Generator().manual_seed(wh * 31 + ww)
    d_rel = torch.randn(heads, n, n, generator=g).to(DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        want = torch.zeros(n_table, heads, dtype=torch.float32, device=DEVICE).index_add_(0, index.view(-1), d_rel.reshape(heads, -1).t())
        got = wa.rel_pos_table_grad(d_rel, inverse, dtype)
        assert got.dtype == dtype and got.shape == (n_table, heads)
        torch.testing.assert_close(got.float(), want, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
        assert torch.equal(got, wa.rel_pos_table_grad(d_rel, inverse, dtype))
    if ws == 7 and wa._INTERPRET:
        # the GPU's launch of the same kernel, one table row per program, over 21 leading slices (two
        # steps of 16): the sum, as the interpreter's many-rows launch gives it (up to the fp32 order)
        stacked = torch.stack([d_rel, 2 * d_rel, -d_rel] * 7).reshape(21, heads, -1)
        many_rows = wa.rel_pos_table_grad_host(stacked, inverse, torch.float32)
        monkeypatch.setattr(wa, "_INTERPRET", False)
        one_row = wa.rel_pos_table_grad_host(stacked, inverse, torch.float32)
        assert torch.equal(one_row, wa.rel_pos_table_grad_host(stacked, inverse, torch.float32))
        torch.testing.assert_close(one_row, many_rows, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(one_row, 14 * want, rtol=1e-5, atol=1e-4)


def test_table_bias_is_the_gathered_bias_bit_for_bit_and_a_bad_mode_is_refused():
    """bias: table reads the same values in-kernel that bias: gather gathers first: the same outputs to
    the bit, and table gradients equal up to the order of the fp32 sums; other modes are a user error."""
    from workbench.errors import UserError

    _, a = model_pair(DEVICE, drop_path_rate=0.0)
    _, b = model_pair(DEVICE, drop_path_rate=0.0)
    a, _ = apply_pass("fused_attention", a, pass_ctx(DEVICE), {"bias": "gather", "route": "kernel"})
    b, _ = apply_pass("fused_attention", b, pass_ctx(DEVICE), {"bias": "table", "route": "kernel"})
    images, labels = tiny_batch(a, 2, DEVICE)
    la, ga = train_step(a, images, labels)
    lb, gb = train_step(b, images, labels)
    assert torch.equal(la, lb)
    for name in ga:
        if "relative_position_bias_table" in name:
            torch.testing.assert_close(gb[name], ga[name], rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(gb[name], ga[name]), name
    with pytest.raises(UserError, match="bias must be one of auto, table, gather"):
        fused_attention.apply(build_model(TINY_MODEL), pass_ctx(DEVICE), bias="sdpa")


def test_auto_is_the_default_bias_mode_and_a_named_mode_is_recorded_as_a_choice():
    """The fmha recipe names fused_attention without params: bias auto, which without a measurement reads
    the table in-kernel at window 7 (49 tokens). A record lists bias only where a recipe named one."""
    _, result = apply_pass("fused_attention", build_model(TINY_MODEL).to(DEVICE), pass_ctx(DEVICE))
    assert result.details["bias"] == "auto" and result.params == {}
    if DEVICE.type == "cpu":    # on a GPU each shape's form is measured
        assert "not measured" in result.details["bias_rule"] and result.details["table_modules"] == 4
    kernel = {"route": "kernel"}
    _, result = apply_pass("fused_attention", build_model(TINY_MODEL).to(DEVICE), pass_ctx(DEVICE), kernel)
    assert result.details["table_modules"] == 4 and "not measured" in result.details["bias_rule"]
    _, result = apply_pass("fused_attention", build_model(TINY_MODEL).to(DEVICE), pass_ctx(DEVICE),
                           {"bias": "gather", **kernel})
    assert result.details["table_modules"] == 0 and result.params == {"bias": "gather", **kernel}
    assert result.details["gather_modules"] == 4 and "bias_rule" not in result.details
    assert "4 with the bias gathered before the kernel" in result.changed
    _, result = apply_pass("fused_attention", build_model(TINY_MODEL).to(DEVICE), pass_ctx(DEVICE),
                           {"bias": "table", **kernel})
    assert result.params == {"bias": "table", **kernel} and result.details["table_modules"] == 4


def test_window_12_runs_the_kernel_and_max_tokens_routes_it_to_sdpa_with_a_reason():
    """Window 12 (144 tokens) runs the key-tiled kernel by default; max_tokens 64 routes it to timm's SDPA
    path and each plan says why; either route trains the same numbers as timm."""
    from timm.models.swin_transformer import SwinTransformer

    def window12():
        torch.manual_seed(0)
        return SwinTransformer(img_size=96, patch_size=4, window_size=12, embed_dim=32, depths=(2, 2),
                               num_heads=(2, 4), num_classes=10, drop_path_rate=0.0).to(DEVICE)

    plain = window12()
    kernel, result = fused_attention.apply(window12(), pass_ctx(DEVICE), route="kernel")
    assert result.details["patched_modules"] == 4 and result.details["sdpa_routed"] == 0
    assert result.params == {"route": "kernel"} and result.details["max_tokens"] == 256
    # bias auto, unmeasured: 144 tokens a window take the gathered bias (the key-tiled kernel reads it faster)
    assert result.details["gather_modules"] == 4 and result.details["table_modules"] == 0
    from workbench.optimize.passes.block_plan import block_plans

    assert all("triton (bias gather)" in p.describe() for p in block_plans(kernel).plans.values())

    routed, forced = fused_attention.apply(window12(), pass_ctx(DEVICE), max_tokens=64)
    assert forced.details["sdpa_routed"] == 4 and forced.details["patched_modules"] == 0
    assert forced.params == {"max_tokens": 64}
    assert "4 with 144-token windows on PyTorch's SDPA (above max_tokens 64)" in forced.changed
    assert all(m.fused_attn for m in routed.modules() if type(m).__name__ == "WindowAttention")
    from workbench.optimize.passes.block_plan import block_plans

    plans = block_plans(routed)
    described = [plans.plan(name).describe() for name in plans.plans]
    assert len(described) == 4 and all("attention sdpa" in d and "as the recipe asks" in d for d in described)

    images, labels = tiny_batch(plain, 2, DEVICE)
    plain_logits, plain_grads = train_step(plain, images, labels)
    for model in (routed, kernel):
        logits, grads = train_step(model, images, labels)
        assert rel_err(logits, plain_logits) < 1e-4
        for name in plain_grads:
            assert rel_err(grads[name], plain_grads[name]) < 1e-4, name


def test_windows_larger_than_the_kernels_take_run_sdpa_and_say_why():
    """A window of 17 x 17 = 289 tokens is past the kernels' 256: SDPA, whatever the recipe asks."""
    from timm.models.swin_transformer import SwinTransformer

    torch.manual_seed(0)
    model = SwinTransformer(img_size=68, patch_size=4, window_size=17, embed_dim=16, depths=(2,),
                            num_heads=(2,), num_classes=10, drop_path_rate=0.0).to(DEVICE)
    routed, result = fused_attention.apply(model, pass_ctx(DEVICE))
    assert result.details["sdpa_routed"] == 2 and result.details["patched_modules"] == 0
    from workbench.optimize.passes.block_plan import block_plans

    plans = block_plans(routed)
    assert all("the kernels take at most 256" in plans.plan(name).describe() for name in plans.plans)


def test_max_tokens_must_be_a_whole_number():
    from workbench.errors import UserError

    for bad in (0, 257, 2.5, True):
        with pytest.raises(UserError, match="max_tokens must be a whole number from 1 to 256"):
            fused_attention.apply(build_model(TINY_MODEL), pass_ctx(DEVICE), max_tokens=bad)


@pytest.mark.filterwarnings("ignore::UserWarning:timm.layers.interpolate")   # timm's table resize, not ours
@pytest.mark.parametrize("bias, block", [("gather", False), ("table", False), ("table", True)],
                         ids=["gather", "table", "whole-block"])
def test_a_model_resized_after_the_passes_runs_at_its_new_window(bias, block):
    """timm's set_input_size after the passes bound the model (a new resolution and window, as for fine-tuning
    at another size): the window kernels and the attention run the new window, whose index's inverse the
    attention registers again, with timm's logits and gradients; before, the stale inverse stopped it."""
    plain, patched = model_pair(DEVICE, drop_path_rate=0.0)
    ctx = pass_ctx(DEVICE)
    patched, _ = apply_pass("fused_layernorm", patched, ctx, {"impl": "triton"})
    passes = [("fused_window", {}), ("fused_attention", {"bias": bias}), ("fused_linear", {})]
    for name, params in passes + [("fused_block", {})] * block:
        patched, result = apply_pass(name, patched, ctx, params)
        assert result.available, result.changed
    for model in (plain, patched):
        resize_like_timm(model, DEVICE, img_size=(64, 64), window_size=4)
    assert patched.layers[0].blocks[0].attn.relative_position_inverse.shape[0] == 13 ** 2  # the old window's
    images, labels = tiny_batch(plain, 2, DEVICE)
    assert images.shape[-1] == 64
    plain_logits, plain_grads = train_step(plain, images, labels)
    fused_logits, fused_grads = train_step(patched, images, labels)
    if not block:  # the whole-block Function sums the table's gradient through the index itself
        assert patched.layers[0].blocks[0].attn.relative_position_inverse.shape[0] == 7 ** 2
    assert rel_err(fused_logits, plain_logits) < 1e-4
    for name in plain_grads:
        assert rel_err(fused_grads[name], plain_grads[name]) < 1e-4, name


def test_a_resized_window_of_as_many_table_rows_and_a_first_forward_in_inference_mode():
    """A (4, 8) window resized to (8, 4): the table has as many rows and the index is another, so the
    inverse is rebuilt by the window it was built for, not its row count; that first forward runs under
    torch.inference_mode (a validation pass), and the training step after it still saves the inverse."""
    from timm.models.swin_transformer import SwinTransformer

    def build():
        torch.manual_seed(0)
        return SwinTransformer(img_size=(32, 64), patch_size=4, window_size=(4, 8), embed_dim=32, depths=(2,),
                               num_heads=(2,), num_classes=10, drop_path_rate=0.0).to(DEVICE)

    plain, patched = build(), build()
    ctx = pass_ctx(DEVICE)
    patched, result = apply_pass("fused_attention", patched, ctx, {"bias": "table"})   # (fused_window: square only)
    assert result.available, result.changed
    for model in (plain, patched):
        resize_like_timm(model, DEVICE, img_size=(64, 32), window_size=(8, 4))
    images = torch.randn(2, 3, 64, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    labels = torch.tensor([1, 7], device=DEVICE)
    with torch.inference_mode():
        patched.eval()(images)
    patched.train()
    plain_logits, plain_grads = train_step(plain, images, labels)
    fused_logits, fused_grads = train_step(patched, images, labels)
    assert rel_err(fused_logits, plain_logits) < 1e-4
    for name in plain_grads:
        assert rel_err(fused_grads[name], plain_grads[name]) < 1e-4, name


@pytest.mark.parametrize("family", ["v1", "v1-whole-block", "v2"])
def test_a_window_resized_past_the_kernels_runs_timms_attention(family):
    """Windows of more than 256 tokens go to PyTorch's path when the pass binds; one resized to 17 x 17 after
    binding runs timm's own attention forward there, not the kernel (which would refuse it)."""
    from timm.models.swin_transformer import SwinTransformer
    from timm.models.swin_transformer_v2 import SwinTransformerV2

    from workbench.kernels.window_attention import MAX_WINDOW_TOKENS
    from workbench.optimize.passes.fused_attention import KERNEL_MAX_TOKENS

    assert KERNEL_MAX_TOKENS == MAX_WINDOW_TOKENS

    def build():
        torch.manual_seed(0)
        cls = SwinTransformerV2 if family == "v2" else SwinTransformer
        return cls(img_size=32, patch_size=4, window_size=4, embed_dim=32, depths=(2,), num_heads=(2,),
                   num_classes=10, drop_path_rate=0.0).to(DEVICE)

    plain, patched = build(), build()
    ctx = pass_ctx(DEVICE)
    passes = [("fused_attention", {})] + [("fused_window", {}), ("fused_block", {})] * (family == "v1-whole-block")
    for name, params in passes:
        patched, result = apply_pass(name, patched, ctx, params)
        assert result.available, result.changed
    for model in (plain, patched):
        resize_like_timm(model, DEVICE, img_size=(68, 68), window_size=17)
    images = torch.randn(1, 3, 68, 68, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        assert rel_err(patched.eval()(images), plain.eval()(images)) < 1e-5
