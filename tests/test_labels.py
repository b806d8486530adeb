"""Honest outputs: CPU runs say CPU and operators (never GPU and kernels), speedups inside the step-time
spread are marked n.s., Kineto's C++ lines stay off the terminal, the CLI's shared options agree, and
a run whose output is not a terminal prints plain progress lines."""
import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import workbench.ladder.apply as apply_mod
from cli import app
from workbench.capture.backends import stderr_to_log
from workbench.results.check import check_records, render_markdown
from workbench.results.report import render_report, run_label, speedup_table
from workbench.results.significance import paired_significant, speedup_significant

runner = CliRunner()
DATA = Path(__file__).parent / "data"
CPU_TRACE = DATA / "kineto_cpu_tiny_train.json"
SAMPLE = DATA / "records" / "baseline"
CPU_ENV = {"device_type": "cpu", "gpu": None, "cpu": "x86_64", "torch": "2.14.1", "triton": "3.8.0",
           "date": "2026-01-01T00:00:00+00:00"}


def stage_record(i, stage, extends, step_ms, iqr_ms, *, steps=8, env=CPU_ENV, shares=None):
    return {
        "schema": "swinbench.stage/1", "run_id": "r1", "recipe": "fmha", "stage": stage, "stage_index": i,
        "status": "ok", "error": None, "extends": extends, "description": f"{stage} stage",
        "chain": [{"name": n, "source": None, "passes": []} for n in ["baseline", "amp", "fmha"][: i + 1]],
        "model": "swinbench_tiny_cpu", "mode": "train", "batch": 2, "precision": "fp32", "device": "cpu",
        "seed": 0, "env": env,
        "timing": {"samples_ms": [step_ms] * steps, "warmup": 1, "clock": "host", "median_ms": step_ms,
                   "iqr_ms": iqr_ms, "repeats": steps},
        "img_per_s": 2 / (step_ms / 1e3), "step_ms": step_ms, "step_iqr_ms": iqr_ms, "peak_mem_bytes": None,
        "compile_s": None, "optimizer": None,
        "gate": {"status": "REFERENCE" if i == 0 else "PASS", "tolerance": {}, "metrics": {}, "reason": None},
        "passes": [], "stage_passes": [], "notes": [], "activation_dtypes": None,
        "profile": {"backend": "torch", "trace": "t.json", "category_share_pct": shares,
                    "kernel_ms_per_step": step_ms / 2} if shares else None,
    }


# ---------------------------------------------------------------- CPU labels


def test_analyze_of_a_cpu_trace_says_cpu_operators():
    result = runner.invoke(app, ["analyze", str(CPU_TRACE), "--top", "3"])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())      # the console is 80 columns wide: lines wrap
    assert "CPU operators (short names)" in out and "704 operators, 99.588 ms" in out
    assert "CPU busy / idle" in out and "other (59 operators)" in out and "op_sum" in out
    tables = out.split("CPU operators (each aten op's self time) instead", 1)[1]   # after the note
    assert "GPU" not in tables and "kernel" not in tables


def test_a_cpu_range_without_operators_is_not_called_gpu():
    result = runner.invoke(app, ["analyze", str(CPU_TRACE), "--range", "Optimizer.zero_grad#AdamW.zero_grad"])
    assert result.exit_code == 2, result.output
    assert "ran no CPU operators" in result.output and "GPU" not in result.output


def test_diff_of_cpu_traces_says_cpu_operators():
    result = runner.invoke(app, ["diff", str(CPU_TRACE), str(CPU_TRACE), "--top", "3"])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "CPU busy % of span" in out and "op ms" in out
    assert "Operators by change of CPU ms" in out and "Categories by change of CPU ms" in out
    assert "GPU" not in out and "Kernels by change" not in out


def test_report_of_cpu_records_says_cpu_op_time(tmp_path, monkeypatch):
    labels = []
    import matplotlib.axes

    real = matplotlib.axes.Axes.set_xlabel
    monkeypatch.setattr(matplotlib.axes.Axes, "set_xlabel", lambda ax, text, *a, **k: (labels.append(text), real(ax, text, *a, **k))[1])
    records = [stage_record(0, "baseline", None, 100.0, 1.0, shares={"gemm": 60.0, "other": 40.0}),
               stage_record(1, "amp", "baseline", 50.0, 1.0, shares={"gemm": 50.0, "other": 50.0})]
    text = render_report(records, tmp_path / "report.md").read_text()
    assert "## CPU op time by category (%)" in text and "CPU busy" in text and "torch.profiler" in text
    assert "| stage | op ms/step |" in text
    assert "GPU kernel time" not in text and "nsys" not in text and "GPU busy" not in text
    assert labels[-1] == "share of CPU op time (%)"   # pandas sets the axis label first, then ours


