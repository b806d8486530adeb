"""The fused_window pass on the tiny timm Swin: same logits and every parameter gradient as the
unpatched model (same seed, deep copies). Without a GPU the kernels run in Triton's interpreter
(TRITON_INTERPRET=1, set before triton is imported)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from workbench.models import TINY_KWARGS, input_size  # noqa: E402
from workbench.optimize.passes import PassUnavailable, apply_pass  # noqa: E402
from workbench.optimize.passes import fused_window  # noqa: E402
from workbench.optimize.passes.block_plan import block_plans  # noqa: E402
from pass_helpers import assert_same_as_the_cast_path, assert_same_step, model_pair, pass_ctx, tiny_batch  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BATCH = 2
N_BLOCKS = 4  # tiny Swin: depths (2, 2); stage 1 (14x14) has one shifted block, stage 2 (7x7 = one window) none
N_SHIFTED = 1


def _window_blocks(model):
    """The blocks whose plan runs the fused window kernels."""
    plans = block_plans(model)
    return [m for n, m in model.named_modules() if plans.plan(n).window]


def _assert_same_step(ref, fused, atol, rtol, autocast=None, train=False, rng_seed=None):
    ref.train(train)
    fused.train(train)
    x, target = tiny_batch(ref, BATCH, DEVICE)
    assert_same_step(ref, fused, x, target, atol, rtol, autocast, rng_seed)


def test_matches_unpatched_fp32():
    ref, model = model_pair(DEVICE)
    model, result = fused_window.apply(model, pass_ctx(DEVICE))
    assert result.available and result.name == "fused_window"
    assert result.details["blocks_patched"] == N_BLOCKS == result.details["blocks_total"]
    assert result.details["blocks_shifted"] == N_SHIFTED
    _assert_same_step(ref, model, atol=1e-5, rtol=1e-5)
    # applying twice changes nothing more
    _, again = fused_window.apply(model, pass_ctx(DEVICE))
    assert again.details["blocks_patched"] == 0 and again.details["blocks_already_fused_window"] == N_BLOCKS


def test_patched_forward_calls_attn_module():
    """fused_attention replaces blk.attn.forward; the patched block must go through blk.attn(...)."""
    _, model = model_pair(DEVICE)
    model, _ = fused_window.apply(model, pass_ctx(DEVICE))
    calls = []
    for blk in _window_blocks(model):
        blk.attn.register_forward_hook(lambda m, a, kw, out: calls.append(a[0].shape), with_kwargs=True)
    model.eval()
    with torch.no_grad():
        model(torch.randn(1, *input_size(model), device=DEVICE))
    assert len(calls) == N_BLOCKS


def test_matches_unpatched_drop_path_and_dynamic_mask_train(monkeypatch):
    """Stochastic depth (training, unfused add; the multiply in kernels.drop_path) and timm's dynamic_mask:
    same RNG draws, same result."""
    from timm.models.swin_transformer import SwinTransformer

    import workbench.kernels.drop_path as dp

    launches = []
    real = dp.scale_samples_host
    monkeypatch.setattr(dp, "scale_samples_host", lambda *a: (launches.append(a[0].shape), real(*a))[1])

    ref, model = model_pair(DEVICE, build=lambda: SwinTransformer(**TINY_KWARGS, drop_path_rate=0.3))
    for m in (ref, model):
        for blk in m.modules():
            if hasattr(blk, "dynamic_mask"):
                blk.dynamic_mask = True
    model, result = fused_window.apply(model, pass_ctx(DEVICE))
    assert result.details["blocks_dynamic_mask"] == N_BLOCKS
    assert result.details["blocks_with_drop_path"] >= 1
    _assert_same_step(ref, model, atol=1e-5, rtol=1e-5, train=True, rng_seed=3)
    assert launches   # the patched blocks' drop paths ran the kernel, forward and backward


def test_matches_unpatched_under_bf16_autocast():
    """Under autocast the fused norm emits fp32 like timm's LayerNorm; the add takes the bf16
    attention output into the fp32 residual. Loose tolerance: both run bf16 matmuls."""
    ref, model = model_pair(DEVICE)
    model, _ = fused_window.apply(model, pass_ctx(DEVICE, "bf16"))
    _assert_same_step(ref, model, atol=3e-2, rtol=3e-2, autocast=torch.bfloat16)


def test_composes_with_fused_layernorm_add_norm2(monkeypatch):
    """With fused_layernorm's add+norm2, each block's attention merge, residual add and norm2 run as one
    merge_add_norm (eager, no stochastic depth), and the step is timm's."""
    import workbench.kernels.window as win

    calls = []
    real = win.merge_add_norm
    monkeypatch.setattr(win, "merge_add_norm", lambda *a, **k: (calls.append(a[0].shape), real(*a, **k))[1])
    ref, model = model_pair(DEVICE, drop_path_rate=0.0)
    model, ln = apply_pass("fused_layernorm", model, pass_ctx(DEVICE), {"impl": "triton", "fuse_residual": True})
    assert ln.available, ln.changed   # the Triton LayerNorm runs wherever these tests run
    model, result = fused_window.apply(model, pass_ctx(DEVICE))
    assert result.details["blocks_patched"] == N_BLOCKS
    assert result.details["blocks_with_add_norm2"] == ln.details.get("fused_residual_blocks", 0) == N_BLOCKS
    assert "merge_add_norm" in result.changed
    _assert_same_step(ref, model, atol=1e-5, rtol=1e-5, train=True)
    assert len(calls) == N_BLOCKS


