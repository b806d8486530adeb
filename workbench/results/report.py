"""Reports from stored stage records only (never a model, never a trace): the speedup table (terminal
and Markdown share `speedup_table`), and the Markdown report a reader wants on a pull request. A profiled
stage's timeline.png is linked, not opened: the record says where its stage drew it.

Every function takes stage records (`records.StageRecord`; dicts of records being built are validated
into them first). `speedup_table(records)` columns (one row per record, in stage order):
    run_id, stage, extends, status ('ok' | 'not available' | 'error'), gate ('PASS' | 'FAIL' |
    'REFERENCE' | 'SKIP'), precision, precision_label (the precision with a quantized stage's GEMM dtype),
    img_per_s, step_ms, step_iqr_ms, x_baseline, x_previous,
    peak_mem_bytes, compile_s, counted (bool: in the speedups), x_baseline_cross_run, x_previous_cross_run,
    previous_stage, model, device ('CPU' or the GPU's name), x_baseline_ns, x_previous_ns (bool: that speedup
    is not significant, see significance.py)
x_baseline = baseline step time / this stage's; x_previous = the same against the stage it extends
(for a peer such as torch-compile, that is amp), or, when that stage was not measured, against its
nearest measured ancestor in the stage's recipe chain (`swinbench apply --stages amp,fmha` compares fmha
with amp); previous_stage names the stage compared with. Both come from the stage's own run; when that
run has no such stage, from another run of the same model, mode, batch and GPU, and the *_cross_run flag
says so. Stages that FAIL the gate, are not available or ended in an error have no img/s-based speedups
(NaN): a fast wrong answer is not a speedup. Records of several models or devices in one table are
labelled "mixed" in the title, and each row then names its model and device.
"""
from __future__ import annotations

import io
import math
import os
from pathlib import Path

import pandas as pd

from workbench.analysis.frames import blocking_calls
from workbench.env import device_label
from workbench.errors import UserError
from workbench.files import atomic_write_bytes, atomic_write_text
from workbench.labels import GPU_WORDS, record_words
from workbench.results.record import (Interleaved, PairedRatio, StageRecord, as_records, read_distinct_records,
                                      read_records, short_dtype)
from workbench.results.significance import NS_MARK, NS_NOTE, paired_significant, speedup_significant

COLUMNS = ["run_id", "stage", "extends", "status", "gate", "precision", "precision_label", "img_per_s", "step_ms", "step_iqr_ms",
           "x_baseline", "x_previous", "peak_mem_bytes", "compile_s", "counted", "x_baseline_cross_run",
           "x_previous_cross_run", "previous_stage", "model", "device", "x_baseline_ns", "x_previous_ns",
           "graph_ms", "graph_iqr_ms", "graph_img_per_s", "x_baseline_graph", "x_previous_graph", "gpu_kernel_ms",
           "gpu_busy_pct", "pytorch_alone", "reused", "mode"]
# NVIDIA's Swin talk (Swin-L training): each rung's throughput over fp32, printed beside the ladder.
TALK_LADDER = {"amp": 1.63, "apex": 2.11, "window": 2.19, "fmha": 2.85}
TALK_NOTE = ("talk × fp32: the same rung in NVIDIA's Swin talk (Swin-L training, throughput over fp32), "
             "for reference")
# A rung whose GPU is busy less than this share of its eager step is bound by the host launching kernels.
HOST_BOUND_BUSY_PCT = 90.0
CROSS_RUN_MARK = "†"
CROSS_RUN_NOTE = (f"{CROSS_RUN_MARK} against that stage in another run of the same model, batch and GPU (another "
                  "process, minutes apart): the run of this stage had no such stage of its own.")


def _counted(rec: StageRecord) -> bool:
    return rec.ok and rec.step_ms is not None and rec.gate.status in ("PASS", "REFERENCE")


def speedup_table(records) -> pd.DataFrame:
    """One row per stage record with its throughput and speedups (see the module docstring for columns)."""
    records = as_records(records)
    rows = []
    for rec in records:
        rows.append({
            "run_id": rec.run_id, "stage": rec.stage, "extends": rec.extends, "status": rec.status,
            "gate": rec.gate.status, "precision": rec.precision, "precision_label": rec.precision_label,
            "img_per_s": rec.img_per_s, "step_ms": rec.step_ms,
            "step_iqr_ms": rec.step_iqr_ms, "peak_mem_bytes": rec.peak_mem_bytes, "compile_s": rec.compile_s,
            "counted": _counted(rec), "model": rec.model, "device": rec.env.device_name, "mode": rec.mode,
            "graph_ms": rec.graph.step_ms if rec.graph else math.nan,
            "graph_iqr_ms": rec.graph.step_iqr_ms if rec.graph else math.nan,
            "graph_img_per_s": rec.graph.img_per_s if rec.graph else math.nan,
            "gpu_kernel_ms": rec.gpu_time.kernel_ms if rec.gpu_time else math.nan,
            "gpu_busy_pct": rec.gpu_time.busy_pct if rec.gpu_time else math.nan,
            "pytorch_alone": bool(rec.pytorch_alone), "reused": rec.reused is not None,
        })
    derived = ("x_baseline", "x_previous", "previous_stage")   # the _ns and _graph columns start with these too
    df = pd.DataFrame(rows, columns=[c for c in COLUMNS if not c.startswith(derived)])
    df["x_baseline_graph"] = math.nan
    df["x_previous_graph"] = math.nan
    df["x_baseline"] = math.nan
    df["x_previous"] = math.nan
    df["x_baseline_cross_run"] = False
    df["x_previous_cross_run"] = False
    df["previous_stage"] = None
    df["x_baseline_ns"] = False
    df["x_previous_ns"] = False
    # Speedups compare stages of one run; a stage whose run lacks the baseline (or the stage it extends)
    # is compared with that stage of another run of the same workload on the same GPU, and marked.
    # a group: one run's records of one workload (a run resumed on another GPU holds two)
    groups = [(rec.run_id, _workload(rec)) for rec in records]
    steps_by_group: dict = {}   # group -> stage -> (median ms, IQR ms, timed steps)
    for idx, r in enumerate(df.itertuples()):
        if r.counted:
            steps_by_group.setdefault(groups[idx], {}).setdefault(r.stage, _spread(records[idx], r))

    def lookup(group, stage, other_runs=True):
        if stage in steps_by_group.get(group, {}):
            return steps_by_group[group][stage], False
        for other, steps in steps_by_group.items():
            if other_runs and other[0] != group[0] and other[1] == group[1] and stage in steps:
                return steps[stage], True
        return None, False

    for idx, r in df.iterrows():
        if not r.counted:
            continue
        mine = _spread(records[idx], r)
        group = groups[idx]
        base, cross_b = lookup(group, "baseline")
        if base:
            df.at[idx, "x_baseline"] = base[0] / r.step_ms
            df.at[idx, "x_baseline_cross_run"] = cross_b
            # the baseline against itself is 1.00x by definition, not a measurement
            if not (r.stage == "baseline" and not cross_b):
                df.at[idx, "x_baseline_ns"] = not speedup_significant(*mine, *base)
        # the nearest ancestor measured in the stage's own run; another run's only where its run has none
        ancestors = list(records[idx].ancestors())
        for ancestor, other_runs in [(a, False) for a in ancestors] + [(a, True) for a in ancestors]:
            prev, cross_p = lookup(group, ancestor, other_runs)
            if prev:
                df.at[idx, "x_previous"] = prev[0] / r.step_ms
                df.at[idx, "x_previous_cross_run"] = cross_p
                df.at[idx, "previous_stage"] = ancestor
                df.at[idx, "x_previous_ns"] = not speedup_significant(*mine, *prev)
                break
    # the same speedups between the graph-replayed forms of the stages (same run only)
    graph_ms = {(groups[i], r.stage): r.graph_ms for i, r in enumerate(df.itertuples())
                if r.counted and _isnum(r.graph_ms)}
    for idx, r in df.iterrows():
        group = groups[idx]
        if (group, r.stage) not in graph_ms:
            continue
        base = graph_ms.get((group, "baseline"))
        if base:
            df.at[idx, "x_baseline_graph"] = base / r.graph_ms
        prev = graph_ms.get((group, r.previous_stage)) if r.previous_stage else None
        if prev:
            df.at[idx, "x_previous_graph"] = prev / r.graph_ms
    return df[COLUMNS]


def has_graph_columns(df: pd.DataFrame) -> bool:
    """Whether any stage was also timed with its step replayed as a CUDA graph (the two-column layout)."""
    return bool(df["graph_ms"].notna().any())


