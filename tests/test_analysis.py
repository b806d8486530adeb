"""Analysis functions: exact sums on the real fixtures against SQL, hand-checked small frames."""
from __future__ import annotations

import json
import lzma
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from rich.console import Console

from workbench.analysis import frames as A
from workbench.analysis.analyze import analyze_trace, category_shares, render_analysis, write_analysis
from workbench.errors import UserError
from workbench.trace import load_trace

DATA = Path(__file__).parent / "data"
KERNEL = "CUPTI_ACTIVITY_KIND_KERNEL"
# kernels with their launching call and the NVTX range (by name) whose [start, end] holds the launch
LAUNCHED_IN = (
    "FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN CUPTI_ACTIVITY_KIND_RUNTIME r ON r.correlationId = k.correlationId "
    "JOIN NVTX_EVENTS e ON e.eventType = 59 AND r.start BETWEEN e.start AND e.end "
    "JOIN StringIds s ON s.id = e.textId "
)


@pytest.fixture(scope="session")
def bf16(tmp_path_factory):
    path = tmp_path_factory.mktemp("analysis") / "bf16.sqlite"
    with lzma.open(DATA / "swin_tiny_train_bf16.sqlite.xz") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return path, load_trace(path)


def sql(path, query):
    with sqlite3.connect(path) as con:
        return con.execute(query).fetchall()


def test_kernel_share_table_matches_sql(bf16):
    path, trace = bf16
    table = A.kernel_share_table(trace.kernels)
    [(total,)] = sql(path, f"SELECT SUM(end - start) FROM {KERNEL}")
    top = sql(path, f"SELECT s.value, COUNT(*), SUM(k.end - k.start) AS t FROM {KERNEL} k "
                    "JOIN StringIds s ON s.id = k.demangledName GROUP BY s.value ORDER BY t DESC LIMIT 5")
    for row, (name, n, ns) in zip(table.itertuples(), top):
        assert (row.kernel, row.instances, row.total_ns) == (name, n, ns)
        assert row.share_pct == pytest.approx(ns * 100 / total, rel=1e-12)
    assert int(table["total_ns"].sum()) == total
    assert table["share_pct"].sum() == pytest.approx(100.0)
    assert table["total_ns"].is_monotonic_decreasing
    first = trace.kernels[trace.kernels["name"] == table["kernel"][0]]["duration_ns"]
    assert table.loc[0, ["min_ns", "max_ns"]].tolist() == [first.min(), first.max()]
    assert table.loc[0, "med_ns"] == first.median() and table.loc[0, "avg_ns"] == pytest.approx(first.mean())


def test_short_name_table_matches_sql(bf16):
    path, trace = bf16
    table = A.kernel_share_table(trace.kernels, name_col="short_name").set_index("kernel")
    rows = sql(path, f"SELECT s.value, SUM(k.end - k.start) FROM {KERNEL} k JOIN StringIds s ON s.id = k.shortName GROUP BY s.value")
    assert {name: ns for name, ns in rows} == table["total_ns"].to_dict()


def test_categories_sum_to_kernel_total(bf16):
    _, trace = bf16
    cats = A.category_share_table(trace.kernels)
    assert int(cats["total_ns"].sum()) == int(trace.kernels["duration_ns"].sum())
    assert int(cats["instances"].sum()) == len(trace.kernels)
    assert cats["share_pct"].sum() == pytest.approx(100.0)
    shares = dict(zip(cats["category"], cats["share_pct"]))
    assert shares["GEMM"] > 15 and shares["other"] < 2  # the rules leave little unclassified


def test_backward_attribution_crosses_threads(bf16):
    path, trace = bf16
    ranges = A.range_table(trace).set_index("range")
    [(backward_ns, backward_n)] = sql(path, f"SELECT SUM(k.end - k.start), COUNT(*) {LAUNCHED_IN} WHERE s.value = 'backward'")
    assert ranges.loc["backward", "gpu_ns"] == backward_ns > 0
    assert ranges.loc["backward", "kernels"] == backward_n
    # those kernels come from autograd's thread, not the thread that pushed `backward`
    main_tid = trace.ranges.loc[trace.ranges["name"] == "backward", "tid"].iloc[0]
    assert (A.kernels_in_range(trace, "backward")["launch_tid"] != main_tid).mean() > 0.9


