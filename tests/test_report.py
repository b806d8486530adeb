"""Reports from stored records only: exact speedups, FAIL and unavailable stages left out, the
Markdown sections and the category-share chart, re-rendered from files without a model or a GPU."""
import json
import math
from pathlib import Path

import pytest

from record_helpers import ENV, record
from workbench.errors import UserError
from workbench.results.record import write_record
from workbench.results.report import default_report_path, display_rows, render_report, render_report_from_paths, speedup_table

@pytest.fixture
def records():
    return [
        record(0, "baseline", None, 100.0, gate="REFERENCE", precision="fp32",
               shares={"gemm": 50.0, "elementwise": 30.0, "layernorm": 20.0}),
        record(1, "amp", "baseline", 50.0, shares={"gemm": 40.0, "elementwise": 40.0, "layernorm": 20.0}),
        record(2, "apex", "amp", 40.0),
        record(3, "window", "apex", 44.0),                      # slower than apex
        record(4, "fmha", "window", 20.0, gate="FAIL"),         # fast and wrong
        record(5, "fmha-compile", "fmha", 10.0, status="not available", gate="SKIP"),
        record(6, "torch-compile", "amp", 25.0),                # a peer: compared with amp
    ]


def test_speedups_across_runs_of_the_same_workload_are_marked(records):
    """A second run with only peer stages is compared with the first run's baseline and amp, marked
    as cross-run; a run of another model or GPU is never used for that."""
    later = [dict(record(0, "torch-compile-graphs", "amp", 12.5), run_id="r2")]
    other_gpu = [dict(record(0, "fmha-graph", "fmha", 10.0), run_id="r3", env={**ENV, "gpu": "NVIDIA A100"})]
    df = speedup_table(records + later + other_gpu).set_index("stage")
    assert df.loc["torch-compile-graphs", "x_baseline"] == pytest.approx(8.0)
    assert df.loc["torch-compile-graphs", "x_previous"] == pytest.approx(4.0)
    assert df.loc["torch-compile-graphs", ["x_baseline_cross_run", "x_previous_cross_run"]].all()
    assert not df.loc["amp", ["x_baseline_cross_run", "x_previous_cross_run"]].any()
    assert math.isnan(df.loc["fmha-graph", "x_baseline"]) and not df.loc["fmha-graph", "x_baseline_cross_run"]


def test_speedups_exact_and_honest(records):
    df = speedup_table(records).set_index("stage")
    assert df.loc["amp", "x_baseline"] == pytest.approx(2.0)
    assert df.loc["apex", "x_previous"] == pytest.approx(1.25)
    assert df.loc["window", "x_previous"] == pytest.approx(40 / 44)
    assert df.loc["torch-compile", "x_previous"] == pytest.approx(2.0)      # vs amp, the stage it extends
    assert df.loc["torch-compile", "x_baseline"] == pytest.approx(4.0)
    for stage in ("fmha", "fmha-compile"):
        assert math.isnan(df.loc[stage, "x_baseline"]) and not df.loc[stage, "counted"]
    assert math.isnan(df.loc["baseline", "x_previous"])
    assert list(df.index) == [r["stage"] for r in records]


def test_markdown_report(records, tmp_path):
    path = render_report(records, tmp_path / "report.md")
    text = path.read_text()
    assert text.startswith("# swinbench apply: fmha — swin_tiny_patch4_window7_224, training, batch 64, NVIDIA H200")
    table = text.index("| stage | precision | img/s")
    assert table < text.index("## Configuration")   # the table first
    assert "| amp | bf16 | 1,280.0 | 50.00 ± 0.50 | 2.00x | 2.00x | 3.00 GiB | PASS |" in text
    assert "| fmha | bf16 | 3,200.0 | 20.00 ± 0.50 | - | - | 3.00 GiB | FAIL |" in text
    assert "| fmha-compile | bf16 | - | - | - | - | - | not available |" in text
    assert "CPU — not a GPU speed figure" not in text
    assert "| GPU | NVIDIA H200 |" in text and "| driver | 580.1 |" in text
    assert "## GPU kernel time by category (%)" in text
    assert "| baseline | - | - | - | - | 50.0 | 30.0 | 20.0 |" in text
    assert (tmp_path / "report-categories.png").stat().st_size > 1000
    assert "`apex_pass`: apex changed things" in text
    assert "**window** is slower than **apex**" in text
    assert "**fmha** FAILED the correctness gate" in text
    assert "**fmha-compile** not available" in text


