"""`check_records` on the checked-in baseline records (tests/data/records/baseline: baseline, amp,
fmha of one H200 run) against variants derived in tmp_path."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from workbench.results.check import check_records, load_thresholds, render_markdown, to_json
from workbench.errors import UserError

BASELINE = Path(__file__).parent / "data" / "records" / "baseline"


@pytest.fixture
def current(tmp_path) -> Path:
    """A copy of the baseline records to edit."""
    folder = tmp_path / "current"
    shutil.copytree(BASELINE, folder)
    return folder


def _path(folder: Path, stage: str) -> Path:
    (path,) = folder.glob(f"*-{stage}.json")
    return path


def edit(folder: Path, stage: str, fn) -> None:
    path = _path(folder, stage)
    rec = json.loads(path.read_text())
    fn(rec)
    path.write_text(json.dumps(rec))


def slower(factor: float, iqr_rel: float | None = None):
    """Step time x factor (images/s / factor); iqr_rel sets timing.iqr_ms to that fraction of the median."""
    def fn(rec):
        t = rec["timing"]
        t["samples_ms"] = [s * factor for s in t["samples_ms"]]
        t["median_ms"] *= factor
        t["iqr_ms"] = t["median_ms"] * iqr_rel if iqr_rel is not None else t["iqr_ms"] * factor
        rec["step_ms"], rec["step_iqr_ms"] = t["median_ms"], t["iqr_ms"]
        rec["img_per_s"] /= factor
    return fn


def set_iqr(iqr_rel: float):
    return slower(1.0, iqr_rel)


def row(result, stage: str, metric: str):
    rows = result.rows[(result.rows["stage"] == stage) & (result.rows["metric"] == metric)]
    assert len(rows) == 1, (stage, metric, result.rows)
    return rows.iloc[0]


def user_error(fn) -> UserError:
    with pytest.raises(UserError) as info:
        fn()
    assert info.value.exit_code == 2
    assert "\n" not in str(info.value)
    return info.value


def test_identical_records_pass():
    result = check_records(BASELINE, BASELINE)
    assert result.exit_code == 0 and not result.regressed
    assert set(result.rows["status"]) == {"unchanged"}
    assert set(result.rows["stage"]) == {"baseline", "amp", "fmha"}
    # 3 % metrics for 'baseline' (no speedup over itself), 4 for the others, shares, one gate each
    assert set(result.rows[result.rows["stage"] == "amp"]["metric"]) >= {
        "img_per_s", "step_ms", "peak_mem_bytes", "speedup", "share:attention", "gate"}
    assert "speedup" not in set(result.rows[result.rows["stage"] == "baseline"]["metric"])
    assert result.summary.startswith("OK:")
    assert result.notes == []


def test_ten_percent_slower_stage_regresses(current):
    edit(current, "fmha", slower(1.10))
    result = check_records(BASELINE, current)
    assert result.exit_code == 1 and result.regressed
    step = row(result, "fmha", "step_ms")
    assert step["status"] == "REGRESSED"
    assert step["delta_pct"] == pytest.approx(10.0)
    assert row(result, "fmha", "img_per_s")["status"] == "REGRESSED"
    assert row(result, "fmha", "img_per_s")["delta_pct"] == pytest.approx(-100 / 11)
    assert row(result, "fmha", "speedup")["status"] == "REGRESSED"
    assert row(result, "amp", "step_ms")["status"] == "unchanged"
    md = render_markdown(result)
    assert "| fmha | step_ms | 58.37 ms | 64.21 ms | +10.0% | 5% |" in md
    assert "| fmha | img_per_s |" in md and "−9.1%" in md and "**REGRESSED**" in md
    assert "fmha" in result.summary and "step_ms +10.0%" in result.summary
    assert md.rstrip().endswith(f"**{result.summary}**")


def test_change_inside_the_iqr_spread_is_noise(current):
    # baseline and current both spread 10 % (IQR / median): band = 0.5 * (10 + 10) = 10 %
    base = current.parent / "base"
    shutil.copytree(BASELINE, base)
    edit(base, "fmha", set_iqr(0.10))
    edit(current, "fmha", slower(1.06, iqr_rel=0.10))
    result = check_records(base, current)
    step = row(result, "fmha", "step_ms")
    assert step["status"] == "noise" and step["noise_band_pct"] == pytest.approx(10.0)
    assert row(result, "fmha", "img_per_s")["status"] == "noise"
    assert result.exit_code == 0


def test_change_within_limit_is_unchanged_and_large_gain_improved(current):
    edit(current, "amp", slower(1.04))
    edit(current, "fmha", slower(0.8))
    result = check_records(BASELINE, current)
    assert row(result, "amp", "step_ms")["status"] == "unchanged"
    assert row(result, "fmha", "step_ms")["status"] == "improved"
    assert row(result, "fmha", "img_per_s")["status"] == "improved"
    assert result.exit_code == 0


def test_exactly_at_the_limit_is_unchanged(current):
    edit(current, "fmha", slower(1.05))
    assert row(check_records(BASELINE, current), "fmha", "step_ms")["status"] == "unchanged"


def test_memory_has_no_noise_band(current):
    edit(current, "amp", lambda r: r.update(peak_mem_bytes=int(r["peak_mem_bytes"] * 1.2)))
    result = check_records(BASELINE, current)
    mem = row(result, "amp", "peak_mem_bytes")
    assert mem["status"] == "REGRESSED" and mem["delta_pct"] == pytest.approx(20.0, abs=1e-6)
    assert mem["noise_band_pct"] is None or mem["noise_band_pct"] != mem["noise_band_pct"]


def test_share_drift_beyond_limit_regresses(current):
    def drift(rec):
        s = rec["profile"]["category_share_pct"]
        s["attention"] += 3.0
        s["GEMM"] -= 3.0
    edit(current, "fmha", drift)
    result = check_records(BASELINE, current)
    att = row(result, "fmha", "share:attention")
    assert att["status"] == "REGRESSED" and att["delta_pct"] == pytest.approx(3.0) and att["unit"] == "pp"
    assert row(result, "fmha", "share:softmax")["status"] == "unchanged"
    assert result.exit_code == 1
    md = render_markdown(result)
    assert "| fmha | share:attention | 9.8% | 12.8% | +3.0 pp | 2 pp |" in md
    assert "| fmha | share: 7 categories |" in md      # the quiet ones folded
    # a wider limit in the file lets it pass
    relaxed = check_records(BASELINE, current, thresholds_file=_yaml(current.parent, "share_drift_pp: 4\n"))
    assert relaxed.exit_code == 0


def test_share_compared_only_when_both_sides_have_it(current):
    edit(current, "amp", lambda r: r.update(profile=None))
    result = check_records(BASELINE, current)
    assert not result.rows[(result.rows["stage"] == "amp")]["metric"].str.startswith("share:").any()
    assert result.exit_code == 0


def test_gate_pass_to_fail_is_a_regression_regardless_of_speed(current):
    def fail(rec):
        rec["gate"]["status"] = "FAIL"
        rec["gate"]["reason"] = "loss differs by 8% (limit 2%)"
    edit(current, "amp", fail)
    edit(current, "amp", slower(0.7))   # much faster, still a failure
    result = check_records(BASELINE, current)
    gate = row(result, "amp", "gate")
    assert (gate["baseline"], gate["current"], gate["status"]) == ("PASS", "FAIL", "FAIL gate")
    assert result.exit_code == 1
    assert any("loss differs" in n for n in result.notes)
    assert "amp: gate PASS -> FAIL" in result.summary


def test_stages_on_one_side_are_listed(current):
    _path(current, "fmha").unlink()
    extra = json.loads(_path(current, "amp").read_text())
    extra.update(stage="compile", stage_index=3)
    (current / "03-compile.json").write_text(json.dumps(extra))
    result = check_records(BASELINE, current, allow_missing=True)
    assert row(result, "fmha", "stage")["status"] == "only in baseline"
    assert row(result, "compile", "stage")["status"] == "only in current"
    assert result.exit_code == 0
    md = render_markdown(result)
    assert "| fmha | stage | ok | — |" in md and "only in baseline" in md
    assert "| compile | stage | — | ok |" in md and "only in current" in md


def test_a_stage_the_current_run_lacks_is_missing(current):
    """A half-finished run (a stage of the baseline absent) must not pass CI unless asked."""
    _path(current, "fmha").unlink()
    result = check_records(BASELINE, current)
    assert row(result, "fmha", "stage")["status"] == "MISSING"
    assert result.exit_code == 1 and "fmha: stage ok -> missing" in result.summary
    assert any("missing from current: fmha" in n and "--allow-missing" in n for n in result.notes)


def test_a_measurement_the_current_record_lacks_is_missing(tmp_path, current):
    """The baseline's graph-replayed timing, absent now (its capture stopped working): MISSING."""
    baseline = tmp_path / "baseline"
    shutil.copytree(BASELINE, baseline)

    def graphed(r):
        ms = r["timing"]["median_ms"]
        r["graph"] = {"step_ms": ms * 0.8, "step_iqr_ms": 0.1, "img_per_s": r["img_per_s"] / 0.8,
                      "how": "the step captured once, replayed", "timing": {**r["timing"], "median_ms": ms * 0.8}}

    edit(baseline, "fmha", graphed)
    result = check_records(baseline, current)
    assert row(result, "fmha", "graph_ms")["status"] == "MISSING" and result.exit_code == 1
    assert check_records(baseline, current, allow_missing=True).exit_code == 0