def test_check_table_of_cpu_records_says_cpu(tmp_path):
    folder = tmp_path / "cpu"
    shutil.copytree(SAMPLE, folder)
    for f in folder.glob("*.json"):
        rec = json.loads(f.read_text())
        rec["env"] = {**rec["env"], "device_type": "cpu", "gpu": None, "driver": None}
        f.write_text(json.dumps(rec))
    md = render_markdown(check_records(folder, folder))
    assert md.startswith("**CPU records** (no GPU)")
    assert not render_markdown(check_records(SAMPLE, SAMPLE)).startswith("**CPU")


def test_title_names_the_stages_unless_the_whole_recipe_ran():
    three = [stage_record(i, s, e, 100.0 - 10 * i, 1.0) for i, (s, e) in
             enumerate([("baseline", None), ("amp", "baseline"), ("fmha", "amp")])]
    assert run_label(three) == "fmha"
    assert run_label(three[:2]) == "baseline, amp"            # `apply --stages baseline,amp` (recipe fmha)
    assert run_label([three[0], three[2]]) == "baseline, fmha"  # fmha without the amp its chain needs


# ---------------------------------------------------------------- significance


def test_speedups_inside_the_spread_are_not_significant():
    assert speedup_significant(50.0, 1.0, 8, 100.0, 1.0, 8)
    assert not speedup_significant(96.0, 3.0, 8, 100.0, 2.0, 8)      # medians ± IQR overlap
    assert not speedup_significant(50.0, 20.0, 8, 100.0, 1.0, 8)     # IQR 40% of the median
    assert not speedup_significant(50.0, 1.0, 1, 100.0, 1.0, 8)      # one step: spread unknown
    assert paired_significant(1.2, 1.4, 5) and not paired_significant(0.9, 1.1, 5)
    assert not paired_significant(1.2, 1.4, 2)


def test_table_and_report_mark_not_significant_speedups(tmp_path):
    records = [stage_record(0, "baseline", None, 100.0, 2.0), stage_record(1, "amp", "baseline", 96.0, 3.0),
               stage_record(2, "fmha", "amp", 40.0, 1.0)]
    df = speedup_table(records).set_index("stage")
    assert not df.loc["baseline", "x_baseline_ns"]                   # 1.00x against itself: no mark
    assert df.loc["amp", "x_baseline_ns"] and df.loc["amp", "x_previous_ns"]
    assert not df.loc["fmha", "x_previous_ns"]
    text = render_report(records, tmp_path / "r.md").read_text()
    assert "| amp | fp32 | 20.8 | 96.00 ± 3.00 | 1.04x (n.s.) | 1.04x (n.s.) |" in text
    assert "| fmha | fp32 | 50.0 | 40.00 ± 1.00 | 2.50x | 2.40x |" in text
    assert "n.s. = not significant" in text
    records[1]["step_ms"] = records[1]["timing"]["median_ms"] = 70.0
    records[1]["step_iqr_ms"] = 1.0
    assert "n.s." not in render_report(records, tmp_path / "r2.md").read_text()


def test_a_slower_stage_within_the_noise_gets_no_reason(tmp_path):
    records = [stage_record(0, "baseline", None, 100.0, 30.0), stage_record(1, "amp", "baseline", 104.0, 30.0)]
    text = render_report(records, tmp_path / "r.md").read_text()
    assert "**amp** is slower than **baseline**" in text and "not a measured slowdown" in text
    assert "host launching" not in text


# ---------------------------------------------------------------- Kineto's C++ lines


def test_stderr_of_cpp_code_goes_to_the_log(tmp_path, capfd):
    log = tmp_path / "capture.log"
    with stderr_to_log(log):
        os.write(2, b"ERROR:2026-01-01 00:00:00 1:1 DeviceProperties.cpp:56] gpuGetDeviceCount failed\n")
        os.write(2, b"USDT:2026-01-01 00:00:00 1:1 SyncActivityProfilerHandler.cpp:39] profiler_start\n")
        os.write(2, b"/x/y.py:3: UserWarning: something a user must see\n")
    err = capfd.readouterr().err
    assert "gpuGetDeviceCount" not in err and "USDT" not in err
    assert "UserWarning: something a user must see" in err
    assert "gpuGetDeviceCount failed" in log.read_text() and "USDT:" in log.read_text()
    os.write(2, b"after\n")                                           # descriptor 2 is back
    assert "after" in capfd.readouterr().err


