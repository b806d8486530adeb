"""The public training API (workbench.api) on the CPU with the tiny Swin; the Triton kernels run under
TRITON_INTERPRET=1 (conftest sets it without a GPU).

What a user relies on: an optimized recipe trains like the fp32 baseline step after step (within the
recipe's gate tolerances), the baseline through the API is a plain PyTorch loop bit for bit (soft
targets, label smoothing and clipping included), the harness's Workload steps the same numbers, a
checkpoint moves between the API and a plain timm Swin bit for bit, optimizer state survives a save and
load, LR schedulers reach the step, and accumulation equals one big batch.
"""
import copy
import io

import pytest
import torch
import torch.nn.functional as F

from workbench.api import optimize_swin
from workbench.errors import UserError
from workbench.models import TINY_MODEL, build_model
from workbench.optimize.gate import GateOutputs, capture_parameters, compare
from workbench.optimize.recipes import gate_tolerance, resolve_chain

BATCH = 2


def tiny(seed: int = 0) -> torch.nn.Module:
    """The tiny Swin with stochastic depth off, as the gate builds it: every recipe then computes the same
    function, and two recipes' random draws cannot set them apart."""
    torch.manual_seed(seed)
    return build_model(TINY_MODEL, drop_path_rate=0.0)


def batches(n: int, batch: int = BATCH, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 56, 56, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(n)]


@pytest.fixture
def master_recipe(tmp_path):
    """bf16 GEMM weights with fp32 masters, without the interpreted kernels (fast on the CPU)."""
    path = tmp_path / "amp-master.yaml"
    path.write_text("name: amp-master\nextends: amp\npeer: true\ndescription: amp with master weights\n"
                    "passes: [master_weights]\n")
    return str(path)


