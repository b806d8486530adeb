"""Where the LayerNorm + shift + partition backward's time goes, at Swin-B's stage shapes (batch 64, bf16).

The backward reads the gradient (window order) and x and writes dx: the bytes of a kernel that reads two
tensors and writes one, which merge_roll_fwd with a shortcut (merge_unshift_add's forward) also moves.
Every variant is timed as bench_window times the ops: CUDA-graph replay of back-to-back calls rotating over
input sets that together exceed the L2 three times (the data comes from DRAM, as in training), and each
call includes what the backward needs after the kernel: the column sums added up over their rows (slots)
and cast to the bf16 parameters' dtype (layer_norm.sum_rows; window._norm_grads launches it), with PDL where on.

  copy3          merge_roll_fwd(windows, shortcut): the same bytes, pure data movement
  shipped        the backward as the host function launches it (its config: _norm_bwd_config)
  shipped no-cast  the same without the launch that adds up the sums' rows and casts them
  shipped late   the shipped call with the next kernel released after the backward's last store, not at
                 its start (PDL_EARLY off)
  no-sums / no-store / no-math
                 the shipped kernel without the column sums (DIAG=1), the dx stores (DIAG=2), the
                 LayerNorm arithmetic (DIAG=3: dx = g + x); wrong results on purpose
  band / band slots S
                 3 programs per SM at most, each a band of at least 16 tokens, the column sums added into
                 one row (the grid before 2026-12-01) or S rows in turn
  tN slots S     bands of N tiles (N = 2, 1: more programs than one wave) with the sums spread over S rows
                 (only where ROW_SUMS holds a band's sums in two (BLOCK_C,) vectors)
  ... no-sums    the same grid without the column sums

Every variant that computes the backward has its dx checked bit for bit, and its sums to 1e-3 of their
largest value, against the shipped host function before it is timed. GPU only.

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

from bench_window import EPS, SHIFT, SWIN_B_STAGES, WINDOW, make_inputs, n_input_sets  # noqa: E402
from workbench.env import environment_stamp  # noqa: E402
from workbench.kernels._ops import cdiv, launch_options, pdl_launch  # noqa: E402
from workbench.timing import cuda_graph_us  # noqa: E402

win = importlib.import_module("workbench.kernels.window")
ln = importlib.import_module("workbench.kernels.layer_norm")


def grid(n_tok: int, C: int, device, kind: str, tiles: int = 1):
    """(block_t, block_c, warps, programs, tiles a program, maxnreg, stages, row_sums) for `kind`:
    'shipped' (_norm_bwd_config), 'band' (at most 3 programs per SM, bands of at least 16 tokens: the grid
    before 2026-12-01), or 'tiles' (bands of `tiles` tiles; uncapped registers where more than one wave)."""
    block_t, block_c, warps, nprog, tpp, maxnreg, stages, row_sums, _ = win._norm_bwd_config(n_tok, C, 2, device)
    if kind == "band":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        n_tiles = cdiv(n_tok, block_t)
        nprog = max(1, min(win._NORM_BWD_PER_SM * sms, n_tiles, cdiv(n_tok, win._NORM_BWD_MIN_TOKENS)))
        tpp = cdiv(n_tiles, nprog)
        nprog = cdiv(n_tiles, tpp)
        regs = 65536 // (cdiv(nprog, sms) * warps * 32)
        maxnreg = min(255, regs - regs % 8)
    if kind == "tiles":
        nprog, tpp = cdiv(cdiv(n_tok, block_t), tiles), tiles
        per_sm = cdiv(nprog, torch.cuda.get_device_properties(device).multi_processor_count)
        regs = 65536 // (per_sm * warps * 32)
        maxnreg = min(255, regs - regs % 8) if per_sm <= 3 else None
    return block_t, block_c, warps, nprog, tpp, maxnreg, stages, row_sums


def backward_fn(s: dict, cfg, diag: int, slots: int, bf16_grads: bool, early: bool | None = None):
    """One call: the backward kernel on input set s with config cfg, its sums into s['sums'][:slots], then
    (bf16_grads) the sums added up and cast, as _norm_grads does. early: PDL_EARLY (None: where the sums
    are added up after, as the host function decides)."""
    x = s["x"]
    B, H, W, C = x.shape
    _, _, nwh, nww, sh, sw = win._geometry(H, W, WINDOW, SHIFT)
    block_t, block_c, warps, nprog, tiles, maxnreg, stages, row_sums = cfg
    pdl = pdl_launch()
    sums = s["sums"][:slots]

    def run():
        win._norm_partition_bwd_kernel[(nprog,)](
            s["g"], x, s["w"], s["mean"], s["rstd"], x, s["dx"], s["dx"], sums, B * H * W, tiles, C,
            H=H, W=W, n_win_h=nwh, n_win_w=nww, shift_h=sh, shift_w=sw, WS=WINDOW, SOFT_RTNE=win._SOFT_RTNE,
            ATOMIC=True, HAS_DS=False, MERGE=False, STAGES=stages, BLOCK_T=block_t, BLOCK_C=block_c, PDL=pdl,
            DIAG=diag, ROW_SUMS=row_sums, SLOTS=slots, PDL_EARLY=pdl and (bf16_grads if early is None else early),
            num_warps=warps, **launch_options(maxnreg, pdl))
        if bf16_grads:
            return ln.sum_rows(sums, torch.bfloat16)
        return None
    return run


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
    dev = torch.device("cuda")
    for stage, B, H, W, C in SWIN_B_STAGES:
        if stage not in args.stages.split(","):
            continue
        n_tok = B * H * W
        n_sets = n_input_sets(3 * n_tok * C * 2)
        sets = []
        for i in range(n_sets):
            t = make_inputs(B, H, W, C, torch.bfloat16, "cuda", seed=i)
            _, mean, rstd = win.norm_shift_partition_fwd(t["x"], t["w"], t["b"], EPS, WINDOW, SHIFT)
            sets.append({"x": t["x"], "g": t["d_win"], "w": t["w"], "b": t["b"], "mean": mean, "rstd": rstd,
                         "dx": torch.empty_like(t["x"]), "out": torch.empty_like(t["x"]), "windows": t["windows"],
                         "sums": torch.zeros(128, 2 * C, dtype=torch.float32, device=dev)})
        s0 = sets[0]
        dx_ref, sums_ref = win.norm_shift_partition_bwd(s0["g"], s0["x"], s0["w"], s0["mean"], s0["rstd"], WINDOW, SHIFT)
        row_sums, slots = win._norm_bwd_config(n_tok, C, 2, dev)[7:]
        shipped = grid(n_tok, C, dev, "shipped")
        variants: dict = {"copy3": ([lambda s=s: win.merge_roll_fwd(s["windows"], WINDOW, SHIFT, H, W, s["x"], out=s["out"])
                                     for s in sets], None)}
        plan = [("shipped", shipped, slots)]
        plan += [(f"band slots {k}" if k > 1 else "band", grid(n_tok, C, dev, "band"), k) for k in (1, 4)]
        if row_sums:
            plan += [(f"t{n} slots {k}", grid(n_tok, C, dev, "tiles", n), k) for n in (2, 1) for k in (4, 16)]
        for name, cfg, k in plan:
            probe = dict(s0, sums=torch.zeros(128, 2 * C, dtype=torch.float32, device=dev), dx=torch.empty_like(s0["x"]))
            backward_fn(probe, cfg, 0, k, False)()
            err = ((probe["sums"].sum(0) - sums_ref).abs().max() / sums_ref.abs().max()).item()
            if not torch.equal(probe["dx"], dx_ref) or err > 1e-3:
                print(f"{stage}: {name} does not match the shipped backward (sums off by {err:.1e})")
                return 1
            variants[name] = ([backward_fn(s, cfg, 0, k, True) for s in sets], cfg[3])
        variants["shipped no-cast"] = ([backward_fn(s, shipped, 0, slots, False) for s in sets], shipped[3])
        variants["shipped late"] = ([backward_fn(s, shipped, 0, slots, True, early=False) for s in sets], shipped[3])
        for name, diag in (("no-sums", 1), ("no-store", 2), ("no-math", 3)):
            variants[name] = ([backward_fn(s, shipped, diag, 1, False) for s in sets], shipped[3])
        variants["band no-sums"] = ([backward_fn(s, grid(n_tok, C, dev, "band"), 1, 1, False) for s in sets], None)
        if row_sums:
            variants["t1 no-sums"] = ([backward_fn(s, grid(n_tok, C, dev, "tiles", 1), 1, 1, False) for s in sets], None)
        rec = {"stage": stage, "B": B, "H": H, "W": W, "C": C, "bytes": 3 * n_tok * C * 2, "input_sets": n_sets}
        line = []
        for name, (fns, nprog) in variants.items():
            us = cuda_graph_us(fns, replays=args.replays, calls=16)[0]
            rec[name] = {"us": us, "programs": nprog}
            line.append(f"{name} {us:.2f}" + (f" ({nprog})" if nprog else ""))
        records.append(rec)
        print(f"{stage} C={C} ({n_sets} sets): " + " | ".join(line), flush=True)
        del sets, s0, probe
        torch.cuda.empty_cache()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"benchmark": "diag_norm_backward", "environment": stamp,
                                        "replays": args.replays, "records": records}, indent=1))
        print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
