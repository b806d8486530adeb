"""`swinbench check` through the CLI: exit codes and output, on committed records."""
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app

runner = CliRunner()
SAMPLE = Path(__file__).parent / "data" / "records" / "baseline"


def test_identical_records_exit_0():
    result = runner.invoke(app, ["check", "--baseline", str(SAMPLE), "--current", str(SAMPLE)])
    assert result.exit_code == 0, result.output
    assert "no regression" in result.output


def test_slower_stage_exit_1_and_json_names_it(tmp_path):
    cur = tmp_path / "cur"
    shutil.copytree(SAMPLE, cur)
    f = sorted(cur.glob("*.json"))[-1]
    rec = json.loads(f.read_text())
    rec["step_ms"] *= 1.2
    rec["img_per_s"] /= 1.2
    rec["timing"]["median_ms"] *= 1.2
    rec["timing"]["samples_ms"] = [x * 1.2 for x in rec["timing"]["samples_ms"]]
    f.write_text(json.dumps(rec))
    result = runner.invoke(app, ["check", "--baseline", str(SAMPLE), "--current", str(cur), "--format", "json",
                                 "--output", str(tmp_path / "check.json")])
    assert result.exit_code == 1, result.output
    data = json.loads((tmp_path / "check.json").read_text())
    bad = [r for r in data["rows"] if r["status"] == "REGRESSED"]
    assert {r["stage"] for r in bad} == {rec["stage"]}


