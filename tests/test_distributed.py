"""Data parallel through torchrun on the CPU (gloo, two processes, the tiny Swin): `optimize_swin` under DDP
takes the same step as one process over the global batch (loss, and gradients read from an SGD step of
lr 1), every rank holds the same weights after it, and master weights get the averaged gradients; the
refusals of settings that cannot work."""
import json
import math
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
from cpu_torchrun import WORLD, run_output, torchrun  # noqa: E402

# gradient of one step, relative to its norm: fp32 sums in another order; bf16 GEMM weights reduce in bf16
GRAD_TOLERANCE = {"baseline": 1e-5, "apex": 2e-2}


@pytest.fixture(scope="module")
def ddp_steps(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    done = torchrun(str(HERE / "ddp_worker.py"), str(out), *GRAD_TOLERANCE)
    assert done.returncode == 0, run_output(done)
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
    ("zero3", "distributed must be None"),
])
def test_bad_ddp_settings_are_user_errors(value, message):
    with pytest.raises(UserError, match=message):
        data_parallel_settings(value)


def test_static_graph_is_off_by_default_with_accumulation_and_refused_when_asked():
    assert DataParallel().static_graph
    with pytest.raises(UserError, match="static_graph does not go with accumulate > 1"):
        data_parallel_settings({"static_graph": True}, accumulate=2)


def test_graph_recipes_are_refused_under_fsdp_only():
    with pytest.raises(UserError, match="does not run under FSDP.*use DDP, or the recipe it extends \\(fmha\\)"):
        optimize_swin(build_model(TINY_MODEL), "fmha-graph", distributed="fsdp")
    with pytest.raises(UserError) as refused:     # under DDP the graph is not what stops it (no process group)
        optimize_swin(build_model(TINY_MODEL), "fmha-graph", distributed=True)
    assert "CUDA graphs" not in str(refused.value)


# ---------------------------------------------------------------- swinbench train --nproc


def test_digit_shards_are_the_one_process_global_batches_cut_in_rank_order():
    from workbench.datasets import DigitsData

    data = DigitsData.load((56, 56))
    one = list(data.train_batches(1, 10, 3, "cpu"))
    shards = [list(data.train_batches(1, 5, 3, "cpu", rank, 2)) for rank in range(2)]
    assert len(one) == len(shards[0]) == len(shards[1]) == data.train_size // 10
    for (x, y), (x0, y0), (x1, y1) in zip(one, *shards):
        assert len(y0) == len(y1) == 5
        assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y)


def test_torchrun_arguments_for_one_and_several_machines():
    from workbench.train.launch import torchrun_arguments
    from workbench.train.loop import TrainConfig

    assert torchrun_arguments(TrainConfig(nproc=8)) == ["--standalone", "--nnodes", "1", "--nproc-per-node", "8"]
    assert torchrun_arguments(TrainConfig(nproc=8, nnodes=2, rdzv_endpoint="node0:29500")) == [
        "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29500", "--rdzv-id", "swinbench",
        "--nproc-per-node", "8"]


def test_train_nproc_2_writes_one_record_file_from_rank_0(tmp_path):
    from typer.testing import CliRunner

    from cli import app

    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "--nproc", "2", "--device", "cpu", "--steps", "2", "--batch", "6",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output + (out / "torchrun.log").read_text()
    assert "global batch 12" in result.output
    files = list((out / "records").iterdir())
    assert len(files) == 1
    lines = [json.loads(line) for line in files[0].read_text().splitlines()]
    kinds = [r["kind"] for r in lines]
    assert kinds == ["run", "step", "step", "epoch", "end"]      # once, not once per rank
    header, end = lines[0], lines[-1]
    assert header["world_size"] == 2 and header["batch"] == 6 and header["global_batch"] == 12
    assert header["steps_per_epoch"] == 1200 // 12
    assert end["status"] == "ok" and any("DDP over 2 processes" in n for n in end["notes"])
    assert all(math.isfinite(r["loss"]) and r["img_per_s"] > 0 for r in lines if r["kind"] == "step")
    report = (out / "report.md").read_text()
    assert "batch 6 per process x 2 processes (global 12)" in report and "its img/s the sum of theirs" in report


