"""`swinbench env`: one row per capability, each saying what the commands fall back to when it is missing."""
import json
import stat

from typer.testing import CliRunner

from cli import app
from workbench.capture.environment import environment_report

runner = CliRunner()


def _rows(**kw):
    return {r["what"]: r for r in environment_report(**kw)}


def test_cpu_report_names_every_fallback(monkeypatch):
    monkeypatch.delenv("SWINBENCH_NSYS", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")                      # no nsys on PATH
    monkeypatch.setattr("workbench.trace.nsys_sqlite.NSYS_FOLDERS", ())
    rows = _rows(device="cpu")
    assert rows["device"]["value"].startswith("CPU") and "label every figure CPU" in rows["device"]["note"]
    assert rows["nsys"]["value"] == "not found" and "torch.profiler" in rows["nsys"]["note"]
    assert rows["torch"]["value"] != "-"
    # torch's CUDA build is not a GPU here: the row says so rather than standing as if CUDA ran
    assert rows["cuda"]["value"] == "-" or "no CUDA GPU is in use here" in rows["cuda"]["note"]
    assert {"nvtx package", "Triton kernels", "eager Triton launches", "apex", "SWINBENCH_* settings"} <= set(rows)


def test_nsys_found_is_run_for_its_version(tmp_path, monkeypatch):
    fake = tmp_path / "nsys"
    fake.write_text("#!/bin/sh\necho 'NVIDIA Nsight Systems version 2099.1.1'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("SWINBENCH_NSYS", str(fake))
    monkeypatch.setenv("SWINBENCH_TRITON_OP", "0")
    rows = _rows(device="cpu")
    assert rows["nsys"] == {"what": "nsys", "value": str(fake), "note": "NVIDIA Nsight Systems version 2099.1.1"}
    assert "SWINBENCH_TRITON_OP=0" in rows["SWINBENCH_* settings"]["value"]
    monkeypatch.setenv("SWINBENCH_NSYS", str(tmp_path / "missing"))
    row = _rows(device="cpu")["nsys"]
    assert row["value"] == "not usable" and "not needed here" in row["note"] and "torch.profiler" in row["note"]


def test_stale_swinbench_nsys_does_not_stop_a_cpu_profile(tmp_path, monkeypatch):
    """What env says (not needed on the CPU) is what profile does."""
    monkeypatch.setenv("SWINBENCH_NSYS", str(tmp_path / "missing"))
    out = runner.invoke(app, ["profile", "--device", "cpu", "--batch", "1", "--steps", "1", "--warmup", "1",
                              "--no-timeline", "--out", str(tmp_path / "p")])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "p" / "trace.json").exists()


def test_cli_env_table_json_and_bad_format():
    table = runner.invoke(app, ["env", "--device", "cpu"])
    assert table.exit_code == 0 and "swinbench env" in table.output and "Triton kernels" in table.output
    out = runner.invoke(app, ["env", "--device", "cpu", "--format", "json"])
    assert out.exit_code == 0 and {r["what"] for r in json.loads(out.output)} >= {"device", "nsys"}
    bad = runner.invoke(app, ["env", "--format", "xml"])
    assert bad.exit_code == 2 and "unknown format" in bad.output