def test_a_stage_only_in_current_that_fails_its_gate_fails(current):
    extra = json.loads(_path(current, "amp").read_text())
    extra.update(stage="compile", stage_index=3)
    extra["gate"].update(status="FAIL", reason="logits differ")
    (current / "03-compile.json").write_text(json.dumps(extra))
    result = check_records(BASELINE, current)
    assert row(result, "compile", "gate")["status"] == "FAIL gate" and result.exit_code == 1


def test_a_failed_stage_is_regressed_not_refused_for_its_precision(current):
    """A failed stage's record keeps the run's precision (fp32), not the stage's: check it, do not refuse."""
    edit(current, "amp", lambda r: r.update(status="error", error="RuntimeError: boom", precision="fp32",
                                            img_per_s=None, step_ms=None, timing=None))
    assert json.loads(_path(BASELINE, "amp").read_text())["precision"] != "fp32"
    result = check_records(BASELINE, current)
    assert row(result, "amp", "stage")["status"] == "REGRESSED" and result.exit_code == 1


def test_records_not_ok_are_listed_not_compared(current):
    edit(current, "fmha", lambda r: r.update(status="not available", error="flash kernels not built",
                                             img_per_s=None, step_ms=None, timing=None))
    result = check_records(BASELINE, current, allow_missing=True)
    fmha = row(result, "fmha", "stage")
    assert (fmha["baseline"], fmha["current"], fmha["status"]) == ("ok", "not available", "not compared")
    assert any("flash kernels not built" in n for n in result.notes)
    assert result.exit_code == 0
    # by default a stage measured in the baseline and not available now is MISSING (a kernel stopped loading)
    assert row(check_records(BASELINE, current), "fmha", "stage")["status"] == "MISSING"
    # a stage that ran in the baseline and errors now is lost work
    edit(current, "fmha", lambda r: r.update(status="error", error="CUDA error: illegal memory access"))
    assert check_records(BASELINE, current).exit_code == 1


