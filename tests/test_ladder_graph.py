"""The headline ladder: each stage as written and graph-replayed, its GPU kernel time, the best form of
the fused stack against the PyTorch-alone peers, the talk's ladder beside it, and reused measurements."""
import copy
import io
import json

import pytest
import torch
from rich.console import Console

from record_helpers import ENV, record
from workbench.errors import UserError
from workbench.ladder import reuse
from workbench.ladder.progress import LadderProgress, outcome
from workbench.optimize.passes import PassContext, PassUnavailable
from workbench.optimize.passes import cuda_graph
from workbench.precision import resolve_precision
from workbench.results.record import StageRecord, read_records, write_record
from workbench.results.report import (GRAPH_HEADERS, best_form, display_rows, headline_text, render_report,
                                      render_speedup_table, speedup_table, table_headers)

# (stage, extends, eager ms, graph ms, GPU kernel ms, PyTorch alone)
LADDER = [("baseline", None, 178.6, 178.5, 176.8, True), ("amp", "baseline", 79.3, 66.6, 64.7, True),
          ("apex", "amp", 94.6, 53.1, 53.1, False), ("window", "apex", 72.9, 44.8, 44.5, False),
          ("fmha", "window", 64.7, 24.6, 24.4, False), ("torch-sdpa", "amp", 69.6, 55.2, 55.2, True),
          ("torch-compile", "amp", 34.6, 29.3, 28.8, True)]
CHAIN = ["baseline", "amp", "apex", "window", "fmha"]


def ladder_records():
    out = []
    for i, (stage, extends, eager, graph, kernel, alone) in enumerate(LADDER):
        rec = record(i, stage, extends, eager)
        rec["chain"] = [{"name": n, "source": None, "passes": []} for n in
                        (CHAIN[: CHAIN.index(stage) + 1] if stage in CHAIN else ["baseline", "amp", stage])]
        rec["graph"] = {"timing": {"samples_ms": [graph] * 4, "warmup": 5, "clock": "cuda-events",
                                   "median_ms": graph, "iqr_ms": 0.02, "repeats": 4},
                        "img_per_s": 64 / graph * 1e3, "step_ms": graph, "step_iqr_ms": 0.02,
                        "how": "the whole step captured once and replayed as one CUDA graph"}
        rec["gpu_time"] = {"kernel_ms": kernel, "busy_pct": 100 * kernel / eager, "steps": 3,
                           "source": "torch.profiler (CUPTI)"}
        rec["pytorch_alone"] = alone
        out.append(rec)
    return out


def test_graph_fields_round_trip_and_are_validated(tmp_path):
    recs = ladder_records()
    recs[1]["reused"] = {"run_id": "r0", "path": "/cache/records/abc.json", "date": "2026-01-01T00:00:00+00:00"}
    for rec in recs:
        write_record(rec, tmp_path)
    back = read_records([tmp_path])
    assert back[4].graph.step_ms == 24.6 and back[4].gpu_time.kernel_ms == 24.4 and back[4].pytorch_alone is False
    assert back[1].reused.run_id == "r0"
    assert StageRecord.from_dict(json.loads(json.dumps(back[4].to_dict()))) == back[4]
    for field, value, needle in (("graph", {"step_ms": -1.0}, "graph"), ("gpu_time", {"steps": 0}, "gpu_time.steps"),
                                 ("reused", {"date": 3}, "reused.date")):
        bad = copy.deepcopy(recs[2])
        bad[field] = {**(bad.get(field) or {"run_id": "r0", "path": "p", "date": "d"}), **value}
        with pytest.raises(UserError, match=needle):
            StageRecord.from_dict(bad)


