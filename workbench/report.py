"""Reports from stored stage records only (never a model, never a trace): the speedup table (terminal
and Markdown share `speedup_table`), and the Markdown report a reader wants on a pull request.

`speedup_table(records)` columns (one row per record, in stage order):
    run_id, stage, extends, status ('ok' | 'not available' | 'error'), gate ('PASS' | 'FAIL' |
    'REFERENCE' | 'SKIP'), precision, img_per_s, step_ms, step_iqr_ms, x_baseline, x_previous,
    peak_mem_bytes, compile_s, counted (bool: in the speedups), x_baseline_cross_run, x_previous_cross_run,
    previous_stage
x_baseline = baseline step time / this stage's; x_previous = the same against the stage it extends
(for a peer such as torch-compile, that is amp), or, when that stage was not measured, against its
nearest measured ancestor in the stage's recipe chain (`swinbench apply --stages amp,fmha` compares fmha
with amp); previous_stage names the stage compared with. Both come from the stage's own run; when that
run has no such stage, from another run of the same model, mode, batch and GPU, and the *_cross_run flag
says so. Stages that FAIL the gate, are not available or ended in an error have no img/s-based speedups
(NaN): a fast wrong answer is not a speedup.
"""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from .analysis import blocking_calls
from .env import device_label
from .errors import UserError
from .records import read_records, short_dtype

COLUMNS = ["run_id", "stage", "extends", "status", "gate", "precision", "img_per_s", "step_ms", "step_iqr_ms",
           "x_baseline", "x_previous", "peak_mem_bytes", "compile_s", "counted", "x_baseline_cross_run",
           "x_previous_cross_run", "previous_stage"]
CROSS_RUN_MARK = "†"
CROSS_RUN_NOTE = (f"{CROSS_RUN_MARK} against that stage in another run of the same model, batch and GPU (another "
                  "process, minutes apart): the run of this stage had no such stage of its own.")


def _counted(rec: dict) -> bool:
    return rec.get("status") == "ok" and rec.get("step_ms") is not None and \
        (rec.get("gate") or {}).get("status") in ("PASS", "REFERENCE")


def speedup_table(records: list[dict]) -> pd.DataFrame:
    """One row per stage record with its throughput and speedups (see the module docstring for columns)."""
    rows = []
    for rec in records:
        rows.append({
            "run_id": rec.get("run_id"), "stage": rec.get("stage"), "extends": rec.get("extends"),
            "status": rec.get("status"), "gate": (rec.get("gate") or {}).get("status", "SKIP"),
            "precision": rec.get("precision"), "img_per_s": rec.get("img_per_s"), "step_ms": rec.get("step_ms"),
            "step_iqr_ms": rec.get("step_iqr_ms"), "peak_mem_bytes": rec.get("peak_mem_bytes"),
            "compile_s": rec.get("compile_s"), "counted": _counted(rec),
        })
    derived = ("x_baseline", "x_previous", "previous_stage")
    df = pd.DataFrame(rows, columns=[c for c in COLUMNS if not c.startswith(derived)])
    df["x_baseline"] = math.nan
    df["x_previous"] = math.nan
    df["x_baseline_cross_run"] = False
    df["x_previous_cross_run"] = False
    df["previous_stage"] = None
    # Speedups compare stages of one run; a stage whose run lacks the baseline (or the stage it extends)
    # is compared with that stage of another run of the same workload on the same GPU, and marked.
    workload = {rec.get("run_id"): (rec.get("model"), rec.get("batch"), rec.get("mode"),
                                    (rec.get("env") or {}).get("gpu")) for rec in records}
    steps_by_run: dict = {}
    for r in df.itertuples():
        if r.counted:
            steps_by_run.setdefault(r.run_id, {}).setdefault(r.stage, r.step_ms)

    def lookup(run_id, stage):
        if stage in steps_by_run.get(run_id, {}):
            return steps_by_run[run_id][stage], False
        for other, steps in steps_by_run.items():
            if other != run_id and workload.get(other) == workload.get(run_id) and stage in steps:
                return steps[stage], True
        return None, False

    for idx, r in df.iterrows():
        if not r.counted:
            continue
        base, cross_b = lookup(r.run_id, "baseline")
        if base:
            df.at[idx, "x_baseline"] = base / r.step_ms
            df.at[idx, "x_baseline_cross_run"] = cross_b
        for ancestor in _ancestors(records[idx], r.extends):
            prev, cross_p = lookup(r.run_id, ancestor)
            if prev:
                df.at[idx, "x_previous"] = prev / r.step_ms
                df.at[idx, "x_previous_cross_run"] = cross_p
                df.at[idx, "previous_stage"] = ancestor
                break
    return df[COLUMNS]