def host_bound_stages(records, df: pd.DataFrame) -> list[tuple[str, float]]:
    """(stage, GPU busy %) of the counted stages whose eager step keeps the GPU busy less than
    HOST_BOUND_BUSY_PCT of the time: bound by the host launching kernels."""
    return [(r.stage, r.gpu_busy_pct) for r in df.itertuples()
            if r.counted and _isnum(r.gpu_busy_pct) and r.gpu_busy_pct < HOST_BOUND_BUSY_PCT]


def headline_text(records, df: pd.DataFrame) -> str | None:
    """Which speedup columns are the headline and why (None without graph columns)."""
    if not has_graph_columns(df):
        return None
    bound = host_bound_stages(records, df)
    if bound:
        listed = ", ".join(f"{stage} {busy:.0f}%" for stage, busy in bound)
        return (f"Headline: the graph columns. As written, these stages keep the GPU busy less than "
                f"{HOST_BOUND_BUSY_PCT:.0f}% of their step ({listed}): the host launching kernels bounds them, so a "
                "rung that saves GPU time can show none there. Replaying each step as one CUDA graph takes the "
                "host's launch cost out and shows what each rung saves on the GPU; GPU ms (the kernel time of "
                "the step as written) agrees with it.")
    return ("Headline: the eager columns: every stage keeps the GPU busy at least "
            f"{HOST_BOUND_BUSY_PCT:.0f}% of its step as written, so its step time is the GPU's; the graph "
            "columns show what replaying it as one CUDA graph adds.")


def best_form(records, df: pd.DataFrame, among: str = "last", graph_recipes: dict[str, str] | None = None,
              require_graph: bool = True) -> dict | None:
    """The fastest counted measurement (eager or graph-replayed) of the stages `among` names, against the
    strongest PyTorch-alone peer -> {stage, form, ms, x_baseline, peer, peer_form, peer_ms, x_peer}; peer:
    the fastest PyTorch-alone peer stage in either form (None without one).

    among='last': the fused stack in its best form: the last main-chain stage that runs swinbench kernels,
    or a stage that extends it (a compiled form); in a --stages run, which names no chain, every stage that
    runs swinbench kernels (its peers then: the PyTorch-alone stages none of them builds on); None without
    graph columns unless `require_graph` is False (then the eager forms alone compete, as on the CPU). among='main': every stage of
    the run's main chain that passed the gate (the baseline and PyTorch-alone rungs such as amp included,
    peers not), with or without graph columns: the best configuration the ladder measured. graph_recipes
    ({stage: recipe that replays it as one CUDA graph}): with it, a graph-replayed form counts only for the
    stages it names (a form a recipe reproduces). None when no stage qualifies."""
    if among not in ("last", "main"):
        raise ValueError(f"among must be 'last' or 'main', got {among!r}")
    if among == "last" and require_graph and not has_graph_columns(df):
        return None
    records = as_records(records)
    runs = _distinct(r.run_id for r in records)
    if len(runs) > 1:     # each run's best form against its own stages; the fastest of them
        found = [best_form([r for r in records if r.run_id == run], df[df["run_id"] == run], among, graph_recipes,
                           require_graph) for run in runs]
        found = [b for b in found if b is not None]
        return min(found, key=lambda b: b["ms"]) if found else None
    counted = {r.stage: r for r in df.itertuples() if r.counted and (not runs or r.run_id == runs[0])}
    # a --stages run names no chain: where it measured swinbench stages, a PyTorch-alone stage that none
    # of them builds on is a peer
    built_on = {c.name for rec in records if not rec.pytorch_alone for c in rec.chain}
    chained = any(rec.stage == rec.recipe for rec in records) or not built_on
    if chained:
        is_peer = lambda rec: _is_peer(rec, records)     # noqa: E731
    else:
        is_peer = lambda rec: rec.pytorch_alone and rec.stage not in built_on     # noqa: E731
    if among == "main":
        family = [rec for rec in records if rec.stage in counted and not is_peer(rec)]
    else:
        fused = [rec for rec in records if rec.stage in counted and not rec.pytorch_alone]
        if not fused:
            return None
        if chained:
            main = [rec for rec in fused if not is_peer(rec)]
            top = (main or fused)[-1]
            family = [rec for rec in fused if rec is top or rec.extends == top.stage]
        else:   # the fastest of the swinbench stages it measured
            family = fused
    if not family:
        return None
    forms = []
    for rec in family:
        r = counted[rec.stage]
        forms.append((r.step_ms, rec.stage, "as written"))
        replayable = graph_recipes is None or rec.stage in graph_recipes
        if _isnum(r.graph_ms) and r.graph_ms != r.step_ms and replayable:
            forms.append((r.graph_ms, rec.stage, "graph-replayed"))
    ms, stage, form = min(forms)
    base = counted.get("baseline")
    base_ms = None
    if base is not None:    # the same column as the winner's: graph-replayed against the baseline's graph
        base_ms = base.graph_ms if form == "graph-replayed" and _isnum(base.graph_ms) else base.step_ms
    out = {"stage": stage, "form": form, "ms": ms, "x_baseline": base_ms / ms if base_ms else None,
           "peer": None, "peer_form": None, "peer_ms": None, "x_peer": None}
    peers = []
    for rec in records:
        r = counted.get(rec.stage)
        if r is None or not rec.pytorch_alone or rec.stage == "baseline" or not is_peer(rec):
            continue
        peers.append((r.step_ms, rec.stage, "as written"))
        if _isnum(r.graph_ms) and r.graph_ms != r.step_ms:
            peers.append((r.graph_ms, rec.stage, "graph-replayed"))
    if peers:
        peer_ms, peer, peer_form = min(peers)
        out.update(peer=peer, peer_form=peer_form, peer_ms=peer_ms, x_peer=peer_ms / ms)
    return out


def auto_choice(records, graph_recipes: dict[str, str] | None = None) -> dict | None:
    """What `apply --recipe auto` recommends: the best configuration of the run's main chain that passed
    the gate (best_form among='main'), with the recipe and command that reproduce it. graph_recipes:
    {stage: the recipe replaying that stage as one CUDA graph} (fmha -> fmha-graph); a graph-replayed form
    counts only where one exists. -> best_form's keys plus recipe, command, api, model, mode, batch,
    device (the GPU's name or 'CPU'), cpu (bool: the figures are CPU ones) and not_significant (bool: an
    eager choice whose speedup over the baseline is within the spread, significance.py); None when no
    stage of the main chain was measured and passed."""
    records = as_records(records)
    graph_recipes = dict(graph_recipes or {})
    df = speedup_table(records)
    best = best_form(records, df, among="main", graph_recipes=graph_recipes)
    if best is None:
        return None
    rec = next(r for r in records if r.stage == best["stage"])
    row = df[df["stage"] == rec.stage].iloc[0]
    # as written, a speedup over the baseline within the spread of the step times may be noise
    noisy = best["form"] == "as written" and rec.stage != "baseline" and bool(row["x_baseline_ns"])
    recipe = graph_recipes[rec.stage] if best["form"] == "graph-replayed" else rec.stage
    cpu = not rec.env.on_gpu
    command = (f"swinbench apply --stages {recipe} --model {rec.model} --batch {rec.batch}"
               + (" --mode infer" if rec.mode == "infer" else "") + (" --device cpu" if cpu else ""))
    return {**best, "recipe": recipe, "command": command, "api": f'optimize_swin(model, "{recipe}")',
            "model": rec.model, "mode": rec.mode, "batch": rec.batch, "device": rec.env.device_name, "cpu": cpu,
            "not_significant": noisy}


def auto_choice_lines(choice: dict) -> list[str]:
    """The auto choice in words (Markdown bold marks the recipe), one item a line: what is best, how to
    reproduce it, its margin over the strongest PyTorch-alone peer; on the CPU, that it is a CPU figure."""
    c = choice
    where = f"{c['model']} {c['mode']}, batch {c['batch']}, {c['device']}"
    over = f", {c['x_baseline']:.2f}x over the baseline" if c["x_baseline"] else ""
    form = c["form"] if c["recipe"] == c["stage"] else f"{c['stage']}, {c['form']}"
    lines = [f"Best configuration that passes the gate ({where}): **{c['recipe']}** ({form}): "
             f"{c['ms']:.2f} ms per step ({c['batch'] / c['ms'] * 1e3:,.1f} img/s){over}"
             + (f" ({NS_MARK}: within the spread of the step times; more --steps would settle it)"
                if c.get("not_significant") else "") + "."]
    lines.append(f"Reproduce it: `{c['command']}`; in your own loop: `{c['api']}`.")
    if c["peer"]:
        if c["x_peer"] >= 1:
            verdict = f"{c['x_peer']:.2f}x faster than"
        else:
            verdict = f"{1 / c['x_peer']:.2f}x slower than"
        lines.append(f"Margin: {verdict} the strongest PyTorch-alone peer, {c['peer']} {c['peer_form']} "
                     f"({c['peer_ms']:.2f} ms).")
    else:
        lines.append("Margin over PyTorch alone: no PyTorch-alone peer was measured in this run.")
    if c["cpu"]:
        lines.append("This is a CPU figure: it shows the workflow, not which recipe is fastest on a GPU; run "
                     "`swinbench apply --recipe auto` on the GPU for that.")
    return lines


