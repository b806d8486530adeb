"""Findings on the committed real traces: the time split adds up to the span, the eager bf16 step is
launch-bound first, every finding names a remedy or says none, a CPU trace makes no GPU claim."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from workbench.analysis.analyze import analyze_trace, render_analysis, write_analysis
from workbench.analysis.findings import COLUMNS, findings

ROOT = Path(__file__).parent.parent
DATA = ROOT / "tests" / "data"
GPU_TRACES = [ROOT / "profiles/examples/swin_tiny_train_bf16/trace.sqlite.xz",
              DATA / "swin_tiny_train_bf16.sqlite.xz", DATA / "swin_tiny_train_fp32.sqlite.xz"]


@pytest.fixture(scope="module", params=GPU_TRACES, ids=lambda p: p.parent.name + "/" + p.name)
def gpu_analysis(request, unxz):
    return analyze_trace(unxz(request.param))


def _busy(analysis) -> dict:
    return dict(zip(analysis.busy["metric"], analysis.busy["ns"]))


def test_time_split_adds_up_to_the_span(gpu_analysis):
    table = findings(gpu_analysis)
    assert list(table.columns) == COLUMNS
    steps = gpu_analysis.trace_meta["api_steps"]
    busy = _busy(gpu_analysis)
    part = table[table["partition"]]
    # idle + categories = span, each kernel in one category: no time counted twice
    assert part["ms_per_step"].sum() == pytest.approx(busy["span"] / steps / 1e6, rel=1e-9)
    assert part[part["kind"] == "category"]["ms_per_step"].sum() == pytest.approx(busy["busy"] / steps / 1e6, rel=1e-9)
    assert table["ms_per_step"].sum() - part["ms_per_step"].sum() <= busy["busy"] / steps / 1e6
    assert part["share_pct"].sum() == pytest.approx(100.0)
    assert table["ms_per_step"].is_monotonic_decreasing and list(table["rank"]) == list(range(1, len(table) + 1))


def test_every_finding_has_a_remedy_or_says_none(gpu_analysis):
    table = findings(gpu_analysis)
    assert table["remedy"].map(lambda r: isinstance(r, str) and len(r) > 0).all()
    gemm = table[table["what"].str.startswith("GEMM:")]
    assert gemm["remedy"].iloc[0].startswith("none")
    cats = dict(zip(table["what"].str.split(":").str[0], table["remedy"]))
    assert "fused_layernorm" in cats["normalization"] and "fused_window" in cats["window gather/scatter"]
    assert "fused_adamw" in cats["optimizer"]


def test_eager_bf16_step_is_launch_bound_first(unxz):
    analysis = analyze_trace(unxz(GPU_TRACES[0]))
    assert _busy(analysis)["busy"] / _busy(analysis)["span"] == pytest.approx(0.26, abs=0.01)
    first = findings(analysis).iloc[0]
    assert first["kind"] == "launch-bound" and first["share_pct"] == pytest.approx(73.8, abs=0.1)
    assert "block-graph" in first["remedy"] and "fmha-graph" in first["remedy"]
    console = Console(record=True, width=160)
    render_analysis(analysis, console)
    text = console.export_text()
    assert "findings" in text and "launch-bound" in text.split("findings")[-1]


def test_cpu_trace_makes_no_gpu_claim():
    analysis = analyze_trace(DATA / "kineto_cpu_tiny_train.json")
    table = findings(analysis)
    assert "launch-bound" not in set(table["kind"]) and "gpu-idle" not in set(table["kind"])
    assert "host-gaps" in set(table["kind"])
    assert not table["what"].str.contains("GPU").any() and table["remedy"].str.startswith("none").all()
    steps = analysis.trace_meta["api_steps"]
    span = _busy(analysis)["span"]
    assert table[table["partition"]]["ms_per_step"].sum() == pytest.approx(span / steps / 1e6, rel=1e-9)


def test_findings_are_written_with_the_tables(unxz, tmp_path):
    analysis = analyze_trace(unxz(GPU_TRACES[0]))
    [js] = write_analysis(analysis, tmp_path / "js", "json")
    doc = json.loads(js.read_text())
    assert doc["findings"][0]["kind"] == "launch-bound" and len(doc["findings"]) == len(findings(analysis))
    files = write_analysis(analysis, tmp_path / "csv", "csv")
    assert (tmp_path / "csv" / "findings.csv") in files
