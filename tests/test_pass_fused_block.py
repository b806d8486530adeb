"""The fused_block pass on the tiny timm Swin: each block as one autograd Function gives the same logits
and every parameter gradient as the unpatched model and as the kernel passes it replaces (same seed,
deep copies), in fp32 and under bf16 autocast; blocks it cannot run fall back, and say why. Without a
GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import copy  # noqa: E402

import pytest  # noqa: E402

from workbench.optimize.passes import PassUnavailable, apply_pass  # noqa: E402
from workbench.optimize.passes import fused_block  # noqa: E402
from workbench.optimize.passes.block_forward import SwinBlockFunction  # noqa: E402
from workbench.optimize.passes.block_plan import BlockPlan, block_plans  # noqa: E402
from pass_helpers import model_pair, pass_ctx, rel_err, tiny_batch, train_step  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
N_BLOCKS = 4
KERNEL_PASSES = (("fused_layernorm", {"impl": "triton", "fuse_residual": True}), ("fused_window", None),
                 ("fused_attention", None), ("fused_linear", None))


def _step(model, autocast=None, train=True):
    model.train(train)
    x, target = tiny_batch(model, 3, DEVICE)
    return train_step(model, x, target, autocast)


def _assert_close_steps(ref, fused, tol, autocast=None, train=True):
    ref_logits, ref_grads = _step(ref, autocast, train)
    logits, grads = _step(fused, autocast, train)
    assert rel_err(logits, ref_logits) < tol
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        err = rel_err(grads[name], g)
        assert err < tol, f"{name}: relative gradient error {err:.2e}"


def test_matches_unpatched_fp32_train_and_eval():
    ref, model = model_pair(DEVICE, drop_path_rate=0.0)
    model, result = fused_block.apply(model, pass_ctx(DEVICE))
    assert result.details["blocks_patched"] == N_BLOCKS and not result.details["blocks_skipped"]
    _assert_close_steps(ref, model, 1e-4)
    _assert_close_steps(ref, model, 1e-4, train=False)


def test_under_bf16_autocast_as_close_to_fp32_as_timm():
    """Two bf16 computations of a gradient that sums many cancelling terms (a LayerNorm bias) can differ
    by 10% from each other; held to the fp32 truth, the fused model must be as close as timm's own bf16
    path (plus a little), for the logits and every gradient."""
    ref, model = model_pair(DEVICE, drop_path_rate=0.0)
    model, _ = fused_block.apply(model, pass_ctx(DEVICE, "bf16"))
    truth_logits, truth = _step(ref)
    plain_logits, plain = _step(ref, torch.bfloat16)
    logits, fused = _step(model, torch.bfloat16)
    assert rel_err(logits, truth_logits) <= 1.5 * rel_err(plain_logits, truth_logits) + 1e-2
    for name, g in truth.items():
        pe, fe = rel_err(plain[name], g), rel_err(fused[name], g)
        assert fe <= 1.5 * pe + 2e-2, (name, fe, pe)


@pytest.mark.parametrize("autocast,tol", [(None, 1e-4), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_replaces_the_kernel_passes_it_sits_on(autocast, tol):
    """On top of the dense stack (Triton LayerNorm with add+norm2, fused window, fused attention, fused
    Linear), the Function computes what those passes computed, one block at a time."""
    ref, _ = model_pair(DEVICE, drop_path_rate=0.0)
    for name, params in KERNEL_PASSES:
        ref, result = apply_pass(name, ref, pass_ctx(DEVICE), params)
        assert result.available, f"{name}: {result.changed}"
    model = copy.deepcopy(ref)
    model, result = fused_block.apply(model, pass_ctx(DEVICE))
    assert result.details["blocks_patched"] == N_BLOCKS
    _assert_close_steps(ref, model, tol, autocast=autocast)


def test_function_runs_once_per_block_and_falls_back_when_dropout_is_active(monkeypatch):
    calls = []
    real = SwinBlockFunction.apply
    monkeypatch.setattr(SwinBlockFunction, "apply", lambda *a: calls.append(a[-2:]) or real(*a))
    _, model = model_pair(DEVICE, drop_path_rate=0.1)
    model, _ = fused_block.apply(model, pass_ctx(DEVICE))
    _step(model, train=False)                 # DropPath is the identity in eval: no factors
    assert len(calls) == N_BLOCKS and all(k == (None, None) for k in calls)
    # In training timm's stochastic depth runs inside the Function: the first block's rate is 0 (timm
    # spaces the rates linearly from 0), so it takes no factors, the others take both
    _step(model, train=True)
    assert len(calls) == 2 * N_BLOCKS
    assert calls[N_BLOCKS] == (None, None) and all(k1 is not None and k2 is not None for k1, k2 in calls[N_BLOCKS + 1:])
    # an active dropout elsewhere in the block: timm's forward
    model.layers[0].blocks[1].attn.proj_drop.p = 0.1
    _step(model, train=True)
    assert len(calls) == 3 * N_BLOCKS - 1


@pytest.mark.parametrize("autocast,tol", [(None, 1e-4), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_stochastic_depth_drops_the_samples_timm_drops(autocast, tol):
    """drop_path_rate 0.5 on a batch of 4: the same seed gives the same dropped samples and the same logits
    and gradients as the unpatched model (fp32) and as the kernel passes under it (bf16: the same branch
    products in the compute dtype)."""
    plain, _ = model_pair(DEVICE, drop_path_rate=0.5)
    ref = plain
    if autocast is not None:
        for name, params in KERNEL_PASSES:
            ref, result = apply_pass(name, ref, pass_ctx(DEVICE), params)
            assert result.available, f"{name}: {result.changed}"
    model, result = fused_block.apply(copy.deepcopy(ref), pass_ctx(DEVICE))
    assert result.details["blocks_patched"] == N_BLOCKS
    x, target = tiny_batch(ref, 4, DEVICE)
    for seed in (3,):
        torch.manual_seed(seed)
        ref_logits, ref_grads = train_step(ref.train(), x, target, autocast)
        torch.manual_seed(seed)
        logits, grads = train_step(model.train(), x, target, autocast)
        assert rel_err(logits, ref_logits) < tol
        for name, g in ref_grads.items():
            assert rel_err(grads[name], g) < tol, name
    torch.manual_seed(5)
    other, _ = train_step(model, x, target, autocast)
    assert rel_err(other, logits) > 10 * tol     # another draw, other samples dropped


def test_non_plain_blocks_are_left_alone_and_counted():
    _, model = model_pair(DEVICE, drop_path_rate=0.0)
    model.layers[0].blocks[0].mlp.act = torch.nn.ReLU()
    model, result = fused_block.apply(model, pass_ctx(DEVICE))
    assert result.details["blocks_patched"] == N_BLOCKS - 1
    assert result.details["blocks_skipped"] == {"MLP activation is not exact GELU": 1}
    assert "left as they were: 1 (MLP activation is not exact GELU)" in result.changed
    _, model = model_pair(DEVICE, drop_path_rate=0.0)
    for blk in (b for layer in model.layers for b in layer.blocks):
        blk.mlp.act = torch.nn.ReLU()
    with pytest.raises(PassUnavailable, match="plain configuration"):
        fused_block.apply(model, pass_ctx(DEVICE))


def test_applying_twice_patches_once():
    _, model = model_pair(DEVICE, drop_path_rate=0.0)
    model, _ = fused_block.apply(model, pass_ctx(DEVICE))
    model, again = fused_block.apply(model, pass_ctx(DEVICE))
    assert again.details["blocks_patched"] == 0
    assert block_plans(model).plan("layers.0.blocks.0") == BlockPlan(whole_block=True)


def test_padded_windows_and_dynamic_mask():
    """A feature map that is not a multiple of the window (15x15 patches, window 7: padded to 21 inside
    the kernels) and timm's dynamic_mask (the mask built from the padded shape at every call)."""
    from timm.models.swin_transformer import SwinTransformer

    from workbench.models import TINY_KWARGS

    torch.manual_seed(0)
    ref = SwinTransformer(**dict(TINY_KWARGS, img_size=60), drop_path_rate=0.0).to(DEVICE)
    for blk in ref.modules():
        if hasattr(blk, "dynamic_mask"):
            blk.dynamic_mask = True
    model = copy.deepcopy(ref)
    model, result = fused_block.apply(model, pass_ctx(DEVICE))
    assert result.details["blocks_patched"] == N_BLOCKS
    assert tuple(model.layers[0].blocks[1].shift_size) != (0, 0)   # a shifted, padded block is covered
    _assert_close_steps(ref, model, 1e-4)


