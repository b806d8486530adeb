"""LayerNorm and residual add + LayerNorm: torch vs the Triton kernels, on Swin-B shapes at batch 64.

    python benchmarks/bench_layer_norm.py --check        # writes benchmarks/results/layer_norm.{json,md}

Variants (op / impl):
  layer_norm      torch   F.layer_norm(x)
  layer_norm      triton  workbench.kernels.layer_norm(x)
  add_layer_norm  torch   s = x + r; F.layer_norm(s)                  (both s and the normed output are used)
  add_layer_norm  triton  workbench.kernels.add_layer_norm(x, r)
  post_add_layer_norm  torch   x + F.layer_norm(r)                 (SwinV2's post-norm residual add; under amp
                               the layer_norm runs in autocast, as SwinV2's does: fp32 out of a bf16 r)
  post_add_layer_norm  triton  workbench.kernels.post_add_layer_norm(r, x)  (one pass; LN(r) never written)
Modes: fwd (no autograd) and fwd+bwd (backward from random gradients on every output; x, r, weight and
bias all need gradients). Dtypes: bf16 (x, r, weight, bias all bf16), fp32, and amp (what Swin sees under
bf16 autocast: the residual stream x fp32, the branch r bf16, parameters fp32; add_layer_norm only, as
layer_norm on fp32 input is the fp32 case).

Timing, two ways for every variant:
  graph (ms_median, p20/p80): GPU time per call: 16 back-to-back calls captured into one CUDA graph,
    replays timed with CUDA events; calls rotate over enough input sets that their data is >= 3x the 60 MB
    L2. No host launch overhead: this is the kernels' own speed.
  call (call_ms): plain Python calls back to back, CUDA events around the loop, per call. On a slow host
    this is the launch path (Python, autograd, Triton's launcher); training pays it unless it runs under
    CUDA graphs.
fwd+bwd uses torch.autograd.grad (no .grad accumulation kernels). The first call of each variant (Triton
compile) is timed separately as first_call_s, never mixed into the medians.
GB/s: the bytes the op must move at least (read inputs, write outputs, in each tensor's dtype; plus fp32
mean/rstd per row) over the graph median. Torch and Triton rows of one op share that numerator, so a GB/s
ratio is a speed ratio. The table prints bf16 and amp rows; fp32 rows are in the JSON and the verdict lines.

--check first compares every Triton variant with torch (computed in fp32 on the same inputs) on the same
shapes and exits non-zero on a mismatch. Results: benchmarks/results/layer_norm.json ({"environment":
environment_stamp(), "settings", "records": [...flat dicts...], "check": [...]}) and layer_norm.md.
Without a GPU the kernels run in Triton's interpreter on tiny shapes: a smoke test, not a measurement
(nothing is written unless --out-dir is given).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch.nn.functional as F  # noqa: E402

from _results import add_out_dir_argument, markdown_table, out_dir_for, write_results  # noqa: E402
from workbench.env import device_label, environment_stamp  # noqa: E402
from workbench.kernels.layer_norm import add_layer_norm, layer_norm, post_add_layer_norm  # noqa: E402
from workbench.optimize.timing import cuda_graph_us, per_call_us  # noqa: E402

BATCH = 64
# (rows, C) of the LayerNorms in Swin-B's four stages at batch 64.
SWIN_B_SHAPES = [(BATCH * 56 * 56, 128), (BATCH * 28 * 28, 256), (BATCH * 14 * 14, 512), (BATCH * 49, 1024)]
# Interpreter smoke-test shapes (no GPU).
CPU_SHAPES = [(2 * 49 + 1, 128), (49, 1024)]
EPS = 1e-5
DTYPES = {  # name -> (x dtype, residual dtype, parameter dtype)
    "bf16": (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    "fp32": (torch.float32, torch.float32, torch.float32),
    "amp": (torch.float32, torch.bfloat16, torch.float32),
}
OPS = ("layer_norm", "add_layer_norm", "post_add_layer_norm")
TWO_OUTPUTS = ("add_layer_norm",)   # outputs s and y; post_add_layer_norm's one output is the sum
IMPLS = ("torch", "triton")
MODES = ("fwd", "fwd+bwd")
# --check: max |ours - ref| / max |ref| per output and gradient.
CHECK_TOL = {"bf16": 2e-2, "fp32": 1e-4, "amp": 2e-2}


def make_inputs(rows: int, C: int, dtype_name: str, device: str, requires_grad: bool, seed: int = 0) -> dict:
    """Fresh random x, r, weight, bias and upstream gradients ds, dy (never zeros)."""
    x_dt, r_dt, p_dt = DTYPES[dtype_name]
    g = torch.Generator(device=device).manual_seed(rows * 7919 + C + 1000003 * seed)

    def rand(shape, dtype, scale=1.0, shift=0.0):
        t = torch.randn(shape, generator=g, device=device, dtype=torch.float32) * scale + shift
        return t.to(dtype).requires_grad_(requires_grad)

    s_dt = torch.promote_types(x_dt, r_dt)
    return {
        "x": rand((rows, C), x_dt, 2.0, 0.5), "r": rand((rows, C), r_dt),
        "w": rand((C,), p_dt, 0.5, 1.0), "b": rand((C,), p_dt, 0.5),
        "ds": rand((rows, C), s_dt).detach(), "dy": rand((rows, C), s_dt).detach(),
    }


def forward_fn(op: str, impl: str):
    """(inputs dict) -> tuple of outputs."""
    if op == "layer_norm" and impl == "torch":
        return lambda t: (F.layer_norm(t["x"], t["x"].shape[-1:], t["w"], t["b"], EPS),)
    if op == "layer_norm":
        return lambda t: (layer_norm(t["x"], t["w"], t["b"], EPS),)
    if op == "post_add_layer_norm" and impl == "torch":
        def torch_post_add_layer_norm(t):
            # amp: the norm under autocast (fp32 out of a half r, as SwinV2's norm1/norm2 run in training)
            amp = t["x"].dtype == torch.float32 and t["r"].dtype != torch.float32
            with torch.autocast(t["r"].device.type, dtype=t["r"].dtype, enabled=amp):
                y = F.layer_norm(t["r"], t["r"].shape[-1:], t["w"], t["b"], EPS)
            return (t["x"] + y,)
        return torch_post_add_layer_norm
    if op == "post_add_layer_norm":
        return lambda t: (post_add_layer_norm(t["r"], t["x"], t["w"], t["b"], EPS),)
    if impl == "torch":
        def torch_add_layer_norm(t):
            s = t["x"] + t["r"]
            return s, F.layer_norm(s, s.shape[-1:], t["w"], t["b"], EPS)
        return torch_add_layer_norm
    return lambda t: add_layer_norm(t["x"], t["r"], t["w"], t["b"], EPS)


def leaves(op: str, t: dict) -> list[torch.Tensor]:
    return [t["x"], t["w"], t["b"]] + ([t["r"]] if op != "layer_norm" else [])


def step_fn(op: str, impl: str, mode: str, t: dict):
    fwd = forward_fn(op, impl)
    if mode == "fwd":
        def run_fwd():
            with torch.no_grad():
                return fwd(t)
        return run_fwd
    grads = (t["ds"], t["dy"]) if op in TWO_OUTPUTS else (t["ds"],) if op == "post_add_layer_norm" else (t["dy"],)
    inputs = leaves(op, t)

    def run_fwd_bwd():  # autograd.grad: gradients returned, not accumulated into .grad
        return torch.autograd.grad(fwd(t), inputs, grads)
    return run_fwd_bwd


def bytes_moved(op: str, mode: str, rows: int, C: int, dtype_name: str) -> int:
    """The least traffic the op needs (see module docstring)."""
    x_dt, r_dt, _ = DTYPES[dtype_name]
    ex, er = torch.tensor([], dtype=x_dt).element_size(), torch.tensor([], dtype=r_dt).element_size()
    es = torch.tensor([], dtype=torch.promote_types(x_dt, r_dt)).element_size()
    n, stats = rows * C, rows * 8  # fp32 mean + rstd per row
    if op == "layer_norm":
        fwd = n * (ex + ex) + stats                     # read x, write y
        bwd = n * (ex + ex + ex) + stats                # read x, dy, write dx
    elif op == "post_add_layer_norm":
        fwd = n * (er + ex + es) + stats                # read r, x, write s = x + LN(r)
        bwd = n * (es + er + er) + stats                # read ds, r, write dr (x's gradient is ds itself)
    else:
        fwd = n * (ex + er + es + es) + stats           # read x, r, write s, y
        dres = 0 if ex == er else n * er                # one gradient serves both inputs when dtypes match
        bwd = n * (es + es + es + ex) + dres + stats    # read s, ds, dy, write dx (and dr)
    return fwd if mode == "fwd" else fwd + bwd


L2_BYTES = 60 * 2**20
GRAPH_CALLS = 16


def call_ms(fns: list, loops: int = 5, calls: int = 10) -> tuple[float, float, float]:
    """(median, p20, p80) ms per plain call, host overhead included (workbench.optimize.timing)."""
    if not torch.cuda.is_available():  # interpreter smoke test: a couple of calls is plenty
        loops, calls = 1, 2
    return tuple(us / 1e3 for us in per_call_us(fns, loops=loops, calls=calls))


def graph_ms(fns: list, replays: int) -> tuple[float, float, float]:
    """(median, p20, p80) GPU ms per call: GRAPH_CALLS calls round robin over fns captured in one CUDA graph,
    replays timed with CUDA events (workbench.optimize.timing.cuda_graph_us)."""
    if not torch.cuda.is_available():
        return call_ms(fns, 1, 2)
    return tuple(us / 1e3 for us in cuda_graph_us(fns, replays=replays, calls=GRAPH_CALLS))


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def configs(shapes, dtype_names):
    for dtype_name in dtype_names:
        for rows, C in shapes:
            for op in OPS:
                if op == "layer_norm" and dtype_name == "amp":
                    continue  # fp32 input: the fp32 rows already cover it
                yield dtype_name, rows, C, op


def check(shapes, dtype_names, device) -> list[dict]:
    """Triton vs torch-in-fp32 on every config: one record per output/gradient with its normalized error."""
    results = []
    for dtype_name, rows, C, op in configs(shapes, dtype_names):
        t = make_inputs(rows, C, dtype_name, device, requires_grad=True)
        ref_t = {k: (v.detach().float().requires_grad_(v.requires_grad)) for k, v in t.items()}
        names = ["x", "w", "b"] + (["r"] if op != "layer_norm" else [])
        outs = forward_fn(op, "triton")(t)
        refs = forward_fn(op, "torch")(ref_t)
        grads = (t["ds"], t["dy"]) if op in TWO_OUTPUTS else (t["ds"],) if op == "post_add_layer_norm" else (t["dy"],)
        torch.autograd.backward(outs, grads)
        torch.autograd.backward(refs, tuple(g.float() for g in grads))
        pairs = [(f"out{i}", o, e) for i, (o, e) in enumerate(zip(outs, refs))]
        pairs += [(f"d{n}", t[n].grad, ref_t[n].grad) for n in names]
        for what, ours, ref in pairs:
            ref = ref.detach().float()
            err = ((ours.detach().float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
            ok = bool(torch.isfinite(ours).all()) and err <= CHECK_TOL[dtype_name]
            results.append({"op": op, "dtype": dtype_name, "rows": rows, "C": C, "what": what,
                            "rel_max_err": err, "ok": ok})
        del t, ref_t, outs, refs
    return results


def measure(shapes, dtype_names, device, replays) -> list[dict]:
    records = []
    for dtype_name, rows, C, op in configs(shapes, dtype_names):
        for mode in MODES:
            nbytes = bytes_moved(op, mode, rows, C, dtype_name)
            n_sets = max(1, min(8, -(-3 * L2_BYTES // nbytes)))
            sets = [make_inputs(rows, C, dtype_name, device, requires_grad=(mode != "fwd"), seed=k)
                    for k in range(n_sets)]
            for impl in IMPLS:
                fns = [step_fn(op, impl, mode, t) for t in sets]
                _sync()
                start = time.perf_counter()
                fns[0]()
                _sync()
                first_call_s = time.perf_counter() - start
                med, p20, p80 = graph_ms(fns, replays)
                cmed, cp20, cp80 = call_ms(fns)
                records.append({
                    "op": op, "impl": impl, "mode": mode, "dtype": dtype_name, "rows": rows, "C": C,
                    "ms_median": med, "ms_p20": p20, "ms_p80": p80, "bytes": nbytes, "input_sets": n_sets,
                    "gbps": nbytes / (med * 1e-3) / 1e9, "first_call_s": first_call_s,
                    "call_ms": cmed, "call_ms_p20": cp20, "call_ms_p80": cp80,
                })
            del sets, fns
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return records


def speedups(records: list[dict]) -> list[dict]:
    """One row per (op, mode, dtype, shape): torch and triton medians and torch/triton."""
    by_key: dict[tuple, dict] = {}
    for r in records:
        key = (r["op"], r["mode"], r["dtype"], r["rows"], r["C"])
        by_key.setdefault(key, {})[r["impl"]] = r
    rows = []
    for (op, mode, dtype, n, C), pair in by_key.items():
        tr, tt = pair["torch"], pair["triton"]
        rows.append({"op": op, "mode": mode, "dtype": dtype, "rows": n, "C": C,
                     "torch_ms": tr["ms_median"], "torch_spread": (tr["ms_p20"], tr["ms_p80"]),
                     "triton_ms": tt["ms_median"], "triton_spread": (tt["ms_p20"], tt["ms_p80"]),
                     "torch_gbps": tr["gbps"], "triton_gbps": tt["gbps"],
                     "torch_call_ms": tr["call_ms"], "triton_call_ms": tt["call_ms"],
                     "speedup": tr["ms_median"] / tt["ms_median"],
                     "speedup_call": tr["call_ms"] / tt["call_ms"]})
    return rows


def format_table(records: list[dict], dtypes=("bf16", "amp")) -> str:
    """One line per (op, dtype, shape): fwd and fwd+bwd, GPU time from graph replay (us) and per plain call."""
    by = {(s["op"], s["dtype"], s["rows"], s["C"], s["mode"]): s for s in speedups(records)}
    head = (f"{'op':<19} {'dtype':<5} {'rows x C':>12} | {'graph us fwd: torch':>19} {'triton':>6} {'x':>5} | "
            f"{'fwd+bwd: torch':>14} {'triton':>6} {'x':>5} {'GB/s':>5} | {'per call fwd+bwd: torch':>23} {'triton':>6}")
    lines = [head]
    for (op, dtype, n, C, mode), f in by.items():
        if mode != "fwd" or dtype not in dtypes:
            continue
        b = by[(op, dtype, n, C, "fwd+bwd")]
        lines.append(f"{op:<19} {dtype:<5} {n:>7}x{C:<4} | {f['torch_ms'] * 1e3:>19.1f} {f['triton_ms'] * 1e3:>6.1f} "
                     f"{f['speedup']:>4.2f}x | {b['torch_ms'] * 1e3:>14.1f} {b['triton_ms'] * 1e3:>6.1f} {b['speedup']:>4.2f}x "
                     f"{b['triton_gbps']:>5.0f} | {b['torch_call_ms'] * 1e3:>23.1f} {b['triton_call_ms'] * 1e3:>6.1f}")
    return "\n".join(lines)


def markdown_rows(records: list[dict], dtypes=("bf16", "fp32", "amp")) -> list[list[str]]:
    """The results table: one row per (op, dtype, shape), GPU µs by graph replay and µs per plain call."""
    by = {(s["op"], s["dtype"], s["rows"], s["C"], s["mode"]): s for s in speedups(records)}
    rows = []
    for (op, dtype, n, C, mode), f in by.items():
        if mode != "fwd" or dtype not in dtypes:
            continue
        b = by[(op, dtype, n, C, "fwd+bwd")]
        rows.append([op, dtype, f"{n}×{C}", f"{f['torch_ms'] * 1e3:.1f}", f"{f['triton_ms'] * 1e3:.1f}",
                     f"{b['torch_ms'] * 1e3:.1f}", f"{b['triton_ms'] * 1e3:.1f}", f"{b['speedup']:.2f}x",
                     f"{b['triton_gbps']:.0f}", f"{b['torch_call_ms'] * 1e3:.0f} / {b['triton_call_ms'] * 1e3:.0f}"])
    return rows


MD_HEADERS = ["op", "dtype", "rows × C", "fwd torch µs", "fwd Triton µs", "fwd+bwd torch µs", "fwd+bwd Triton µs",
              "fwd+bwd speedup", "Triton GB/s", "per call fwd+bwd µs, torch / Triton"]


def verdict(records: list[dict]) -> list[str]:
    """One line per op: where Triton loses to torch, say so (the pass keeps the faster one: see
    workbench/optimize/passes/fused_layernorm.py AUTO_GPU_IMPL)."""
    lines = []
    for op in OPS:
        rows = [s for s in speedups(records) if s["op"] == op]
        if not rows:
            continue
        losses = [s for s in rows if s["speedup"] < 1.0]
        geo = 1.0
        for s in rows:
            geo *= s["speedup"]
        geo **= 1.0 / len(rows)
        train = [s for s in rows if s["mode"] == "fwd+bwd"]
        tgeo = 1.0
        for s in train:
            tgeo *= s["speedup"]
        tgeo = tgeo ** (1.0 / len(train)) if train else float("nan")
        cgeo = 1.0
        for s in train:
            cgeo *= s["speedup_call"]
        cgeo = cgeo ** (1.0 / len(train)) if train else float("nan")
        where = ", ".join(f"{s['mode']} {s['dtype']} C={s['C']} ({s['speedup']:.2f}x)" for s in losses[:4])
        lines.append(f"{op}: Triton vs torch GPU time geomean {geo:.2f}x (fwd+bwd {tgeo:.2f}x; per plain call fwd+bwd "
                     f"{cgeo:.2f}x); "
                     + (f"Triton LOSES (GPU time) on {len(losses)}/{len(rows)}: {where}" if losses
                        else f"Triton wins on all {len(rows)}"))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="verify Triton vs torch first; exit 1 on mismatch")
    add_out_dir_argument(ap)
    ap.add_argument("--dtypes", default="bf16,fp32,amp", help="comma list of bf16, fp32, amp")
    ap.add_argument("--replays", type=int, default=20, help="graph replays timed per measurement")
    args = ap.parse_args(argv)

    dtype_names = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtype_names if d not in DTYPES]
    if bad:
        print(f"error: unknown dtype(s) {', '.join(bad)}: choose from {', '.join(DTYPES)}", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = SWIN_B_SHAPES if device == "cuda" else CPU_SHAPES
    stamp = environment_stamp(device)
    print(f"# bench_layer_norm on {device_label(stamp)}; torch {stamp['torch']}, triton {stamp['triton']}")
    if device == "cpu":
        print("# no GPU: Triton interpreter on tiny shapes - a smoke test, the times mean nothing")
    t0 = time.perf_counter()

    checks = []
    if args.check:
        checks = check(shapes, dtype_names, device)
        failed = [c for c in checks if not c["ok"]]
        worst = max(checks, key=lambda c: c["rel_max_err"] / CHECK_TOL[c["dtype"]])
        print(f"# check: {len(checks) - len(failed)}/{len(checks)} outputs/gradients within tolerance "
              f"(worst {worst['op']} {worst['dtype']} C={worst['C']} {worst['what']}: "
              f"{worst['rel_max_err']:.2e} of max |ref|)")
        if failed:
            for c in failed:
                print(f"MISMATCH {c['op']} {c['dtype']} rows={c['rows']} C={c['C']} {c['what']}: "
                      f"{c['rel_max_err']:.3e} > {CHECK_TOL[c['dtype']]}", file=sys.stderr)
            return 1

    records = measure(shapes, dtype_names, device, args.replays)
    print(format_table(records))
    for line in verdict(records):
        print("# " + line)
    compile_s = sum(r["first_call_s"] for r in records if r["impl"] == "triton")
    print(f"# first calls (Triton compile included, not in the medians): triton {compile_s:.1f} s, "
          f"torch {sum(r['first_call_s'] for r in records if r['impl'] == 'torch'):.1f} s; "
          f"total {time.perf_counter() - t0:.1f} s")

    settings = {"batch": BATCH if device == "cuda" else None, "shapes": shapes, "dtypes": dtype_names, "eps": EPS,
                "replays": args.replays, "graph_calls": GRAPH_CALLS,
                "timing": "ms_*: CUDA-graph replay of back-to-back calls; call_ms: plain calls, host included"}
    written = write_results(
        out_dir_for(args.out_dir, device == "cuda"), "layer_norm",
        title="LayerNorm and add + LayerNorm: torch against the Triton kernels (Swin-B shapes, batch 64)",
        stamp=stamp, settings=settings, records=records, check=checks,
        table=markdown_table(MD_HEADERS, markdown_rows(records, dtype_names)),
        notes=["GPU µs: CUDA-graph replay of 16 back-to-back calls over input sets >= 3x the L2, median of "
               f"{args.replays} replays; per call: plain calls, host included.",
               "amp: fp32 residual stream x, bf16 branch r, fp32 parameters (what Swin sees under bf16 autocast).",
               *verdict(records)])
    for path in written:
        print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
