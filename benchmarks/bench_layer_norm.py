"""LayerNorm and residual add + LayerNorm: torch vs the Triton kernels, on Swin-B shapes at batch 64.

    python benchmarks/bench_layer_norm.py --check --out results/bench_layer_norm_h200.json

Variants (op / impl):
  layer_norm      torch   F.layer_norm(x)
  layer_norm      triton  workbench.kernels.layer_norm(x)
  add_layer_norm  torch   s = x + r; F.layer_norm(s)                  (both s and the normed output are used)
  add_layer_norm  triton  workbench.kernels.add_layer_norm(x, r)
Modes: fwd (no autograd) and fwd+bwd (backward from random gradients on every output; x, r, weight and
bias all need gradients). Dtypes: bf16 (x, r, weight, bias all bf16), fp32, and amp (what Swin sees under
bf16 autocast: the residual stream x fp32, the branch r bf16, parameters fp32; add_layer_norm only, as
layer_norm on fp32 input is the fp32 case).

Timing: triton.testing.do_bench (CUDA events, L2 flushed between reps, gradients reset to None), median and
20th/80th percentiles. The first call of each variant (Triton compile, cuBLAS/cuDNN-free but lazy init) is
timed separately and reported as first_call_s, never mixed into the medians.
GB/s: the bytes the op must move at least (read inputs, write outputs, in each tensor's dtype; plus fp32
mean/rstd per row) over the median time. Torch and Triton rows of one op share that numerator, so a GB/s
ratio is a speed ratio.

--check first compares every Triton variant with torch (computed in fp32 on the same inputs) on the same
shapes and exits non-zero on a mismatch. --out FILE writes {"environment": environment_stamp(), "settings",
"records": [...flat dicts...], "check": [...]} as JSON.
Without a GPU the kernels run in Triton's interpreter on tiny shapes: a smoke test, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.nn.functional as F  # noqa: E402

from workbench.env import device_label, environment_stamp  # noqa: E402
from workbench.kernels.layer_norm import add_layer_norm, layer_norm  # noqa: E402

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
OPS = ("layer_norm", "add_layer_norm")
IMPLS = ("torch", "triton")
MODES = ("fwd", "fwd+bwd")
# --check: max |ours - ref| / max |ref| per output and gradient.
CHECK_TOL = {"bf16": 2e-2, "fp32": 1e-4, "amp": 2e-2}


def make_inputs(rows: int, C: int, dtype_name: str, device: str, requires_grad: bool) -> dict:
    """Fresh random x, r, weight, bias and upstream gradients ds, dy (never zeros)."""
    x_dt, r_dt, p_dt = DTYPES[dtype_name]
    g = torch.Generator(device=device).manual_seed(rows * 7919 + C)

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
    if impl == "torch":
        def torch_add_layer_norm(t):
            s = t["x"] + t["r"]
            return s, F.layer_norm(s, s.shape[-1:], t["w"], t["b"], EPS)
        return torch_add_layer_norm
    return lambda t: add_layer_norm(t["x"], t["r"], t["w"], t["b"], EPS)


def leaves(op: str, t: dict) -> list[torch.Tensor]:
    return [t["x"], t["w"], t["b"]] + ([t["r"]] if op == "add_layer_norm" else [])


def step_fn(op: str, impl: str, mode: str, t: dict):
    fwd = forward_fn(op, impl)
    if mode == "fwd":
        def run_fwd():
            with torch.no_grad():
                fwd(t)
        return run_fwd
    grads = (t["ds"], t["dy"]) if op == "add_layer_norm" else (t["dy"],)

    def run_fwd_bwd():
        torch.autograd.backward(fwd(t), grads)
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
    else:
        fwd = n * (ex + er + es + es) + stats           # read x, r, write s, y
        dres = 0 if ex == er else n * er                # one gradient serves both inputs when dtypes match
        bwd = n * (es + es + es + ex) + dres + stats    # read s, ds, dy, write dx (and dr)
    return fwd if mode == "fwd" else fwd + bwd


def _timed(fn, grad_to_none, warmup_ms: float, rep_ms: float) -> tuple[float, float, float]:
    """(median, p20, p80) milliseconds."""
    if torch.cuda.is_available():
        from triton.testing import do_bench

        q = do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, quantiles=[0.5, 0.2, 0.8])
        return float(q[0]), float(q[1]), float(q[2])
    times = []
    for _ in range(3):
        for t in grad_to_none:
            t.grad = None
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times), max(times)


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
        names = ["x", "w", "b"] + (["r"] if op == "add_layer_norm" else [])
        outs = forward_fn(op, "triton")(t)
        refs = forward_fn(op, "torch")(ref_t)
        grads = (t["ds"], t["dy"]) if op == "add_layer_norm" else (t["dy"],)
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


def measure(shapes, dtype_names, device, warmup_ms, rep_ms) -> list[dict]:
    records = []
    for dtype_name, rows, C, op in configs(shapes, dtype_names):
        for mode in MODES:
            t = make_inputs(rows, C, dtype_name, device, requires_grad=(mode != "fwd"))
            for impl in IMPLS:
                fn = step_fn(op, impl, mode, t)
                grad_to_none = leaves(op, t) if mode != "fwd" else []
                _sync()
                start = time.perf_counter()
                fn()
                _sync()
                first_call_s = time.perf_counter() - start
                med, p20, p80 = _timed(fn, grad_to_none, warmup_ms, rep_ms)
                nbytes = bytes_moved(op, mode, rows, C, dtype_name)
                records.append({
                    "op": op, "impl": impl, "mode": mode, "dtype": dtype_name, "rows": rows, "C": C,
                    "ms_median": med, "ms_p20": p20, "ms_p80": p80, "bytes": nbytes,
                    "gbps": nbytes / (med * 1e-3) / 1e9, "first_call_s": first_call_s,
                })
            del t
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
                     "speedup": tr["ms_median"] / tt["ms_median"]})
    return rows


def format_table(records: list[dict]) -> str:
    head = (f"{'op':<15} {'mode':<8} {'dtype':<5} {'rows x C':>13} | {'torch ms [p20-p80]':>24} {'GB/s':>6} | "
            f"{'triton ms [p20-p80]':>24} {'GB/s':>6} | {'speedup':>7}")
    lines = [head, "-" * len(head)]
    for s in speedups(records):
        lines.append(
            f"{s['op']:<15} {s['mode']:<8} {s['dtype']:<5} {s['rows']:>8}x{s['C']:<4} | "
            f"{s['torch_ms']:>8.4f} [{s['torch_spread'][0]:.4f}-{s['torch_spread'][1]:.4f}] {s['torch_gbps']:>6.0f} | "
            f"{s['triton_ms']:>8.4f} [{s['triton_spread'][0]:.4f}-{s['triton_spread'][1]:.4f}] {s['triton_gbps']:>6.0f} | "
            f"{s['speedup']:>6.2f}x")
    return "\n".join(lines)


def verdict(records: list[dict]) -> list[str]:
    """One line per op: where Triton loses to torch, say so (the pass keeps the faster one: see
    workbench/passes/fused_layernorm.py AUTO_GPU_IMPL)."""
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
        where = ", ".join(f"{s['mode']} {s['dtype']} C={s['C']} ({s['speedup']:.2f}x)" for s in losses)
        lines.append(f"{op}: Triton vs torch geomean {geo:.2f}x (fwd+bwd {tgeo:.2f}x); "
                     + (f"Triton LOSES on {len(losses)}/{len(rows)}: {where}" if losses
                        else f"Triton wins on all {len(rows)}"))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="verify Triton vs torch first; exit 1 on mismatch")
    ap.add_argument("--out", type=Path, help="write records + environment stamp as JSON here")
    ap.add_argument("--dtypes", default="bf16,fp32,amp", help="comma list of bf16, fp32, amp")
    ap.add_argument("--warmup-ms", type=float, default=10.0)
    ap.add_argument("--rep-ms", type=float, default=40.0)
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

    records = measure(shapes, dtype_names, device, args.warmup_ms, args.rep_ms)
    print(format_table(records))
    for line in verdict(records):
        print("# " + line)
    compile_s = sum(r["first_call_s"] for r in records if r["impl"] == "triton")
    print(f"# first calls (Triton compile included, not in the medians): triton {compile_s:.1f} s, "
          f"torch {sum(r['first_call_s'] for r in records if r['impl'] == 'torch'):.1f} s; "
          f"total {time.perf_counter() - t0:.1f} s")

    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"benchmark": "bench_layer_norm", "environment": stamp,
                   "settings": {"batch": BATCH, "shapes": shapes, "dtypes": dtype_names, "eps": EPS,
                                "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms},
                   "records": records, "check": checks}
        args.out.write_text(json.dumps(payload, indent=1))
        print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