def _is_peer(rec: StageRecord, records: list[StageRecord]) -> bool:
    """Whether a stage sits beside the run's main chain rather than on it: the run's recipe chain is the
    chain of the stage named like the recipe (or of the last stage), and a stage outside it is a peer."""
    target = next((r for r in records if r.stage == r.recipe), None)
    if target is None:
        return False
    return rec.stage not in {c.name for c in target.chain}


def _spread(rec: StageRecord, row) -> tuple:
    """(median step ms, IQR ms, timed steps or None) of a record, for significance.speedup_significant."""
    timing = rec.timing
    steps = (timing.repeats or len(timing.samples_ms) or None) if timing is not None else None
    return row.step_ms, row.step_iqr_ms, steps


# ---------------------------------------------------------------- formatting helpers


def _isnum(x) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def fmt_bytes(n) -> str:
    return f"{n / 2**30:.2f} GiB" if _isnum(n) else "-"


def fmt_speedup(x) -> str:
    return f"{x:.2f}x" if _isnum(x) else "-"


def fmt_step(ms, iqr) -> str:
    return f"{ms:.2f} ± {iqr:.2f}" if _isnum(ms) else "-"


def fmt_rate(x) -> str:
    return f"{x:,.1f}" if _isnum(x) else "-"


def gate_cell(row) -> str:
    if row["status"] != "ok":
        return row["status"]
    return row["gate"]


def _per_row_labels(df: pd.DataFrame) -> bool:
    """Whether the table mixes models or devices, so that each row must name its own."""
    return df["model"].nunique() > 1 or df["device"].nunique() > 1


def table_headers(df: pd.DataFrame) -> list[str]:
    """HEADERS (GRAPH_HEADERS when stages were also timed graph-replayed), with model and device after
    the stage when the table mixes them."""
    headers = GRAPH_HEADERS if has_graph_columns(df) else HEADERS
    return headers[:1] + ["model", "device"] + headers[1:] if _per_row_labels(df) else list(headers)


PEER_LABEL = " (PyTorch alone)"
REUSED_MARK = "‡"
REUSED_NOTE = (f"{REUSED_MARK} reused: measured by an earlier run under the same conditions (GPU, driver, "
               "versions, swinbench code, steps), not run again; `apply --fresh` measures it again.")


def _graph_display_rows(df: pd.DataFrame, records: list[StageRecord] | None) -> list[list[str]]:
    """The two-column layout: each stage as written (eager) and with its step replayed as one CUDA
    graph, its GPU kernel time, the talk's figure for its rung; the best form of the fused stack after
    the main chain, and the PyTorch-alone peers after that, marked."""
    multi = df["run_id"].nunique() > 1
    labels = _per_row_labels(df)
    out = []
    best = best_form(records, df) if records is not None else None
    main_names = set()
    if records is not None:
        main_names = {r.stage for r in records if not _is_peer(r, records)}
    last_main = max((i for i, r in enumerate(df.itertuples()) if r.stage in main_names), default=None)
    for i, (_, r) in enumerate(df.iterrows()):
        stage = r["stage"] + (f" ({r['run_id']})" if multi else "")
        if r["pytorch_alone"] and r["stage"] != "baseline" and r["stage"] not in main_names:
            stage += PEER_LABEL
        if r["reused"]:
            stage += f" {REUSED_MARK}"
        xp, gp = fmt_speedup(r["x_previous"]), fmt_speedup(r["x_previous_graph"])
        xp += CROSS_RUN_MARK if r["x_previous_cross_run"] else ""
        xp += f" ({NS_MARK})" if _isnum(r["x_previous"]) and r["x_previous_ns"] else ""
        if _isnum(r["x_previous"]) and r["previous_stage"] != r["extends"]:
            xp += f" (vs {r['previous_stage']})"
            gp += f" (vs {r['previous_stage']})" if _isnum(r["x_previous_graph"]) else ""
        xb = fmt_speedup(r["x_baseline"]) + (CROSS_RUN_MARK if r["x_baseline_cross_run"] else "")
        xb += f" ({NS_MARK})" if _isnum(r["x_baseline"]) and r["x_baseline_ns"] else ""
        gpu = (f"{r['gpu_kernel_ms']:.1f} ({r['gpu_busy_pct']:.0f}%)" if _isnum(r["gpu_kernel_ms"]) else "-")
        talk = fmt_speedup(TALK_LADDER.get(r["stage"]) if _talk_applies(df) else None)
        out.append([stage, *([r["model"], r["device"]] if labels else []), r["precision_label"] or "-",
                    fmt_step(r["step_ms"], r["step_iqr_ms"]), xb, xp,
                    fmt_step(r["graph_ms"], r["graph_iqr_ms"]), fmt_speedup(r["x_baseline_graph"]), gp,
                    gpu, talk, fmt_bytes(r["peak_mem_bytes"]), gate_cell(r)])
        if best is not None and i == last_main:
            cells = ["-"] * 6
            at = 0 if best["form"] == "as written" else 3
            cells[at], cells[at + 1] = f"{best['ms']:.2f}", fmt_speedup(best["x_baseline"])
            out.append([f"best form: {best['stage']}, {best['form']}", *(["", ""] if labels else []), "",
                        *cells, "", "", "", ""])
    return out


def display_rows(df: pd.DataFrame, records=None) -> list[list[str]]:
    """The table as strings, as both the terminal and the Markdown show it (columns: table_headers(df)).
    records: the StageRecords of df, for the best-form row of the two-column layout."""
    if has_graph_columns(df):
        return _graph_display_rows(df, as_records(records) if records is not None else None)
    multi = df["run_id"].nunique() > 1
    labels = _per_row_labels(df)
    out = []
    for _, r in df.iterrows():
        stage = r["stage"] + (f" ({r['run_id']})" if multi else "")
        xb = fmt_speedup(r["x_baseline"]) + (CROSS_RUN_MARK if r["x_baseline_cross_run"] else "")
        xp = fmt_speedup(r["x_previous"]) + (CROSS_RUN_MARK if r["x_previous_cross_run"] else "")
        xb += f" ({NS_MARK})" if _isnum(r["x_baseline"]) and r["x_baseline_ns"] else ""
        xp += f" ({NS_MARK})" if _isnum(r["x_previous"]) and r["x_previous_ns"] else ""
        if _isnum(r["x_previous"]) and r["previous_stage"] != r["extends"]:
            xp += f" (vs {r['previous_stage']})"
        out.append([stage, *([r["model"], r["device"]] if labels else []), r["precision_label"] or "-",
                    fmt_rate(r["img_per_s"]), fmt_step(r["step_ms"], r["step_iqr_ms"]),
                    xb, xp, fmt_bytes(r["peak_mem_bytes"]), gate_cell(r)])
    return out


HEADERS = ["stage", "precision", "img/s", "step ms (median ± IQR)", "× baseline", "× previous", "peak memory", "gate"]
GRAPH_HEADERS = ["stage", "precision", "eager ms (median ± IQR)", "eager × baseline", "eager × previous",
                 "graph ms (median ± IQR)", "graph × baseline", "graph × previous", "GPU ms (busy)", "talk × fp32",
                 "peak memory", "gate"]
NUMERIC_HEADERS = {"img/s", "step ms (median ± IQR)", "× baseline", "× previous", "peak memory",
                   *GRAPH_HEADERS[2:-1]}