def test_table_has_both_columns_the_best_form_and_marked_peers():
    recs = ladder_records()
    df = speedup_table(recs)
    assert table_headers(df) == GRAPH_HEADERS
    row = df.set_index("stage").loc["fmha"]
    assert row.x_previous_graph == pytest.approx(44.8 / 24.6) and row.x_baseline_graph == pytest.approx(178.5 / 24.6)
    rows = display_rows(df, recs)
    names = [r[0] for r in rows]
    assert names == CHAIN + ["best form: fmha, graph-replayed", "torch-sdpa (PyTorch alone)",
                             "torch-compile (PyTorch alone)"]
    by_name = dict(zip(names, rows))
    assert by_name["apex"][GRAPH_HEADERS.index("talk × fp32")] == "2.11x"
    assert by_name["fmha"][GRAPH_HEADERS.index("GPU ms (busy)")] == "24.4 (38%)"
    best = best_form(recs, df)
    assert (best["stage"], best["form"], best["peer"], best["peer_form"]) == ("fmha", "graph-replayed", "torch-compile",
                                                                              "graph-replayed")
    assert best["x_peer"] == pytest.approx(29.3 / 24.6)


def test_headline_says_which_columns_and_why():
    recs = ladder_records()
    text = headline_text(recs, speedup_table(recs))
    assert text.startswith("Headline: the graph columns") and "fmha 38%" in text and "baseline" not in text
    gpu_bound = ladder_records()
    for rec in gpu_bound:
        rec["gpu_time"]["busy_pct"] = 97.0
    assert headline_text(gpu_bound, speedup_table(gpu_bound)).startswith("Headline: the eager columns")


def test_best_form_takes_a_compiled_form_when_it_is_faster():
    recs = ladder_records()
    extra = record(7, "fmha-compile", "fmha", 22.0)
    extra["chain"] = [{"name": n, "source": None, "passes": []} for n in CHAIN + ["fmha-compile"]]
    extra["pytorch_alone"] = False
    extra["graph_note"] = "not captured: RuntimeError: operation not permitted when stream is capturing"
    best = best_form(recs + [extra], speedup_table(recs + [extra]))
    assert (best["stage"], best["form"], best["ms"]) == ("fmha-compile", "as written", 22.0)


def test_a_stages_run_takes_its_fastest_swinbench_stage_against_its_peers():
    # --stages names no chain: the fused stack is every swinbench stage measured, not the last one listed
    recs = ladder_records()
    extra = record(7, "fmha-compile", "fmha", 30.0)
    extra["chain"] = [{"name": n, "source": None, "passes": []} for n in CHAIN + ["fmha-compile"]]
    extra["pytorch_alone"] = False
    for rec in recs + [extra]:
        rec["recipe"] = "stages"
    best = best_form(recs + [extra], speedup_table(recs + [extra]))
    assert (best["stage"], best["form"], best["ms"]) == ("fmha", "graph-replayed", 24.6)
    assert (best["peer"], best["peer_ms"]) == ("torch-compile", 29.3)     # amp is a rung of fmha's, not a peer


def test_report_and_terminal_say_it(tmp_path):
    recs = ladder_records()
    path = render_report(recs, tmp_path / "report.md")
    text = path.read_text()
    assert "| best form: fmha, graph-replayed |" in text and "torch-compile (PyTorch alone)" in text
    assert "Fused stack, best form: fmha, graph-replayed: 24.60 ms per step" in text
    assert "1.19x faster" in text and "NVIDIA's Swin talk" in text
    out = io.StringIO()
    render_speedup_table(recs, Console(file=out, width=250))
    assert "Headline: the graph columns" in out.getvalue() and "1.19x faster" in out.getvalue()


def test_old_records_keep_the_one_column_table():
    recs = [record(0, "baseline", None, 100.0), record(1, "amp", "baseline", 50.0)]
    df = speedup_table(recs)
    assert "eager ms (median ± IQR)" not in table_headers(df) and best_form(recs, df) is None
    assert headline_text(recs, df) is None


