"""`run_apply` on the CPU: one record per stage, a report, and the stages that are wrong, unavailable
or broken marked as such without stopping the run."""
import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from workbench.ladder.apply import run_apply
from workbench.errors import UserError
from workbench.models import TINY_MODEL
from workbench.optimize.passes import PassUnavailable
from workbench.results.record import read_records
from workbench.results.report import render_report_from_paths, speedup_table
from pass_helpers import register_test_pass, scale_head

RUN = dict(model=TINY_MODEL, batch=2, steps=2, warmup=1, device="cpu", progress=False, interleave=0)


def missing_kernel(model, ctx):
    raise PassUnavailable("test kernel is not built")


def crash(model, ctx):
    raise RuntimeError("kernel launch failed\nsecond line")


def out_of_memory(model, ctx):
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def recipe_file(folder: Path, name: str, extends: str, pass_name: str) -> str:
    p = folder / f"{name}.yaml"
    p.write_text(f"name: {name}\nextends: {extends}\ndescription: test stage {name}\npasses: [{pass_name}]\n")
    return str(p)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("apply")
    with pytest.MonkeyPatch.context() as mp:
        register_test_pass(mp, "scale_head_test", scale_head)
        register_test_pass(mp, "missing_test", missing_kernel)
        # sdpa (fp32) rather than amp: bf16 autocast is seconds per step on a CPU without bf16 units;
        # test_gate covers amp's gate.
        stages = ["baseline", recipe_file(tmp, "sdpa", "baseline", "sdpa_attention"),
                  recipe_file(tmp, "wrong", "baseline", "scale_head_test"),
                  recipe_file(tmp, "missing", "amp", "missing_test")]
        console = Console(file=io.StringIO(), width=160)
        result = run_apply("amp", **RUN, out_dir=tmp / "reports" / "run1", stages=stages, console=console)
    return result, console.file.getvalue()


def test_one_record_per_stage_written(run):
    result, _ = run
    names = sorted(p.name for p in result.records_dir.glob("*.json"))
    assert names == ["00-baseline.json", "01-sdpa.json", "02-wrong.json", "03-missing.json"]
    stored = json.loads((result.records_dir / "01-sdpa.json").read_text())
    assert stored["schema"] == "swinbench.stage/3" and stored["precision"] == "fp32"
    assert stored["env"]["device_type"] == "cpu" and stored["peak_mem_bytes"] is None
    assert stored["timing"]["repeats"] == 2 and stored["img_per_s"] == pytest.approx(2 / (stored["step_ms"] / 1e3))
    assert [p["name"] for p in stored["passes"]] == ["sdpa_attention"]
    assert stored["extends"] == "baseline" and stored["recipe_source"].endswith("sdpa.yaml")


def test_records_carry_the_activation_dtypes(run):
    """Every stage whose gate ran records the output dtype of each part of the model under its precision."""
    result, _ = run
    by = {r["stage"]: r for r in result.records}
    dtypes = by["sdpa"]["activation_dtypes"]
    assert list(dtypes)[0] == "patch_embed" and "layers.0" in dtypes and "norm" in dtypes and "head" in dtypes
    assert set(dtypes.values()) == {"float32"}            # an fp32 run
    assert by["missing"]["activation_dtypes"] is None      # its gate did not run


def test_statuses_and_gate(run):
    result, _ = run
    by = {r["stage"]: r for r in result.records}
    assert by["baseline"]["gate"]["status"] == "REFERENCE"
    assert by["sdpa"]["gate"]["status"] == "PASS"
    assert by["wrong"]["status"] == "ok" and by["wrong"]["gate"]["status"] == "FAIL"
    assert by["missing"]["status"] == "not available" and by["missing"]["timing"] is None
    assert "test kernel is not built" in by["missing"]["error"]
    assert result.failed == []