def render_speedup_table(records, console) -> None:
    """The speedup table in the terminal (rich)."""
    from rich.table import Table

    records = as_records(records)
    df = speedup_table(records)
    table = Table(title=_title(records), title_justify="left")
    for h in table_headers(df):
        table.add_column(h, justify="right" if h in NUMERIC_HEADERS else "left")
    for row in display_rows(df, records):
        style = {"FAIL": "red", "error": "red", "not available": "yellow"}.get(row[-1])
        if row[0].startswith("best form"):
            style = "bold"
        table.add_row(*row, style=style)
    console.print(table)
    for line in _ladder_lines(records, df):
        console.print(line.replace("**", ""), highlight=False)
    console.print("× previous: against the stage it extends (or, named, its nearest measured ancestor); "
                  "FAIL / not available / error stages are not in the speedups.")
    if (df["x_baseline_cross_run"] | df["x_previous_cross_run"]).any():
        console.print(CROSS_RUN_NOTE)
    if _any_not_significant(records, df):
        console.print(NS_NOTE)
    timed = [r for r in records if r.interleaved is not None]
    spread = [r.stage for r in records if _spread_note(r)]
    if spread and not timed and not has_graph_columns(df):
        console.print(f"{', '.join(spread)}: step times spread widely (likely bound by the host); their ratios depend "
                      "on this machine's load: --interleave N times the stages again in alternation")
    if timed:
        e0 = timed[0].interleaved
        console.print(f"timed in alternation ({_rounds_text(e0)} of {e0.block} steps, one process), paired: "
                      + "; ".join(f"{r.stage} {r.interleaved.step_ms:.2f} ms"
                                  + (f", {_ratio_cell(r.interleaved.x_previous, r.interleaved.previous_stage, r.interleaved.rounds)}"
                                     if r.interleaved.x_previous is not None else "")
                                  for r in timed))
    w = record_words(records)
    what = f"{w.device} {w.op}"
    for rec, parent_rec, table in kernel_changes(records, rows=3):
        stage, parent = rec.stage, parent_rec.stage
        moved = ", ".join(f"{k[:48]} {d:+.2f}" for k, d in table[["kernel", "delta_ms"]].values)
        console.print(f"{stage} against {parent}, largest {what} changes (ms per step): {moved}")


def _talk_applies(df: pd.DataFrame) -> bool:
    """The talk's ladder is of training steps: it is printed beside training runs only."""
    return bool((df["mode"] == "train").all()) if "mode" in df else False


def _ladder_lines(records: list[StageRecord], df: pd.DataFrame) -> list[str]:
    """What the two-column table needs said under it: which columns are the headline and why, the best
    form of the fused stack against the strongest PyTorch-alone peer, the talk's ladder, reuse."""
    lines = []
    headline = headline_text(records, df)
    if headline:
        lines.append(headline)
    # one best form per workload: a form of one model, mode, batch and device is never set against another's
    workloads = _distinct(_workload(r) for r in records)
    for workload in workloads:
        mine = [r for r in records if _workload(r) == workload]
        best = best_form(mine, df[df["run_id"].isin({r.run_id for r in mine})])
        if best is None:
            continue
        batch = mine[0].batch
        model, mode, _, device = workload[:4]
        whose = (f"{model}, {'inference' if mode == 'infer' else 'training'}, batch {batch}, {device}: "
                 if len(workloads) > 1 else "")
        line = (f"**{whose}Fused stack, best form: {best['stage']}, {best['form']}: {best['ms']:.2f} ms per step "
                f"({batch / best['ms'] * 1e3:,.0f} img/s)"
                + (f", {best['x_baseline']:.2f}x over fp32" if best["x_baseline"] else "") + "**")
        if best["peer"]:
            verdict = "faster" if best["x_peer"] > 1 else "slower: not a win"
            line += (f"; the strongest PyTorch-alone peer, {best['peer']} {best['peer_form']}, takes "
                     f"{best['peer_ms']:.2f} ms: the fused stack is {best['x_peer']:.2f}x {verdict}.")
        lines.append(line)
    if has_graph_columns(df) and _talk_applies(df) and any(s in TALK_LADDER for s in df["stage"]):
        lines.append(TALK_NOTE + ".")
    if df["reused"].any():
        lines.append(REUSED_NOTE)
    for rec in records:
        if rec.graph is None and rec.graph_note and rec.ok and has_graph_columns(df):
            lines.append(f"{rec.stage}: no graph timing: {rec.graph_note}")
    return lines


def _any_not_significant(records: list[StageRecord], df: pd.DataFrame) -> bool:
    """Whether any speedup shown (the table's, or a paired one) is marked n.s."""
    shown = (df["x_baseline_ns"] & df["x_baseline"].notna()) | (df["x_previous_ns"] & df["x_previous"].notna())
    paired = any(NS_MARK in _ratio_cell(ratio, rounds=e.rounds)
                 for r in records if (e := r.interleaved) is not None
                 for ratio in (e.x_first if r.stage != e.first_stage else None, e.x_previous) if ratio is not None)
    return bool(shown.any()) or paired


def _md_table(headers: list[str], rows: list[list]) -> str:
    esc = lambda v: str(v).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(map(esc, headers)) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
    return "\n".join(lines)


_LAUNCHERS = {"cached": "cached launcher (workbench.kernels._common.CachedLauncher)",
              "triton": "Triton's kernel[grid] launcher", "interpreter": "Triton's CPU interpreter"}


def _distinct(values) -> list:
    return list(dict.fromkeys(values))


def _workload(rec: StageRecord) -> tuple:
    """What a record measured: (model, mode, batch, device, image size, trained weights); speedups stay
    within one."""
    return rec.model, rec.mode, rec.batch, rec.env.device_name, rec.shape_label, rec.weights


def _is_cpu(records: list[StageRecord]) -> bool:
    """Every record measured on the CPU."""
    return all(not r.env.on_gpu for r in records)


def run_label(records) -> str:
    """What the run ran, for titles: the recipe's name when the records hold its whole chain (the default
    `apply`, peers included), else the stages themselves ('baseline, amp' for `--stages baseline,amp`).
    Takes StageRecords or the dicts apply holds."""
    records = as_records(records)
    recipe = str(records[0].recipe)
    stages = [r.stage for r in records]
    target = next((r for r in records if r.stage == recipe
                   or (r.recipe_source and Path(r.recipe_source) == Path(recipe))), None)
    chain = [c.name for c in target.chain] if target is not None else []
    if target is not None and all(name in stages for name in chain):
        return recipe
    return ", ".join(stages)


# the first line of every report.md: what `swinbench report --out` may write over
REPORT_HEADING = "# swinbench apply:"


def _title(records: list[StageRecord]) -> str:
    """What the table holds; a setting that differs between records is called mixed (the rows then name
    their model and device)."""
    models = _distinct(r.model for r in records)
    devices = _distinct(r.env.device_name for r in records)
    modes = _distinct("inference" if r.mode == "infer" else "training" for r in records)
    batches = _distinct(r.batch for r in records)
    if _is_cpu(records):
        where = "CPU — not a GPU speed figure"
    elif len(devices) == 1:
        where = devices[0]
    else:
        where = f"mixed devices ({', '.join(devices)}; per row)" + (" — CPU rows are not GPU speed figures"
                                                                   if "CPU" in devices else "")
    model = models[0] if len(models) == 1 else "mixed models (per row)"
    sizes = _distinct("x".join(map(str, r.img_size)) if r.img_size else "" for r in records)
    if len(models) == 1 and len(sizes) == 1 and sizes[0]:
        model += f" at {sizes[0]} px"
    mode = modes[0] if len(modes) == 1 else "mixed modes"
    batch = f"batch {batches[0]}" if len(batches) == 1 else f"batches {', '.join(map(str, batches))}"
    return f"{REPORT_HEADING[2:]} {run_label(records)} — {model}, {mode}, {batch}, {where}"


# ---------------------------------------------------------------- the Markdown report


def stage_label(rec: StageRecord, records: list[StageRecord]) -> str:
    """The stage's name, with its run's id where the records hold several runs (stage names repeat)."""
    several = len({r.run_id for r in records}) > 1
    return rec.stage + (f" ({rec.run_id})" if several else "")


def category_share_frame(records) -> pd.DataFrame:
    """Stages (rows, in order; labelled by stage_label) x kernel categories (columns), percent of GPU
    kernel time; empty when no stage was profiled. Columns are ordered by their largest share."""
    records = as_records(records)
    rows = {stage_label(r, records): r.profile.category_share_pct for r in records
            if r.profile is not None and r.profile.category_share_pct}
    if not rows:
        return pd.DataFrame()
    df = pd.DataFrame.from_dict(rows, orient="index").fillna(0.0)
    return df[df.max().sort_values(ascending=False).index]