# ---------------------------------------------------------------- CLI


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("swinbench ") and result.output.strip()[-1].isdigit()


@pytest.mark.parametrize("flag", ["--out", "--output"])
def test_check_writes_its_table_with_out_or_output(tmp_path, flag):
    target = tmp_path / "check.md"
    result = runner.invoke(app, ["check", "--baseline", str(SAMPLE), "--current", str(SAMPLE), flag, str(target)])
    assert result.exit_code == 0, result.output
    assert "no regression" in target.read_text()


def test_apply_off_a_terminal_prints_a_line_per_stage(tmp_path, monkeypatch):
    """CliRunner's output is not a terminal: no bars, one line as each stage starts and ends, and on the CPU
    the stages are timed again in alternation by default (its timing is test_interleave's; stubbed here)."""
    calls = []
    monkeypatch.setattr(apply_mod, "_interleave", lambda *a, **k: calls.append((a[3], a[7].plain, k)))
    result = runner.invoke(app, ["apply", "--device", "cpu", "--steps", "1", "--warmup", "0", "--batch", "1",
                                 "--stages", "baseline,amp", "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    start = lines.index("stage 1/2 baseline: started")
    assert lines[start + 2] == "stage 2/2 amp: started"
    assert lines[start + 1].startswith("stage 1/2 baseline: ok, ") and lines[start + 1].endswith("img/s, gate REFERENCE")
    assert lines[start + 3].startswith("stage 2/2 amp: ok, ") and lines[start + 3].endswith("img/s, gate PASS")
    assert "timed again in alternation after they run (3 rounds; --interleave 0 turns it off" in " ".join(result.output.split())
    assert "timing the stages again in alternation: 3 rounds" in lines
    assert calls == [(apply_mod.CPU_INTERLEAVE_ROUNDS, True, {"asked": False})]   # rounds, plain lines
    assert "stages ━" not in result.output and "0:00:" not in result.output   # no progress bar in a log
    assert "swinbench apply: baseline, amp — swinbench_tiny_cpu" in result.output
    assert "swinbench_tiny_cpu's CPU step times" in result.output
    assert "(n.s.)" in result.output                                   # one timed step: spread unknown
    assert (tmp_path / "run" / "report.md").read_text().startswith("# swinbench apply: baseline, amp — ")


def test_interleaved_rounds_print_a_line_each_off_a_terminal(tmp_path):
    import io

    from rich.console import Console

    from workbench.ladder.apply import _interleave
    from workbench.ladder.progress import LadderProgress

    console = Console(file=io.StringIO(), width=100)
    records = [stage_record(0, "baseline", None, 10.0, 1.0), stage_record(1, "amp", "baseline", 9.0, 1.0)]
    specs = [apply_mod.StageSpec(run_id="r1", recipe="fmha", stage=r["stage"], stage_index=i, stage_ref="baseline",
                                 recipe_source=None, config={}, steps=1, warmup=0, profile=False, out_dir=str(tmp_path))
             for i, r in enumerate(records)]

    def two_rounds(ispec, emit):
        for i in range(2):
            emit({"event": "round", "i": i, "samples_ms": {"baseline": [10.0], "amp": [9.0]}})
        return {"baseline": {"samples_ms": [10.0, 10.0], "round_median_ms": [10.0, 10.0]},
                "amp": {"samples_ms": [9.0, 9.0], "round_median_ms": [9.0, 9.0]}}

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(apply_mod, "run_interleaved_spec", two_rounds)
        mp.setattr(apply_mod, "asdict", lambda c: {})
        _interleave(records, specs, None, 2, False, tmp_path, console, LadderProgress(console, True, 2), asked=False)
    assert console.file.getvalue().splitlines() == ["interleaved round 1/2 done", "interleaved round 2/2 done"]


def test_records_of_the_cpu_and_a_gpu_together_get_mixed_words():
    from workbench.labels import CPU_WORDS, GPU_WORDS, MIXED_WORDS, record_words

    gpu, cpu = {"env": {"device_type": "cuda"}}, {"env": {"device_type": "cpu"}}
    assert record_words([gpu, gpu]) == GPU_WORDS and record_words([cpu]) == CPU_WORDS
    assert record_words([gpu, cpu]) == MIXED_WORDS and not MIXED_WORDS.is_cpu