def test_add_norm2_blocks_with_stochastic_depth_scale_inside_merge_add_norm(monkeypatch):
    """drop_path1 active (training): every block still merges, multiplies by drop_path1's factors (drawn
    with timm's calls), adds and normalizes in one merge_add_norm; the blocks whose drop_path1 is an
    Identity (the first: timm's rates rise from 0) pass no factors. drop_path2 draws per sample although the
    MLP runs on token rows, and its factors travel with the deferred branch into the next block's
    add_norm_shift_partition. Same step with the same RNG draws."""
    import workbench.kernels.window as win

    keeps, deferred = [], []
    real = win.merge_add_norm
    monkeypatch.setattr(win, "merge_add_norm", lambda *a, **k: (keeps.append(k.get("keep")), real(*a, **k))[1])
    real_ansp = win.add_norm_shift_partition
    monkeypatch.setattr(win, "add_norm_shift_partition", lambda *a: (deferred.append(a[-1]), real_ansp(*a))[1])
    from timm.models.swin_transformer import SwinTransformer

    ref, model = model_pair(DEVICE, build=lambda: SwinTransformer(**TINY_KWARGS, drop_path_rate=0.3))
    apply_pass("fused_layernorm", model, pass_ctx(DEVICE), {"impl": "triton", "fuse_residual": True})
    fused_window.apply(model, pass_ctx(DEVICE))
    _assert_same_step(ref, model, atol=1e-5, rtol=1e-5, train=True, rng_seed=5)
    identity = sum(isinstance(b.drop_path1, torch.nn.Identity) for b in model.modules() if hasattr(b, "drop_path1"))
    assert 0 < identity < N_BLOCKS and len(keeps) == N_BLOCKS
    assert sum(k is None for k in keeps) == identity
    assert all(k.shape == (BATCH,) for k in keeps if k is not None)
    # a stage's first block hands its MLP branch and drop_path2's factors to the second block's norm
    # kernel, which multiplies and adds them (the first stage's first block draws none: rate 0)
    assert len(deferred) == 2 and deferred[0] is None and deferred[1].shape == (BATCH,)


def test_a_non_square_block_keeps_timms_forward_and_a_model_of_none_is_unavailable():
    _, model = model_pair(DEVICE)
    blocks = [m for m in model.modules() if hasattr(m, "shift_size")]
    blocks[0].window_size = (7, 4)
    model, result = apply_pass("fused_window", model, pass_ctx(DEVICE))
    assert result.available and result.details["blocks_non_square"] == 1
    assert result.details["blocks_patched"] == len(blocks) - 1
    _, model = model_pair(DEVICE)
    for blk in (m for m in model.modules() if hasattr(m, "shift_size")):
        blk.window_size = (7, 4)
    with pytest.raises(PassUnavailable):
        fused_window.apply(model, pass_ctx(DEVICE))


def test_windows_and_norm2_come_out_in_the_autocast_dtype_with_the_cast_path_s_bits(monkeypatch):
    """Under autocast the norms write the Linears' input dtype themselves (no cast kernels): the qkv and
    fc1 Linears receive bf16, and the logits equal, bit for bit, those of the same passes writing fp32
    and letting autocast cast, and so do the gradients as `assert_same_as_the_cast_path` holds them (on the
    H200 patch_embed.norm.weight's came out apart in the last bits: the norm backward's sums follow dy's dtype).
    No stochastic depth (it would drop other samples in the second run) and the weight and bias sums in
    their fixed-order mode (atomic sums on a GPU add in whatever order the programs finish)."""
    from workbench.optimize.passes import _swin

    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    # the residual stream fp32, as CUDA autocast has it (torch's layer_norm returns fp32 there), on the CPU too
    import importlib

    monkeypatch.setattr(importlib.import_module("workbench.kernels.layer_norm"), "AUTOCAST_FP32_NORM_DEVICES", ("cuda", "cpu"))
    ref, model = model_pair(DEVICE, drop_path_rate=0.0)
    for m in (ref, model):
        apply_pass("fused_layernorm", m, pass_ctx(DEVICE, "bf16"), {"impl": "triton", "fuse_residual": True})
        fused_window.apply(m, pass_ctx(DEVICE, "bf16"))
    seen, stream = [], []
    for blk in _window_blocks(model):
        blk.register_forward_pre_hook(lambda mod, args: stream.append(args[0].dtype))
        for lin in (blk.attn.qkv, blk.mlp.fc1):
            lin.register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
    x, target = tiny_batch(ref, BATCH, DEVICE)
    from pass_helpers import train_step

    logits, grads = train_step(model, x, target, torch.bfloat16, None)
    assert seen and set(seen) == {torch.bfloat16}
    assert torch.float32 in stream  # stage 1's blocks take an fp32 x: the direct path is the one exercised
    monkeypatch.setattr(_swin, "autocast_input_dtype", lambda x: None)
    logits_ref, grads_ref = train_step(ref, x, target, torch.bfloat16, None)
    assert_same_as_the_cast_path(logits, grads, logits_ref, grads_ref, DEVICE)