@pytest.mark.parametrize("args, message", [
    (["--nproc", "0"], "--nproc must be"),
    (["--nnodes", "2"], "go with --nproc"),
    (["--nproc", "2", "--nnodes", "2"], "needs --rdzv-endpoint"),
    (["--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", "node0"], "takes HOST:PORT"),
    (["--nproc", "2", "--batch", "700"], "x 2 processes is larger than the 1200 training images"),
    (["--nproc", "2", "--parallel", "zero3"], "--parallel must be one of ddp, fsdp, got 'zero3'"),
    (["--parallel", "fsdp"], "--parallel goes with --nproc"),
    (["--nproc", "2", "--parallel", "fsdp", "--recipe", "fmha-graph"], "does not run under FSDP"),
])
def test_train_nproc_mistakes_are_one_line_and_exit_2(tmp_path, args, message):
    from typer.testing import CliRunner

    from cli import app

    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["train", "--device", "cpu", "--out", str(out), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert not out.exists()


# ---------------------------------------------------------------- swinbench apply --nproc


@pytest.mark.slow
def test_apply_nproc_2_adds_a_scaling_record_gated_on_every_rank(tmp_path):
    from typer.testing import CliRunner

    from cli import app
    from workbench.results.record import read_records

    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["apply", "--stages", "baseline", "--nproc", "2", "--device", "cpu", "--batch",
                                      "4", "--steps", "2", "--warmup", "1", "--interleave", "0", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "baseline: data parallel, 2 processes under torchrun" in result.output
    (record,) = read_records([out / "records"])
    s = record.scaling
    assert s.status == "ok" and s.world_size == 2 and s.batch_per_process == 4 and s.global_batch == 8
    assert s.backend == "gloo" and len(s.step_ms_per_rank) == 2 and s.step_ms == max(s.step_ms_per_rank)
    assert len(s.step_iqr_ms_per_rank) == 2 and min(s.step_iqr_ms_per_rank) >= 0
    assert s.img_per_s == pytest.approx(8 / (s.step_ms / 1e3))
    assert s.efficiency == pytest.approx(s.img_per_s / (2 * record.img_per_s))
    # the baseline under DDP against one process over the global batch of 8: the same logits, loss, gradients
    assert s.gate["ranks"] == ["PASS", "PASS"] and s.gate["metrics"]["weights_match"]
    metrics = s.gate["metrics"]
    assert metrics["logits"]["rel_l2"] <= 1e-6 and metrics["loss"]["abs_diff"] <= 1e-6
    assert all(g["rel_l2"] <= 1e-6 for g in metrics["grads"].values())
    # each rank's gloo all-reduces, from steps under torch.profiler: some time, no more of it exposed than there is
    comm = s.comm
    assert comm["steps"] == 3 and len(comm["comm_ms_per_rank"]) == len(comm["exposed_ms_per_rank"]) == 2
    assert all(c > 0 and 0 <= e <= c + 1e-6 for c, e in zip(comm["comm_ms_per_rank"], comm["exposed_ms_per_rank"]))
    report = (out / "report.md").read_text()
    assert "## Data parallel: 2 processes" in report and "communication ms per step per rank (not overlapped)" in report
    # a CPU run's efficiency pits one thread per rank against every core: said where it is shown
    assert "not like for like" in report and "not like for like" in " ".join(result.output.split())
    # the run checked against itself: its data-parallel figures are compared too
    check = CliRunner().invoke(app, ["check", "--baseline", str(out / "records"), "--current", str(out / "records")])
    assert check.exit_code == 0 and "| baseline | dp_step_ms |" in check.output


@pytest.mark.parametrize("args, message", [
    (["--nproc", "0"], "--nproc must be a whole number >= 1"),
    (["--nproc", "2", "--mode", "infer"], "use --mode train"),
])
def test_apply_nproc_mistakes_are_one_line_and_exit_2(tmp_path, args, message):
    from typer.testing import CliRunner

    from cli import app

    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["apply", "--device", "cpu", "--out", str(out), *args])
    assert result.exit_code == 2 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not out.exists()


def test_resume_keeps_the_data_parallel_figures_and_refuses_another_world_size(tmp_path, monkeypatch):
    """A resumed apply --nproc keeps each kept stage's figures (scaling.sh reruns with --resume: measured
    figures are neither lost nor paid for again on the GPUs); --nproc of another world size is refused."""
    from typer.testing import CliRunner

    from cli import app
    from workbench.ladder import scaling
    from workbench.results.record import read_records, write_record

    calls = []

    def fake_scale(record, spec, nproc, extra_env=None, parallel="ddp"):
        calls.append(record["stage"])
        record["scaling"] = {
            "world_size": nproc, "backend": "gloo", "batch_per_process": 4, "global_batch": 4 * nproc,
            "status": "ok", "reason": None, "img_per_s": 80.0 + len(calls), "step_ms": 100.0,
            "step_ms_per_rank": [100.0] * nproc, "efficiency": 0.9, "ddp": {"strategy": parallel},
            "gate": {"status": "PASS", "reason": None, "ranks": ["PASS"] * nproc, "metrics": {}}}
        record["_path"] = str(write_record(record, Path(spec.out_dir) / "records"))
        return record
    monkeypatch.setattr(scaling, "scale_stage", fake_scale)
    out = tmp_path / "run"
    args = ["apply", "--stages", "baseline", "--device", "cpu", "--batch", "4", "--steps", "1", "--warmup", "0",
            "--interleave", "0", "--out", str(out)]
    assert CliRunner().invoke(app, [*args, "--nproc", "2"]).exit_code == 0 and calls == ["baseline"]
    again = CliRunner().invoke(app, [*args, "--nproc", "2", "--resume"])
    assert again.exit_code == 0, again.output
    assert calls == ["baseline"] and "data parallel at 2 processes kept from the earlier run" in again.output
    (kept,) = read_records([out / "records"])
    assert kept.scaling.img_per_s == 81.0
    other = CliRunner().invoke(app, [*args, "--nproc", "1", "--resume"])
    assert other.exit_code == 2 and "data-parallel figures at 2 processes (ddp) there vs --nproc 1" in other.output
    assert len(other.output.strip().splitlines()) == 1 and calls == ["baseline"]


@pytest.mark.slow
def test_train_nproc_1_through_torchrun_matches_the_plain_run(tmp_path):
    from typer.testing import CliRunner

    from cli import app

    losses = {}
    for name, extra in (("plain", []), ("torchrun", ["--nproc", "1"])):
        out = tmp_path / name
        result = CliRunner().invoke(app, ["train", "--device", "cpu", "--steps", "2", "--batch", "8", "--out", str(out),
                                          *extra])
        assert result.exit_code == 0, result.output
        (records,) = (out / "records").iterdir()
        lines = [json.loads(line) for line in records.read_text().splitlines()]
        assert lines[0]["world_size"] == 1 and lines[0]["global_batch"] == 8
        losses[name] = [r["loss"] for r in lines if r["kind"] == "step"]
    assert losses["torchrun"] == pytest.approx(losses["plain"], rel=1e-5)


def test_scaling_is_an_optional_record_field_that_is_validated(tmp_path):
    from record_helpers import record

    from workbench.results.record import StageRecord
    from workbench.results.report import render_report

    plain = record(0, "fmha", None, 50.0)
    assert "scaling" not in StageRecord.from_dict(plain).to_dict()      # old records read and write as before
    scaled = {**plain, "scaling": {
        "world_size": 8, "backend": "nccl", "batch_per_process": 64, "global_batch": 512, "status": "ok",
        "reason": None, "img_per_s": 9000.0, "step_ms": 56.9, "step_ms_per_rank": [56.1] * 7 + [56.9],
        "efficiency": 0.88, "gate": {"status": "PASS", "reason": None, "ranks": ["PASS"] * 8, "metrics": {}},
        "ddp": {"bucket_cap_mb": 25.0}}}
    again = StageRecord.from_dict(StageRecord.from_dict(scaled).to_dict())
    assert again.scaling.efficiency == 0.88 and again.scaling.gate["ranks"] == ["PASS"] * 8
    text = render_report([again], tmp_path / "report.md").read_text()
    assert "## Data parallel: 8 processes" in text and "| 0.88 |" in text and "PASS on all 8 ranks" in text
    one = {**scaled, "scaling": {**scaled["scaling"], "world_size": 1, "global_batch": 64, "step_ms_per_rank": [56.9],
                                 "gate": {**scaled["scaling"]["gate"], "ranks": ["PASS"]}}}
    text = render_report([StageRecord.from_dict(one)], tmp_path / "one.md").read_text()
    assert "## Data parallel: 1 process through torchrun" in text and "| img/s, plain | img/s, under torchrun |" in text
    for field, value in (("status", "maybe"), ("img_per_s", None), ("world_size", 0), ("extra", 1)):
        bad = {**scaled, "scaling": {**scaled["scaling"], field: value}}
        with pytest.raises(UserError, match="scaling"):
            StageRecord.from_dict(bad)


def test_figures_written_before_a_crash_in_the_communication_profile_are_kept(tmp_path, monkeypatch):
    """The ranks write the stage's figures before the communication profile; a profiler that takes the
    processes down after that (an abort: torchrun exits non-zero) costs the `comm` figures only."""
    import json
    import sys
    from types import SimpleNamespace

    from record_helpers import record

    from workbench.ladder import scaling
    from workbench.results.record import StageRecord
    from workbench.results.report import render_report

    figures = {"world_size": 2, "backend": "gloo", "batch_per_process": 4, "global_batch": 8, "status": "ok",
               "reason": None, "img_per_s": 80.0, "step_ms": 100.0, "step_ms_per_rank": [99.0, 100.0],
               "efficiency": 0.9, "gate": {"status": "PASS", "reason": None, "ranks": ["PASS", "PASS"], "metrics": {}},
               "ddp": {"strategy": "ddp"}}
    fake_rank = ("import json, os, sys; spec = json.load(open(sys.argv[1])); "
                 f"open(spec['result'], 'w').write(json.dumps({figures!r})); os.abort()")

    def fake_torchrun(nproc, spec_path):
        return [sys.executable, "-c", fake_rank, str(spec_path)], {}
    monkeypatch.setattr(scaling, "torchrun_command", fake_torchrun)
    spec = SimpleNamespace(out_dir=str(tmp_path), stage_index=0, stage="fmha", config={"batch": 4})
    monkeypatch.setattr(scaling, "asdict", lambda s: vars(s))
    out = scaling.scale_stage(record(0, "fmha", None, 50.0), spec, 2)
    assert out["scaling"]["img_per_s"] == 80.0 and out["scaling"]["status"] == "ok"
    assert "during the communication profile" in out["scaling"]["comm_error"]
    stored = StageRecord.from_dict(json.loads(Path(out["_path"]).read_text()))
    assert stored.scaling.img_per_s == 80.0 and not stored.scaling.comm
    text = render_report([stored], tmp_path / "report.md").read_text()
    assert "not measured: torchrun exited with" in text


def test_imagefolder_shards_are_equal_and_disjoint(tmp_path):
    pytest.importorskip("torchvision")
    from PIL import Image

    from workbench.datasets import ImageFolderData

    for c in range(2):
        folder = tmp_path / "images" / f"class{c}"
        folder.mkdir(parents=True)
        for i in range(23):
            Image.new("RGB", (12, 12), (100 * c, 10 * i, 0)).save(folder / f"{i}.png")
    data = ImageFolderData(tmp_path / "images", (8, 8), 0)           # 42 training images, 4 held out
    seen = []
    for rank in range(2):
        batches = list(data.train_batches(0, 5, 0, "cpu", rank, 2))
        assert len(batches) == data.train_size // 2 // 5 and all(len(y) == 5 for _, y in batches)
        seen.append(batches)
    # each image is one flat colour, which crops and flips keep: its colour names it
    names = [{tuple(torch.round(x[i, :, 0, 0] * 100).tolist()) for x, _ in batches
              for i in range(len(x))} for batches in seen]
    assert len(names[0]) == len(names[1]) == data.train_size // 2 // 5 * 5
    assert not names[0] & names[1]                          # the ranks' shares are disjoint


def test_which_graphs_run_data_parallel():
    from workbench.optimize.workload import Workload, WorkloadConfig

    workload = Workload.build(WorkloadConfig(model=TINY_MODEL, batch=2, device="cpu"))
    assert workload.parallel_blocker("ddp") is None and workload.parallel_blocker("fsdp") is None
    workload.ctx.cuda_graph = True      # the stage's whole step as one graph: DDP's all-reduce goes inside it
    assert workload.parallel_blocker("ddp") is None
    assert "does not run it under FSDP" in workload.parallel_blocker("fsdp")
    workload.ctx.cuda_graph = False
    workload.ctx.compile, workload.ctx.compile_options = True, {"mode": "reduce-overhead"}
    assert "Inductor's CUDA graphs" in workload.parallel_blocker("ddp")


@pytest.mark.slow
def test_apply_nproc_2_runs_a_compiled_stage_under_ddp(tmp_path):
    """torch.compile under DDP (Dynamo's DDP optimizer splits the graph at bucket boundaries): the stage
    runs under torchrun and passes its gate on every rank."""
    from typer.testing import CliRunner

    from cli import app
    from workbench.results.record import read_records

    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["apply", "--stages", "torch-compile", "--nproc", "2", "--device", "cpu",
                                      "--batch", "4", "--steps", "2", "--warmup", "1", "--interleave", "0",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    (record,) = read_records([out / "records"])
    s = record.scaling
    assert s.status == "ok" and s.world_size == 2 and s.gate["ranks"] == ["PASS", "PASS"], (s.status, s.reason)


def test_review_nproc_refusals_and_rank_import_paths(tmp_path, monkeypatch):
    """profile --nproc measures training only; Inductor-graph recipes run under neither DDP nor FSDP;
    torchrun's ranks never import from the current folder."""
    from typer.testing import CliRunner

    from cli import app
    from workbench.capture.backends import torchrun_module_command
    from workbench.train.loop import TrainConfig, plan_runs

    result = CliRunner().invoke(app, ["profile", "--mode", "infer", "--nproc", "2", "--device", "cpu",
                                      "--out", str(tmp_path / "p")])
    assert result.exit_code == 2 and "use --mode train" in result.output, result.output
    config = TrainConfig(nproc=2, recipe="torch-compile-graphs", device="cpu")
    config.check()
    with pytest.raises(UserError, match="replays Inductor's own CUDA graphs"):
        plan_runs(config, True)
    cmd, env = torchrun_module_command(["--standalone", "--nproc-per-node", "2"], "workbench.train.rank", "spec")
    rank = cmd[cmd.index("--no-python") + 1:]         # each rank's own interpreter, as a stage process's
    assert rank[0] == sys.executable and rank[-1] == "spec" and ("-P" in rank or rank[1] == "-c")
    assert "-m" not in cmd[3:cmd.index("--no-python")]   # torchrun's own -m would put the cwd back
    assert env["PYTHONUNBUFFERED"] == "1"


def test_more_cpu_processes_than_cores_are_said_to_measure_contention(monkeypatch):
    import os

    from workbench.optimize.distributed import oversubscribed_note

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert oversubscribed_note(None, cpu) is None and oversubscribed_note(2, cpu) is None
    assert oversubscribed_note(4, gpu) is None
    assert oversubscribed_note(3, cpu) == ("--nproc 3 on 2 CPU cores: the processes share cores, so their step "
                                           "times (and the efficiency) measure contention, not data parallelism")
