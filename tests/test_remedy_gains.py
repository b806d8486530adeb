"""The findings' measured gains: looked up in stored records of the same model, mode and GPU (another
batch is said, another model or GPU never matched), shown in the findings table, CSV and JSON."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from record_helpers import record
from workbench.analysis.analyze import analyze_trace, write_analysis
from workbench.analysis.findings import GRAPH_KEY, NO_REMEDY, NOT_MEASURED, findings
from workbench.capture.remedies import trace_workload
from workbench.results.record import write_record
from workbench.results.remedy_gains import TraceWorkload, remedy_gains

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "profiles/examples/swin_tiny_train_bf16"
TINY = "swin_tiny_patch4_window7_224"

# (stage, extends, eager ms, graph ms): a Swin-T ladder on an H200
LADDER = [("baseline", None, 80.0, 79.0), ("amp", "baseline", 40.0, 30.0), ("apex", "amp", 45.0, 25.0),
          ("window", "apex", 44.0, 22.0), ("fmha", "window", 43.0, 11.0)]
CHAIN = [s for s, *_ in LADDER]


def ladder(batch=64, gpu="NVIDIA H200", model=TINY, run_id="r1", fail=()):
    out = []
    for i, (stage, extends, eager, graph) in enumerate(LADDER):
        rec = record(i, stage, extends, eager, gate="FAIL" if stage in fail else ("REFERENCE" if i == 0 else "PASS"))
        rec.update(run_id=run_id, batch=batch, model=model)
        rec["env"]["gpu"] = gpu
        rec["chain"] = [{"name": n, "source": None, "passes": []} for n in CHAIN[: i + 1]]
        rec["graph"] = {"timing": {"samples_ms": [graph] * 4, "warmup": 5, "clock": "cuda-events",
                                   "median_ms": graph, "iqr_ms": 0.02, "repeats": 4},
                        "img_per_s": batch / graph * 1e3, "step_ms": graph, "step_iqr_ms": 0.02,
                        "how": "the whole step captured once and replayed as one CUDA graph"}
        out.append(rec)
    return out


def test_gains_of_the_same_workload():
    got = remedy_gains(ladder(), TraceWorkload(TINY, "train", 64, "NVIDIA H200"))
    g = got.gains
    assert set(g) == {GRAPH_KEY, "fmha", "apex", "window"}       # dense and block were not run
    assert g["fmha"]["x"] == pytest.approx(22.0 / 11.0) and g["fmha"]["x_eager"] == pytest.approx(44.0 / 43.0)
    assert g["fmha"]["against"] == "window" and "fmha vs window" in g["fmha"]["text"]
    assert g[GRAPH_KEY]["stage"] == "fmha" and g[GRAPH_KEY]["x"] == pytest.approx(43.0 / 11.0)
    assert g["apex"]["x"] == pytest.approx(30.0 / 25.0) and "0.89x as written" in g["apex"]["text"]
    assert "batch" not in g["fmha"]["text"] and "run r1 (batch 64)" in got.note


def test_another_batch_is_said_and_the_same_batch_preferred():
    got = remedy_gains(ladder(batch=128), TraceWorkload(TINY, "train", 32, "NVIDIA H200"))
    assert all(v["text"].endswith("measured at batch 128") for v in got.gains.values())
    both = ladder(batch=128, run_id="big") + ladder(batch=32, run_id="same")
    got = remedy_gains(both, TraceWorkload(TINY, "train", 32, "NVIDIA H200"))
    assert {v["run_id"] for v in got.gains.values()} == {"same"}


@pytest.mark.parametrize("workload, why", [
    (TraceWorkload("swin_base_patch4_window7_224", "train", 64, "NVIDIA H200"), "no stored records of swin_base"),
    (TraceWorkload(TINY, "train", 64, "NVIDIA A100-SXM4-80GB"), "on NVIDIA A100"),
    (TraceWorkload(TINY, "infer", 64, "NVIDIA H200"), "infer on NVIDIA H200"),
    (TraceWorkload(None, "train", 64, "NVIDIA H200"), "does not say which model"),
    (TraceWorkload(TINY, "train", 64, "NVIDIA H200", img_size=(384, 384)), "at 384x384 train on NVIDIA H200"),
])
def test_never_across_models_gpus_or_modes(workload, why):
    got = remedy_gains(ladder(), workload)
    assert got.gains == {} and why in got.note


def test_a_cpu_trace_gets_no_gains_and_no_note():
    got = remedy_gains(ladder(), TraceWorkload(TINY, "train", 64, None))
    assert got.gains == {} and got.note == ""


def test_a_stage_that_failed_the_gate_gives_no_gain():
    got = remedy_gains(ladder(fail=("fmha",)), TraceWorkload(TINY, "train", 64, "NVIDIA H200"))
    assert "fmha" not in got.gains and GRAPH_KEY not in got.gains   # the graph gain is of fmha, block or dense
    assert got.gains["window"]["x"] == pytest.approx(25.0 / 22.0)


@pytest.fixture(scope="module")
def example(unxz):
    return analyze_trace(unxz(EXAMPLE / "trace.sqlite.xz"))


def test_findings_carry_the_gains(example, tmp_path):
    gains = remedy_gains(ladder(), TraceWorkload(TINY, "train", 32, "NVIDIA H200")).gains
    table = findings(example, gains)
    by_kind = table.set_index(table["what"].str.split(":").str[0])
    assert table.iloc[0]["kind"] == "launch-bound"
    assert table.iloc[0]["gain_x"] == pytest.approx(43.0 / 11.0) and "measured at batch 64" in table.iloc[0]["gain"]
    assert by_kind.loc["softmax", "gain_x"] == pytest.approx(2.0)   # eager timm attention: GEMMs and a softmax
    assert by_kind.loc["reduction", "gain"] == NOT_MEASURED                 # dense: not run
    assert by_kind.loc["GEMM", "gain"] == NO_REMEDY and pd.isna(by_kind.loc["GEMM", "gain_x"])
    assert by_kind.loc["elementwise", "gain"] == NOT_MEASURED
    assert "window vs apex" in by_kind.loc["copy/memory", "gain"] and "apex vs amp" in by_kind.loc["copy/memory", "gain"]
    plain = findings(example)
    assert (plain["gain"].isin([NOT_MEASURED, NO_REMEDY])).all()
    out = tmp_path / "csv"
    write_analysis(example, out, "csv", trace=EXAMPLE / "trace.sqlite.xz", gains=gains)
    csv = pd.read_csv(out / "findings.csv")
    assert csv.loc[0, "gain_x"] == pytest.approx(43.0 / 11.0)
    write_analysis(example, tmp_path / "json", "json", trace=EXAMPLE / "trace.sqlite.xz", gains=gains)
    doc = json.loads((tmp_path / "json" / "analysis.json").read_text())
    assert doc["findings"][0]["gain"] == table.iloc[0]["gain"]


def test_the_example_trace_names_its_workload(example):
    assert trace_workload(EXAMPLE / "trace.sqlite.xz", example.trace_meta) == TraceWorkload(TINY, "train", 32,
                                                                                            "NVIDIA H200")
    assert trace_workload(Path("/nowhere/trace.sqlite"), example.trace_meta).model is None


def test_cli_analyze_with_records(tmp_path, monkeypatch):
    import cli
    from cli import app
    from rich.console import Console

    monkeypatch.setattr(cli, "console", Console(width=400))   # one line per row, to search
    folder = tmp_path / "run"
    folder.mkdir()
    shutil.copy(EXAMPLE / "trace.sqlite.xz", folder / "trace.sqlite.xz")
    shutil.copy(EXAMPLE / "run.json", folder / "run.json")
    for rec in ladder():
        write_record(rec, tmp_path / "records")
    runner = CliRunner()
    res = runner.invoke(app, ["analyze", str(folder / "trace.sqlite.xz"), "--records", str(tmp_path / "records"),
                              "--format", "json", "--no-timeline"])
    assert res.exit_code == 0, res.output
    assert "measured gains: stored records of swin_tiny_patch4_window7_224 train on NVIDIA H200" in res.output
    assert "3.91x: fmha graph-replayed vs as written; measured at batch 64" in res.output
    doc = json.loads((folder / "analysis.json").read_text())
    assert doc["findings"][0]["gain_x"] == pytest.approx(43.0 / 11.0)
    # the canonical runs hold no Swin-T: said, not guessed
    res = runner.invoke(app, ["analyze", str(folder / "trace.sqlite.xz")])
    assert res.exit_code == 0 and "no stored records of swin_tiny_patch4_window7_224" in res.output
    bad = runner.invoke(app, ["analyze", str(folder / "trace.sqlite.xz"), "--records", str(tmp_path / "missing")])
    assert bad.exit_code == 2 and "no such record file or folder" in bad.output
    assert "Traceback" not in bad.output and len(bad.output.strip().splitlines()) == 1
