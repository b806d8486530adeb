"""The fused_attention pass on a tiny SwinV2: the same logits and the same gradient for every parameter
(logit_scale, cpb_mlp, q/v biases included) as the unpatched timm model, in fp32, with shifted and
unshifted windows; modules the kernel cannot run keep timm's path with their reason; the passes that
take only Swin v1 blocks (fused_block) stand aside with one line; fused_linear binds its SwinV2 form."""
import copy
import os
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from workbench.optimize.passes import PassUnavailable, apply_pass, get_pass  # noqa: E402
from workbench.optimize.passes.fused_attention import v2_attention_forward  # noqa: E402
from pass_helpers import assert_step_close, pass_ctx, rel_err, train_step  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
V2_REASON = "not applied: SwinV2 blocks (post-norm, cosine attention, position bias from an MLP): "


def tiny_v2(img: int = 32, window: int = 4, depths=(2, 2), heads=(2, 4), seed: int = 0, log_scales=(1.6, 2.7)):
    """A SwinV2 of embed_dim 32 (head width 16), no stochastic depth, with the norm weights, q/v biases
    and logit scales drawn away from timm's init (zero res-post-norm weights would hide the attention
    branch from the logits and leave its gradients near zero). log_scales: the range of logit_scale, by
    default around timm's init log(10) (scales 5 to 15); the logit scale's gradient is a sum that cancels,
    whose fp32 error grows with the scale (test_near_the_logit_scale_clamp_...)."""
    from timm.models.swin_transformer_v2 import SwinTransformerV2

    torch.manual_seed(seed)
    model = SwinTransformerV2(img_size=img, patch_size=4, window_size=window, embed_dim=32, depths=depths,
                              num_heads=heads, num_classes=10, drop_path_rate=0.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.2)
            elif name.endswith(("q_bias", "v_bias")):
                p.normal_(0.0, 0.1)
            elif name.endswith("logit_scale"):
                p.uniform_(*log_scales)
    return model.to(DEVICE)


def grad_tol(name: str) -> float:
    """Relative gradient error allowed against timm in fp32. Seen: at most 4e-6, and 1.2e-5 for a logit
    scale's gradient (a sum that cancels)."""
    return 6e-5 if name.endswith("logit_scale") else 2e-5


def v2_attentions(model):
    from timm.models.swin_transformer_v2 import WindowAttention

    return [m for m in model.modules() if isinstance(m, WindowAttention)]


def batch(img: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, 3, img, img), generator=g).to(DEVICE), torch.randint(0, 10, (2,), generator=g).to(DEVICE)


@pytest.mark.parametrize("img, window, separate", [(32, 4, False), (48, 6, True), (72, 9, False)],
                         ids=["window4-16tokens", "window6-36tokens-qkv_bias_separate", "window9-81tokens"])
def test_fused_swinv2_attention_matches_timm_in_fp32(img, window, separate):
    """Stage 1 shifts its windows (a mask), stage 2 holds one window (no shift); 36 and 81 tokens are no
    power of two, 81 runs the key-tiled kernel."""
    plain = tiny_v2(img, window)
    blocks = [m for m in plain.modules() if type(m).__name__ == "SwinTransformerV2Block"]
    assert any(b.attn_mask is not None for b in blocks) and any(b.attn_mask is None for b in blocks)
    if separate:
        for attn in v2_attentions(plain)[::2]:
            attn.qkv_bias_separate = True
    patched = copy.deepcopy(plain)
    patched, result = apply_pass("fused_attention", patched, pass_ctx(DEVICE))
    assert result.available and result.details["swinv2_patched_modules"] == 4, result.changed
    assert result.details["swinv2_left_on_timm"] == {}
    assert all(getattr(m.forward, "__func__", None) is v2_attention_forward for m in v2_attentions(patched))
    assert patched.state_dict().keys() == plain.state_dict().keys()

    names = [n for n, _ in patched.named_parameters()]
    assert any(n.endswith("logit_scale") for n in names) and any("cpb_mlp" in n for n in names)
    for seed in (1, 2):  # fresh inputs each step
        assert_step_close(plain, patched, *batch(img, seed), grad_tol=grad_tol)