def _ancestors(rec: dict, extends: str | None) -> list[str]:
    """The stages a record's x_previous may compare with, nearest first: the stage it extends, then that
    stage's own chain back to the baseline (from the record's stored recipe chain)."""
    if not extends:
        return []
    names = [c.get("name") for c in rec.get("chain") or [] if isinstance(c, dict)]
    if extends in names:
        return names[: names.index(extends) + 1][::-1]
    return [extends]


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


def display_rows(df: pd.DataFrame) -> list[list[str]]:
    """The table as strings, as both the terminal and the Markdown show it."""
    multi = df["run_id"].nunique() > 1
    out = []
    for _, r in df.iterrows():
        stage = r["stage"] + (f" ({r['run_id']})" if multi else "")
        xb = fmt_speedup(r["x_baseline"]) + (CROSS_RUN_MARK if r["x_baseline_cross_run"] else "")
        xp = fmt_speedup(r["x_previous"]) + (CROSS_RUN_MARK if r["x_previous_cross_run"] else "")
        if _isnum(r["x_previous"]) and r["previous_stage"] != r["extends"]:
            xp += f" (vs {r['previous_stage']})"
        out.append([stage, r["precision"] or "-", fmt_rate(r["img_per_s"]), fmt_step(r["step_ms"], r["step_iqr_ms"]),
                    xb, xp, fmt_bytes(r["peak_mem_bytes"]), gate_cell(r)])
    return out


HEADERS = ["stage", "precision", "img/s", "step ms (median ± IQR)", "× baseline", "× previous", "peak memory", "gate"]


def render_speedup_table(records: list[dict], console) -> None:
    """The speedup table in the terminal (rich)."""
    from rich.table import Table

    df = speedup_table(records)
    table = Table(title=_title(records), title_justify="left")
    for i, h in enumerate(HEADERS):
        table.add_column(h, justify="right" if 2 <= i <= 6 else "left")
    for row in display_rows(df):
        style = {"FAIL": "red", "error": "red", "not available": "yellow"}.get(row[-1])
        table.add_row(*row, style=style)
    console.print(table)
    console.print("× previous: against the stage it extends (or, named, its nearest measured ancestor); "
                  "FAIL / not available / error stages are not in the speedups.")
    if (df["x_baseline_cross_run"] | df["x_previous_cross_run"]).any():
        console.print(CROSS_RUN_NOTE)
    timed = [r for r in records if r.get("interleaved")]
    spread = [r["stage"] for r in records if _spread_note(r)]
    if spread and not timed:
        console.print(f"{', '.join(spread)}: step times spread widely (likely bound by the host); their ratios depend "
                      "on this machine's load: --interleave N times the stages again in alternation")
    if timed:
        e0 = timed[0]["interleaved"]
        console.print(f"timed in alternation ({_rounds_text(e0)} of {e0['block']} steps, one process), paired: "
                      + "; ".join(f"{r['stage']} {r['interleaved']['step_ms']:.2f} ms"
                                  + (f", {_ratio_cell(r['interleaved']['x_previous'], r['interleaved']['previous_stage'])}"
                                     if r["interleaved"].get("x_previous") else "")
                                  for r in timed))
    what = "CPU op" if _is_cpu(records) else "GPU kernel"
    for stage, parent, table in kernel_changes(records, rows=3):
        moved = ", ".join(f"{k[:48]} {d:+.2f}" for k, d in table[["kernel", "delta_ms"]].values)
        console.print(f"{stage} against {parent}, largest {what} changes (ms per step): {moved}")


