"""Fused Swin window ops vs the eager timm ops they replace, on Swin-B stage shapes at batch 64.

    python benchmarks/bench_window.py --check --out results/bench_window_h200.json

Ops (fused / eager it replaces), forward + backward:
  roll_partition        torch.roll(-3) + F.pad + window_partition
  merge_roll            window_reverse + crop + torch.roll(+3)
  norm_shift_partition  F.layer_norm + torch.roll + F.pad + window_partition
  merge_unshift_add     window_reverse + crop + torch.roll + residual add
Stages: 56x56x128, 28x28x256, 14x14x512, 7x7x1024; ws 7, shift 3 on every stage (timm uses no
shift on the single-window 7x7 stage; the shifted case is the one that moves data); bf16 by default.

Timing: triton.testing.do_bench (CUDA events, L2 flushed between reps), median with p20/p80.
  eager_us / fused_us: fwd+bwd through autograd (what training sees, Python overhead included).
  fwd_us / bwd_us: the fused kernels alone, through the host functions (no autograd).
  GB/s: the least traffic of fwd+bwd (read inputs, write outputs once; fp32 LN stats) over
  fwd_us + bwd_us; % copy: that over the measured device-to-device copy bandwidth
  (read + write of a 1 GiB tensor with Tensor.copy_).
The first call (Triton compile) is timed separately (first_call_s), never in the medians.
--check first verifies fused == eager (data movement bit-exact, LayerNorm at 2e-2 of max |ref|
in half precision) on the same shapes, forward and every gradient, and exits 1 on a mismatch.
--out FILE writes {"benchmark", "environment": environment_stamp(), "settings", "copy", "records",
"check"} as JSON. Without a GPU it runs the interpreter on tiny shapes: a smoke test only.
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
from timm.models.swin_transformer import window_partition, window_reverse  # noqa: E402

from workbench.env import device_label, environment_stamp  # noqa: E402
from workbench.kernels.window import (  # noqa: E402
    merge_roll,
    merge_roll_fwd,
    merge_unshift_add,
    norm_shift_partition,
    norm_shift_partition_bwd,
    norm_shift_partition_fwd,
    roll_partition,
    roll_partition_fwd,
)

BATCH = 64
WINDOW, SHIFT, EPS = 7, 3, 1e-5
# (name, B, H, W, C): Swin-B's four stages at batch 64
SWIN_B_STAGES = [("s1", BATCH, 56, 56, 128), ("s2", BATCH, 28, 28, 256), ("s3", BATCH, 14, 14, 512),
                 ("s4", BATCH, 7, 7, 1024)]
CPU_STAGES = [("s1", 1, 14, 14, 32), ("s4", 2, 7, 7, 64)]  # interpreter smoke test
OPS = ("roll_partition", "merge_roll", "norm_shift_partition", "merge_unshift_add")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LN_TOL = {"bf16": 2e-2, "fp16": 2e-2, "fp32": 1e-4}


# ---------------------------------------------------------------------------- eager references


def eager_roll_partition(x, ws, shift):
    B, H, W, C = x.shape
    if shift:
        x = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
    x = F.pad(x, (0, 0, 0, (ws - W % ws) % ws, 0, (ws - H % ws) % ws))
    return window_partition(x, (ws, ws)).view(-1, ws * ws, C)


def eager_merge_roll(windows, ws, shift, H, W):
    C = windows.shape[-1]
    Hp, Wp = -(-H // ws) * ws, -(-W // ws) * ws
    x = window_reverse(windows.view(-1, ws, ws, C), (ws, ws), Hp, Wp)[:, :H, :W, :].contiguous()
    return torch.roll(x, shifts=(shift, shift), dims=(1, 2)) if shift else x


# ------------------------------------------------------------------------------------- inputs


def make_inputs(B, H, W, C, dtype, device) -> dict:
    """Fresh random tensors (never zeros): x/shortcut (B, H, W, C), windows (B*nW, ws*ws, C), LN params, upstream grads."""
    g = torch.Generator(device=device).manual_seed(B * 131 + H * 7 + C)
    nw = B * -(-H // WINDOW) * -(-W // WINDOW)

    def rand(shape, scale=1.0, shift=0.0):
        return (torch.randn(shape, generator=g, device=device) * scale + shift).to(dtype)

    return {"x": rand((B, H, W, C), 2.0, 0.5), "windows": rand((nw, WINDOW * WINDOW, C)),
            "w": rand((C,), 0.5, 1.0), "b": rand((C,), 0.5),
            "d_img": rand((B, H, W, C)), "d_win": rand((nw, WINDOW * WINDOW, C))}


def leaves(op: str, t: dict) -> list[torch.Tensor]:
    return {"roll_partition": [t["x"]], "merge_roll": [t["windows"]],
            "norm_shift_partition": [t["x"], t["w"], t["b"]],
            "merge_unshift_add": [t["windows"], t["x"]]}[op]


def forward(op: str, impl: str, t: dict, H: int, W: int, shift: int) -> torch.Tensor:
    ws = WINDOW
    if op == "roll_partition":
        return roll_partition(t["x"], ws, shift) if impl == "fused" else eager_roll_partition(t["x"], ws, shift)
    if op == "merge_roll":
        return merge_roll(t["windows"], ws, shift, H, W) if impl == "fused" else eager_merge_roll(t["windows"], ws, shift, H, W)
    if op == "norm_shift_partition":
        if impl == "fused":
            return norm_shift_partition(t["x"], t["w"], t["b"], EPS, ws, shift)
        C = t["x"].shape[-1]
        return eager_roll_partition(F.layer_norm(t["x"], (C,), t["w"], t["b"], EPS), ws, shift)
    if impl == "fused":
        return merge_unshift_add(t["windows"], t["x"], ws, shift, H, W)
    return t["x"] + eager_merge_roll(t["windows"], ws, shift, H, W)


def upstream(op: str, t: dict) -> torch.Tensor:
    return t["d_win"] if op in ("roll_partition", "norm_shift_partition") else t["d_img"]


def fwd_bwd_fn(op, impl, t, H, W, shift):
    def run():
        torch.autograd.backward(forward(op, impl, t, H, W, shift), upstream(op, t))
    return run


def kernel_fns(op, t, H, W, shift):
    """(fwd, bwd) closures calling the fused kernels' host functions directly (no autograd)."""
    ws, x, win, d_img, d_win = WINDOW, t["x"], t["windows"], t["d_img"], t["d_win"]
    if op == "roll_partition":
        return (lambda: roll_partition_fwd(x, ws, shift)), (lambda: merge_roll_fwd(d_win, ws, shift, H, W))
    if op == "merge_roll":
        return (lambda: merge_roll_fwd(win, ws, shift, H, W)), (lambda: roll_partition_fwd(d_img, ws, shift))
    if op == "norm_shift_partition":
        _, mean, rstd = norm_shift_partition_fwd(x, t["w"], t["b"], EPS, ws, shift)
        return ((lambda: norm_shift_partition_fwd(x, t["w"], t["b"], EPS, ws, shift)),
                (lambda: norm_shift_partition_bwd(d_win, x, t["w"], mean, rstd, ws, shift)))
    return ((lambda: merge_roll_fwd(win, ws, shift, H, W, x)),
            (lambda: roll_partition_fwd(d_img, ws, shift, out_dtype=win.dtype)))


