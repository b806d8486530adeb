"""The report of a `swinbench train` run, rendered from its record files alone (no model, no GPU):
report.md (the summary table first, then the parity rule with the measured spread, then the setup) and
curves.png (smoothed training loss and validation accuracy of every run, overlaid)."""
from __future__ import annotations

import math
import statistics
from pathlib import Path

from workbench.env import device_label
from workbench.errors import UserError
from workbench.files import atomic_write_text
from workbench.results.parity import ACCURACY_POINTS, NOISE_SIGMAS, smooth, smoothing_window
from workbench.results.train_runs import RunRecords, compare_runs, read_runs, reference_label


def _fmt(x, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def _final_loss(run: RunRecords, window: int) -> float | None:
    losses = run.losses
    return smooth(losses, window)[-1] if losses else None


def _range(values: list[float], digits: int, short: bool = False) -> str:
    """'mean (min-max)' over seeds; short: 'mean ±half the range'; one value as it is."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    if short:
        return f"{statistics.mean(values):.{digits}f} ±{(max(values) - min(values)) / 2:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def summary_rows(records_dir: Path | None = None, runs: list[RunRecords] | None = None, *,
                 short: bool = False) -> list[dict]:
    """One row per recipe (each recipe's seeds in one row): seeds, final smoothed loss, final validation
    accuracy (mean and range over seeds), median img/s, and the parity figures and verdict (`short`: the
    verdict in a word or two, for a terminal)."""
    runs = runs if runs is not None else read_runs(records_dir)
    if not runs:
        return []
    comparison = compare_runs(runs)
    steps = max((len(r.steps) for r in runs), default=1)
    window = comparison.spread.window if comparison.spread else smoothing_window(steps)
    rows = []
    order = []
    for r in runs:
        if r.recipe not in order:
            order.append(r.recipe)
    for recipe in order:
        group = [r for r in runs if r.recipe == recipe]
        done = [r for r in group if r.status in ("ok", "diverged")]
        row = {"recipe": recipe, "seeds": ", ".join(str(r.seed) for r in group),
               "final loss": _range([_final_loss(r, window) for r in done], 3 if short else 4, short),
               "val acc %": _range([r.final_accuracy for r in done], 1 if short else 2, short),
               **({"EMA val acc %": _range([r.final_accuracy_ema for r in done], 1 if short else 2, short)}
                  if any(r.header.get("ema") for r in runs) else {}),
               "img/s": _fmt(statistics.median([r.img_per_s for r in done if r.img_per_s]) if
                             any(r.img_per_s for r in done) else None, 1),
               "loss distance": "-", "baseline spread": "-", "val acc Δ": "-", "parity": ""}
        not_done = [r for r in group if r.status not in ("ok", "diverged")]
        if recipe == comparison.reference and comparison.spread is not None:
            s = comparison.spread
            row["baseline spread"] = f"{s.spread_mean:.4f}" + ("" if short else f" (max {s.spread_max:.4f})")
            row["parity"] = ("reference" if short else
                             f"reference ({s.seeds} seeds; accuracy spread {s.accuracy_spread:.2f} points)")
        elif recipe == comparison.reference:
            row["parity"] = "reference" + (" (one seed: no spread)" if len(done) == 1 else "")
        p = comparison.parity.get(recipe)
        diverged = [r for r in done if r.status == "diverged"]
        if p is not None:
            row["loss distance"] = _fmt(p.distance_mean, 4)
            row["baseline spread"] = _fmt(p.spread_mean, 4)
            row["val acc Δ"] = "-" if p.accuracy_delta is None else f"{p.accuracy_delta:+.2f}"
            failed = [what for what, ok in (("loss", p.loss_ok), ("accuracy", p.accuracy_ok)) if not ok]
            words = p.verdict.split(": ", 1)[-1].replace("the baseline", reference_label(comparison.reference))
            if not failed:
                row["parity"] = "PASS"
            elif not p.decided:
                row["parity"] = "NOT DECIDED (accuracy within the noise)" if short else "NOT DECIDED: " + words
            else:
                row["parity"] = f"FAIL ({', '.join(failed)})" if short else "FAIL: " + words
        if diverged:
            row["parity"] = f"diverged: {(diverged[0].end or {}).get('reason')}"
        if done and not_done and row["parity"]:
            row["parity"] += f" ({len(done)} of {len(group)} seeds finished)"
        if not_done and not done:
            why = "" if short else (not_done[0].end or {}).get("reason") or ""
            row["parity"] = f"{not_done[0].status}: {why}".rstrip(": ")
        rows.append(row)
    if len(order) == 1 and not comparison.parity:   # one recipe: nothing to compare, but a run may not have ended well
        flagged = any(r.status != "ok" for r in runs)
        for row in rows:
            status = row["parity"]
            for col in ("loss distance", "baseline spread", "val acc Δ", "parity"):
                del row[col]
            if flagged:
                row["status"] = status if status and not status.startswith("reference") else "ok"
    if comparison.reference != "baseline":
        rows = [{("reference spread" if k == "baseline spread" else k): v for k, v in row.items()} for row in rows]
    if short:   # a terminal's width: the spread goes on a line of its own (spread_line)
        names = {"final loss": "loss", "loss distance": "distance"}
        rows = [{names.get(k, k): v for k, v in row.items() if k not in ("seeds", "baseline spread", "reference spread", "val acc Δ")}
                for row in rows]
    return rows


def spread_line(records_dir: Path) -> str | None:
    """The reference recipe's measured spread (the baseline's unless --reference) in one line (None without
    two finished seeds)."""
    comparison = compare_runs(read_runs(records_dir))
    s = comparison.spread
    if s is None:
        return None
    return (f"{comparison.reference} spread over {s.seeds} seeds: smoothed loss (trailing mean of {s.window} steps) "
            f"{s.spread_mean:.4f} on average, {s.spread_max:.4f} at most; final val accuracy "
            f"{', '.join(f'{a:.2f}' for a in s.accuracies)} % ({s.accuracy_spread:.2f} points apart)")


def _markdown_table(rows: list[dict]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(str(r[c]).replace("|", "/") for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def _batch_words(header: dict) -> str:
    """'64', or '64 per process x 2 processes (global 128)' for a data-parallel run."""
    world = header.get("world_size") or 1
    if world == 1:
        return str(header.get("batch"))
    return f"{header.get('batch')} per process x {world} processes (global {header.get('global_batch')})"


def _setup_lines(runs: list[RunRecords]) -> list[str]:
    h = runs[0].header
    data = h.get("data", {})
    env = h.get("env", {})
    lines = [
        f"- **model** `{h.get('model')}`, input {'x'.join(map(str, h.get('input_size', [])))}, trained from "
        f"scratch (timm's default stochastic depth)",
        f"- **data** {data.get('source')}: {data.get('train')} training images, {data.get('val')} validation "
        f"images, {data.get('classes')} classes; augmentation: {data.get('augmentation')}",
        *([f"- **data parallel** {h['world_size']} processes ({(h.get('parallel') or 'ddp').upper()}, torchrun), "
           f"{h.get('batch')} images each a step: "
            f"global batch {h.get('global_batch')}; a step's loss is the mean over the processes (the global "
            "batch's), its img/s the sum of theirs"] if (h.get("world_size") or 1) > 1 else []),
        f"- **training** batch {_batch_words(h)}, {h.get('steps')} steps ({h.get('steps_per_epoch')} per epoch, "
        f"validation after each epoch and at the end); AdamW lr {h['optimizer']['lr']:g}, weight decay "
        f"{h['optimizer']['weight_decay']:g}; {h.get('schedule')}; label smoothing {h.get('label_smoothing')}; "
        f"gradient clipping {h.get('clip_grad') or 'off'}"
        + (f"; an EMA of the fp32 weights, decay {h['ema']:g}, validated beside them" if h.get("ema") else ""),
        "- **img/s**: the batch over the wall time of one train_step up to its loss on the host, median over "
        "the steps after the first tenth of a run and after at least its first 4 (12 for a CUDA-graph recipe under DDP): "
        "warm-up, autotuning, compiling and graph capture excluded; "
        "validation is not timed",
        f"- **environment** {device_label(env)}; torch {env.get('torch')}, triton {env.get('triton')}, "
        f"timm {env.get('timm')}; swinbench {env.get('swinbench')}; {env.get('date')}",
        "", "Per recipe (what its passes changed, and what it said while training):", ""]
    seen = set()
    for r in runs:
        if r.recipe in seen:
            continue
        seen.add(r.recipe)
        hh = r.header
        what = (f"{hh.get('precision', '?')}, {hh.get('optimizer_impl', '?')}"
                + (", CUDA graph" if hh.get("graphed") else ""))
        changed = "; ".join(f"{p['name']}: {p['changed']}" for p in hh.get("passes", [])) or "no passes"
        lines.append(f"- `{r.recipe}` ({what}): {changed}")
        for note in (r.end or {}).get("notes", []) or []:
            lines.append(f"  - {note}")
        if r.status not in ("ok",):
            lines.append(f"  - {r.status}: {(r.end or {}).get('reason') or ''}")
    return lines


def render_train_report(records_dir: Path, out: Path | None = None) -> str:
    """report.md of the runs in records_dir (written to `out` when given) -> the Markdown."""
    runs = read_runs(records_dir)
    if not runs:
        raise UserError(f"no record files in {records_dir}")
    comparison = compare_runs(runs)
    h = runs[0].header
    env = h.get("env", {})
    cpu = env.get("device_type") == "cpu"
    title = (f"# Training `{h.get('model')}` on {h.get('data', {}).get('name')}: {h.get('steps')} steps, batch "
             f"{_batch_words(h)}" + (" (CPU: the img/s are not GPU figures)" if cpu else f", {env.get('gpu')}"))
    parts = [title, "", _markdown_table(summary_rows(runs=runs)), "", "![loss and validation accuracy](curves.png)", ""]
    s = comparison.spread
    ref = reference_label(comparison.reference)
    if s is not None:
        parts += [
            f"## Parity with {ref}", "",
            f"A recipe converges like {ref} when its loss curve stays within {ref}'s spread across seeds and its "
            f"final validation accuracy is within {ACCURACY_POINTS} points of {ref}'s mean (docs/training.md). Loss "
            f"curves are smoothed with a trailing mean over {s.window} steps and compared from step {s.first + 1} to "
            f"{s.steps}: at each step the spread is the range of {ref}'s {s.seeds} seeds' smoothed losses, and a "
            f"recipe passes when its mean distance from the seeds' mean is at most the mean spread. A recipe run "
            f"with several seeds is held against it by the mean of its seeds' curves and accuracies.", "",
            f"Measured on {ref} ({s.seeds} seeds): spread of the smoothed loss {s.spread_mean:.4f} on average, "
            f"{s.spread_max:.4f} at most; final validation accuracy "
            f"{', '.join(f'{a:.2f}' for a in s.accuracies)} % (mean {s.accuracy_mean:.2f}, spread "
            f"{s.accuracy_spread:.2f} points).", ""]
        parts += [f"The accuracy's noise: the mean of k seeds of a recipe that changes nothing falls within "
                  f"±{NOISE_SIGMAS:g} s·sqrt(1/k + 1/{s.seeds}) of {ref}'s mean (s = {s.accuracy_std:.2f} points, the "
                  f"standard deviation of {ref}'s seeds): ±{s.accuracy_noise(1):.2f} points for one seed. A recipe "
                  f"whose loss holds and whose accuracy misses the rule by less than that is NOT DECIDED, not "
                  "failed: more seeds, or a stabler run, decide it.", ""]
        rows = []
        for recipe, p in comparison.parity.items():
            group = [r for r in runs if r.recipe == recipe and r.status in ("ok", "diverged")]
            rows.append({"recipe": recipe, "seeds": ", ".join(str(r.seed) for r in group),
                         "mean distance": _fmt(p.distance_mean, 4),
                         "max distance": _fmt(p.distance_max, 4), "mean spread": _fmt(p.spread_mean, 4),
                         "steps inside the seeds' range": "-" if p.inside_share is None else f"{100 * p.inside_share:.0f}%",
                         "val acc": ", ".join(_fmt(r.final_accuracy, 2) for r in group),
                         "Δ points (mean)": "-" if p.accuracy_delta is None else f"{p.accuracy_delta:+.2f}",
                         "verdict": p.verdict.replace("the baseline", ref)})
        if rows:
            parts += [_markdown_table(rows), ""]
    elif any(r.recipe != comparison.reference for r in runs):
        parts += [f"No parity verdicts: they need at least two finished seeds of {ref} (--compare with "
                  "--baseline-seeds 2 or more).", ""]
    commands = list(dict.fromkeys(r.header.get("command") or "swinbench train" for r in runs))
    made = (f"Made by `{commands[0]}`." if len(commands) == 1 else
            "Made in " + str(len(commands)) + " sittings (`--resume`): " + "; then ".join(f"`{c}`" for c in commands) + ".")
    parts += ["## Setup", "", *_setup_lines(runs), "", made, ""]
    text = "\n".join(parts)
    if out is not None:
        atomic_write_text(out, text)
    return text


def write_curves(records_dir: Path, out: Path) -> Path:
    """curves.png: the smoothed training loss per step (the reference recipe's seeds as a shaded range), the
    validation accuracy at each epoch's end and, where the runs recorded it, the gradient norm before
    clipping (smoothed, log scale: a loss spike starts there), every run overlaid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in read_runs(records_dir) if r.steps]
    comparison = compare_runs(runs)
    steps = max((len(r.steps) for r in runs), default=1)
    window = comparison.spread.window if comparison.spread else smoothing_window(steps)
    with_norms = any(r.grad_norms for r in runs)
    fig, axes = plt.subplots(1, 3 if with_norms else 2, figsize=(18 if with_norms else 12, 4.5))
    ax_loss, ax_acc = axes[0], axes[1]
    ax_norm = axes[2] if with_norms else None
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    reference = comparison.reference
    others = [r for r in runs if r.recipe != reference]
    base = [r for r in runs if r.recipe == reference]
    if len(base) >= 2:
        n = min(len(r.steps) for r in base)
        curves = [smooth(r.losses[:n], window) for r in base]
        x = list(range(1, n + 1))
        ax_loss.fill_between(x, [min(v) for v in zip(*curves)], [max(v) for v in zip(*curves)], color="0.8",
                             label=f"{reference}, range of {len(base)} seeds")
    for i, r in enumerate(base):
        style = ("-", "--", ":", "-.")[i % 4]
        ax_loss.plot(range(1, len(r.steps) + 1), smooth(r.losses, window), color="0.35", lw=0.8, ls=style,
                     label=f"{reference} seed {r.seed}")
        ax_acc.plot([e["step"] for e in r.epochs], [e["val_acc"] for e in r.epochs], color="0.35", lw=0.8,
                    ls=style, marker=".", label=f"{reference} seed {r.seed}")
        if ax_norm is not None and r.grad_norms:
            ax_norm.plot(range(1, len(r.steps) + 1), smooth(r.grad_norms, window), color="0.35", lw=0.8, ls=style,
                         label=f"{reference} seed {r.seed}")
    recipes = list(dict.fromkeys(r.recipe for r in others))
    for r in others:
        c = colors[recipes.index(r.recipe) % len(colors)]
        ax_loss.plot(range(1, len(r.steps) + 1), smooth(r.losses, window), color=c, lw=1.3, label=f"{r.recipe} seed {r.seed}")
        ax_acc.plot([e["step"] for e in r.epochs], [e["val_acc"] for e in r.epochs], color=c, lw=1.3, marker=".",
                    label=f"{r.recipe} seed {r.seed}")
        if ax_norm is not None and r.grad_norms:
            ax_norm.plot(range(1, len(r.steps) + 1), smooth(r.grad_norms, window), color=c, lw=1.3,
                         label=f"{r.recipe} seed {r.seed}")
    ax_loss.set(xlabel="step", ylabel=f"training loss (trailing mean of {window} steps)", title="training loss")
    ax_acc.set(xlabel="step", ylabel="validation accuracy %", title="validation accuracy (each epoch's end)")
    if ax_norm is not None:
        ax_norm.set(xlabel="step", ylabel=f"gradient norm before clipping (trailing mean of {window} steps)",
                    title="gradient norm", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:   # none where no run has steps yet (a launch that failed)
            ax.legend(fontsize=8)
    env = runs[0].header.get("env", {}) if runs else {}
    fig.suptitle(f"{runs[0].header.get('model') if runs else ''} on {device_label(env)}", fontsize=10)
    fig.tight_layout()
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    tmp.replace(out)
    return out
