"""timm's other SwinV2, swin_transformer_v2_cr (swinv2_cr_* models): its WindowMultiHeadAttention scores
windows like swin_transformer_v2's (cosine, per-head logit scale, a position bias from an MLP, the shift
mask), with the bias from meta_mlp over the N x N token pairs in order. fused_attention runs it on the
fused kernels (the table of an identity index), sdpa_attention on PyTorch's SDPA, fused_linear swaps its
Linears, fused_window and fused_layernorm bind its blocks as they bind swin_transformer_v2's: each the same
logits and gradients as timm in fp32, shifted and unshifted windows, in training and inference. The passes that bind timm's other blocks stand aside, saying why in one line, so the ladder's
stages run on it."""
import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from workbench.optimize.passes import apply_pass  # noqa: E402
from pass_helpers import pass_ctx, rel_err, train_step  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def tiny_cr(img: int = 32, window: int = 4, seed: int = 0, meta_dropout: float = 0.0):
    """A swin_transformer_v2_cr model of embed_dim 32 (head width 16), two stages (the first shifted, the
    second one window), with the norm weights and logit scales drawn away from timm's init (its zero
    post-norm weights hide the attention branch from the logits). meta_dropout: meta_mlp's dropout (timm's
    is 0.125, active in training)."""
    from timm.models.swin_transformer_v2_cr import SwinTransformerV2Cr

    torch.manual_seed(seed)
    try:
        model = SwinTransformerV2Cr(img_size=(img, img), window_size=window, embed_dim=32, depths=(2, 2),
                                    num_heads=(2, 4), num_classes=10)
    except RuntimeError as e:  # timm 1.0.29 builds a shifted block's mask from the unpadded map
        import timm

        pytest.skip(f"timm {timm.__version__} cannot build swinv2_cr at {img} px in windows of {window}: {e}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.2)
            elif name.endswith("logit_scale"):
                p.uniform_(1.6, 2.7)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = meta_dropout if m.p == 0.125 else m.p
    return model.to(DEVICE)


def attentions(model):
    return [m for m in model.modules() if type(m).__name__ == "WindowMultiHeadAttention"]


def batch(img: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, 3, img, img), generator=g).to(DEVICE), torch.randint(0, 10, (2,), generator=g).to(DEVICE)


def assert_same_step(plain, patched, images, labels):
    """Logits and every gradient within 2e-5 (relative) of timm's, except meta_mlp's last bias: it adds
    one constant per head to every score of a row, which the softmax cancels, so its gradient is zero but
    for rounding; there both are held to that rounding against the weight's gradient."""
    logits_ref, grads_ref = train_step(plain, images, labels)
    logits, grads = train_step(patched, images, labels)
    assert rel_err(logits, logits_ref) < 1e-5
    assert grads.keys() == grads_ref.keys()
    for name, g_ref in grads_ref.items():
        if name.endswith("meta_mlp.fc2.bias"):
            scale = grads_ref[name[:-len("bias")] + "weight"].norm()
            assert grads[name].norm() < 1e-5 * scale and g_ref.norm() < 1e-5 * scale, name
            continue
        assert rel_err(grads[name], g_ref) < 2e-5, f"{name}: relative gradient error {rel_err(grads[name], g_ref):.2e}"


@pytest.mark.parametrize("img, window", [(32, 4), (48, 6), (72, 9)], ids=["16tokens", "36tokens", "81tokens-tiled"])
def test_fused_attention_runs_cr_attention_as_timm_does(img, window):
    from workbench.optimize.passes.fused_attention import v2_attention_forward

    plain = tiny_cr(img, window)
    blocks = [m for m in plain.modules() if type(m).__name__ == "SwinTransformerV2CrBlock"]
    assert any(b.attn_mask is not None for b in blocks) and any(b.attn_mask is None for b in blocks)
    patched, result = apply_pass("fused_attention", copy.deepcopy(plain), pass_ctx(DEVICE))
    assert result.available and result.details["swinv2_patched_modules"] == 4, result.changed
    assert all(getattr(m.forward, "__func__", None) is v2_attention_forward for m in attentions(patched))
    assert patched.state_dict().keys() == plain.state_dict().keys()
    for seed in (1, 2):
        assert_same_step(plain, patched, *batch(img, seed))
    x, _ = batch(img, 3)
    with torch.no_grad():      # inference: q and k normalized inside the attention kernel
        assert rel_err(patched.eval()(x), plain.eval()(x)) < 1e-5