def bytes_moved(op: str, B, H, W, C, elt: int) -> int:
    """Least fwd+bwd traffic: N tokens of the map, Np of the padded windows (Np = N on these shapes)."""
    n = B * H * W * C * elt
    n_pad = B * (-(-H // WINDOW) * WINDOW) * (-(-W // WINDOW) * WINDOW) * C * elt
    stats = B * H * W * 8  # fp32 mean + rstd per token, written once and read once
    return {
        "roll_partition": (n + n_pad) + (n + n),            # fwd: read x, write windows; bwd: read valid dwin, write dx
        "merge_roll": (n + n) + (n + n_pad),                # fwd: read valid windows, write y; bwd: read dy, write dwin
        "norm_shift_partition": (n + n_pad) + (3 * n) + 2 * stats,  # bwd: read dwin, x; write dx
        "merge_unshift_add": (3 * n) + (n + n_pad),         # fwd: read windows, shortcut, write; bwd: read dy, write dwin
    }[op]


# ------------------------------------------------------------------------------------- timing


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, grad_to_none, warmup_ms, rep_ms) -> tuple[float, float, float]:
    """(median, p20, p80) in microseconds."""
    if torch.cuda.is_available():
        from triton.testing import do_bench

        q = do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, quantiles=[0.5, 0.2, 0.8])
        return tuple(float(v) * 1e3 for v in q)
    times = []
    for _ in range(3):
        for p in grad_to_none:
            p.grad = None
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times), min(times), max(times)


