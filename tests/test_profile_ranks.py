"""`profile --nproc N` and `analyze FOLDER`: one capture per rank under torchrun (gloo on the CPU, the tiny
Swin in DDP), each rank's tables in its folder, and the ranks table read from the traces together;
the interval arithmetic behind its overlap figures on hand-made kernels."""
import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from cli import app
from workbench.analysis.ranks import _intersection_ns, _merged, rank_row, rank_summary
from workbench.trace import KERNEL_COLUMNS, RANGE_COLUMNS, Trace, finish_frame

runner = CliRunner()


def test_profile_nproc_2_captures_every_rank_and_reads_them_together(tmp_path, monkeypatch):
    from workbench.capture import profile as profile_module
    from workbench.results.remedy_gains import RemedyGains

    asked = []   # each rank's findings take the measured gains of the stage records, as one process's do
    monkeypatch.setattr(profile_module, "findings_gains",
                        lambda records, trace, meta: asked.append(trace) or RemedyGains(note="gains looked up"))
    out = tmp_path / "p"
    result = runner.invoke(app, ["profile", "--device", "cpu", "--nproc", "2", "--batch", "2", "--steps", "2",
                                 "--warmup", "1", "--out", str(out), "--no-timeline"])
    assert result.exit_code == 0, result.output
    assert [t.parent.name for t in asked] == ["rank0", "rank1"] and result.output.count("gains looked up") == 1
    for rank in (0, 1):
        run = json.loads((out / f"rank{rank}" / "run.json").read_text())
        assert run["rank"] == rank and run["world_size"] == 2 and run["dist_backend"] == "gloo"
        assert (out / f"rank{rank}" / "trace.json").exists() and (out / f"rank{rank}" / "categories.csv").exists()
    table = pd.read_csv(out / "ranks.csv")
    assert list(table["rank"]) == [0, 1] and list(table["steps"]) == [2, 2]
    assert (table["comm_ms"] > 0).all()            # the gradient all-reduce, on every rank
    assert "rank 0 of 2" in result.output and "step-time skew" in result.output
    listed = result.output.split("files written:")[-1].replace("\n", "")
    assert str(out / "capture_spec.json") in listed and str(out / "rank1" / "run.json") in listed

    again = runner.invoke(app, ["analyze", str(out), "--format", "json", "--out", str(tmp_path / "a"), "--no-timeline"])
    assert again.exit_code == 0, again.output
    data = json.loads((tmp_path / "a" / "ranks.json").read_text())
    assert [r["rank"] for r in data["ranks"]] == [0, 1] and data["summary"]["ranks"] == 2
    assert (tmp_path / "a" / "rank1" / "analysis.json").exists()


def test_profile_nproc_2_parallel_fsdp_captures_the_shards_collectives(tmp_path):
    """Under FSDP2 each rank's trace holds the parameter all-gathers and gradient reduce-scatters, and its
    run.json names the strategy; master weights stand aside (the recipe's other passes run)."""
    out = tmp_path / "p"
    result = runner.invoke(app, ["profile", "--device", "cpu", "--nproc", "2", "--parallel", "fsdp", "--batch", "2",
                                 "--steps", "2", "--warmup", "1", "--recipe", "amp", "--out", str(out),
                                 "--no-timeline"])
    assert result.exit_code == 0, result.output
    for rank in (0, 1):
        run = json.loads((out / f"rank{rank}" / "run.json").read_text())
        assert run["parallel"] == "fsdp" and run["world_size"] == 2
    table = pd.read_csv(out / "ranks.csv")
    assert list(table["rank"]) == [0, 1] and (table["comm_ms"] > 0).all()
    assert "(torchrun, FSDP)" in result.output


@pytest.mark.parametrize("args, message", [
    (["--nproc", "0"], "--nproc must be"),
    (["--parallel", "fsdp"], "--parallel goes with --nproc"),
    (["--nproc", "2", "--parallel", "zero3"], "--parallel must be one of ddp, fsdp, got 'zero3'"),
    (["--nproc", "2", "--parallel", "fsdp", "--recipe", "fmha-graph"], "does not run under FSDP"),
    # refused before torchrun starts: every rank would refuse Inductor's own graphs
    (["--nproc", "2", "--recipe", "torch-compile-graphs"], "replays Inductor's CUDA graphs"),
])
def test_profile_nproc_mistakes_are_one_line(tmp_path, args, message):
    result = runner.invoke(app, ["profile", "--device", "cpu", "--out", str(tmp_path / "o"), *args])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "o").exists()