def test_failed_and_unavailable_stages_are_not_in_speedups(run):
    result, _ = run
    df = speedup_table(result.records).set_index("stage")
    assert df.loc["baseline", "x_baseline"] == pytest.approx(1.0)
    assert df.loc["sdpa", "x_baseline"] == pytest.approx(df.loc["baseline", "step_ms"] / df.loc["sdpa", "step_ms"])
    assert df.loc["sdpa", "x_previous"] == df.loc["sdpa", "x_baseline"]
    assert df[["x_baseline", "x_previous"]].loc[["wrong", "missing"]].isna().all().all()


def test_report_has_table_rows_and_cpu_label(run):
    result, terminal = run
    assert result.report_path == result.out_dir / "report.md"
    text = result.report_path.read_text()
    assert "CPU — not a GPU speed figure" in text
    for row in ("| baseline | fp32 |", "| sdpa | fp32 |", "| wrong | fp32 |", "| missing | bf16 |"):
        assert row in text
    assert "| FAIL |" in text and "not available" in text
    assert "x1.1 (deliberately wrong)" in text
    assert "wrong" in terminal and "FAIL" in terminal


def test_report_rerendered_from_stored_records_alone(run, tmp_path):
    result, _ = run
    again = render_report_from_paths([result.records_dir], tmp_path / "again.md")
    original = result.report_path.read_text().splitlines()
    assert again.read_text().splitlines()[:12] == original[:12]   # title, label and the speedup table
    assert len(read_records([result.records_dir])) == 4


def test_stage_errors_are_recorded_and_the_run_exits_non_zero(tmp_path):
    with pytest.MonkeyPatch.context() as mp:
        register_test_pass(mp, "crash_test", crash)
        register_test_pass(mp, "oom_test", out_of_memory)
        stages = [recipe_file(tmp_path, "broken", "baseline", "crash_test"),
                  recipe_file(tmp_path, "huge", "baseline", "oom_test"), "baseline"]
        with pytest.raises(UserError) as exc:
            run_apply("baseline", **RUN, out_dir=tmp_path / "out", stages=stages,
                      console=Console(file=io.StringIO()))
    assert exc.value.exit_code == 2 and "\n" not in str(exc.value)
    assert "broken: RuntimeError: kernel launch failed" in str(exc.value)
    records = {r["stage"]: r for r in exc.value.result.records}
    assert records["broken"]["status"] == "error" and records["broken"]["error"] == "RuntimeError: kernel launch failed"
    assert records["huge"]["error"] == "out of memory at batch 2"
    assert records["baseline"]["status"] == "ok"      # the run carried on after the broken stages
    assert (tmp_path / "out" / "report.md").exists()
    assert len(list((tmp_path / "out" / "records").glob("*.json"))) == 3


def test_isolated_stage_runs_in_its_own_process(tmp_path):
    # one stage: its process computes the baseline reference first (reference.pt), then runs the stage
    result = run_apply("baseline", **{**RUN, "steps": 1, "warmup": 0}, out_dir=tmp_path / "iso",
                       isolate=True, console=Console(file=io.StringIO()))
    assert [r["status"] for r in result.records] == ["ok"]
    assert result.records[0]["gate"]["status"] == "REFERENCE"
    assert result.records[0]["gate"]["metrics"]["logits"]["max_abs"] == 0.0
    assert (tmp_path / "iso" / "reference.pt").exists()
    assert (tmp_path / "iso" / "logs" / "00-baseline.log").exists()


def test_bad_arguments_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="unknown recipe"):
        run_apply("nope", **RUN, out_dir=tmp_path)
    with pytest.raises(UserError, match="--steps"):
        run_apply("amp", **{**RUN, "steps": 0}, out_dir=tmp_path)