def test_configuration_names_the_eager_launcher_and_settings(records, tmp_path):
    assert "Triton launches" not in render_report(records, tmp_path / "a.md").read_text()  # older records: no line
    for r in records:
        r["env"] = {**ENV, "triton_launcher": "cached", "swinbench_env": {"SWINBENCH_TRITON_OP": "0"}}
    text = render_report(records, tmp_path / "b.md").read_text()
    assert "| Triton launches (eager) | cached launcher (workbench.kernels._common.CachedLauncher) |" in text
    assert "| settings | SWINBENCH_TRITON_OP=0 |" in text


def test_widely_spread_gpu_steps_get_a_note(records, tmp_path):
    """A GPU stage whose steps spread past 5% of the median (IQR) is flagged as likely host-bound, with
    its range; steady stages and CPU (host-clock) records are not."""
    noisy = records[2]
    noisy["timing"] = {**noisy["timing"], "samples_ms": [36.0, 40.0, 44.0, 52.0], "iqr_ms": 6.0}
    text = render_report(records, tmp_path / "r.md").read_text()
    assert "apex: step times spread from 36.0 to 52.0 ms (IQR 15% of the median)" in text
    assert text.count("step times spread") == 1 and "`apply --interleave N` compares such stages" in text
    noisy["interleaved"] = {"rounds": 1, "block": 3, "with": ["apex"], "step_ms": 40.0, "iqr_ms": 6.0,
                            "samples_ms": [36.0, 40.0, 46.0], "round_median_ms": [40.0], "first_stage": "apex",
                            "x_first": {"median": 1.0, "q1": 1.0, "q3": 1.0}, "previous_stage": None,
                            "x_previous": None}   # already interleaved
    assert "--interleave N` compares" not in render_report(records, tmp_path / "r1.md").read_text()
    noisy["timing"]["clock"] = "host"
    assert "step times spread" not in render_report(records, tmp_path / "r2.md").read_text()


def test_cpu_records_are_labelled(records, tmp_path):
    for r in records:
        r["env"] = {**ENV, "device_type": "cpu", "gpu": None, "cpu": "x86_64"}
    text = render_report(records, tmp_path / "r.md").read_text()
    assert "CPU — not a GPU speed figure" in text.splitlines()[0]


def test_rerender_from_stored_files(records, tmp_path):
    folder = tmp_path / "run" / "records"
    for r in records:
        write_record(r, folder)
    assert default_report_path([folder]) == tmp_path / "run" / "report.md"
    path = render_report_from_paths([folder])
    assert path == tmp_path / "run" / "report.md"
    assert render_report(records, tmp_path / "direct.md").read_text() == path.read_text().replace(
        "report-categories.png", "direct-categories.png")
    one = render_report_from_paths([folder / "01-amp.json"], tmp_path / "one.md").read_text()
    assert "| amp |" in one and "| apex |" not in one


def test_bad_record_paths_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no such record"):
        render_report_from_paths([tmp_path / "missing"])
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"schema": "other"}))
    with pytest.raises(UserError, match="not a swinbench stage record"):
        render_report_from_paths([bad])


def test_slower_stage_with_less_gpu_time_is_explained_as_host_bound(tmp_path):
    from workbench.results.report import _slower_why

    from workbench.results.record import as_records

    parent = record(0, "amp", "baseline", 67.0, shares={"gemm": 100.0})
    slower = record(1, "apex", "amp", 98.7, shares={"gemm": 100.0})
    parent["profile"]["kernel_ms_per_step"], slower["profile"]["kernel_ms_per_step"] = 63.2, 51.1
    recs = as_records([parent, slower])
    why = _slower_why(recs[1], recs, "amp")
    assert "fell from 63.2 to 51.1 ms" in why and "host" in why and "52%" in why
    unprofiled = as_records([{**slower, "profile": None}])[0]
    assert "look at its passes" in _slower_why(unprofiled, recs, "amp")


