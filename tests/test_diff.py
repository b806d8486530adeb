"""`swinbench diff`: two real nsys exports of Swin-T training (fp32 and bf16, four steps each) compared
kernel by kernel, per step; the deltas add up to the change in kernel time; bad input is one line."""
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from workbench.analysis.analyze import analyze_trace
from workbench.analysis.diff import diff_analyses, write_diff
from workbench.errors import UserError

DATA = Path(__file__).parent / "data"
FP32, BF16 = DATA / "swin_tiny_train_fp32.sqlite.xz", DATA / "swin_tiny_train_bf16.sqlite.xz"
runner = CliRunner()


@pytest.fixture(scope="module")
def analyses():
    return analyze_trace(FP32, name_style="short"), analyze_trace(BF16, name_style="short")


def test_per_step_deltas_add_up_to_the_change_in_kernel_time(analyses):
    fp32, bf16 = analyses
    d = diff_analyses(fp32, bf16, "fp32", "bf16")
    assert d.unit == "step" and d.steps == (4, 4) and not d.notes
    before_ms = fp32.trace_meta["kernel_total_ns"] / 1e6 / 4
    after_ms = bf16.trace_meta["kernel_total_ns"] / 1e6 / 4
    assert d.kernels["before_ms"].sum() == pytest.approx(before_ms)
    assert d.kernels["after_ms"].sum() == pytest.approx(after_ms)
    assert d.kernels["delta_ms"].sum() == pytest.approx(after_ms - before_ms)
    assert d.categories["delta_ms"].sum() == pytest.approx(after_ms - before_ms)
    summary = d.summary.set_index("metric")
    assert summary.loc["kernel ms", "delta"] == pytest.approx(after_ms - before_ms)
    assert summary.loc["kernels", "after"] == pytest.approx(bf16.trace_meta["kernel_count"] / 4)
    # every kernel once, present on at least one side, largest change first
    assert d.kernels["kernel"].is_unique
    assert ((d.kernels["before_n"] > 0) | (d.kernels["after_n"] > 0)).all()
    deltas = d.kernels["delta_ms"].abs().to_numpy()
    assert (deltas[:-1] >= deltas[1:]).all()
    # fp32 -> bf16: the fp32 GEMMs vanish, GEMM time falls
    gemm = d.categories.set_index("category").loc["GEMM"]
    assert gemm["after_ms"] < gemm["before_ms"] / 2
    assert (d.kernels[d.kernels["kernel"].str.contains("f32f32_f32f32")]["after_ms"] == 0).all()


def test_host_launches_per_step_are_analyzes_figure(analyses):
    """Per step, diff counts the launches inside the steps, as analyze's API table and findings do; the
    fixture's launches before step0 (the whole trace's 4,484 against 4,482 inside) stay out."""
    from workbench.analysis.frames import api_summary

    fp32, bf16 = analyses
    summary = diff_analyses(fp32, bf16).summary.set_index("metric")
    assert api_summary(fp32.api)["launch"] == 1120.5                  # analyze's launches per step
    assert summary.loc["host launches", "before"] == pytest.approx(api_summary(fp32.api)["launch"])
    assert summary.loc["host launches", "after"] == pytest.approx(api_summary(bf16.api)["launch"])
    assert fp32.trace_meta["host_launches"] / 4 == 1121.0     # what the whole trace over 4 steps would say


def test_a_trace_against_itself_changes_nothing(analyses):
    fp32, _ = analyses
    d = diff_analyses(fp32, fp32)
    assert (d.kernels["delta_ms"] == 0).all() and (d.summary["delta"].fillna(0) == 0).all()


def test_mixed_name_styles_are_refused(analyses):
    fp32, _ = analyses
    with pytest.raises(UserError):
        diff_analyses(fp32, analyze_trace(BF16, name_style="demangled"))


def test_written_tables(analyses, tmp_path):
    d = diff_analyses(*analyses)
    paths = write_diff(d, tmp_path, "csv")
    assert sorted(p.name for p in paths) == ["diff_categories.csv", "diff_kernels.csv", "diff_summary.csv"]
    (path,) = write_diff(d, tmp_path, "json")
    doc = json.loads(path.read_text())
    assert doc["unit"] == "step" and doc["steps"] == [4, 4] and len(doc["kernels"]) == len(d.kernels)


def test_cli_renders_and_writes(tmp_path):
    result = runner.invoke(app, ["diff", str(FP32), str(BF16), "--top", "5", "--format", "json", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "Kernels by change of GPU ms per step" in result.output and "other (" in result.output
    assert (tmp_path / "diff.json").exists()


@pytest.mark.parametrize("args", [["diff", "/no/such.sqlite", str(BF16)], ["diff", str(FP32), str(BF16), "--name", "odd"],
                                  ["diff", str(FP32), str(BF16), "--format", "xml"], ["diff", str(FP32), str(BF16), "--top", "0"],
                                  ["diff", str(FP32), str(BF16), "--range", "no_such_range"]])
def test_bad_input_is_one_line_and_exit_2(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
