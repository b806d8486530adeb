"""Nothing measured is lost through --out: apply and profile refuse a folder that holds another run
(exit 2, one line, the folder byte for byte as it was) unless --resume (apply, same plan only) or
--overwrite (the old run moved aside) says what to do; a live run's lock keeps a second run out; Ctrl-C
keeps the finished stages and a report that says the run was interrupted; analyze and diff tables of a
range carry it in their names and contents and do not replace another trace's tables; an unwritable
--out is one line."""
import json
import os
import shutil
import socket
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

import workbench.ladder.apply
from cli import app
from test_run_folder import dead_pid, folder_digest, write_lock
from workbench.run_folder import LOCK_NAME

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data"
FP32, BF16 = DATA / "swin_tiny_train_fp32.sqlite.xz", DATA / "swin_tiny_train_bf16.sqlite.xz"
COMMITTED_RUN = ROOT / "reports" / "cpu-tiny-b8-train"
runner = CliRunner()


def one_line(result) -> str:
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


@pytest.fixture(scope="module")
def sdpa(tmp_path_factory) -> str:
    """A cheap second stage for the CPU (fp32 SDPA attention; amp's bf16 is slow on a CPU)."""
    path = tmp_path_factory.mktemp("recipes") / "sdpa.yaml"
    path.write_text("name: sdpa\nextends: baseline\ndescription: test stage\npasses: [sdpa_attention]\n")
    return str(path)


def apply_args(out: Path, stages: str, *extra: str) -> list[str]:
    return ["apply", "--recipe", "baseline", "--stages", stages, "--device", "cpu", "--batch", "1", "--steps", "1",
            "--warmup", "0", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, sdpa) -> tuple[Path, str]:
    """(folder, stages) of a finished two-stage CPU run, started over a stale lock (taken over)."""
    out = tmp_path_factory.mktemp("apply") / "run"
    write_lock(out, dead_pid())
    stages = f"baseline,{sdpa}"
    result = runner.invoke(app, apply_args(out, stages))
    assert result.exit_code == 0, result.output
    assert "took over the stale lock" in result.output
    assert not (out / LOCK_NAME).exists()
    return out, stages


