"""Findings: the measured facts of one analyzed trace, ranked by the time per step they cost, each naming
the recipe that addresses it.

`findings(analysis)` reads only the frames `analyze_trace` builds (busy, categories, kernels, api and
trace_meta); it never opens a trace. One row per finding, ranked by `ms_per_step`:

- **launch-bound** (GPU): the GPU idles for the idle share of the span and the host's launches explain it:
  the host issues one launch per L µs of the span while the average kernel runs K µs, L > K. Remedy: the
  CUDA-graph stages. When the launches do not explain the idle time (or none were recorded), the row is
  **gpu-idle** and says so. A CPU trace (meta `device: cpu`) gets **host-gaps** instead: span time outside
  any CPU operator, with no GPU claim.
- **category**: one row per kernel category (workbench/analysis/categories.py) with the recipe whose passes
  address it, or "none" with the reason.
- **small-kernels** (`small-operators` on a CPU trace): kernel names whose average duration is under
  SMALL_KERNEL_NS: their count per step and time. A cut across the categories, so its time is already
  in them: `partition` is False.

How the time is split, so that nothing counts twice: the rows with `partition` True are the idle row plus
the category rows. Each kernel is in exactly one category; the category rows hold its share of the busy
time (a category's kernel time × busy / kernel_sum, which is the kernel time itself when no kernels overlap
on several streams), so they sum to busy, and idle + busy = span. Their `ms_per_step` therefore sums to the
span per step. Per step means divided by the number of step ranges (`trace_meta['api_steps']`, or the
instances of `--range`); a trace without them is one unit, "trace". The span runs from the first kernel to
the last (summed over the instances with `--range`), so it can hold work before the first step.

Columns: rank (1 = costs most), kind, what (the fact, in words), ms_per_step (float), share_pct (of the
span), remedy (recipe and pass, or "none: <why>"), note, partition (bool: part of the idle + busy split).
With several GPUs: a leading `device` column, one set of rows per GPU, each of its own span.
"""
from __future__ import annotations

import pandas as pd

from workbench.labels import trace_words

SMALL_KERNEL_NS = 5_000  # kernels averaging under 5 µs cost about as much host time to launch as GPU time
LAUNCH_BOUND_BUSY_PCT = 60.0  # below this GPU busy share, idle time is a finding worth a remedy

COLUMNS = ["rank", "kind", "what", "ms_per_step", "share_pct", "remedy", "gain", "gain_x", "note", "partition"]

# The recipes are accelerator stages: a CPU trace gets none, in CPU words only (workbench/labels.py).
CPU_REMEDY = "none: a CPU run (the fused and graph stages are for the accelerator)"
GRAPH_REMEDY = "fmha-graph / block-graph (cuda_graph); torch-compile-graphs for PyTorch alone"

# category -> (remedy, note): the recipe whose passes address it (recipes/*.yaml)
CATEGORY_REMEDY: dict[str, tuple[str, str]] = {
    "attention": ("fmha (fused_attention)", "window attention with bias and mask in one Triton kernel"),
    "softmax": ("fmha (fused_attention)", "the window attention's softmax runs inside the fused kernel"),
    "normalization": ("apex (fused_layernorm)", "LayerNorm forward and backward as Triton kernels"),
    "window gather/scatter": ("window (fused_window)", "shift + partition and reverse + unshift in one kernel each"),
    "copy/memory": ("window (fused_window); apex (master_weights)",
                    "window layout copies fuse into the window kernels; bf16 GEMM weights remove autocast casts"),
    "optimizer": ("apex (fused_adamw)", "one multi-tensor AdamW instead of a for-each chain"),
    "GEMM": ("none: cuBLAS already", "swinbench does not replace the GEMMs"),
    "reduction": ("dense (fused_linear)", "Linear bias gradients (column sums) fused with the GELU backward"),
    "elementwise": ("dense (fused_linear); block (fused_block)",
                    "GELU backward fuses into dense; block leaves fewer residual and cast kernels"),
    "communication": ("none: data parallel's collectives", "the gradient all-reduce; it costs the step only where "
                      "it is not hidden behind the backward (the ranks table's exposed communication)"),
    "other": ("none", "kernels no rule names"),
}

