"""Fused Swin window ops vs the eager timm ops they replace, on Swin-B stage shapes at batch 64.

    python benchmarks/bench_window.py --check              # writes benchmarks/results/window.{json,md}
    python benchmarks/bench_window.py --check --inductor   # adds torch.compile of the eager ops (minutes more)

Ops (fused / eager it replaces), forward + backward:
  roll_partition        torch.roll(-3) + F.pad + window_partition
  merge_roll            window_reverse + crop + torch.roll(+3)
  norm_shift_partition  F.layer_norm + torch.roll + F.pad + window_partition
  merge_unshift_add     window_reverse + crop + torch.roll + residual add
  norm_shift_partition_amp  the same op as the fmha stage runs it under autocast: fp32 x and LayerNorm
                        parameters, windows written in the half dtype for the qkv Linear (out_dtype);
                        eager: F.layer_norm in fp32 + roll + pad + partition + the Linear's cast
  add_norm_shift_partition  the previous block's MLP residual add folded into the norm: s = x + r, then
                        norm_shift_partition of s (outputs s and the windows; the backward takes the
                        gradient arriving at s too); eager: x + r, F.layer_norm + roll + pad + partition
  merge_add_norm        a block's attention merge, residual add and norm2: s = x + merge_roll(windows),
                        y = LayerNorm(s) (outputs s and y; the backward takes gradients at both and writes
                        the windows' and x's); eager: window_reverse + crop + roll + add + F.layer_norm
  roll_partition_amp    roll_partition of an fp32 map writing the half dtype of the qkv Linear (out_dtype,
                        SwinV2's fp32 stream going into its attention); eager: roll + pad + partition + cast
  merge_norm_add_amp    SwinV2's post-norm attention half under autocast: out = x + LayerNorm(merge_roll(
                        windows)), half windows, fp32 x, parameters and out (the merged branch never
                        written); eager: window_reverse + crop + roll + F.layer_norm in fp32 + add
Stages: 56x56x128, 28x28x256, 14x14x512, 7x7x1024; ws 7, shift 3 on every stage (timm uses no
shift on the single-window 7x7 stage; the shifted case is the one that moves data); bf16 by default.

Timing, two ways, both for the eager ops and for the fused ones (fwd+bwd through autograd,
torch.autograd.grad so nothing accumulates):
  graph_us: GPU time per call. N back-to-back calls are captured into one torch.cuda.CUDAGraph and
    the replays are timed with CUDA events (median, p20/p80 over replays, divided by N): no host
    launch overhead, no idle gaps. Calls rotate over enough input sets that their data is >= 3x the
    60 MB L2 (stage 4 would otherwise be timed out of L2).
  call_us: per-call time as plain Python calls: CUDA events around a loop of back-to-back calls,
    divided by their number. On a slow host this is the host launch path (Python, autograd, Triton's
    launcher), which training pays too unless it runs under CUDA graphs.
  fwd_us / bwd_us: the fused kernels alone through the host functions (no autograd), graph replay.
  GB/s and % copy: the least traffic of fwd+bwd (read inputs, write outputs once; fp32 LN stats)
  over the fused graph_us, and that over the device-to-device copy bandwidth measured the same way
  (Tensor.copy_ of a 1 GiB buffer, counting read + write).
  --inductor: the eager ops compiled by torch.compile (Inductor, default mode, static shapes), fwd+bwd
  through autograd, graph-replayed the same way (inductor_graph_us): what torch.compile alone gives.
The first call (Triton compile) is timed separately (first_call_s), never in the medians.
--check first verifies fused == eager (data movement bit-exact; the LayerNorm ops against the eager ops
in fp32, at 2e-2 of max |ref| in half precision) on the same shapes, forward and every gradient, and
exits 1 on a mismatch.
Results: benchmarks/results/window.json ({"benchmark", "environment": environment_stamp(), "settings",
"copy", "records", "check"}) and window.md. Without a GPU it runs the interpreter on tiny shapes: a smoke
test only (nothing is written unless --out-dir is given).
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
from workbench.optimize.timing import cuda_graph_us, per_call_us  # noqa: E402
from workbench.kernels.window import (  # noqa: E402
    add_norm_shift_partition,
    add_norm_shift_partition_fwd,
    merge_add_norm,
    merge_add_norm_bwd,
    merge_add_norm_fwd,
    merge_roll_reference,
    roll_partition_reference,
    merge_roll,
    merge_norm_add,
    merge_norm_add_bwd,
    merge_norm_add_fwd,
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
OPS = ("roll_partition", "merge_roll", "norm_shift_partition", "merge_unshift_add", "norm_shift_partition_amp",
       "add_norm_shift_partition", "merge_add_norm", "roll_partition_amp", "merge_norm_add_amp")
LN_OPS = ("norm_shift_partition", "norm_shift_partition_amp", "add_norm_shift_partition", "merge_add_norm",
          "merge_norm_add_amp")
TWO_OUTPUTS = ("add_norm_shift_partition", "merge_add_norm")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LN_TOL = {"bf16": 2e-2, "fp16": 2e-2, "fp32": 1e-4}


# ---------------------------------------------------------------------------- eager references


eager_roll_partition = roll_partition_reference
eager_merge_roll = merge_roll_reference


# ------------------------------------------------------------------------------------- inputs


def make_inputs(B, H, W, C, dtype, device, seed=0) -> dict:
    """Fresh random tensors (never zeros): x/shortcut (B, H, W, C), windows (B*nW, ws*ws, C), LN params, upstream grads."""
    g = torch.Generator(device=device).manual_seed(B * 131 + H * 7 + C + 1000003 * seed)
    nw = B * -(-H // WINDOW) * -(-W // WINDOW)

    def rand(shape, scale=1.0, shift=0.0):
        return (torch.randn(shape, generator=g, device=device) * scale + shift).to(dtype)

    t = {"x": rand((B, H, W, C), 2.0, 0.5), "r": rand((B, H, W, C)), "windows": rand((nw, WINDOW * WINDOW, C)),
         "w": rand((C,), 0.5, 1.0), "b": rand((C,), 0.5),
         "d_img": rand((B, H, W, C)), "d_win": rand((nw, WINDOW * WINDOW, C))}
    # the _amp ops: fp32 activation, parameters and gradient at the fp32 stream, as autocast training holds them
    t.update(x32=t["x"].float(), w32=t["w"].float(), b32=t["b"].float(), d_img32=t["d_img"].float())
    return t


LEAVES = {"roll_partition": ("x",), "merge_roll": ("windows",), "norm_shift_partition": ("x", "w", "b"),
          "norm_shift_partition_amp": ("x32", "w32", "b32"), "add_norm_shift_partition": ("x", "r", "w", "b"),
          "merge_add_norm": ("windows", "x", "w", "b"), "merge_unshift_add": ("windows", "x"),
          "roll_partition_amp": ("x32",), "merge_norm_add_amp": ("windows", "x32", "w32", "b32")}


def leaves(op: str, t: dict) -> list[torch.Tensor]:
    return [t[k] for k in LEAVES[op]]


def forward(op: str, impl: str, t: dict, H: int, W: int, shift: int) -> torch.Tensor:
    ws = WINDOW
    if op == "roll_partition":
        return roll_partition(t["x"], ws, shift) if impl == "fused" else eager_roll_partition(t["x"], ws, shift)
    if op == "roll_partition_amp":
        half = t["d_win"].dtype
        if impl == "fused":
            return roll_partition(t["x32"], ws, shift, half)
        return eager_roll_partition(t["x32"], ws, shift).to(half)
    if op == "merge_norm_add_amp":
        if impl == "fused":
            return merge_norm_add(t["windows"], t["x32"], t["w32"], t["b32"], EPS, ws, shift)
        merged = eager_merge_roll(t["windows"], ws, shift, H, W)
        return t["x32"] + F.layer_norm(merged.float(), (merged.shape[-1],), t["w32"], t["b32"], EPS)
    if op == "merge_roll":
        return merge_roll(t["windows"], ws, shift, H, W) if impl == "fused" else eager_merge_roll(t["windows"], ws, shift, H, W)
    if op == "norm_shift_partition":
        if impl == "fused":
            return norm_shift_partition(t["x"], t["w"], t["b"], EPS, ws, shift)
        C = t["x"].shape[-1]
        return eager_roll_partition(F.layer_norm(t["x"], (C,), t["w"], t["b"], EPS), ws, shift)
    if op == "norm_shift_partition_amp":
        half = t["d_win"].dtype
        if impl == "fused":
            return norm_shift_partition(t["x32"], t["w32"], t["b32"], EPS, ws, shift, half)
        C = t["x32"].shape[-1]
        return eager_roll_partition(F.layer_norm(t["x32"], (C,), t["w32"], t["b32"], EPS), ws, shift).to(half)
    if op == "add_norm_shift_partition":  # two outputs: (s, windows)
        if impl == "fused":
            return add_norm_shift_partition(t["x"], t["r"], t["w"], t["b"], EPS, ws, shift)
        s = t["x"] + t["r"]
        return s, eager_roll_partition(F.layer_norm(s, (s.shape[-1],), t["w"], t["b"], EPS), ws, shift)
    if op == "merge_add_norm":  # two outputs: (s, y)
        if impl == "fused":
            return merge_add_norm(t["windows"], t["x"], t["w"], t["b"], EPS, ws, shift)
        s = t["x"] + eager_merge_roll(t["windows"], ws, shift, H, W)
        return s, F.layer_norm(s, (s.shape[-1],), t["w"], t["b"], EPS)
    if impl == "fused":
        return merge_unshift_add(t["windows"], t["x"], ws, shift, H, W)
    return t["x"] + eager_merge_roll(t["windows"], ws, shift, H, W)


def upstream(op: str, t: dict):
    if op == "add_norm_shift_partition":
        return t["d_img"], t["d_win"]
    if op == "merge_add_norm":
        return t["d_img"], t["r"]   # at s and at y
    if op == "merge_norm_add_amp":
        return t["d_img32"]
    return t["d_win"] if op in ("roll_partition", "roll_partition_amp", *LN_OPS) else t["d_img"]


def compiled_eager(op, H, W, shift, half: torch.dtype):
    """The eager ops of `op` compiled by torch.compile (Inductor, default mode, static shapes) as a
    function of the op's leaves: what a user gets from torch.compile alone. Dynamo's caches are reset
    first: every (op, stage) is its own compile, never a fallback to eager past the recompile limit."""
    torch._dynamo.reset()

    def eager(*args):
        t = dict(zip(LEAVES[op], args))
        t["d_win"] = torch.empty(0, dtype=half)  # forward reads only its dtype (the amp op's output dtype)
        return forward(op, "eager", t, H, W, shift)
    return torch.compile(eager, dynamic=False)


def fwd_bwd_fn(op, impl, t, H, W, shift, compiled=None):
    """Forward + backward through autograd; torch.autograd.grad returns the gradients instead of
    accumulating them into .grad (no extra add kernels, graph-capturable). impl "inductor" runs
    `compiled` (compiled_eager) on the leaves."""
    inputs, dout = leaves(op, t), upstream(op, t)

    def run():
        y = compiled(*inputs) if impl == "inductor" else forward(op, impl, t, H, W, shift)
        return torch.autograd.grad(y, inputs, dout)
    return run


def kernel_fns(op, t, H, W, shift):
    """(fwd, bwd) closures calling the fused kernels' host functions directly (no autograd)."""
    ws, x, win, d_img, d_win = WINDOW, t["x"], t["windows"], t["d_img"], t["d_win"]
    if op == "roll_partition":
        return (lambda: roll_partition_fwd(x, ws, shift)), (lambda: merge_roll_fwd(d_win, ws, shift, H, W))
    if op == "roll_partition_amp":
        x32 = t["x32"]
        return ((lambda: roll_partition_fwd(x32, ws, shift, out_dtype=d_win.dtype)),
                (lambda: merge_roll_fwd(d_win, ws, shift, H, W, out_dtype=x32.dtype)))
    if op == "merge_norm_add_amp":
        x32, w32, b32 = t["x32"], t["w32"], t["b32"]
        _, mean, rstd = merge_norm_add_fwd(win, x32, w32, b32, EPS, ws, shift, x32.dtype)
        return ((lambda: merge_norm_add_fwd(win, x32, w32, b32, EPS, ws, shift, x32.dtype)),
                (lambda: merge_norm_add_bwd(t["d_img32"], win, w32, mean, rstd, ws, shift)))
    if op == "merge_roll":
        return (lambda: merge_roll_fwd(win, ws, shift, H, W)), (lambda: roll_partition_fwd(d_img, ws, shift))
    if op == "merge_add_norm":
        s, _, mean, rstd = merge_add_norm_fwd(win, x, t["w"], t["b"], EPS, ws, shift)
        return ((lambda: merge_add_norm_fwd(win, x, t["w"], t["b"], EPS, ws, shift)),
                (lambda: merge_add_norm_bwd(t["r"], s, t["w"], mean, rstd, ws, shift, d_img, win.dtype)))
    if op == "add_norm_shift_partition":
        s, _, mean, rstd = add_norm_shift_partition_fwd(x, t["r"], t["w"], t["b"], EPS, ws, shift)
        return ((lambda: add_norm_shift_partition_fwd(x, t["r"], t["w"], t["b"], EPS, ws, shift)),
                (lambda: norm_shift_partition_bwd(d_win, s, t["w"], mean, rstd, ws, shift, ds=d_img)))
    if op in LN_OPS:
        amp = op == "norm_shift_partition_amp"
        xx, w, b = (t["x32"], t["w32"], t["b32"]) if amp else (x, t["w"], t["b"])
        out_dtype = d_win.dtype if amp else None
        _, mean, rstd = norm_shift_partition_fwd(xx, w, b, EPS, ws, shift, out_dtype=out_dtype)
        return ((lambda: norm_shift_partition_fwd(xx, w, b, EPS, ws, shift, out_dtype=out_dtype)),
                (lambda: norm_shift_partition_bwd(d_win, xx, w, mean, rstd, ws, shift)))
    return ((lambda: merge_roll_fwd(win, ws, shift, H, W, x)),
            (lambda: roll_partition_fwd(d_img, ws, shift, out_dtype=win.dtype)))