def test_bad_input_exit_2_one_line(tmp_path):
    (tmp_path / "x.json").write_text("{not json")
    result = runner.invoke(app, ["check", "--baseline", str(SAMPLE), "--current", str(tmp_path / "x.json")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    result = runner.invoke(app, ["check", "--baseline", str(SAMPLE), "--current", str(SAMPLE),
                                 "--max-regression", "lots"])
    assert result.exit_code == 2 and "percentage" in result.output


RECORDS = Path(__file__).parent / "data" / "records"


def test_two_h200_runs_of_one_stage_check_clean_against_each_other():
    """Real H200 records of the amp stage (Swin-B, batch 64) from two separate runs must agree within the
    default limits: the check does not flag a stage that did not change."""
    result = runner.invoke(app, ["check", "--baseline", str(RECORDS / "h200-amp-run-a"),
                                 "--current", str(RECORDS / "h200-amp-run-b"), "--format", "json"])
    assert result.exit_code == 0, result.output
    rows = [r for r in json.loads(result.output)["rows"] if r["stage"] == "amp" and r["metric"] == "img_per_s"]
    assert rows and rows[0]["status"] == "unchanged"


def _hostile_copy(tmp_path, field, value) -> Path:
    """The committed records with one field of the amp record replaced."""
    folder = tmp_path / "hostile"
    shutil.copytree(SAMPLE, folder)
    path = next(folder.glob("*-amp.json"))
    rec = json.loads(path.read_text())
    rec[field] = value
    path.write_text(json.dumps(rec))
    return folder


def _one_line_exit_2(result, *needles):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    for needle in needles:
        assert needle in result.output, result.output


HOSTILE = [("img_per_s", float("nan")), ("img_per_s", float("inf")), ("img_per_s", None), ("img_per_s", -900.0),
           ("stage_index", "two"), ("run_id", 5), ("peak_mem_bytes", 10**30), ("step_ms", [71.0]),
           ("env", ["NVIDIA H200"]), ("timing", "fast")]


@pytest.mark.parametrize("field,value", HOSTILE, ids=[f"{f}={v!r}" for f, v in HOSTILE])
@pytest.mark.parametrize("side", ["--current", "--baseline"])
def test_a_record_that_is_not_a_measurement_is_bad_input(tmp_path, side, field, value):
    """NaN, infinite, null or wrong-typed figures are neither 'improved' nor 'only in baseline': exit 2, one
    line naming the file, the stage and the field, on either side."""
    hostile = _hostile_copy(tmp_path, field, value)
    other = "--baseline" if side == "--current" else "--current"
    result = runner.invoke(app, ["check", side, str(hostile), other, str(SAMPLE)])
    _one_line_exit_2(result, "01-amp.json", "stage 'amp'", f"'{field}")


def _thresholds(tmp_path, content: bytes) -> Path:
    path = tmp_path / "thresholds.yaml"
    path.write_bytes(content)
    return path


@pytest.mark.parametrize("content,needle", [
    (b"default: {max_regression_pct: 5}\n# \xff\xfe\n", "not UTF-8"),
    (b"default: {max_regression_pct: .inf}\n", "default.max_regression_pct"),
    (b"stages:\n  fmha: {img_per_s: .inf}\n", "stages.fmha.img_per_s"),
    (b"noise_iqr_scale: .nan\n", "noise_iqr_scale"),
    (b"default: {peak_mem_bytes: " + b"9" * 400 + b"}\n", "default.peak_mem_bytes"),
    (b"a: &a [x, x, x, x, x, x, x, x, x]\n" + b"".join(b"%c: &%c [*%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c]\n"
                                                       % ((97 + i + 1,) * 2 + (97 + i,) * 9) for i in range(8)),
     "not read"),
], ids=["non-utf8", "inf-default", "inf-stage", "nan-scale", "huge-int", "alias-bomb"])
def test_bad_thresholds_are_one_line_exit_2(tmp_path, content, needle):
    result = runner.invoke(app, ["check", "--baseline", str(SAMPLE), "--current", str(SAMPLE),
                                 "--thresholds", str(_thresholds(tmp_path, content))])
    _one_line_exit_2(result, needle)


def test_unwritable_output_is_exit_2(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = runner.invoke(app, ["check", "--baseline", str(SAMPLE), "--current", str(SAMPLE),
                                 "--output", str(blocker / "check.md")])
    _one_line_exit_2(result, "cannot write")


def test_an_unexpected_failure_is_exit_2_not_a_regression(monkeypatch):
    import workbench.results.check

    def broken(*args, **kwargs):
        raise KeyError("surprise")

    monkeypatch.setattr(workbench.results.check, "check_records", broken)
    result = runner.invoke(app, ["check", "--baseline", str(SAMPLE), "--current", str(SAMPLE)])
    _one_line_exit_2(result, "not a regression", "KeyError")


def test_a_json_table_among_stage_records_is_refused_before_it_is_written(tmp_path):
    records = tmp_path / "run" / "records"
    shutil.copytree(SAMPLE, records)
    before = sorted(p.name for p in records.iterdir())
    result = runner.invoke(app, ["check", "--baseline", str(SAMPLE), "--current", str(records), "--format", "json",
                                 "--output", str(records / "check.json")])
    _one_line_exit_2(result, "as a stage record")
    assert sorted(p.name for p in records.iterdir()) == before
    # beside the records/ folder, or under a name report and check skip, it is written
    for out in (tmp_path / "run" / "check.json", records / "_check.json"):
        result = runner.invoke(app, ["check", "--baseline", str(SAMPLE), "--current", str(records), "--format",
                                     "json", "--output", str(out)])
        assert result.exit_code == 0 and out.is_file(), result.output
    assert runner.invoke(app, ["check", "--baseline", str(SAMPLE), "--current", str(records)]).exit_code == 0


@pytest.mark.parametrize("fails_in_baseline, code", [(False, 1), (True, 2)])
def test_apply_checks_a_run_whose_stage_failed(tmp_path, monkeypatch, fails_in_baseline, code):
    """`apply --check-against`: a stage that ran in the baseline and fails now is a regression (exit 1),
    checked on the records the failed run wrote; a failure the baseline had too stays exit 2."""
    from types import SimpleNamespace

    import workbench.ladder.apply as apply_mod
    from workbench.errors import UserError

    base, cur = tmp_path / "base", tmp_path / "cur"
    shutil.copytree(SAMPLE, base)
    shutil.copytree(SAMPLE, cur)

    def broke(folder):
        f = next(folder.glob("*-amp.json"))
        rec = json.loads(f.read_text())
        rec.update(status="error", error="RuntimeError: boom", precision="fp32", img_per_s=None, step_ms=None,
                   timing=None)
        f.write_text(json.dumps(rec))

    broke(cur)
    if fails_in_baseline:
        broke(base)

    def run_apply(*args, **kwargs):
        err = UserError("1 stage(s) failed (amp: RuntimeError: boom)", exit_code=2)
        err.result = SimpleNamespace(records_dir=cur)
        raise err

    monkeypatch.setattr(apply_mod, "run_apply", run_apply)
    result = runner.invoke(app, ["apply", "--device", "cuda", "--check-against", str(base)])   # the baseline's
    assert result.exit_code == code, result.output
    assert "1 stage(s) failed" in result.output
    assert ("REGRESSED" in result.output) == (code == 1)


def test_apply_records_a_reference_that_cannot_be_computed(tmp_path, monkeypatch):
    """The baseline's reference outputs failing (a CPU out of memory at a huge batch) is each stage's
    recorded error and one line, exit 2: never a traceback and exit 1."""
    import workbench.ladder.apply as apply_mod

    def no_memory(config):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] . DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 9999 bytes")

    monkeypatch.setattr(apply_mod, "compute_reference", no_memory)
    out = tmp_path / "run"
    result = runner.invoke(app, ["apply", "--device", "cpu", "--stages", "baseline,amp", "--steps", "1", "--warmup",
                                 "0", "--batch", "1", "--no-peers", "--no-isolate", "--interleave", "0", "--out",
                                 str(out)])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    records = [json.loads(f.read_text()) for f in sorted((out / "records").glob("*.json"))]
    assert [r["error"] for r in records] == ["out of memory at batch 1 (baseline reference)"] * 2
