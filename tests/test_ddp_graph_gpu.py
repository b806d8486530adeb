"""CUDA-graph recipes under DDP on one GPU: a one-rank NCCL process group, so DDP's reducer and its
all-reduce (NCCL) run for real inside the captured step. The graph under DDP trains what the eager DDP
step trains (with and without accumulation), and `apply --nproc 1` times and gates a graph stage under
torchrun. Skipped without a GPU.

    python -m pytest -q -m gpu tests/test_ddp_graph_gpu.py
"""
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from workbench.api import optimize_swin
from workbench.models import TINY_MODEL
from workbench.optimize.distributed import DDP_GRAPH_WARMUP_STEPS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_api_gpu import assert_close_runs, batches, tiny  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS = DDP_GRAPH_WARMUP_STEPS + 4     # warm-up, capture, replays


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def nccl_group():
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_graph_under_ddp_trains_what_the_eager_ddp_step_trains(nccl_group, accumulate):
    kwargs = dict(optimizer={"lr": 1e-3}, grad_clip=1.0, accumulate=accumulate, distributed=True)
    eager = optimize_swin(tiny(), "fmha", **kwargs)
    graphed = optimize_swin(tiny(), "fmha-graph", **kwargs)
    assert graphed.ddp is not None and graphed.graph_warmup_steps == DDP_GRAPH_WARMUP_STEPS
    data = batches(STEPS * accumulate, batch=8 // accumulate)
    a = [eager.train_step(x, y).item() for x, y in data]
    b = [graphed.train_step(x, y).item() for x, y in data]
    tg = graphed._train_graphs
    assert tg is not None and graphed.eager_fallbacks == 0
    assert set(tg.graphs) == ({"step"} if accumulate == 1 else {"micro", "step"})
    assert_close_runs(a, b)
    # the replays moved the weights the way the eager DDP steps did: the same direction overall. (Per
    # tensor, AdamW's normalized steps turn bf16 noise in a near-zero gradient into a full step of
    # either sign, so a small tensor such as a bias table can differ by much more between two runs.)
    start, sa, sb = tiny().state_dict(), eager.state_dict(), graphed.state_dict()
    keys = [k for k in start if start[k].is_floating_point()]
    da = torch.cat([(sa[k].float() - start[k].float()).flatten() for k in keys])
    db = torch.cat([(sb[k].float() - start[k].float()).flatten() for k in keys])
    cosine = torch.nn.functional.cosine_similarity(da, db, dim=0).item()
    assert cosine > 0.95 and (da - db).norm() / da.norm() < 0.3, (cosine, ((da - db).norm() / da.norm()).item())


def test_a_batch_of_another_size_runs_the_eager_ddp_step(nccl_group):
    graphed = optimize_swin(tiny(), "fmha-graph", optimizer={"lr": 1e-3}, distributed=True)
    for x, y in batches(STEPS):
        graphed.train_step(x, y)
    with pytest.warns(UserWarning, match="batch of"):
        loss = graphed.train_step(*batches(1, batch=3, seed=2)[0])
    assert torch.isfinite(loss) and graphed.eager_fallbacks == 1
    graphed.train_step(*batches(1, seed=3)[0])     # and replays again after it
    assert graphed.eager_fallbacks == 1


def test_the_compiled_graph_under_ddp_trains_what_the_eager_ddp_step_trains(nccl_group):
    """The fused stack's fastest training form (fmha-compile-graph: torch.compile, the whole step in one
    CUDA graph) under DDP: Dynamo's DDP optimizer splits the compiled graph at the buckets, and the
    all-reduce they launch is captured with the step."""
    kwargs = dict(optimizer={"lr": 1e-3}, grad_clip=1.0, distributed=True)
    eager = optimize_swin(tiny(), "fmha", **kwargs)
    graphed = optimize_swin(tiny(), "fmha-compile-graph", **kwargs)
    assert graphed.ddp is not None and graphed.graph_warmup_steps == DDP_GRAPH_WARMUP_STEPS
    data = batches(STEPS)
    a = [eager.train_step(x, y).item() for x, y in data]
    b = [graphed.train_step(x, y).item() for x, y in data]
    assert graphed._train_graphs is not None and graphed.eager_fallbacks == 0
    assert_close_runs(a, b)


@pytest.mark.slow
def test_apply_nproc_1_times_and_gates_a_graph_stage_under_ddp(tmp_path):
    from typer.testing import CliRunner

    from cli import app
    from workbench.results.record import read_records

    os.environ.pop("RANK", None)
    out = tmp_path / "run"
    stages = "fmha,fmha-graph,fmha-compile-graph,torch-compile-graph"
    result = CliRunner().invoke(app, ["apply", "--model", TINY_MODEL, "--stages", stages, "--nproc", "1", "--batch", "8",
                                      "--steps", "5", "--warmup", "2", "--interleave", "0", "--out", str(out)])
    assert result.exit_code == 0, result.output
    records = {r.stage: r for r in read_records([out / "records"])}
    for stage in ("fmha-graph", "fmha-compile-graph", "torch-compile-graph"):
        s = records[stage].scaling
        assert s.status == "ok", (stage, s.status, s.reason)
        assert s.backend == "nccl" and s.gate["ranks"] == ["PASS"] and s.img_per_s > 0