def _md_table(headers: list[str], rows: list[list]) -> str:
    esc = lambda v: str(v).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(map(esc, headers)) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
    return "\n".join(lines)


_LAUNCHERS = {"cached": "cached launcher (workbench.kernels._ops.CachedLauncher)",
              "triton": "Triton's kernel[grid] launcher", "interpreter": "Triton's CPU interpreter"}


def _env(records) -> dict:
    return (records[0].get("env") or {}) if records else {}


def _is_cpu(records) -> bool:
    return _env(records).get("device_type") != "cuda"


def _title(records) -> str:
    first = records[0]
    where = "CPU — not a GPU speed figure" if _is_cpu(records) else (_env(records).get("gpu") or "GPU")
    mode = "inference" if first.get("mode") == "infer" else "training"
    return (f"swinbench apply: {first.get('recipe')} — {first.get('model')}, {mode}, batch {first.get('batch')}, "
            f"{where}")


# ---------------------------------------------------------------- the Markdown report


def category_share_frame(records: list[dict]) -> pd.DataFrame:
    """Stages (rows, in order) x kernel categories (columns), percent of GPU kernel time; empty when
    no stage was profiled. Columns are ordered by their largest share."""
    rows = {r["stage"]: (r.get("profile") or {}).get("category_share_pct") for r in records}
    rows = {k: v for k, v in rows.items() if v}
    if not rows:
        return pd.DataFrame()
    df = pd.DataFrame.from_dict(rows, orient="index").fillna(0.0)
    return df[df.max().sort_values(ascending=False).index]


def plot_category_shares(df: pd.DataFrame, path: Path) -> Path:
    """A stacked horizontal bar per stage of kernel-category shares, written as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.5 * len(df) + 1.6))
    df.iloc[::-1].plot.barh(stacked=True, ax=ax, width=0.7, colormap="tab20")
    ax.set_xlabel("share of GPU kernel time (%)")
    ax.set_xlim(0, 100)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _stage_pass_lines(rec: dict) -> list[str]:
    """What the passes this stage adds (over the one it extends) changed, one line each."""
    own = rec.get("stage_passes") or []
    done = rec.get("passes") or []
    tail = done[len(done) - len(own):] if own and len(done) >= len(own) else []
    if not own:
        return ["no passes (the reference)"] if not rec.get("extends") else ["no passes of its own"]
    if not tail:
        return [f"`{n}`: not applied ({rec.get('status')})" for n in own]
    return [f"`{p['name']}`: {p['changed']}" for p in tail]


def activation_dtype_changes(records: list[dict]) -> list[str]:
    """One line per stage whose activations are kept in another dtype than those of the stage it extends
    (or its nearest ancestor in the run) at the same precision: a kernel swap that also changed precision."""
    by_name = {r["stage"]: r for r in records if r.get("activation_dtypes")}
    lines = []
    for rec in records:
        mine = rec.get("activation_dtypes")
        if not mine:
            continue
        ref = next((by_name[a] for a in _ancestors(rec, rec.get("extends")) if a in by_name), None)
        if ref is None or ref.get("precision") != rec.get("precision"):
            continue
        theirs = ref["activation_dtypes"]
        diff = [f"{part} {short_dtype(theirs[part])} -> {short_dtype(d)}" for part, d in mine.items()
                if part in theirs and theirs[part] != d]
        if diff:
            lines.append(f"**{rec['stage']}** keeps activations in other dtypes than **{ref['stage']}** "
                         f"at the same precision ({rec.get('precision')}): {', '.join(diff)}. Part of its speed "
                         "(and of its error against the baseline) may come from that precision, not from the kernels.")
    return lines


def _activation_dtype_lines(records: list[dict]) -> list[str]:
    recs = [r for r in records if r.get("activation_dtypes")]
    if not recs:
        return []
    parts = list(dict.fromkeys(p for r in recs for p in r["activation_dtypes"]))
    rows = [[r["stage"]] + [short_dtype(r["activation_dtypes"].get(p, "-")) for p in parts] for r in recs]
    lines = ["## Activation dtypes", "",
             "The output dtype of each part of the model in one forward under the stage's precision (the "
             "residual stream between stages; `layers.N` is stage N+1).", "",
             _md_table(["stage"] + parts, rows), ""]
    changes = activation_dtype_changes(records)
    if changes:
        lines += [f"- {c}" for c in changes] + [""]
    return lines


def _gate_rows(records) -> list[list[str]]:
    rows = []
    for rec in records:
        g = rec.get("gate") or {}
        m = g.get("metrics") or {}
        tol = g.get("tolerance") or {}
        logits = (m.get("logits") or {}).get("rel_l2")
        loss = (m.get("loss") or {}).get("abs_diff")
        grads = {k: v.get("rel_l2") for k, v in (m.get("grads") or {}).items()}
        worst = max(grads.items(), key=lambda kv: -1 if kv[1] is None else kv[1], default=(None, None))
        f = lambda x: "-" if x is None else f"{x:.2e}"
        tol_txt = ", ".join(f"{k} {v:g}" for k, v in tol.items()) or "-"
        worst_txt = f"{f(worst[1])} ({worst[0]})" if worst[0] else "-"
        rows.append([rec["stage"], g.get("status", "SKIP"), rec.get("precision") or "-", f(logits), f(loss), worst_txt,
                     tol_txt, g.get("reason") or ""])
    return rows


def kernel_ms_per_step(rec: dict) -> float | None:
    """GPU kernel time per step from the stage's profile (None when it was not profiled)."""
    value = (rec.get("profile") or {}).get("kernel_ms_per_step")
    return float(value) if _isnum(value) else None


