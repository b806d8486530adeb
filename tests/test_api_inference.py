"""optimize_swin_inference: a recipe's inference form in one call. On the CPU with the tiny Swin (the Triton
kernels under TRITON_INTERPRET=1, conftest sets it without a GPU); the CUDA graphs per batch shape in
test_api_gpu.py, their bookkeeping here with a stand-in for the capture.

What a user relies on: the logits are timm's function of the same weights under the recipe's autocast,
what `swinbench apply --mode infer` measures for the recipe is what the call runs, the passes are
planned for inference (bf16 weights without fp32 copies; the quantizing recipes allowed), and mistakes
are one line."""
import copy
import sys
from pathlib import Path

import pytest
import torch

from workbench.api import InferenceSwin, RecipeUnavailable, optimize_swin, optimize_swin_inference
from workbench.errors import UserError
from workbench.optimize.inference import PredictGraphs
from workbench.optimize.workload import Workload, WorkloadConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_api import tiny  # noqa: E402


def timm_logits(model, x, autocast: bool) -> torch.Tensor:
    model = copy.deepcopy(model).eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return model(x).float()


@pytest.mark.parametrize("recipe, tol", [("baseline", 0), ("amp", 0), ("apex", 0), ("fmha", 1e-2)])
def test_the_logits_are_timms_under_the_recipes_autocast(recipe, tol):
    model = tiny()
    x = torch.randn(3, 3, 56, 56, generator=torch.Generator().manual_seed(2))
    want = timm_logits(model, x, autocast=recipe != "baseline")
    swin = optimize_swin_inference(model, recipe)
    assert isinstance(swin, InferenceSwin) and swin.model is model and not model.training
    got = swin(x)
    assert got.dtype == torch.float32 and got.shape == (3, 10)
    assert ((got - want).norm() / want.norm()).item() <= tol
    assert torch.equal(swin.predict(x), got)
    assert not swin.graphed and "no CUDA graphs on the CPU" in swin.describe()


def test_inference_keeps_bf16_weights_without_fp32_copies():
    model = tiny()
    swin = optimize_swin_inference(model, "apex")
    master = swin.ctx.master_weights
    assert master is not None and master._fp32 is None and master.master is None
    assert all(p.dtype == torch.bfloat16 for p in master.params)
    assert "inference keeps no fp32 copy" in swin.describe()


def test_the_weights_are_left_without_requires_grad_and_train_again_in_a_fresh_model():
    """As the docstring and docs/training.md say: no gradients after the call; the weights saved before it
    train in a fresh timm model."""
    model = tiny()
    saved = copy.deepcopy(model.state_dict())
    swin = optimize_swin_inference(model, "apex")
    assert not any(p.requires_grad for p in swin.model.parameters())
    fresh = tiny(seed=1)
    fresh.load_state_dict(saved)
    trainer = optimize_swin(fresh, "amp")
    assert all(p.requires_grad for p in fresh.parameters())
    x, y = torch.randn(2, 3, 56, 56), torch.randint(0, 10, (2,))
    assert trainer.train_step(x, y).isfinite() and trainer.updated


def test_what_apply_measures_in_inference_is_what_the_call_runs():
    """The ladder's inference workload for a recipe and the API on the same weights give the same logits."""
    config = WorkloadConfig(model="swinbench_tiny_cpu", mode="infer", batch=2, device="cpu", precision="bf16")
    workload = Workload.build(config)
    from workbench.optimize.recipes import resolve_chain

    model = copy.deepcopy(workload.model)
    workload.apply_chain(resolve_chain("fmha"))
    with torch.inference_mode():
        measured = workload.forward_loss()[0].float()
    assert torch.equal(optimize_swin_inference(model, "fmha")(workload.x), measured)