def weights(module) -> dict[str, torch.Tensor]:
    """A copy of a module's (or an OptimizedSwin's) state_dict: state_dict tensors share the weights' memory."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_fmha_trains_within_the_gate_of_the_baseline_step_after_step():
    """Both models step on the same batches; at each step logits, loss and the gate's gradients of the
    fused model stay within the fmha recipe's bf16 tolerances of the fp32 baseline's, and the loss falls."""
    plain = optimize_swin(tiny(), "baseline", optimizer={"lr": 1e-3})
    model = tiny()
    gate_params = capture_parameters(model)            # taken before any pass, as the ladder's gate does
    fused = optimize_swin(model, "fmha", optimizer={"lr": 1e-3})
    assert [p.name for p in fused.passes][-1] == "fused_attention" and all(p.available for p in fused.passes)
    tolerance = gate_tolerance(resolve_chain("fmha"), fused.ctx.precision.name)

    def hook_grads(params):
        grads = {}
        for name, p in params.items():
            p.register_hook(lambda g, n=name: grads.__setitem__(n, g.detach().float().clone()))
        return grads

    ref_grads = hook_grads(capture_parameters(plain.model))
    grads = hook_grads(gate_params)
    x, y = batches(1)[0]
    losses = []
    for step in range(3):
        ref_loss = plain.train_step(x, y).item()
        loss = fused.train_step(x, y).item()
        ref = GateOutputs(plain.last_logits.float(), ref_loss, dict(ref_grads))
        out = GateOutputs(fused.last_logits.float(), loss, dict(grads))
        result = compare(out, ref, tolerance)
        assert result.status == "PASS", (step, result.reason)
        losses.append(loss)
    assert losses[2] < losses[1] < losses[0]


def test_baseline_is_a_plain_pytorch_loop_bit_for_bit():
    """Soft targets (mixup-like), label smoothing in the user's loss, gradient clipping: the baseline recipe
    through the API gives the weights a hand-written loop gives."""
    data = batches(3, batch=4)
    soft = [(x, 0.8 * F.one_hot(y, 10).float() + 0.02) for x, y in data]
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)

    swin = optimize_swin(tiny(), "baseline", optimizer={"lr": 1e-3, "weight_decay": 0.02}, grad_clip=0.5,
                         loss_fn=loss_fn)
    assert swin.last_grad_norm is None
    api_norms = []
    for x, y in soft:
        swin.train_step(x, y)
        api_norms.append(swin.last_grad_norm.item())

    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.02, foreach=True)
    norms = []
    for x, y in soft:
        loss = loss_fn(model(x).float(), y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 0.5).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert_bitwise(swin.state_dict(), weights(model))
    assert api_norms == norms          # the norm before clipping, as clip_grad_norm_ returns it


def test_the_harness_workload_steps_what_the_api_steps():
    """The ladder times Workload.step; a user runs train_step: the same recipe gives the same losses and
    weights, bit for bit."""
    from workbench.ladder.interleave import build_stage_workload
    from workbench.optimize.workload import WorkloadConfig

    workload, _ = build_stage_workload(WorkloadConfig(model=TINY_MODEL, batch=BATCH, precision="fp32",
                                                      device="cpu"), "apex")
    swin = optimize_swin(tiny(), "apex")
    harness = [workload.step(i).item() for i in range(2)]
    api = [swin.train_step(workload.x, workload.y).item() for _ in range(2)]
    assert harness == api
    mw = workload.ctx.master_weights
    assert all(torch.equal(a, b) for a, b in zip(mw.fp32_views(), swin.ctx.master_weights.fp32_views()))


def test_use_graph_turns_the_graph_form_on_and_off():
    """apply times a stage's graph column on the stage's own workload: Workload.use_graph turns the API's
    graph on (capturable optimizer, the learning rate as a device tensor, a fresh capture) and off."""
    from workbench.ladder.interleave import build_stage_workload
    from workbench.optimize.workload import WorkloadConfig

    workload, _ = build_stage_workload(WorkloadConfig(model=TINY_MODEL, batch=BATCH, device="cpu"), "apex")
    workload.step(0)
    session = workload.session
    assert not session.graphed
    workload.use_graph(True)
    assert workload.ctx.cuda_graph and session.graphed and not session.graph_captured
    assert all(torch.is_tensor(g["lr"]) for g in session.optimizer.param_groups)
    assert all(g["capturable"] for g in session.optimizer.param_groups if "capturable" in g)
    with pytest.raises(UserError, match="needs a CUDA device"):     # no graph on the CPU: one line, not a crash
        workload.step(1)
    workload.use_graph(False)
    assert not workload.ctx.cuda_graph and not session.graphed
    session.sharded = True        # an FSDP session: no graph of its step (refused, not built half-way)
    with pytest.raises(UserError, match="FSDP step as a CUDA graph"):
        session.use_graph(True)
    assert not session.graphed


def test_checkpoints_move_between_the_api_and_a_plain_timm_swin_bit_for_bit(master_recipe):
    swin = optimize_swin(tiny(), master_recipe, optimizer={"lr": 1e-3})
    assert swin.ctx.master_weights is not None
    for x, y in batches(2):
        swin.train_step(x, y)
    saved = swin.state_dict()
    assert {v.dtype for v in saved.values() if v.is_floating_point()} == {torch.float32}

    # optimized -> plain: the fp32 masters are what a plain timm Swin loads
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    plain = tiny(seed=5)
    plain.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    assert_bitwise(weights(plain), saved)

    # plain -> optimized: the masters become the plain weights, the bf16 copies those rounded
    other = tiny(seed=7)
    swin.load_state_dict(weights(other))
    assert_bitwise(swin.state_dict(), weights(other))
    by_name = dict(swin.model.named_parameters())
    for name, value in weights(other).items():
        if name in by_name and by_name[name].dtype == torch.bfloat16:
            assert torch.equal(by_name[name].detach(), value.to(torch.bfloat16)), name


def test_optimizer_state_survives_save_and_load(master_recipe):
    data = batches(4)
    swin = optimize_swin(tiny(), master_recipe, optimizer={"lr": 1e-3})
    for x, y in data[:2]:
        swin.train_step(x, y)
    buffer = io.BytesIO()
    torch.save({"model": swin.state_dict(), "optimizer": swin.optimizer_state_dict()}, buffer)
    straight_on = [swin.train_step(x, y).item() for x, y in data[2:]]

    resumed = optimize_swin(tiny(seed=3), master_recipe, optimizer={"lr": 1e-3})
    checkpoint = torch.load(io.BytesIO(buffer.getvalue()))
    resumed.load_state_dict(checkpoint["model"])
    resumed.load_optimizer_state_dict(checkpoint["optimizer"])
    assert [resumed.train_step(x, y).item() for x, y in data[2:]] == straight_on
    assert_bitwise(resumed.state_dict(), swin.state_dict())


@pytest.mark.parametrize("recipe", ["baseline", "master"])
def test_an_lr_scheduler_reaches_the_step(recipe, master_recipe):
    """LambdaLR on swin.optimizer: after the first step the lr is 0, and the next step leaves every weight
    as it was (AdamW with lr 0 neither moves nor decays)."""
    swin = optimize_swin(tiny(), master_recipe if recipe == "master" else "baseline", optimizer={"lr": 1e-3})
    schedule = torch.optim.lr_scheduler.LambdaLR(swin.optimizer, lambda step: 1.0 if step == 0 else 0.0)
    (x, y), (x2, y2) = batches(2)
    before = weights(swin)
    swin.train_step(x, y)
    schedule.step()
    after_first = weights(swin)
    assert any(not torch.equal(before[k], after_first[k]) for k in before)
    swin.train_step(x2, y2)
    assert_bitwise(swin.state_dict(), after_first)


def test_a_number_put_in_a_group_reaches_the_graphs_lr_tensor():
    """The CUDA-graph path keeps each group's lr in a tensor the graph reads: schedulers fill it in place
    (this torch keeps the tensor), and a plain number a user assigns is copied into it before the replay."""
    from workbench.optimize.trainer import _TrainGraphs

    swin = optimize_swin(tiny(), "baseline", optimizer={"lr": 1e-3})
    group = swin.optimizer.param_groups[0]
    lr = torch.tensor(1e-3)
    group["lr"] = lr
    swin._lr_tensors = [lr]
    schedule = torch.optim.lr_scheduler.LambdaLR(swin.optimizer, lambda step: 0.5)
    with pytest.warns(UserWarning, match="before `optimizer.step"):
        schedule.step()
    assert group["lr"] is lr and lr.item() == pytest.approx(5e-4)
    swin._train_graphs = _TrainGraphs({}, None, None, None, True, swin._number_lrs())
    group["lr"] = 0.25
    swin._sync_lr()
    assert group["lr"] is lr and lr.item() == 0.25


def test_accumulation_equals_one_big_batch():
    """Two micro-batches of 2 with accumulate=2 against batches of 4, clipped. SGD: an update linear in the
    gradient, so the weights differ by the gradients' rounding only (AdamW's first steps divide each
    gradient by its own size and would magnify that rounding where a gradient is near zero)."""
    (x, y), (x2, y2) = batches(2, batch=4)
    sgd = dict(optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, grad_clip=0.5)
    big = optimize_swin(tiny(), "baseline", **sgd)
    split = optimize_swin(tiny(), "baseline", accumulate=2, **sgd)
    updated = []
    for xs, ys in ((x, y), (x2, y2)):
        big.train_step(xs, ys)
        for half in (slice(0, 2), slice(2, 4)):
            split.train_step(xs[half], ys[half])
            updated.append(split.updated)
    assert updated == [False, True, False, True] and split.optimizer_steps == 2 and split.micro_steps == 4
    a, b = big.state_dict(), split.state_dict()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")


def test_predict_runs_in_eval_mode_and_puts_the_mode_back():
    swin = optimize_swin(tiny(), "amp")
    x, _ = batches(1)[0]
    reference = copy.deepcopy(swin.model).eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(x).float()
    assert swin.model.training
    assert torch.equal(swin.predict(x), expected)
    assert swin.model.training
    assert swin.eval() is swin and not swin.model.training
    assert swin.train().model.training


def test_the_users_own_optimizer_is_used_as_given():
    swin = optimize_swin(tiny(), "baseline", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1, "momentum": 0.9})
    assert type(swin.optimizer) is torch.optim.SGD and swin.optimizer.defaults["momentum"] == 0.9
    # the recipe's own (the for-each AdamW of a recipe no pass changes the optimizer of) is said replaced
    assert "the optimizer given is used, not the recipe's torch.optim.AdamW(foreach=True)" in swin.notes
    x, y = batches(1)[0]
    assert torch.isfinite(swin.train_step(x, y))
    factory = lambda params: torch.optim.AdamW(params, lr=3e-4)  # noqa: E731
    swin = optimize_swin(tiny(), "apex", optimizer=factory)
    assert swin.optimizer.defaults["lr"] == 3e-4 and any("optimizer given is used" in n for n in swin.notes)


@pytest.mark.parametrize("kwargs, message", [
    (dict(accumulate=0), "accumulate"),
    (dict(grad_clip=-1.0), "grad_clip"),
    (dict(optimizer="sgd"), "optimizer must be"),
    (dict(optimizer={"lr": 1e-3, "fused": True}), "unknown AdamW setting"),
    (dict(optimizer=dict, optimizer_kwargs={}), "not a torch.optim.Optimizer"),
    (dict(recipe="fmha-fast"), "unknown recipe"),
    (dict(recipe="fmha-graph"), "cannot run here: pass cuda_graph"),
])
def test_mistakes_are_one_line_user_errors(kwargs, message):
    if "fmha-graph" in str(kwargs) and torch.cuda.is_available():
        pytest.skip("CUDA graphs run here")
    recipe = kwargs.pop("recipe", "baseline")
    with pytest.raises(UserError, match=message) as info:
        optimize_swin(tiny(), recipe, **kwargs)
    assert "\n" not in str(info.value)


def test_allow_unavailable_goes_on_and_says_what_was_left_out():
    if torch.cuda.is_available():
        pytest.skip("CUDA graphs run here")
    swin = optimize_swin(tiny(), "fmha-graph", allow_unavailable=True)
    assert not swin.graphed and any("cuda_graph left out" in n for n in swin.notes)


def test_a_swinv2_takes_the_fused_window_and_attention_passes():
    from timm.models.swin_transformer_v2 import SwinTransformerV2

    torch.manual_seed(0)
    model = SwinTransformerV2(img_size=32, patch_size=4, window_size=4, embed_dim=16, depths=(1, 1),
                              num_heads=(1, 2), num_classes=10)
    swin = optimize_swin(model, "fmha", device="cpu", allow_unavailable=True)
    assert not [n for n in swin.notes if "left out" in n]
    assert not [n for n in swin.notes if "not applied: SwinV2 blocks (post-norm, cosine attention" in n]
    assert {p.name for p in swin.passes if p.available} >= {"amp", "fused_layernorm", "master_weights",
                                                             "fused_window", "fused_attention"}
    assert next(p for p in swin.passes if p.name == "fused_attention").details["swinv2_patched_modules"] == 2
    assert next(p for p in swin.passes if p.name == "fused_window").details["swinv2_patched_blocks"] == 2
    loss = swin.train_step(torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,)))
    assert torch.isfinite(loss)


def test_a_quantizing_recipe_is_refused_before_any_pass_changes_the_model():
    from workbench.api import RecipeUnavailable

    model = tiny()
    with pytest.raises(RecipeUnavailable, match="inference only.*the model is unchanged"):
        optimize_swin(model, "tests/data/recipes/int8-sim.yaml")
    assert all(type(m).__name__ not in ("TritonLayerNorm", "QuantLinear") for m in model.modules())


@pytest.mark.parametrize("entry", ["optimize_swin", "optimize_swin_inference", "patch_swin"])
def test_a_patched_or_meta_model_is_refused_in_one_line(entry):
    """A second recipe over a patched model would change nothing and report counts of nothing; a model
    on the meta device has no weights to patch. Each entry point says so before touching it."""
    import workbench.api as api

    call = getattr(api, entry)
    kwargs = {} if entry != "patch_swin" else {"training": False}
    fused = tiny()
    api.patch_swin(fused, "apex")     # TritonLayerNorm modules (the interpreter runs them on the CPU)
    with pytest.raises(UserError, match="patched already"):
        call(fused, "amp", **kwargs)
    with torch.device("meta"):
        meta = build_model(TINY_MODEL)
    with pytest.raises(UserError, match="meta device"):
        call(meta, "amp", **kwargs)


def test_an_optimizer_factory_must_step_what_it_is_passed(master_recipe):
    # under master weights the factory is passed the flat fp32 master: one built over the model's own
    # (bf16) weights would leave every GEMM weight unstepped
    model = tiny()
    with pytest.raises(UserError, match="leaves out the fp32 master"):
        optimize_swin(model, master_recipe, optimizer=lambda params: torch.optim.AdamW(model.parameters(), lr=1e-3))
    with pytest.raises(UserError, match="not a torch.optim.Optimizer"):
        optimize_swin(tiny(), "amp", optimizer=lambda params: 5)
    frozen = optimize_swin(tiny(), "amp", optimizer=lambda ps: torch.optim.SGD([p for p in ps if p.ndim > 1], lr=0.1))
    assert frozen.train_step(*batches(1)[0]).isfinite()      # a subset (the rest frozen) is fine


def test_a_refused_recipe_stops_at_its_first_unavailable_pass(monkeypatch):
    from workbench.optimize.passes import PassUnavailable, fused_layernorm
    from workbench.optimize.recipes import RecipeUnavailable

    def unavailable(model, ctx, **params):
        raise PassUnavailable("not here")

    monkeypatch.setattr(fused_layernorm, "apply", unavailable)
    model = tiny()
    with pytest.raises(RecipeUnavailable, match="fused_layernorm"):
        optimize_swin(model, "apex")      # master_weights, after fused_layernorm, must not round the weights
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_predictions_can_be_training_targets():
    from workbench.api import optimize_swin_inference

    images, _ = batches(1)[0]
    teacher, student = optimize_swin_inference(tiny(), "amp"), optimize_swin(tiny(seed=1), "amp")
    target = teacher(images)
    assert not target.is_inference() and not student.predict(images).is_inference()
    assert student.train_step(images, target, loss_fn=F.mse_loss).isfinite()


def test_train_step_checks_its_inputs_as_predict_does():
    swin = optimize_swin(tiny(), "baseline")
    images, targets = batches(1)[0]
    for bad, message in (((torch.randn(BATCH, 3, 64, 64), targets), r"images must be \(N >= 1, 3, 56, 56\)"),
                         ((images.to(torch.uint8), targets), "got Tensor of uint8"),
                         ((images, targets[:1]), "one row per image")):
        with pytest.raises(UserError, match=message):
            swin.train_step(*bad)
    assert swin.micro_steps == 0 and swin.train_step(images.half(), targets).isfinite()


def test_predict_gives_each_module_its_own_mode_back():
    swin = optimize_swin(tiny(), "baseline")
    swin.model.train()
    swin.model.layers[0].eval()          # a user's frozen part
    swin.predict(batches(1)[0][0])
    assert swin.model.training and not swin.model.layers[0].training and not swin.model.layers[0].blocks[0].training


@pytest.mark.parametrize("kwargs, message", [
    ({"optimizer": {"betas": 0.9}}, "betas must be two numbers"),
    ({"optimizer": {"lr": "fast"}}, "lr must be a number >= 0"),
    ({"grad_clip": True}, "grad_clip must be a number > 0"),
])
def test_optimizer_settings_are_checked_when_given(kwargs, message):
    with pytest.raises(UserError, match=message):
        optimize_swin(tiny(), "baseline", **kwargs)


def test_a_model_that_is_not_fp32_is_refused_before_any_pass():
    model = tiny().half()
    with pytest.raises(UserError, match="takes an fp32 model"):
        optimize_swin(model, "amp")
    assert {p.dtype for p in model.parameters()} == {torch.float16}


@pytest.mark.parametrize("device", [None, "cpu"])
def test_a_model_without_parameters_is_one_line(device):
    with pytest.raises(UserError, match="optimize_swin trains a model's parameters, and this Identity has none"):
        optimize_swin(torch.nn.Identity(), "baseline", device=device)


@pytest.mark.parametrize("entry", ["optimize_swin", "optimize_swin_inference"])
def test_no_gpu_for_device_cuda_speaks_of_the_argument_not_the_cli(entry, monkeypatch):
    import workbench.api as api

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match=f"no CUDA GPU is visible here: give {entry} device='cpu'") as info:
        getattr(api, entry)(tiny(), "baseline", device="cuda")
    assert "--device" not in str(info.value)
