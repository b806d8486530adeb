"""Host-side CUDA API calls: parsed from the real nsys fixture and the schema-faithful Kineto trace, scoped to
step ranges (autograd's thread included), tabulated by kind, rendered and written by `analyze`."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from rich.console import Console

from workbench.analysis import frames as A
from workbench.analysis.analyze import analyze_trace, render_analysis, write_analysis
from workbench.trace import API_COLUMNS, load_trace

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def bf16_sqlite(unxz):
    return unxz(DATA / "swin_tiny_train_bf16.sqlite.xz")


def test_nsys_api_frame_matches_sql(bf16_sqlite):
    trace = load_trace(bf16_sqlite)
    api = trace.api
    assert list(api.columns) == API_COLUMNS
    with sqlite3.connect(bf16_sqlite) as con:
        [(n, total)] = con.execute("SELECT COUNT(*), SUM(end - start) FROM CUPTI_ACTIVITY_KIND_RUNTIME").fetchall()
        [(syncs,)] = con.execute("SELECT COUNT(*) FROM CUPTI_ACTIVITY_KIND_RUNTIME r JOIN StringIds s ON s.id = r.nameId "
                                 "WHERE s.value = 'cudaStreamSynchronize_v3020'").fetchall()
    assert len(api) == n and int(api["duration_ns"].sum()) == total
    assert (api["name"] == "cudaStreamSynchronize").sum() == syncs      # version suffix stripped
    assert not api["name"].str.contains(r"_v\d+$").any()
    assert api["start_ns"].is_monotonic_increasing and (api["pid"] > 0).all()


def test_step_scope_counts_per_step(bf16_sqlite):
    an = analyze_trace(bf16_sqlite)
    trace = load_trace(bf16_sqlite)
    steps = trace.ranges[trace.ranges["name"].str.match(r"^step\d+$")]
    assert an.trace_meta["api_steps"] == len(steps) == 4 and an.trace_meta["api_unit"] == "step"
    t = an.api.set_index("call")
    inside = A.calls_in_windows(trace.api, steps)
    assert t["calls"].sum() == len(inside) < len(trace.api)             # setup outside the steps left out
    assert t.loc["cudaLaunchKernel", "per_step"] == pytest.approx(t.loc["cudaLaunchKernel", "calls"] / 4)
    assert t.loc["cudaLaunchKernel", "kind"] == "launch" and t.loc["cudaMalloc", "kind"] == "allocation"
    assert an.api["share_pct"].sum() == pytest.approx(100.0)
    assert an.api["total_ns"].is_monotonic_decreasing


def test_kineto_runtime_events_and_autograd_thread():
    trace = load_trace(DATA / "kineto_synthetic_gpu.json")
    data = json.loads((DATA / "kineto_synthetic_gpu.json").read_text())
    runtime = [e for e in data["traceEvents"] if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    assert len(trace.api) == len(runtime) and set(trace.api["name"]) == {e["name"] for e in runtime}
    an = analyze_trace(DATA / "kineto_synthetic_gpu.json")
    # the backward's launches come from thread 1001, which never pushed step0: still inside the step
    assert an.trace_meta["api_scope"] == "inside 1 step ranges"
    assert an.api["calls"].sum() == len(A.calls_in_windows(trace.api, trace.ranges[trace.ranges["name"] == "step0"]))
    assert 1001 in set(A.calls_in_windows(trace.api, trace.ranges[trace.ranges["name"] == "step0"])["tid"])


def test_calls_in_windows_by_time_and_process():
    api = pd.DataFrame({"start_ns": [5, 15, 25, 15], "end_ns": [6, 16, 26, 16], "duration_ns": [1] * 4,
                        "name": ["a", "b", "c", "d"], "tid": [1, 2, 1, 9], "pid": [7, 7, 7, 8],
                        "correlation_id": [1, 2, 3, 4]})
    windows = pd.DataFrame({"start_ns": [10, 20], "end_ns": [18, 30], "pid": [7, 7]})
    assert A.calls_in_windows(api, windows)["name"].tolist() == ["b", "c"]   # d: another process
    assert A.calls_in_windows(api, windows.iloc[:0]).empty


def test_api_kinds():
    assert [A.api_kind(n) for n in ("cudaStreamSynchronize", "cuCtxSynchronize", "cudaFree", "cudaLaunchKernel",
                                    "cuLaunchKernelEx", "cudaGraphLaunch", "cudaMemcpyAsync", "cuModuleLoad")] == [
        "synchronize", "synchronize", "allocation", "launch", "launch", "launch", "copy/set", "other"]


def test_rendered_and_written(bf16_sqlite, tmp_path):
    an = analyze_trace(bf16_sqlite)
    console = Console(record=True, width=160)
    render_analysis(an, console, top=5)
    text = console.export_text()
    assert "CUDA API calls on the host (inside 4 step ranges)" in text and "cudaLaunchKernel" in text
    assert "synchronizing or allocating CUDA calls per step" in text      # the fixture's cudaMalloc calls
    paths = write_analysis(an, tmp_path, "csv")
    api_csv = pd.read_csv(tmp_path / "api.csv")
    assert tmp_path / "api.csv" in paths and len(api_csv) == len(an.api)
    write_analysis(an, tmp_path, "json")
    doc = json.loads((tmp_path / "analysis.json").read_text())
    assert doc["api"][0]["call"] == an.api["call"].iloc[0] and doc["meta"]["api_unit"] == "step"
    assert np.isclose(sum(r["share_pct"] for r in doc["api"]), 100.0)


def test_a_trace_without_steps_shows_its_calls_whole(bf16_sqlite, tmp_path):
    """No step ranges: the calls are the whole trace's, with no per-step column (it had no figures but the
    folded row's 0.0) and a blocking-calls note that does not say 'calls calls'."""
    path = tmp_path / "no-nvtx.sqlite"
    path.write_bytes(bf16_sqlite.read_bytes())
    with sqlite3.connect(path) as con:
        con.execute("DROP TABLE NVTX_EVENTS")
    an = analyze_trace(path)
    assert an.trace_meta["api_unit"] is None and an.api["per_step"].isna().all()
    console = Console(record=True, width=160)
    render_analysis(an, console, top=3)
    text = console.export_text()
    header = next(line for line in text.splitlines() if "┃ call" in line)
    assert header.count("calls") == 1 and "per step" not in header
    blocking = int(an.api.loc[an.api["kind"].isin(["synchronize", "allocation"]), "calls"].sum())
    assert f"{blocking:,} synchronizing or allocating CUDA calls in the trace" in text
    assert "calls calls" not in text