def test_an_inference_only_recipe_is_refused_for_training_and_taken_for_inference(tmp_path):
    simulated = tmp_path / "int8-sim.yaml"
    simulated.write_text("name: int8-sim\nextends: amp\ndescription: int8 simulated\n"
                         "passes:\n  - name: quantize_linear\n    params: {dtype: int8, simulate: true, keep: [head.fc]}\n")
    with pytest.raises(RecipeUnavailable, match="runs inference only"):
        optimize_swin(tiny(), str(simulated))
    model = tiny()
    x = torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(3))
    want = timm_logits(model, x, autocast=True)
    swin = optimize_swin_inference(model, str(simulated))
    got = swin(x)
    assert 0 < ((got - want).norm() / want.norm()).item() < 0.1     # int8's rounding, not a wrong scale
    with pytest.raises(RecipeUnavailable, match="int8 GEMMs need a CUDA GPU"):
        optimize_swin_inference(tiny(), "int8")
    noted = optimize_swin_inference(tiny(), "int8", allow_unavailable=True)
    assert any("quantize_linear left out" in n for n in noted.notes)


def test_static_calibration_runs_on_the_callers_images(tmp_path):
    """calibration=: the static scales come from the user's images (first calibration_batches of them, from
    (images, labels) pairs too), and the record says so; a recipe without static scales says it is unused."""
    static = tmp_path / "int8-static.yaml"
    static.write_text("name: int8-static\nextends: amp\ndescription: int8 static\npasses:\n  - name: quantize_linear\n"
                      "    params: {dtype: int8, simulate: true, keep: [head.fc], activations: static, "
                      "calibration: max, calibration_batches: 2}\n")
    gen = torch.Generator().manual_seed(11)
    loud = [(8.0 * torch.randn(2, 3, 56, 56, generator=gen), torch.zeros(2)) for _ in range(3)]
    seen = []

    def batches():
        for item in loud:
            seen.append(item)
            yield item

    mine = optimize_swin_inference(tiny(), str(static), calibration=batches())
    noise = optimize_swin_inference(tiny(), str(static))
    mine_cal, noise_cal = mine.passes[-1].details["calibration"], noise.passes[-1].details["calibration"]
    assert mine_cal["data"] == "the caller's images" and noise_cal["data"] == "synthetic"
    assert len(seen) == 2 and mine_cal["batches"] == 2       # the recipe's calibration_batches, no more
    assert mine_cal["scales"] != noise_cal["scales"]
    # the synthetic images given as the caller's: the very scales the synthetic calibration takes
    from workbench.optimize.passes.quantize_linear import synthetic_calibration_batches

    same = synthetic_calibration_batches(tiny(), 2, 8, torch.device("cpu"))[0]
    again = optimize_swin_inference(tiny(), str(static), calibration=same).passes[-1].details["calibration"]
    assert again["scales"] == noise_cal["scales"]
    unused = optimize_swin_inference(tiny(), "amp", calibration=[torch.zeros(1, 3, 56, 56)])
    assert any("calibrates nothing" in n for n in unused.notes)
    with pytest.raises(UserError, match="calibration must be an iterable"):
        optimize_swin_inference(tiny(), str(static), calibration=torch.zeros(1, 3, 56, 56))
    with pytest.raises(UserError, match="calibration: images must be"):
        optimize_swin_inference(tiny(), str(static), calibration=[torch.zeros(1, 3, 32, 32)])

@pytest.mark.parametrize("kwargs, message", [
    ({"graph": "yes"}, "graph must be True or False"),
    ({"batch": 0}, "batch must be an integer"),
    ({"recipe": "nope"}, "unknown recipe"),
])
def test_mistakes_are_one_line(kwargs, message):
    with pytest.raises(UserError, match=message):
        optimize_swin_inference(tiny(), **kwargs)


def test_a_call_on_something_that_is_not_a_batch_of_images_is_one_line():
    swin = optimize_swin_inference(tiny(), "amp")
    for bad in ([1, 2], torch.zeros(3, 56, 56), torch.zeros(1, 3, 56, 56, dtype=torch.int64)):
        with pytest.raises(UserError, match="images must be a float tensor"):
            swin(bad)
    with pytest.raises(UserError, match="must be a torch.nn.Module"):
        optimize_swin_inference("swin_tiny_patch4_window7_224")


