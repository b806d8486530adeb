"""Options that cannot work are refused before anything runs: exit 2, one line, no stage measured."""
import shutil
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
    (["--check-against", str(RECORDS), "--batch", "3"], "the baseline's batch is"),
    (["--check-against", str(RECORDS), "--mode", "infer"], "the baseline's mode is train and this run's infer"),
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


@pytest.mark.parametrize("args, message", [
    (["profile", "--batch", "abc"], "Invalid value for '--batch'"),
    (["profile", "--batchsize", "2"], "No such option: --batchsize"),
    (["nosuchcommand"], "No such command"),
    (["diff", "a.json"], "Missing argument"),
    (["check", "--baseline", "x"], "Missing option '--current'"),
    (["apply", "--device", "cpu", "--seed", "-1"], "--seed must be a whole number from 0"),
    (["apply", "--device", "cpu", "--seed", "18446744073709551616"], "--seed must be a whole number from 0"),
    (["apply", "--device", "cpu", "--stages", "baseline,,amp"], "has an empty item"),
    # past what a record holds: refused before a stage starts, not when its record is written
    (["apply", "--device", "cpu", "--batch", "3000000000"], "--batch must be a whole number from 1 to 2147483648"),
    (["apply", "--device", "cpu", "--steps", "99999999999999999999"], "--steps must be a whole number from 1"),
    (["matrix", "--device", "cpu", "--warmup", "3000000000"], "--warmup from 0 to 2147483648"),
    (["check", "--baseline", "a", "--current", "b", "--max-regression", "5%%"], "--max-regression takes a percentage"),
])
def test_command_line_mistakes_are_one_line(args, message):
    out = refused(args)
    assert message in out and out.count("\n") == 1 and "Usage:" not in out and "╭" not in out


@pytest.mark.parametrize("device", ["gpu", "cuda:abc", ""])
def test_env_refuses_an_unknown_device(device):
    assert "unknown device" in refused(["env", "--device", device])