def _slower_why(rec: dict, records: list[dict], previous: str) -> str:
    """Why a stage is slower than the stage it was compared with, from what was measured: if its GPU
    kernel time per step went down while the wall step went up, the step is host-bound (launch overhead)."""
    parent = next((r for r in records if r["stage"] == previous), None)
    mine, theirs = kernel_ms_per_step(rec), kernel_ms_per_step(parent) if parent else None
    if mine is None or theirs is None or not _isnum(rec.get("step_ms")):
        return ": look at its passes above and its kernel shares before keeping it"
    busy = 100.0 * mine / rec["step_ms"]
    if mine < theirs:
        return (f": its GPU kernel time per step fell from {theirs:.1f} to {mine:.1f} ms, but its step takes "
                f"{rec['step_ms']:.1f} ms, the GPU busy {busy:.0f}% of it, so the step is bound by the host "
                "launching kernels (its fused kernels cost more host time per launch than the ops they "
                "replace); a CUDA graph (the fmha-graph stage) or torch.compile removes that cost")
    return f": its GPU kernel time per step rose from {theirs:.1f} to {mine:.1f} ms"


SPREAD_NOTE_FRACTION = 0.05  # GPU step times whose IQR exceeds this share of the median get a note


def _spread_note(rec: dict) -> str | None:
    """A note for a GPU stage whose step times spread widely. Steady steps are bound by the GPU; eager
    steps bound by the host (launch overhead) vary with the CPU and whatever else runs on it."""
    timing = rec.get("timing") or {}
    samples = timing.get("samples_ms") or []
    median = timing.get("median_ms")
    if timing.get("clock") != "cuda-events" or len(samples) < 4 or not _isnum(median) or median <= 0:
        return None
    iqr = timing.get("iqr_ms")
    if not _isnum(iqr) or iqr <= SPREAD_NOTE_FRACTION * median:
        return None
    return (f"{rec['stage']}: step times spread from {min(samples):.1f} to {max(samples):.1f} ms (IQR "
            f"{100.0 * iqr / median:.0f}% of the median): steps that vary this much are usually bound by the host "
            "launching kernels, so its figure depends on this machine's CPU and load; replaying the step as a "
            "CUDA graph (the -graph and -graphs stages) takes the host out"
            + ("" if rec.get("interleaved") else
               ", and `apply --interleave N` compares such stages in alternation, where the host's drift cancels"))