def plot_category_shares(df: pd.DataFrame, path: Path, what: str = "GPU kernel time") -> Path:
    """A stacked horizontal bar per stage of category shares of `what` ('GPU kernel time', 'CPU op
    time'), written as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.5 * len(df) + 1.6))
    df.iloc[::-1].plot.barh(stacked=True, ax=ax, width=0.7, colormap="tab20")
    ax.set_xlabel(f"share of {what} (%)")
    ax.set_xlim(0, 100)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    return atomic_write_bytes(path, png.getvalue())


def _stage_pass_lines(rec: StageRecord) -> list[str]:
    """What the passes this stage adds (over the one it extends) changed, one line each."""
    own, done = rec.stage_passes, rec.passes
    tail = done[len(done) - len(own):] if own and len(done) >= len(own) else ()
    if not own:
        return ["no passes (the reference)"] if not rec.extends else ["no passes of its own"]
    if not tail:
        return [f"`{n}`: not applied ({rec.status})" for n in own]
    return [f"`{p.name}`: {p.changed}" for p in tail]


def activation_dtype_changes(records) -> list[str]:
    """One line per stage whose activations are kept in another dtype than those of the stage it extends
    (or its nearest ancestor in the run) at the same precision: a kernel swap that also changed precision."""
    records = as_records(records)
    by_key = {(r.run_id, r.stage): r for r in records if r.activation_dtypes}
    lines = []
    for rec in records:
        mine = rec.activation_dtypes
        if not mine:
            continue
        # the nearest ancestor in the stage's own run (stages repeat across runs)
        ref = next((by_key[(rec.run_id, a)] for a in rec.ancestors() if (rec.run_id, a) in by_key), None)
        if ref is None or ref.precision != rec.precision:
            continue
        theirs = ref.activation_dtypes
        diff = [f"{part} {short_dtype(theirs[part])} -> {short_dtype(d)}" for part, d in mine.items()
                if part in theirs and theirs[part] != d]
        if diff:
            lines.append(f"**{stage_label(rec, records)}** keeps activations in other dtypes than **{ref.stage}** "
                         f"at the same precision ({rec.precision}): {', '.join(diff)}. Part of its speed "
                         "(and of its error against the baseline) may come from that precision, not from the kernels.")
    return lines


def _activation_dtype_lines(records: list[StageRecord]) -> list[str]:
    recs = [r for r in records if r.activation_dtypes]
    if not recs:
        return []
    parts = list(dict.fromkeys(p for r in recs for p in r.activation_dtypes))
    rows = [[r.stage] + [short_dtype(r.activation_dtypes.get(p, "-")) for p in parts] for r in recs]
    lines = ["## Activation dtypes", "",
             "The output dtype of each part of the model in one forward under the stage's precision (the "
             "residual stream between stages; `layers.N` is stage N+1).", "",
             _md_table(["stage"] + parts, rows), ""]
    changes = activation_dtype_changes(records)
    if changes:
        lines += [f"- {c}" for c in changes] + [""]
    return lines


def _gate_rows(records: list[StageRecord]) -> list[list[str]]:
    rows = []
    for rec in records:
        g, m = rec.gate, rec.gate.metrics
        logits = m.logits.rel_l2 if m.logits is not None else None
        loss = m.loss.abs_diff if m.loss is not None else None
        grads = {k: v.rel_l2 for k, v in m.grads.items()}
        worst = max(grads.items(), key=lambda kv: -1 if kv[1] is None else kv[1], default=(None, None))
        f = lambda x: "-" if x is None else f"{x:.2e}"
        tol_txt = ", ".join(f"{k} {v:g}" for k, v in g.tolerance.items()) or "-"
        worst_txt = f"{f(worst[1])} ({worst[0]})" if worst[0] else "-"
        rows.append([rec.stage, g.status, rec.precision_label or "-", f(logits), f(loss), worst_txt, tol_txt, g.reason or ""])
    return rows


def kernel_ms_per_step(rec: StageRecord) -> float | None:
    """GPU kernel time per step from the stage's profile (None when it was not profiled)."""
    return rec.profile.kernel_ms_per_step if rec.profile is not None else None


def _slower_why(rec: StageRecord, records: list[StageRecord], previous: str) -> str:
    """Why a stage is slower than the stage it was compared with, from what was measured: if its GPU
    kernel time per step went down while the wall step went up, the step is host-bound (launch overhead)."""
    # the record speedup_table compared with: the stage's own run's, else one of the same workload
    same_run = [r for r in records if r.stage == previous and r.run_id == rec.run_id]
    parent = next(iter(same_run or [r for r in records if r.stage == previous and _workload(r) == _workload(rec)]),
                  None)
    mine, theirs = kernel_ms_per_step(rec), kernel_ms_per_step(parent) if parent else None
    if mine is None or theirs is None or rec.step_ms is None:
        return ": look at its passes above and its kernel shares before keeping it"
    if record_words([rec]).is_cpu:   # the launch-bound story below is about a GPU waiting on its host
        return f": its CPU op time per step went from {theirs:.1f} to {mine:.1f} ms (step {rec.step_ms:.1f} ms)"
    busy = 100.0 * mine / rec.step_ms
    if mine < theirs:
        return (f": its GPU kernel time per step fell from {theirs:.1f} to {mine:.1f} ms, but its step takes "
                f"{rec.step_ms:.1f} ms, the GPU busy {busy:.0f}% of it, so the step is bound by the host "
                "launching kernels (its fused kernels cost more host time per launch than the ops they "
                "replace); a CUDA graph (the fmha-graph stage) or torch.compile removes that cost")
    return f": its GPU kernel time per step rose from {theirs:.1f} to {mine:.1f} ms"


SPREAD_NOTE_FRACTION = 0.05  # GPU step times whose IQR exceeds this share of the median get a note


def _spread_note(rec: StageRecord, name: str | None = None) -> str | None:
    """A note for a GPU stage whose step times spread widely. Steady steps are bound by the GPU; eager
    steps bound by the host (launch overhead) vary with the CPU and whatever else runs on it."""
    timing = rec.timing
    if timing is None or timing.clock != "cuda-events" or len(timing.samples_ms) < 4:
        return None
    median, iqr, samples = timing.median_ms, timing.iqr_ms, timing.samples_ms
    if iqr <= SPREAD_NOTE_FRACTION * median:
        return None
    return (f"{name or rec.stage}: step times spread from {min(samples):.1f} to {max(samples):.1f} ms (IQR "
            f"{100.0 * iqr / median:.0f}% of the median): steps that vary this much are usually bound by the host "
            "launching kernels, so its figure depends on this machine's CPU and load; replaying the step as a "
            "CUDA graph (the -graph and -graphs stages) takes the host out"
            + ("" if rec.interleaved is not None else
               ", and `apply --interleave N` compares such stages in alternation, where the host's drift cancels"))


def _notes(records: list[StageRecord], df: pd.DataFrame) -> list[str]:
    notes = []
    by_stage = {(r.run_id, r.stage): r for r in df.itertuples()}
    for rec in records:
        r = by_stage.get((rec.run_id, rec.stage))
        name = stage_label(rec, records)
        if rec.status == "not available":
            notes.append(f"**{name}** not available: {rec.error}")
        elif rec.status == "error":
            notes.append(f"**{name}** ended in an error: {rec.error}")
        elif rec.gate.status == "FAIL":
            notes.append(f"**{name}** FAILED the correctness gate ({rec.gate.reason}); "
                         "it is left out of the speedups")
        if r is not None and _isnum(r.x_previous) and r.x_previous < 1.0:
            how = "the stage it extends" if r.previous_stage == rec.extends else "its nearest measured ancestor"
            previous = r.previous_stage + (f" {CROSS_RUN_MARK}" if r.x_previous_cross_run else "")
            if r.x_previous_ns:   # no reason is drawn from a difference the spread covers
                notes.append(f"**{name}** is slower than **{previous}**, {how} "
                             f"({r.x_previous:.2f}x, {NS_MARK}), by less than their step times spread: "
                             "not a measured slowdown")
            else:
                notes.append(f"**{name}** is slower than **{previous}**, {how} "
                             f"({r.x_previous:.2f}x)" + _slower_why(rec, records, r.previous_stage))
        spread = _spread_note(rec, name) if rec.graph is None else None   # the graph columns show it already
        if spread:
            notes.append(spread)
        for n in rec.notes:
            notes.append(f"{name}: {n}")
        if rec.compile_s is not None:
            notes.append(f"{name}: torch.compile took {rec.compile_s:.1f} s on its first step "
                         "(excluded from step times)")
    return notes


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _api_calls(rec: StageRecord, count) -> str:
    """count(api_calls_per_step) of the stage's capture, formatted ('-' when not recorded)."""
    per_step = rec.profile.api_calls_per_step if rec.profile is not None else None
    return f"{count(per_step):,.0f}" if per_step else "-"


def _busy(rec: StageRecord) -> str:
    mine = kernel_ms_per_step(rec)
    if mine is None or rec.step_ms is None:
        return "-"
    return f"{100.0 * mine / rec.step_ms:.0f}%"


KERNEL_CHANGE_ROWS = 6  # kernels listed per stage in the report's stage-to-stage changes


