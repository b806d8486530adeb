"""Launch-configuration sweep for the LayerNorm + shift + partition kernels (forward and backward).

For each Swin-B stage shape at batch 64 (bf16), times every candidate (tile rows, warps, tiles per
program) with CUDA-graph replay over input sets that together exceed the L2 (as bench_window does),
checks it against the shipped configuration (forward bit-exact; dx to 1e-2, the dweight/dbias sums to
1e-3 relative), and prints the best per stage beside the shipped one. The shipped rule in workbench/kernels/window.py comes from this table.

    python benchmarks/sweep_norm_window.py [--out sweep.json]
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.env import environment_stamp  # noqa: E402
from workbench.timing import cuda_graph_us  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_window import n_input_sets  # noqa: E402

win = importlib.import_module("workbench.kernels.window")
lnk = importlib.import_module("workbench.kernels.layer_norm")

STAGES = {"s1": (64, 56, 56, 128), "s2": (64, 28, 28, 256), "s3": (64, 14, 14, 512), "s4": (64, 7, 7, 1024)}
WS, SHIFT = 7, 3


def shipped_bwd(n_tok, C, elt, dev):
    return win._norm_bwd_config.__wrapped__(n_tok, C, elt, dev)


def bwd_candidates(n_tok, C, dev):
    """Each program a band of 2-64 tiles (the column sums are atomic adds, so many short programs cost no
    partial rows), loads pipelined by Triton with 1-4 stages, and two families of tiles:
      * 2048-4096 elements over 4-8 warps, 8-32 elements per thread per tensor (the shipped family);
      * one or two warps per program, so that a row of C = 512 or 1024 stays inside one warp and its two
        row reductions per tile are shuffles, not the cross-warp shared-memory round trips (and barriers)
        that a row spread over several warps needs; residency comes from many small programs instead."""
    sms = lnk.sm_count(dev)
    block_c = 1 << (C - 1).bit_length()
    for block_t, warps, tiles, stages in itertools.product((1, 2, 4, 8, 16, 32, 64), (1, 2, 4, 8),
                                                           (2, 4, 8, 16, 32, 64), (1, 2, 3, 4)):
        tile = block_t * block_c
        per_thread = tile // (32 * warps)
        small = warps <= 2 and 512 <= tile <= 2048 and 8 <= per_thread <= 32 and stages in (1, 3)
        if not small and (warps <= 2 or not 2048 <= tile <= 4096 or not 8 <= per_thread <= 32):
            continue
        n_tiles = -(-n_tok // block_t)
        programs = -(-n_tiles // tiles)
        if programs < sms or programs > (32 if small else 8) * sms:
            continue
        row_sums = block_c >= 256 * warps  # as window._norm_bwd_config decides it
        yield (block_t, block_c, warps, programs, tiles, None, stages, row_sums, 1), dict(
            block_t=block_t, warps=warps, tiles=tiles, programs=programs, stages=stages, row_sums=row_sums)


def slot_candidates(n_tok, C, dev):
    """Where ROW_SUMS holds for the shipped tile (_norm_blocks; C = 512-1024): tiles of 2-16 rows over 2-8
    warps (ROW_SUMS where a row spans the warps), bands of 1-6 tiles (from more programs than one wave to
    fewer than one per SM), pipelined with 3 stages (1 for one-tile programs), the column sums spread over
    1, 2 or 4 rows (slots); registers as the compiler allocates them. (The first run of this family, kept
    in sweep_norm_window_slots_h200.json, took the shipped tile only, with 1-12 tiles, 1, 3 or 4 stages
    and 1, 4 or 16 rows.)"""
    block_t0, block_c, warps0 = win._norm_blocks(C)
    if block_c < 256 * warps0:
        return
    for (block_t, warps), tiles, slots in itertools.product(((2, 2), (4, 4), (8, 4), (8, 8), (16, 8)),
                                                            (1, 2, 3, 4, 6), (1, 2, 4)):
        if block_t * block_c // (32 * warps) > 64:
            continue
        n_tiles = -(-n_tok // block_t)
        programs = -(-n_tiles // tiles)
        stages = 1 if tiles == 1 else 3
        row_sums = block_c >= 256 * warps
        yield (block_t, block_c, warps, programs, tiles, None, stages, row_sums, slots), dict(
            block_t=block_t, warps=warps, tiles=tiles, programs=programs, stages=stages, slots=slots)


def fwd_candidates(C):
    block_c = 1 << (C - 1).bit_length()
    for block_t, warps in itertools.product((1, 2, 4, 8, 16, 32, 64), (1, 2, 4, 8, 16)):
        tile = block_t * block_c
        if tile > 8192 or tile < 64 * warps or tile // (32 * warps) > 64:
            continue
        yield (block_t, block_c, warps), dict(block_t=block_t, warps=warps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--stages", default="s1,s2,s3,s4")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--dirs", default="fwd,bwd")
    ap.add_argument("--family", choices=("bands", "slots"), default="bands",
                    help="backward candidates: bands of 2048-4096 element tiles (bwd_candidates) or the shipped "
                         "ROW_SUMS tile on bands of 1-12 tiles with the sums over 1-16 rows (slot_candidates)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    bf = torch.bfloat16
    out = {"benchmark": "sweep_norm_window", "environment": environment_stamp(), "stages": {}}
    orig_fwd, orig_bwd = win._norm_fwd_config, win._norm_bwd_config
    for name in args.stages.split(","):
        B, H, W, C = STAGES[name]
        g = torch.Generator(device=dev).manual_seed(0)
        n_sets = n_input_sets(2 * B * H * W * C * 2)   # x and dwindows, bf16
        sets = []
        for _ in range(n_sets):
            x = torch.randn(B, H, W, C, device=dev, dtype=bf, generator=g)
            w = torch.randn(C, device=dev, dtype=bf, generator=g)
            b = torch.randn(C, device=dev, dtype=bf, generator=g)
            win_, mean, rstd = win.norm_shift_partition_fwd(x, w, b, 1e-5, WS, SHIFT)
            sets.append((x, w, b, win_, mean, rstd, torch.randn_like(win_)))
        x, w, b, win_, mean, rstd, dwin = sets[0]
        n_tok = B * H * W
        ref = win.norm_shift_partition_bwd(dwin, x, w, mean, rstd, WS, SHIFT)
        fwd_fns = [lambda s=s_: win.norm_shift_partition_fwd(s[0], s[1], s[2], 1e-5, WS, SHIFT) for s_ in sets]
        # as the autograd backward of a bf16 model runs it: the kernel, then its sums added up over their rows
        # and cast to the parameters' bf16 (one launch)
        bwd_fns = [lambda s=s_: win._norm_grads(win.norm_shift_partition_bwd(s[6], s[0], s[1], s[4], s[5], WS, SHIFT,
                                                                             raw_sums=True)[1], s[1], s[2])
                   for s_ in sets]
        rows = []
        try:
            for cfg, desc in (fwd_candidates(C) if "fwd" in args.dirs else ()):
                win._norm_fwd_config = lambda C_, cfg=cfg: cfg
                try:
                    o, _, _ = win.norm_shift_partition_fwd(x, w, b, 1e-5, WS, SHIFT)
                    ok = torch.equal(o, win_)
                    us = cuda_graph_us(fwd_fns, replays=args.replays)[0]
                except Exception as exc:  # a config that does not compile is a row, not a crash
                    ok, us = False, float("nan")
                    desc["error"] = f"{type(exc).__name__}: {exc}"[:200]
                rows.append({"dir": "fwd", **desc, "ok": ok, "us": us})
            win._norm_fwd_config = orig_fwd
            family = bwd_candidates if args.family == "bands" else slot_candidates
            for cfg, desc in (family(n_tok, C, dev) if "bwd" in args.dirs else ()):
                win._norm_bwd_config = lambda *a, cfg=cfg: cfg
                try:
                    dx, sums = win.norm_shift_partition_bwd(dwin, x, w, mean, rstd, WS, SHIFT)
                    ok = (torch.allclose(dx.float(), ref[0].float(), atol=1e-2, rtol=1e-2)
                          and torch.allclose(sums, ref[1], rtol=1e-3, atol=1e-2))
                    us = cuda_graph_us(bwd_fns, replays=args.replays)[0]
                except Exception as exc:
                    ok, us = False, float("nan")
                    desc["error"] = f"{type(exc).__name__}: {exc}"[:200]
                rows.append({"dir": "bwd", **desc, "ok": ok, "us": us})
        finally:
            win._norm_fwd_config, win._norm_bwd_config = orig_fwd, orig_bwd
        ship_f = cuda_graph_us(fwd_fns, replays=args.replays)[0]
        ship_b = cuda_graph_us(bwd_fns, replays=args.replays)[0]
        out["stages"][name] = {"shape": [B, H, W, C], "input_sets": n_sets, "shipped_fwd_us": ship_f,
                               "shipped_bwd_us": ship_b, "rows": rows}
        for d, ship in (("fwd", ship_f), ("bwd", ship_b)):
            good = sorted((r for r in rows if r["dir"] == d and r["ok"]), key=lambda r: r["us"])
            bad = [r for r in rows if r["dir"] == d and not r["ok"]]
            print(f"{name} {d}: shipped {ship:7.1f} µs | best:", "; ".join(
                f"{r['us']:.1f} " + ",".join(f"{k}={v}" for k, v in r.items() if k not in ("dir", "ok", "us"))
                for r in good[:8]), f"| {len(bad)} failed", (bad[0].get("error", "mismatch") if bad else ""), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
