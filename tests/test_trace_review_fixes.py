"""Traces that once gave a traceback or a wrong figure: a damaged gzip, text that is no text in an nsys
export, malformed metadata beside a trace, collectives nested in CPU captures, overlapping instances of a
range, a diff of a stepped and an unstepped capture, a memcpy-only capture's timeline, and options that a
folder of rank traces cannot honour."""
from __future__ import annotations

import gzip
import json
import sqlite3
from pathlib import Path

import pandas as pd
from typer.testing import CliRunner

from cli import app
from trace_builders import GOOD_KERNELS, kineto_trace, nsys_export, rank_folder
from workbench.analysis.analyze import analyze_trace
from workbench.analysis.diff import diff_analyses
from workbench.analysis.frames import range_instance_of
from workbench.trace import load_trace
from workbench.trace.kineto import cpu_ops_as_kernels

runner = CliRunner()


def one_line_error(args, needle: str) -> None:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert needle in result.output, result.output


def test_a_damaged_gzip_is_one_line(tmp_path):
    good = kineto_trace(tmp_path / "t.json", [(1.0, 2.0, 0)])
    packed = bytearray(gzip.compress(good.read_bytes()))
    packed[20:60] = bytes(b ^ 0x55 for b in packed[20:60])
    (tmp_path / "c.json.gz").write_bytes(bytes(packed))
    one_line_error(["analyze", tmp_path / "c.json.gz"], "cannot read")


def test_an_nvtx_name_that_is_no_text_and_a_blob_version_read_as_unnamed(tmp_path):
    path = nsys_export(tmp_path / "t.sqlite", GOOD_KERNELS)
    with sqlite3.connect(path) as con:
        con.execute("UPDATE StringIds SET value = x'ff' WHERE id = 4")
        con.execute("CREATE TABLE META_DATA_EXPORT (name TEXT, value TEXT)")
        con.execute("INSERT INTO META_DATA_EXPORT VALUES ('EXPORT_PRODUCT_VERSION', x'ff')")
    analysis = analyze_trace(path)
    assert analysis.trace_meta["export_version"] is None
    assert "<no name>" in set(analysis.trace.ranges["name"])
    assert runner.invoke(app, ["analyze", str(path)]).exit_code == 0


def test_a_malformed_export_names_the_file_not_the_query(tmp_path, monkeypatch):
    """pandas wraps SQLite's error in its own DatabaseError (an OSError), quoting the whole query."""
    import workbench.trace.nsys_sqlite as nsys

    path = nsys_export(tmp_path / "t.sqlite", GOOD_KERNELS)

    def malformed(self, sql):
        raise pd.errors.DatabaseError(f"Execution failed on sql '{sql}': database disk image is malformed")

    monkeypatch.setattr(nsys._Db, "query", malformed)
    one_line_error(["analyze", path], f"cannot read {path} as an nsys SQLite export: database disk image is malformed")


def test_malformed_device_properties_and_launches_file_are_left_out(tmp_path):
    doc = json.loads(kineto_trace(tmp_path / "t.json", [(1.0, 2.0, 0)]).read_text())
    for props in (5, [{"id": 0}], [{"name": 7}]):
        (tmp_path / "p.json").write_text(json.dumps({**doc, "deviceProperties": props}))
        assert runner.invoke(app, ["analyze", str(tmp_path / "p.json")]).exit_code == 0
    folder = tmp_path / "run"
    folder.mkdir()
    trace = nsys_export(folder / "trace.sqlite", GOOD_KERNELS)
    for bad in ({"device_name": 7}, {"largest": [["a"], "bf16"]}):
        launch = {"kernel": "softmax_warp_forward", "bytes": 10, "largest": [[2, 3], "bf16"]}
        doc = {"schema": "swinbench.launches/1", "device_name": "NVIDIA H200", "launches": [launch]}
        if "device_name" in bad:
            doc["device_name"] = bad["device_name"]
        else:
            launch["largest"] = bad["largest"]
        (folder / "launches.json").write_text(json.dumps(doc))
        assert load_trace(trace).launches is None
        result = runner.invoke(app, ["analyze", str(trace)])
        assert result.exit_code == 0 and "is not a swinbench.launches/1 file" in result.output, result.output


def test_a_collective_inside_a_collective_counts_once():
    def op(name, ts, dur):
        return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}

    data = {"traceEvents": [op("c10d::allreduce_", 10, 100), op("c10d::allreduce_coalesced_", 20, 50),
                            op("aten::copy_", 25, 5), op("aten::mm", 150, 20)]}
    leaves = cpu_ops_as_kernels(data)
    assert sorted(leaves["name"]) == ["aten::mm", "c10d::allreduce_"]
    assert int(leaves["duration_ns"].sum()) == 120_000


def test_a_launch_inside_a_long_instance_belongs_to_its_block_of_instances():
    kernels = pd.DataFrame({"launch_ns": [50, 150, 500, 1500, 1600], "pid": [1] * 5})
    instances = pd.DataFrame({"range_id": [0, 1, 2], "start_ns": [0, 100, 1400], "end_ns": [1000, 200, 1550],
                              "pid": [1, 1, 1]})
    assert range_instance_of(kernels, instances).tolist() == [0, 0, 0, 2, -1]


def test_diff_counts_host_launches_over_the_same_scope_as_the_kernels(tmp_path):
    stepped = nsys_export(tmp_path / "a.sqlite", GOOD_KERNELS, ranges=((1500, 4000, 4),))
    bare = nsys_export(tmp_path / "b.sqlite", GOOD_KERNELS, ranges=())
    d = diff_analyses(analyze_trace(stepped), analyze_trace(bare))
    assert d.unit == "trace"
    summary = dict(zip(d.summary["metric"], zip(d.summary["before"], d.summary["after"])))
    assert summary["host launches"] == (4.0, 4.0)        # both sides: every launch of the trace


def test_a_memcpy_only_capture_writes_its_timeline(tmp_path):
    doc = json.loads(kineto_trace(tmp_path / "t.json", [(1.0, 2.0, 0)]).read_text())
    events = [e for e in doc["traceEvents"] if e["cat"] != "kernel"]
    events += [{"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "pid": 1, "tid": 1, "ts": 1.0, "dur": 2.0},
               {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "pid": 0, "tid": 7, "ts": 1.5, "dur": 1.0,
                "args": {"device": 0, "stream": 7, "correlation": 0, "bytes": 64}}]
    (tmp_path / "m.json").write_text(json.dumps({**doc, "traceEvents": events}))
    result = runner.invoke(app, ["analyze", str(tmp_path / "m.json"), "--format", "json", "--out",
                                 str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    left_out = json.loads((tmp_path / "out" / "timeline.json").read_text())["otherData"]["left_out"]
    assert "memcpy/memset left out" in left_out


def test_a_folder_of_rank_traces_refuses_step_and_records_and_honours_range(tmp_path):
    folder = rank_folder(tmp_path / "ranks", [dict(gemm_us=100, comm_us=20, hidden_us=10, step_us=200)] * 2)
    one_line_error(["analyze", folder, "--step", "1"], "--step goes with one trace file")
    one_line_error(["analyze", folder, "--range", "nosuchrange"], "no range named 'nosuchrange'")
