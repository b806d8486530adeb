"""Window attention fwd+bwd: timm eager, SDPA backends, FlexAttention and the fused Triton kernel,
on Swin-B stage shapes at batch 64 in bf16.

    python benchmarks/bench_window_attention.py --check      # writes benchmarks/results/window_attention.{json,md}
    python benchmarks/bench_window_attention.py --window 12 --img 384 --out-dir /tmp/wa384   # Swin-B 384 (N = 144)
    python benchmarks/bench_window_attention.py --cosine --check   # SwinV2-T 256 inference: window_attention_cosine.*

Every method starts where timm's WindowAttention does, from the packed qkv tensor
(B*nW, N, 3, nH, d) bf16 and the fp32 relative_position_bias_table, and ends with the gradients of
both (autograd.grad, so nothing accumulates). The table gather is inside every timed step.
  eager        timm's formula: q*scale @ k^T + bias + mask, softmax, @ v, under bf16 autocast
  sdpa_math / sdpa_efficient / sdpa_cudnn
               F.scaled_dot_product_attention with the materialized (B*nW, nH, N, N) bf16 bias+mask,
               one backend forced each (a backend that refuses the inputs is reported, not timed)
  flex         torch.nn.attention.flex_attention (torch.compile'd) with a score_mod that adds
               bias[h] and mask[b % nW]; compile time reported separately
  fused        workbench.kernels.fused_window_attention_qkv on timm's gathered bias (the kernel alone)
  fused_table  fused_window_attention_table, as the fused_attention pass runs it: the kernels read the
               table through the index, and the backward sums the bias partials into the table's rows
  fused_views  fused_window_attention on q, k, v unbound from qkv (autograd stacks dq, dk, dv)
  fused_tiles_slowest / fused_tiles_fastest
               (windows of more than 64 tokens, on a GPU) `fused` with the key-tiled kernels autotuned over
               one grid order alone: a window's query tiles (dk/dv: key blocks) on the grid's slowest axis,
               or side by side on its fastest (TILE_FASTEST); `fused` lets the autotuner pick either
Stages 1-3 use the shifted-window mask (the more expensive block); stage 4 (one window) has none.

Timing: triton.testing.do_bench (CUDA events, L2 flushed between reps), median and 20th/80th
percentiles in microseconds. The first call of each method (compile, autotune) is timed apart
(first_call_s) and never mixed into the medians.
GB/s: memory floor bytes = read q, k, v, dout + write out, dq, dk, dv once, in bf16, over the fused
median time. "speedup" is the best non-fused median over the fused median.
--check first compares fused with eager computed in fp32 on the same inputs (out, d_qkv,
d_table relative Frobenius error < 2e-2) and exits non-zero on a mismatch.
Results: benchmarks/results/window_attention.json ({"environment", "settings", "records", "summary",
"check"}) and window_attention.md.
Without a GPU the kernel runs in Triton's interpreter on tiny shapes: a smoke test, not a measurement
(nothing is written unless --out-dir is given).

--cosine: SwinV2's cosine attention in inference (forward only, no autograd), SwinV2-T 256 shapes (window 8,
heads 3/6/12/24, d 32) at batch 64, from the packed qkv's q, k, v views (bf16), the (n_table, nH) fp32
position-bias table and the per-head logit scale:
  eager_v2     timm's formula: normalize(q) @ normalize(k)^T * logit_scale + table[index] + mask, softmax,
               @ v, under bf16 autocast
  sdpa_v2      q and k normalized (logit scale folded into q), F.scaled_dot_product_attention with the
               materialized bias + mask in bf16 (what the PyTorch-alone peers and the SDPA fallback run)
  fused_2pass  kernels.cosine.cosine_qk (one launch for q, one for k) + fused_window_attention_from_table:
               what training runs
  fused_cosine cosine_window_attention: q and k normalized inside the attention kernel as it loads them
Floor: q, k, v read once and out written once, bf16. --check: fused_cosine bit for bit fused_2pass, and
both against eager_v2 computed in fp32 (relative Frobenius error < 2e-2).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from timm.models.swin_transformer import get_relative_position_index  # noqa: E402

from _results import add_out_dir_argument, markdown_table, out_dir_for, write_results  # noqa: E402
from workbench.env import device_label, environment_stamp  # noqa: E402
from workbench.optimize.timing import cuda_graph_us  # noqa: E402
from workbench.kernels import window_attention as wa  # noqa: E402
from workbench.kernels.window_attention import (  # noqa: E402
    fused_window_attention,
    fused_window_attention_qkv,
)

SWIN_B_HEADS = (4, 8, 16, 32)
HEAD_DIM = 32
CHECK_TOL = 2e-2
SDPA_BACKENDS = ("math", "efficient", "cudnn")


def stage_shapes(batch: int, img: int, window: int, heads=SWIN_B_HEADS) -> list[dict]:
    """Swin-B's four attention shapes: resolution img/4, /8, /16, /32; nW windows of window^2 tokens."""
    shapes = []
    for i, nh in enumerate(heads):
        res = img // 4 // 2 ** i
        win = min(window, res)  # timm shrinks the window (and drops the shift) when res <= window
        nw = (res // win) ** 2
        shapes.append(dict(stage=i + 1, batch=batch, bnw=batch * nw, nh=nh, n=win * win, d=HEAD_DIM,
                           nw=nw, window=win, masked=res > window))
    return shapes


def make_inputs(shape: dict, device: str, dtype=torch.bfloat16, seed: int = 0) -> dict:
    """Fresh random qkv, bias table (+ index), -100/0 mask like timm's, upstream gradient."""
    g = torch.Generator(device=device).manual_seed(seed)
    bnw, nh, n, d, win = shape["bnw"], shape["nh"], shape["n"], shape["d"], shape["window"]
    qkv = torch.randn(bnw, n, 3, nh, d, generator=g, device=device).to(dtype).requires_grad_()
    table = (0.02 * torch.randn((2 * win - 1) ** 2, nh, generator=g, device=device)).requires_grad_()
    index = get_relative_position_index(win, win).to(device)
    mask = None
    if shape["masked"]:
        # Region ids per window; a pair of tokens in different regions gets -100 (timm's mask).
        region = torch.randint(0, 4, (shape["nw"], n), generator=g, device=device)
        mask = torch.where(region[:, :, None] == region[:, None, :], 0.0, -100.0)
    dout = torch.randn(bnw, nh, n, d, generator=g, device=device).to(dtype)
    inverse = wa.rel_pos_inverse(index, table.shape[0])
    return dict(qkv=qkv, table=table, index=index, inverse=inverse, mask=mask, dout=dout, scale=d ** -0.5)


def rel_bias(t: dict) -> torch.Tensor:
    """timm's _get_rel_pos_bias without the leading 1: (nH, N, N) fp32, differentiable to the table."""
    n = t["index"].shape[0]
    return t["table"][t["index"].view(-1)].view(n, n, -1).permute(2, 0, 1).contiguous()


def unbind_qkv(qkv):
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)


