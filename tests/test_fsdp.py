"""FSDP2 through torchrun on the CPU (gloo, two processes, the tiny Swin): `optimize_swin(distributed=FullyShard)`
trains as one process does over the global batch (losses, and the weights after three clipped SGD steps),
each rank holds half of the weights, state_dict() gives the whole weights of a plain timm Swin, and
load_state_dict takes them back; master weights stand aside; the refusals of settings that cannot work."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workbench.api import FullyShard, optimize_swin
from workbench.errors import UserError
from workbench.models import TINY_MODEL, build_model
from workbench.optimize.distributed import data_parallel_settings

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from fsdp_worker import global_batches, predict_batch, train  # noqa: E402

WORLD = 2
# recipe:unit:reshard under FSDP -> the one-process recipe it is held against, and the tolerance of the
# weights' change over the steps relative to its norm: fp32 sums in another order; under bf16 FSDP
# gathers bf16 weights where the one process steps apex's master weights
CONFIGS = {"baseline:block:reshard": ("baseline", 1e-5), "baseline:stage:keep": ("baseline", 1e-5),
           "apex:block:reshard": ("apex", 5e-2)}
LOSS_TOLERANCE = {"baseline": 1e-5, "apex": 1e-2}


def torchrun(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(WORLD), *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    done = torchrun(str(HERE / "fsdp_worker.py"), str(out), *CONFIGS)
    assert done.returncode == 0, done.stderr[-3000:]
    return {(config, r): torch.load(out / f"{config.replace(':', '_')}-rank{r}.pt") for config in CONFIGS
            for r in range(WORLD)}


@pytest.fixture(scope="module")
def one_process():
    """recipe -> (losses, state_dict) of one process over the global batches."""
    runs = {}
    for recipe in {r for r, _ in CONFIGS.values()}:
        swin, losses = train(recipe, global_batches(WORLD), False)
        runs[recipe] = losses, swin.state_dict()
    return runs


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fsdp_training_equals_one_process_over_the_global_batch(fsdp_runs, one_process, config):
    recipe, tolerance = CONFIGS[config]
    ranks = [fsdp_runs[config, r] for r in range(WORLD)]
    assert all(r["world"] == WORLD for r in ranks)
    assert any("FSDP over 2 processes" in n for n in ranks[0]["notes"])
    losses, state = one_process[recipe]
    # equal shards: the global batch's mean loss is the mean of the ranks' losses, step by step
    mean = [sum(step) / WORLD for step in zip(*(r["losses"] for r in ranks))]
    assert mean == pytest.approx(losses, rel=LOSS_TOLERANCE[recipe])
    torch.manual_seed(0)
    start = build_model(TINY_MODEL, drop_path_rate=0.0).state_dict()
    for name, w in state.items():
        assert torch.equal(ranks[1]["state"][name], ranks[0]["state"][name]), name     # every rank gets it all
        if not w.is_floating_point():
            assert torch.equal(ranks[0]["state"][name], w), name
            continue
        change_one, change_fsdp = (w - start[name]).double(), (ranks[0]["state"][name] - start[name]).double()
        # plus a few fp32 roundings of the weight itself, for changes that are tiny next to it
        allowed = tolerance * change_one.norm() + 4 * torch.finfo(torch.float32).eps * w.double().norm()
        assert (change_fsdp - change_one).norm() <= allowed, name


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fsdp_state_dict_is_whole_and_loads_into_a_plain_swin(fsdp_runs, config):
    rank0 = fsdp_runs[config, 0]
    plain = build_model(TINY_MODEL, drop_path_rate=0.0)
    expected = plain.state_dict()
    assert list(rank0["state"]) == list(expected)
    for name, value in rank0["state"].items():
        assert type(value) is torch.Tensor, name
        assert value.shape == expected[name].shape and value.dtype == expected[name].dtype, name
    plain.load_state_dict(rank0["state"])
    # each rank held its half of every parameter (dim 0 split evenly, the odd row to the first ranks)
    total = sum(p.numel() for p in plain.parameters())
    assert sum(fsdp_runs[config, r]["held"] for r in range(WORLD)) == total
    assert rank0["held"] < 0.6 * total


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fsdp_load_state_dict_takes_a_plain_swin_and_predicts_as_it_does(fsdp_runs, config):
    torch.manual_seed(5)
    plain = build_model(TINY_MODEL, drop_path_rate=0.0).eval()
    with torch.no_grad():
        expected = plain(predict_batch())
    for r in range(WORLD):
        logits = fsdp_runs[config, r]["logits"]
        assert (logits - expected).norm() / expected.norm() <= (1e-5 if config.startswith("baseline") else 2e-2)


def test_master_weights_stand_aside_under_fsdp(fsdp_runs):
    notes = fsdp_runs["apex:block:reshard", 0]["notes"]
    assert any(n.startswith("pass master_weights not applied under FSDP") for n in notes), notes
    assert "master_weights: not applied under FSDP" in fsdp_runs["apex:block:reshard", 0]["describe"]


def test_master_weights_pass_leaves_the_model_as_it_is_when_sharded():
    from workbench.optimize.passes import PassContext, master_weights
    from workbench.precision import resolve_precision

    model = build_model(TINY_MODEL)
    ctx = PassContext(device=torch.device("cpu"), precision=resolve_precision("bf16"), sharded=True)
    same, result = master_weights.apply(model, ctx)
    assert same is model and result.available and result.details == {"applied": False}
    assert ctx.master_weights is None and all(p.dtype == torch.float32 for p in model.parameters())
    assert len(result.changed.splitlines()) == 1


def test_fused_adamw_under_fsdp_is_torch_fused_and_refuses_apex():
    from workbench.optimize.passes import PassContext, PassUnavailable, fused_adamw
    from workbench.precision import resolve_precision

    ctx = PassContext(device=torch.device("cuda"), precision=resolve_precision("bf16"), sharded=True)
    fused_adamw.apply(None, ctx)
    assert ctx.optimizer_name == "torch.optim.AdamW(fused=True)"
    with pytest.raises(PassUnavailable, match="DTensor"):
        fused_adamw.apply(None, ctx, impl="apex")


def test_without_a_process_group_fsdp_is_refused():
    with pytest.raises(UserError, match="asks for FSDP, but torch.distributed is not initialized"):
        data_parallel_settings("fsdp")


@pytest.mark.parametrize("value, message", [
    ({"strategy": "fsdp", "bucket_cap_mb": 10}, "unknown FSDP setting 'bucket_cap_mb'"),
    ({"strategy": "fsdp", "unit": "layer"}, "unit must be one of block, stage"),
    ({"strategy": "fsdp", "reshard_after_forward": "yes"}, "reshard_after_forward must be True or False"),
    ({"strategy": "zero3"}, "strategy must be one of ddp, fsdp"),
    ("FSDP", "distributed must be None"),
])
def test_bad_fsdp_settings_are_user_errors(value, message):
    with pytest.raises(UserError, match=message):
        data_parallel_settings(value)


def test_graph_recipes_are_refused_under_fsdp():
    with pytest.raises(UserError, match="replays CUDA graphs, which swinbench does not run under FSDP"):
        optimize_swin(build_model(TINY_MODEL), "fmha-graph", distributed=FullyShard())