def kernel_changes(records, rows: int = KERNEL_CHANGE_ROWS) -> list[tuple[str, str, pd.DataFrame]]:
    """(record, the record it is compared with, the `rows` kernels whose GPU ms per step changed most) for
    every profiled stage whose nearest profiled ancestor of the same workload in `records` (the stage it
    extends, then that one's chain) has a per-kernel table too."""
    from workbench.analysis.diff import join_per_unit

    records = as_records(records)
    # a stage is held against an ancestor of its own workload only (never a CPU capture against a GPU one)
    profiled = {(_workload(r), r.stage): (r, f) for r in records
                if r.profile is not None and (f := r.profile.kernels_frame()) is not None}
    out = []
    for rec in records:
        mine = _workload(rec)
        if (mine, rec.stage) not in profiled:
            continue
        parent = next((a for a in rec.ancestors() if (mine, a) in profiled and a != rec.stage), None)
        if parent is not None:
            (parent_rec, before), (_, after) = profiled[mine, parent], profiled[mine, rec.stage]
            out.append((rec, parent_rec, join_per_unit(before, after, "kernel").head(rows)))
    return out


_BACKENDS = {"torch": "torch.profiler", "nsys": "Nsight Systems"}


def _backend_names(records: list[StageRecord]) -> str:
    """The capture backends of the profiled stages, as readers know them ('Nsight Systems', 'torch.profiler')."""
    found = {r.profile.backend for r in records if r.profile is not None}
    return ", ".join(sorted(_BACKENDS.get(b, b) for b in found))


def timeline_link(rec: StageRecord, report_md: Path) -> str | None:
    """The stage's timeline.png as a link from the report `report_md`: profile.timeline is relative to the
    run folder, which holds the record's folder `records/` (a record read from elsewhere: its own folder;
    one held only in memory: the report's folder). None when the stage has no timeline."""
    if rec.profile is None or not rec.profile.timeline:
        return None
    if rec.source is None:
        return rec.profile.timeline
    folder = Path(rec.source).parent
    run = folder.parent if folder.name == "records" else folder
    return Path(os.path.relpath(Path(os.path.abspath(run)) / rec.profile.timeline,
                                Path(os.path.abspath(report_md)).parent)).as_posix()


def _timeline_lines(records: list[StageRecord], report_md: Path) -> list[str]:
    """A picture of one captured step per profiled stage that has one (profile.timeline)."""
    shown = [(rec, link) for rec in records if (link := timeline_link(rec, report_md))]
    if not shown:
        return []
    w = record_words(records)
    lines = ["## One step of each profiled stage", "",
             f"The median-length captured step of each stage's profile: NVTX ranges on top, {w.device} "
             f"{w.units} coloured by category (each pixel column stacked by the share of it each category "
             "covers, so white is idle time), the host's CUDA API calls per thread below. `timeline.json` "
             "beside each picture holds every captured step; open it in https://ui.perfetto.dev.", ""]
    for rec, link in shown:
        lines += [f"**{rec.stage}**", "", f"![{rec.stage}: one step]({link})", ""]
    return lines


def _kernel_change_lines(records: list[StageRecord]) -> list[str]:
    changes = kernel_changes(records)
    if not changes:
        return []
    w = record_words(records)
    cpu = w.is_cpu
    what, calls = ("CPU op", "calls") if cpu else ("GPU kernel", "launches") if w == GPU_WORDS \
        else ("CPU/GPU op/kernel", "calls/launches")
    lines = [f"## What changed in the {what.split()[0]} profile from stage to stage", "",
             f"For each profiled stage, the {KERNEL_CHANGE_ROWS} {what}s whose time per step changed most "
             "against the stage it extends (or its nearest profiled ancestor), from the two stages' captures "
             f"({_backend_names(records)}; short names; `swinbench diff` on the two traces gives the full table).", ""]
    if cpu:
        lines += ["> CPU op times from torch.profiler, not GPU kernel times.", ""]
    for rec, parent_rec, table in changes:
        stage, parent = rec.stage, parent_rec.stage
        mine, theirs = kernel_ms_per_step(rec), kernel_ms_per_step(parent_rec)
        total = (f": {what} time {theirs:.1f} → {mine:.1f} ms per step"
                 if mine is not None and theirs is not None else "")
        rows = [[f"`{k}`" if len(k) <= 70 else f"`{k[:67]}...`", f"{b:.3f}", f"{a:.3f}", f"{d:+.3f}", f"{bn:.0f}", f"{an:.0f}"]
                for k, b, a, d, bn, an in table[["kernel", "before_ms", "after_ms", "delta_ms", "before_n", "after_n"]].values]
        lines += [f"**{stage}** against **{parent}**{total}", "",
                  _md_table([what.split()[1], f"ms/step ({parent})", f"ms/step ({stage})", "change",
                             f"{calls} ({parent})", f"{calls} ({stage})"], rows), ""]
    return lines


def _ratio_cell(r: PairedRatio | None, against: str | None = None, rounds: int | None = None) -> str:
    if r is None or r.median is None:
        return "-"
    vs = f" vs {against}" if against else ""
    ns = "" if paired_significant(r.q1, r.q3, rounds) else f" {NS_MARK}"
    return f"{r.median:.2f}x{vs} ({r.q1:.2f}-{r.q3:.2f}){ns}"


def _rounds_text(entry: Interleaved) -> str:
    """'20 rounds', or '7 rounds (stopped early: 12 planned)' where the run ended before its last round."""
    done, planned = entry.rounds, entry.rounds_planned
    return f"{done} rounds" + (f" (stopped early: {planned} planned)" if done < planned else "")


def _scaling_lines(records: list[StageRecord]) -> list[str]:
    """The `apply --nproc` table: each stage under torchrun (DDP or FSDP) against its one-process figure."""
    scaled = [r for r in records if r.scaling is not None]
    if not scaled:
        return []
    first = scaled[0].scaling
    # the data-parallel settings: DDP's, or with "strategy": "fsdp" FSDP2's (records before FSDP name none)
    settings = {k: v for k, v in (first.ddp or {}).items() if k != "strategy"}
    strategy = (first.ddp or {}).get("strategy") or "ddp"
    rows = []
    for r in scaled:
        s = r.scaling
        if s.status != "ok":
            rows.append([r.stage, _num(r.img_per_s), "-", "-", "-", "-", f"{s.status}: {s.reason}"])
            continue
        ranks = s.gate.get("ranks") or []
        gate = (f"{s.gate['status']} on all {len(ranks)} ranks" if set(ranks) == {s.gate["status"]}
                else f"{s.gate['status']} (by rank: {', '.join(ranks)})")
        comm = ("-" if not s.comm else " / ".join(f"{c:.2f} ({e:.2f})" for c, e in
                                                 zip(s.comm["comm_ms_per_rank"], s.comm["exposed_ms_per_rank"])))
        if s.comm_error:
            comm = f"not measured: {s.comm_error}"
        rows.append([r.stage, _num(r.img_per_s), _num(s.img_per_s),
                     "-" if s.efficiency is None else f"{s.efficiency:.2f}",
                     " / ".join(f"{ms:.1f}" for ms in s.step_ms_per_rank), comm, gate])
    n = first.world_size
    title, plain, launched = ((f"{n} processes", "img/s, 1 process", f"img/s, {n} processes") if n > 1 else
                              ("1 process through torchrun", "img/s, plain", "img/s, under torchrun"))
    return [f"## Data parallel: {title}", "",
            _md_table(["stage", plain, launched, "efficiency",
                       "median step ms per rank", "communication ms per step per rank (not overlapped)",
                       "gate over the global batch"], rows), "",
            f"Each stage again under torchrun ({first.backend}, {strategy.upper()}: "
            + ", ".join(f"{k} {v}" for k, v in settings.items())
            + f"), {first.batch_per_process} images per process, global batch {first.global_batch}. img/s = global "
            "batch / the slowest rank's median step; efficiency = img/s / (processes x the one-process img/s at the "
            "same batch per process). The gate compares the combined ranks (logits gathered, mean loss, the "
            "averaged gradients) with the fp32 baseline over the global batch, on every rank. Communication: "
            "each rank's collective kernels per step (NCCL; gloo's c10d operators on the CPU) and, in brackets, "
            "the part of their time no compute kernel of the rank overlaps, the time a step waits on them; from "
            "a few more steps under torch.profiler after the timing."
            + (" On the CPU (gloo) each rank runs one thread (torchrun sets OMP_NUM_THREADS=1) while the "
               "one-process figure uses every core, so efficiency there is not like for like: a CPU run rehearses "
               "the path, a GPU run measures it." if first.backend == "gloo" else ""), ""]