def test_plain_progress_names_the_graph_phase_and_both_rates():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    rec = ladder_records()[4]
    with LadderProgress(console, True, 1) as shown:
        shown.start_stage(0, "fmha", 25)
        shown.event({"event": "graph"})
        shown.end_stage(0, "fmha", rec)
    lines = out.getvalue().splitlines()
    assert lines == ["stage 1/1 fmha: started", "stage fmha: timing the step replayed as one CUDA graph",
                     f"stage 1/1 fmha: {outcome(rec)}"]
    assert "989.2 img/s" in outcome(rec) and "2,601.6 img/s graph-replayed" in outcome(rec)


def test_cuda_graph_pass_takes_a_default_compile_not_reduce_overhead():
    ctx = PassContext(device=torch.device("cuda"), precision=resolve_precision("bf16"))
    ctx.compile, ctx.compile_options = True, {"backend": "inductor"}
    cuda_graph.apply(torch.nn.Linear(2, 2), ctx)
    assert ctx.cuda_graph
    ctx = PassContext(device=torch.device("cuda"), precision=resolve_precision("bf16"))
    ctx.compile, ctx.compile_options = True, {"backend": "inductor", "mode": "reduce-overhead"}
    with pytest.raises(PassUnavailable, match="reduce-overhead"):
        cuda_graph.apply(torch.nn.Linear(2, 2), ctx)


# ---------------------------------------------------------------- reuse


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(reuse, "gpu_identity", lambda: ("NVIDIA H200", "580.1"))
    made = reuse.RecordCache(tmp_path / "cache", on_gpu=True, fresh=False)
    made.machine.update({k: ENV[k] for k in ("torch", "triton", "timm", "python")}, swinbench_env={})  # the records'

    return made


def test_a_stored_measurement_is_reused_under_the_same_conditions_only(cache, tmp_path):
    rec = ladder_records()[2]
    chain, config = rec["chain"], {"model": rec["model"], "mode": "train", "batch": 64, "precision": "fp32", "seed": 0}
    key = cache.key(chain, config, steps=20, warmup=5, profile=False)
    assert cache.lookup(key) is None
    cache.store(key, rec)
    cached = cache.lookup(key)
    assert cached["step_ms"] == rec["step_ms"]
    for other in (dict(steps=10, warmup=5, profile=False), dict(steps=20, warmup=5, profile=True)):
        assert cache.key(chain, config, **other) != key
    assert cache.key(chain, {**config, "batch": 32}, steps=20, warmup=5, profile=False) != key
    for what, value in (("swinbench_source", "0" * 12), ("torch", "9.9"), ("gpu", ["NVIDIA H100", "580.1"])):
        other = reuse.RecordCache(cache.folder, on_gpu=True, fresh=False)
        other.machine = {**cache.machine, what: value}
        assert other.key(chain, config, steps=20, warmup=5, profile=False) != key, what
    mine = reuse.reused_record(cached, run_id="r9", recipe="fmha", stage_index=7)
    path = write_record(mine, tmp_path / "records")
    (back,) = read_records([path])
    assert (back.run_id, back.stage_index, back.reused.run_id) == ("r9", 7, "r1")
    assert back.reused.path.endswith(f"{key}.json")
    fresh = reuse.RecordCache(cache.folder, on_gpu=True, fresh=True)
    assert fresh.lookup(key) is None


def test_a_record_of_other_conditions_is_neither_stored_nor_reused(cache, tmp_path):
    """A record kept by --resume was measured under its run's conditions: stored under today's key, a later
    run would take it as measured today."""
    key = cache.key([], {"model": "m"}, steps=1, warmup=0, profile=False)
    older = record(1, "amp", "baseline", 50.0)
    older["env"] = {**older["env"], "torch": "2.10.0"}
    cache.store(key, older)
    assert cache.lookup(key) is None and not (cache.folder / "records" / f"{key}.json").exists()
    cache.store(key, record(1, "amp", "baseline", 50.0))
    assert cache.lookup(key) is not None
    cache.machine["swinbench_env"] = {"SWINBENCH_AUTOTUNE": "0"}
    assert cache.lookup(key) is None          # the stored record's settings are not this machine's