def test_speedup_is_relative_to_the_baseline_stage_of_the_same_run(current):
    # everything 10 % slower, including 'baseline': speedups unchanged, speeds regressed
    for stage in ("baseline", "amp", "fmha"):
        edit(current, stage, slower(1.10))
    result = check_records(BASELINE, current)
    assert row(result, "fmha", "speedup")["status"] == "unchanged"
    assert row(result, "fmha", "speedup")["current"] == pytest.approx(1096.45 / 459.04, rel=1e-3)
    assert row(result, "fmha", "step_ms")["status"] == "REGRESSED"


def test_malformed_json_is_a_user_error(current):
    _path(current, "amp").write_text("{not json")
    err = user_error(lambda: check_records(BASELINE, current))
    assert "01-amp.json" in str(err)


def test_missing_required_key_names_key_and_file(current):
    edit(current, "amp", lambda r: r.pop("img_per_s"))
    err = user_error(lambda: check_records(BASELINE, current))
    assert "'img_per_s'" in str(err) and "01-amp.json" in str(err)
    edit(current, "amp", lambda r: r.update(img_per_s=1.0) or r["env"].pop("gpu"))
    err = user_error(lambda: check_records(BASELINE, current))
    assert "'env.gpu'" in str(err)
    edit(current, "amp", lambda r: r["env"].update(gpu="NVIDIA H200") or r.update(step_ms="fast"))
    assert "'step_ms' must be a number" in str(user_error(lambda: check_records(BASELINE, current)))