def _notes(records, df: pd.DataFrame) -> list[str]:
    notes = []
    by_stage = {r.stage: r for r in df.itertuples()}
    for rec in records:
        r = by_stage.get(rec["stage"])
        st = rec.get("status")
        if st == "not available":
            notes.append(f"**{rec['stage']}** not available: {rec.get('error')}")
        elif st == "error":
            notes.append(f"**{rec['stage']}** ended in an error: {rec.get('error')}")
        elif (rec.get("gate") or {}).get("status") == "FAIL":
            notes.append(f"**{rec['stage']}** FAILED the correctness gate ({(rec['gate'].get('reason'))}); "
                         "it is left out of the speedups")
        if r is not None and _isnum(r.x_previous) and r.x_previous < 1.0:
            how = "the stage it extends" if r.previous_stage == rec.get("extends") else "its nearest measured ancestor"
            notes.append(f"**{rec['stage']}** is slower than **{r.previous_stage}**, {how} "
                         f"({r.x_previous:.2f}x)" + _slower_why(rec, records, r.previous_stage))
        spread = _spread_note(rec)
        if spread:
            notes.append(spread)
        for n in rec.get("notes") or []:
            notes.append(f"{rec['stage']}: {n}")
        if rec.get("compile_s") is not None:
            notes.append(f"{rec['stage']}: torch.compile took {rec['compile_s']:.1f} s on its first step "
                         "(excluded from step times)")
    return notes


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _api_calls(rec: dict, count) -> str:
    """count(api_calls_per_step) of the stage's capture, formatted ('-' when not recorded)."""
    per_step = (rec.get("profile") or {}).get("api_calls_per_step")
    return f"{count(per_step):,.0f}" if per_step else "-"


def _busy(rec: dict) -> str:
    mine = kernel_ms_per_step(rec)
    if mine is None or not _isnum(rec.get("step_ms")):
        return "-"
    return f"{100.0 * mine / rec['step_ms']:.0f}%"


KERNEL_CHANGE_ROWS = 6  # kernels listed per stage in the report's stage-to-stage changes


def kernel_changes(records: list[dict], rows: int = KERNEL_CHANGE_ROWS) -> list[tuple[str, str, pd.DataFrame]]:
    """(stage, compared_with, the `rows` kernels whose GPU ms per step changed most) for every profiled
    stage whose nearest profiled ancestor in `records` (the stage it extends, then that one's chain) has a
    per-kernel table too."""
    from .diff import join_per_unit, record_kernels

    frames = {r["stage"]: f for r in records if (f := record_kernels(r)) is not None}
    out = []
    for rec in records:
        if rec["stage"] not in frames:
            continue
        parent = next((a for a in _ancestors(rec, rec.get("extends")) if a in frames and a != rec["stage"]), None)
        if parent is not None:
            out.append((rec["stage"], parent, join_per_unit(frames[parent], frames[rec["stage"]], "kernel").head(rows)))
    return out


def _kernel_change_lines(records: list[dict]) -> list[str]:
    changes = kernel_changes(records)
    if not changes:
        return []
    cpu = _is_cpu(records)
    what, calls = ("CPU op", "calls") if cpu else ("GPU kernel", "launches")
    names = {"torch": "torch.profiler"}
    backends = sorted({names.get(b, b) for r in records if r.get("profile") for b in [str(r["profile"].get("backend"))]})
    lines = [f"## What changed in the {what.split()[0]} profile from stage to stage", "",
             f"For each profiled stage, the {KERNEL_CHANGE_ROWS} {what}s whose time per step changed most "
             "against the stage it extends (or its nearest profiled ancestor), from the two stages' captures "
             f"({', '.join(backends)}; short names; `swinbench diff` on the two traces gives the full table).", ""]
    if cpu:
        lines += ["> CPU op times from torch.profiler, not GPU kernel times.", ""]
    by_stage = {r["stage"]: r for r in records}
    for stage, parent, table in changes:
        mine, theirs = kernel_ms_per_step(by_stage[stage]), kernel_ms_per_step(by_stage[parent])
        total = (f": {what} time {theirs:.1f} → {mine:.1f} ms per step"
                 if mine is not None and theirs is not None else "")
        rows = [[f"`{k}`" if len(k) <= 70 else f"`{k[:67]}...`", f"{b:.3f}", f"{a:.3f}", f"{d:+.3f}", f"{bn:.0f}", f"{an:.0f}"]
                for k, b, a, d, bn, an in table[["kernel", "before_ms", "after_ms", "delta_ms", "before_n", "after_n"]].values]
        lines += [f"**{stage}** against **{parent}**{total}", "",
                  _md_table([what.split()[1], f"ms/step ({parent})", f"ms/step ({stage})", "change",
                             f"{calls} ({parent})", f"{calls} ({stage})"], rows), ""]
    return lines


