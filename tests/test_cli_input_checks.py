"""Options that cannot work are refused before anything runs: exit 2, one line, no stage measured."""
from pathlib import Path

import pytest
from typer.testing import CliRunner

import workbench.ladder.apply
from cli import app

runner = CliRunner()
DATA = Path(__file__).parent / "data"
RECORDS = DATA / "records" / "baseline"
TRACE = DATA / "kineto_cpu_tiny_train.json"


@pytest.fixture
def no_run(monkeypatch):
    """apply must stop before run_apply: it fails the test if it is reached."""
    calls = []
    monkeypatch.setattr(workbench.ladder.apply, "run_apply", lambda *a, **k: calls.append(a) or pytest.fail("ran"))
    return calls


def refused(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    return result.output


@pytest.mark.parametrize("top", ["0", "-5"])
def test_top_below_one_is_refused(top, tmp_path):
    assert "--top must be at least 1" in refused(["analyze", str(TRACE), "--top", top])
    assert "--top must be at least 1" in refused(["profile", "--top", top, "--device", "cpu",
                                                  "--out", str(tmp_path / "p")])
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("extra, message", [
    (["--check-against", "{tmp}/nothere"], "no such record"),
    (["--check-against", "{tmp}"], "no stage records"),
    (["--check-against", str(RECORDS), "--thresholds", "{tmp}/nothere.yaml"], "cannot read thresholds"),
    (["--check-against", str(RECORDS), "--thresholds", "{tmp}/bad.yaml"], "unknown key"),
    (["--check-against", str(RECORDS), "--max-regression", "lots"], "percentage"),
    (["--check-against", str(RECORDS), "--max-regression", "nan"], "percentage"),
    (["--check-against", str(RECORDS), "--max-regression", "inf%"], "percentage"),
    (["--check-against", str(RECORDS), "--max-regression", "-5"], "percentage"),
    (["--thresholds", str(RECORDS)], "with --check-against"),
])
def test_apply_check_options_are_validated_before_any_stage(tmp_path, no_run, extra, message):
    (tmp_path / "bad.yaml").write_text("limits: {img_per_s: 3}\n")
    out = refused(["apply", "--stages", "baseline", "--device", "cpu", "--out", str(tmp_path / "run"),
                   *[a.replace("{tmp}", str(tmp_path)) for a in extra]])
    assert message in out
    assert no_run == [] and not (tmp_path / "run").exists()


def test_error_quoting_rich_markup_is_printed_as_text(tmp_path):
    out = refused(["apply", "--recipe", str(tmp_path / "a[/x]b.yaml"), "--device", "cpu"])
    assert "a[/x]b.yaml" in out