def test_one_warm_up_step_holds_a_graph_recipes_capture():
    # Workload.step runs the graph's eager warm-up steps and its capture inside the first step
    from workbench.capture.profile import _warmup_short_of

    assert _warmup_short_of("fmha-graph", 0) == "the CUDA graph's warm-up steps and its capture"
    assert _warmup_short_of("fmha-graph", 1) is None
    assert _warmup_short_of("torch-compile", 1) == "torch.compile's compilation"
    assert _warmup_short_of("fmha-compile-graph", 1) is None


def test_a_rank_that_refuses_the_recipe_says_why_in_one_line(tmp_path, monkeypatch):
    """The ranks' UserError, not torchrun's '=====' summary: torchrun prefixes each rank's lines with
    '[rank0]: '."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    result = runner.invoke(app, ["profile", "--device", "cpu", "--nproc", "2", "--batch", "2", "--steps", "1",
                                 "--warmup", "0", "--recipe", "fp8", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and "recipe fp8 cannot run here" in result.output, result.output
    assert "=====" not in result.output and "Traceback" not in result.output


def test_analyze_a_folder_without_ranks_is_one_line(tmp_path):
    result = runner.invoke(app, ["analyze", str(tmp_path)])
    assert result.exit_code == 2 and "without rank0/" in result.output
    (tmp_path / "trace.sqlite").write_bytes(b"")     # a single-process profile folder: its trace is named
    result = runner.invoke(app, ["analyze", str(tmp_path)])
    assert result.exit_code == 2 and "this one holds trace.sqlite: `swinbench analyze" in " ".join(result.output.split())


def test_intervals_merge_and_intersect():
    merged = _merged(np.array([0, 5, 2, 20]), np.array([3, 8, 4, 25]))
    assert merged[0].tolist() == [0, 5, 20] and merged[1].tolist() == [4, 8, 25]
    # merged [0,4) [5,8) [20,25) against [3,7) [6,30) = [3,7) [6,30) merged to [3,30)
    assert _intersection_ns(merged, _merged(np.array([3, 6]), np.array([7, 30]))) == 1 + 3 + 5


def _trace(kernels, steps):
    k = pd.DataFrame([{"start_ns": s, "end_ns": e, "duration_ns": e - s, "name": n, "short_name": n, "device_id": 0,
                       "stream_id": 7 if "nccl" in n else 1, "correlation_id": i, "launch_ns": s, "launch_tid": 1,
                       "pid": 1} for i, (s, e, n) in enumerate(kernels)])
    r = pd.DataFrame([{"range_id": i, "name": f"step{i}", "domain": "", "start_ns": s, "end_ns": e, "tid": 1, "pid": 1,
                       "depth": 0} for i, (s, e) in enumerate(steps)])
    return Trace(finish_frame(k, KERNEL_COLUMNS), finish_frame(r, RANGE_COLUMNS), {"source": "nsys"})


def test_a_rank_row_splits_communication_into_hidden_and_exposed():
    """Two steps of 100 us: a 60 us GEMM each, an all-reduce of 30 us that runs 20 us beside the GEMM."""
    ms = 1_000_000
    kernels = [(0, 60_000, "sm90_xmma_gemm"), (40_000, 70_000, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"),
               (100_000, 160_000, "sm90_xmma_gemm"), (140_000, 170_000, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL")]
    row = rank_row(3, _trace(kernels, [(0, 100_000), (100_000, 200_000)]))
    assert row["rank"] == 3 and row["steps"] == 2 and row["step_ms"] == pytest.approx(0.1)
    assert row["comm_ms"] == pytest.approx(30_000 / ms) and row["kernel_ms"] == pytest.approx(90_000 / ms)
    assert row["overlap_pct"] == pytest.approx(100 * 20 / 30) and row["exposed_ms"] == pytest.approx(10_000 / ms)
    assert row["busy_pct"] == pytest.approx(100 * 140_000 / 170_000)
    table = pd.DataFrame([row, {**row, "rank": 4, "step_ms": 0.12}])
    summary = rank_summary(table)
    assert summary.slowest == 4 and summary.skew_pct == pytest.approx(100 * 0.02 / 0.11)
    assert summary.comm_share_pct == pytest.approx(100 * 30 / 90)


def test_a_ranks_error_line_is_said_whole_and_a_runaway_one_cut_visibly(tmp_path):
    from workbench.capture.backends import _first_error

    reason = "recipe 'x' cannot run here: " + "a reason of some length, " * 10 + "the end"
    log = tmp_path / "log"
    log.write_text(f"[rank0]: workbench.errors.UserError: {reason}\n[rank0]: done\n"
                   "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: =====\n")
    assert _first_error(log) == f"workbench.errors.UserError: {reason}"
    log.write_text("RuntimeError: " + "x" * 1000 + "\n")
    said = _first_error(log)
    assert len(said) == 400 and said.endswith("…")
