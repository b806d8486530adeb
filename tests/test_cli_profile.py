"""`swinbench profile` end to end on the CPU (torch.profiler backend, tiny Swin), through the CLI."""
import json

from typer.testing import CliRunner

from cli import app

runner = CliRunner()


def test_profile_on_cpu_writes_trace_tables_and_says_which_backend(tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(app, ["profile", "--device", "cpu", "--batch", "2", "--steps", "2", "--warmup", "1",
                                 "--out", str(out), "--format", "json"])
    assert result.exit_code == 0, result.output
    assert "torch.profiler" in result.output
    assert (out / "trace.json").exists() and (out / "run.json").exists()
    run = json.loads((out / "run.json").read_text())
    assert run["backend"] == "torch" and run["env"]["device_type"] == "cpu"
    assert run["config"]["model"] == "swinbench_tiny_cpu"
    assert any(p.suffix == ".json" and p.name != "trace.json" and p.name != "run.json" for p in out.iterdir())
    # the picture of the median step and the Perfetto export, beside the captured trace (not over it)
    assert (out / "timeline.png").stat().st_size > 10_000
    assert json.loads((out / "trace.json").read_text())["traceEvents"]
    timeline = json.loads((out / "timeline.json").read_text())
    assert timeline["otherData"]["steps"] == ["step1", "step2"] and timeline["trace"] == "trace.json"


def test_profile_no_timeline_writes_none(tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(app, ["profile", "--device", "cpu", "--batch", "1", "--steps", "1", "--warmup", "0",
                                 "--out", str(out), "--no-timeline"])
    assert result.exit_code == 0, result.output
    assert (out / "kernels.csv").exists() and not list(out.glob("timeline.*"))


def test_profile_bad_input_is_one_line_and_exit_2(tmp_path):
    for args, text in (
        (["--model", "resnet50", "--device", "cpu"], "not a timm Swin"),
        (["--precision", "fp8", "--device", "cpu"], "unknown precision"),
        (["--mode", "eval", "--device", "cpu"], "unknown mode"),
        (["--backend", "nsys", "--device", "cpu", "--nsys", str(tmp_path / "x")], "nsys not found"),
        (["--format", "xml", "--device", "cpu"], "unknown format"),
        (["--mode", "eval"], "unknown mode"),       # default device: no CPU-fallback note before the error
        (["--batch", "0"], "--batch must be a whole number from 1"),
        (["--backend", "bogus"], "unknown backend"),
        (["--out", str(tmp_path / "held")], "holds an earlier run"),
    ):
        (tmp_path / "held").mkdir(exist_ok=True)
        (tmp_path / "held" / "trace.json").write_text("{}")
        result = runner.invoke(app, ["profile", "--out", str(tmp_path / "o"), *args])
        assert result.exit_code == 2, (args, result.output)
        assert text in result.output
        assert "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1, result.output


def test_profile_with_recipe_says_what_each_pass_changed(tmp_path):
    result = runner.invoke(app, ["profile", "--device", "cpu", "--batch", "2", "--steps", "1", "--warmup", "0",
                                 "--recipe", "amp", "--precision", "fp32", "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert "recipe amp: amp: autocast bf16" in result.output
    run = json.loads((tmp_path / "r" / "run.json").read_text())
    assert [p["name"] for p in run["passes"]] == ["amp"]


def test_a_recipe_that_cannot_run_here_is_refused_not_profiled_under_its_name(tmp_path, monkeypatch):
    """A capture whose passes did not run is another model's: one line, exit 2, no trace named fp8."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    result = runner.invoke(app, ["profile", "--device", "cpu", "--batch", "2", "--steps", "1", "--warmup", "0",
                                 "--recipe", "fp8", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2, result.output
    assert "recipe fp8 cannot run here" in result.output
    assert not (tmp_path / "r" / "run.json").exists()


def test_profile_with_unknown_recipe_is_one_line(tmp_path):
    result = runner.invoke(app, ["profile", "--device", "cpu", "--recipe", "nope", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and "unknown recipe" in result.output


def test_a_workload_that_fails_under_the_profiler_is_one_line_and_blocks_nothing(tmp_path, monkeypatch):
    import workbench.capture.worker as worker

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 376 GB")

    monkeypatch.setattr(worker, "run_capture", out_of_memory)
    out = tmp_path / "run"
    args = ["profile", "--device", "cpu", "--batch", "2", "--steps", "1", "--warmup", "1", "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "capture failed: RuntimeError: DefaultCPUAllocator" in result.output
    assert "RuntimeError" in (out / "capture.log").read_text()          # the traceback, for the user
    monkeypatch.undo()
    assert runner.invoke(app, args).exit_code == 0                     # the folder holds no run yet


def test_a_precision_the_cpu_does_not_run_is_said_with_what_ran(tmp_path):
    """fp16 autocast runs as bf16 on the CPU and tf32 as fp32: the capture is labelled with the option's name,
    so a note says what it really is of."""
    for asked, ran in (("fp16", "bf16"), ("tf32", "fp32")):
        result = runner.invoke(app, ["profile", "--device", "cpu", "--batch", "1", "--steps", "1", "--warmup", "1",
                                     "--precision", asked, "--no-timeline", "--out", str(tmp_path / asked)])
        assert result.exit_code == 0, result.output
        assert f"--precision {asked} runs as {ran} on the CPU" in " ".join(result.output.split())
    plain = runner.invoke(app, ["profile", "--device", "cpu", "--batch", "1", "--steps", "1", "--warmup", "1",
                                "--precision", "bf16", "--no-timeline", "--out", str(tmp_path / "bf16")])
    assert plain.exit_code == 0 and "runs as" not in plain.output


def test_infer_capture_is_the_forward_alone_as_its_help_says(tmp_path):
    """The inference step is the forward alone (the loss is computed outside it): no loss operator in the
    trace, and --mode's help does not promise one."""
    import typer.main

    command = typer.main.get_command(app).get_command(None, "profile")
    assert "forward alone" in next(p.help for p in command.params if p.name == "mode")
    out = tmp_path / "infer"
    result = runner.invoke(app, ["profile", "--device", "cpu", "--mode", "infer", "--batch", "1", "--steps", "1",
                                 "--warmup", "1", "--no-timeline", "--out", str(out)])
    assert result.exit_code == 0, result.output
    operators = (out / "kernels.csv").read_text()
    assert "aten::linear" in operators or "aten::addmm" in operators
    assert "nll_loss" not in operators and "cross_entropy" not in operators