def _ratio_cell(r: dict | None, against: str | None = None) -> str:
    if not r or r.get("median") is None:
        return "-"
    vs = f" vs {against}" if against else ""
    return f"{r['median']:.2f}x{vs} ({r['q1']:.2f}-{r['q3']:.2f})"


def _rounds_text(entry: dict) -> str:
    """'20 rounds', or '7 rounds (stopped early: 12 planned)' where the run ended before its last round."""
    done, planned = entry["rounds"], entry.get("rounds_planned") or entry["rounds"]
    return f"{done} rounds" + (f" (stopped early: {planned} planned)" if done < planned else "")


def _interleaved_lines(records: list[dict]) -> list[str]:
    """The `--interleave` table: the stages timed again in alternation in one process, with their paired
    ratios (median and quartiles over the rounds)."""
    timed = [r for r in records if r.get("interleaved")]
    if not timed:
        return []
    il = timed[0]["interleaved"]
    first = il["first_stage"]
    rows = []
    for r in timed:
        e = r["interleaved"]
        rows.append([r["stage"], fmt_step(e["step_ms"], e["iqr_ms"]),
                     "1.00x" if r["stage"] == first else _ratio_cell(e["x_first"]),
                     _ratio_cell(e.get("x_previous"), e.get("previous_stage"))])
    return ["## Timed in alternation", "",
            f"After the stages ran, these {len(timed)} were built side by side in one process and timed again: "
            f"{_rounds_text(il)} of {il['block']} back-to-back steps of each stage, the order rotating from round "
            "to round (`--interleave`). A paired ratio is the median over the rounds of one stage's round median "
            "against another's, each pair taken seconds apart, so a host whose speed drifts between stages does not "
            "move it; in brackets, its quartiles over the rounds. Where a stage is bound by the host, prefer these "
            "ratios to the table above, whose stages ran minutes apart.", "",
            _md_table(["stage", "step ms (median ± IQR, interleaved)", f"× {first} (paired)", "× previous (paired)"], rows),
            ""]