def test_sdpa_attention_runs_cr_attention_as_timm_does():
    from workbench.optimize.passes.sdpa_attention import v2_sdpa_forward

    plain = tiny_cr(48, 6)
    patched, result = apply_pass("sdpa_attention", copy.deepcopy(plain), pass_ctx(DEVICE))
    assert result.available and result.details["swinv2_modules"] == 4, result.changed
    assert all(vars(m)["forward"].__func__ is v2_sdpa_forward for m in attentions(patched))
    assert_same_step(plain, patched, *batch(48, 1))


@pytest.mark.parametrize("name", ["fused_attention", "sdpa_attention"])
def test_meta_mlp_dropout_draws_what_timm_draws(name):
    """timm's meta_mlp drops 12.5% of its hidden units in training: the passes run it as timm does, with the
    same draws for the same seed, and never keep its output across forwards while it is random."""
    plain = tiny_cr(meta_dropout=0.125).train()
    patched, _ = apply_pass(name, copy.deepcopy(plain), pass_ctx(DEVICE))
    x, _ = batch(32, 4)
    torch.manual_seed(7)
    want = plain(x)
    torch.manual_seed(7)
    assert rel_err(patched(x), want) < 1e-5
    with torch.no_grad():      # training mode without autograd: a fresh bias each forward, as timm's
        torch.manual_seed(8)
        first = patched(x)
        second = patched(x)
        torch.manual_seed(8)
        assert rel_err(first, plain(x)) < 1e-5
    assert not torch.equal(first, second)


def test_fused_linear_swaps_cr_linears():
    from workbench.kernels.linear import BiasGradLinear

    plain = tiny_cr()
    patched, result = apply_pass("fused_linear", copy.deepcopy(plain), pass_ctx(DEVICE))
    assert result.details["linears"] == 16 and result.details["mlps_fused"] == 4 and result.details["swinv2"]
    assert result.changed.startswith("16 SwinV2 Linear (qkv, proj, fc1, fc2)") and "\n" not in result.changed
    assert all(type(a.qkv) is BiasGradLinear and type(a.proj) is BiasGradLinear for a in attentions(patched))
    assert_same_step(plain, patched, *batch(32, 5))


@pytest.mark.parametrize("img, window", [(32, 4), (40, 4)], ids=["fitting", "padded"])
def test_window_kernels_and_post_norm_adds_run_cr_blocks_as_timm_does(img, window):
    """fused_window binds each block's _shifted_window_attn (roll_partition, merge_roll), fused_layernorm
    its forward (the post-norm adds in the LayerNorm's pass, the windows merged in it too): alone, together
    and with fused_attention; 40 px leaves a 10 x 10 map, padded inside the windows."""
    from workbench.optimize.passes.block_forward import v2_block_forward, v2_window_attn_bound

    plain = tiny_cr(img, window)
    stacks = [[("fused_window", None)], [("fused_layernorm", {"impl": "triton"})],
              [("fused_layernorm", {"impl": "triton"}), ("fused_window", None), ("fused_attention", None)]]
    for stack in stacks:
        patched = copy.deepcopy(plain)
        for name, params in stack:
            patched, result = apply_pass(name, patched, pass_ctx(DEVICE), params)
            assert result.available and "\n" not in result.changed, result.changed
        blocks = [m for m in patched.modules() if type(m).__name__ == "SwinTransformerV2CrBlock"]
        if any(n == "fused_window" for n, _ in stack):
            assert all(v2_window_attn_bound(b) for b in blocks)
        if any(n == "fused_layernorm" for n, _ in stack):
            assert all(vars(b)["forward"].__func__ is v2_block_forward for b in blocks)
        assert_same_step(plain, patched, *batch(img, 2))
        x, _ = batch(img, 3)
        with torch.no_grad():
            assert rel_err(copy.deepcopy(patched).eval()(x), copy.deepcopy(plain).eval()(x)) < 1e-5


