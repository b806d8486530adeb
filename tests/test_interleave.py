"""`apply --interleave`: the stages timed again in alternation in one process. The timing loop's order and
counts, the paired ratio, the record entries (previous = nearest interleaved ancestor), and a run on the
CPU's tiny Swin that adds the entries to the stored records and a table to the report."""
import statistics
import time

import pytest
import torch
from rich.console import Console

from record_helpers import record
from workbench.ladder.apply import run_apply
from workbench.errors import UserError
from workbench.ladder.interleave import interleaved_entries, paired_ratio, time_interleaved
from workbench.models import TINY_MODEL
from workbench.results.record import read_records
from workbench.results.report import render_report

CPU = torch.device("cpu")


def test_rounds_rotate_the_order_and_time_every_step():
    calls = []
    steps = {n: (lambda i, _n=n: calls.append((_n, i))) for n in ("a", "b", "c")}
    out = time_interleaved(steps, rounds=4, block=2, warmup=1, device=CPU)
    assert calls[:3] == [("a", 0), ("b", 0), ("c", 0)]                  # warm-up, one each
    timed = [n for n, _ in calls[3:]]
    rounds = [timed[k:k + 6:2] for k in range(0, 24, 6)]                 # first step of each block
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert all(len(v["samples_ms"]) == 8 and len(v["round_median_ms"]) == 4 for v in out.values())
    assert [i for n, i in calls[3:] if n == "a"] == [1, 2, 3, 4, 5, 6, 7, 8]   # step indices keep counting
    with pytest.raises(ValueError):
        time_interleaved(steps, rounds=0, block=1, warmup=0, device=CPU)


def test_slow_and_fast_stages_are_told_apart():
    # sleeps long enough that a loaded machine's fixed wake-up delay does not pull the ratio toward 1
    steps = {"slow": lambda i: time.sleep(0.016), "fast": lambda i: time.sleep(0.008)}
    out = time_interleaved(steps, rounds=3, block=2, warmup=0, device=CPU)
    r = paired_ratio(out["slow"]["round_median_ms"], out["fast"]["round_median_ms"])
    assert 1.3 < r["median"] < 2.5 and r["q1"] <= r["median"] <= r["q3"]


def test_paired_ratio_is_the_median_of_round_ratios_not_the_ratio_of_medians():
    # the host drifts: round 2 is 3x slower for both; each round the second stage is 2x faster
    base, other = [10.0, 30.0, 12.0], [5.0, 15.0, 6.0]
    assert paired_ratio(base, other) == {"median": 2.0, "q1": 2.0, "q3": 2.0}
    assert paired_ratio([4.0], [2.0])["median"] == 2.0
    assert paired_ratio([], [])["median"] is None
    # two rounds far apart: the quartiles are the two ratios, never past them (nor below 0)
    assert paired_ratio([10.0, 10.0], [10.0, 1.5]) == {"median": pytest.approx(3.8333, abs=1e-4), "q1": 1.0,
                                                       "q3": pytest.approx(10 / 1.5)}


def _rec(stage, extends, chain):
    return dict(record(len(chain), stage, extends, 10.0), chain=[{"name": n} for n in chain])


def test_entries_compare_with_the_nearest_interleaved_ancestor():
    records = [_rec("amp", "baseline", ["baseline", "amp"]),
               _rec("window", "apex", ["baseline", "amp", "apex", "window"]),
               _rec("fmha", "window", ["baseline", "amp", "apex", "window", "fmha"])]
    t = {"amp": [8.0, 8.0], "window": [6.0, 4.0], "fmha": [2.0, 2.0]}
    timings = {k: {"samples_ms": v, "round_median_ms": v} for k, v in t.items()}
    e = interleaved_entries(records, timings, rounds=2, block=1)
    assert e["amp"]["previous_stage"] is None and e["amp"]["x_previous"] is None
    assert e["window"]["previous_stage"] == "amp"                       # apex was not interleaved
    assert e["window"]["x_previous"]["median"] == pytest.approx(5 / 3)   # median of 8/6 and 8/4
    assert e["fmha"]["previous_stage"] == "window" and e["fmha"]["x_first"]["median"] == 4.0
    assert e["fmha"]["with"] == ["amp", "window", "fmha"] and e["fmha"]["step_ms"] == 2.0


def test_apply_interleave_adds_paired_timings_to_records_and_report(tmp_path):
    run = dict(model=TINY_MODEL, batch=2, steps=1, warmup=0, device="cpu", progress=False)
    result = run_apply("amp", **run, stages=["baseline", "amp"], out_dir=tmp_path / "run", interleave=2,
                       console=Console(file=None, record=True, width=120))
    stored = {r.stage: r.to_dict() for r in read_records([result.records_dir])}
    for name in ("baseline", "amp"):
        e = stored[name]["interleaved"]
        assert e["rounds"] == 2 and len(e["samples_ms"]) == 2 * e["block"] and e["with"] == ["baseline", "amp"]
        assert e["step_ms"] == pytest.approx(statistics.median(e["samples_ms"]))
    assert stored["amp"]["interleaved"]["previous_stage"] == "baseline"
    text = result.report_path.read_text()
    assert "## Timed in alternation" in text and "| amp |" in text.split("## Timed in alternation")[1]
    assert "× baseline (paired)" in text