def test_missing_folder_is_a_user_error(tmp_path):
    user_error(lambda: check_records(BASELINE, tmp_path / "nope"))


@pytest.mark.parametrize("key,value", [("model", "swin_small_patch4_window7_224"), ("batch", 128), ("mode", "infer")])
def test_different_run_settings_need_force(current, key, value):
    for stage in ("baseline", "amp", "fmha"):
        edit(current, stage, lambda r: r.update({key: value}))
    err = user_error(lambda: check_records(BASELINE, current))
    assert str(value) in str(err) and "--force" in str(err)
    assert f"differ in {key}" in str(err)
    forced = check_records(BASELINE, current, force=True)
    assert any(str(value) in n and "--force" in n for n in forced.notes)


def test_another_image_size_is_another_experiment(current):
    for stage in ("baseline", "amp", "fmha"):
        edit(current, stage, lambda r: r.update(img_size=[384, 384]))
    err = user_error(lambda: check_records(BASELINE, current))
    assert "differ in image size" in str(err) and "384x384" in str(err) and "--force" in str(err)


def test_different_gpu_needs_force_and_is_noted(current):
    for stage in ("baseline", "amp", "fmha"):
        edit(current, stage, lambda r: r["env"].update(gpu="NVIDIA A100-SXM4-80GB"))
    err = user_error(lambda: check_records(BASELINE, current))
    assert "NVIDIA H200" in str(err) and "NVIDIA A100-SXM4-80GB" in str(err)
    result = check_records(BASELINE, current, force=True)
    assert result.exit_code == 0
    md = render_markdown(result)
    assert "Notes:" in md and "--force" in md and "NVIDIA A100-SXM4-80GB" in md
    assert "--force" in json.dumps(to_json(result))


def test_different_torch_version_needs_force(current):
    for stage in ("baseline", "amp", "fmha"):
        edit(current, stage, lambda r: r["env"].update(torch="2.6.0+cu126"))
    assert "torch version" in str(user_error(lambda: check_records(BASELINE, current)))
    assert check_records(BASELINE, current, force=True).exit_code == 0


def test_driver_difference_is_only_a_note(current):
    for stage in ("baseline", "amp", "fmha"):
        edit(current, stage, lambda r: r["env"].update(driver="580.1"))
    result = check_records(BASELINE, current)
    assert any("driver" in n for n in result.notes)


def _yaml(folder: Path, text: str) -> Path:
    path = folder / "thresholds.yaml"
    path.write_text(text)
    return path


