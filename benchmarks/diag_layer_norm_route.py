"""layer_norm / add_layer_norm through their own kernels or through window.py's (LN_VIA_WINDOW), side by side.

    python benchmarks/diag_layer_norm_route.py --out results/diag_layer_norm_route_h200.json

For each Swin-B shape at batch 64 (bench_layer_norm's), bf16 and amp, forward + backward through autograd:
  graph_us: GPU time per call, CUDA-graph replay (bench_layer_norm's timing), each route captured alone;
  call_us:  time per plain call, host included, the two routes timed in alternation (`--rounds` rounds
            of 10 calls each), so that a host that drifts during the run drifts for both alike; the
            median of each route's rounds and the median of the per-round ratios.
Both routes are checked against each other first (outputs and every gradient, 2e-2 of max |ref| in half
precision). The route is layer_norm.LN_VIA_WINDOW, set before each call.
Without a GPU the kernels run in Triton's interpreter on tiny shapes: a smoke test, not a measurement.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_layer_norm import (CPU_SHAPES, GRAPH_CALLS, L2_BYTES, SWIN_B_SHAPES, bytes_moved, configs,  # noqa: E402
                              make_inputs, step_fn)

from workbench.env import device_label, environment_stamp  # noqa: E402  (bench_layer_norm put the repo on sys.path)
from workbench.timing import cuda_graph_us, per_call_us  # noqa: E402

ln = importlib.import_module("workbench.kernels.layer_norm")  # the module (the package exports a function of that name)
ROUTES = {"own": False, "window": True}


def routed(fn, via_window: bool):
    def call():
        ln.LN_VIA_WINDOW = via_window
        return fn()
    return call


def check(op, dtype_name, rows, C, device) -> float:
    """max over outputs and gradients of |window - own| / max |own|."""
    outs = {}
    for route, flag in ROUTES.items():
        t = make_inputs(rows, C, dtype_name, device, requires_grad=True)
        fwd_bwd = step_fn(op, "triton", "fwd+bwd", t)
        ln.LN_VIA_WINDOW = flag
        outs[route] = [g.float() for g in fwd_bwd()]
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
               for a, b in zip(outs["window"], outs["own"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rounds", type=int, default=12, help="alternating rounds of plain calls per route")
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = SWIN_B_SHAPES if device == "cuda" else CPU_SHAPES[:1]
    rounds = args.rounds if device == "cuda" else 2
    stamp = environment_stamp(device)
    print(f"# diag_layer_norm_route on {device_label(stamp)}; torch {stamp['torch']}, triton {stamp['triton']}")
    records = []
    for dtype_name, rows, C, op in configs(shapes, ("bf16", "amp")):
        err = check(op, dtype_name, rows, C, device)
        if err > 2e-2:
            print(f"MISMATCH {op} {dtype_name} {rows}x{C}: {err:.3e}", file=sys.stderr)
            return 1
        nbytes = bytes_moved(op, "fwd+bwd", rows, C, dtype_name)
        sets = [make_inputs(rows, C, dtype_name, device, requires_grad=True, seed=k)
                for k in range(max(1, min(8, -(-3 * L2_BYTES // nbytes))))]
        fns = {route: [routed(step_fn(op, "triton", "fwd+bwd", t), flag) for t in sets]
               for route, flag in ROUTES.items()}
        rec = {"op": op, "dtype": dtype_name, "rows": rows, "C": C, "bytes": nbytes, "max_rel_diff": err}
        for route in ROUTES:
            rec[f"{route}_graph_us"] = (cuda_graph_us(fns[route], replays=args.replays, calls=GRAPH_CALLS)[0]
                                        if device == "cuda" else float("nan"))
        per_round = {route: [] for route in ROUTES}
        for _ in range(rounds):
            for route in ROUTES:
                per_round[route].append(per_call_us(fns[route], loops=1, calls=10)[0])
        for route in ROUTES:
            rec[f"{route}_call_us"] = statistics.median(per_round[route])
        rec["call_ratio_own_over_window"] = statistics.median(o / w for o, w in zip(per_round["own"], per_round["window"]))
        rec["graph_speedup"] = rec["own_graph_us"] / rec["window_graph_us"]
        records.append(rec)
        print(f"{op:<15}{dtype_name:<5}{rows:>7}x{C:<5} graph us own {rec['own_graph_us']:7.1f} window "
              f"{rec['window_graph_us']:7.1f} ({rec['graph_speedup']:.2f}x) | per call us own {rec['own_call_us']:7.1f} "
              f"window {rec['window_call_us']:7.1f} (own/window per round {rec['call_ratio_own_over_window']:.2f})")
    ln.LN_VIA_WINDOW = False
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"benchmark": "diag_layer_norm_route", "environment": stamp,
                                        "settings": {"rounds": rounds, "replays": args.replays,
                                                     "graph_calls": GRAPH_CALLS},
                                        "records": records}, indent=1))
        print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
