"""`apply --recipe auto`: the best configuration of the main chain that passes the gate, in its best
reproducible form (a graph-replayed form only where a <stage>-graph recipe replays it), the command that
reproduces it and its margin over the strongest PyTorch-alone peer; on the CPU, said to be a CPU figure."""
from __future__ import annotations

import io

import pytest
from rich.console import Console

from record_helpers import record
from workbench.ladder.apply import AUTO_LADDER, STAGES_LABEL, run_apply
from workbench.models import TINY_MODEL
from workbench.optimize.recipes import graph_recipes, plan_stages
from workbench.results.report import auto_choice, auto_choice_lines, best_form, render_report, speedup_table

GRAPHS = {"fmha": "fmha-graph", "dense": "dense-graph", "block": "block-graph"}
CHAIN = ["baseline", "amp", "apex", "window", "fmha", "dense", "block"]
# (stage, extends, eager ms, graph ms, PyTorch alone)
LADDER = [("baseline", None, 178.0, 177.0, True), ("amp", "baseline", 69.0, 66.0, True),
          ("apex", "amp", 91.0, 53.0, False), ("window", "apex", 98.0, 44.5, False),
          ("fmha", "window", 95.0, 24.6, False), ("dense", "fmha", 90.0, 23.9, False),
          ("block", "dense", 40.0, 23.0, False), ("torch-sdpa", "amp", 71.6, 54.8, True),
          ("torch-compile", "amp", 31.2, 29.2, True)]


def ladder(rows=LADDER, gpu=True, fail=(), recipe="block"):
    out = []
    for i, (stage, extends, eager, graph, alone) in enumerate(rows):
        rec = record(i, stage, extends, eager, gate="FAIL" if stage in fail else ("REFERENCE" if i == 0 else "PASS"))
        rec["recipe"] = recipe     # the run's recipe: its chain is the main one, the rest are peers
        rec["chain"] = [{"name": n, "source": None, "passes": []} for n in
                        (CHAIN[: CHAIN.index(stage) + 1] if stage in CHAIN else ["baseline", "amp", stage])]
        rec["pytorch_alone"] = alone
        if gpu:
            rec["graph"] = {"timing": {"samples_ms": [graph] * 4, "warmup": 5, "clock": "cuda-events",
                                       "median_ms": graph, "iqr_ms": 0.02, "repeats": 4},
                            "img_per_s": 64 / graph * 1e3, "step_ms": graph, "step_iqr_ms": 0.02,
                            "how": "the whole step captured once and replayed as one CUDA graph"}
        else:
            rec["env"] = {**rec["env"], "device_type": "cpu", "gpu": None}
            rec["device"] = "cpu"
        out.append(rec)
    return out


def test_the_graph_recipes_are_the_stages_they_replay():
    # the compiled stages' graph forms have their recipes too (a default-mode compiled step is captured like an
    # eager one)
    assert graph_recipes() == {**GRAPHS, "fmha-compile": "fmha-compile-graph", "torch-compile": "torch-compile-graph"}


def test_auto_picks_the_fastest_stage_in_its_best_reproducible_form():
    choice = auto_choice(ladder(), GRAPHS)
    assert (choice["stage"], choice["form"], choice["recipe"]) == ("block", "graph-replayed", "block-graph")
    assert choice["ms"] == 23.0 and choice["x_baseline"] == pytest.approx(177.0 / 23.0)
    assert (choice["peer"], choice["peer_form"]) == ("torch-compile", "graph-replayed")
    assert choice["x_peer"] == pytest.approx(29.2 / 23.0)
    assert choice["command"] == "swinbench apply --stages block-graph --model swin_tiny_patch4_window7_224 --batch 64"
    assert choice["api"] == 'optimize_swin(model, "block-graph")' and not choice["cpu"]
    text = "\n".join(auto_choice_lines(choice))
    assert "**block-graph** (block, graph-replayed): 23.00 ms" in text and "1.27x faster than" in text
    assert "CPU figure" not in text