def test_steps_contain_phases_and_sum_exactly(bf16):
    path, trace = bf16
    per = A.attribute_ranges(trace.kernels, trace.ranges)
    steps = per[per["name"].str.fullmatch(r"step\d")]
    [(in_steps,)] = sql(path, f"SELECT SUM(k.end - k.start) {LAUNCHED_IN} WHERE s.value LIKE 'step%'")
    assert len(steps) == 4 and int(steps["gpu_ns"].sum()) == in_steps
    for step in steps.itertuples():
        inside = per[(per["start_ns"] >= step.start_ns) & (per["end_ns"] <= step.end_ns)]
        phases = inside[inside["name"].isin(["forward", "backward", "optimizer"])]
        assert len(phases) == 3 and int(phases["gpu_ns"].sum()) <= step.gpu_ns
    step_kernels = set(A.kernels_in_range(trace, "step2")["correlation_id"])
    phase_kernels = set().union(*(set(A.kernels_in_range(trace, p)["correlation_id"]) for p in ("forward", "backward", "optimizer")))
    all_steps = set().union(*(set(A.kernels_in_range(trace, f"step{i}")["correlation_id"]) for i in range(4)))
    assert phase_kernels <= all_steps and step_kernels <= all_steps


def test_kernels_in_range_unknown_name(bf16):
    _, trace = bf16
    with pytest.raises(UserError, match=r"no range named 'stage9' .*available: step0, forward"):
        A.kernels_in_range(trace, "stage9")


def test_busy_idle_hand_checked():
    k = pd.DataFrame({"start_ns": [0, 5, 20, 22, 40], "end_ns": [10, 12, 30, 25, 50]})
    k["duration_ns"] = k["end_ns"] - k["start_ns"]
    got = A.busy_idle(k).set_index("metric")["ns"].to_dict()
    assert got == {"span": 50, "busy": 12 + 10 + 10, "idle": 18, "kernel_sum": 10 + 7 + 10 + 3 + 10}
    clipped = A.busy_idle(k, span_start_ns=8, span_end_ns=45).set_index("metric")["ns"].to_dict()
    assert clipped == {"span": 37, "busy": 4 + 10 + 5, "idle": 18, "kernel_sum": 2 + 4 + 10 + 3 + 5}


def test_busy_idle_on_fixture(bf16):
    _, trace = bf16
    busy = A.busy_idle(trace.kernels).set_index("metric")["ns"]
    assert busy["span"] == trace.meta["span_end_ns"] - trace.meta["span_start_ns"]
    assert busy["busy"] + busy["idle"] == busy["span"]
    assert busy["busy"] <= busy["kernel_sum"] == trace.kernels["duration_ns"].sum()


def test_fold_tail_sums_are_exact(bf16):
    _, trace = bf16
    table = A.kernel_share_table(trace.kernels)
    folded = A.fold_tail(table, 10, "kernel", ["instances", "total_ns", "share_pct"])
    assert len(folded) == 11 and folded["kernel"].iloc[-1] == f"other ({len(table) - 10} kernels)"
    assert int(folded["total_ns"].sum()) == int(table["total_ns"].sum())
    assert int(folded["instances"].sum()) == len(trace.kernels)
    assert folded["total_ns"].dtype == np.int64
    assert A.fold_tail(table.head(3), 10, "kernel", ["total_ns"]).equals(table.head(3))