def test_near_the_logit_scale_clamp_the_fused_gradients_stay_near_fp64():
    """Scales of 55 to 100 (timm clamps at 100): softmax rows near one-hot, and fp32 gradients of the logit
    scale a few times 1e-4 off the fp64 truth on timm's path and on the kernel's (summed in another order,
    base-2 exponentials). Both are held to the fp64 truth."""
    plain = tiny_v2(log_scales=(4.0, 4.6))
    patched, _ = apply_pass("fused_attention", copy.deepcopy(plain), pass_ctx(DEVICE))
    truth = copy.deepcopy(plain).double()
    images, labels = batch(32, 1)
    truth_logits, truth_grads = train_step(truth, images.double(), labels)
    for model in (plain, patched):
        logits, grads = train_step(model, images, labels)
        assert rel_err(logits, truth_logits) < 1e-5
        for name, g in truth_grads.items():
            assert rel_err(grads[name], g) < 2e-3, name


def test_a_deep_copy_and_a_second_run_keep_the_fused_forward():
    model, result = apply_pass("fused_attention", tiny_v2(), pass_ctx(DEVICE))
    copied = copy.deepcopy(model)
    assert all(m.forward.__self__ is m for m in v2_attentions(copied))
    again, result = apply_pass("fused_attention", copied, pass_ctx(DEVICE))
    assert result.details["swinv2_patched_modules"] == 4 and result.details["swinv2_left_on_timm"] == {}


def test_attention_dropout_and_large_windows_run_pytorch_s_sdpa_with_their_reason():
    """What the kernel cannot take runs sdpa_attention's SwinV2 forward (what the PyTorch-alone peers
    run), not timm's eager attention: the same logits and gradients as timm, the reason in the result."""
    from workbench.optimize.passes.sdpa_attention import v2_sdpa_forward

    model = tiny_v2()
    first = v2_attentions(model)[0]
    first.attn_drop.p = 0.1
    model, result = apply_pass("fused_attention", model, pass_ctx(DEVICE))
    assert result.details["swinv2_patched_modules"] == 3 and result.details["swinv2_left_on_timm"] == {}
    assert result.details["swinv2_sdpa_beyond_kernel"] == {"attn_drop > 0: the kernel has no dropout": 1}
    assert "1 on PyTorch's SDPA, beyond the kernel (attn_drop > 0: the kernel has no dropout)" in result.changed
    assert vars(first)["forward"].__func__ is v2_sdpa_forward

    plain = tiny_v2()
    patched, result = apply_pass("fused_attention", copy.deepcopy(plain), pass_ctx(DEVICE), {"max_tokens": 15})
    assert result.details["swinv2_patched_modules"] == 0
    assert result.details["swinv2_sdpa_beyond_kernel"] == {"16-token windows, above max_tokens 15": 4}
    assert all(vars(m)["forward"].__func__ is v2_sdpa_forward for m in v2_attentions(patched))
    assert_step_close(plain, patched, *batch(32, 8), grad_tol=grad_tol)

    # window 24 (576 tokens, swinv2_*_window24 models): above what the kernels take. The pass only binds.
    big = tiny_v2(img=96, window=24, depths=(1,), heads=(2,))
    big, result = apply_pass("fused_attention", big, pass_ctx(DEVICE))
    assert result.details["swinv2_sdpa_beyond_kernel"] == {"576-token windows, above max_tokens 256": 1}
    assert result.details["swinv2_left_on_timm"] == {} and "\n" not in result.changed


@pytest.mark.parametrize("name, why", [
    ("fused_block", "the whole-block Function computes Swin v1's pre-norm block"),
])
def test_v1_block_passes_stand_aside_on_swinv2(name, why):
    model = tiny_v2()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    kinds = [type(m) for m in model.modules()]
    out, result = apply_pass(name, model, pass_ctx(DEVICE))
    assert out is model and result.available and result.details == {"applied": False}
    assert result.changed.startswith(V2_REASON + why) and "\n" not in result.changed
    assert [type(m) for m in model.modules()] == kinds
    assert not any("forward" in vars(m) for m in model.modules())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", ["fused_window", "fused_block", "fused_linear", "fused_attention"])