def _floor_lines(records) -> list[str]:
    """Each stage's own kernels against their memory floor (StageRecord.kernel_floors: the nsys capture's where
    the stage was profiled, else those of the steps apply timed the GPU time of)."""
    staged = [(r, *r.kernel_floors) for r in records if r.kernel_floors[0]]
    if not staged:
        return []
    rows = []
    for r, floors, _ in staged:
        for f in floors:
            rows.append([r.stage, f.kernel, f.largest_argument, f"{f.calls_per_step:,.0f}", f"{f.median_us:,.1f}",
                         f"{f.floor_us:,.1f}", f"{f.floor_pct:.0f}%", f"{f.calls_per_step * f.median_us / 1e3:,.3f}"])
    peaks = sorted({f"{peak:,.0f}" for _, _, peak in staged if peak})
    return ["## swinbench's kernels against their memory floor", "",
            f"In each stage that runs them, its costliest Triton kernels (by time per step) per argument shape: the "
            f"median time in the nsys capture (--profile) or else in the steps torch.profiler timed the GPU time of, "
            f"the floor (the bytes of the kernel's arguments at the GPU's peak bandwidth, "
            f"{' / '.join(peaks)} GB/s) and floor / median. 100% runs at the memory limit (above it, part of the "
            "input came from the L2 cache); what a row is under it is time a faster kernel could take off the "
            "step (docs/analysis.md).", "",
            _md_table(["stage", "kernel", "largest argument", "calls/step", "median µs", "floor µs", "% of floor",
                       "ms/step"], rows), ""]


def _num(x) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _interleaved_lines(records: list[StageRecord]) -> list[str]:
    """The `--interleave` table: the stages timed again in alternation in one process, with their paired
    ratios (median and quartiles over the rounds)."""
    timed = [r for r in records if r.interleaved is not None]
    if not timed:
        return []
    il = timed[0].interleaved
    first = il.first_stage
    rows = []
    for r in timed:
        e = r.interleaved
        rows.append([r.stage, fmt_step(e.step_ms, e.iqr_ms),
                     "1.00x" if r.stage == first else _ratio_cell(e.x_first, rounds=e.rounds),
                     _ratio_cell(e.x_previous, e.previous_stage, e.rounds)])
    return ["## Timed in alternation", "",
            f"After the stages ran, these {len(timed)} were built side by side in one process and timed again: "
            f"{_rounds_text(il)} of {il.block} back-to-back steps of each stage, the order rotating from round "
            "to round (`--interleave`). A paired ratio is the median over the rounds of one stage's round median "
            "against another's, each pair taken seconds apart, so a host whose speed drifts between stages does not "
            "move it; in brackets, its quartiles over the rounds. Where a stage is bound by the host, prefer these "
            "ratios to the table above, whose stages ran minutes apart.", "",
            _md_table(["stage", "step ms (median ± IQR, interleaved)", f"× {first} (paired)", "× previous (paired)"], rows),
            ""]


def _env_value(records: list[StageRecord], key: str, missing: str = "-") -> str:
    """An env field as the configuration table shows it: its value, or the distinct values where the
    records differ."""
    values = _distinct(getattr(r.env, key) for r in records)
    return ", ".join(missing if v is None else str(v) for v in values)


def _config_rows(records: list[StageRecord]) -> list[tuple[str, object]]:
    env = records[0].env
    timing = next((r.timing for r in records if r.timing is not None), None)
    devices = _distinct(device_label(r.env.to_dict()) for r in records)
    launchers = _distinct(r.env.triton_launcher for r in records if r.env.triton_launcher)
    settings = _distinct(", ".join(f"{k}={v}" for k, v in r.env.swinbench_env.items())
                         for r in records if r.env.swinbench_env)
    distinct = lambda values: ", ".join(map(str, _distinct(values)))
    multi_run = len({r.run_id for r in records}) > 1
    return [
        ("device", "; ".join(devices) if len(devices) == 1 else "mixed: " + "; ".join(devices)),
        ("GPU", _env_value(records, "gpu", "none (CPU)")), ("driver", _env_value(records, "driver")),
        ("CUDA", _env_value(records, "cuda")), ("torch", _env_value(records, "torch")),
        ("triton", _env_value(records, "triton")), ("timm", _env_value(records, "timm")),
        ("python", _env_value(records, "python")),
        *([("Triton launches (eager)", ", ".join(_LAUNCHERS.get(v, v) for v in launchers))] if launchers else []),
        *([("settings", "; ".join(settings))] if settings else []),
        ("model", distinct(r.model for r in records)), ("mode", distinct(r.mode for r in records)),
        ("batch", distinct(r.batch for r in records)),
        ("precision per stage", ", ".join(f"{r.stage}{f' ({r.run_id})' if multi_run else ''}={r.precision}"
                                          for r in records)),
        ("timed steps / warm-up", f"{timing.repeats} / {timing.warmup} ({timing.clock} clock)" if timing
         else "- / - (- clock)"),
        ("seed", distinct(r.seed for r in records)), ("date", env.date or "-"), ("host", _env_value(records, "host")),
        ("run", ", ".join(sorted({r.run_id for r in records}))),
        ("recipe", distinct(r.recipe for r in records)),
    ]


def _heldout_lines(records: list[StageRecord]) -> list[str]:
    """'## Trained model on held-out images': each stage's accuracy, agreement and gate verdict, where the
    run loaded a checkpoint (apply --checkpoint)."""
    rows, checkpoint = [], None
    for rec in records:
        h = rec.gate.metrics.heldout
        checkpoint = checkpoint or rec.checkpoint
        if h is None:
            continue
        tol = rec.gate.tolerance
        limits = [f"drop <= {tol['accuracy_drop']:g}" if "accuracy_drop" in tol else None,
                  f"agreement >= {tol['top1_agreement']:g}" if "top1_agreement" in tol else None]
        drop = h["accuracy_drop_pts"]
        rows.append([rec.stage, rec.precision_label, _fmt_pct(h["accuracy_pct"]),
                     "-" if rec.gate.status == "REFERENCE" or not _isnum(drop) else f"{-drop:+.2f}",
                     _fmt_pct(None if h["top1_agreement"] is None else 100 * h["top1_agreement"]),
                     _fmt_num(h["logits_rel"]), ", ".join(x for x in limits if x) or "-", rec.gate.status])
    if not rows:
        return []
    c = checkpoint or {}
    trained = ", ".join(x for x in (f"recipe {c['recipe']}" if c.get("recipe") else None,
                                     f"{c['steps']} steps" if c.get("steps") else None,
                                     f"val accuracy {c['val_acc']:.2f}% when saved" if _isnum(c.get("val_acc"))
                                     else None) if x)
    images = next(rec.gate.metrics.heldout["images"] for rec in records if rec.gate.metrics.heldout)
    return ["## Trained model on held-out images", "",
            f"Every stage loaded `{c.get('path')}` ({c.get('model') or 'a plain state_dict'}"
            + (f"; {trained}" if trained else "") + f") and ran {images:,} held-out images "
            f"({c.get('heldout')}) through its own forward. Against the fp32 baseline on the same images:", "",
            _md_table(["stage", "precision", "accuracy", "Δ points", "top-1 agreement", "logits rel L2",
                       "gate limits", "gate"], rows), ""]


def _fmt_num(x) -> str:
    return f"{x:.3g}" if _isnum(x) else "-"


def _fmt_pct(x) -> str:
    return f"{x:.2f}%" if _isnum(x) else "-"


def _parity_lines(records: list[StageRecord], verdicts) -> list[str]:
    """'## Training parity': the verdicts of `swinbench train --compare` runs on the stages' recipes."""
    from workbench.results.verdicts import find_verdicts, verdict_line

    if all(r.mode == "infer" for r in records):
        return []
    stages = {r.stage for r in records}
    on_cpu = all(not r.env.on_gpu for r in records)
    # a recipe's verdict on any model, but of the same kind of device: a CPU run's report does not cite
    # GPU training, nor a GPU run's a CPU comparison
    found = [v for v in (find_verdicts() if verdicts is None else verdicts)
             if v.recipe in stages and (v.device is None or (v.device == "CPU") == on_cpu)]
    if not found:
        return []
    failed = sorted({v.recipe for v in found if not v.passed and v.decided})
    undecided = sorted({v.recipe for v in found if not v.passed and not v.decided} - set(failed))
    head = (f"{', '.join(f'**{s}**' for s in failed)} failed the parity rule in a training comparison below: "
            "what such a stage's step time buys may not train like the reference. " if failed else "")
    head += (f"For {', '.join(f'**{s}**' for s in undecided)} a comparison below could not decide: its accuracy "
             "missed the rule by less than the run-to-run noise. " if undecided else "")
    return ["## Training parity", "",
            head + "From `swinbench train --compare` runs found under reports/ (docs/training.md has the rule).", "",
            *[f"- {verdict_line(v)}" for v in found], ""]