class _FakeGraph:
    """Stands in for a captured CUDA graph: a replay runs the forward on the static input."""

    def __init__(self, forward, x):
        self.forward, self.x = forward, x
        self.logits = forward(x)

    def replay(self):
        self.logits.copy_(self.forward(self.x))


def test_graphs_per_batch_shape_warm_up_capture_replay_and_stop_at_the_limit(monkeypatch):
    calls, said = [], []

    def forward(x):
        calls.append(tuple(x.shape))
        return x.sum(dim=(1, 2, 3))[:, None] * torch.ones(1, 4)

    graphs = PredictGraphs(forward, torch.device("cpu"), on_eager=lambda k, t: said.append((k, t)),
                           terms_every_call=False, warmup=2, limit=2)

    def capture(images):
        from workbench.optimize.inference import _Graph

        g = _FakeGraph(forward, images.clone())
        return _Graph(g, g.x, g.logits)

    monkeypatch.setattr(graphs, "_capture", capture)
    a, b, c = (torch.randn(n, 3, 4, 4) for n in (2, 3, 5))
    for _ in range(4):
        assert torch.allclose(graphs(a), forward(a))
    assert list(graphs.graphs) == [((2, 3, 4, 4), torch.float32)]
    fresh = torch.randn(2, 3, 4, 4)
    assert torch.allclose(graphs(fresh), forward(fresh))        # the replay reads the new batch
    for _ in range(3):
        graphs(b)
    assert len(graphs.graphs) == 2 and not said
    assert torch.allclose(graphs(c), forward(c))                # past the limit: eager, said
    assert len(graphs.graphs) == 2 and said and said[0][0] == "predict:shape"
    assert "predict ran eagerly: a batch of (5, 3, 4, 4)" in said[0][1]


def test_predict_follows_swinv2_weights_changed_where_no_op_says_so():
    """A replayed training step (or a fused optimizer writing through pointers) changes SwinV2's logit
    scale and position-bias MLP without raising their version counters: predict must not serve the terms it
    cached before."""
    from timm.models.swin_transformer_v2 import SwinTransformerV2

    def v2():
        torch.manual_seed(0)
        model = SwinTransformerV2(img_size=32, patch_size=4, window_size=4, embed_dim=32, depths=(2, 2),
                                  num_heads=(2, 4), num_classes=10, drop_path_rate=0.0)
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                torch.nn.init.ones_(p)       # timm starts the post-norms at 0, which hides the attention
        return model

    swin = optimize_swin(v2(), "fmha")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    swin.predict(x)
    with torch.no_grad():
        for name, p in swin.model.named_parameters():
            if "logit_scale" in name or "q_bias" in name:     # fp32 weights, outside the bf16 master copy
                p.data.copy_(p.data * 1.5 + 0.3)       # as a replay writes: no version change
    plain = v2()
    plain.load_state_dict(swin.state_dict())
    want = timm_logits(plain, x, autocast=True)
    got = swin.predict(x)
    assert ((got - want).norm() / want.norm()).item() < 3e-2


def test_images_of_another_size_or_dtype():
    swin = optimize_swin_inference(tiny(), "amp")
    with pytest.raises(UserError, match=r"images must be \(N >= 1, 3, 56, 56\), got \(1, 3, 64, 64\)"):
        swin(torch.zeros(1, 3, 64, 64))
    with pytest.raises(UserError, match="N >= 1"):
        swin(torch.zeros(0, 3, 56, 56))
    x = torch.randn(2, 3, 56, 56)
    assert torch.allclose(swin(x.half()), swin(x.half().float()))       # fp16 images are taken as fp32
    trainer = optimize_swin(tiny(), "amp")
    with pytest.raises(UserError, match="predict: images must be a float tensor"):
        trainer.predict([1, 2])


def test_a_graph_recipe_on_the_cpu_runs_eagerly_and_describes_no_training_graph():
    swin = optimize_swin_inference(tiny(), "torch-compile-graph")
    assert not swin.graphed and "cuda_graph" not in [p.name for p in swin.passes]
    assert "no CUDA graphs on the CPU" in swin.describe()