def test_a_model_without_swin_blocks_is_still_unavailable(name):
    with pytest.raises(PassUnavailable):
        get_pass(name).apply(torch.nn.Sequential(torch.nn.Linear(4, 4)), pass_ctx(DEVICE))


def test_fused_linear_on_swinv2_matches_timm_in_fp32():
    """proj, fc1 and fc2 become BiasGradLinear and each MLP runs fc1 + GELU as one Function: the same
    logits and gradients as timm; without autograd the same logits too (on a GPU in a half dtype the
    GELU moves into the GEMM's epilogue, tested in test_pass_fused_linear)."""
    from workbench.kernels.linear import BiasGradLinear
    from workbench.optimize.passes.fused_linear import v2_mlp_bound

    plain = tiny_v2()
    patched, result = apply_pass("fused_linear", copy.deepcopy(plain), pass_ctx(DEVICE))
    assert result.details["linears"] == 12 and result.details["mlps_fused"] == 4 and result.details["swinv2"]
    assert result.changed.startswith("12 SwinV2 Linear (proj, fc1, fc2)") and "\n" not in result.changed
    blocks = [m for m in patched.modules() if type(m).__name__ == "SwinTransformerV2Block"]
    assert all(type(b.mlp.fc1) is BiasGradLinear and type(b.attn.proj) is BiasGradLinear for b in blocks)
    assert all(type(b.attn.qkv) is torch.nn.Linear for b in blocks)
    assert all(v2_mlp_bound(b.mlp) for b in blocks)
    assert patched.state_dict().keys() == plain.state_dict().keys()
    for seed in (1, 2):
        assert_step_close(plain, patched, *batch(32, seed))
    x, _ = batch(32, 3)
    with torch.no_grad():
        torch.testing.assert_close(patched.eval()(x), plain.eval()(x), rtol=1e-5, atol=1e-5)


def test_fused_linear_runs_a_swinv2_mlp_measured_faster_as_one_kernel(monkeypatch):
    """In GPU inference (forced here: the kernel runs in the interpreter) SwinV2's MLPs are timed and bound
    as one kernel where faster, like v1's: stage 1's here (5 us against 10), not stage 2's; the kernel's
    tanh GELU keeps the logits within a few bf16 steps of the two GEMMs' forward (exact GELU on the CPU)."""
    from workbench.kernels import mlp as mlp_kernels
    from workbench.optimize.passes import _route, fused_linear
    from workbench.optimize.passes.block_forward import mlp_forward_fused, mlp_forward_whole

    monkeypatch.setattr(fused_linear, "_inference_epilogue", lambda ctx, n, dtypes: True)
    times = iter([10.0, 5.0, 10.0, 10.0])     # per MLP shape: the two GEMMs, then the kernel
    monkeypatch.setattr(_route, "median_us", lambda call: call() is None or next(times))
    plain = tiny_v2().eval()
    ctx = pass_ctx(DEVICE, "bf16")
    ctx.training, ctx.batch = False, 2
    patched, result = apply_pass("fused_linear", copy.deepcopy(plain), ctx)
    assert result.details["mlp_kernel_blocks"] == 2 and "inference: 2 MLP as one kernel" in result.changed
    blocks = [m for m in patched.modules() if type(m).__name__ == "SwinTransformerV2Block"]
    assert [vars(b.mlp)["forward"].__func__ for b in blocks] == [mlp_forward_whole] * 2 + [mlp_forward_fused] * 2
    calls = []
    real = mlp_kernels.fused_mlp
    monkeypatch.setattr(mlp_kernels, "fused_mlp", lambda *a: calls.append(tuple(a[0].shape)) or real(*a))
    x, _ = batch(32, 3)
    with torch.inference_mode(), torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = patched(x)
        for b in blocks[:2]:
            b.mlp.forward = types.MethodType(mlp_forward_fused, b.mlp)
        two_gemms = patched(x)
    # logits of about 0.1 in bf16: a step of the format is 0.4-0.8% of one; the tanh GELU moves some a step
    assert calls == [(128, 32), (128, 32)] and rel_err(out.double(), two_gemms.double()) < 3e-2