def test_previous_falls_back_to_the_nearest_measured_ancestor(tmp_path):
    """`apply --stages amp,fmha`: fmha extends window, which was not measured; × previous compares it
    with amp, its nearest measured ancestor in its recorded chain, and says so."""
    chain = [{"name": n, "source": None, "passes": []} for n in ("baseline", "amp", "apex", "window", "fmha")]
    recs = [dict(record(0, "amp", "baseline", 90.0), chain=chain[:2]),
            dict(record(1, "fmha", "window", 60.0), chain=chain)]
    df = speedup_table(recs).set_index("stage")
    assert df.loc["fmha", "x_previous"] == pytest.approx(1.5)
    assert df.loc["fmha", "previous_stage"] == "amp"
    assert math.isnan(df.loc["amp", "x_previous"])          # its baseline was not measured either
    rows = {r[0]: r for r in display_rows(speedup_table(recs))}
    assert rows["fmha"][5] == "1.50x (vs amp)"
    # without a stored chain there is nothing to fall back on
    assert math.isnan(speedup_table([recs[0], record(1, "fmha", "window", 60.0)]).set_index("stage").loc["fmha", "x_previous"])


def test_inference_report_says_forward_only(tmp_path):
    recs = [dict(record(0, "amp", "baseline", 24.0), mode="infer"), dict(record(1, "fmha", "amp", 16.0), mode="infer")]
    out = tmp_path / "report.md"
    render_report(recs, out)
    text = out.read_text()
    assert "inference" in text and "One forward on the same seed" in text
    assert "One forward + backward" not in text and "optimizer:" not in text


def test_profiled_stage_shows_host_api_calls_per_step(records, tmp_path):
    records[1]["profile"]["api_calls_per_step"] = {"launch": 1194.5, "synchronize": 0.25, "allocation": 29.25,
                                                   "other": 10.0}
    out = tmp_path / "report.md"
    render_report(records, out)
    text = out.read_text()
    assert "| amp | - | - | 1,194 | 30 | 40.0 | 40.0 | 20.0 |" in text
    assert "launches/step | sync+alloc/step" in text


def test_profiled_stages_show_which_kernels_changed(records, tmp_path):
    """Each profiled stage's per-kernel table against its nearest profiled ancestor: largest change first,
    kernels that appear or vanish counted as 0 on the other side; stages without one are left out."""
    records[0]["profile"].update(kernel_ms_per_step=10.0, kernels_per_step=[
        {"kernel": "sgemm_fp32", "ms_per_step": 6.0, "per_step": 100.0},
        {"kernel": "layer_norm", "ms_per_step": 2.0, "per_step": 48.0},
        {"kernel": "elementwise", "ms_per_step": 2.0, "per_step": 300.0}])
    records[1]["profile"].update(kernel_ms_per_step=5.5, kernels_per_step=[
        {"kernel": "hgemm_bf16", "ms_per_step": 2.5, "per_step": 100.0},
        {"kernel": "layer_norm", "ms_per_step": 1.5, "per_step": 48.0},
        {"kernel": "elementwise", "ms_per_step": 1.5, "per_step": 500.0}])
    out = tmp_path / "report.md"
    render_report(records, out)
    text = out.read_text()
    assert "## What changed in the GPU profile from stage to stage" in text
    assert "**amp** against **baseline**: GPU kernel time 10.0 → 5.5 ms per step" in text
    section = text.split("## What changed in the GPU profile")[1].split("## What each stage changed")[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("| `")]
    assert lines[0] == "| `sgemm_fp32` | 6.000 | 0.000 | -6.000 | 100 | 0 |"
    assert lines[1] == "| `hgemm_bf16` | 0.000 | 2.500 | +2.500 | 0 | 100 |"
    assert len(lines) == 4
    # without per-kernel tables (older records) the section is not there
    for r in records:
        if r.get("profile"):
            r["profile"].pop("kernels_per_step", None)
    render_report(records, out)
    assert "What changed in the" not in out.read_text()


