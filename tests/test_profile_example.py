"""The committed example: `swinbench profile --model swin_tiny_patch4_window7_224 --mode train
--precision bf16` run under Nsight Systems on an H200 (profiles/examples/). Its trace must analyze to
the tables committed beside it, with numbers checked against SQL run here, and carry every range
the profile command promises."""
import json
import sqlite3
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from cli import app
from workbench.analysis.analyze import analyze_trace

EXAMPLE = Path(__file__).resolve().parent.parent / "profiles" / "examples" / "swin_tiny_train_bf16"


@pytest.fixture(scope="module")
def trace(unxz):
    return unxz(EXAMPLE / "trace.sqlite.xz")


def test_run_record_says_what_ran_where():
    run = json.loads((EXAMPLE / "run.json").read_text())
    assert run["backend"] == "nsys" and run["env"]["gpu"] == "NVIDIA H200"
    assert run["config"]["model"] == "swin_tiny_patch4_window7_224" and run["config"]["precision"] == "bf16"


def test_kernel_totals_match_sql_and_committed_tables(trace):
    with sqlite3.connect(trace) as con:
        count, total = con.execute("SELECT COUNT(*), SUM(end - start) FROM CUPTI_ACTIVITY_KIND_KERNEL").fetchone()
    analysis = analyze_trace(trace)
    assert analysis.kernels["instances"].sum() == count
    assert analysis.kernels["total_ns"].sum() == total
    assert analysis.categories["total_ns"].sum() == total
    committed = pd.read_csv(EXAMPLE / "categories.csv")
    merged = committed.merge(analysis.categories, on="category", suffixes=("_committed", ""))
    assert len(merged) == len(committed)
    assert (merged["total_ns_committed"] == merged["total_ns"]).all()


def test_every_promised_range_is_there_and_backward_has_its_kernels(trace):
    ranges = analyze_trace(trace).ranges.set_index("range")
    for name in ("forward", "backward", "optimizer", "attention", "mlp", "norm1", "norm2",
                 "patch_embed", "head", "stage0.block0", "stage3.block1", "stage1.downsample"):
        assert name in ranges.index, name
    steps = [r for r in ranges.index if r.startswith("step")]
    assert len(steps) == json.loads((EXAMPLE / "run.json").read_text())["steps"]
    # Backward kernels come from autograd's thread; the attribution still gives them to `backward`.
    assert ranges.loc["backward", "gpu_ns"] > ranges.loc["forward", "gpu_ns"] > 0
    phases = ranges.loc[["forward", "backward", "optimizer"], "gpu_ns"].sum()
    assert phases == ranges.loc[steps, "gpu_ns"].sum()


def test_analyze_cli_on_the_compressed_example():
    result = CliRunner().invoke(app, ["analyze", str(EXAMPLE / "trace.sqlite.xz"), "--range", "backward", "--top", "5"])
    assert result.exit_code == 0, result.output
    assert "other (" in result.output