def bytes_moved(op: str, B, H, W, C, elt: int) -> int:
    """Least fwd+bwd traffic: N tokens of the map, Np of the padded windows (Np = N on these shapes)."""
    n = B * H * W * C * elt
    n32 = B * H * W * C * 4
    n_pad = B * (-(-H // WINDOW) * WINDOW) * (-(-W // WINDOW) * WINDOW) * C * elt
    stats = B * H * W * 8  # fp32 mean + rstd per token, written once and read once
    return {
        "roll_partition": (n + n_pad) + (n + n),            # fwd: read x, write windows; bwd: read valid dwin, write dx
        "merge_roll": (n + n) + (n + n_pad),                # fwd: read valid windows, write y; bwd: read dy, write dwin
        "norm_shift_partition": (n + n_pad) + (3 * n) + 2 * stats,  # bwd: read dwin, x; write dx
        # x, dx fp32 (4 bytes an element), windows and dwin in `elt`: fwd read x, write windows; bwd read dwin, x; write dx
        "norm_shift_partition_amp": (n32 + n_pad) + (n + 2 * n32) + 2 * stats,
        "merge_unshift_add": (3 * n) + (n + n_pad),         # fwd: read windows, shortcut, write; bwd: read dy, write dwin
        # fwd: read x, r, write s, windows; bwd: read dwin, s, ds, write dx
        "add_norm_shift_partition": (3 * n + n_pad) + (4 * n) + 2 * stats,
        # fwd: read windows, x, write s, y; bwd: read dy, s, ds, write dx, dwin
        "merge_add_norm": (n_pad + 3 * n) + (4 * n + n_pad) + 2 * stats,
        # fwd: read x fp32, write windows in `elt`; bwd: read valid dwin, write dx fp32
        "roll_partition_amp": (n32 + n_pad) + (n + n32),
        # fwd: read valid windows, x fp32, write out fp32; bwd: read dout fp32, windows, write dwin (the
        # shortcut's gradient is dout itself)
        "merge_norm_add_amp": (n + 2 * n32) + (n32 + n + n_pad) + 2 * stats,
    }[op]


# ------------------------------------------------------------------------------------- timing


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


L2_BYTES = 60 * 2**20
GRAPH_CALLS = 16  # calls captured per graph (rounded up to a whole number of input sets)


def n_input_sets(set_bytes: int) -> int:
    """Input sets to rotate so that one round of calls touches >= 3x the L2 (at most 8)."""
    return max(1, min(8, -(-3 * L2_BYTES // max(1, set_bytes))))


def graph_us(fns: list, replays: int) -> tuple[float, float, float]:
    """(median, p20, p80) GPU microseconds per call: fns (one closure per input set) are called round robin,
    GRAPH_CALLS calls captured into one CUDA graph, replays timed with CUDA events (workbench.optimize.timing)."""
    if not torch.cuda.is_available():
        return call_us(fns, 1, 2)
    return cuda_graph_us(fns, replays=replays, calls=GRAPH_CALLS)


def call_us(fns: list, loops: int, calls: int) -> tuple[float, float, float]:
    """(median, p20, p80) microseconds per plain call, host overhead included (workbench.optimize.timing)."""
    if not torch.cuda.is_available():  # interpreter smoke test: a couple of calls is plenty
        loops, calls = 1, 2
    return per_call_us(fns, loops=loops, calls=calls)


def first_call_s(fn) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def copy_bandwidth(device, replays) -> dict:
    """Device-to-device Tensor.copy_ of a 1 GiB buffer (64 KiB on the CPU): GB/s counting read + write.
    Timed as plain back-to-back calls (a 1 GiB copy is long enough that the host's launch cost hides behind
    it), not by graph replay: captured into a graph, copy_ becomes a memcpy node, which moves markedly
    less than the copy kernel."""
    n_bytes = (1 << 30) if device == "cuda" else (1 << 16)
    src = torch.randn(n_bytes // 4, device=device)
    dst = torch.empty_like(src)
    med, p20, p80 = call_us([lambda: dst.copy_(src)], loops=max(3, replays // 2), calls=8)
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
                if impl == "eager" and op in LN_OPS:  # the LayerNorm ops against the eager ops run in fp32
                    t = {k: v.float() for k, v in t.items()}
                for p in leaves(op, t):
                    p.requires_grad_(True)
                y = forward(op, impl, t, H, W, shift)
                ys = list(y) if isinstance(y, tuple) else [y]
                up = upstream(op, t)
                torch.autograd.backward(ys, list(up) if isinstance(up, tuple) else [up])
                outs[impl] = [v.detach() for v in ys] + [p.grad for p in leaves(op, t)]
            n_out = 2 if op in TWO_OUTPUTS else 1
            names = [f"out{i}" for i in range(n_out)] + [f"d{i}" for i in range(len(outs["fused"]) - n_out)]
            for what, ours, ref in zip(names, outs["fused"], outs["eager"]):
                if op in LN_OPS:
                    err = ((ours.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()
                    ok = bool(torch.isfinite(ours).all()) and err <= LN_TOL[dtype_name]
                else:
                    err = 0.0 if torch.equal(ours, ref) else float("inf")
                    ok = err == 0.0
                results.append({"op": op, "stage": stage, "what": what, "rel_max_err": err, "ok": ok})
    return results


def measure(stages, dtype_name, device, replays, copy_gbps, inductor=False) -> list[dict]:
    dtype = DTYPES[dtype_name]
    elt = torch.tensor([], dtype=dtype).element_size()
    records = []
    for op in OPS:
        for stage, B, H, W, C in stages:
            shift = SHIFT
            nbytes = bytes_moved(op, B, H, W, C, elt)
            sets = [make_inputs(B, H, W, C, dtype, device, seed=k) for k in range(n_input_sets(nbytes))]
            for t in sets:
                for p in leaves(op, t):
                    p.requires_grad_(True)
            rec = {"op": op, "stage": stage, "B": B, "H": H, "W": W, "C": C, "window": WINDOW, "shift": shift,
                   "dtype": dtype_name, "input_sets": len(sets), "bytes": nbytes}
            for impl in ("eager", "fused") + (("inductor",) if inductor else ()):
                compiled = compiled_eager(op, H, W, shift, sets[0]["d_win"].dtype) if impl == "inductor" else None
                fns = [fwd_bwd_fn(op, impl, t, H, W, shift, compiled) for t in sets]
                rec[f"{impl}_first_call_s"] = first_call_s(fns[0])
                rec[f"{impl}_graph_us"], rec[f"{impl}_graph_us_p20"], rec[f"{impl}_graph_us_p80"] = graph_us(fns, replays)
                rec[f"{impl}_call_us"], rec[f"{impl}_call_us_p20"], rec[f"{impl}_call_us_p80"] = call_us(fns, 5, 10)
            with torch.no_grad():
                pairs = [kernel_fns(op, t, H, W, shift) for t in sets]
                rec["kernel_first_call_s"] = first_call_s(pairs[0][0]) + first_call_s(pairs[0][1])
                rec["fwd_us"], _, _ = graph_us([f for f, _ in pairs], replays)
                rec["bwd_us"], _, _ = graph_us([b for _, b in pairs], replays)
            rec["speedup"] = rec["eager_graph_us"] / rec["fused_graph_us"]
            rec["speedup_call"] = rec["eager_call_us"] / rec["fused_call_us"]
            rec["gbps"] = nbytes / (rec["fused_graph_us"] * 1e-6) / 1e9
            rec["eager_gbps"] = nbytes / (rec["eager_graph_us"] * 1e-6) / 1e9
            rec["pct_copy"] = 100.0 * rec["gbps"] / copy_gbps
            if inductor:
                rec["speedup_vs_inductor"] = rec["inductor_graph_us"] / rec["fused_graph_us"]
                rec["inductor_gbps"] = nbytes / (rec["inductor_graph_us"] * 1e-6) / 1e9
            records.append(rec)
            del sets, fns, pairs
            if device == "cuda":
                torch.cuda.empty_cache()
    return records


def format_table(records: list[dict]) -> str:
    inductor = bool(records) and "inductor_graph_us" in records[0]
    head = (f"{'op':<24} {'stage':<16} | {'graph us: eager':>15} {'fused':>6} {'x':>5} {'fwd':>5} {'bwd':>5} "
            f"{'GB/s':>5} {'%copy':>5} | {'per call us: eager':>18} {'fused':>6}")
    if inductor:
        head += f" | {'inductor us':>11} {'%copy':>5} {'fused x':>7}"
    lines = [head]
    for r in records:
        shape = f"{r['stage']} {r['H']}x{r['W']}x{r['C']}"
        line = (f"{r['op']:<24} {shape:<16} | {r['eager_graph_us']:>15.1f} {r['fused_graph_us']:>6.1f} "
                f"{r['speedup']:>4.2f}x {r['fwd_us']:>5.1f} {r['bwd_us']:>5.1f} {r['gbps']:>5.0f} {r['pct_copy']:>4.0f}% | "
                f"{r['eager_call_us']:>18.1f} {r['fused_call_us']:>6.1f}")
        if inductor:
            line += (f" | {r['inductor_graph_us']:>11.1f} {r['pct_copy'] * r['inductor_gbps'] / r['gbps']:>4.0f}% "
                     f"{r['speedup_vs_inductor']:>6.2f}x")
        lines.append(line)
    return "\n".join(lines)


def markdown_rows(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) of the results table: one row per op and stage."""
    inductor = bool(records) and "inductor_graph_us" in records[0]
    headers = ["op", "stage", "eager GPU µs", "fused GPU µs", "speedup", "fused fwd / bwd µs", "fused GB/s",
               "% of copy", "per call µs, eager / fused"]
    if inductor:
        headers += ["Inductor GPU µs", "fused vs Inductor"]
    rows = []
    for r in records:
        row = [r["op"], f"{r['stage']} {r['H']}×{r['W']}×{r['C']}", f"{r['eager_graph_us']:.1f}",
               f"{r['fused_graph_us']:.1f}", f"{r['speedup']:.2f}x", f"{r['fwd_us']:.1f} / {r['bwd_us']:.1f}",
               f"{r['gbps']:.0f}", f"{r['pct_copy']:.0f}%", f"{r['eager_call_us']:.0f} / {r['fused_call_us']:.0f}"]
        if inductor:
            row += [f"{r['inductor_graph_us']:.1f}", f"{r['speedup_vs_inductor']:.2f}x"]
        rows.append(row)
    return headers, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="verify fused == eager first; exit 1 on a mismatch")
    add_out_dir_argument(ap)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--replays", type=int, default=20, help="graph replays timed per measurement")
    ap.add_argument("--inductor", action="store_true",
                    help="also time the eager ops compiled by torch.compile (Inductor; GPU only; adds a compile "
                         "of forward and backward per op and stage, minutes)")
    args = ap.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.inductor and device != "cuda":
        print("bench_window: --inductor needs a GPU (Inductor cannot compile these ops' Triton code for the CPU)",
              file=sys.stderr)
        return 2
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
              f"(data movement bit-exact; LayerNorm ops worst {max((c['rel_max_err'] for c in checks if c['op'] in LN_OPS), default=0):.1e} of max |ref| against fp32)")
        if failed:
            for c in failed:
                print(f"MISMATCH {c['op']} {c['stage']} {c['what']}: {c['rel_max_err']:.3e}", file=sys.stderr)
            return 1

    # The copy rate is measured before and after the ops and the faster run kept.
    copies = [copy_bandwidth(device, args.replays)]
    records = measure(stages, args.dtype, device, args.replays, copies[0]["gbps"], args.inductor)
    copies.append(copy_bandwidth(device, args.replays))
    copy = max(copies, key=lambda c: c["gbps"])
    copy["gbps_runs"] = [c["gbps"] for c in copies]
    # The bar is the faster of Tensor.copy_ and the best any op here reaches, so that a slow copy
    # measurement never flatters the kernels.
    copy["ceiling_gbps"] = max([copy["gbps"]] + [r["gbps"] for r in records])
    for r in records:
        r["pct_copy"] = 100.0 * r["gbps"] / copy["ceiling_gbps"]
    print(format_table(records))
    worst = min(records, key=lambda r: r["pct_copy"])
    print(f"# copy (Tensor.copy_ {copy['bytes'] / 2 / 2**20:g} MiB, read+write, plain calls, before / after): "
          f"{' / '.join(f'{g:.0f}' for g in copy['gbps_runs'])} GB/s; %copy is of the bar "
          f"max(copy_, best op here) = {copy['ceiling_gbps']:.0f} GB/s; fused fwd+bwd reach {worst['pct_copy']:.0f}%..{max(r['pct_copy'] for r in records):.0f}% of it "
          f"(lowest: {worst['op']} {worst['stage']})")
    geo = 1.0
    for r in records:
        geo *= r["speedup"]
    geo_call = 1.0
    for r in records:
        geo_call *= r["speedup_call"]
    print(f"# fused vs eager fwd+bwd: geomean {geo ** (1 / len(records)):.2f}x GPU time (graph), "
          f"{geo_call ** (1 / len(records)):.2f}x per plain call; "
          f"first calls (compile) {sum(r['kernel_first_call_s'] + r['fused_first_call_s'] for r in records):.1f} s; "
          f"total {time.perf_counter() - t0:.1f} s")
    if args.inductor:
        geo_ind = 1.0
        for r in records:
            geo_ind *= r["speedup_vs_inductor"]
        print(f"# fused vs torch.compile (Inductor) of the eager ops, fwd+bwd: geomean {geo_ind ** (1 / len(records)):.2f}x "
              f"GPU time (graph); range {min(r['speedup_vs_inductor'] for r in records):.2f}x.."
              f"{max(r['speedup_vs_inductor'] for r in records):.2f}x")

    settings = {"batch": stages[0][1], "stages": stages, "dtype": args.dtype, "window": WINDOW, "shift": SHIFT,
                "eps": EPS, "replays": args.replays, "graph_calls": GRAPH_CALLS, "inductor": args.inductor,
                "timing": "graph_us: CUDA-graph replay of back-to-back calls; call_us: plain calls, host included"}
    written = write_results(
        out_dir_for(args.out_dir, device == "cuda"), "window",
        title=f"Fused window ops against the eager timm ops, fwd+bwd, {args.dtype} (Swin-B stages, batch {stages[0][1]})",
        stamp=stamp, settings=settings, records=records, copy=copy, check=checks,
        table=markdown_table(*markdown_rows(records)),
        notes=[f"GPU µs: CUDA-graph replay of {GRAPH_CALLS} back-to-back calls over input sets >= 3x the L2, median of "
               f"{args.replays} replays; per call: plain calls, host included.",
               f"% of copy: fwd+bwd floor bytes over the fused GPU time, against the faster of Tensor.copy_ "
               f"(read + write) and the best op here: {copy['ceiling_gbps']:.0f} GB/s."])
    for path in written:
        print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