def test_inference_mode_gates_logits_and_times_the_forward(tmp_path):
    """--mode infer: forward only under inference_mode; the fused kernels run forward-only, the gate
    compares logits and loss (no gradients), a wrong stage still fails it."""
    fused = tmp_path / "fused_fp32.yaml"
    fused.write_text("name: fused_fp32\nextends: baseline\ndescription: fused kernels in fp32\npasses:\n"
                     "  - name: fused_layernorm\n    params: {impl: triton}\n  - fused_window\n  - fused_attention\n")
    with pytest.MonkeyPatch.context() as mp:
        register_test_pass(mp, "scale_head_test", scale_head)
        stages = ["baseline", str(fused), recipe_file(tmp_path, "wrong", "baseline", "scale_head_test")]
        result = run_apply("baseline", **RUN, mode="infer", out_dir=tmp_path / "infer", stages=stages,
                           console=Console(file=io.StringIO(), width=160))
    by_stage = {r["stage"]: r for r in result.records}
    assert "-infer-" in result.run_id
    assert all(r["mode"] == "infer" and r["optimizer"] is None for r in result.records)
    assert by_stage["baseline"]["gate"]["status"] == "REFERENCE"
    gate = by_stage["fused_fp32"]["gate"]
    assert gate["status"] == "PASS", gate
    assert gate["metrics"]["grads"] == {} and gate["metrics"]["logits"]["rel_l2"] < 1e-4
    assert all(p["available"] for p in by_stage["fused_fp32"]["passes"])
    assert by_stage["wrong"]["gate"]["status"] == "FAIL"
    assert by_stage["fused_fp32"]["step_ms"] > 0


def test_unknown_mode_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="unknown mode"):
        run_apply("baseline", **RUN, mode="serve", out_dir=tmp_path)


def test_resume_keeps_finished_stages_and_runs_the_rest(tmp_path):
    """A run cut short (here: its last record deleted, as if the process died in that stage) resumes
    from its folder: finished stages are kept as they are (same run id), the missing one runs."""
    out = tmp_path / "run"
    first = run_apply("baseline", **{**RUN, "steps": 1, "warmup": 0}, out_dir=out, stages=["baseline", "amp"],
                      console=Console(file=io.StringIO()))
    kept_text = (out / "records" / "00-baseline.json").read_text()
    (out / "records" / "01-amp.json").unlink()
    console = Console(file=io.StringIO(), width=200)
    again = run_apply("baseline", **{**RUN, "steps": 1, "warmup": 0}, out_dir=out, stages=["baseline", "amp"],
                      console=console, resume=True)
    assert "keeping 1 finished stage(s) (baseline)" in console.file.getvalue()
    assert (out / "records" / "00-baseline.json").read_text() == kept_text          # not re-measured
    assert [r["status"] for r in again.records] == ["ok", "ok"]
    assert {r["run_id"] for r in again.records} == {first.run_id}
    assert len(read_records([out / "records"])) == 2 and again.report_path.exists()


def test_resume_refuses_a_different_experiment(tmp_path):
    out = tmp_path / "run"
    run_apply("baseline", **{**RUN, "steps": 1, "warmup": 0}, out_dir=out, stages=["baseline"],
              console=Console(file=io.StringIO()))
    with pytest.raises(UserError, match="differs from this plan: batch 2 there vs 4"):
        run_apply("baseline", **{**RUN, "steps": 1, "warmup": 0, "batch": 4}, out_dir=out, stages=["baseline"],
                  console=Console(file=io.StringIO()), resume=True)
    with pytest.raises(UserError, match="--resume needs --out"):
        run_apply("baseline", **RUN, resume=True, console=Console(file=io.StringIO()))


