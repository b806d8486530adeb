"""FSDP2 through torchrun on the CPU (gloo, two processes, the tiny Swin): `optimize_swin(distributed=FullyShard)`
trains as one process does over the global batch (losses, and the weights after three clipped SGD steps, with
and without gradient accumulation),
each rank holds half of the weights, state_dict() gives the whole weights of a plain timm Swin, and
load_state_dict takes them back; master weights stand aside; the refusals of settings that cannot work."""
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
from cpu_torchrun import WORLD, run_output, torchrun  # noqa: E402

AMP_MASTER = str(HERE / "data" / "recipes" / "amp-master.yaml")     # amp + master_weights, no Triton
# recipe:unit:reshard under FSDP -> the one-process recipe it is held against, and the tolerance of the
# weights' change over the steps relative to its norm: fp32 sums in another order; under bf16 FSDP
# gathers bf16 weights where the one process steps master weights
CONFIGS = {"baseline:block:reshard": ("baseline", 1e-5), "baseline:stage:keep": ("baseline", 1e-5),
           "baseline:block:reshard:acc3": ("baseline", 1e-5), f"{AMP_MASTER}:block:reshard": (AMP_MASTER, 5e-2)}
LOSS_TOLERANCE = {"baseline": 1e-5, AMP_MASTER: 1e-2}


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    configs = [*CONFIGS, "scaling"]
    done = torchrun(str(HERE / "fsdp_worker.py"), str(out), *configs)
    assert done.returncode == 0, run_output(done)
    return {(config, r): torch.load(out / f"{i}-rank{r}.pt") for i, config in enumerate(configs)
            for r in range(WORLD)}


@pytest.fixture(scope="module")
def one_process():
    """recipe -> (losses, state_dict) of one process over the global batches."""
    runs = {}
    for recipe in {r for r, _ in CONFIGS.values()}:
        swin, losses = train(recipe, global_batches(WORLD), False)
        runs[recipe] = losses, swin.state_dict()
    return runs


@pytest.mark.parametrize("config", list(CONFIGS), ids=lambda c: c.replace(AMP_MASTER, "amp-master"))
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


@pytest.mark.parametrize("config", list(CONFIGS), ids=lambda c: c.replace(AMP_MASTER, "amp-master"))
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


@pytest.mark.parametrize("config", list(CONFIGS), ids=lambda c: c.replace(AMP_MASTER, "amp-master"))
def test_fsdp_load_state_dict_takes_a_plain_swin_and_predicts_as_it_does(fsdp_runs, config):
    torch.manual_seed(5)
    plain = build_model(TINY_MODEL, drop_path_rate=0.0).eval()
    with torch.no_grad():
        expected = plain(predict_batch())
    for r in range(WORLD):
        logits = fsdp_runs[config, r]["logits"]
        assert (logits - expected).norm() / expected.norm() <= CONFIGS[config][1]


def test_master_weights_stand_aside_under_fsdp(fsdp_runs):
    run = fsdp_runs[f"{AMP_MASTER}:block:reshard", 0]
    assert any(n.startswith("pass master_weights not applied under FSDP") for n in run["notes"]), run["notes"]
    assert "master_weights: not applied under FSDP" in run["describe"]


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


def test_a_swinv2_is_refused_under_fsdp_before_any_pass(monkeypatch, tmp_path):
    """FSDP shards timm's SwinTransformerBlocks (or stages); a SwinV2's are other classes. The refusal comes
    before the recipe's passes would change the user's model."""
    import torch.distributed as dist
    from timm.models.swin_transformer_v2 import SwinTransformerV2

    import workbench.optimize.trainer as trainer

    def no_pass(*args, **kwargs):
        raise AssertionError("a pass ran before the refusal")

    monkeypatch.setattr(trainer, "apply_chain_passes", no_pass)
    model = SwinTransformerV2(img_size=32, patch_size=4, window_size=4, embed_dim=16, depths=(1, 1),
                              num_heads=(1, 2), num_classes=10)
    dist.init_process_group("gloo", init_method=(tmp_path / "group").as_uri(), rank=0, world_size=1)
    try:
        for unit in ("block", "stage"):
            with pytest.raises(UserError, match=f"FSDP shards a timm Swin by {unit}, and this SwinTransformerV2 "
                                                "has no SwinTransformer"):
                optimize_swin(model, "amp", distributed=FullyShard(unit=unit))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- swinbench train --nproc --parallel fsdp