def copy_of(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


# ---------------------------------------------------------------- apply


def test_apply_refuses_another_plans_run_and_changes_nothing(tmp_path):
    out = copy_of(COMMITTED_RUN, tmp_path)
    before = folder_digest(out)
    for extra in ([], ["--resume"]):
        result = runner.invoke(app, apply_args(out, "baseline", *extra))
        assert result.exit_code == 2, result.output
        line = one_line(result)
        assert "--overwrite moves it aside to" in line and "--resume continues" not in line
        assert "batch 8 there vs 1" in line and "recipe 'fmha' there vs 'baseline'" in line
        assert folder_digest(out) == before and sorted(tmp_path.iterdir()) == [out]


def test_apply_into_its_own_finished_run_offers_resume(finished_run, tmp_path):
    run, stages = finished_run
    out = copy_of(run, tmp_path)
    before = folder_digest(out)
    result = runner.invoke(app, apply_args(out, stages))
    assert result.exit_code == 2
    line = one_line(result)
    assert "--resume continues it" in line and "--overwrite moves it aside" in line
    assert folder_digest(out) == before


@pytest.mark.parametrize("change, differs", [
    (["--stages", "baseline"], "stages 1:sdpa there, not in this plan (0:baseline)"),
    (["--recipe", "amp"], "recipe 'baseline' there vs 'amp'"),
    (["--steps", "2"], "steps/warm-up 1/0 there vs 2/0"),
])
def test_resume_with_another_plan_is_refused_and_deletes_nothing(finished_run, tmp_path, change, differs):
    run, stages = finished_run
    out = copy_of(run, tmp_path)
    before = folder_digest(out)
    args = apply_args(out, stages, "--resume")
    for i in range(0, len(change), 2):
        args[args.index(change[i]) + 1] = change[i + 1]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    line = one_line(result)
    assert line.startswith(f"error: cannot resume {out}") and differs in line and "nothing was changed" in line
    assert folder_digest(out) == before


def test_apply_overwrite_moves_the_earlier_run_aside(finished_run, tmp_path):
    run, stages = finished_run
    out = copy_of(run, tmp_path)
    before = folder_digest(out)
    run_id = json.loads((out / "records" / "00-baseline.json").read_text())["run_id"]
    result = runner.invoke(app, apply_args(out, "baseline", "--overwrite"))
    assert result.exit_code == 0, result.output
    aside = tmp_path / f"run.previous-{run_id}"
    assert f"moved the earlier run in {out} aside to {aside}" in result.output.replace("\n", "")
    assert folder_digest(aside) == before
    assert sorted(p.name for p in (out / "records").iterdir()) == ["00-baseline.json"]
    assert json.loads((out / "records" / "00-baseline.json").read_text())["run_id"] != run_id


def test_apply_refuses_a_folder_a_live_run_holds(tmp_path):
    out = tmp_path / "run"
    write_lock(out, os.getpid())
    before = folder_digest(out)
    result = runner.invoke(app, apply_args(out, "baseline"))
    assert result.exit_code == 2
    assert f"is in use by another swinbench apply (pid {os.getpid()} on {socket.gethostname()}" in one_line(result)
    assert folder_digest(out) == before


def test_ctrl_c_keeps_the_finished_stages_and_says_so_in_the_report(tmp_path, sdpa, monkeypatch):
    real_run_stage = workbench.ladder.apply.run_stage

    def interrupted_after_first(spec, reference, on_event=None):
        if spec.stage_index > 0:
            raise KeyboardInterrupt
        return real_run_stage(spec, reference, on_event)

    monkeypatch.setattr(workbench.ladder.apply, "run_stage", interrupted_after_first)
    out = tmp_path / "run"
    result = runner.invoke(app, apply_args(out, f"baseline,{sdpa}"))
    assert result.exit_code == 130
    line = result.output.strip().splitlines()[-1]   # after the CPU note and the progress lines
    assert line == (f"error: interrupted after 1 of 2 stages: their records are in {out / 'records'}, "
                    f"report {out / 'report.md'} (--resume runs the rest)")
    assert sorted(p.name for p in (out / "records").iterdir()) == ["00-baseline.json"]
    report = (out / "report.md").read_text()
    assert "**Interrupted:** the run was stopped after 1 of 2 stages had finished" in report
    assert "| baseline |" in report and "| sdpa |" not in report
    assert not (out / LOCK_NAME).exists()


def test_ctrl_c_as_a_stage_writes_its_record_counts_that_stage(tmp_path, sdpa, monkeypatch):
    """A stage process can write its record in the instant before the interrupt reaches the parent:
    the report and the message go by the records on disk."""
    real_run_stage = workbench.ladder.apply.run_stage

    def interrupted_once_written(spec, reference, on_event=None):
        real_run_stage(spec, reference, on_event)
        raise KeyboardInterrupt

    monkeypatch.setattr(workbench.ladder.apply, "run_stage", interrupted_once_written)
    out = tmp_path / "run"
    result = runner.invoke(app, apply_args(out, f"baseline,{sdpa}"))
    assert result.exit_code == 130
    assert result.output.strip().splitlines()[-1].startswith("error: interrupted after 1 of 2 stages")
    assert sorted(p.name for p in (out / "records").iterdir()) == ["00-baseline.json"]
    report = (out / "report.md").read_text()
    assert "stopped after 1 of 2 stages" in report and "| baseline |" in report


# ---------------------------------------------------------------- profile


def test_profile_refuses_an_earlier_profile_and_overwrite_moves_it_aside(tmp_path):
    out = tmp_path / "prof"
    out.mkdir()
    for name in ("trace.sqlite", "run.json", "kernels.csv"):
        (out / name).write_text(f"earlier {name}\n")
    before = folder_digest(out)
    args = ["profile", "--device", "cpu", "--batch", "1", "--steps", "1", "--warmup", "0", "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    line = one_line(result)
    assert "holds an earlier run (kernels.csv, run.json, trace.sqlite)" in line and "--overwrite" in line
    assert folder_digest(out) == before
    result = runner.invoke(app, args + ["--overwrite"])
    assert result.exit_code == 0, result.output
    (aside,) = tmp_path.glob("prof.previous-*")
    assert folder_digest(aside) == before
    assert (out / "trace.json").exists() and not (out / "trace.sqlite").exists()
    assert not (out / LOCK_NAME).exists()


# ---------------------------------------------------------------- analyze and diff tables


def test_range_tables_carry_the_range_and_leave_the_whole_trace_tables(tmp_path):
    out = tmp_path / "tables"
    assert runner.invoke(app, ["analyze", str(BF16), "--format", "csv", "--out", str(out)]).exit_code == 0
    whole = folder_digest(out)
    result = runner.invoke(app, ["analyze", str(BF16), "--range", "backward", "--format", "csv", "--out", str(out)])
    assert result.exit_code == 0, result.output
    ranged = sorted(p.name for p in out.glob("*.range-backward.csv"))
    assert ranged == ["api.range-backward.csv", "busy.range-backward.csv", "categories.range-backward.csv",
                      "findings.range-backward.csv", "kernels.range-backward.csv", "ranges.range-backward.csv"]
    for p in out.glob("*.range-backward.csv"):
        p.rename(tmp_path / p.name)
    assert folder_digest(out) == whole        # the whole-trace tables were not touched
    kernels = pd.read_csv(tmp_path / "kernels.range-backward.csv", keep_default_na=False)
    assert set(kernels["trace_range"]) == {"backward"}
    assert set(kernels["trace"]) == {os.path.relpath(BF16, out)}
    assert set(pd.read_csv(out / "kernels.csv", keep_default_na=False)["trace_range"]) == {""}
    result = runner.invoke(app, ["analyze", str(BF16), "--range", "stage2.block1", "--format", "json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "analysis.range-stage2.block1.json").read_text())
    assert doc["trace_range"] == "stage2.block1" and doc["trace"] == os.path.relpath(BF16, out)
    # the same trace and range again: rewritten without asking
    result = runner.invoke(app, ["analyze", str(BF16), "--format", "csv", "--out", str(out)])
    assert result.exit_code == 0, result.output


def test_another_traces_tables_need_overwrite(tmp_path):
    out = tmp_path / "tables"
    assert runner.invoke(app, ["analyze", str(FP32), "--format", "csv", "--out", str(out)]).exit_code == 0
    before = folder_digest(out)
    result = runner.invoke(app, ["analyze", str(BF16), "--format", "csv", "--out", str(out)])
    assert result.exit_code == 2
    line = one_line(result)
    assert "--overwrite" in line and "swin_tiny_train_fp32.sqlite.xz" in line
    assert folder_digest(out) == before
    result = runner.invoke(app, ["analyze", str(BF16), "--format", "csv", "--out", str(out), "--overwrite"])
    assert result.exit_code == 0, result.output
    (aside,) = out.glob("previous-*")
    assert "moved the earlier tables aside to" in result.output
    assert set(pd.read_csv(aside / "kernels.csv")["trace"]) == {os.path.relpath(FP32, out)}
    assert set(pd.read_csv(out / "kernels.csv")["trace"]) == {os.path.relpath(BF16, out)}


def test_tables_that_do_not_name_their_trace_are_not_replaced(tmp_path):
    out = tmp_path / "tables"
    out.mkdir()
    pd.DataFrame({"kernel": ["k"], "total_ns": [1]}).to_csv(out / "kernels.csv", index=False)
    before = folder_digest(out)
    result = runner.invoke(app, ["analyze", str(BF16), "--format", "csv", "--out", str(out)])
    assert result.exit_code == 2 and "do not name their trace" in one_line(result)
    assert folder_digest(out) == before


def test_diff_tables_of_a_range_carry_it(tmp_path):
    result = runner.invoke(app, ["diff", str(FP32), str(BF16), "--range", "backward", "--format", "csv",
                                 "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "diff_categories.range-backward.csv", "diff_kernels.range-backward.csv", "diff_summary.range-backward.csv"]
    summary = pd.read_csv(tmp_path / "diff_summary.range-backward.csv")
    assert set(summary["trace_range"]) == {"backward"}
    assert set(summary["before_trace"]) == {os.path.relpath(FP32, tmp_path)}
    assert set(summary["after_trace"]) == {os.path.relpath(BF16, tmp_path)}


def test_an_unwritable_out_is_one_line(tmp_path, finished_run):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = blocker / "sub"
    run, _ = finished_run
    for args in (["analyze", str(BF16), "--format", "csv", "--out", str(out)],
                 ["diff", str(FP32), str(BF16), "--format", "json", "--out", str(out)],
                 apply_args(out, "baseline"),
                 ["report", str(run / "records"), "--out", str(out / "report.md")]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert str(blocker) in one_line(result)