def test_thresholds_per_stage_limit_overrides_default(current):
    edit(current, "fmha", slower(1.04))
    assert check_records(BASELINE, current).exit_code == 0
    th = _yaml(current.parent, "default: {max_regression_pct: 5}\nstages:\n  fmha: {img_per_s: 3, step_ms: 3}\n")
    result = check_records(BASELINE, current, thresholds_file=th)
    assert row(result, "fmha", "step_ms")["status"] == "REGRESSED"
    assert row(result, "fmha", "step_ms")["limit"] == 3
    assert row(result, "fmha", "peak_mem_bytes")["limit"] == 5
    assert result.exit_code == 1
    # and a looser one for a stage
    edit(current, "baseline", lambda r: r.update(peak_mem_bytes=int(r["peak_mem_bytes"] * 1.08)))
    loose = _yaml(current.parent, "stages:\n  baseline: {peak_mem_bytes: 10}\n")
    result = check_records(BASELINE, current, thresholds_file=loose, max_regression_pct=5)
    assert row(result, "baseline", "peak_mem_bytes")["status"] == "unchanged"


def test_example_thresholds_file_is_valid():
    th = load_thresholds(Path(__file__).parents[1] / ".ci" / "check-thresholds.example.yaml")
    assert th.max_regression_pct > 0 and th.share_drift_pp > 0
    from workbench.optimize.recipes import list_recipes

    # every stage it names is one the ladder runs
    assert set(th.stages) <= {r.name for r in list_recipes()}, set(th.stages)


@pytest.mark.parametrize("text,needle", [
    ("default: {max_regression_pct: 5\n", "not valid YAML"),
    ("- 5\n", "expected a mapping"),
    ("defaults: {max_regression_pct: 5}\n", "unknown key 'defaults'"),
    ("default: {max_regression_pct: -1}\n", "default.max_regression_pct must be a number >= 0"),
    ("stages:\n  fmha: {img_per_sec: 3}\n", "stages.fmha.img_per_sec"),
    ("stages:\n  fmha: {img_per_s: fast}\n", "stages.fmha.img_per_s must be a number"),
    ("stages:\n  fmha: 3\n", "stages.fmha must be a mapping"),
    # mistakes that would loosen a limit silently: a falsy non-mapping, a key given twice
    ("default: 0\n", "'default' must be a mapping"),
    ("stages: []\n", "'stages' must map"),
    ("stages:\n  fmha: {step_ms: 3}\n  fmha: {step_ms: 50}\n", "gives the key 'fmha' twice (line 3)"),
    ("default: {step_ms: 3, step_ms: 50}\n", "gives the key 'step_ms' twice"),
])
def test_bad_thresholds_file_is_a_user_error(current, text, needle):
    err = user_error(lambda: check_records(BASELINE, current, thresholds_file=_yaml(current.parent, text)))
    assert needle in str(err)


def test_missing_thresholds_file(tmp_path):
    assert "cannot read thresholds file" in str(user_error(
        lambda: check_records(BASELINE, BASELINE, thresholds_file=tmp_path / "none.yaml")))


def test_several_runs_on_one_side_newest_wins(current, tmp_path):
    older = tmp_path / "older"
    shutil.copytree(BASELINE, older)
    for stage in ("baseline", "amp", "fmha"):
        edit(older, stage, lambda r: r.update(run_id="20240101-old") or r["env"].update(date="2024-01-01T00:00:00+00:00"))
        edit(older, stage, slower(1.5))
    result = check_records([older, BASELINE], current)
    assert result.exit_code == 0
    assert any("appears in 2 records" in n for n in result.notes)


