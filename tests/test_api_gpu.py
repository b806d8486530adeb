"""The public training API's CUDA-graph path (recipe fmha-graph) against the same recipe run eagerly (fmha),
on the tiny Swin on a GPU: warm-up, capture and replay train the same numbers; LR schedulers and plain
numbers put into a group reach the captured step; a batch of another size, and predict, fall back and
say so; accumulation and checkpoints work under the graph. Skipped without a GPU.

    python -m pytest -q -m gpu tests/test_api_gpu.py
"""
import io
import math

import pytest
import torch

from workbench.api import GRAPH_WARMUP_STEPS, GraphFallbackWarning, optimize_swin
from workbench.models import TINY_MODEL, build_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS = GRAPH_WARMUP_STEPS + 4     # warm-up, capture, replays


def tiny(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(TINY_MODEL, drop_path_rate=0.0).cuda()


def batches(n: int, batch: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 56, 56, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(n)]


def pair(**kwargs):
    """(eager fmha, graphed fmha-graph) from the same weights."""
    return optimize_swin(tiny(), "fmha", **kwargs), optimize_swin(tiny(), "fmha-graph", **kwargs)


def assert_close_runs(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= 1e-2 * max(1.0, abs(x)), (i, a, b)


def test_the_graph_trains_what_the_eager_step_trains():
    eager, graphed = pair(optimizer={"lr": 1e-3}, grad_clip=1.0)
    assert graphed.graphed and not eager.graphed
    data = batches(STEPS)
    a, b, norms_a, norms_b = [], [], [], []
    for x, y in data:
        a.append(eager.train_step(x, y).item())
        norms_a.append(eager.last_grad_norm.item())
    for x, y in data:
        b.append(graphed.train_step(x, y).item())
        norms_b.append(graphed.last_grad_norm.item())   # replays update the captured step's norm
    assert graphed._train_graphs is not None and graphed.eager_fallbacks == 0
    assert_close_runs(a, b)
    assert_close_runs(norms_a, norms_b)
    assert b[-1] < b[0]


def test_a_scheduler_and_a_plain_number_reach_the_captured_step():
    graphed = optimize_swin(tiny(), "fmha-graph", optimizer={"lr": 1e-3})
    schedule = torch.optim.lr_scheduler.LambdaLR(graphed.optimizer, lambda s: 1.0 if s < STEPS - 1 else 0.0)
    data = batches(STEPS + 2)
    for x, y in data[:STEPS]:
        graphed.train_step(x, y)
        schedule.step()
    frozen = {k: v.clone() for k, v in graphed.state_dict().items()}
    graphed.train_step(*data[STEPS])                      # replayed with lr 0: nothing moves
    assert all(torch.equal(frozen[k], v) for k, v in graphed.state_dict().items())
    for group in graphed.optimizer.param_groups:
        group["lr"] = 1e-3                                # a plain number: copied into the graph's tensor
    graphed.train_step(*data[STEPS + 1])
    assert any(not torch.equal(frozen[k], v) for k, v in graphed.state_dict().items())
    assert graphed._train_graphs is not None


def test_a_batch_of_another_size_runs_eagerly_and_says_so_once():
    eager, graphed = pair(optimizer={"lr": 1e-3})
    data = batches(STEPS) + batches(2, batch=3, seed=2) + batches(1, seed=3)
    a = [eager.train_step(x, y).item() for x, y in data]
    with pytest.warns(GraphFallbackWarning, match="another|batch of"):
        b = [graphed.train_step(x, y).item() for x, y in data]
    assert graphed.eager_fallbacks == 2 and sum("train_step ran eagerly" in n for n in graphed.notes) == 1
    assert_close_runs(a, b)


def test_accumulation_under_the_graph():
    eager, graphed = pair(optimizer={"lr": 1e-3}, accumulate=2)
    data = batches(2 * STEPS, batch=4)
    a = [eager.train_step(x, y).item() for x, y in data]
    b = [graphed.train_step(x, y).item() for x, y in data]
    assert set(graphed._train_graphs.graphs) == {"micro", "step"} and graphed.optimizer_steps == STEPS
    assert_close_runs(a, b)


def test_the_graph_moves_the_weights_average_as_the_eager_step_does():
    """ema inside the captured step: after the same steps, the graph's average is the eager one's (within
    the runs' bf16 noise), and predict(ema=True) replays the inference graph on the averaged weights."""
    eager, graphed = pair(optimizer={"lr": 1e-3}, ema=0.9)
    for x, y in batches(STEPS):
        eager.train_step(x, y)
        graphed.train_step(x, y)
    assert graphed._train_graphs is not None and graphed.eager_fallbacks == 0
    a, b = eager.ema_state_dict(), graphed.ema_state_dict()
    start = tiny().state_dict()
    da = torch.cat([(a[k] - start[k]).flatten() for k in start if start[k].is_floating_point()])
    db = torch.cat([(b[k] - start[k]).flatten() for k in start if start[k].is_floating_point()])
    assert torch.nn.functional.cosine_similarity(da, db, dim=0).item() > 0.95
    x = batches(1, seed=5)[0][0]
    for _ in range(4):
        trained = graphed.predict(x)
        assert torch.allclose(graphed.predict(x, ema=True), eager.predict(x, ema=True), rtol=2e-2, atol=2e-2)
        assert torch.equal(graphed.predict(x), trained)
    assert graphed._predict_graphs.graphs


def test_predict_replays_and_falls_back_for_another_size():
    eager, graphed = pair()
    (x, _), (small, _) = batches(1)[0], batches(1, batch=3)[0]
    for _ in range(4):
        assert torch.allclose(graphed.predict(x), eager.predict(x), rtol=1e-2, atol=1e-2)
    assert graphed._predict_graphs.graphs
    with pytest.warns(GraphFallbackWarning, match="predict ran eagerly"):
        assert graphed.predict(small).shape == (3, 10)


def test_checkpoint_and_optimizer_state_under_the_graph():
    data = batches(STEPS + 3)
    graphed = optimize_swin(tiny(), "fmha-graph", optimizer={"lr": 1e-3})
    for x, y in data[:STEPS]:
        graphed.train_step(x, y)
    buffer = io.BytesIO()
    torch.save({"model": graphed.state_dict(), "optimizer": graphed.optimizer_state_dict()}, buffer)
    straight_on = [graphed.train_step(x, y).item() for x, y in data[STEPS:]]

    plain = build_model(TINY_MODEL, drop_path_rate=0.0)
    checkpoint = torch.load(io.BytesIO(buffer.getvalue()), map_location="cpu")
    plain.load_state_dict(checkpoint["model"])
    assert all(torch.equal(v.cpu(), checkpoint["model"][k]) for k, v in plain.state_dict().items())

    resumed = optimize_swin(tiny(seed=3), "fmha-graph", optimizer={"lr": 1e-3})
    resumed.train_step(*data[0])                          # state to replace
    resumed.load_state_dict(checkpoint["model"])
    resumed.load_optimizer_state_dict(checkpoint["optimizer"])
    assert_close_runs([resumed.train_step(x, y).item() for x, y in data[STEPS:]], straight_on)


def test_the_graph_trains_like_eager_through_validation_and_stochastic_depth():
    """What `swinbench train` does and the tests above don't: stochastic depth on, clipping at 5, label
    smoothing, and predict (graph captured in eval mode, a smaller last batch eager) between epochs. The
    eager and graphed runs use the same kernels: their losses must stay together across the validations."""
    def build():
        torch.manual_seed(0)
        return build_model(TINY_MODEL, drop_path_rate=0.1).cuda()

    kwargs = dict(optimizer={"lr": 1e-3, "weight_decay": 0.05}, grad_clip=5.0,
                  loss_fn=torch.nn.CrossEntropyLoss(label_smoothing=0.1))
    eager, graphed = optimize_swin(build(), "fmha", **kwargs), optimize_swin(build(), "fmha-graph", **kwargs)
    data = batches(6, seed=4)
    val = batches(3, seed=5) + batches(1, batch=5, seed=6)
    losses = ([], [])
    for step in range(4 * len(data)):
        for swin, out in zip((eager, graphed), losses):
            torch.manual_seed(100 + step)            # the same stochastic-depth draws in both
            out.append(swin.train_step(*data[step % len(data)]).item())
        if step % len(data) == len(data) - 1:
            for swin in (eager, graphed):
                for x, _ in val:
                    swin.predict(x)
    assert_close_runs(*losses)


def test_use_graph_replays_an_eager_recipe_on_its_own_state_and_back():
    """What apply does for a stage's graph column: the same weights and optimizer state, stepped eagerly,
    then warmed up, captured and replayed, then eagerly again, train as the eager steps throughout."""
    eager = optimize_swin(tiny(), "fmha", optimizer={"lr": 1e-3})
    toggled = optimize_swin(tiny(), "fmha", optimizer={"lr": 1e-3})
    data = batches(2 + STEPS + 2)
    a = [eager.train_step(x, y).item() for x, y in data]
    b = [toggled.train_step(x, y).item() for x, y in data[:2]]
    toggled.use_graph(True)
    b += [toggled.train_step(x, y).item() for x, y in data[2:2 + STEPS]]
    assert toggled.graph_captured and toggled.eager_fallbacks == 0
    toggled.use_graph(False)
    b += [toggled.train_step(x, y).item() for x, y in data[2 + STEPS:]]
    assert not toggled.graphed
    assert_close_runs(a, b)


def test_apply_graph_column_captures_the_stage_session():
    """apply's graph column on an eager stage: Workload.use_graph makes its next steps warm up, capture and
    replay the stage's own OptimizedSwin (not eager steps under a graph label)."""
    from workbench.ladder.interleave import build_stage_workload
    from workbench.optimize.workload import WorkloadConfig

    workload, _ = build_stage_workload(WorkloadConfig(model=TINY_MODEL, batch=8, device="cuda"), "fmha")
    eager = [workload.step(i).item() for i in range(2)]
    workload.use_graph(True)
    graphed = [workload.step(i).item() for i in range(3)]
    assert workload.session.graph_captured and workload.session.eager_fallbacks == 0
    workload.use_graph(False)
    assert not workload.session.graphed and all(math.isfinite(v) for v in eager + graphed + [workload.step(9).item()])


def test_a_swinv2_predict_graph_follows_the_weights_as_they_change():
    """SwinV2's weight terms (position bias, logit scale) are cached between eager inference calls; the
    predict graph of a graph recipe computes them in the graph, so a replay after the weights changed in
    place (training steps, the EMA, load_state_dict) gives timm's logits for the new weights, not the terms
    of the capture."""
    from timm.models.swin_transformer_v2 import SwinTransformerV2

    def v2():
        torch.manual_seed(0)
        return SwinTransformerV2(img_size=32, patch_size=4, window_size=4, embed_dim=32, depths=(2, 2),
                                 num_heads=(2, 4), num_classes=10, drop_path_rate=0.0).cuda()

    graphed = optimize_swin(v2(), "fmha-graph", optimizer={"lr": 1e-3})
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        graphed.train_step(torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g))
    for _ in range(4):
        graphed.predict(x)
    assert graphed._predict_graphs.graphs
    state = graphed.state_dict()
    for key in state:
        if "cpb_mlp" in key or "logit_scale" in key:
            state[key] = state[key] * 2 + 0.5      # far from the terms the graph was captured with
    graphed.load_state_dict(state)
    plain = v2()
    plain.load_state_dict(state)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        want = plain.eval()(x.cuda()).float()
    got = graphed.predict(x)
    assert (got - want).norm() / want.norm() < 3e-2


def test_inference_replays_a_graph_per_batch_shape_with_the_eager_logits():
    """optimize_swin_inference on a GPU: each batch shape warms up, is captured and replayed, giving the
    logits its eager forward gives; past MAX_INFERENCE_GRAPHS shapes a batch runs eagerly, said once."""
    import warnings

    from workbench.api import optimize_swin_inference
    from workbench.optimize.inference import MAX_INFERENCE_GRAPHS

    graphed = optimize_swin_inference(tiny(), "dense")
    eager = optimize_swin_inference(tiny(), "dense", graph=False)
    assert graphed.graphed and not eager.graphed
    sizes = [8, 3, 5, 1, 2][:MAX_INFERENCE_GRAPHS + 1]
    for n in sizes[:-1]:
        x = batches(1, batch=n, seed=n)[0][0]
        for _ in range(4):
            assert torch.allclose(graphed(x), eager(x), rtol=1e-2, atol=1e-2)
    assert len(graphed.graphs) == MAX_INFERENCE_GRAPHS and graphed.eager_fallbacks == 0
    x = batches(1, batch=8, seed=11)[0][0]
    assert torch.allclose(graphed(x), eager(x), rtol=1e-2, atol=1e-2)      # a replay reads the new batch
    with pytest.warns(GraphFallbackWarning, match="predict ran eagerly"):
        graphed(batches(1, batch=sizes[-1])[0][0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graphed(batches(1, batch=sizes[-1])[0][0])                          # said once
    assert graphed.eager_fallbacks == 2
