"""Data parallel through torchrun on the CPU (gloo, two processes, the tiny Swin): `optimize_swin` under DDP
takes the same step as one process over the global batch (loss, and gradients read from an SGD step of
lr 1), every rank holds the same weights after it, and master weights get the averaged gradients; the
refusals of settings that cannot work."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workbench.api import DataParallel, optimize_swin
from workbench.errors import UserError
from workbench.models import TINY_MODEL, build_model
from workbench.optimize.distributed import data_parallel_settings

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from ddp_worker import PER_RANK, global_batch, one_step  # noqa: E402

WORLD = 2
# gradient of one step, relative to its norm: fp32 sums in another order; bf16 GEMM weights reduce in bf16
GRAD_TOLERANCE = {"baseline": 1e-5, "apex": 2e-2}


def torchrun(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(HERE.parent), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    import os

    env = {**os.environ, **env}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(WORLD), *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def ddp_steps(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    done = torchrun(str(HERE / "ddp_worker.py"), str(out), *GRAD_TOLERANCE)
    assert done.returncode == 0, done.stderr[-3000:]
    return {(recipe, r): torch.load(out / f"{recipe}-rank{r}.pt") for recipe in GRAD_TOLERANCE for r in range(WORLD)}


@pytest.mark.parametrize("recipe", list(GRAD_TOLERANCE))
def test_ddp_step_equals_one_process_over_the_global_batch(ddp_steps, recipe):
    ranks = [ddp_steps[recipe, r] for r in range(WORLD)]
    assert all(r["world"] == WORLD and r["shard"] == PER_RANK for r in ranks)
    assert any("DDP over 2 processes" in n for n in ranks[0]["notes"])
    x, y = global_batch(WORLD)
    loss, before, after, notes = one_step(recipe, x, y, False)
    assert not any("DDP" in n for n in notes)
    # equal shards: the global batch's mean loss is the mean of the ranks' losses
    assert sum(r["loss"] for r in ranks) / WORLD == pytest.approx(loss, rel=1e-5)
    for name, w0 in before.items():
        # every rank starts from and ends at the same weights
        for r in ranks[1:]:
            assert torch.equal(r["before"][name], ranks[0]["before"][name]), name
            assert torch.equal(r["after"][name], ranks[0]["after"][name]), name
        assert torch.equal(ranks[0]["before"][name], w0), name
        if not w0.is_floating_point():
            continue
        grad_one = (w0 - after[name]).double()
        grad_ddp = (ranks[0]["before"][name] - ranks[0]["after"][name]).double()
        scale = grad_one.norm().clamp_min(1e-12)
        assert (grad_ddp - grad_one).norm() / scale <= GRAD_TOLERANCE[recipe], name


def test_without_a_process_group_ddp_is_off_or_refused():
    assert data_parallel_settings(None) is None and data_parallel_settings(False) is None
    with pytest.raises(UserError, match="not initialized: start the script with torchrun"):
        data_parallel_settings(True)


@pytest.mark.parametrize("value, message", [
    ({"bucket_mb": 10}, "unknown DDP setting 'bucket_mb'"),
    ({"bucket_cap_mb": 0}, "bucket_cap_mb must be a number > 0"),
    ({"static_graph": "yes"}, "static_graph must be True or False"),
    ("ddp", "distributed must be None"),
])
def test_bad_ddp_settings_are_user_errors(value, message):
    with pytest.raises(UserError, match=message):
        data_parallel_settings(value)


def test_static_graph_is_off_by_default_with_accumulation_and_refused_when_asked():
    assert DataParallel().static_graph
    with pytest.raises(UserError, match="static_graph does not go with accumulate > 1"):
        data_parallel_settings({"static_graph": True}, accumulate=2)


def test_graph_recipes_are_refused_under_ddp():
    with pytest.raises(UserError, match="replays CUDA graphs.*use the recipe it extends \\(fmha\\)"):
        optimize_swin(build_model(TINY_MODEL), "fmha-graph", distributed=True)