def test_the_key_holds_the_kernel_environment_and_process_isolation(cache, monkeypatch):
    def made():
        made = reuse.RecordCache(cache.folder, on_gpu=True, fresh=False)
        made.machine.update({k: cache.machine[k] for k in ("torch", "triton", "timm", "python", "swinbench_env")})
        return made

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    compiled = made()
    key = compiled.key([], {"model": "m"}, steps=1, warmup=0, profile=False)
    assert compiled.key([], {"model": "m"}, steps=1, warmup=0, profile=False, isolate=False) != key
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")       # where a cache lives: not a condition
    interpreted = made()
    assert interpreted.machine["kernel_env"] == {"TRITON_INTERPRET": "1"}
    assert interpreted.key([], {"model": "m"}, steps=1, warmup=0, profile=False) != key


def test_a_stored_profile_names_its_files_from_anywhere(cache, tmp_path):
    rec = record(1, "amp", "baseline", 50.0)
    rec["profile"] = {"timeline": "profiles/01-amp/timeline.png", "trace": "profiles/01-amp/trace.sqlite"}
    key = cache.key([], {"model": "m"}, steps=1, warmup=0, profile=True)
    cache.store(key, rec, tmp_path / "run")
    stored = json.loads((cache.folder / "records" / f"{key}.json").read_text())["profile"]
    assert stored["timeline"] == str((tmp_path / "run" / "profiles/01-amp/timeline.png").resolve())
    assert rec["profile"]["timeline"] == "profiles/01-amp/timeline.png"     # this run's own record: as it was


def test_failed_reused_or_unreadable_records_are_not_cached(cache):
    key = cache.key([], {"model": "m"}, steps=1, warmup=0, profile=False)
    cache.store(key, record(1, "amp", "baseline", 50.0, gate="FAIL"))
    assert cache.lookup(key) is None
    cache.store(key, {**record(1, "amp", "baseline", 50.0), "reused": {"run_id": "r", "path": "p", "date": "d"}})
    assert cache.lookup(key) is None
    (cache.folder / "records").mkdir(parents=True, exist_ok=True)
    (cache.folder / "records" / f"{key}.json").write_text("{not json")
    assert cache.lookup(key) is None


def test_no_reuse_on_the_cpu_or_without_the_gpus_identity(tmp_path, monkeypatch):
    assert reuse.RecordCache(tmp_path, on_gpu=False, fresh=False).key([], {}, steps=1, warmup=0, profile=False) is None
    monkeypatch.setattr(reuse, "gpu_identity", lambda: None)
    assert reuse.RecordCache(tmp_path, on_gpu=True, fresh=False).key([], {}, steps=1, warmup=0, profile=False) is None


def test_compile_cache_note():
    assert reuse.compile_cache_note({}) is None
    note = reuse.compile_cache_note({"fxgraph_cache_hit": 3, "fxgraph_cache_miss": 1, "autograd_cache_hit": 2})
    assert note == "compile caches: FX graphs 3 of 4 reused, AOTAutograd graphs 2 of 2 reused"


def test_quick_and_fresh_reach_run_apply(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    import workbench.ladder.apply as apply_module
    from cli import app

    seen = {}

    def fake_run_apply(recipe, **kwargs):
        seen.update(kwargs, recipe=recipe)
        raise UserError("stop here")

    monkeypatch.setattr(apply_module, "run_apply", fake_run_apply)
    result = CliRunner().invoke(app, ["apply", "--quick", "--fresh", "--cache", str(tmp_path), "--device", "cpu"])
    assert result.exit_code == 2 and "stop here" in result.output
    assert (seen["steps"], seen["warmup"], seen["peers"], seen["fresh"]) == (10, 3, False, True)
    assert seen["cache_dir"] == tmp_path
    result = CliRunner().invoke(app, ["apply", "--device", "cpu"])
    assert (seen["steps"], seen["warmup"], seen["peers"], seen["fresh"]) == (20, 5, None, False)
    assert seen["cache_dir"] == reuse.default_cache_dir()