def test_mlp_residual_add_goes_into_the_next_block_s_norm(monkeypatch):
    """Within a stage each block hands its MLP branch to the next, whose norm kernel adds it: one
    add_norm_shift_partition per block but a stage's first, blocks still called as modules (their hooks
    run: the NVTX ranges), and the same step as timm's, with stochastic depth on (the branch is dropped
    before it is handed over, in timm's order of draws)."""
    import importlib

    win = importlib.import_module("workbench.kernels.window")
    calls = []
    real = win.AddNormShiftPartitionFunction.apply
    monkeypatch.setattr(win.AddNormShiftPartitionFunction, "apply", lambda *a: calls.append(1) or real(*a))
    ref, model = model_pair(DEVICE, drop_path_rate=0.2)
    model, result = fused_window.apply(model, pass_ctx(DEVICE))
    assert result.details["stages_deferring_mlp_add"] == 2
    entered = []
    for blk in _window_blocks(model):
        blk.register_forward_pre_hook(lambda mod, args: entered.append(1))
    _assert_same_step(ref, model, atol=1e-5, rtol=1e-5, train=True, rng_seed=3)
    assert len(entered) == N_BLOCKS and len(calls) == N_BLOCKS - 2
    # a stage whose blocks a later pass plans otherwise (one Function each: they take no pending branch)
    # runs them as timm's stage does, the adds unfused: with stochastic depth on, the blocks that draw
    # fall back to the window forward
    model, _ = apply_pass("fused_block", model, pass_ctx(DEVICE))
    assert not any(plan.defers_mlp_add for plan in block_plans(model).plans.values())
    calls.clear()
    _assert_same_step(ref, model, atol=1e-5, rtol=1e-5, train=True, rng_seed=3)
    assert calls == []


def test_inference_hands_a_stage_s_last_mlp_add_to_the_next_merging(monkeypatch):
    """In inference (the dense recipe, bf16) a stage's last MLP branch goes to the next stage unadded and its
    PatchMerging adds it in the gather-and-norm pass: the same logits bit for bit as the forward that adds
    it first; with autograd (training) the stages run in turn and the merging takes no residual."""
    import importlib

    from workbench.models import TINY_MODEL
    from workbench.optimize.passes import block_forward
    from workbench.optimize.recipes import apply_chain_passes, resolve_chain
    from workbench.optimize.workload import Workload, WorkloadConfig

    w = Workload.build(WorkloadConfig(model=TINY_MODEL, mode="infer", batch=2, precision="bf16", device=str(DEVICE),
                                      seed=0))
    w.model, results = apply_chain_passes(w.model, w.ctx, resolve_chain("dense"))
    window = next(r for r in results if r.name == "fused_window")
    assert window.details["stage_hand_offs"] == len(w.model.layers) - 1 >= 1
    assert "stage boundaries" in window.changed
    assert vars(w.model.layers)["forward"].__func__ is block_forward.stages_forward
    residuals = []
    ln = importlib.import_module("workbench.kernels.layer_norm")    # the package exports a layer_norm function
    real = ln.merging_layer_norm
    monkeypatch.setattr(ln, "merging_layer_norm", lambda *a, residual=None: residuals.append(residual is not None)
                        or real(*a, residual=residual))
    w.prepare()
    with torch.inference_mode():
        handed, _ = w.forward_loss()
        assert residuals == [True] * (len(w.model.layers) - 1)
        forward = vars(w.model.layers).pop("forward")
        added, _ = w.forward_loss()
        w.model.layers.forward = forward
    assert torch.equal(handed, added) and residuals[len(w.model.layers) - 1:] == [False] * (len(w.model.layers) - 1)
    residuals.clear()
    with torch.enable_grad(), torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        w.model.layers(torch.randn(1, *w.model.layers[0].blocks[0].input_resolution, w.model.layers[0].dim,
                                   device=DEVICE, requires_grad=True))
    assert residuals == []
