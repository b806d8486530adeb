"""Broken traces: rows whose times cannot be real are dropped with one warning line per kind (in the
analysis, its rendering and its JSON); a trace with nothing valid left, without StringIds, or expanding
past the decompression cap is one UserError line and exit 2. Hand-built hostile files in tmp_path."""
from __future__ import annotations

import gzip
import json
import lzma
import os
import sqlite3
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

import workbench.trace as trace_pkg
from cli import app
from trace_builders import GOOD_KERNELS, kineto_trace, nsys_export
from workbench.analysis.analyze import analyze_trace, render_analysis, write_analysis
from workbench.errors import UserError
from workbench.trace import MAX_SPAN_NS, load_trace

DATA = Path(__file__).parent / "data"
runner = CliRunner()
GOOD_NS = sum(e - s for s, e, _, _ in GOOD_KERNELS)
DAY = 24 * 3600 * 10**9
assert MAX_SPAN_NS == DAY

# (case, the bad kernel row, the reason its warning gives)
BAD_NSYS_ROWS = [
    ("end before start", (7000, 6500, 0, 1), "an end before the start"),
    ("NULL start", (None, 7000, 0, 1), "no start or end time"),
    ("NULL end", (7000, None, 0, 1), "no start or end time"),
    ("text start", ("soon", 7000, 0, 1), "a start or end time that is not a number"),
    ("blob end", (7000, b"\x00\x01", 0, 1), "a start or end time that is not a number"),
    ("negative start", (-40, 100, 0, 1), "a negative start or end time"),
    ("beyond 2^62", (2**62 + 10, 2**62 + 20, 0, 1), "an absurd time"),
    ("huge real", (1e30, 1e30, 0, 1), "an absurd time"),
    ("huge start", (1e30, 7000, 0, 1), "an absurd time"),
    ("lasting over a day", (7000, 7000 + DAY + 1, 0, 1), "an absurd time"),
    ("a day from the rest", (7000 + DAY, 7000 + DAY + 100, 0, 1), "an absurd time"),
]


def one_line_error(args) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    return result.output


@pytest.mark.parametrize("case,row,reason", BAD_NSYS_ROWS, ids=[c for c, _, _ in BAD_NSYS_ROWS])
def test_nsys_bad_kernel_row_is_dropped_with_one_warning(tmp_path, case, row, reason):
    path = nsys_export(tmp_path / "t.sqlite", GOOD_KERNELS[:2] + [row] + GOOD_KERNELS[2:])
    analysis = analyze_trace(path)
    [warning] = [w for w in analysis.warnings if "kernel rows" in w]  # its launch may be broken as well
    assert warning.startswith(f"dropped 1 of 5 kernel rows: {reason}")
    assert analysis.trace_meta["kernel_count"] == 4 and analysis.kernels["total_ns"].sum() == GOOD_NS
    assert (analysis.kernels["min_ns"] >= 0).all() and analysis.ranges["share_pct"].max() <= 100.0
    busy = analysis.busy.set_index("metric")["ns"]
    assert busy["span"] == 6200 - 1000 and busy["kernel_sum"] == GOOD_NS
    result = runner.invoke(app, ["analyze", str(path)])
    assert result.exit_code == 0, result.output
    assert f"warning: dropped 1 of 5 kernel rows: {reason}" in result.output


def test_one_warning_line_per_kind(tmp_path):
    bad = [(9000, 8000, 0, 1), (9500, 9000, 0, 1), (None, 5, 0, 1), ("x", 5, 0, 1), ("y", "z", 0, 2)]
    path = nsys_export(tmp_path / "t.sqlite", GOOD_KERNELS + bad)
    trace = load_trace(path)
    assert trace.meta["warnings"] == [
        "dropped 1 of 9 kernel rows: no start or end time",
        "dropped 2 of 9 kernel rows: a start or end time that is not a number",
        "dropped 2 of 9 kernel rows: an end before the start",
    ]
    assert len(trace.kernels) == 4 and (trace.kernels["duration_ns"] > 0).all()


