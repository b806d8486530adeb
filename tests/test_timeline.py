"""timeline.png (one step) and timeline.json (every step, for Perfetto) on the committed real traces:
the right step, a picture of the right size in the category colours, an export that holds exactly the
kernels of the steps it covers, in time order, and the commands that write both files."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from cli import app
from workbench.analysis import frames as A
from workbench.analysis.categories import categorize
from workbench.analysis.timeline import (
    API_COLORS, CATEGORY_COLORS, DPI, FIGSIZE_IN, GPU_PID_BASE, perfetto_trace, pick_step, render_timeline_png,
    step_ranges, step_view, timeline_origin, write_timeline,
)
from workbench.errors import UserError
from workbench.trace import load_trace

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
BF16 = DATA / "swin_tiny_train_bf16.sqlite.xz"
FP32 = DATA / "swin_tiny_train_fp32.sqlite.xz"
EXAMPLE = ROOT / "profiles" / "examples" / "swin_tiny_train_bf16" / "trace.sqlite.xz"
SHARED = Path("/work/shared/fixtures/nsys")
# The shared fixtures are the originals of tests/data's copies: checked where the machine has them.
NSYS_TRACES = [BF16, FP32, EXAMPLE] + [
    pytest.param(SHARED / name, marks=pytest.mark.skipif(not (SHARED / name).exists(), reason="no shared fixtures"),
                 id=f"shared-{name}")
    for name in ("swin_tiny_train_bf16.sqlite.xz", "swin_tiny_train_fp32.sqlite.xz")]
runner = CliRunner()


@pytest.fixture(scope="module")
def traces():
    """load_trace, once per file for the module."""
    cache = {}

    def load(path):
        if path not in cache:
            cache[path] = load_trace(path)
        return cache[path]

    return load


def step_kernels(trace, name):
    """The kernels launched inside the range `name` (the analysis' attribution rule)."""
    return A.kernels_in_range(trace, name)


def median_step(trace) -> str:
    steps = step_ranges(trace.ranges)
    by_length = sorted(zip(steps["end_ns"] - steps["start_ns"], range(len(steps)), steps["name"]))
    return by_length[(len(by_length) - 1) // 2][2]


# ---------------------------------------------------------------- the step


def test_the_median_step_is_drawn_and_a_named_one_on_request(traces):
    trace = traces(BF16)
    # step0 carries the first-step cost (759 ms); the others are 51-68 ms: the median is step2 (64.0 ms)
    assert median_step(trace) == "step2"
    view = step_view(trace)
    assert (view.label, view.why) == ("step2", "median of 4 steps")
    assert round(view.step_ns / 1e6, 1) == 64.0
    for asked in (3, "3", "step3"):
        assert pick_step(trace, asked)["name"] == "step3"
    assert step_view(traces(EXAMPLE)).label == median_step(traces(EXAMPLE)) == "step6"


@pytest.mark.parametrize("path", NSYS_TRACES)
def test_the_view_holds_the_steps_kernels_and_both_launching_threads(traces, path):
    trace = traces(path)
    view = step_view(trace)
    launched = step_kernels(trace, view.label)
    assert view.kernel_count == len(launched) > 1000
    assert view.kernel_ns == int(launched["duration_ns"].sum())
    assert 0 < view.busy_pct < 100
    kinds = [row.kind for row in view.rows]
    assert kinds == sorted(kinds, key=["nvtx", "gpu", "host"].index)    # ranges above, GPU, host below
    assert view.rows[0].label == view.label                                # the step range itself on top
    host = [row.label for row in view.rows if row.kind == "host"]
    # the backward's kernels come from autograd's thread: two host rows that launch
    assert len(host) == 2 and host[0].startswith("CUDA API, main") and host[1].startswith("CUDA API, thread")
    assert all(int(label.split("\n")[1].split()[0].replace(",", "")) > 100 for label in host)


def test_a_step_the_trace_lacks_is_one_line(traces):
    trace = traces(BF16)
    with pytest.raises(UserError, match=r"no range step9 in the trace; it has step0, step1, step2, step3$"):
        step_view(trace, 9)
    with pytest.raises(UserError, match="takes a step number"):
        pick_step(trace, "forward")


def test_a_trace_without_step_ranges_is_drawn_whole(traces):
    trace = load_trace(BF16)
    trace.ranges = trace.ranges.iloc[:0]
    view = step_view(trace)
    assert view.label == "whole trace" and view.kernel_count == len(trace.kernels)
    with pytest.raises(UserError, match="no step ranges"):
        step_view(trace, 1)


# ---------------------------------------------------------------- the picture


def colours_in(png: bytes, colours: dict) -> set[str]:
    """The names of `colours` that some pixel of the picture has exactly."""
    import io

    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).reshape(-1, 3).astype("int64")
    found = set(np.unique((pixels[:, 0] << 16) | (pixels[:, 1] << 8) | pixels[:, 2]).tolist())
    return {name for name, h in colours.items() if int(h[1:], 16) in found}


@pytest.mark.parametrize("path", [BF16, EXAMPLE])
def test_the_picture_has_its_size_and_the_categories_colours(traces, path):
    trace = traces(path)
    view = step_view(trace)
    png = render_timeline_png(view, "swin_tiny train bf16")
    import io

    img = Image.open(io.BytesIO(png))
    assert img.size == (int(FIGSIZE_IN[0] * DPI), int(FIGSIZE_IN[1] * DPI)) == (1600, 900)
    present = set(categorize(step_kernels(trace, view.label)["name"]))
    shown = colours_in(png, CATEGORY_COLORS)
    assert len(shown) >= 6 and shown <= set(CATEGORY_COLORS)
    assert {"GEMM", "copy/memory", "normalization", "elementwise"} <= shown
    assert shown >= present - {"other"}       # "other" shares its grey with matplotlib's
    assert "launch" in colours_in(png, API_COLORS)


def test_a_cpu_capture_is_drawn_with_its_operators(tmp_path):
    trace = load_trace(DATA / "kineto_cpu_tiny_train.json")
    view = step_view(trace)
    assert [r.label for r in view.rows if r.kind == "gpu"] == ["CPU operators"]
    assert not [r for r in view.rows if r.kind == "host"]                 # no CUDA calls on the CPU
    paths = write_timeline(trace, tmp_path, title="tiny cpu", origin="trace.json")
    assert [p.name for p in paths] == ["timeline.png", "timeline.json"]
    events = json.loads(paths[1].read_text())["traceEvents"]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    assert len(ops) == sum(len(step_kernels(trace, s)) for s in step_ranges(trace.ranges)["name"])


# ---------------------------------------------------------------- the Perfetto export


def timed(doc) -> list[dict]:
    return [e for e in doc["traceEvents"] if e["ph"] != "M"]


@pytest.mark.parametrize("path", NSYS_TRACES)
def test_the_export_holds_every_steps_kernels_in_time_order(traces, path):
    trace = traces(path)
    doc, notes = perfetto_trace(trace, origin="trace.sqlite")
    doc = json.loads(json.dumps(doc))                       # what a reader of the file gets
    steps = list(step_ranges(trace.ranges)["name"])
    assert doc["otherData"]["steps"] == steps and doc["trace"] == "trace.sqlite"
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    in_steps = sum(len(step_kernels(trace, s)) for s in steps)
    assert len(kernels) == doc["otherData"]["kernels"] == in_steps
    outside = len(trace.kernels) - in_steps
    assert (f"{outside:,} kernels launched outside the step ranges" in "; ".join(notes)) == (outside > 0)
    ts = [e["ts"] for e in timed(doc)]
    assert min(ts) >= 0 and all(a <= b for a, b in zip(ts, ts[1:]))
    assert all(e["dur"] >= 0 for e in timed(doc) if e["ph"] == "X")
    assert {e["pid"] for e in kernels} == {GPU_PID_BASE}        # GPU 0's process, one track per stream
    assert {e["tid"] for e in kernels} == set(trace.kernels["stream_id"])
    k = kernels[0]["args"]
    assert set(k) >= {"name", "category", "step", "stream", "correlation", "launched_by_tid"}
    assert sum(e["dur"] for e in kernels) == pytest.approx(
        sum(int(step_kernels(trace, s)["duration_ns"].sum()) for s in steps) / 1e3, abs=len(kernels) * 1e-3)
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert any(n.startswith("main thread") for n in names) and "stream 7" in names
    starts = [e["id"] for e in doc["traceEvents"] if e["ph"] == "s"]
    assert sorted(starts) == sorted(e["id"] for e in doc["traceEvents"] if e["ph"] == "f") == list(range(len(starts)))


def test_the_export_keeps_whole_steps_under_its_cap_and_says_what_it_cut(traces):
    trace = traces(BF16)
    full, _ = perfetto_trace(trace)
    kernels = [e for e in timed(full) if e.get("cat") == "kernel"]
    per_step = {s: sum(e["args"]["step"] == s for e in kernels) for s in full["otherData"]["steps"]}
    # a cap that holds step0 and step1 but not step2: the events before step2's range starts, and a few
    step2 = step_ranges(trace.ranges).set_index("name").loc["step2", "start_ns"]
    step2_us = (step2 - full["otherData"]["time_zero_ns"]) / 1e3
    cap = sum(e["ts"] < step2_us for e in timed(full)) + 10
    doc, notes = perfetto_trace(trace, max_events=cap)
    assert len(timed(doc)) <= cap and doc["otherData"]["steps"] == ["step0", "step1"]
    assert doc["otherData"]["kernels"] == per_step["step0"] + per_step["step1"]
    assert "step2…step3 (2 of 4 steps) left out: the export holds at most" in notes[0]
    assert doc["otherData"]["left_out"].startswith("step2…step3")
    tiny, notes = perfetto_trace(trace, max_events=3000)   # under step0 alone: its first events
    assert 0 < len(timed(tiny)) <= 3000 and tiny["otherData"]["steps"] == ["step0"]
    assert notes[0].startswith("step0 alone has")


def test_the_files_name_their_trace(traces, tmp_path):
    png, js = write_timeline(traces(BF16), tmp_path, title="t", origin="../data/x.sqlite.xz")
    assert timeline_origin(png) == timeline_origin(js) == "../data/x.sqlite.xz"
    (tmp_path / "other.png").write_bytes(b"not a png")
    assert timeline_origin(tmp_path / "other.png") is None


# ---------------------------------------------------------------- the commands


def test_analyze_writes_the_timeline_beside_its_tables(tmp_path):
    out = tmp_path / "tables"
    result = runner.invoke(app, ["analyze", str(BF16), "--format", "csv", "--out", str(out), "--step", "step1"])
    assert result.exit_code == 0, result.output
    assert Image.open(out / "timeline.png").size == (1600, 900)
    doc = json.loads((out / "timeline.json").read_text())
    assert doc["otherData"]["steps"] == ["step0", "step1", "step2", "step3"]
    # the same trace, one range: the tables of the range beside, the timeline rewritten
    result = runner.invoke(app, ["analyze", str(BF16), "--range", "backward", "--format", "json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    # another trace's timeline is in the way as its tables are; --no-timeline leaves it be
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(out / "timeline.png", other)
    result = runner.invoke(app, ["analyze", str(FP32), "--format", "csv", "--out", str(other)])
    assert result.exit_code == 2 and "timeline.png holds the timeline of another trace" in result.output
    assert len(result.output.strip().splitlines()) == 1
    result = runner.invoke(app, ["analyze", str(FP32), "--format", "csv", "--out", str(other), "--no-timeline"])
    assert result.exit_code == 0, result.output
    assert not (other / "timeline.json").exists()
    result = runner.invoke(app, ["analyze", str(FP32), "--format", "csv", "--out", str(other), "--overwrite"])
    assert result.exit_code == 0, result.output
    (aside,) = other.glob("previous-*")
    assert sorted(p.name for p in aside.iterdir())[-1] == "timeline.png"
    assert timeline_origin(other / "timeline.png").endswith("swin_tiny_train_fp32.sqlite.xz")


@pytest.mark.parametrize("args, text", [
    (["--format", "csv", "--step", "7"], "no range step7 in the trace"),
    (["--format", "csv", "--step", "fwd"], "takes a step number"),
    (["--step", "1"], "it needs --format"),
    (["--format", "csv", "--no-timeline", "--step", "1"], "it needs --format"),
])
def test_analyze_step_mistakes_are_one_line(tmp_path, args, text):
    result = runner.invoke(app, ["analyze", str(BF16), "--out", str(tmp_path), *args])
    assert result.exit_code == 2 and text in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert not list(tmp_path.iterdir())


def test_apply_profile_keeps_each_stages_timeline_and_the_report_shows_it(tmp_path, monkeypatch):
    """A profiled stage (its capture replaced by the committed trace) records where its timeline.png is,
    relative to the run folder, and the report shows it."""
    import workbench.capture.backends as backends
    from workbench.ladder.apply import StageSpec, _profile_stage
    from workbench.optimize.workload import WorkloadConfig
    from workbench.results.record import write_record
    from workbench.results.report import render_report_from_paths

    from record_helpers import record

    def captured(config, stage, source, folder, steps, warmup):
        Path(folder).mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(BF16, Path(folder) / "trace.sqlite.xz")), "nsys"

    monkeypatch.setattr(backends, "capture_workload", captured)
    run = tmp_path / "run"
    spec = StageSpec(run_id="r1", recipe="amp", stage="amp", stage_index=1, stage_ref="amp", recipe_source=None,
                     config={}, steps=4, warmup=2, profile=True, out_dir=str(run))
    config = WorkloadConfig(model="swin_tiny_patch4_window7_224", mode="train", batch=32, precision="bf16",
                            device="cuda")
    rec = record(1, "amp", "baseline", 50.0)
    rec["profile"] = _profile_stage(spec, config, rec)
    assert rec["profile"]["timeline"] == "profiles/01-amp/timeline.png" and not rec["notes"]
    assert (run / "profiles" / "01-amp" / "timeline.json").exists()
    write_record(rec, run / "records")
    report = render_report_from_paths([run / "records"], tmp_path / "elsewhere" / "report.md").read_text()
    assert "## One step of each profiled stage" in report
    assert "![amp: one step](../run/profiles/01-amp/timeline.png)" in report
    at_home = render_report_from_paths([run / "records"]).read_text()
    assert "![amp: one step](profiles/01-amp/timeline.png)" in at_home