def test_terminal_summary_names_the_largest_kernel_changes():
    from rich.console import Console

    from workbench.results.report import render_speedup_table

    recs = [record(0, "amp", "baseline", 50.0, shares={"gemm": 50.0}), record(1, "fmha", "amp", 40.0, shares={"gemm": 60.0})]
    recs[0]["profile"]["kernels_per_step"] = [{"kernel": "a", "ms_per_step": 3.0, "per_step": 1},
                                              {"kernel": "b", "ms_per_step": 2.0, "per_step": 1}]
    recs[1]["profile"]["kernels_per_step"] = [{"kernel": "a", "ms_per_step": 1.0, "per_step": 1},
                                              {"kernel": "c", "ms_per_step": 3.0, "per_step": 1}]
    console = Console(width=200, record=True)
    render_speedup_table(recs, console)
    assert "fmha against amp, largest GPU kernel changes (ms per step): c +3.00, a -2.00, b -2.00" in console.export_text()


def test_terminal_summary_points_host_bound_stages_at_interleave():
    from rich.console import Console

    from workbench.results.report import render_speedup_table

    recs = [record(0, "amp", "baseline", 50.0), record(1, "fmha", "amp", 40.0)]
    recs[1]["timing"] = {**recs[1]["timing"], "samples_ms": [36.0, 40.0, 44.0, 52.0], "iqr_ms": 6.0}
    console = Console(width=200, record=True)
    render_speedup_table(recs, console)
    text = console.export_text()
    assert "fmha: step times spread widely (likely bound by the host)" in text and "--interleave N" in text


def test_activation_dtypes_table_and_a_precision_change_is_named(tmp_path):
    """Each stage's activation dtypes get a table; a stage that keeps activations in other dtypes than the
    stage it extends, at the same precision, gets a line naming the parts (not amp against the fp32
    baseline: another precision is that stage's point)."""
    from workbench.results.report import activation_dtype_changes

    chain = [{"name": n, "source": None, "passes": []} for n in ("baseline", "amp", "apex", "window", "fmha")]
    fp32 = {"patch_embed": "float32", "layers.0": "float32", "layers.1": "float32", "norm": "float32"}
    amp = {"patch_embed": "float32", "layers.0": "float32", "layers.1": "bfloat16", "norm": "float32"}
    fused = {"patch_embed": "bfloat16", "layers.0": "bfloat16", "layers.1": "bfloat16", "norm": "bfloat16"}
    recs = [dict(record(0, "baseline", None, 100.0, gate="REFERENCE", precision="fp32"), activation_dtypes=fp32, chain=chain[:1]),
            dict(record(1, "amp", "baseline", 60.0), activation_dtypes=amp, chain=chain[:2]),
            dict(record(2, "fmha", "window", 40.0), activation_dtypes=fused, chain=chain),
            dict(record(3, "fmha-graph", "fmha", 20.0), activation_dtypes=fused, chain=chain + [{"name": "fmha-graph"}])]
    changes = activation_dtype_changes(recs)
    assert len(changes) == 1 and changes[0].startswith("**fmha** keeps activations in other dtypes than **amp**")
    assert "patch_embed fp32 -> bf16" in changes[0] and "norm fp32 -> bf16" in changes[0] and "layers.1" not in changes[0]
    text = render_report(recs, tmp_path / "r.md").read_text()
    assert "## Activation dtypes" in text and "| stage | patch_embed | layers.0 | layers.1 | norm |" in text
    assert "| amp | fp32 | fp32 | bf16 | fp32 |" in text
    # records from before the field existed render without the section
    old = [{k: v for k, v in r.items() if k != "activation_dtypes"} for r in recs]
    assert "## Activation dtypes" not in render_report(old, tmp_path / "old.md").read_text()


HOSTILE = [("img_per_s", float("nan")), ("step_ms", "fast"), ("stage_index", "two"), ("run_id", 5),
           ("peak_mem_bytes", 10**30), ("timing", [1.0]), ("gate", "PASS"), ("profile", {"backend": 1})]