def eager_attention(t: dict) -> torch.Tensor:
    q, k, v = unbind_qkv(t["qkv"])
    attn = (q * t["scale"]) @ k.transpose(-2, -1) + rel_bias(t)[None]
    mask = t["mask"]
    if mask is not None:
        nw, nh, n = mask.shape[0], q.shape[1], q.shape[2]
        attn = (attn.view(-1, nw, nh, n, n) + mask[None, :, None]).view(-1, nh, n, n)
    return attn.softmax(-1) @ v


def sdpa_attention(backend: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
              "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def run(t: dict) -> torch.Tensor:
        q, k, v = unbind_qkv(t["qkv"])
        bnw, nh, n, _ = q.shape
        bias = rel_bias(t)[None]
        if t["mask"] is not None:
            nw = t["mask"].shape[0]
            bias = (bias.unsqueeze(1) + t["mask"][None, :, None]).expand(bnw // nw, -1, -1, -1, -1)
            bias = bias.reshape(bnw, nh, n, n)
        bias = bias.expand(bnw, nh, n, n).to(q.dtype)  # SDPA wants the mask in q's dtype
        with sdpa_kernel([chosen]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=t["scale"])
    return run


def flex_attention_fn():
    """A FlexAttention method, or None when this torch has no flex_attention."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    compiled = torch.compile(flex_attention, dynamic=False)

    def run(t: dict) -> torch.Tensor:
        q, k, v = unbind_qkv(t["qkv"])
        bias, mask = rel_bias(t), t["mask"]
        if mask is None:
            def score_mod(score, b, h, q_idx, kv_idx):
                return score + bias[h, q_idx, kv_idx]
        else:
            nw = mask.shape[0]

            def score_mod(score, b, h, q_idx, kv_idx):
                return score + bias[h, q_idx, kv_idx] + mask[b % nw, q_idx, kv_idx]
        return compiled(q, k, v, score_mod=score_mod, scale=t["scale"])
    return run


def fused_attention(t: dict) -> torch.Tensor:
    return fused_window_attention_qkv(t["qkv"], rel_bias(t), t["mask"], t["scale"])


def fused_attention_table(t: dict) -> torch.Tensor:
    return wa.fused_window_attention_table(t["qkv"], t["table"], t["index"], t["inverse"], t["mask"], t["scale"])


def fused_attention_views(t: dict) -> torch.Tensor:
    q, k, v = unbind_qkv(t["qkv"])
    return fused_window_attention(q, k, v, rel_bias(t), t["mask"], t["scale"])


def grid_order(fastest: bool):
    """A context in which the key-tiled kernels are autotuned over the configs of one grid order only
    (TILE_FASTEST or not): the three autotuners swapped in for the forward and the backward alike."""
    tuned = wa.key_tiled_autotuners(lambda c: bool(c.kwargs.get("TILE_FASTEST")) == fastest)

    @contextlib.contextmanager
    def swapped():
        saved = {name: getattr(wa, name) for name in tuned}
        for name, kernel in tuned.items():
            setattr(wa, name, kernel)
        try:
            yield
        finally:
            for name, kernel in saved.items():
                setattr(wa, name, kernel)
    return swapped


GRID_ORDERS = {"fused_tiles_slowest": False, "fused_tiles_fastest": True}


def methods(device: str, tiled: bool = False) -> dict:
    table = {"eager": eager_attention}
    for backend in SDPA_BACKENDS:
        table[f"sdpa_{backend}"] = sdpa_attention(backend)
    if device == "cuda":
        flex = flex_attention_fn()
        if flex is not None:
            table["flex"] = flex
    table["fused"] = fused_attention
    table["fused_table"] = fused_attention_table
    table["fused_views"] = fused_attention_views
    if tiled and device == "cuda":       # the key-tiled kernels' two grid orders, each autotuned alone
        for name, fastest in GRID_ORDERS.items():
            table[name] = fwd_bwd_in(grid_order(fastest), fused_attention)
    return table


def fwd_bwd_in(context, method):
    """`method` whose fwd_bwd_step runs inside `context()` (its `in_context` attribute)."""
    def run(t: dict) -> torch.Tensor:
        return method(t)
    run.in_context = context
    return run


def fwd_bwd_step(method, t: dict, autocast: bool):
    device_type = t["qkv"].device.type
    context = getattr(method, "in_context", contextlib.nullcontext)

    def step():
        with context():
            # No autocast weight cache: the step must be capturable in a CUDA graph.
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast, cache_enabled=False):
                out = method(t)
            return torch.autograd.grad(out, [t["qkv"], t["table"]], t["dout"])
    return step


def check_fused(shape: dict, device: str) -> dict:
    """Fused vs eager in fp32 on the same bf16 inputs: relative errors of out, d_qkv, d_table."""
    t = make_inputs(shape, device, seed=1)
    out = fused_attention(t)
    got = [out, *torch.autograd.grad(out, [t["qkv"], t["table"]], t["dout"])]
    qkv32 = t["qkv"].detach().float().requires_grad_()
    t32 = dict(t, qkv=qkv32)
    ref = eager_attention(t32)
    want = [ref, *torch.autograd.grad(ref, [qkv32, t["table"]], t["dout"].float())]
    errs = {name: ((a.float() - b.float()).norm() / b.float().norm()).item()
            for name, a, b in zip(("out", "d_qkv", "d_table"), got, want)}
    ok = all(e < CHECK_TOL for e in errs.values())
    return dict(stage=shape["stage"], **{f"rel_err_{k}": v for k, v in errs.items()}, ok=ok)


def time_method(name: str, method, t: dict, device: str, warmup_ms: int, rep_ms: int) -> dict:
    step = fwd_bwd_step(method, t, autocast=(name == "eager"))
    try:
        t0 = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        first = time.perf_counter() - t0
    except Exception as exc:  # a backend refusing these inputs is a result, not a crash
        return dict(method=name, status="refused", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    if device != "cuda":
        return dict(method=name, status="ok", first_call_s=first, median_us=first * 1e6, p20_us=None, p80_us=None)
    med, p20, p80 = triton.testing.do_bench(step, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    # GPU time without the host's launch cost: the same fwd+bwd replayed from a CUDA graph.
    try:
        g_med, g_p20, g_p80 = cuda_graph_us([step], replays=20, calls=8)
        graph = dict(graph_us=g_med, graph_p20_us=g_p20, graph_p80_us=g_p80)
    except Exception as exc:  # noqa: BLE001 - a method that cannot be captured is reported, not fatal
        graph = dict(graph_us=None, graph_error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    return dict(method=name, status="ok", first_call_s=first, median_us=med * 1e3, p20_us=p20 * 1e3,
                p80_us=p80 * 1e3, **graph)


def floor_bytes(shape: dict) -> int:
    """Read q, k, v, dout + write out, dq, dk, dv once, bf16."""
    return 8 * shape["bnw"] * shape["nh"] * shape["n"] * shape["d"] * 2


SWINV2_T_HEADS = (3, 6, 12, 24)


def cosine_inputs(shape: dict, device: str, seed: int = 0) -> dict:
    """make_inputs, plus SwinV2's per-head logit scale (exp of a clamped log, 10 at init) and a table in
    16 * sigmoid's range; q, k, v the views of the packed qkv, as the pass hands them over."""
    t = make_inputs(shape, device, seed=seed)
    g = torch.Generator(device=device).manual_seed(seed + 7)
    nh = shape["nh"]
    t["table"] = 16 * torch.sigmoid(torch.randn(t["table"].shape, generator=g, device=device))
    t["logit_scale"] = (torch.log(torch.full((nh,), 10.0, device=device))
                        + 0.3 * torch.randn(nh, generator=g, device=device)).exp()
    t["q"], t["k"], t["v"] = unbind_qkv(t["qkv"].detach())
    return t


def _cosine_bias(t: dict) -> torch.Tensor:
    n = t["index"].shape[0]
    return t["table"][t["index"].view(-1)].view(n, n, -1).permute(2, 0, 1)


def _cosine_masked(attn: torch.Tensor, t: dict) -> torch.Tensor:
    if t["mask"] is None:
        return attn
    nw, nh, n = t["mask"].shape[0], attn.shape[1], attn.shape[2]
    return (attn.view(-1, nw, nh, n, n) + t["mask"][None, :, None]).view(-1, nh, n, n)


def cosine_eager(t: dict) -> torch.Tensor:
    q, k, v = t["q"], t["k"], t["v"]
    with torch.autocast(q.device.type, dtype=torch.bfloat16, enabled=q.dtype != torch.float32, cache_enabled=False):
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        attn = attn * t["logit_scale"].view(1, -1, 1, 1) + _cosine_bias(t)[None]
        return _cosine_masked(attn, t).softmax(-1) @ v


def cosine_sdpa(t: dict) -> torch.Tensor:
    q, k, v = t["q"], t["k"], t["v"]
    qn = (F.normalize(q.float(), dim=-1) * t["logit_scale"].view(1, -1, 1, 1)).to(q.dtype)
    kn = F.normalize(k.float(), dim=-1).to(k.dtype)
    bnw, nh, n, _ = q.shape
    bias = _cosine_masked(_cosine_bias(t)[None].expand(bnw, nh, n, n), t).to(q.dtype)
    return F.scaled_dot_product_attention(qn, kn, v, attn_mask=bias, scale=1.0)


def cosine_fused_2pass(t: dict) -> torch.Tensor:
    from workbench.kernels.cosine import cosine_qk

    q, k = cosine_qk(t["q"], t["k"], t["logit_scale"], t["v"].dtype)
    return wa.fused_window_attention_from_table(q, k, t["v"], t["table"], t["index"], t["inverse"], t["mask"],
                                                scale=1.0)


def cosine_fused(t: dict) -> torch.Tensor:
    return wa.cosine_window_attention(t["q"], t["k"], t["v"], t["table"], t["index"], t["logit_scale"], t["mask"])


COSINE_METHODS = {"eager_v2": cosine_eager, "sdpa_v2": cosine_sdpa, "fused_2pass": cosine_fused_2pass,
                  "fused_cosine": cosine_fused}


def cosine_main(args, device: str, batch: int) -> int:
    """--cosine: SwinV2 inference attention (see the module docstring)."""
    wanted = {int(s) for s in args.stages.split(",")}
    shapes = [s for s in stage_shapes(batch, args.img, args.window, SWINV2_T_HEADS) if s["stage"] in wanted]
    if device == "cpu":
        shapes = [s for s in shapes if s["bnw"] * s["nh"] <= 96] or shapes[-1:]
    stamp = environment_stamp(device)
    print(f"# SwinV2 cosine window attention, inference, bf16, batch {batch}, img {args.img}, window "
          f"{args.window} on {device_label(stamp)}", flush=True)
    checks, records, rows = [], [], []
    with torch.no_grad():
        if args.check:
            for shape in shapes:
                t = cosine_inputs(shape, device, seed=1)
                got, two = cosine_fused(t), cosine_fused_2pass(t)
                ref = cosine_eager(dict(t, q=t["q"].float(), k=t["k"].float(), v=t["v"].float()))
                err = ((got.float() - ref).norm() / ref.norm()).item()
                c = dict(stage=shape["stage"], bit_exact_vs_2pass=bool(torch.equal(got, two)), rel_err_out=err,
                         ok=bool(torch.equal(got, two)) and err < CHECK_TOL)
                checks.append(c)
                print(f"check stage {c['stage']}: fused_cosine == fused_2pass {c['bit_exact_vs_2pass']}, "
                      f"against fp32 eager {err:.1e}  {'ok' if c['ok'] else 'MISMATCH'}", flush=True)
            if not all(c["ok"] for c in checks):
                print("error: the cosine kernel differs from the two-pass form or from eager", file=sys.stderr)
                return 1
        for shape in shapes:
            t = cosine_inputs(shape, device)
            floor = 4 * shape["bnw"] * shape["nh"] * shape["n"] * shape["d"] * 2
            times = {}
            for name, method in COSINE_METHODS.items():
                t0 = time.perf_counter()
                method(t)
                if device == "cuda":
                    torch.cuda.synchronize()
                    med, p20, p80 = cuda_graph_us([lambda: method(t)], replays=20, calls=8)
                else:
                    med = p20 = p80 = (time.perf_counter() - t0) * 1e6
                times[name] = med
                records.append({**shape, "method": name, "dtype": "bf16", "mode": "fwd", "graph_us": med,
                                "graph_p20_us": p20, "graph_p80_us": p80, "floor_bytes": floor})
            best_other = min(times["eager_v2"], times["sdpa_v2"])
            fused = times["fused_cosine"]
            dims = f"{shape['bnw']}×{shape['nh']}×{shape['n']}×{shape['d']}" + ("" if shape["masked"] else " (no mask)")
            rows.append([str(shape["stage"]), dims, *(f"{times[m]:.1f}" for m in COSINE_METHODS),
                         f"{best_other / fused:.2f}x", f"{times['fused_2pass'] / fused:.2f}x",
                         f"{floor / (fused * 1e-6) / 1e9:.0f}", f"{100 * floor / 4.8e12 * 1e6 / fused:.0f}%"])
            del t
    headers = ["stage", "windows × heads × N × d", *(f"{m} µs" for m in COSINE_METHODS),
               "fused_cosine vs best PyTorch", "vs fused_2pass", "fused_cosine GB/s", "of floor at 4.8 TB/s"]
    table_md = markdown_table(headers, rows)
    print()
    print(table_md)
    settings = dict(batch=batch, img=args.img, window=args.window, heads=SWINV2_T_HEADS, dtype="bf16", mode="fwd",
                    timer="CUDA-graph replay of 8 back-to-back calls, median of 20 replays")
    written = write_results(
        out_dir_for(args.out_dir, device == "cuda"), "window_attention_cosine",
        title=f"SwinV2 cosine window attention, inference, bf16 (SwinV2-T {args.img}, window {args.window}, "
              f"batch {batch})",
        stamp=stamp, settings=settings, records=records, check=checks, table=table_md,
        notes=["GPU µs: CUDA-graph replay (no host launch cost). Floor: q, k, v read once and out written once, "
               "bf16, at 4.8 TB/s (H200's HBM)."])
    for path in written:
        print(f"wrote {path}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--img", type=int, default=None, help="default 224 (256 with --cosine)")
    parser.add_argument("--window", type=int, default=None, help="default 7 (8 with --cosine)")
    parser.add_argument("--cosine", action="store_true",
                        help="SwinV2's cosine attention in inference (SwinV2-T shapes), forward only")
    parser.add_argument("--stages", default="1,2,3,4", help="comma-separated stage numbers")
    parser.add_argument("--methods", default=None, help="comma-separated subset of methods (default all)")
    parser.add_argument("--check", action="store_true", help="verify fused against eager (fp32) first")
    parser.add_argument("--warmup-ms", type=int, default=25)
    parser.add_argument("--rep-ms", type=int, default=100)
    add_out_dir_argument(parser)
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch = args.batch if device == "cuda" else 1
    if args.img is None:
        args.img = 256 if args.cosine else 224
    if args.window is None:
        args.window = 8 if args.cosine else 7
    if args.cosine:
        return cosine_main(args, device, batch)
    wanted = {int(s) for s in args.stages.split(",")}
    shapes = [s for s in stage_shapes(batch, args.img, args.window) if s["stage"] in wanted]
    if device == "cpu":  # interpreter smoke test: one batch, stages with few windows only
        shapes = [s for s in shapes if s["bnw"] * s["nh"] <= 64] or shapes[-1:]
    table = methods(device, tiled=args.window * args.window > 64)
    if args.methods:
        keep = set(args.methods.split(","))
        table = {k: v for k, v in table.items() if k in keep or k.startswith("fused")}
    stamp = environment_stamp(device)
    print(f"# window attention fwd+bwd, bf16, batch {batch}, img {args.img}, window {args.window} "
          f"on {device_label(stamp)}", flush=True)

    checks = []
    if args.check:
        for shape in shapes:
            checks.append(check_fused(shape, device))
            c = checks[-1]
            print(f"check stage {c['stage']}: out {c['rel_err_out']:.1e}  d_qkv {c['rel_err_d_qkv']:.1e}  "
                  f"d_table {c['rel_err_d_table']:.1e}  {'ok' if c['ok'] else 'MISMATCH'}", flush=True)
        if not all(c["ok"] for c in checks):
            print(f"error: fused window attention differs from eager by more than {CHECK_TOL}", file=sys.stderr)
            return 1

    records = []
    for shape in shapes:
        t = make_inputs(shape, device)
        for name, method in table.items():
            r = time_method(name, method, t, device, args.warmup_ms, args.rep_ms)
            records.append({**shape, **r, "dtype": "bf16", "floor_bytes": floor_bytes(shape)})
            msg = f"{r['median_us']:.0f} us (first call {r['first_call_s']:.1f} s)" if r["status"] == "ok" \
                else f"refused: {r['error']}"
            print(f"  stage {shape['stage']} {name:15s} {msg}", flush=True)
        del t
        if device == "cuda":
            torch.cuda.empty_cache()

    # The table: one row per stage. Cells: GPU time from graph replay / time per plain call (host
    # launch cost included); the speedup and GB/s use GPU time, the other column shows what a
    # launch-bound host pays.
    names = list(table)
    t_key = "graph_us" if device == "cuda" else "median_us"

    def gpu(r):
        return r.get(t_key) if r["status"] == "ok" else None

    header = ["stage", "windows × heads × N × d"] + [f"{n} µs (GPU / call)" for n in names] + [
        "GPU speedup vs best other", "fused GB/s", "floor µs at 4.8 TB/s"]
    rows, summary = [], []
    for shape in shapes:
        by_method = {r["method"]: r for r in records if r["stage"] == shape["stage"]}

        def cell(m):
            r = by_method[m]
            if r["status"] != "ok":
                return "refused"
            g = gpu(r)
            return (f"{g:.0f}" if g is not None else "-") + f" / {r['median_us']:.0f}"
        others = [gpu(r) for m, r in by_method.items() if not m.startswith("fused") and gpu(r) is not None]
        fused = gpu(by_method["fused"])
        speedup = min(others) / fused if others and fused else None
        gbs = floor_bytes(shape) / (fused * 1e-6) / 1e9 if fused else None
        summary.append(dict(stage=shape["stage"], timer=t_key, best_other_us=min(others) if others else None,
                            fused_us=fused, speedup=speedup, fused_gbs=gbs,
                            floor_fraction=(floor_bytes(shape) / 4.8e12 * 1e6) / fused if fused else None))
        dims = f"{shape['bnw']}×{shape['nh']}×{shape['n']}×{shape['d']}" + ("" if shape["masked"] else " (no mask)")
        rows.append([str(shape["stage"]), dims] + [cell(m) for m in names] + [
            f"{speedup:.2f}x" if speedup else "-", f"{gbs:.0f}" if gbs else "-",
            f"{floor_bytes(shape) / 4.8e12 * 1e6:.0f}"])
    table_md = markdown_table(header, rows)
    print()
    print(table_md)
    refused = sorted({(r["method"], r["error"]) for r in records if r["status"] != "ok"})
    for name, err in refused[:4]:
        print(f"refused: {name}: {err}")

    settings = dict(batch=batch, img=args.img, window=args.window, dtype="bf16", mode="fwd+bwd",
                    warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                    timer="graph replay (graph_us) and triton.testing.do_bench per call (median_us)")
    written = write_results(
        out_dir_for(args.out_dir, device == "cuda"), "window_attention",
        title=f"Window attention fwd+bwd, bf16: timm eager, SDPA, FlexAttention and the fused kernels "
              f"(Swin-B {args.img}, window {args.window}, batch {batch})",
        stamp=stamp, settings=settings, records=records, summary=summary, check=checks, table=table_md,
        notes=["Cells: GPU time from CUDA-graph replay / time per call by triton.testing.do_bench (host "
               "included), µs. The speedup is fused against the best of the other methods, by GPU time.",
               "Floor: q, k, v and dout read once, out, dq, dk, dv written once, at 4.8 TB/s (H200's HBM).",
               *[f"refused: {name}: {err}" for name, err in refused[:4]]])
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