def test_warnings_in_rendering_and_json(tmp_path):
    path = nsys_export(tmp_path / "t.sqlite", GOOD_KERNELS + [(9000, 8000, 0, 1)])
    analysis = analyze_trace(path)
    console = Console(record=True, width=140, file=open(os.devnull, "w"))
    render_analysis(analysis, console)
    assert "warning: dropped 1 of 5 kernel rows: an end before the start" in console.export_text()
    [js] = write_analysis(analysis, tmp_path / "out", "json")
    assert json.loads(js.read_text())["meta"]["warnings"] == ["dropped 1 of 5 kernel rows: an end before the start"]


def test_diff_carries_each_sides_warnings(tmp_path):
    good = nsys_export(tmp_path / "good.sqlite", GOOD_KERNELS)
    bad = nsys_export(tmp_path / "bad.sqlite", GOOD_KERNELS + [(9000, 8000, 0, 1)])
    result = runner.invoke(app, ["diff", str(good), str(bad), "--format", "json", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    line = f"warning: {bad}: dropped 1 of 5 kernel rows: an end before the start"
    # rich wraps the long line at a space or inside the path, as the tmp path's length falls: compare
    # both without whitespace
    assert "".join(line.split()) in "".join(result.output.split())
    assert json.loads((tmp_path / "diff.json").read_text())["warnings"] == [line[len("warning: "):]]


def test_broken_range_api_and_memop_rows_are_dropped_too(tmp_path):
    path = nsys_export(tmp_path / "t.sqlite", GOOD_KERNELS, ranges=[(500, 20_000, 4), (9000, 600, 5), ("a", 700, 5)])
    with sqlite3.connect(path) as con:
        con.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (NULL, 5, ?, 99, 3)", (1,))
        con.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INTEGER, end INTEGER, bytes INTEGER)")
        con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES (?, ?, 64)", [(100, 200), (300, -1)])
    trace = load_trace(path)
    assert trace.meta["warnings"] == [
        "dropped 1 of 3 NVTX range rows: a start or end time that is not a number",
        "dropped 1 of 3 NVTX range rows: an end before the start",
        "dropped 1 of 2 memcpy/memset rows: a negative start or end time",
        "dropped 1 of 5 CUDA API rows: no start or end time",
    ]
    assert trace.ranges["name"].tolist() == ["step0"] and len(trace.memops) == 1 and len(trace.api) == 4


def test_nothing_valid_left_is_one_line_exit_2(tmp_path):
    path = nsys_export(tmp_path / "t.sqlite", [(5, 1, 0, 1), (None, 3, 0, 1)])
    with pytest.raises(UserError, match="no GPU kernel with valid times in .*t.sqlite: dropped 1 of 2 kernel rows"):
        load_trace(path)
    assert "no GPU kernel with valid times" in one_line_error(["analyze", str(path)])


def test_missing_string_ids_is_one_line_exit_2(tmp_path):
    path = nsys_export(tmp_path / "t.sqlite", GOOD_KERNELS, strings=False)
    assert "no StringIds table" in one_line_error(["analyze", str(path)])
    assert "no StringIds table" in one_line_error(["diff", str(path), str(path)])


def test_unknown_string_id_keeps_the_row_under_a_placeholder(tmp_path):
    path = nsys_export(tmp_path / "t.sqlite", GOOD_KERNELS + [(7000, 7500, 0, 99)])
    trace = load_trace(path)
    assert trace.meta["warnings"] == ["1 of 5 kernel rows name a string id that StringIds lacks: shown as <string id N>"]
    assert trace.kernels["name"].iloc[-1] == "<string id 99>" and int(trace.kernels["duration_ns"].sum()) == GOOD_NS + 500


def test_text_in_id_columns_is_not_a_crash(tmp_path):
    path = nsys_export(tmp_path / "t.sqlite", GOOD_KERNELS + [(7000, 7500, "gpu zero", "gemm")])
    trace = load_trace(path)
    assert trace.kernels["device_id"].tolist() == [0, 0, 0, 0, -1]
    assert trace.kernels["name"].iloc[-1] == "<no name>"


# --- Kineto -----------------------------------------------------------------------------------------------

GOOD_KINETO = [(1.0, 1.0, 0), (2.5, 0.5, 0), (3.5, 1.5, 0), (5.2, 1.0, 0)]  # µs: the same 4,000 ns
BAD_KINETO = [
    ("ts missing", (None, 1.0, 0), "no start or end time"),
    ("dur missing", (7.0, None, 0), "no start or end time"),
    ("ts text", ("later", 1.0, 0), "a start or end time that is not a number"),
    ("ts NaN", (float("nan"), 1.0, 0), "no start or end time"),  # JSON NaN reads as an absent value
    ("negative dur", (7.0, -0.5, 0), "an end before the start"),
    ("negative ts", (-7.0, 1.0, 0), "a negative start or end time"),
    ("ts 1e300", (1e300, 1.0, 0), "an absurd time"),
    ("ts infinite", (float("inf"), 1.0, 0), "an absurd time"),
    ("ts a day later", (7.0 + 86_400e6, 1.0, 0), "an absurd time"),
]


@pytest.mark.parametrize("case,event,reason", BAD_KINETO, ids=[c for c, _, _ in BAD_KINETO])
def test_kineto_bad_kernel_event_is_dropped_with_one_warning(tmp_path, case, event, reason):
    path = kineto_trace(tmp_path / "t.json", GOOD_KINETO + [event])
    analysis = analyze_trace(path)
    [warning] = analysis.warnings
    assert warning.startswith(f"dropped 1 of 5 kernel rows: {reason}")
    assert analysis.kernels["total_ns"].sum() == GOOD_NS and analysis.ranges["share_pct"].max() <= 100.0
    assert "warning: dropped 1 of 5 kernel rows" in runner.invoke(app, ["analyze", str(path)]).output


def test_kineto_all_kernels_broken_is_an_error_not_a_cpu_fallback(tmp_path):
    path = kineto_trace(tmp_path / "t.json", [("x", 1.0, 0), (1.0, -1.0, 0)])
    assert "no GPU kernel with valid times in" in one_line_error(["analyze", str(path)])


def test_kineto_deeply_nested_json_is_one_line(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert "cannot read" in one_line_error(["analyze", str(path)])


# --- decompression cap ------------------------------------------------------------------------------------

def test_xz_bomb_is_refused_naming_the_cap(tmp_path):
    path = tmp_path / "bomb.sqlite.xz"
    path.write_bytes(lzma.compress(b"\0" * 3_000_000))  # ~500 bytes that expand 6,000x
    cap = 50 * path.stat().st_size
    message = one_line_error(["analyze", str(path)])
    assert f"decompresses to more than {cap:,} bytes" in message and "50x" in message


def test_xz_absolute_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(trace_pkg, "MAX_DECOMPRESSED_BYTES", 1 << 20)
    path = tmp_path / "big.sqlite.xz"
    path.write_bytes(lzma.compress(os.urandom(1_200_000)))  # incompressible: under 50x, over the 1 MiB cap
    with pytest.raises(UserError, match=r"decompresses to more than 1,048,576 bytes"):
        load_trace(path)
    monkeypatch.setattr(trace_pkg, "MAX_DECOMPRESSED_BYTES", 4 << 30)
    assert len(load_trace(DATA / "swin_tiny_train_fp32.sqlite.xz").kernels) > 0  # a real export is well under


def test_gzip_bomb_is_refused(tmp_path):
    path = tmp_path / "bomb.json.gz"
    path.write_bytes(gzip.compress(b'{"traceEvents": [' + b" " * 3_000_000 + b"]}"))
    assert "decompresses to more than" in one_line_error(["analyze", str(path)])
