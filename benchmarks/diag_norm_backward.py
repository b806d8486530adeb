"""Where the LayerNorm + shift + partition backward's time goes, at Swin-B's stage shapes (batch 64, bf16).

The backward reads the gradient (window order) and x and writes dx: the bytes of a kernel that reads two
tensors and writes one, which merge_roll_fwd with a shortcut (merge_unshift_add's forward) also moves.
This times, by CUDA-graph replay of back-to-back kernel launches (the column sums added into one
preallocated buffer, no memset):

  copy3          merge_roll_fwd(windows, shortcut): the same bytes, pure data movement
  shipped        the backward as the host function launches it
  no-sums        without the column sums (DIAG=1: no cross-warp reduction, no atomics)
  no-store       without the dx stores (DIAG=2)
  no-math        without the LayerNorm arithmetic (DIAG=3: dx = g + x)
  programs xN    the shipped kernel on N times the shipped number of programs (fewer tiles each), and the
                 same without the column sums
  one tile       a program per tile, its column sums added straight from the tile (ONE_TILE: no
                 accumulators held across a band, so more programs fit on an SM), with and without the sums

The DIAG variants compute wrong results on purpose. The one-tile variant with its sums computes the
backward: its dx is checked bit for bit, and its sums to 1e-3 of their largest value, against the shipped
host function before it is timed. GPU only.

    python benchmarks/diag_norm_backward.py [--stages s3,s4] [--out FILE]
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

from bench_window import EPS, SHIFT, SWIN_B_STAGES, WINDOW, make_inputs  # noqa: E402
from workbench.env import environment_stamp  # noqa: E402
from workbench.kernels._ops import cdiv, launch_options, pdl_launch  # noqa: E402
from workbench.timing import cuda_graph_us  # noqa: E402

win = importlib.import_module("workbench.kernels.window")


def backward_launch(g, x, w, mean, rstd, sums, dx, programs_factor: int, diag: int):
    """The backward kernel launched as window._norm_bwd launches it, on programs_factor times its programs;
    programs_factor 0: a program per tile, with ONE_TILE."""
    B, H, W, C = x.shape
    _, _, nwh, nww, sh, sw = win._geometry(H, W, WINDOW, SHIFT)
    n_tok = B * H * W
    block_t, block_c, warps, nprog, tiles, maxnreg, stages = win._norm_bwd_config(n_tok, C, 2, x.device)
    if programs_factor > 1:
        tiles = max(1, cdiv(tiles, programs_factor))
        nprog = cdiv(cdiv(n_tok, block_t), tiles)
    if programs_factor == 0:
        tiles, nprog = 1, cdiv(n_tok, block_t)
    pdl = pdl_launch()

    def run():
        win._norm_partition_bwd_kernel[(nprog,)](
            g, x, w, mean, rstd, x, dx, dx, sums, n_tok, tiles, C,
            H=H, W=W, n_win_h=nwh, n_win_w=nww, shift_h=sh, shift_w=sw, WS=WINDOW, SOFT_RTNE=win._SOFT_RTNE, ATOMIC=True,
            HAS_DS=False, MERGE=False, STAGES=stages, BLOCK_T=block_t, BLOCK_C=block_c, PDL=pdl, DIAG=diag,
            ONE_TILE=programs_factor == 0,
            num_warps=warps, **launch_options(maxnreg, pdl))
    return run, nprog


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="s2,s3,s4")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("diag_norm_backward: needs a CUDA GPU")
        return 2
    stamp = environment_stamp("cuda")
    print(f"# {stamp.get('gpu')}; torch {stamp['torch']}, triton {stamp['triton']}; PDL {pdl_launch()}")
    records = []
    for stage, B, H, W, C in SWIN_B_STAGES:
        if stage not in args.stages.split(","):
            continue
        t = make_inputs(B, H, W, C, torch.bfloat16, "cuda")
        x, w, b, g = t["x"], t["w"], t["b"], t["d_win"]
        _, mean, rstd = win.norm_shift_partition_fwd(x, w, b, EPS, WINDOW, SHIFT)
        sums = torch.zeros(2 * C, dtype=torch.float32, device="cuda")
        dx = torch.empty_like(x)
        out = torch.empty_like(x)
        variants = {"copy3": (lambda: win.merge_roll_fwd(t["windows"], WINDOW, SHIFT, H, W, x, out=out), None)}
        for name, factor, diag in (("shipped", 1, 0), ("no-sums", 1, 1), ("no-store", 1, 2), ("no-math", 1, 3),
                                   ("programs x2", 2, 0), ("programs x4", 4, 0), ("programs x2 no-sums", 2, 1),
                                   ("programs x4 no-sums", 4, 1), ("one tile", 0, 0), ("one tile no-sums", 0, 1)):
            variants[name] = backward_launch(g, x, w, mean, rstd, sums, dx, factor, diag)
        dx_ref, sums_ref = win.norm_shift_partition_bwd(g, x, w, mean, rstd, WINDOW, SHIFT)
        sums1, dx1 = torch.zeros_like(sums), torch.empty_like(x)
        backward_launch(g, x, w, mean, rstd, sums1, dx1, 0, 0)[0]()
        err = ((sums1 - sums_ref).abs().max() / sums_ref.abs().max()).item()
        if not torch.equal(dx1, dx_ref) or err > 1e-3:
            print(f"{stage}: the one-tile backward does not match the shipped one (sums off by {err:.1e})")
            return 1
        rec = {"stage": stage, "B": B, "H": H, "W": W, "C": C, "bytes": 3 * x.numel() * 2}
        line = []
        for name, (fn, nprog) in variants.items():
            fn()
            us = cuda_graph_us([fn], replays=args.replays, calls=16)[0]
            rec[name] = {"us": us, "programs": nprog}
            line.append(f"{name} {us:.2f}" + (f" ({nprog})" if nprog else ""))
        records.append(rec)
        print(f"{stage} C={C}: " + " | ".join(line), flush=True)
        del t, x, g, dx, out, sums
        torch.cuda.empty_cache()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"benchmark": "diag_norm_backward", "environment": stamp,
                                        "replays": args.replays, "records": records}, indent=1))
        print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