def render_report(records: list[dict], out_path_md: Path) -> Path:
    """Write the Markdown report (and, if stages were profiled, `<name>-categories.png` beside it)
    from stage records alone -> the .md path."""
    if not records:
        raise UserError("no stage records to report")
    out_path_md = Path(out_path_md)
    out_path_md.parent.mkdir(parents=True, exist_ok=True)
    df = speedup_table(records)
    env = _env(records)
    first = records[0]
    lines = [f"# {_title(records)}", ""]
    if _is_cpu(records):
        lines += ["> **CPU — not a GPU speed figure.** These numbers come from the CPU (no GPU was used): "
                  "they show the workflow and the correctness gate, not what the recipes do on a GPU.", ""]
    lines += [_md_table(HEADERS, display_rows(df)), "",
              "img/s = batch / median step time. × previous compares a stage with the stage it extends or, where "
              "that stage was not measured, with its nearest measured ancestor (named). "
              "Stages that fail the correctness gate, are not available or ended in an error are not in the speedups."
              + (" " + CROSS_RUN_NOTE if (df["x_baseline_cross_run"] | df["x_previous_cross_run"]).any() else ""),
              ""]
    lines += _interleaved_lines(records)
    timing = next((r.get("timing") for r in records if r.get("timing")), None) or {}
    config = [
        ("device", device_label(env) if env else "-"),
        ("GPU", env.get("gpu") or "none (CPU)"), ("driver", env.get("driver") or "-"),
        ("CUDA", env.get("cuda") or "-"), ("torch", env.get("torch") or "-"),
        ("triton", env.get("triton") or "-"), ("timm", env.get("timm") or "-"), ("python", env.get("python") or "-"),
        *([("Triton launches (eager)", _LAUNCHERS.get(env["triton_launcher"], env["triton_launcher"]))]
          if env.get("triton_launcher") else []),
        *([("settings", ", ".join(f"{k}={v}" for k, v in env["swinbench_env"].items()))]
          if env.get("swinbench_env") else []),
        ("model", first.get("model")), ("mode", first.get("mode")), ("batch", first.get("batch")),
        ("precision per stage", ", ".join(f"{r['stage']}={r.get('precision')}" for r in records)),
        ("timed steps / warm-up", f"{timing.get('repeats', '-')} / {timing.get('warmup', '-')} ({timing.get('clock', '-')} clock)"),
        ("seed", first.get("seed")), ("date", env.get("date") or "-"), ("host", env.get("host") or "-"),
        ("run", ", ".join(sorted({str(r.get('run_id')) for r in records}))),
        ("recipe", first.get("recipe")),
    ]
    lines += ["## Configuration", "", _md_table(["", ""], [[k, v] for k, v in config]), ""]

    shares = category_share_frame(records)
    if not shares.empty:
        png = plot_category_shares(shares, out_path_md.with_name(out_path_md.stem + "-categories.png"))
        by_stage = {r["stage"]: r for r in records}
        rows = [[stage, _fmt_ms(kernel_ms_per_step(by_stage[stage])), _busy(by_stage[stage]),
                 _api_calls(by_stage[stage], lambda c: float(c.get("launch", 0.0))),
                 _api_calls(by_stage[stage], blocking_calls)]
                + [f"{v:.1f}" for v in shares.loc[stage]] for stage in shares.index]
        lines += ["## GPU kernel time by category (%)", "",
                  "Kernel ms/step: GPU kernel time per step in the stage's nsys capture; GPU busy: that over the "
                  "measured step time. A stage far under 100% busy is bound by the host launching kernels. "
                  "Launches / sync+alloc: host CUDA API calls per step in the capture (kernel launches; "
                  "synchronizing and allocating calls, each of which can stall the launch queue).", "",
                  _md_table(["stage", "kernel ms/step", "GPU busy", "launches/step", "sync+alloc/step", *shares.columns],
                            rows), "",
                  f"![kernel-category shares per stage]({png.name})", ""]
    elif any(n.startswith("profile") for r in records for n in (r.get("notes") or [])):
        lines += ["## GPU kernel time by category", "", "Profiling was asked for but gave no GPU kernel shares "
                  "(see Notes).", ""]
    else:
        lines += ["## GPU kernel time by category", "", "Not profiled (run `swinbench apply --profile`).", ""]

    lines += _kernel_change_lines(records)
    lines += ["## What each stage changed", ""]
    for rec in records:
        ext = f" (extends {rec['extends']})" if rec.get("extends") else ""
        lines.append(f"- **{rec['stage']}**{ext}: {rec.get('description') or ''}")
        lines += [f"  - {t}" for t in _stage_pass_lines(rec)]
        if rec.get("optimizer") and rec.get("mode") != "infer":
            lines.append(f"  - optimizer: {rec['optimizer']}")
    lines.append("")
    what = "One forward" if first.get("mode") == "infer" else "One forward + backward"
    lines += ["## Correctness gate", "",
              f"{what} on the same seed and batch, against the fp32 baseline (relative L2 error; "
              "loss: absolute difference).", "",
              _md_table(["stage", "gate", "precision", "logits rel L2", "loss diff", "worst grad rel L2", "tolerance",
                         "reason"], _gate_rows(records)), ""]
    lines += _activation_dtype_lines(records)
    notes = _notes(records, df)
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    out_path_md.write_text("\n".join(lines))
    return out_path_md


def default_report_path(paths: list[Path]) -> Path:
    """report.md beside the records: for `<run>/records` (the folder apply writes), `<run>/report.md`."""
    p = Path(paths[0])
    folder = p if p.is_dir() else p.parent
    if folder.name == "records":
        folder = folder.parent
    return folder / "report.md"


def render_report_from_paths(paths: list[Path], out: Path | None = None) -> Path:
    """`swinbench report RECORDS...`: read stored records (files or folders) and write the report."""
    records = read_records(paths)
    return render_report(records, Path(out) if out else default_report_path(list(paths)))
