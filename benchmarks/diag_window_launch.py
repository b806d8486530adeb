"""The window ops' fused fwd+bwd launched plainly or with programmatic dependent launch (PDL), and for the
LayerNorm ops with bf16 parameters, with their grads cast by torch (a plain launch that ends the PDL chain)
or by the Triton kernel that adds up the sums in the chain (window.PDL_CAST). The op norm_shift_partition@f32p is
norm_shift_partition with bf16 activations and fp32 parameters: no cast at all.

Each variant is timed as bench_window times the fused ops (autograd forward + backward, CUDA-graph replay of
back-to-back calls over input sets larger than the L2) in one process, variants alternating per op and stage,
and given as % of the copy rate. Before timing, every variant's outputs and gradients, from a plain call
and from a replayed graph, are compared with the plain variant's: data movement and dx bit-exact, the
LayerNorm parameters' gradients to 1e-2 of their largest value (fp32 atomic sums in another order).

Earlier knobs measured with this script on the H200 (2026-12-01, benchmarks/results/
diag_window_launch_{gik,knobs,cast}_h200.json, each with a note on its variants) and since removed: the next kernel released at the top of each kernel instead of after its
last store (6% slower data movement at stage 3), the norm backward's tiles spread evenly over 1 or 2
programs per SM (no better at any stage, 1 per SM up to 27% slower), and the backward's last program
casting the parameters' grads itself (an atomic counter and a fence per program: 1.4 us slower at stage 4).

    python benchmarks/diag_window_launch.py [--ops a,b] [--stages s1,s2] [--out FILE]
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_window import (LN_OPS, OPS, SHIFT, SWIN_B_STAGES, WINDOW, bytes_moved, copy_bandwidth,  # noqa: E402
                          fwd_bwd_fn, graph_us, leaves, make_inputs, n_input_sets)
from workbench.env import environment_stamp  # noqa: E402

ops_mod = importlib.import_module("workbench.kernels._ops")
win = importlib.import_module("workbench.kernels.window")

VARIANTS = {  # name: (PDL, PDL_CAST)
    "plain": (False, False),
    "pdl": (True, False),
    "pdl+cast": (True, True),
}


def set_variant(name: str) -> None:
    ops_mod.PDL_OVERRIDE, win.PDL_CAST = VARIANTS[name]


def variants_for(op: str) -> list[str]:
    # the grads' cast only matters to the LayerNorm ops
    return list(VARIANTS) if op in LN_OPS else ["plain", "pdl"]


def results_of(fn) -> list[torch.Tensor]:
    return [g.detach().clone() for g in fn()]


def replayed(fn) -> list[torch.Tensor]:
    """fn's results from a CUDA graph replay (the graph captured after two warm-up calls)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = fn()
    g.replay()
    torch.cuda.synchronize()
    return [o.detach().clone() for o in outs]


def compare(op, ref, got) -> float:
    """Worst error relative to each tensor's largest value (0.0: bit-exact everywhere)."""
    worst = 0.0
    for a, b in zip(ref, got):
        if torch.equal(a, b):
            continue
        if op not in LN_OPS:
            return float("inf")
        worst = max(worst, ((a.float() - b.float()).abs().max() / a.float().abs().max().clamp_min(1e-12)).item())
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default=",".join(OPS + ("norm_shift_partition@f32p",)))
    ap.add_argument("--stages", default="s1,s2,s3,s4")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of all variants; median kept")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("diag_window_launch: needs a GPU (PDL is a launch attribute; nothing to compare on the CPU)")
        return 2
    stamp = environment_stamp("cuda")
    print(f"# {stamp.get('gpu')}; torch {stamp['torch']}, triton {stamp['triton']}; PDL supported: "
          f"{ops_mod.pdl_supported()}")
    stages = [s for s in SWIN_B_STAGES if s[0] in args.stages.split(",")]
    copy = copy_bandwidth("cuda", args.replays)
    records, bad = [], 0
    for label in args.ops.split(","):
        op, _, params = label.partition("@")
        for stage, B, H, W, C in stages:
            elt = 2
            nbytes = bytes_moved(op, B, H, W, C, elt)
            sets = [make_inputs(B, H, W, C, torch.bfloat16, "cuda", seed=k) for k in range(n_input_sets(nbytes))]
            if params == "f32p":
                for t in sets:
                    t["w"], t["b"] = t["w32"], t["b32"]
            for t in sets:
                for p in leaves(op, t):
                    p.requires_grad_(True)
            fns = [fwd_bwd_fn(op, "fused", t, H, W, SHIFT) for t in sets]
            names = variants_for(op)
            set_variant("plain")
            ref = results_of(fns[0])
            errs = {}
            for name in names:
                set_variant(name)
                errs[name] = max(compare(op, ref, results_of(fns[0])), compare(op, ref, replayed(fns[0])))
            times = {name: [] for name in names}
            for _ in range(args.rounds):
                for name in names:
                    set_variant(name)
                    times[name].append(graph_us(fns, args.replays)[0])
            rec = {"op": label, "stage": stage, "B": B, "H": H, "W": W, "C": C, "bytes": nbytes}
            for name in names:
                us = sorted(times[name])[len(times[name]) // 2]
                ok = errs[name] <= (1e-2 if op in LN_OPS else 0.0)
                bad += not ok
                rec[name] = {"us": us, "us_rounds": times[name], "pct_copy": 100 * nbytes / (us * 1e-6) / 1e9 / copy["gbps"],
                             "max_rel_err": errs[name], "ok": ok}
            records.append(rec)
            print(f"{label:<26} {stage} C={C:<5} " + "  ".join(
                f"{n} {rec[n]['us']:6.2f} us {rec[n]['pct_copy']:3.0f}%{'' if rec[n]['ok'] else ' MISMATCH'}" for n in names),
                flush=True)
            del sets, fns
            torch.cuda.empty_cache()
    ops_mod.PDL_OVERRIDE, win.PDL_CAST = None, True
    print(f"# copy_: {copy['gbps']:.0f} GB/s (bench_window's bar is max(copy_, the best op), so its % run a little lower); "
          f"{bad} mismatch(es)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"benchmark": "diag_window_launch", "environment": stamp, "copy": copy,
                                        "window": WINDOW, "shift": SHIFT, "replays": args.replays,
                                        "rounds": args.rounds, "records": records}, indent=1))
        print(f"# wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