def test_interleave_needs_two_stages_and_a_sane_count(tmp_path):
    run = dict(model=TINY_MODEL, batch=2, steps=1, warmup=0, device="cpu", progress=False)
    console = Console(record=True, width=200)
    result = run_apply("baseline", **run, stages=["baseline"], out_dir=tmp_path / "one", interleave=2, console=console)
    assert "needs two measured stages" in console.export_text()
    assert read_records([result.records_dir])[0].interleaved is None
    with pytest.raises(UserError, match="--interleave"):
        run_apply("baseline", **run, out_dir=tmp_path / "bad", interleave=-1)


def test_report_without_interleaving_has_no_such_section(tmp_path):
    assert "Timed in alternation" not in render_report([_rec("amp", None, ["amp"])], tmp_path / "r.md").read_text()


def test_isolated_runs_interleave_in_a_process_of_their_own(tmp_path):
    """On a GPU stages run isolated; the interleaved phase then runs as `python -m workbench.ladder.interleave`,
    its timings coming back through a JSON file (the path the H200 runs take)."""
    run = dict(model=TINY_MODEL, batch=2, steps=1, warmup=0, device="cpu", progress=False)
    result = run_apply("amp", **run, stages=["baseline", "amp"], out_dir=tmp_path / "iso", interleave=1,
                       isolate=True, console=Console(record=True, width=160))
    logs = tmp_path / "iso" / "logs"
    assert (logs / "interleave.spec.json").exists() and (logs / "interleave.result.json").exists()
    stored = {r.stage: r.to_dict() for r in read_records([result.records_dir])}
    assert stored["amp"]["interleaved"]["previous_stage"] == "baseline"
    assert len(stored["baseline"]["interleaved"]["samples_ms"]) == 3


def test_rounds_handed_out_one_by_one_add_up_to_the_same_timings():
    """add_round rebuilds, from the per-round step times on_round hands out (the interleave process's
    "round" events), exactly what time_interleaved returns."""
    from workbench.ladder.interleave import add_round

    steps = {n: (lambda i: None) for n in ("a", "b")}
    seen, counts = {}, []
    out = time_interleaved(steps, rounds=3, block=2, warmup=0, device=CPU,
                           on_round=lambda r, samples: counts.append(add_round(seen, samples)))
    assert counts == [1, 2, 3] and seen == out


def _interrupted_after(real, rounds_done: int, exc: BaseException):
    def run(spec, emit):
        def relay(event):
            emit(event)
            if event.get("event") == "round" and event["i"] == rounds_done - 1:
                raise exc
        return real(spec, relay)
    return run


def test_an_interleave_that_stops_early_keeps_its_rounds_in_records_and_report(tmp_path, monkeypatch):
    import workbench.ladder.apply as apply_mod

    monkeypatch.setattr(apply_mod, "run_interleaved_spec",
                        _interrupted_after(apply_mod.run_interleaved_spec, 2, RuntimeError("out of time")))
    console = Console(file=None, record=True, width=200)
    run = dict(model=TINY_MODEL, batch=2, steps=1, warmup=0, device="cpu", progress=False)
    result = run_apply("amp", **run, stages=["baseline", "amp"], out_dir=tmp_path / "run", interleave=5,
                       console=console)
    stored = {r.stage: r.to_dict() for r in read_records([result.records_dir])}
    e = stored["amp"]["interleaved"]
    assert e["rounds"] == 2 and e["rounds_planned"] == 5 and len(e["round_median_ms"]) == 2
    assert "2 rounds (stopped early: 5 planned)" in result.report_path.read_text()
    assert "the 2 of 5 rounds timed before it stopped are in the records" in console.export_text()


def test_a_run_stopped_between_stages_leaves_a_report_of_those_finished(tmp_path, monkeypatch):
    """Ctrl-C (or a time limit) after the first stage: its record and a report of it are on disk."""
    import workbench.ladder.apply as apply_mod

    real, calls = apply_mod.run_stage, []

    def run_stage(spec, reference, on_event):
        calls.append(spec.stage)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(spec, reference, on_event)

    monkeypatch.setattr(apply_mod, "run_stage", run_stage)
    run = dict(model=TINY_MODEL, batch=2, steps=1, warmup=0, device="cpu", progress=False)
    with pytest.raises(KeyboardInterrupt):
        run_apply("amp", **run, stages=["baseline", "amp"], out_dir=tmp_path / "run",
                  console=Console(file=None, record=True, width=120))
    report = (tmp_path / "run" / "report.md").read_text()
    rows = [line.split("|")[1].strip() for line in report.splitlines() if line.startswith("| ")]
    assert "baseline" in rows and "amp" not in rows
