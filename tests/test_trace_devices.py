"""Several GPUs in one trace: the analysis builds its kernel, category, range and busy tables per device
(shares of that device's time), `diff` compares device with device or refuses, and a one-GPU trace keeps
its tables without a device column. Hand-built nsys and Kineto traces in tmp_path."""
from __future__ import annotations

import json
import os

import pytest
from rich.console import Console
from typer.testing import CliRunner

from cli import app
from trace_builders import GOOD_KERNELS, kineto_trace, nsys_export
from workbench.analysis import frames as A
from workbench.analysis.analyze import analyze_trace, category_shares, render_analysis, write_analysis
from workbench.analysis.diff import diff_analyses, write_diff
from workbench.errors import UserError
from workbench.trace import load_trace

runner = CliRunner()
# device 1 runs the same four kernels on a clock twice as slow: 8,000 ns of GPU time over 10,400 ns
ON_DEVICE_1 = [(2 * s, 2 * e, 1, name) for s, e, _, name in GOOD_KERNELS]


@pytest.fixture
def two_gpus(tmp_path):
    return nsys_export(tmp_path / "two.sqlite", GOOD_KERNELS + ON_DEVICE_1)


def test_per_device_tables(two_gpus):
    analysis = analyze_trace(two_gpus)
    assert analysis.devices == [0, 1] and analysis.trace_meta["device_steps"] == {0: 1, 1: 1}
    for frame in (analysis.kernels, analysis.categories, analysis.ranges, analysis.busy):
        assert frame.columns[0] == "device" and set(frame["device"]) == {0, 1}
    k = analysis.kernels.groupby("device")
    assert k["total_ns"].sum().to_dict() == {0: 4000, 1: 8000}
    assert k["share_pct"].sum().tolist() == pytest.approx([100.0, 100.0])
    assert analysis.categories.groupby("device")["total_ns"].sum().to_dict() == {0: 4000, 1: 8000}
    step = analysis.ranges.set_index("device")
    assert step["gpu_ns"].to_dict() == {0: 4000, 1: 8000} and step["share_pct"].tolist() == [100.0, 100.0]
    busy = analysis.busy.set_index(["device", "metric"])["ns"]
    assert busy[0, "span"] == 5200 and busy[0, "busy"] == busy[0, "kernel_sum"] == 4000
    assert busy[1, "span"] == 10_400 and busy[1, "busy"] == busy[1, "kernel_sum"] == 8000
    assert category_shares(analysis) == pytest.approx({"GEMM": 62.5, "softmax": 37.5})


def test_range_scoped_per_device(two_gpus):
    analysis = analyze_trace(two_gpus, range_name="step0")
    assert analysis.kernels.groupby("device")["total_ns"].sum().to_dict() == {0: 4000, 1: 8000}
    assert analysis.busy.set_index(["device", "metric"])["ns"][1, "kernel_sum"] == 8000


def test_per_device_matches_each_device_alone(two_gpus):
    trace = load_trace(two_gpus)
    stacked = A.per_device(trace.kernels, A.kernel_share_table)
    for device, group in trace.kernels.groupby("device_id"):
        alone = A.kernel_share_table(group)
        mine = stacked[stacked["device"] == device].drop(columns="device").reset_index(drop=True)
        assert mine.equals(alone)


def test_one_device_has_no_device_column(tmp_path):
    analysis = analyze_trace(nsys_export(tmp_path / "one.sqlite", ON_DEVICE_1))
    assert analysis.devices == [1] and "device_steps" not in analysis.trace_meta
    assert all("device" not in f for f in (analysis.kernels, analysis.categories, analysis.ranges, analysis.busy))