@pytest.mark.parametrize("kw", [dict(mlp_ratio=2.5), dict(head_dim=32), dict(embed_dim=20)],
                         ids=["mlp-ratio-2.5", "head-dim-32", "head-width-10"])
def test_blocks_of_other_widths_compute_timms_function(kw):
    """An MLP wider or narrower than 4C, heads of a head_dim other than C // heads, and heads the kernel
    does not take (width 10: timm's SDPA path, said per block) all give timm's logits and gradients."""
    import copy

    from timm.models.swin_transformer import SwinTransformer

    from pass_helpers import assert_timms_function
    from workbench.api import patch_swin

    torch.manual_seed(0)
    model = SwinTransformer(img_size=32, patch_size=4, window_size=4, depths=(1, 1), num_classes=10,
                            drop_path_rate=0.0, **{"embed_dim": 32, "num_heads": (2, 4), **kw}).to(DEVICE)
    plain = copy.deepcopy(model)
    patch = patch_swin(model, "fmha" if kw.get("embed_dim") == 20 else "block", dtype="fp32")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert_timms_function(model, plain, x)
    if kw.get("embed_dim") == 20:
        fused = next(r for r in patch.applied if r.name == "fused_attention")
        assert fused.details["skipped_head_width"] == 2


def test_window_12_whole_blocks_take_the_gathered_bias_and_compute_timms_function():
    """At 144 tokens a window bias auto (unmeasured) gathers the bias: the whole-block Function runs that
    form too, with timm's logits and gradients (the table's gradient among them)."""
    import copy

    from timm.models.swin_transformer import SwinTransformer

    from pass_helpers import assert_timms_function
    from workbench.api import patch_swin
    from workbench.optimize.passes.block_plan import block_plans

    torch.manual_seed(0)
    model = SwinTransformer(img_size=48, patch_size=4, window_size=12, embed_dim=32, depths=(2,), num_heads=(2,),
                            num_classes=10, drop_path_rate=0.0).to(DEVICE)
    plain = copy.deepcopy(model)
    patch = patch_swin(model, "block", dtype="fp32")
    attention = next(r for r in patch.applied if r.name == "fused_attention")
    assert attention.details["gather_modules"] == 2 and attention.details["table_modules"] == 0
    assert next(r for r in patch.applied if r.name == "fused_block").details["blocks_patched"] == 2
    assert all("bias gather" in p.describe() for p in block_plans(model).plans.values())
    x = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert_timms_function(model, plain, x)