def test_fused_layernorm_keeps_the_post_norm_math():
    """Each SwinV2 block's x + norm(branch) runs as one post_add_layer_norm: the same step as timm."""
    from workbench.optimize.passes.block_forward import v2_block_forward

    plain = tiny_v2()
    patched, result = apply_pass("fused_layernorm", copy.deepcopy(plain), pass_ctx(DEVICE), {"impl": "triton"})
    assert result.details["replaced"] == 11 and result.details["merging_norms_into_linear"] == 0
    assert result.details["swinv2_post_norm_blocks"] == 4 and result.details["swinv2_blocks_left"] == 0
    assert "4 SwinV2 blocks' x + norm(branch) -> post_add_layer_norm" in result.changed
    blocks = [m for m in patched.modules() if type(m).__name__ == "SwinTransformerV2Block"]
    assert all(getattr(vars(b).get("forward"), "__func__", None) is v2_block_forward for b in blocks)
    assert_step_close(plain, patched, *batch(32, 3))
    _, no_fuse = apply_pass("fused_layernorm", copy.deepcopy(plain), pass_ctx(DEVICE),
                            {"impl": "triton", "fuse_residual": False})
    assert "swinv2_post_norm_blocks" not in no_fuse.details


def test_post_norm_adds_with_stochastic_depth_stay_timm_s_in_training(monkeypatch):
    """An active drop path sits between the norm and the add: in training that add runs as timm's (the
    same step, same drop-path draws); in eval the fused add runs."""
    import importlib

    ln = importlib.import_module("workbench.kernels.layer_norm")
    torch.manual_seed(0)
    plain = tiny_v2()
    for blk in (m for m in plain.modules() if type(m).__name__ == "SwinTransformerV2Block"):
        from timm.layers import DropPath

        blk.drop_path1, blk.drop_path2 = DropPath(0.3), DropPath(0.3)
    patched, _ = apply_pass("fused_layernorm", copy.deepcopy(plain), pass_ctx(DEVICE), {"impl": "triton"})
    calls = []
    real = ln.post_add_layer_norm
    monkeypatch.setattr(ln, "post_add_layer_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, target = batch(32, 5)
    torch.manual_seed(7)
    ref = torch.nn.functional.cross_entropy(plain.train()(x), target)
    torch.manual_seed(7)
    got = torch.nn.functional.cross_entropy(patched.train()(x), target)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert calls == []
    with torch.no_grad():
        torch.testing.assert_close(patched.eval()(x), plain.eval()(x), rtol=1e-5, atol=1e-5)
    assert len(calls) == 8


def test_the_fmha_chain_runs_on_swinv2():
    from workbench.api import optimize_swin

    swin = optimize_swin(tiny_v2(), "fmha", device=DEVICE, allow_unavailable=True)
    results = {p.name: p for p in swin.passes}
    assert results["fused_attention"].available and results["fused_attention"].details["swinv2_patched_modules"] == 4
    assert results["fused_window"].details["swinv2_patched_blocks"] == 4
    assert not [n for n in swin.notes if "left out" in n]
    loss = swin.train_step(*batch(32, 4))
    assert torch.isfinite(loss)


# aot_eager on the CPU (the kernels are opaque custom ops there); on a GPU also Inductor, which traces into them.
# The post-norm adds (fused_layernorm), the window kernels (fused_window) and the fused MLP (fused_linear)
# compile with the attention.
@pytest.mark.parametrize("backend", ["aot_eager"] + (["inductor"] if DEVICE.type == "cuda" else []))
def test_compiled_fused_swinv2_matches_timm_in_fp32(backend):
    torch._dynamo.reset()
    plain = tiny_v2()
    patched, _ = apply_pass("fused_layernorm", copy.deepcopy(plain), pass_ctx(DEVICE), {"impl": "triton"})
    patched, _ = apply_pass("fused_window", patched, pass_ctx(DEVICE))
    patched, _ = apply_pass("fused_linear", patched, pass_ctx(DEVICE))
    patched, _ = apply_pass("fused_attention", patched, pass_ctx(DEVICE))
    compiled = torch.compile(patched, backend=backend)
    for seed in (1, 2):
        assert_step_close(plain, compiled, *batch(32, seed), grad_tol=grad_tol)


def test_inference_keeps_the_weight_terms_until_a_weight_changes(monkeypatch):
    """Without autograd, in a frozen model (inference), the qkv bias, logit scale and position bias are
    computed once per weights: the same logits as timm, cpb_mlp run once over two forwards, again after a
    load changes a weight. A model whose weights train computes them in every forward: a fused optimizer
    or a replayed graph steps its weights in place without a new version, as `.data` below does."""
    from workbench.optimize.passes import fused_attention

    plain = tiny_v2()
    patched, result = apply_pass("fused_attention", copy.deepcopy(plain), pass_ctx(DEVICE), {"route": "kernel"})
    assert result.available, result.changed
    plain.eval(), patched.eval()
    patched.requires_grad_(False)
    computed = []
    real = fused_attention.v2_terms
    monkeypatch.setattr(fused_attention, "v2_terms", lambda attn: computed.append(1) or real(attn))
    blocks = len(v2_attentions(patched))
    x = torch.randn(2, 3, 32, 32, device=DEVICE)
    with torch.inference_mode():
        want = plain(x)
        first, second = patched(x), patched(x)
    assert rel_err(first, want) < 1e-5 and torch.equal(first, second)
    assert len(computed) == blocks
    with torch.no_grad():
        v2_attentions(patched)[0].cpb_mlp[0].weight.add_(0.1)
        v2_attentions(plain)[0].cpb_mlp[0].weight.add_(0.1)
    with torch.inference_mode():
        assert rel_err(patched(x), plain(x)) < 1e-5
    assert len(computed) == blocks + 1                    # only the changed module recomputed
    # inside terms_in_every_call (a CUDA graph replayed while the weights change) nothing is kept
    with fused_attention.terms_in_every_call(), torch.inference_mode():
        patched(x), patched(x)
    assert len(computed) == 3 * blocks + 1
    # weights that train: every forward computes them, also after an update no version records
    patched.requires_grad_(True)
    with torch.no_grad():
        patched(x)
        v2_attentions(patched)[0].logit_scale.data.add_(0.3)
        v2_attentions(plain)[0].logit_scale.data.add_(0.3)
        assert rel_err(patched(x), plain(x)) < 1e-5
    assert len(computed) == 5 * blocks + 1
    patched(x).sum().backward()
    assert len(computed) == 6 * blocks + 1


def test_inference_normalizes_q_and_k_inside_the_attention_kernel(monkeypatch):
    """Without autograd the fused SwinV2 attention runs cosine_window_attention (no cosine_qk launches):
    the same logits as the training path's cosine_qk + attention kernel (bit for bit under the interpreter;
    on a GPU the two kernels' reductions may round apart in the last bit), and timm's."""
    import importlib

    cos = importlib.import_module("workbench.kernels.cosine")
    calls = []
    real = cos.cosine_qk
    monkeypatch.setattr(cos, "cosine_qk", lambda *a, **k: calls.append(1) or real(*a, **k))
    plain = tiny_v2().eval()
    patched, _ = apply_pass("fused_attention", copy.deepcopy(plain), pass_ctx(DEVICE))
    x, _ = batch(32, 6)
    with torch.no_grad():
        fast = patched(x)
    assert calls == []
    with_grad = patched(x)
    assert calls
    if DEVICE.type == "cpu":
        assert torch.equal(fast, with_grad.detach())
    else:
        torch.testing.assert_close(fast, with_grad.detach(), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(fast, plain(x), rtol=1e-5, atol=1e-5)