# The measured forms of the remedies: a finding's remedy is measured as these keys of the gains mapping.
# GRAPH_KEY: a stage replayed as one CUDA graph against the same stage as written; a stage name: that stage
# against the stage it extends, in the same run.
GRAPH_KEY = "cuda_graph"
REMEDY_KEYS: dict[str, tuple[str, ...]] = {
    "attention": ("fmha",), "softmax": ("fmha",), "normalization": ("apex",), "window gather/scatter": ("window",),
    "copy/memory": ("window", "apex"), "optimizer": ("apex",), "reduction": ("dense",),
    "elementwise": ("dense", "block"),
}
NOT_MEASURED = "not measured here"
NO_REMEDY = "no remedy"


def _gain(keys: tuple[str, ...], gains) -> tuple[str, float]:
    """(gain text, headline speedup or NaN) of a finding whose remedy is measured as `keys`."""
    if not keys:
        return NO_REMEDY, float("nan")
    measured = [(k, gains[k]) for k in keys if gains and k in gains]
    if not measured:
        return NOT_MEASURED, float("nan")
    parts = [str(g["text"]) for _, g in measured]
    parts += [f"{k}: {NOT_MEASURED}" for k in keys if not gains or k not in gains]
    return "; ".join(parts), float(measured[0][1]["x"])