def test_to_json_is_plain_json(current):
    edit(current, "fmha", slower(1.10))
    data = to_json(check_records(BASELINE, current))
    text = json.dumps(data, allow_nan=False)
    assert data["exit_code"] == 1 and data["regressed"] is True
    back = json.loads(text)
    fmha_step = [r for r in back["rows"] if r["stage"] == "fmha" and r["metric"] == "step_ms"][0]
    assert fmha_step["status"] == "REGRESSED" and fmha_step["delta_pct"] == pytest.approx(10.0)
    gate = [r for r in back["rows"] if r["metric"] == "gate"][0]
    assert gate["delta_pct"] is None and gate["noise_band_pct"] is None


def test_precision_is_compared_per_stage(current):
    # the records of one run differ in precision (fp32 baseline stage, bf16 after amp): that is fine
    assert check_records(BASELINE, BASELINE).exit_code == 0
    edit(current, "amp", lambda r: r.update(precision="fp16"))
    err = user_error(lambda: check_records(BASELINE, current))
    assert "stage 'amp'" in str(err) and "bf16 (baseline) vs fp16 (current)" in str(err)
    assert any("fp16" in n for n in check_records(BASELINE, current, force=True).notes)


def _api_calls(launch: float, synchronize: float = 0.0, allocation: float = 0.0):
    def fn(rec):
        rec["profile"]["api_calls_per_step"] = {"launch": launch, "synchronize": synchronize,
                                                "allocation": allocation, "other": 5.0}
    return fn


def test_host_calls_per_step_more_launches_or_a_new_sync_regress(tmp_path, current):
    base = tmp_path / "base"
    shutil.copytree(BASELINE, base)
    edit(base, "fmha", _api_calls(1589.0))
    edit(current, "fmha", _api_calls(1600.0))                 # +0.7%: unchanged
    result = check_records(base, current)
    assert row(result, "fmha", "launches_per_step")["status"] == "unchanged"
    assert row(result, "fmha", "blocking_calls_per_step")["status"] == "unchanged"
    assert result.exit_code == 0
    edit(current, "fmha", _api_calls(1800.0, synchronize=1.0))   # a broken fusion and an .item() per step
    result = check_records(base, current)
    launches = row(result, "fmha", "launches_per_step")
    assert launches["status"] == "REGRESSED" and launches["delta_pct"] == pytest.approx(100 * 211 / 1589)
    assert pd.isna(launches["noise_band_pct"])                   # exact counts: no noise band
    blocking = row(result, "fmha", "blocking_calls_per_step")
    assert blocking["status"] == "REGRESSED" and blocking["delta_pct"] == float("inf")
    assert result.exit_code == 1
    assert "| fmha | launches_per_step | 1,589.0 | 1,800.0 | +13.3% |" in render_markdown(result)
    # records without the host-call counts (older ones, unprofiled stages) get no such rows
    assert not result.rows[result.rows["stage"] == "amp"]["metric"].isin(["launches_per_step"]).any()


def test_host_calls_per_step_must_be_numbers(current):
    edit(current, "fmha", lambda r: r["profile"].update(api_calls_per_step={"launch": "many"}))
    err = user_error(lambda: check_records(BASELINE, current))
    assert "profile.api_calls_per_step.launch" in str(err)