@pytest.mark.parametrize("field,value", HOSTILE, ids=[f"{f}={v!r}" for f, v in HOSTILE])
def test_cli_report_of_a_bad_record_is_one_line_exit_2(records, tmp_path, field, value):
    from typer.testing import CliRunner

    from cli import app

    folder = tmp_path / "records"
    for r in records[:3]:
        write_record(r, folder)
    path = folder / "01-amp.json"
    data = json.loads(path.read_text())
    data[field] = value
    path.write_text(json.dumps(data))
    result = CliRunner().invoke(app, ["report", str(folder), "--out", str(tmp_path / "r.md")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1 and "01-amp.json" in result.output
    assert "stage 'amp'" in result.output and f"'{field}" in result.output
    assert not (tmp_path / "r.md").exists()


def test_records_of_several_models_and_devices_are_labelled_per_row(records, tmp_path):
    """A table of records from different GPUs, models or the CPU says "mixed" and names each row's model
    and device; speedups are never taken across devices."""
    other = dict(record(0, "baseline", None, 80.0, gate="REFERENCE", precision="fp32"), run_id="r2",
                 model="swin_base_patch4_window7_224", env={**ENV, "gpu": "NVIDIA A100-SXM4-80GB"})
    cpu = dict(record(0, "baseline", None, 900.0, gate="REFERENCE", precision="fp32"), run_id="r3",
               model="swinbench_tiny_cpu", env={**ENV, "device_type": "cpu", "gpu": None}, peak_mem_bytes=None)
    text = render_report(records[:2] + [other, cpu], tmp_path / "mixed.md").read_text()
    title = text.splitlines()[0]
    assert "mixed models" in title and "mixed devices" in title and "NVIDIA H200" in title
    assert "NVIDIA A100" in title and "CPU" in title
    assert "| stage | model | device | precision |" in text
    assert "| amp (r1) | swin_tiny_patch4_window7_224 | NVIDIA H200 | bf16 |" in text
    assert "| baseline (r2) | swin_base_patch4_window7_224 | NVIDIA A100-SXM4-80GB | fp32 |" in text
    assert "| baseline (r3) | swinbench_tiny_cpu | CPU | fp32 |" in text
    assert "not GPU speed figures" in text
    df = speedup_table(records[:2] + [other, cpu]).set_index(["run_id", "stage"])
    assert df.loc[("r2", "baseline"), "x_baseline"] == pytest.approx(1.0)     # its own run only
    assert "| model | swin_tiny_patch4_window7_224, swin_base_patch4_window7_224, swinbench_tiny_cpu |" in text
    # one model on one GPU: no per-row labels, the GPU in the title
    plain = render_report(records[:2], tmp_path / "plain.md").read_text()
    assert "| stage | precision |" in plain and "mixed" not in plain.splitlines()[0]


def test_a_cpu_run_says_cpu_in_the_title_and_rows(tmp_path):
    cpu_env = {**ENV, "device_type": "cpu", "gpu": None, "cpu": "x86_64"}
    recs = [dict(record(i, s, e, 100.0), env=cpu_env, peak_mem_bytes=None)
            for i, (s, e) in enumerate([("baseline", None), ("amp", "baseline")])]
    text = render_report(recs, tmp_path / "cpu.md").read_text()
    assert text.splitlines()[0].endswith("CPU — not a GPU speed figure")
    assert "| device | CPU (x86_64) - no GPU, speed figures are not GPU figures |" in text
    assert "| GPU | none (CPU) |" in text


def test_a_stage_whose_recipe_failed_training_parity_is_flagged(records, tmp_path):
    from pathlib import Path

    from workbench.results.verdicts import TrainingVerdict

    stages = [r["stage"] if isinstance(r, dict) else r.stage for r in records]
    failed = TrainingVerdict(stages[-1], "baseline", "swin_tiny_patch4_window7_224", 1000, 1, False,
                             "differs: accuracy -3.35 points from the baseline's mean (rule: within 0.5)",
                             Path(tmp_path / "cmp"))
    passed = TrainingVerdict(stages[1], "amp", "swin_tiny_patch4_window7_224", 1000, 3, True,
                             "converges like the baseline", Path(tmp_path / "cmp2"))
    text = render_report(records, tmp_path / "r.md", verdicts=[failed, passed]).read_text()
    section = text.split("## Training parity")[1].split("\n## ")[0]
    assert f"**{stages[-1]}** failed the parity rule" in section
    assert f"**{stages[-1]}** **fails parity** with the fp32 baseline" in section and "-3.35 points" in section
    assert f"**{stages[1]}** trains like `amp`" in section and "3 seeds" in section
    assert "## Training parity" not in render_report(records, tmp_path / "n.md", verdicts=[]).read_text()

    undecided = TrainingVerdict(stages[1], "baseline", "swin_tiny_patch4_window7_224", 1000, 1, False,
                                "not decided: accuracy -0.67 points from the baseline's mean (rule: within 0.5; "
                                "this comparison's noise: ±1.02, ...): more seeds or a stabler run decide it",
                                Path(tmp_path / "cmp3"), decided=False)
    text = render_report(records, tmp_path / "u.md", verdicts=[undecided]).read_text()
    section = text.split("## Training parity")[1].split("\n## ")[0]
    assert "failed the parity rule" not in section and f"For **{stages[1]}** a comparison below could not decide" in section
    assert f"**{stages[1]}** is **not decided** against the fp32 baseline" in section and "±1.02" in section


def test_a_quantized_stage_shows_its_gemm_dtype_beside_the_precision(tmp_path):
    from record_helpers import record

    from workbench.results.record import StageRecord
    from workbench.results.report import render_report

    quant = {"name": "quantize_linear", "params": {"dtype": "fp8"}, "changed": "", "details": {}, "available": True}
    fp8 = StageRecord.from_dict({**record(1, "fp8", "amp", 9.0), "passes": [quant]})
    sim = StageRecord.from_dict({**record(2, "int8", "amp", 9.0),
                                 "passes": [{**quant, "params": {"dtype": "int8", "simulate": True}}]})
    off = StageRecord.from_dict({**record(3, "fp8x", "amp", 9.0), "passes": [{**quant, "available": False}]})
    assert fp8.precision == "bf16" and fp8.precision_label == "bf16, fp8 GEMMs"
    assert sim.precision_label == "bf16, int8 GEMMs simulated" and off.precision_label == "bf16"
    text = render_report([StageRecord.from_dict(record(0, "amp", None, 10.0)), fp8], tmp_path / "r.md").read_text()
    assert "| fp8 | bf16, fp8 GEMMs |" in text


def test_a_report_of_several_workloads_gives_each_its_own_best_form(tmp_path):
    """The README's three canonical record folders (H200 training, H200 inference, the CPU ladder): each
    workload's fused stack is set against its own peer, never a CPU figure against a GPU one."""
    from workbench.results.report import render_report_from_paths

    root = Path(__file__).resolve().parent.parent / "reports"
    folders = [root / "h200-swin_base-b64-train" / "records", root / "h200-swin_base-b64-infer" / "records",
               root / "cpu-tiny-b8-train" / "records"]
    text = render_report_from_paths(folders, tmp_path / "mixed.md").read_text()
    best = [line for line in text.splitlines() if "Fused stack, best form" in line]
    assert len(best) == 2, best
    assert "training, batch 64, NVIDIA H200: " in best[0] and "inference, batch 64, NVIDIA H200: " in best[1]
    assert all("0.00x" not in line and "CPU" not in line for line in best)


def test_a_parity_verdict_names_the_device_that_trained():
    from workbench.results.verdicts import TrainingVerdict, find_verdicts, verdict_line

    v = TrainingVerdict("fmha", "baseline", "swin_tiny_patch4_window7_224", 1000, 2, True,
                        "converges like the baseline", Path("reports/x"), device="NVIDIA H200")
    assert "2 seeds, on NVIDIA H200)" in verdict_line(v)
    committed = Path(__file__).resolve().parent.parent / "reports"
    assert {x.device for x in find_verdicts([committed])} == {"NVIDIA H200"}


def test_the_category_chart_beside_a_report_never_writes_over_a_file_of_the_user_s(records, tmp_path):
    mine = tmp_path / "notes-categories.png"
    mine.write_text("my notes")
    with pytest.raises(UserError, match="exists and is not a category chart swinbench drew"):
        render_report(records, tmp_path / "notes.md")
    assert mine.read_text() == "my notes" and not (tmp_path / "notes.md").exists()
    render_report(records, tmp_path / "report.md")
    render_report(records, tmp_path / "report.md")        # its own chart, drawn again


def test_speedups_never_pair_image_sizes_or_devices_even_inside_one_run(records):
    """A stage of another image size, or of one run resumed on another GPU, has no speedup against the
    baseline it does not share its workload with."""
    bigger = [dict(record(0, "fmha-graph", "fmha", 10.0), run_id="r2", img_size=[112, 112])]
    other_gpu = [dict(record(7, "fmha-graph", "fmha", 10.0), env={**ENV, "gpu": "NVIDIA H100"})]   # run r1
    df = speedup_table(records + bigger + other_gpu)
    assert math.isnan(df.loc[7, "x_baseline"]) and math.isnan(df.loc[8, "x_baseline"])


def test_previous_is_the_nearest_ancestor_of_the_stages_own_run(records):
    """A run of baseline, amp and fmha beside a run that has window: its fmha is compared with its own
    amp, not with the other run's window; the baseline of another run is marked in the graph layout."""
    mine = [dict(record(0, "baseline", None, 100.0, gate="REFERENCE", precision="fp32"), run_id="r2"),
            dict(record(1, "amp", "baseline", 50.0), run_id="r2"),
            dict(record(2, "fmha", "window", 25.0), run_id="r2",
                 chain=[{"name": n, "source": None, "passes": []} for n in ("baseline", "amp", "window", "fmha")])]
    df = speedup_table(records + mine)
    fmha = df[(df["run_id"] == "r2") & (df["stage"] == "fmha")].iloc[0]
    assert fmha["previous_stage"] == "amp" and fmha["x_previous"] == pytest.approx(2.0)
    assert not fmha["x_previous_cross_run"]
    from workbench.results.report import CROSS_RUN_MARK, _graph_display_rows

    lone = [dict(record(0, "torch-compile", "amp", 25.0), run_id="r3",
                 graph={"step_ms": 20.0, "step_iqr_ms": 0.1, "img_per_s": 3200.0, "how": "replayed",
                        "timing": {**records[0]["timing"], "median_ms": 20.0}})]
    df = speedup_table(records + lone)
    rows = _graph_display_rows(df, None)
    row = next(r for r in rows if r[0].startswith("torch-compile (r3)"))
    assert CROSS_RUN_MARK in row[3] and CROSS_RUN_MARK in row[4]

def test_the_best_form_is_one_runs_against_its_own_baseline():
    from workbench.results.report import best_form

    def graphed(rec, graph_ms):
        return {**rec, "graph": {"step_ms": graph_ms, "step_iqr_ms": 0.1, "img_per_s": 64e3 / graph_ms,
                                 "how": "the step captured once, replayed",
                                 "timing": {**rec["timing"], "samples_ms": [graph_ms] * 4, "median_ms": graph_ms}}}

    run_a = [graphed(record(0, "baseline", None, 100.0, gate="REFERENCE", precision="fp32"), 90.0),
             graphed(record(1, "amp", "baseline", 50.0), 45.0),
             graphed(record(2, "torch-compile", "amp", 40.0), 30.0)]
    run_b = [dict(graphed(record(0, "baseline", None, 200.0, gate="REFERENCE", precision="fp32"), 180.0),
                  run_id="r2"),
             dict(record(1, "amp", "baseline", 50.0, gate="FAIL"), run_id="r2")]
    records = run_a + run_b
    best = best_form(records, speedup_table(records), among="main")
    # run A's fastest form against run A's own baseline graph (90 ms), not run B's (180 ms)
    assert (best["stage"], best["ms"]) == ("torch-compile", 30.0) and best["x_baseline"] == pytest.approx(3.0)


def test_two_runs_keep_their_own_notes_and_category_rows():
    """Stage names repeat across runs: the category rows and the notes are each run's own, labelled."""
    from workbench.results.record import as_records
    from workbench.results.report import _notes, category_share_frame

    def run(run_id, fmha_ms, shares):
        return [dict(record(0, "baseline", None, 100.0, gate="REFERENCE", precision="fp32"), run_id=run_id),
                dict(record(1, "amp", "baseline", 50.0), run_id=run_id),
                dict(record(2, "fmha", "amp", fmha_ms, shares=shares), run_id=run_id)]

    recs = run("a", 40.0, {"gemm": 70.0, "attention": 30.0}) + run("b", 65.0, {"gemm": 40.0, "attention": 60.0})
    shares = category_share_frame(recs)
    assert shares.loc["fmha (a)", "gemm"] == 70.0 and shares.loc["fmha (b)", "gemm"] == 40.0
    notes = _notes(as_records(recs), speedup_table(recs))
    slower = [n for n in notes if "is slower than" in n]
    assert len(slower) == 1 and slower[0].startswith("**fmha (b)**"), notes


def test_records_of_two_folders_need_an_out(tmp_path):
    """`report A B` would otherwise replace A's own report with one of both runs."""
    a, b = tmp_path / "a" / "records", tmp_path / "b" / "records"
    assert default_report_path([a / "x.json"]) == tmp_path / "a" / "report.md"
    assert default_report_path([a, a / "y.json"]) == tmp_path / "a" / "report.md"
    with pytest.raises(UserError, match="give --out"):
        default_report_path([a, b])


def test_parity_cites_verdicts_of_the_same_kind_of_device(records, tmp_path):
    """A GPU run's report does not cite a CPU comparison (and a CPU run's none of the GPU's)."""
    from workbench.results.verdicts import TrainingVerdict

    stage = records[1]["stage"]
    gpu = TrainingVerdict(stage, "baseline", "swin_tiny_patch4_window7_224", 1000, 2, True, "converges like the "
                          "baseline", tmp_path / "g", device="NVIDIA H200")
    cpu = TrainingVerdict(stage, "baseline", "swinbench_tiny_cpu", 30, 1, True, "converges like the baseline",
                          tmp_path / "c", device="CPU")
    section = render_report(records, tmp_path / "r.md", verdicts=[gpu, cpu]).read_text().split(
        "## Training parity")[1].split("\n## ")[0]
    assert "NVIDIA H200" in section and "swinbench_tiny_cpu" not in section


def test_activation_dtype_changes_compare_within_a_run():
    """Run a keeps amp and fmha in bf16, run b both in fp32: neither changed dtype, so nothing is said."""
    from workbench.results.report import activation_dtype_changes

    def run(run_id, dtype):
        return [dict(record(1, "amp", "baseline", 50.0), run_id=run_id, activation_dtypes={"blocks.0": dtype}),
                dict(record(2, "fmha", "amp", 40.0), run_id=run_id, activation_dtypes={"blocks.0": dtype})]

    assert activation_dtype_changes(run("a", "torch.bfloat16") + run("b", "torch.float32")) == []


def test_a_record_named_twice_is_one_row_and_a_copied_run_is_refused(tmp_path):
    import shutil

    from workbench.results.readme_table import render_for_readme

    cpu = Path(__file__).resolve().parents[1] / "reports" / "cpu-tiny-b8-train"
    out = render_report_from_paths([cpu / "records", cpu / "records" / "00-baseline.json"], out=tmp_path / "r.md")
    assert out.read_text().count("| baseline | fp32 | 531.2 |") == 1
    readme = tmp_path / "README.md"
    assert render_for_readme([cpu / "records", cpu / "records"], readme).count("| baseline | fp32 | 15.06") == 1
    copy = tmp_path / "copy"
    shutil.copytree(cpu / "records", copy)
    for paths in ([cpu / "records", copy], [copy, cpu / "records"]):
        with pytest.raises(UserError, match="hold the same stage baseline of run .* \\(a copy\\?\\)"):
            render_report_from_paths(paths, out=tmp_path / "twice.md")
        with pytest.raises(UserError, match="a copy"):
            render_for_readme(paths, readme)
    assert not (tmp_path / "twice.md").exists()


def _committed_stage_runs():
    root = Path(__file__).resolve().parents[1] / "reports"
    return sorted(p.parent for p in root.glob("**/records") if any(p.glob("*.json")) and (p.parent / "report.md").is_file())


@pytest.mark.parametrize("folder", _committed_stage_runs(), ids=lambda p: p.name)
def test_committed_reports_are_what_their_records_render(folder, tmp_path):
    """reports/ holds runs of the current code: each report.md is its records rendered again."""
    out = render_report_from_paths([folder / "records"], out=tmp_path / "report.md")
    assert out.read_text() == (folder / "report.md").read_text(), f"re-render: swinbench report {folder}/records"


def test_a_report_of_part_of_a_run_does_not_replace_the_runs_report(tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(Path(__file__).resolve().parents[1] / "reports" / "cpu-tiny-b8-train", run)
    before = (run / "report.md").read_text()
    with pytest.raises(UserError, match="1 of the 5 records .* part of the run.*give --out FILE"):
        render_report_from_paths([run / "records" / "01-amp.json"])
    assert (run / "report.md").read_text() == before
    assert render_report_from_paths([run / "records" / "01-amp.json"], out=tmp_path / "amp.md").is_file()
    assert render_report_from_paths([run / "records"]) == run / "report.md"