def _count(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def _unit(meta: dict) -> tuple[int, str]:
    """(how many units the figures are divided by, the unit's name)."""
    steps = meta.get("api_steps")
    if steps and meta.get("api_unit"):
        return int(steps), str(meta["api_unit"])
    return 1, "trace"


def _launches(api: pd.DataFrame | None, units: int, has_units: bool) -> float | None:
    """Kernel launch calls per unit from the api table, or None when it has none."""
    if api is None or not len(api) or "kind" not in api:
        return None
    launch = api[api["kind"] == "launch"]
    if not len(launch):
        return None
    return float(launch["per_step"].sum()) if has_units else float(launch["calls"].sum()) / units


def _one_device(busy: pd.DataFrame, categories: pd.DataFrame, kernels: pd.DataFrame, api, meta: dict,
                units: int, unit: str, gains=None, launch_share: float = 1.0) -> list[dict]:
    words = trace_words(meta)
    ns = dict(zip(busy["metric"], busy["ns"].astype("int64")))
    span, busy_ns, idle_ns, kernel_sum = (int(ns.get(k, 0)) for k in ("span", "busy", "idle", "kernel_sum"))
    if span <= 0:
        return []

    def row(kind, what, total_ns, remedy, note, partition=True, keys=()):
        gain, gain_x = _gain(keys, gains)
        return {"kind": kind, "what": what, "ms_per_step": total_ns / units / 1e6,
                "share_pct": total_ns * 100.0 / span, "remedy": remedy, "gain": gain, "gain_x": gain_x,
                "note": note, "partition": partition}

    rows = []
    idle_pct = idle_ns * 100.0 / span
    n_kernels = int(categories["instances"].sum()) if len(categories) else 0
    if words.is_cpu:
        rows.append(row("host-gaps", f"{idle_pct:.1f}% of the span is outside any CPU operator", idle_ns,
                        CPU_REMEDY,
                        "Python, autograd and framework time between operators"))
    else:
        launches = _launches(api, units, unit != "trace")
        launches = launches * launch_share if launches is not None else None
        avg_kernel_us = kernel_sum / n_kernels / 1e3 if n_kernels else 0.0
        every_us = span / units / launches / 1e3 if launches else None
        explained = every_us is not None and every_us > avg_kernel_us and idle_pct > 100 - LAUNCH_BOUND_BUSY_PCT
        if explained:
            rows.append(row("launch-bound", f"the GPU idles {idle_pct:.1f}% of the span: {launches:,.0f} launches per "
                            f"{unit}, one every {every_us:,.1f} µs, while the average kernel runs {avg_kernel_us:,.1f} µs",
                            idle_ns, GRAPH_REMEDY, "the host's launch rate, not the GPU, sets the step time",
                            keys=(GRAPH_KEY,)))
        else:
            why = ("no launch calls recorded" if every_us is None else
                   f"launches (one every {every_us:,.1f} µs) do not explain it" if idle_pct > 100 - LAUNCH_BOUND_BUSY_PCT
                   else "the GPU is mostly busy")
            graph = every_us is not None and idle_pct > 100 - LAUNCH_BOUND_BUSY_PCT
            rows.append(row("gpu-idle", f"the GPU idles {idle_pct:.1f}% of the span", idle_ns,
                            GRAPH_REMEDY if graph else "none", why, keys=(GRAPH_KEY,) if graph else ()))
    # Each kernel is in one category; scale to busy so overlapping streams do not count twice.
    scale = min(1.0, busy_ns / kernel_sum) if kernel_sum else 0.0
    for cat in categories.itertuples(index=False):
        remedy, note = CATEGORY_REMEDY.get(str(cat.category), ("none", ""))
        keys = REMEDY_KEYS.get(str(cat.category), ())
        if words.is_cpu:
            remedy, note, keys = CPU_REMEDY, "", ()
        rows.append(row("category", f"{cat.category}: {_count(cat.instances / units)} {words.units} per {unit}, "
                        f"{cat.share_pct:.1f}% of {words.time}", cat.total_ns * scale, remedy, note, keys=keys))
    small = kernels[kernels["avg_ns"] < SMALL_KERNEL_NS] if len(kernels) else kernels
    if len(small):
        count = float(small["instances"].sum()) / units
        rows.append(row(f"small-{words.units}", f"{count:,.0f} {words.units} per {unit} under {SMALL_KERNEL_NS / 1e3:g} µs "
                        f"each ({len(small):,} names)", float(small["total_ns"].sum()) * scale,
                        CPU_REMEDY if words.is_cpu else GRAPH_REMEDY,
                        "already counted in the categories" + ("" if words.is_cpu else
                                                               "; each costs a launch more than GPU time"),
                        partition=False, keys=() if words.is_cpu else (GRAPH_KEY,)))
    return rows


def findings(analysis, gains=None) -> pd.DataFrame:
    """Findings of an `Analysis` (workbench/analysis/analyze.py) as a frame with COLUMNS (see the module
    docstring for what each row is and how the time is split), ranked by ms_per_step, largest first.
    gains: {remedy key (GRAPH_KEY or a stage in REMEDY_KEYS): {"x": speedup, "text": words}}, the measured
    gains of the remedies on this GPU and model, or None; a remedy missing from it is "not measured here"."""
    meta = analysis.trace_meta
    units, unit = _unit(meta)
    if "device" in analysis.categories:
        rows = []
        for device in analysis.devices:
            one = [f[f["device"] == device].drop(columns="device") for f in
                   (analysis.busy, analysis.categories, analysis.kernels)]
            steps = (meta.get("device_steps") or {}).get(device) or units
            # each launch starts a kernel on one GPU: this GPU's share of the host's launches
            total = int(analysis.categories["instances"].sum())
            share = int(one[1]["instances"].sum()) / total if total else 1.0
            rows += [{"device": device, **r}
                     for r in _one_device(*one, analysis.api, meta, steps, unit, gains, launch_share=share)]
    else:
        rows = _one_device(analysis.busy, analysis.categories, analysis.kernels, analysis.api, meta, units, unit,
                           gains)
    cols = (["device"] if rows and "device" in rows[0] else []) + COLUMNS
    if not rows:
        return pd.DataFrame(columns=cols)
    out = pd.DataFrame(rows).sort_values("ms_per_step", ascending=False, kind="stable").reset_index(drop=True)
    out["rank"] = range(1, len(out) + 1)
    return out[cols]