def test_analyze_render_write(bf16, tmp_path):
    path, _ = bf16
    analysis = analyze_trace(path, name_style="short")
    assert analysis.backend == "nsys"
    shares = category_shares(analysis)
    assert sum(shares.values()) == pytest.approx(100.0) and list(shares)[0] == analysis.categories["category"][0]
    console = Console(record=True, width=140)
    render_analysis(analysis, console, top=8)
    text = console.export_text()
    assert text.splitlines()[0].startswith("nsys 2025.3.2.0") and str(path) in text.splitlines()[0]
    assert "other (" in text and "backward" in text and "idle" in text
    files = write_analysis(analysis, tmp_path / "csv", "csv")
    assert [f.name for f in files] == ["kernels.csv", "categories.csv", "ranges.csv", "busy.csv", "api.csv", "findings.csv"]
    assert pd.read_csv(files[0])["total_ns"].sum() == analysis.kernels["total_ns"].sum()
    [js] = write_analysis(analysis, tmp_path / "js", "json")
    doc = json.loads(js.read_text())
    assert doc["backend"] == "nsys" and len(doc["kernels"]) == len(analysis.kernels)
    assert doc["meta"]["kernel_total_ns"] == analysis.kernels["total_ns"].sum()


def test_analyze_restricted_to_range(bf16):
    path, trace = bf16
    analysis = analyze_trace(path, range_name="forward")
    forward_ns = A.range_table(trace).set_index("range").loc["forward", "gpu_ns"]
    assert analysis.kernels["total_ns"].sum() == forward_ns
    assert analysis.ranges.set_index("range").loc["forward", "share_pct"] == pytest.approx(100.0)
    busy = analysis.busy.set_index("metric")["ns"]
    assert busy["busy"] + busy["idle"] == busy["span"] and busy["kernel_sum"] == forward_ns


def test_range_table_counts_a_kernel_once_per_name():
    """Instances of one name that nest or overlap (a recursive range, one name on two threads) do not
    count a kernel twice: the share stays within 100%."""
    k = pd.DataFrame({"launch_ns": [10, 20, 30], "duration_ns": [5, 7, 11], "pid": [1, 1, 1]})
    r = pd.DataFrame({"range_id": [0, 1, 2, 3], "name": ["outer", "outer", "x", "outer"],
                      "start_ns": [0, 5, 15, 200], "end_ns": [100, 25, 35, 300], "pid": [1, 1, 1, 1],
                      "domain": [""] * 4})
    trace = type("T", (), {"kernels": k, "ranges": r})()
    table = A.range_table(trace).set_index("range")
    assert table.loc["outer", ["instances", "kernels", "gpu_ns"]].tolist() == [3, 3, 23]
    assert table.loc["outer", "share_pct"] == 100.0 and table.loc["x", "gpu_ns"] == 18
    per_instance = A.attribute_ranges(k, r)["gpu_ns"].tolist()  # the per-instance view still nests
    assert per_instance == [23, 12, 18, 0]


REAL_TRACES = [DATA / "swin_tiny_train_bf16.sqlite.xz", DATA / "swin_tiny_train_fp32.sqlite.xz",
               DATA.parent.parent / "profiles" / "examples" / "swin_tiny_train_bf16" / "trace.sqlite.xz"]


@pytest.mark.parametrize("range_name", [None, "backward"])
@pytest.mark.parametrize("path", REAL_TRACES, ids=["bf16", "fp32", "example-bf16"])
def test_real_traces_are_clean_and_bounded(unxz, path, range_name):
    """The committed real exports: nothing dropped, one GPU, no negative total, no share over 100%."""
    analysis = analyze_trace(unxz(path), range_name=range_name)
    assert analysis.warnings == [] and analysis.devices == [0] and "device" not in analysis.kernels
    assert analysis.ranges["share_pct"].max() <= 100.0 + 1e-9
    assert analysis.kernels["share_pct"].sum() == pytest.approx(100.0)
    assert (analysis.kernels[["total_ns", "min_ns"]] >= 0).all().all() and (analysis.categories["total_ns"] >= 0).all()
    assert (analysis.ranges["gpu_ns"] >= 0).all() and (analysis.busy["ns"] >= 0).all()
    busy = analysis.busy.set_index("metric")["pct"]
    assert busy["busy"] <= 100.0 + 1e-9