def test_rendered_and_written_per_device(two_gpus, tmp_path):
    analysis = analyze_trace(two_gpus)
    console = Console(record=True, width=400, file=open(os.devnull, "w"))
    render_analysis(analysis, console)
    text = console.export_text()
    assert "2 GPUs (devices 0, 1)" in text.splitlines()[0]
    assert "GPU 0: GPU kernels" in text and "GPU 1: GPU busy / idle" in text and "GPU 1: ranges" in text
    [js] = write_analysis(analysis, tmp_path / "js", "json")
    doc = json.loads(js.read_text())
    assert doc["meta"]["devices"] == [0, 1] and {r["device"] for r in doc["kernels"]} == {0, 1}
    result = runner.invoke(app, ["analyze", str(two_gpus), "--format", "csv", "--out", str(tmp_path / "csv")])
    assert result.exit_code == 0, result.output
    assert "GPU 1: categories" in result.output
    assert (tmp_path / "csv" / "kernels.csv").read_text().startswith("device,kernel,")


def test_kineto_devices_from_args(tmp_path):
    path = kineto_trace(tmp_path / "t.json", [(1.0, 1.0, 0), (2.0, 0.5, 1), (3.0, 2.0, 1)])
    analysis = analyze_trace(path)
    assert analysis.devices == [0, 1]
    assert analysis.kernels.groupby("device")["total_ns"].sum().to_dict() == {0: 1000, 1: 2500}
    assert analysis.ranges.groupby("device")["share_pct"].max().tolist() == [100.0, 100.0]


def test_diff_per_device(two_gpus, tmp_path):
    slower = nsys_export(tmp_path / "slower.sqlite", GOOD_KERNELS + [(s, e + 500, 1, n) for s, e, _, n in ON_DEVICE_1])
    before, after = analyze_trace(two_gpus, name_style="short"), analyze_trace(slower, name_style="short")
    d = diff_analyses(before, after)
    assert d.devices == [0, 1] and d.unit == "step" and d.device_steps == {0: (1, 1), 1: (1, 1)}
    delta = d.kernels.groupby("device")["delta_ms"].sum()
    assert delta[0] == pytest.approx(0.0) and delta[1] == pytest.approx(4 * 500 / 1e6)
    summary = d.summary.set_index(["device", "metric"])
    assert summary.loc[(1, "kernel ms"), "delta"] == pytest.approx(0.002)
    assert summary.loc[(0, "kernel ms"), "delta"] == 0.0 and summary.loc[(-1, "host launches"), "before"] == 8
    (path,) = write_diff(d, tmp_path / "out", "json")
    assert json.loads(path.read_text())["devices"] == [0, 1]
    result = runner.invoke(app, ["diff", str(two_gpus), str(slower)])
    assert result.exit_code == 0, result.output
    assert "GPU 1: Kernels by change" in result.output and "host" in result.output


def test_diff_refuses_different_device_sets(two_gpus, tmp_path):
    one = nsys_export(tmp_path / "one.sqlite", GOOD_KERNELS)
    with pytest.raises(UserError, match=r"different GPUs \(before: devices 0, 1; after: devices 0\)"):
        diff_analyses(analyze_trace(two_gpus), analyze_trace(one))
    result = runner.invoke(app, ["diff", str(two_gpus), str(one)])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output


def test_diff_of_two_single_gpu_traces_ignores_the_index(tmp_path):
    on_0 = analyze_trace(nsys_export(tmp_path / "a.sqlite", GOOD_KERNELS))
    on_1 = analyze_trace(nsys_export(tmp_path / "b.sqlite", ON_DEVICE_1))
    d = diff_analyses(on_0, on_1)
    assert "device" not in d.kernels and d.summary.set_index("metric").loc["kernel ms", "delta"] == pytest.approx(0.004)


def test_render_prints_the_kernel_table_by_another_name_style(two_gpus):
    """render_analysis(names=...) prints each GPU's kernel table grouped by that style (profile prints op
    names) over the same kernels: the same totals per GPU as the analysis's own table."""
    import io

    from workbench.analysis.analyze import kernels_by

    analysis = analyze_trace(two_gpus)
    by_op = kernels_by(analysis, "op")
    assert set(by_op["device"]) == {0, 1}
    assert (by_op.groupby("device")["total_ns"].sum() == analysis.kernels.groupby("device")["total_ns"].sum()).all()
    out = io.StringIO()
    render_analysis(analysis, Console(file=out, width=200), names="op")
    assert "GPU 0: GPU kernels (op names)" in out.getvalue() and "(demangled names)" not in out.getvalue()
