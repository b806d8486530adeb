"""Bad inputs end in one UserError line (exit code 2), never a traceback."""
from __future__ import annotations

import lzma
import sqlite3
from pathlib import Path

import pytest

from workbench.analysis.analyze import analyze_trace, write_analysis
from workbench.errors import UserError

DATA = Path(__file__).parent / "data"
BF16_XZ = DATA / "swin_tiny_train_bf16.sqlite.xz"


def assert_user_error(path, match, **kwargs):
    with pytest.raises(UserError, match=match) as info:
        analyze_trace(path, **kwargs)
    message = str(info.value)
    assert info.value.exit_code == 2 and "\n" not in message and message
    return message


def test_no_such_file(tmp_path):
    assert_user_error(tmp_path / "missing.sqlite", "trace not found")


def test_directory(tmp_path):
    assert_user_error(tmp_path, "directory")


def test_not_sqlite(tmp_path):
    path = tmp_path / "notes.sqlite"
    path.write_text("this is not a database\n" * 100)
    assert_user_error(path, "cannot read .* as an nsys SQLite export")


def test_truncated_xz(tmp_path):
    path = tmp_path / "truncated.sqlite.xz"
    path.write_bytes(BF16_XZ.read_bytes()[:50_000])
    assert_user_error(path, "cannot decompress")


def test_corrupt_xz(tmp_path):
    path = tmp_path / "corrupt.sqlite.xz"
    path.write_bytes(b"\xfd7zXZ\x00" + bytes(range(256)) * 4)
    assert_user_error(path, "cannot decompress")


def test_xz_of_something_else(tmp_path):
    path = tmp_path / "text.sqlite.xz"
    path.write_bytes(lzma.compress(b"hello, not sqlite" * 100))
    assert_user_error(path, "as an nsys SQLite export")


def test_truncated_sqlite(tmp_path):
    path = tmp_path / "cut.sqlite"
    path.write_bytes(lzma.decompress(BF16_XZ.read_bytes())[:300_000])
    assert_user_error(path, "cannot read|no kernel table|empty trace")


def test_no_kernel_table(tmp_path):
    path = tmp_path / "nokernels.sqlite"
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT)")
    assert_user_error(path, r"no kernel table \(CUPTI_ACTIVITY_KIND_KERNEL\)")


def test_kernel_table_without_required_columns(tmp_path):
    path = tmp_path / "odd.sqlite"
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, deviceId INTEGER)")
    assert_user_error(path, "lacks required column.*end.*demangledName/shortName")


def test_empty_trace(tmp_path):
    path = tmp_path / "empty.sqlite"
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT)")
        con.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, demangledName INTEGER, shortName INTEGER)")
    assert_user_error(path, "empty trace: no GPU kernels")


def test_unknown_suffix(tmp_path):
    path = tmp_path / "trace.txt"
    path.write_text("x")
    assert_user_error(path, "unknown trace type")


def test_bad_json(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text('{"traceEvents": [')
    assert_user_error(path, "cannot read .* as a Kineto JSON trace")


def test_json_without_events(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text('{"schemaVersion": 1}')
    assert_user_error(path, "no traceEvents")


def test_nsys_rep_without_nsys(tmp_path, monkeypatch):
    path = tmp_path / "run.nsys-rep"
    path.write_bytes(b"\x00" * 16)
    monkeypatch.setenv("SWINBENCH_NSYS", str(tmp_path / "no-such-nsys"))
    assert_user_error(path, "nsys not found")


def test_nsys_export_failure(tmp_path, monkeypatch):
    fake = tmp_path / "nsys"
    fake.write_text("#!/bin/sh\necho 'ERROR: not a report file' >&2\nexit 1\n")
    fake.chmod(0o755)
    path = tmp_path / "run.nsys-rep"
    path.write_bytes(b"\x00" * 16)
    monkeypatch.setenv("SWINBENCH_NSYS", str(fake))
    assert_user_error(path, "nsys export failed .*not a report file")


def test_unknown_range_and_name_style():
    assert_user_error(BF16_XZ, "no range named 'nope'.*available: step0", range_name="nope")
    assert_user_error(BF16_XZ, "unknown name style", name_style="mangled")


def test_unknown_output_format(tmp_path):
    analysis = analyze_trace(DATA / "kineto_synthetic_gpu.json")
    with pytest.raises(UserError, match="unknown output format"):
        write_analysis(analysis, tmp_path, "xlsx")


def test_a_record_given_as_a_trace_names_itself_and_what_reads_it(tmp_path):
    from workbench.errors import UserError
    from workbench.trace.kineto import load_kineto

    path = tmp_path / "00-baseline.json"
    path.write_text('{"schema": "swinbench.stage/3", "stage": "baseline"}')
    with pytest.raises(UserError, match=r"00-baseline.json is not a Kineto trace.*swinbench report"):
        load_kineto(path)


def test_a_cpu_captures_ranges_table_names_cpu_time(tmp_path):
    import csv
    from pathlib import Path

    from typer.testing import CliRunner

    from cli import app

    trace = Path(__file__).parent / "data" / "kineto_cpu_tiny_train.json"
    result = CliRunner().invoke(app, ["analyze", str(trace), "--format", "csv", "--out", str(tmp_path / "t")])
    assert result.exit_code == 0, result.output
    with open(tmp_path / "t" / "ranges.csv") as f:
        header = next(csv.reader(f))
    assert header[:6] == ["range", "instances", "operators", "cpu_ns", "avg_cpu_ns", "share_pct"]