def first_call_s(fn) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def copy_bandwidth(device, warmup_ms, rep_ms) -> dict:
    """Device-to-device Tensor.copy_ of a 1 GiB buffer (64 KiB on the CPU): GB/s counting read + write."""
    n_bytes = (1 << 30) if device == "cuda" else (1 << 16)
    src = torch.randn(n_bytes // 4, device=device)
    dst = torch.empty_like(src)
    med, p20, p80 = timed(lambda: dst.copy_(src), [], warmup_ms, rep_ms)
    return {"bytes": 2 * n_bytes, "us_median": med, "us_p20": p20, "us_p80": p80, "gbps": 2 * n_bytes / (med * 1e-6) / 1e9}


# --------------------------------------------------------------------------------- check, measure


def check(stages, dtype_name, device) -> list[dict]:
    """Fused vs eager on every (op, stage): forward and every gradient."""
    dtype, results = DTYPES[dtype_name], []
    for op in OPS:
        for stage, B, H, W, C in stages:
            shift = SHIFT
            outs = {}
            for impl in ("eager", "fused"):
                t = make_inputs(B, H, W, C, dtype, device)
                for p in leaves(op, t):
                    p.requires_grad_(True)
                y = forward(op, impl, t, H, W, shift)
                y.backward(upstream(op, t))
                outs[impl] = [y.detach()] + [p.grad for p in leaves(op, t)]
            names = ["out"] + [f"d{i}" for i in range(len(outs["fused"]) - 1)]
            for what, ours, ref in zip(names, outs["fused"], outs["eager"]):
                if op == "norm_shift_partition":
                    err = ((ours.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()
                    ok = bool(torch.isfinite(ours).all()) and err <= LN_TOL[dtype_name]
                else:
                    err = 0.0 if torch.equal(ours, ref) else float("inf")
                    ok = err == 0.0
                results.append({"op": op, "stage": stage, "what": what, "rel_max_err": err, "ok": ok})
    return results


def measure(stages, dtype_name, device, warmup_ms, rep_ms, copy_gbps) -> list[dict]:
    dtype = DTYPES[dtype_name]
    elt = torch.tensor([], dtype=dtype).element_size()
    records = []
    for op in OPS:
        for stage, B, H, W, C in stages:
            shift = SHIFT
            t = make_inputs(B, H, W, C, dtype, device)
            for p in leaves(op, t):
                p.requires_grad_(True)
            rec = {"op": op, "stage": stage, "B": B, "H": H, "W": W, "C": C, "window": WINDOW, "shift": shift,
                   "dtype": dtype_name}
            for impl in ("eager", "fused"):
                fn = fwd_bwd_fn(op, impl, t, H, W, shift)
                rec[f"{impl}_first_call_s"] = first_call_s(fn)
                rec[f"{impl}_us"], rec[f"{impl}_us_p20"], rec[f"{impl}_us_p80"] = timed(fn, leaves(op, t), warmup_ms, rep_ms)
            with torch.no_grad():
                kfwd, kbwd = kernel_fns(op, t, H, W, shift)
                rec["kernel_first_call_s"] = first_call_s(kfwd) + first_call_s(kbwd)
                rec["fwd_us"], _, _ = timed(kfwd, [], warmup_ms, rep_ms)
                rec["bwd_us"], _, _ = timed(kbwd, [], warmup_ms, rep_ms)
            rec["bytes"] = bytes_moved(op, B, H, W, C, elt)
            rec["speedup"] = rec["eager_us"] / rec["fused_us"]
            rec["kernel_gbps"] = rec["bytes"] / ((rec["fwd_us"] + rec["bwd_us"]) * 1e-6) / 1e9
            rec["autograd_gbps"] = rec["bytes"] / (rec["fused_us"] * 1e-6) / 1e9
            rec["pct_copy"] = 100.0 * rec["kernel_gbps"] / copy_gbps
            records.append(rec)
            del t
            if device == "cuda":
                torch.cuda.empty_cache()
    return records


def format_table(records: list[dict]) -> str:
    head = (f"{'op':<21} {'stage':<15} {'eager us':>9} {'fused us':>9} {'speedup':>7} | "
            f"{'fwd us':>7} {'bwd us':>7} {'GB/s':>6} {'%copy':>5}")
    lines = [head, "-" * len(head)]
    for r in records:
        shape = f"{r['stage']} {r['H']}x{r['W']}x{r['C']}"
        lines.append(f"{r['op']:<21} {shape:<15} {r['eager_us']:>9.1f} {r['fused_us']:>9.1f} {r['speedup']:>6.2f}x | "
                     f"{r['fwd_us']:>7.1f} {r['bwd_us']:>7.1f} {r['kernel_gbps']:>6.0f} {r['pct_copy']:>4.0f}%")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="verify fused == eager first; exit 1 on a mismatch")
    ap.add_argument("--out", type=Path, help="write records + environment stamp as JSON here (default: stdout only)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--warmup-ms", type=float, default=10.0)
    ap.add_argument("--rep-ms", type=float, default=40.0)
    args = ap.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    stages = SWIN_B_STAGES if device == "cuda" else CPU_STAGES
    stamp = environment_stamp(device)
    print(f"# bench_window on {device_label(stamp)}; torch {stamp['torch']}, triton {stamp['triton']}, {args.dtype}, "
          f"batch {stages[0][1]}, ws {WINDOW}")
    if device == "cpu":
        print("# no GPU: Triton interpreter on tiny shapes - a smoke test, the times mean nothing")
    t0 = time.perf_counter()

    checks = []
    if args.check:
        checks = check(stages, args.dtype, device)
        failed = [c for c in checks if not c["ok"]]
        print(f"# check: {len(checks) - len(failed)}/{len(checks)} outputs/gradients match eager "
              f"(data movement bit-exact; LayerNorm worst {max((c['rel_max_err'] for c in checks if c['op'] == 'norm_shift_partition'), default=0):.1e} of max |ref|)")
        if failed:
            for c in failed:
                print(f"MISMATCH {c['op']} {c['stage']} {c['what']}: {c['rel_max_err']:.3e}", file=sys.stderr)
            return 1

    copy = copy_bandwidth(device, args.warmup_ms, args.rep_ms)
    records = measure(stages, args.dtype, device, args.warmup_ms, args.rep_ms, copy["gbps"])
    print(format_table(records))
    worst = min(records, key=lambda r: r["pct_copy"])
    print(f"# copy bandwidth (Tensor.copy_ of {copy['bytes'] / 2 / 2**20:g} MiB, read+write): {copy['gbps']:.0f} GB/s; "
          f"fused kernels reach {worst['pct_copy']:.0f}%..{max(r['pct_copy'] for r in records):.0f}% of it "
          f"(lowest: {worst['op']} {worst['stage']})")
    geo = 1.0
    for r in records:
        geo *= r["speedup"]
    print(f"# fused vs eager fwd+bwd: geomean {geo ** (1 / len(records)):.2f}x; "
          f"first calls (compile) {sum(r['kernel_first_call_s'] + r['fused_first_call_s'] for r in records):.1f} s; "
          f"total {time.perf_counter() - t0:.1f} s")

    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"benchmark": "bench_window", "environment": stamp,
                   "settings": {"batch": stages[0][1], "stages": stages, "dtype": args.dtype, "window": WINDOW,
                                "shift": SHIFT, "eps": EPS, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms},
                   "copy": copy, "records": records, "check": checks}
        args.out.write_text(json.dumps(payload, indent=1))
        print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