def test_resume_keeps_complete_interleaved_rounds_and_says_when_it_replaces_them(tmp_path):
    """Every stage kept with its full interleaved rounds: nothing is timed again. A stage run anew: the kept
    stages' rounds are timed again with it, and the run says so."""
    out = tmp_path / "run"
    args = {**RUN, "steps": 1, "warmup": 0, "interleave": 2}
    run_apply("baseline", **args, out_dir=out, stages=["baseline", "amp"], console=Console(file=io.StringIO()))
    kept_text = (out / "records" / "01-amp.json").read_text()
    console = Console(file=io.StringIO(), width=200)
    run_apply("baseline", **args, out_dir=out, stages=["baseline", "amp"], console=console, resume=True)
    assert "hold their 2 interleaved rounds: kept" in console.file.getvalue()
    assert (out / "records" / "01-amp.json").read_text() == kept_text
    (out / "records" / "01-amp.json").unlink()
    console = Console(file=io.StringIO(), width=200)
    again = run_apply("baseline", **args, out_dir=out, stages=["baseline", "amp"], console=console, resume=True)
    assert "the interleaved rounds of 1 kept stage(s) are replaced" in console.file.getvalue()
    assert all(r["interleaved"]["rounds"] == 2 for r in again.records)


def test_a_run_resumed_on_another_gpu_is_another_plan(monkeypatch):
    """--resume keeps stages of the same device kind and GPU: a run of an H100 is not continued on an H200."""
    from record_helpers import record
    from workbench.ladder import apply as ladder_apply
    from workbench.ladder import reuse
    from workbench.optimize.recipes import plan_stages
    from workbench.optimize.workload import WorkloadConfig

    config = WorkloadConfig(model="swin_tiny_patch4_window7_224", batch=64, device="cuda")
    plans = plan_stages("amp")
    rec = {**record(0, "baseline", None, 100.0, gate="REFERENCE", precision="fp32"), "recipe": "amp",
           "timing": {"samples_ms": [100.0] * 4, "warmup": 5, "clock": "cuda-events", "median_ms": 100.0,
                      "iqr_ms": 0.5, "repeats": 20}}
    monkeypatch.setattr(reuse, "gpu_identity", lambda: ("NVIDIA H200", "580.1"))
    assert ladder_apply._plan_differences([rec], plans, "amp", config, steps=20, warmup=5, profile=False) == []
    monkeypatch.setattr(reuse, "gpu_identity", lambda: ("NVIDIA H100 80GB HBM3", "580.1"))
    diffs = ladder_apply._plan_differences([rec], plans, "amp", config, steps=20, warmup=5, profile=False)
    assert diffs == ["GPU NVIDIA H200 there vs NVIDIA H100 80GB HBM3"]


def test_a_run_of_stages_alone_is_not_named_after_a_recipe(tmp_path):
    """--stages without --recipe: no recipe's chain ran, so the run and its records are named 'stages'."""
    result = run_apply(None, **RUN, out_dir=tmp_path / "r", stages=["baseline"], console=Console(file=io.StringIO()))
    assert result.run_id.startswith("stages-") and {r["recipe"] for r in result.records} == {"stages"}
    named = run_apply("fmha", **RUN, out_dir=tmp_path / "n", stages=["baseline"], console=Console(file=io.StringIO()))
    assert named.run_id.startswith("fmha-")


def test_a_reduce_overhead_stage_on_the_cpu_has_no_graph_timing():
    """Inductor's reduce-overhead replays no CUDA graph on the CPU: its record gets no graph column (which
    made the report's headline speak of the GPU being busy on a CPU run), only the CPU's reason."""
    from types import SimpleNamespace

    from workbench.ladder.apply import _time_graph
    from workbench.optimize.workload import Workload

    workload = SimpleNamespace(ctx=SimpleNamespace(device=torch.device("cpu"), cuda_graph=False, compile=True,
                                                   compile_options={"mode": "reduce-overhead"}, grad_scaler=False))
    workload.own_graphs = lambda: Workload.own_graphs(workload)
    workload.graph_blocker = lambda: Workload.graph_blocker(workload)
    assert "reduce-overhead" in workload.own_graphs()
    record = {"timing": {}, "img_per_s": 10.0, "step_ms": 100.0, "step_iqr_ms": 1.0}
    _time_graph(workload, SimpleNamespace(), record, lambda event: None)
    assert "graph" not in record and record["graph_note"] == "no CUDA graphs on the CPU"