@pytest.mark.parametrize("name, why", [
    ("fused_block", "not applied: SwinV2 blocks (post-norm, cosine attention, position bias from an MLP)"),
])
def test_fused_block_stands_aside_in_one_line(name, why):
    model = tiny_cr()
    out, result = apply_pass(name, model, pass_ctx(DEVICE))
    assert out is model and result.available and result.details == {"applied": False}
    assert result.changed.startswith(why) and "\n" not in result.changed
    assert not any("forward" in vars(m) or "_attn" in vars(m) for m in model.modules())


def test_the_fmha_and_dense_chains_run_on_cr():
    from workbench.api import optimize_swin

    for recipe in ("fmha", "dense"):
        swin = optimize_swin(tiny_cr(), recipe, device=DEVICE)
        results = {p.name: p for p in swin.passes}
        assert results["fused_attention"].details["swinv2_patched_modules"] == 4
        assert results["fused_window"].details["swinv2_patched_blocks"] == 4
        assert torch.isfinite(swin.train_step(*batch(32, 6)))


def test_patch_embed_runs_cr_s_patch_embedding_as_one_gemm():
    from workbench.optimize.passes.patch_embed import cr_patch_gemm_forward

    plain = tiny_cr()
    patched, result = apply_pass("patch_embed", copy.deepcopy(plain), pass_ctx(DEVICE))
    assert result.details["patched"] == 1 and vars(patched.patch_embed)["forward"].__func__ is cr_patch_gemm_forward
    assert_same_step(plain, patched, *batch(32, 7))
    with pytest.raises(AssertionError, match="doesn't match model"):
        patched.patch_embed(torch.randn(1, 3, 36, 32, device=DEVICE))


def test_the_route_reads_a_cr_block_shape():
    from workbench.optimize.passes._route import block_shape

    shapes = {block_shape(b) for b in tiny_cr().modules() if type(b).__name__ == "SwinTransformerV2CrBlock"}
    assert {(s.tokens, s.heads, s.head_dim, s.windows, s.masked) for s in shapes} == {(16, 2, 16, 4, True),
                                                                                     (16, 2, 16, 4, False),
                                                                                     (16, 4, 16, 1, False)}


# aot_eager on the CPU (the kernels are opaque custom ops there); on a GPU also Inductor, which traces into them.
@pytest.mark.parametrize("backend", ["aot_eager"] + (["inductor"] if DEVICE.type == "cuda" else []))
def test_the_compiled_fused_stack_runs_cr_as_timm_does(backend):
    torch._dynamo.reset()
    plain = tiny_cr()
    patched = copy.deepcopy(plain)
    for name, params in (("fused_layernorm", {"impl": "triton"}), ("fused_window", None), ("fused_linear", None),
                         ("fused_attention", None)):
        patched, _ = apply_pass(name, patched, pass_ctx(DEVICE), params)
    assert_same_step(plain, torch.compile(patched, backend=backend), *batch(32, 1))


def test_profiles_and_gates_see_cr_stages():
    """The profile's ranges name -CR's stages and blocks (its `stages`, where timm's other Swins have
    `layers`), and the gate's activation dtypes list each stage."""
    from workbench.optimize.gate import activation_dtypes
    from workbench.optimize.ranges import RangeMarker, annotate_modules
    from workbench.optimize.workload import Workload, WorkloadConfig

    model = tiny_cr()
    marker = RangeMarker("torch")
    handles = annotate_modules(model, marker)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(batch(32, 0)[0])
    names = {e.name for e in prof.events()}
    assert {"patch_embed", "stage0.block1", "stage1.downsample", "attention", "mlp", "head"} <= names
    for h in handles:
        h.remove()
    workload = Workload(WorkloadConfig(model="swinv2_cr_tiny_224", batch=2, device=str(DEVICE)), model,
                        pass_ctx(DEVICE), *batch(32, 0))
    assert {"patch_embed", "stages.0", "stages.1", "head"} <= set(activation_dtypes(workload))

