"""`swinbench check` on records of `apply --nproc N` runs: the data-parallel figures (img/s of all ranks,
the slowest rank's step, efficiency, the gate on every rank) against a baseline of the same world size;
another world size is refused in one line unless forced."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from cli import app
from workbench.errors import UserError
from workbench.results.check import check_records, load_thresholds, render_markdown

BASELINE = Path(__file__).parent / "data" / "records" / "baseline"
runner = CliRunner()


def scaled(folder: Path, world: int = 2, slower: float = 1.0, *, rank_ms=None, gate="PASS", status="ok",
           iqr_rel: float | None = None) -> Path:
    """Give every record in `folder` the scaling result of `apply --nproc world`: each rank's median step is
    the one-process step x 1.05 (x `slower`; `rank_ms` scales rank by rank), efficiency follows; iqr_rel:
    each rank's IQR as a fraction of its median (None: no IQRs kept)."""
    for path in folder.glob("*.json"):
        rec = json.loads(path.read_text())
        factors = rank_ms or [1.0] * world
        per_rank = [rec["step_ms"] * 1.05 * slower * f for f in factors]
        step = max(per_rank)
        img = rec["batch"] * world / (step / 1e3)
        rec["scaling"] = {"world_size": world, "backend": "nccl", "batch_per_process": rec["batch"],
                          "global_batch": rec["batch"] * world, "status": status,
                          "reason": None if status == "ok" else "torchrun exited with 1",
                          "img_per_s": img if status == "ok" else None, "step_ms": step if status == "ok" else None,
                          "step_ms_per_rank": per_rank if status == "ok" else [],
                          **({"step_iqr_ms_per_rank": [ms * iqr_rel for ms in per_rank]} if iqr_rel is not None
                             else {}),
                          "efficiency": img / (world * rec["img_per_s"]) if status == "ok" else None,
                          "gate": {"status": gate, "reason": None, "ranks": [gate] * world, "metrics": {}},
                          "ddp": {"bucket_cap_mb": 25.0}}
        path.write_text(json.dumps(rec))
    return folder


def copy(tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(BASELINE, tmp_path / name))


def row(result, stage: str, metric: str):
    rows = result.rows[(result.rows["stage"] == stage) & (result.rows["metric"] == metric)]
    assert len(rows) == 1, (stage, metric, result.rows)
    return rows.iloc[0]


def test_same_data_parallel_figures_are_unchanged(tmp_path):
    base, cur = scaled(copy(tmp_path, "b")), scaled(copy(tmp_path, "c"))
    result = check_records(base, cur)
    assert result.exit_code == 0
    for metric in ("dp_img_per_s", "dp_step_ms", "dp_efficiency", "dp_gate"):
        assert row(result, "fmha", metric)["status"] == "unchanged"
    assert any("data parallel over 2 ranks" in n for n in result.notes)
    assert "| fmha | dp_efficiency | 0.952 | 0.952 |" in render_markdown(result)


def test_a_slower_rank_regresses_the_step_img_per_s_and_efficiency(tmp_path):
    base = scaled(copy(tmp_path, "b"))
    cur = scaled(copy(tmp_path, "c"), rank_ms=[1.0, 1.10])     # rank 1 10 % slower: the step is its step
    result = check_records(base, cur)
    assert result.exit_code == 1
    assert row(result, "fmha", "dp_step_ms")["delta_pct"] == pytest.approx(10.0)
    assert row(result, "fmha", "dp_img_per_s")["status"] == "REGRESSED"
    assert row(result, "fmha", "dp_efficiency")["delta_pct"] == pytest.approx(-100 / 11)
    # the one-process figures did not move, and their profiles are not blamed
    assert row(result, "fmha", "step_ms")["status"] == "unchanged" and not result.kernel_changes
    assert "dp_step_ms +10.0%" in result.summary
    assert any("61.29 / 67.42 ms (slowest: rank 1) (current)" in n for n in result.notes)


def test_the_slowest_ranks_iqr_makes_the_noise_band(tmp_path):
    # both sides spread 10 %: band 0.5 x (10 + 10) = 10 %, so 8 % slower is noise
    base = scaled(copy(tmp_path, "b"), iqr_rel=0.10)
    cur = scaled(copy(tmp_path, "c"), slower=1.08, iqr_rel=0.10)
    result = check_records(base, cur)
    step = row(result, "fmha", "dp_step_ms")
    assert step["noise_band_pct"] == pytest.approx(10.0) and step["status"] == "noise"
    one_process = 2 * 0.3712 / 58.37   # the records' own IQR (0.3712 ms of 58.37) adds in for efficiency
    assert row(result, "fmha", "dp_efficiency")["noise_band_pct"] == pytest.approx(10.0 + 50 * one_process)
    assert result.exit_code == 0
    # a record without per-rank IQRs gives no band
    assert pd.isna(row(check_records(base, scaled(copy(tmp_path, "old"))), "fmha", "dp_step_ms")["noise_band_pct"])