def test_regressed_stages_list_their_largest_kernel_changes(current, tmp_path):
    """When both records of a regressed stage carry their profile's per-kernel table, the check names the
    kernels whose GPU ms per step changed most; stages that did not regress, or lack the tables, get none."""
    base = tmp_path / "base"
    shutil.copytree(BASELINE, base)
    kernels = [{"kernel": "gemm", "ms_per_step": 20.0, "per_step": 300.0},
               {"kernel": "_window_attention_bwd_kernel", "ms_per_step": 1.7, "per_step": 24.0}]

    def with_kernels(table):
        def fn(rec):
            rec["profile"] = dict(rec.get("profile") or {}, kernels_per_step=table)
        return fn

    for stage in ("amp", "fmha"):
        edit(base, stage, with_kernels(kernels))
    edit(current, "amp", with_kernels(kernels))
    slower_attention = [kernels[0], {"kernel": "_window_attention_bwd_kernel", "ms_per_step": 3.2, "per_step": 24.0},
                        {"kernel": "triton_poi_fused_permute_7", "ms_per_step": 1.4, "per_step": 24.0}]
    edit(current, "fmha", lambda rec: (slower(1.10)(rec), with_kernels(slower_attention)(rec)))
    result = check_records(base, current)
    assert result.regressed and list(result.kernel_changes) == ["fmha"]
    table = result.kernel_changes["fmha"]
    assert list(table["kernel"]) == ["_window_attention_bwd_kernel", "triton_poi_fused_permute_7", "gemm"]
    assert table["delta_ms"].tolist() == pytest.approx([1.5, 1.4, 0.0])
    md = render_markdown(result)
    assert "Largest kernel changes in **fmha**" in md
    assert "| `_window_attention_bwd_kernel` | 1.700 | 3.200 | +1.500 | 24 | 24 |" in md
    doc = to_json(result)
    assert doc["kernel_changes"]["fmha"][1]["kernel"] == "triton_poi_fused_permute_7"
    json.dumps(doc)
    # the committed records carry no per-kernel tables: nothing to list
    edit(current, "amp", slower(1.10))
    assert check_records(BASELINE, current).kernel_changes == {}


def paired(median: float, q1: float, q3: float, against: str = "amp"):
    """An `apply --interleave` entry: the stage's paired ratio over `against`."""
    def fn(rec):
        rec["interleaved"] = {"rounds": 1, "block": 3, "with": [against, rec["stage"]], "step_ms": rec["step_ms"],
                              "iqr_ms": 0.0, "samples_ms": [rec["step_ms"]] * 3, "round_median_ms": [rec["step_ms"]],
                              "first_stage": against,
                              "x_first": {"median": median, "q1": q1, "q3": q3}, "previous_stage": against,
                              "x_previous": {"median": median, "q1": q1, "q3": q3}}
    return fn


def test_paired_speedup_from_interleaved_runs(tmp_path, current):
    base = tmp_path / "base"
    shutil.copytree(BASELINE, base)
    edit(base, "fmha", paired(1.30, 1.28, 1.32))
    # the host got slower and fmha's own step time with it (noise), but its paired ratio fell 15 %
    edit(current, "fmha", paired(1.105, 1.10, 1.11))
    result = check_records(base, current)
    r = row(result, "fmha", "paired_speedup")
    assert r["status"] == "REGRESSED" and r["delta_pct"] == pytest.approx(-15.0)
    assert r["noise_band_pct"] == pytest.approx(50 * (0.04 / 1.30 + 0.01 / 1.105))
    assert "1.30×" in render_markdown(result) and result.exit_code == 1
    # stages without interleaved entries have no such row; inside the quartiles it is noise
    assert "paired_speedup" not in set(result.rows[result.rows["stage"] == "amp"]["metric"])
    edit(current, "fmha", paired(1.22, 1.10, 1.40))
    assert row(check_records(base, current), "fmha", "paired_speedup")["status"] == "noise"


def test_paired_speedup_against_another_ancestor_is_not_compared(tmp_path, current):
    base = tmp_path / "base"
    shutil.copytree(BASELINE, base)
    edit(base, "fmha", paired(1.30, 1.28, 1.32, against="amp"))
    edit(current, "fmha", paired(2.5, 2.4, 2.6, against="baseline"))
    result = check_records(base, current)
    (r,) = [r for _, r in result.rows.iterrows() if str(r["metric"]).startswith("paired_speedup")]
    assert r["status"] == "not compared" and "vs amp / baseline" in r["metric"] and result.exit_code == 0