def test_train_nproc_2_parallel_fsdp_trains_and_validates_on_every_rank(tmp_path):
    import json
    import math

    from typer.testing import CliRunner

    from cli import app

    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "--nproc", "2", "--parallel", "fsdp", "--device", "cpu", "--steps", "2",
                                      "--batch", "6", "--out", str(out)])
    assert result.exit_code == 0, result.output + (out / "torchrun.log").read_text()
    (records,) = (out / "records").iterdir()
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert [r["kind"] for r in lines] == ["run", "step", "step", "epoch", "end"]
    header, end = lines[0], lines[-1]
    assert header["parallel"] == "fsdp" and header["world_size"] == 2 and header["global_batch"] == 12
    assert end["status"] == "ok" and any("FSDP over 2 processes" in n for n in end["notes"])
    assert all(math.isfinite(r["loss"]) for r in lines if r["kind"] == "step")
    assert all(r["grad_norm"] > 0 for r in lines if r["kind"] == "step")     # a plain number from the shards
    assert 0 <= lines[3]["val_acc"] <= 100
    assert "2 processes (FSDP, torchrun)" in (out / "report.md").read_text()


# ---------------------------------------------------------------- swinbench apply --nproc --parallel fsdp


def test_apply_scaling_under_fsdp_gates_the_sharded_baseline_against_one_process(fsdp_runs):
    s = fsdp_runs["scaling", 0]
    assert s["status"] == "ok" and s["world_size"] == 2 and s["global_batch"] == 8, s
    assert s["ddp"] == {"strategy": "fsdp", "unit": "block", "reshard_after_forward": True}
    assert s["img_per_s"] > 0 and len(s["step_ms_per_rank"]) == 2
    # the sharded baseline against one process over the global batch of 8: the same logits, loss, gradients
    assert s["gate"]["ranks"] == ["PASS", "PASS"]
    metrics = s["gate"]["metrics"]
    assert metrics["logits"]["rel_l2"] <= 1e-6 and metrics["loss"]["abs_diff"] <= 1e-6
    assert all(g["rel_l2"] <= 1e-5 for g in metrics["grads"].values())


def test_apply_parallel_mistakes_are_one_line_and_exit_2(tmp_path):
    from typer.testing import CliRunner

    from cli import app

    out = tmp_path / "out"
    for args, message in ((["--parallel", "fsdp"], "--parallel goes with --nproc"),
                          (["--nproc", "2", "--parallel", "zero3"], "--parallel must be one of ddp, fsdp")):
        result = CliRunner().invoke(app, ["apply", "--device", "cpu", "--out", str(out), *args])
        assert result.exit_code == 2 and message in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1 and not out.exists()


def test_the_report_names_the_strategy_of_a_scaling_record(tmp_path):
    from record_helpers import record

    from workbench.results.record import StageRecord
    from workbench.results.report import render_report

    scaled = {**record(0, "fmha", None, 50.0), "scaling": {
        "world_size": 2, "backend": "gloo", "batch_per_process": 4, "global_batch": 8, "status": "ok",
        "reason": None, "img_per_s": 90.0, "step_ms": 88.9, "step_ms_per_rank": [88.1, 88.9], "efficiency": 0.9,
        "gate": {"status": "PASS", "reason": None, "ranks": ["PASS"] * 2, "metrics": {}},
        "ddp": {"strategy": "fsdp", "unit": "block", "reshard_after_forward": True}}}
    text = render_report([StageRecord.from_dict(scaled)], tmp_path / "report.md").read_text()
    assert "(gloo, FSDP: unit block, reshard_after_forward True)" in text


def test_a_torch_without_fully_shard_is_a_user_error(monkeypatch):
    import torch.distributed.fsdp as fsdp

    from workbench.optimize.distributed import require_fully_shard

    monkeypatch.delattr(fsdp, "fully_shard")
    with pytest.raises(UserError, match="FSDP needs torch.distributed.fsdp.fully_shard \\(torch 2.6 or later\\)"):
        require_fully_shard()


def test_fp16_with_a_grad_scaler_is_refused_under_fsdp_by_one_rule():
    from workbench.optimize.distributed import sharding_blocker

    assert sharding_blocker(True, "cuda").startswith("fp16 with a GradScaler is not run under FSDP")
    assert sharding_blocker(True, "cpu") is None and sharding_blocker(False, "cuda") is None