def test_thresholds_set_data_parallel_limits_per_stage(tmp_path):
    base, cur = scaled(copy(tmp_path, "b")), scaled(copy(tmp_path, "c"), slower=1.08)
    th = tmp_path / "th.yaml"
    th.write_text("version: 1\nstages:\n  fmha: {dp_step_ms: 10, dp_img_per_s: 10, dp_efficiency: 10}\n")
    assert load_thresholds(th).limit("fmha", "dp_step_ms") == 10
    result = check_records(base, cur, thresholds_file=th)
    assert row(result, "fmha", "dp_step_ms")["status"] == "unchanged"
    assert row(result, "amp", "dp_step_ms")["status"] == "REGRESSED"


def test_a_gate_that_fails_on_a_rank_is_a_regression(tmp_path):
    result = check_records(scaled(copy(tmp_path, "b")), scaled(copy(tmp_path, "c"), gate="FAIL"))
    assert row(result, "fmha", "dp_gate")["status"] == "FAIL gate" and result.exit_code == 1
    assert any("by rank: FAIL, FAIL" in n for n in result.notes)


def test_data_parallel_error_after_ok_regresses(tmp_path):
    result = check_records(scaled(copy(tmp_path, "b")), scaled(copy(tmp_path, "c"), status="error"))
    assert row(result, "fmha", "dp")["status"] == "REGRESSED"
    assert any("torchrun exited with 1" in n for n in result.notes)


def test_a_side_without_data_parallel_results_is_listed_not_failed(tmp_path):
    result = check_records(scaled(copy(tmp_path, "b")), BASELINE)
    assert result.exit_code == 0
    assert row(result, "fmha", "dp")["status"] == "only in baseline"
    assert any("the current ran without --nproc" in n for n in result.notes)


def test_another_world_size_is_refused_unless_forced(tmp_path):
    base, cur = scaled(copy(tmp_path, "b"), world=2), scaled(copy(tmp_path, "c"), world=4)
    with pytest.raises(UserError, match=r"data-parallel world size: 2 ranks \(baseline\) vs 4 \(current\)") as info:
        check_records(base, cur)
    assert info.value.exit_code == 2
    result = check_records(base, cur, force=True)
    assert row(result, "fmha", "dp_efficiency")["status"] == "unchanged"
    assert any("across world sizes with --force" in n for n in result.notes)
    cli = runner.invoke(app, ["check", "--baseline", str(base), "--current", str(cur)])
    assert cli.exit_code == 2 and "world size" in cli.output and "Traceback" not in cli.output
    assert len(cli.output.strip().splitlines()) == 1


def test_one_side_mixing_world_sizes_is_refused(tmp_path):
    base = scaled(copy(tmp_path, "b"))
    cur = scaled(copy(tmp_path, "c"))
    scaled_one = copy(tmp_path, "four")
    for path in list(scaled_one.glob("*.json"))[1:]:
        path.unlink()
    scaled(scaled_one, world=4)
    (path,) = scaled_one.glob("*.json")
    rec = json.loads(path.read_text())
    rec["env"]["date"] = "2099-01-01T00:00:00+00:00"     # the newest record of its stage: the one compared
    path.write_text(json.dumps(rec))
    with pytest.raises(UserError, match="current records mix data-parallel world sizes"):
        check_records(base, [cur, scaled_one])


def test_per_rank_iqrs_are_validated_and_kept(tmp_path):
    from workbench.results.record import StageRecord

    folder = scaled(copy(tmp_path, "b"), iqr_rel=0.01)
    rec = json.loads(next(folder.glob("*.json")).read_text())
    again = StageRecord.from_dict(StageRecord.from_dict(rec).to_dict())
    assert len(again.scaling.step_iqr_ms_per_rank) == 2
    for value, message in (([1.0], "holds 1 ranks"), ([-1.0, 1.0], "step_iqr_ms_per_rank")):
        bad = {**rec, "scaling": {**rec["scaling"], "step_iqr_ms_per_rank": value}}
        with pytest.raises(UserError, match=message):
            StageRecord.from_dict(bad)


def test_apply_against_a_baseline_of_another_world_size_is_refused_before_it_runs(tmp_path, monkeypatch):
    import workbench.ladder.apply as apply_module

    ran = []
    monkeypatch.setattr(apply_module, "run_apply", lambda *a, **k: ran.append(a))
    base = scaled(copy(tmp_path, "b"), world=2)
    args = ["apply", "--stages", "baseline", "--device", "cuda", "--out", str(tmp_path / "run"), "--check-against",
            str(base), "--nproc"]   # the baseline's device: only the world size differs
    result = runner.invoke(app, [*args, "4"])
    assert result.exit_code == 2 and "of 2 ranks and this run has --nproc 4" in result.output and not ran
    assert len(result.output.strip().splitlines()) == 1