def test_activation_dtypes_change_is_flagged_and_old_records_skip_it(current, tmp_path):
    """A stage whose activations moved to another dtype fails the check with the parts named; records
    without the field (written before it existed, like the checked-in baseline) skip the row."""
    result = check_records(BASELINE, current)
    assert "activation_dtypes" not in set(result.rows["metric"])
    base = tmp_path / "base"
    shutil.copytree(current, base)
    dtypes = {"patch_embed": "float32", "layers.0": "float32", "layers.1": "bfloat16", "norm": "float32"}
    for folder in (base, current):
        edit(folder, "fmha", lambda rec: rec.update(activation_dtypes=dict(dtypes)))
    assert row(check_records(base, current), "fmha", "activation_dtypes")["status"] == "unchanged"
    edit(current, "fmha", lambda rec: rec["activation_dtypes"].update({"patch_embed": "bfloat16", "norm": "bfloat16"}))
    result = check_records(base, current)
    r = row(result, "fmha", "activation_dtypes")
    assert r["status"] == "REGRESSED" and r["baseline"] == "patch_embed:fp32 norm:fp32"
    assert r["current"] == "patch_embed:bf16 norm:bf16" and result.regressed
    assert any("patch_embed fp32 -> bf16" in n for n in result.notes)
    assert "fmha: activation_dtypes patch_embed:fp32 norm:fp32 -> patch_embed:bf16 norm:bf16" in result.summary


def _graph(ms: float, iqr: float = 0.02):
    def fn(rec):
        rec["graph"] = {"timing": {"samples_ms": [ms] * 4, "warmup": 2, "clock": "cuda-events", "median_ms": ms,
                                   "iqr_ms": iqr, "repeats": 4},
                        "img_per_s": rec["batch"] / ms * 1e3, "step_ms": ms, "step_iqr_ms": iqr,
                        "how": "the whole step captured once and replayed as one CUDA graph"}
    return fn


def test_graph_step_is_checked_with_its_own_spread(tmp_path, current):
    base = tmp_path / "base"
    shutil.copytree(BASELINE, base)
    edit(base, "fmha", _graph(20.0))
    edit(current, "fmha", _graph(22.0))          # graph-replayed 10% slower, eager unchanged
    result = check_records(base, current)
    graph = row(result, "fmha", "graph_ms")
    assert graph["status"] == "REGRESSED" and graph["delta_pct"] == pytest.approx(10.0)
    assert row(result, "fmha", "step_ms")["status"] == "unchanged" and result.exit_code == 1
    edit(current, "fmha", _graph(20.1))
    assert row(check_records(base, current), "fmha", "graph_ms")["status"] == "unchanged"
    # a stage without graph timing on either side has no graph_ms row
    assert (check_records(BASELINE, BASELINE).rows["metric"] != "graph_ms").all()


def test_cpu_records_against_gpu_ones_are_called_mixed_and_graph_times_read_as_ms():
    from workbench.labels import MIXED_WORDS
    from workbench.results.check import MIXED_NOTE

    root = Path(__file__).resolve().parent.parent / "reports"
    gpu = root / "h200-swin_base-b64-train" / "records"
    result = check_records(gpu, root / "cpu-tiny-b8-train" / "records", force=True)
    text = render_markdown(result)
    assert result.words == MIXED_WORDS and text.startswith(MIXED_NOTE) and to_json(result)["device"] == "CPU/GPU"
    assert "None" not in " ".join(result.notes)
    graph_rows = [line for line in render_markdown(check_records(gpu, gpu)).splitlines() if "| graph_ms |" in line]
    assert graph_rows and all(" ms |" in line for line in graph_rows)


def test_another_host_cpu_is_noted(current):
    edit(current, "amp", lambda r: r["env"].update(cpu="AMD EPYC 9654"))
    edit(current, "baseline", lambda r: r["env"].update(cpu="AMD EPYC 9654"))
    edit(current, "fmha", lambda r: r["env"].update(cpu="AMD EPYC 9654"))
    result = check_records(BASELINE, current)
    assert any(n.startswith("host CPU differs") and "AMD EPYC 9654 (current)" in n for n in result.notes)