def render_report(records, out_path_md: Path, note: str | None = None, auto: dict | None = None,
                  verdicts=None) -> Path:
    """Write the Markdown report (and, if stages were profiled, `<name>-categories.png` beside it)
    from stage records alone -> the .md path. note: a line quoted under the title (a run that did not
    finish says so). auto: the choice of `apply --recipe auto` (auto_choice), written under the table.
    verdicts: the training-parity verdicts to cite (default: those found under reports/, results.verdicts)."""
    if not records:
        raise UserError("no stage records to report")
    records = as_records(records)
    out_path_md = Path(out_path_md)
    df = speedup_table(records)
    first = records[0]
    lines = [f"# {_title(records)}", ""] + ([f"> {note}", ""] if note else [])
    if _is_cpu(records):
        lines += ["> **CPU — not a GPU speed figure.** These numbers come from the CPU (no GPU was used): "
                  "they show the workflow and the correctness gate, not what the recipes do on a GPU.", ""]
    elif any(not r.env.on_gpu for r in records):
        lines += ["> **Rows measured on the CPU (device column) are not GPU speed figures**, and speedups are "
                  "only taken between records of the same device.", ""]
    ladder = _ladder_lines(records, df)
    lines += [_md_table(table_headers(df), display_rows(df, records)), ""] + (["\n".join(ladder), ""] if ladder else []) + [
              ("eager: the step as a plain training script runs it (modules, autograd, optimizer, one launch per "
               "kernel); graph: the same step captured once and replayed as one CUDA graph; speedups compare the "
               "same column. " if has_graph_columns(df) else "img/s = batch / median step time. ")
              + "× previous compares a stage with the stage it extends or, where "
              "that stage was not measured, with its nearest measured ancestor (named). "
              "Stages that fail the correctness gate, are not available or ended in an error are not in the speedups."
              + (" " + CROSS_RUN_NOTE if (df["x_baseline_cross_run"] | df["x_previous_cross_run"]).any() else "")
              + (" " + NS_NOTE if _any_not_significant(records, df) else ""),
              ""]
    if auto is not None:
        lines += ["## Best configuration (`--recipe auto`)", "", "\n".join(f"- {x}" for x in auto_choice_lines(auto)),
                  ""]
    lines += _parity_lines(records, verdicts)
    lines += _heldout_lines(records)
    lines += _interleaved_lines(records)
    lines += _scaling_lines(records)
    lines += ["## Configuration", "", _md_table(["", ""], [[k, v] for k, v in _config_rows(records)]), ""]

    shares = category_share_frame(records)
    w = record_words(records)
    if not shares.empty:
        from workbench.files import refuse_to_replace

        # beside the report, a picture this command drew before (matplotlib's PNG), or a new file: never a
        # file of the user's that happens to have the name
        png_path = refuse_to_replace(out_path_md.with_name(out_path_md.stem + "-categories.png"),
                                     lambda head: "Matplotlib" in head, "a category chart swinbench drew")
        png = plot_category_shares(shares, png_path, w.time)
        by_stage = {stage_label(r, records): r for r in records}
        rows = [[stage, _fmt_ms(kernel_ms_per_step(by_stage[stage])), _busy(by_stage[stage]),
                 _api_calls(by_stage[stage], lambda c: float(c.get("launch", 0.0))),
                 _api_calls(by_stage[stage], blocking_calls)]
                + [f"{v:.1f}" for v in shares.loc[stage]] for stage in shares.index]
        busy_why = ("" if w.is_cpu else " A stage far under 100% busy is bound by the host launching kernels.")
        lines += [f"## {w.time} by category (%)", "",
                  f"{w.op.capitalize()} ms/step: {w.time} per step in the stage's capture ({_backend_names(records)}); "
                  f"{w.device} busy: that over the measured step time.{busy_why} "
                  "Launches / sync+alloc: host CUDA API calls per step in the capture (kernel launches; "
                  "synchronizing and allocating calls, each of which can stall the launch queue"
                  + ("; none on the CPU)." if w.is_cpu else ")."), "",
                  _md_table(["stage", f"{w.op} ms/step", f"{w.device} busy", "launches/step", "sync+alloc/step",
                             *shares.columns], rows), "",
                  f"![{w.unit}-category shares per stage]({png.name})", ""]
    elif any(n.startswith("profile") for r in records for n in r.notes):
        lines += [f"## {w.time} by category", "", f"Profiling was asked for but gave no {w.time} shares "
                  "(see Notes).", ""]
    else:
        lines += [f"## {w.time} by category", "", "Not profiled (run `swinbench apply --profile`).", ""]

    lines += _floor_lines(records)
    lines += _timeline_lines(records, out_path_md)
    lines += _kernel_change_lines(records)
    lines += ["## What each stage changed", ""]
    for rec in records:
        ext = f" (extends {rec.extends})" if rec.extends else ""
        lines.append(f"- **{rec.stage}**{ext}: {rec.description}")
        lines += [f"  - {t}" for t in _stage_pass_lines(rec)]
        if rec.optimizer and rec.mode != "infer":
            lines.append(f"  - optimizer: {rec.optimizer}")
    lines.append("")
    what = "One forward" if first.mode == "infer" else "One forward + backward"
    lines += ["## Correctness gate", "",
              f"{what} on the same seed and batch, against the fp32 baseline (relative L2 error; "
              "loss: absolute difference).", "",
              _md_table(["stage", "gate", "precision", "logits rel L2", "loss diff", "worst grad rel L2", "tolerance",
                         "reason"], _gate_rows(records)), ""]
    lines += _activation_dtype_lines(records)
    notes = _notes(records, df)
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return atomic_write_text(out_path_md, "\n".join(lines))


def default_report_path(paths: list[Path]) -> Path:
    """report.md beside the records: for `<run>/records` (the folder apply writes), `<run>/report.md`.
    Records of several folders have no folder of their own: UserError (the report of one of them is not
    to be replaced by a report of them all)."""
    def folder_of(p: Path) -> Path:
        folder = p if p.is_dir() else p.parent
        return folder.parent if folder.name == "records" else folder

    folders = {folder_of(Path(p)).resolve() for p in paths}
    if len(folders) > 1:
        raise UserError(f"records of {len(folders)} folders make one report of them all, which belongs to none "
                        "of them: give --out FILE")
    return folder_of(Path(paths[0])) / "report.md"


def _refuse_part_of_a_run(files: list[Path], report: Path) -> None:
    """UserError (one line) when the record `files` are some of the records beside `report`, not all: a
    report of part of the run is not to replace the run's own."""
    from workbench.results.record import record_files

    records_dir = report.parent / "records" if (report.parent / "records").is_dir() else report.parent
    given = {f.resolve() for f in files}
    left_out = [f for f in record_files([records_dir]) if f.resolve() not in given]
    if left_out:
        raise UserError(f"{len(given)} of the {len(given) + len(left_out)} records in {records_dir} make a report of "
                        f"part of the run, which is not to replace {report}: give --out FILE")


def report_target(paths: list[Path], out: Path | None, files: list[Path] | None = None) -> Path:
    """Where `swinbench report` writes, checked before anything is written (UserError, one line): never a
    *.json among stage records (it would be read as one), never the report.md of another run (a folder
    whose records/ the inputs are not from), never a file that is not a report or is one of the inputs."""
    from workbench.files import refuse_to_replace
    from workbench.results.check import refuse_among_records
    from workbench.results.record import record_files

    files = record_files(list(paths)) if files is None else files
    if out is None:
        _refuse_part_of_a_run(files, default_report_path(list(paths)))
    target = refuse_to_replace(Path(out) if out is not None else default_report_path(list(paths)),
                               lambda head: head.startswith(REPORT_HEADING), "a report swinbench wrote", inputs=files)
    if out is not None:
        out = Path(out)
        refuse_among_records(out)
        run_records = out.parent / "records"
        if out.name == "report.md" and run_records.is_dir() and any(run_records.glob("*.json")):
            mine = {f.resolve().parent for f in files}
            if run_records.resolve() not in mine:
                raise UserError(f"{out} is the report of the run in {out.parent} (its records/); render that one with "
                                f"`swinbench report {out.parent}`, or give another --out")
    return target


def render_report_from_paths(paths: list[Path], out: Path | None = None,
                             graph_recipes: dict[str, str] | None = None) -> Path:
    """`swinbench report RECORDS...`: read stored records (files or folders) and write the report. Records
    of one `apply --recipe auto` run (run id 'auto-...') get its choice again (graph_recipes: which recipe
    replays each stage as a graph, recipes.graph_recipes())."""
    from workbench.results.record import record_files

    files = record_files(list(paths))
    records = read_distinct_records(files)
    target = report_target(paths, out, files)
    runs = {r.run_id for r in records}
    auto = None
    if len(runs) == 1 and next(iter(runs)).startswith("auto-"):
        auto = auto_choice(records, graph_recipes)
    return render_report(records, target, auto=auto)
