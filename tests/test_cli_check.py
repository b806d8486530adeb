"""`swinbench check` through the CLI: exit codes and output, on committed records."""
import json
import shutil
from pathlib import Path

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