def test_a_graph_form_without_a_recipe_does_not_count():
    # amp replayed is fastest, but no recipe replays amp: the choice is a form swinbench reproduces
    rows = [(s, e, eager, 10.0 if s == "amp" else graph, alone) for s, e, eager, graph, alone in LADDER]
    choice = auto_choice(ladder(rows), GRAPHS)
    assert choice["recipe"] == "block-graph"
    assert best_form(ladder(rows), speedup_table(ladder(rows)), among="main")["stage"] == "amp"   # without the filter


def test_a_stage_that_fails_the_gate_is_never_chosen():
    choice = auto_choice(ladder(fail=("block",)), GRAPHS)
    assert (choice["stage"], choice["recipe"]) == ("dense", "dense-graph")


def test_eager_best_and_a_faster_peer_are_said():
    rows = [(s, e, eager, graph, alone) for s, e, eager, graph, alone in LADDER if s not in ("dense", "block")]
    rows = [(s, e, 20.0 if s == "torch-compile" else eager, 20.0 if s == "torch-compile" else graph, alone)
            for s, e, eager, graph, alone in rows]
    choice = auto_choice(ladder(rows, recipe="fmha"), {})          # no graph recipes: eager forms only
    assert (choice["stage"], choice["form"], choice["recipe"]) == ("amp", "as written", "amp")
    assert "slower than the strongest PyTorch-alone peer, torch-compile" in "\n".join(auto_choice_lines(choice))


def test_on_the_cpu_the_choice_is_a_cpu_figure(tmp_path):
    rows = [(s, e, eager, None, alone) for s, e, eager, _, alone in LADDER[:5]]
    recs = ladder(rows, gpu=False, recipe="fmha")
    choice = auto_choice(recs, GRAPHS)
    assert (choice["stage"], choice["form"], choice["cpu"], choice["device"]) == ("amp", "as written", True, "CPU")
    assert choice["command"].endswith("--device cpu") and choice["peer"] is None
    lines = auto_choice_lines(choice)
    assert any("CPU figure" in line for line in lines) and any("no PyTorch-alone peer" in line for line in lines)
    text = render_report(recs, tmp_path / "report.md", auto=choice).read_text()
    assert "## Best configuration (`--recipe auto`)" in text and "This is a CPU figure" in text


def test_auto_plans_the_block_ladder_with_peers_on_a_gpu():
    plans = [p.name for p in plan_stages(AUTO_LADDER["cuda"], peers=True)]
    assert plans[:7] == CHAIN and "torch-compile" in plans and "torch-sdpa" in plans


def test_apply_auto_end_to_end_on_the_cpu(tmp_path):
    console = Console(file=io.StringIO(), width=240)
    result = run_apply("auto", model=TINY_MODEL, batch=2, steps=1, warmup=0, device="cpu", progress=False,
                       interleave=0, out_dir=tmp_path / "auto", stages=["baseline", "amp"], console=console)
    out = console.file.getvalue()
    # the stages ran, not this machine's ladder (fmha here, block on a GPU): named as --stages alone names them
    assert result.run_id.startswith("auto-") and {r["recipe"] for r in result.records} == {STAGES_LABEL}
    assert result.auto is not None and result.auto["stage"] in ("baseline", "amp") and result.auto["cpu"]
    assert f"Reproduce it: swinbench apply --stages {result.auto['recipe']}" in out and "CPU figure" in out
    assert "## Best configuration (`--recipe auto`)" in result.report_path.read_text()
    # `swinbench report` on the run's records writes the choice again
    from workbench.optimize.recipes import graph_recipes
    from workbench.results.report import render_report_from_paths

    again = render_report_from_paths([result.records_dir], tmp_path / "again.md", graph_recipes())
    assert "## Best configuration (`--recipe auto`)" in again.read_text()
