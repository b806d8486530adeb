"""`swinbench diff` on two `profile --nproc` folders: rank by rank on hand-built torch.profiler traces
(a GEMM and an all-reduce per step, so every figure is known), the kernels of the slowest rank after
the change, `--rank`, and the one-line refusals of sides that do not match."""
import json

import pytest
from typer.testing import CliRunner

from cli import app
from trace_builders import rank_folder
from workbench.analysis.rank_diff import diff_plan, diff_ranks, write_rank_diff
from workbench.errors import UserError

runner = CliRunner()
EVEN = dict(gemm_us=60, comm_us=30, hidden_us=20, step_us=100)


@pytest.fixture
def runs(tmp_path):
    """before: two even ranks; after: a shorter GEMM whose all-reduce hides fully, rank 1 the slower."""
    before = rank_folder(tmp_path / "before", [EVEN, EVEN])
    after = rank_folder(tmp_path / "after", [dict(gemm_us=50, comm_us=30, hidden_us=30, step_us=90),
                                             dict(gemm_us=50, comm_us=30, hidden_us=30, step_us=95)])
    return before, after


def test_ranks_are_compared_rank_by_rank_and_the_slowest_ranks_kernels(runs):
    before, after = runs
    d = diff_ranks(diff_plan(before, after), "before", "after")
    table = d.ranks.set_index(["rank", "metric"])
    assert list(d.ranks["rank"].unique()) == [0, 1]
    assert table.loc[(1, "step_ms"), "before"] == pytest.approx(0.100)
    assert table.loc[(1, "step_ms"), "after"] == pytest.approx(0.095)
    assert table.loc[(0, "kernel_ms"), "delta"] == pytest.approx(-0.010)
    assert table.loc[(0, "comm_ms"), "delta"] == pytest.approx(0.0)
    # 10 us of 30 exposed per step before, all of it hidden behind the GEMM after
    assert table.loc[(0, "exposed_ms"), "before"] == pytest.approx(0.010)
    assert table.loc[(0, "exposed_ms"), "after"] == pytest.approx(0.0)
    assert d.summaries[1].slowest == 1 and d.rank == 1 and d.chosen == "slowest after"
    kernels = d.kernels.kernels.set_index("kernel")
    assert kernels["delta_ms"].sum() == pytest.approx(-0.010)
    assert kernels.loc["ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "delta_ms"] == pytest.approx(0.0)


def test_rank_picks_the_kernel_tables(runs):
    d = diff_ranks(diff_plan(*runs, rank=0), "before", "after")
    assert d.rank == 0 and d.chosen == "asked" and "rank 0" in d.kernels.after


def test_written_tables_carry_the_rank(runs, tmp_path):
    d = diff_ranks(diff_plan(*runs), "b", "a")
    paths = write_rank_diff(d, tmp_path / "csv", "csv")
    assert sorted(p.name for p in paths) == ["diff_categories.csv", "diff_kernels.csv", "diff_ranks.csv",
                                             "diff_summary.csv"]
    assert (tmp_path / "csv" / "diff_kernels.csv").read_text().splitlines()[0].startswith("rank,kernel,")
    (path,) = write_rank_diff(d, tmp_path / "json", "json")
    doc = json.loads(path.read_text())
    assert doc["rank"] == 1 and doc["rank_chosen"] == "slowest after"
    assert doc["rank_summary"]["after"]["slowest"] == 1 and len(doc["ranks"]) == 2 * 5


def test_cli_renders_the_ranks_and_writes_inside_after(runs):
    before, after = runs
    result = runner.invoke(app, ["diff", str(before), str(after), "--format", "csv"])
    assert result.exit_code == 0, result.output
    assert "Ranks (per step)" in result.output and "Kernel tables: rank 1" in result.output
    assert "0.100 →" in result.output and "(-0.005)" in result.output
    assert (after / "diff_ranks.csv").exists()
    # tables of another comparison are not replaced without --overwrite
    other = rank_folder(before.parent / "other", [EVEN, EVEN])
    again = runner.invoke(app, ["diff", str(other), str(after), "--format", "csv"])
    assert again.exit_code == 2 and "--overwrite" in again.output and "Traceback" not in again.output
    moved = runner.invoke(app, ["diff", str(other), str(after), "--format", "csv", "--overwrite"])
    assert moved.exit_code == 0 and list(after.glob("previous-*/diff_ranks.csv"))


def test_a_single_trace_against_one_rank_needs_rank(runs):
    before, after = runs
    one = before / "rank0" / "trace.json"
    refused = runner.invoke(app, ["diff", str(one), str(after)])
    assert refused.exit_code == 2 and "--rank R compares the trace with rank R of AFTER" in refused.output
    result = runner.invoke(app, ["diff", str(one), str(after), "--rank", "1", "--format", "json"])
    assert result.exit_code == 0, result.output
    assert "rank 1 of the AFTER folder of 2 ranks" in result.output and "rank1" in result.output
    doc = json.loads((after / "diff.json").read_text())     # inside the AFTER folder, as for two folders
    assert doc["after_trace"] == "rank1/trace.json" and "rank 1 of the AFTER folder" in doc["notes"][0]


def test_different_world_sizes_are_refused_unless_one_rank_is_asked(runs, tmp_path):
    before, _ = runs
    four = rank_folder(tmp_path / "four", [EVEN] * 4)
    refused = runner.invoke(app, ["diff", str(before), str(four)])
    assert refused.exit_code == 2 and "BEFORE holds 2 ranks (0, 1) and AFTER 4 ranks (0, 1, 2, 3)" in refused.output
    assert len(refused.output.strip().splitlines()) == 1
    result = runner.invoke(app, ["diff", str(before), str(four), "--rank", "1"])
    assert result.exit_code == 0 and "rank 1 of each" in result.output


@pytest.mark.parametrize("args, message", [
    (["--rank", "2"], "--rank 2: BEFORE"),
    (["--rank", "-1"], "--rank must be 0 or more"),
])
def test_bad_rank_is_one_line(runs, args, message):
    result = runner.invoke(app, ["diff", *map(str, runs), *args])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_rank_of_two_single_traces_and_folders_without_ranks_are_refused(runs, tmp_path):
    before, after = runs
    with pytest.raises(UserError, match="both sides are single traces"):
        diff_plan(before / "rank0" / "trace.json", after / "rank0" / "trace.json", rank=0)
    result = runner.invoke(app, ["diff", str(tmp_path / "before" / "rank0"), str(after)])
    assert result.exit_code == 2 and "without rank0/" in result.output