@pytest.mark.parametrize("args", [
    ["profile", "--model", ""], ["profile", "--recipe", " "], ["apply", "--model", ""], ["apply", "--stages", ""],
    ["train", "--recipe", ""], ["matrix", "--models", ""], ["apply", "--cache", ""], ["matrix", "--cache", ""],
    ["apply", "--recipe", " "],
])
def test_an_empty_option_is_refused_not_taken_for_its_default(args, tmp_path, no_run):
    refused([*args, "--device", "cpu", "--out", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args, message", [
    (["apply", "--force"], "--force is read with --check-against"),
    (["apply", "--max-regression", "10"], "--max-regression is read with --check-against"),
    (["train", "--rdzv-id", "job"], "--rdzv-id names the job"),
])
def test_options_that_need_another_are_refused_alone(args, message, tmp_path, no_run):
    assert message in refused([*args, "--device", "cpu", "--out", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["analyze", "diff"])
@pytest.mark.parametrize("option", [["--out", "tables"], ["--overwrite"]])
def test_analyze_and_diff_refuse_out_and_overwrite_without_format(command, option, tmp_path):
    """--out and --overwrite only place the tables --format writes: alone, nothing would be written."""
    traces = [str(TRACE)] * (2 if command == "diff" else 1)
    args = [a if a != "tables" else str(tmp_path / "tables") for a in option]
    output = refused([command, *traces, *args])
    assert f"{option[0]} is about the tables --format writes: it needs --format" in output
    assert len(output.strip().splitlines()) == 1 and not (tmp_path / "tables").exists()


def test_matrix_render_only_refuses_options_of_a_run(tmp_path):
    assert "--steps has nothing to do" in refused(["matrix", "--render-only", str(tmp_path), "--steps", "3"])


def test_a_cache_that_is_a_file_is_refused(tmp_path, no_run):
    (tmp_path / "cache").write_text("mine")
    assert "is a file" in refused(["apply", "--cache", str(tmp_path / "cache"), "--device", "cpu",
                                   "--out", str(tmp_path / "run")])
    assert (tmp_path / "cache").read_text() == "mine"


def test_matrix_refuses_a_folder_holding_another_run(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RECORDS, run / "records")
    assert "holds a run of apply, profile or train" in refused(["matrix", "--device", "cpu", "--steps", "1",
                                                                "--out", str(run)])
    assert sorted(p.name for p in run.iterdir()) == ["records"]


def test_matrix_refuses_an_out_that_is_a_file(tmp_path):
    (tmp_path / "afile").write_text("mine")
    assert "the output folder" in refused(["matrix", "--device", "cpu", "--out", str(tmp_path / "afile")])
    assert (tmp_path / "afile").read_text() == "mine"


def test_nothing_is_written_among_a_runs_records(tmp_path):
    # report and check read every *.json of records/ as a stage record: a matrix, an analysis or a
    # report there would leave the run unreadable
    run = tmp_path / "run"
    shutil.copytree(RECORDS, run / "records")
    (run / "report.md").write_text("# swinbench apply: theirs\n")
    before = sorted(p.name for p in (run / "records").iterdir())
    assert "is part of the run in" in refused(["matrix", "--device", "cpu", "--steps", "1",
                                               "--out", str(run / "records")])
    alone = tmp_path / "alone"     # records/ of no run folder: still records
    shutil.copytree(RECORDS, alone)
    assert "holds stage records" in refused(["matrix", "--device", "cpu", "--steps", "1", "--out", str(alone)])
    trace = Path(__file__).parent / "data" / "kineto_cpu_tiny_train.json"
    assert "holds stage records" in refused(["analyze", str(trace), "--format", "json", "--out", str(run / "records")])
    assert "read every *.json" in refused(["report", str(run), "--out", str(run / "records" / "x.json")])
    assert sorted(p.name for p in (run / "records").iterdir()) == before


def test_report_keeps_off_another_runs_report_and_checks_out_before_the_readme(tmp_path):
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    shutil.copytree(RECORDS, mine / "records")
    shutil.copytree(RECORDS, theirs / "records")
    (theirs / "report.md").write_text("# swinbench apply: theirs\n")
    assert "is the report of the run in" in refused(["report", str(mine), "--out", str(theirs / "report.md")])
    assert (theirs / "report.md").read_text() == "# swinbench apply: theirs\n"
    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- results:begin -->\n<!-- results:end -->\n")
    assert "read every *.json" in refused(["report", str(mine), "--readme", str(readme),
                                           "--out", str(mine / "records" / "x.json")])
    assert readme.read_text() == "x\n<!-- results:begin -->\n<!-- results:end -->\n"


def test_report_says_what_a_matrix_or_train_folder_is(tmp_path):
    matrix = tmp_path / "m"
    matrix.mkdir()
    (matrix / "matrix.json").write_text("{}")
    assert "matrix --render-only" in refused(["report", str(matrix)])
    trained = tmp_path / "t" / "records"
    trained.mkdir(parents=True)
    (trained / "01-amp-seed0.jsonl").write_text("")
    assert "is a `swinbench train` run" in refused(["report", str(tmp_path / "t")])
    # its records/ folder named itself, and by check as well
    assert f"{tmp_path / 't'} is a `swinbench train` run" in refused(["report", str(trained)])
    assert "is a `swinbench train` run" in refused(["check", "--current", str(trained), "--baseline", str(trained)])


@pytest.fixture
def run_folder(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RECORDS, run / "records")
    return run


def test_report_writes_over_its_own_report_only(run_folder):
    record = run_folder / "records" / "00-baseline.json"
    before = record.read_bytes()
    assert "is one of the inputs" in refused(["report", str(run_folder / "records"), "--out", str(record)])
    (run_folder / "mine.md").write_text("# my notes\n")
    assert "is not a report swinbench wrote" in refused(["report", str(run_folder), "--out",
                                                         str(run_folder / "mine.md")])
    assert "is a folder" in refused(["report", str(run_folder), "--out", str(run_folder)])
    assert record.read_bytes() == before and (run_folder / "mine.md").read_text() == "# my notes\n"
    for _ in range(2):   # the run folder itself names its records; its report.md is rendered again
        result = runner.invoke(app, ["report", str(run_folder)])
        assert result.exit_code == 0, result.output
    assert (run_folder / "report.md").read_text().startswith("# swinbench apply:")


@pytest.mark.parametrize("fmt", ["md", "json"])
def test_check_writes_over_its_own_table_only(run_folder, fmt):
    args = ["check", "--baseline", str(run_folder), "--current", str(run_folder / "records"), "--format", fmt]
    record = run_folder / "records" / "01-amp.json"
    before = record.read_bytes()
    assert "is one of the inputs" in refused([*args, "--out", str(record)])
    (run_folder / "trace.json").write_text('{"traceEvents": []}')
    assert "is not a table swinbench check wrote" in refused([*args, "--out", str(run_folder / "trace.json")])
    assert record.read_bytes() == before and (run_folder / "trace.json").read_text() == '{"traceEvents": []}'
    for _ in range(2):
        result = runner.invoke(app, [*args, "--out", str(run_folder / f"check.{fmt}")])
        assert result.exit_code == 0, result.output


def test_an_unreadable_image_from_a_loader_process_is_one_line(tmp_path):
    from workbench.datasets import ImageFolderData
    from workbench.errors import UserError

    data = ImageFolderData.__new__(ImageFolderData)
    data.root = tmp_path

    def loader():
        yield "first batch"
        raise OSError("Caught UnidentifiedImageError in DataLoader worker process 0.\nOriginal Traceback (most "
                      "recent call last):\n  File \"x.py\", line 1\nPIL.UnidentifiedImageError: cannot identify "
                      "image file 'a/2.jpg'\n")

    batches = data._read(loader())
    assert next(batches) == "first batch"
    with pytest.raises(UserError) as info:
        next(batches)
    assert str(info.value) == f"--data {tmp_path}: cannot identify image file 'a/2.jpg'"


def test_resume_into_a_file_is_one_line_without_a_note_that_contradicts_it(tmp_path):
    target = tmp_path / "afile"
    target.write_text("x")
    out = refused(["apply", "--device", "cpu", "--resume", "--out", str(target)])
    assert out.count("\n") == 1 and "is a file" in out and "starting a new one" not in out


@pytest.mark.parametrize("command", [["profile"], ["apply"], ["matrix"], ["train"], ["report", "x"],
                                     ["check", "--baseline", "x", "--current", "y"], ["analyze", "t.sqlite"]])
def test_an_empty_out_is_refused_not_taken_for_the_current_folder(command):
    out = refused([*command, "--out", ""])
    assert "Invalid value for '--out'" in out and "empty" in out and out.count("\n") == 1


@pytest.mark.parametrize("extra, message", [
    ([], "the baseline's model is swin_tiny_patch4_window7_224 and this run's swinbench_tiny_cpu"),
    (["--model", "swin_tiny_patch4_window7_224"], "the baseline's device type is cuda and this run's cpu"),
])
def test_apply_check_against_refuses_another_default_model_or_device_before_any_stage(tmp_path, no_run, extra,
                                                                                      message):
    # a CPU run's default model and device are known before it runs: a GPU baseline is refused then, not after
    out = refused(["apply", "--stages", "baseline", "--device", "cpu", "--out", str(tmp_path / "run"),
                   "--check-against", str(RECORDS), *extra])
    assert message in out
    assert no_run == [] and not (tmp_path / "run").exists()


def test_apply_check_against_a_baseline_of_the_same_model_and_device_goes_on_to_run(tmp_path, no_run):
    with pytest.raises(BaseException):   # no_run fails the test's run_apply: the checks let it through
        runner.invoke(app, ["apply", "--stages", "baseline", "--device", "cpu", "--batch", "8", "--check-against",
                            str(Path(__file__).parents[1] / "reports" / "cpu-tiny-b8-train" / "records")],
                      catch_exceptions=False)
    assert len(no_run) == 1
