"""Where the host time of an eager step goes: launch costs, per-op host cost, per-stage host ms per step.

GPU runs only. Parts (--parts), printed as short tables and written as one JSON record:
  launch  host µs per call (no sync in the loop; tensors tiny so the GPU never backs up) of a torch op,
          a trivial Triton kernel, one with 40 int arguments, a custom op around a no-op, and the
          swinbench kernels' host functions, custom ops and autograd Functions.
  stages  for each recipe stage at a small batch (GPU time small), host ms to enqueue one training step
          (wall time of step() without a sync) against the GPU time of the step (CUDA events).
  fastlaunch  as stages, with the cached launcher (SWINBENCH_FAST_LAUNCH) off and on in alternate steps
          of one process: host ms saved per step, free of the host's drift between runs.
  paired  several stages built side by side in one process and timed in alternation (rounds of a few
          back-to-back steps each, order rotating): step ms per stage and, against the first stage, the
          median of the per-round ratios, free of the host's drift. STAGE+fastlaunch / STAGE+plainlaunch
          run STAGE with the cached launcher on / off for its steps only (plain STAGE: the default);
          STAGE+nopdl with the window kernels launched without programmatic dependent launch.
  phases  for each stage, host ms to enqueue the forward, the backward and the optimizer step.
  pyprof  cProfile of a few eager steps of one stage: the Python functions with the most own time.
  compile for each compiled stage (--compile-stages): host enqueue and step ms, Dynamo's graph breaks
          and graph count, and the cProfile top of three compiled steps (where the host time goes).

    python benchmarks/bench_host.py --out host.json [--model swin_base_patch4_window7_224 --batch 8]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.env import environment_stamp  # noqa: E402


def host_us(fn, n=400, warm=30) -> float:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n // 5):
            fn()
        samples.append((time.perf_counter() - t) / (n // 5) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def direct_launcher(jit_fn, grid, *args):
    """A closure that launches jit_fn's compiled kernel straight through its launcher, as the end of
    JITFunction.run does, with binding, specialization and the cache lookup done once here (same tensors
    every call; a real cache would key on shapes, dtypes and alignment)."""
    from triton import knobs
    from triton.runtime.driver import driver

    compiled = jit_fn[grid](*args)                  # compiles (once) and launches; returns the CompiledKernel
    device = driver.active.get_current_device()
    binder = jit_fn.device_caches[device][-1]
    bound, _, _ = binder(*args)
    values = tuple(bound.values())
    stream = driver.active.get_current_stream(device)
    g = tuple(grid) + (1,) * (3 - len(grid))
    metadata = compiled.launch_metadata(grid, stream, *values)
    run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return lambda: run(g[0], g[1], g[2], stream, function, packed, metadata, enter, leave, *values)


def launch_table() -> list[dict]:
    import triton
    import triton.language as tl

    import importlib

    # (the package re-exports functions under the module names, so import the modules by path)
    ln = importlib.import_module("workbench.kernels.layer_norm")
    win = importlib.import_module("workbench.kernels.window")
    wa = importlib.import_module("workbench.kernels.window_attention")

    @triton.jit
    def _noop(X, n):
        pid = tl.program_id(0)
        tl.store(X + pid, tl.load(X + pid) + n)

    @triton.jit
    def _noop40(X, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9,
                c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9):
        pid = tl.program_id(0)
        tl.store(X + pid, tl.load(X + pid) + a0 + b9 + c5 + d9)

    dev = torch.device("cuda")
    x = torch.zeros(1024, device=dev)
    ints = list(range(3, 43))
    rows = []

    def add(name, fn):
        rows.append({"what": name, "host_us": host_us(fn)})

    add("torch x.add_(1)", lambda: x.add_(1))
    add("torch.empty(1024)", lambda: torch.empty(1024, device=dev))
    add("triton no-op, 2 args", lambda: _noop[(1,)](x, 1))
    add("triton no-op, 41 args", lambda: _noop40[(1,)](x, *ints))
    # The launch JITFunction.run ends in, with the argument binding, specialization and cache lookup done
    # once: how much of a Triton launch's host cost a cached launcher could save (experiment, not used
    # by the kernels).
    inc = ints[0] + ints[19] + ints[25] + ints[39]
    try:
        fast = direct_launcher(_noop40, (1,), x, *ints)
        before = x[0].item()
        fast()
        ok = x[0].item() - before == inc
        rows.append({"what": "triton no-op, 41 args, cached launcher" + ("" if ok else " (WRONG RESULT)"),
                     "host_us": host_us(fast)})
    except Exception as e:  # private Triton API: report, don't fail the benchmark
        rows.append({"what": f"triton cached launcher unavailable: {type(e).__name__}: {e}"[:120], "host_us": float("nan")})

    def _plain(t: torch.Tensor) -> torch.Tensor:
        return t.new_empty(t.shape)

    op = torch.library.custom_op("swinbench_bench::noop", _plain, mutates_args=())
    op.register_fake(lambda t: t.new_empty(t.shape))
    add("python fn returning new_empty", lambda: _plain(x))
    add("custom op around it", lambda: op(x))

    # swinbench kernels at a tiny Swin shape (GPU time a few µs), bf16
    bf = torch.bfloat16
    B, H, W, C, ws, nh = 2, 14, 14, 128, 7, 4
    xs = torch.randn(B, H, W, C, device=dev, dtype=bf)
    w = torch.randn(C, device=dev, dtype=bf)
    b = torch.randn(C, device=dev, dtype=bf)
    add("layer_norm_fwd host fn", lambda: ln.layer_norm_fwd(xs.view(-1, C), None, w, b, 1e-5, bf))
    add("layer_norm custom op", lambda: ln._layer_norm_fwd_op.op(xs.view(-1, C), w, b, 1e-5, xs.dtype))
    add("F.layer_norm", lambda: torch.nn.functional.layer_norm(xs, (C,), w, b))
    add("norm_shift_partition_fwd host fn", lambda: win.norm_shift_partition_fwd(xs, w, b, 1e-5, ws, 3))
    qkv = torch.randn(B * 4, 49, 3, nh, C // nh, device=dev, dtype=bf)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    rel = torch.randn(nh, 49, 49, device=dev, dtype=bf)
    mask = torch.zeros(4, 49, 49, device=dev, dtype=bf)
    add("window_attention_fwd host fn", lambda: wa.window_attention_fwd(q, k, v, rel, mask, 0.17))
    add("window_attention custom op", lambda: wa._window_attention_fwd_op.op(q, k, v, rel, mask, 0.17))
    add("F.scaled_dot_product_attention", lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.repeat(B, 1, 1).unsqueeze(1)))

    # fwd + bwd through autograd, per call
    xg = xs.clone().requires_grad_()
    wg, bg = w.clone().requires_grad_(), b.clone().requires_grad_()
    gy = torch.randn(B * 4, 49, C, device=dev, dtype=bf)

    def nsp_fb():
        win.norm_shift_partition(xg, wg, bg, 1e-5, ws, 3).backward(gy)

    def ln_torch_fb():
        torch.nn.functional.layer_norm(xg, (C,), wg, bg).backward(xs)

    def ln_triton_fb():
        ln.layer_norm(xg, wg, bg).backward(xs)

    qkvg = qkv.clone().requires_grad_()
    relg = rel.clone().requires_grad_()
    go = torch.randn(B * 4, nh, 49, C // nh, device=dev, dtype=bf)

    def attn_fb():
        wa.fused_window_attention_qkv(qkvg, relg, mask, 0.17).backward(go)

    def sdpa_fb():
        qq, kk, vv = qkvg.permute(2, 0, 3, 1, 4).unbind(0)
        torch.nn.functional.scaled_dot_product_attention(
            qq, kk, vv, attn_mask=(relg.unsqueeze(0) + mask.repeat(B, 1, 1).unsqueeze(1))).backward(go)

    # the backward path, piece by piece: which part of a Python backward costs the host time
    xr = torch.randn(B * H * W, C, device=dev, dtype=bf)
    y0, mean0, rstd0 = ln._layer_norm_fwd_op(xr, w, b, 1e-5, xr.dtype)
    add("layer_norm_bwd host fn", lambda: ln.layer_norm_bwd(xr, xr, w, b, mean0, rstd0, None, bf))
    add("layer_norm_bwd custom op", lambda: ln._layer_norm_bwd_op.op(xr, xr, w, b, mean0, rstd0, None))

    def identity_with_backward(name, backward):
        """An autograd Function whose forward is `t * 1` and whose backward is `backward(g)`: what differs
        between the rows below is only what the Python backward does."""
        return type(name, (torch.autograd.Function,), {
            "forward": staticmethod(lambda ctx, t: t * 1), "backward": staticmethod(lambda ctx, g: backward(g))})

    def torch_op(g):
        return g * 1

    def triton_noop(g):
        _noop[(1,)](x, 1)
        return g

    TorchBwd = identity_with_backward("TorchBwd", torch_op)
    TritonBwd = identity_with_backward("TritonBwd", triton_noop)
    OpBwd = identity_with_backward("OpBwd", op)

    class DirectLnBwd(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            y, m, r = ln._layer_norm_fwd_op(t, wg, bg, 1e-5, t.dtype)
            ctx.save_for_backward(t, m, r)
            return y

        @staticmethod
        def backward(ctx, g):
            t, m, r = ctx.saved_tensors
            dx, _ = ln.layer_norm_bwd(g, t, wg, bg, m, r, None, t.dtype)   # (dx, column sums)
            return dx

    xrg = xr.clone().requires_grad_()
    gr = torch.randn_like(xr)
    for name, fn in (("Function, torch op in backward", TorchBwd), ("Function, triton no-op in backward", TritonBwd),
                     ("Function, custom op in backward", OpBwd), ("Function, layer_norm_bwd host fn", DirectLnBwd)):
        add(name + " (fwd+bwd)", lambda fn=fn: fn.apply(xrg).backward(gr))
        add(name + " (autograd.grad)", lambda fn=fn: torch.autograd.grad(fn.apply(xrg), xrg, gr))
    add("x*1 fwd+bwd (no Python backward)", lambda: (xrg * 1).backward(gr))

    add("F.layer_norm fwd+bwd", ln_torch_fb)
    add("triton layer_norm fwd+bwd", ln_triton_fb)
    add("norm_shift_partition fwd+bwd", nsp_fb)
    add("fused attention fwd+bwd", attn_fb)
    add("SDPA (bias+mask) fwd+bwd", sdpa_fb)
    return rows


def backward_timeline(n: int = 200) -> list[dict]:
    """Timestamps through one Triton LayerNorm fwd+bwd: where between `.backward()` and its return
    the host time goes (engine hand-off, saved tensors, the custom op, grad accumulation)."""
    import importlib

    ln = importlib.import_module("workbench.kernels.layer_norm")
    dev, bf = torch.device("cuda"), torch.bfloat16
    x = torch.randn(392, 128, device=dev, dtype=bf, requires_grad=True)
    w = torch.randn(128, device=dev, dtype=bf, requires_grad=True)
    b = torch.randn(128, device=dev, dtype=bf, requires_grad=True)
    gy = torch.randn(392, 128, device=dev, dtype=bf)
    marks: dict[str, list[float]] = {}
    now = time.perf_counter
    orig_bwd, orig_op = ln.LayerNormFunction.backward, ln._layer_norm_bwd_op

    def timed_op(*a):
        marks.setdefault("op_in", []).append(now())
        r = orig_op(*a)
        marks.setdefault("op_out", []).append(now())
        return r

    def timed_backward(ctx, dy):
        marks.setdefault("bwd_in", []).append(now())
        r = orig_bwd(ctx, dy)
        marks.setdefault("bwd_out", []).append(now())
        return r

    ln._layer_norm_bwd_op = timed_op
    ln.LayerNormFunction.backward = staticmethod(timed_backward)
    try:
        for i in range(n + 20):
            t0 = now()
            y = ln.layer_norm(x, w, b)
            t1 = now()
            y.backward(gy)
            t2 = now()
            if i >= 20:
                marks.setdefault("t0", []).append(t0)
                marks.setdefault("t1", []).append(t1)
                marks.setdefault("t2", []).append(t2)
        torch.cuda.synchronize()
    finally:
        ln._layer_norm_bwd_op = orig_op
        ln.LayerNormFunction.backward = orig_bwd
    for k in ("op_in", "op_out", "bwd_in", "bwd_out"):
        marks[k] = marks[k][20:]
    seg = [("forward (apply)", "t0", "t1"), ("backward() -> Function.backward entry", "t1", "bwd_in"),
           ("backward entry -> op call", "bwd_in", "op_in"), ("custom op layer_norm_bwd", "op_in", "op_out"),
           ("op return -> backward exit", "op_out", "bwd_out"), ("backward exit -> backward() returns", "bwd_out", "t2"),
           ("total", "t0", "t2")]
    return [{"what": name, "host_us": statistics.median(e - s for s, e in zip(marks[a], marks[z])) * 1e6}
            for name, a, z in seg]


def build_stage(model: str, batch: int, stage: str):
    """A bf16 training workload with every pass of `stage`'s recipe chain applied, prepared."""
    from workbench.interleave import build_stage_workload
    from workbench.workload import WorkloadConfig

    return build_stage_workload(WorkloadConfig(model=model, batch=batch, precision="bf16", device="cuda"), stage)[0]


def host_and_step_ms(wl, steps: int) -> tuple[float, float]:
    """Medians over `steps` training steps: host ms to enqueue one (wall time of step() without a sync)
    and the step's GPU ms (CUDA events around it, synchronized before and after)."""
    enq, gpu = [], []
    for i in range(steps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        e0.record()
        t = time.perf_counter()
        wl.step(i)
        enq.append((time.perf_counter() - t) * 1e3)
        e1.record()
        torch.cuda.synchronize()
        gpu.append(e0.elapsed_time(e1))
    return statistics.median(enq), statistics.median(gpu)


def fastlaunch_table(model: str, batch: int, stages: list[str], steps: int) -> list[dict]:
    """For each stage, host enqueue and step ms with the cached launcher off and on, alternating from step
    to step in one process (one workload), so that the host's drift falls on both sides alike. The
    first steps of each side (compiles, cache misses) are warm-up. Medians per side, and the median of
    the paired differences (each "on" step against the "off" step just before it)."""
    from workbench.kernels import _common as _ops

    rows = []
    saved = _ops.FAST_LAUNCH
    try:
        for stage in stages:
            wl = build_stage(model, batch, stage)
            for i in range(4):
                _ops.FAST_LAUNCH = bool(i % 2)
                wl.step(i)
            torch.cuda.synchronize()
            samples = {False: [], True: []}
            for i in range(2 * steps):
                _ops.FAST_LAUNCH = bool(i % 2)
                samples[_ops.FAST_LAUNCH].append(host_and_step_ms(wl, 1))
            off, on = samples[False], samples[True]
            row = {"stage": stage, "steps_per_side": steps,
                   "host_ms_off": statistics.median(h for h, _ in off),
                   "host_ms_on": statistics.median(h for h, _ in on),
                   "step_ms_off": statistics.median(g for _, g in off),
                   "step_ms_on": statistics.median(g for _, g in on),
                   "host_ms_paired_saving": statistics.median(a[0] - b[0] for a, b in zip(off, on))}
            rows.append(row)
            print(f"  {stage:14s} host enqueue off {row['host_ms_off']:7.2f} ms  on {row['host_ms_on']:7.2f} ms  "
                  f"(paired saving {row['host_ms_paired_saving']:6.2f} ms)   step off {row['step_ms_off']:7.2f}  "
                  f"on {row['step_ms_on']:7.2f} ms", flush=True)
            del wl
            torch.cuda.empty_cache()
    finally:
        _ops.FAST_LAUNCH = saved
    return rows


def paired_table(model: str, batch: int, stages: list[str], rounds: int, block: int = 3) -> list[dict]:
    """Step times of several stages built side by side in one process, measured in alternation
    (workbench.interleave.time_interleaved: rounds of `block` back-to-back steps of each stage, the order
    rotating), so that the host's drift falls on every stage alike. Per stage: the median step over all
    rounds, and against the first stage the median of the per-round ratios (> 1 is faster)."""
    from workbench.interleave import paired_ratio, time_interleaved
    from workbench.kernels import _common as _ops

    # suffix -> (fast launch, PDL) for that stage's steps; a plain stage runs the defaults
    default = (_ops.FAST_LAUNCH, _ops.pdl_launch())
    flags = {"": default, "fastlaunch": (True, default[1]), "plainlaunch": (False, default[1]),
             "nopdl": (default[0], False)}
    steps = {}
    for stage in stages:
        base, _, flag = stage.partition("+")
        if flag not in flags:
            raise SystemExit(f"paired: unknown stage suffix +{flag} (one of {', '.join('+' + f for f in flags if f)})")
        wl = build_stage(model, batch, base)

        def step(i, _wl=wl, _flags=flags[flag]):
            _ops.FAST_LAUNCH, _ops.PDL_LAUNCH = _flags
            return _wl.step(i)
        steps[stage] = step
    try:
        timings = time_interleaved(steps, rounds=rounds, block=block, warmup=3, device=torch.device("cuda"))
    finally:
        _ops.FAST_LAUNCH, _ops.PDL_LAUNCH = default
    rows, first = [], stages[0]
    for stage in stages:
        samples = timings[stage]["samples_ms"]
        q = statistics.quantiles(samples, n=4)
        ratio = paired_ratio(timings[first]["round_median_ms"], timings[stage]["round_median_ms"])["median"]
        rows.append({"stage": stage, "steps": len(samples), "step_ms": statistics.median(samples),
                     "step_iqr_ms": q[2] - q[0], f"x_{first}_paired": ratio, "samples_ms": samples})
        print(f"  {stage:48s} step {rows[-1]['step_ms']:7.2f} ± {rows[-1]['step_iqr_ms']:5.2f} ms "
              f"({len(samples)} steps)   x {first}: {ratio:5.3f} (paired)", flush=True)
    return rows


def warm_stage(model: str, batch: int, stage: str):
    """build_stage, then three steps (compiles, autotuning, cache misses) and a sync."""
    wl = build_stage(model, batch, stage)
    for i in range(3):
        wl.step(i)
    torch.cuda.synchronize()
    return wl


def stage_table(model: str, batch: int, stages: list[str], steps: int) -> list[dict]:
    rows = []
    for stage in stages:
        wl = warm_stage(model, batch, stage)
        host_ms, step_ms = host_and_step_ms(wl, steps)
        rows.append({"stage": stage, "host_ms_per_step": host_ms, "step_ms": step_ms})
        print(f"  {stage:14s} host enqueue {rows[-1]['host_ms_per_step']:7.2f} ms   step {rows[-1]['step_ms']:7.2f} ms",
              flush=True)
        del wl
        torch.cuda.empty_cache()
    return rows


def phase_table(model: str, batch: int, stages: list[str], steps: int) -> list[dict]:
    """For each stage, host ms to enqueue each phase of a training step (forward with the loss, backward,
    optimizer step with zero_grad), the GPU idle before the step so that no phase waits on a full launch
    queue: medians over `steps` steps. Where the step is host-bound these say which phase to cut."""
    rows = []
    for stage in stages:
        wl = warm_stage(model, batch, stage)
        phases = {"forward": [], "backward": [], "optimizer": []}
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _, loss = wl.forward_loss()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            wl.optimizer.step()
            wl.optimizer.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            for k, a, b in (("forward", t0, t1), ("backward", t1, t2), ("optimizer", t2, t3)):
                phases[k].append((b - a) * 1e3)
        torch.cuda.synchronize()
        row = {"stage": stage, "steps": steps, **{f"{k}_host_ms": statistics.median(v) for k, v in phases.items()}}
        rows.append(row)
        print(f"  {stage:14s} host ms  forward {row['forward_host_ms']:7.2f}  backward {row['backward_host_ms']:7.2f}  "
              f"optimizer {row['optimizer_host_ms']:7.2f}", flush=True)
        del wl
        torch.cuda.empty_cache()
    return rows


def gc_table(model: str, batch: int, stages: list[str], steps: int) -> list[dict]:
    """Step time (CUDA events, warm-up excluded) with Python's cyclic GC as it is, and with the objects
    alive after warm-up frozen (gc.freeze) and collection off during the timed steps."""
    import gc

    rows = []
    for stage in stages:
        wl = build_stage(model, batch, stage)
        for i in range(5):
            wl.step(i)
        for mode in ("gc on", "gc frozen+off", "gc on (again)"):
            if mode == "gc frozen+off":
                gc.collect()
                gc.freeze()
                gc.disable()
            times, collections = [], sum(s["collections"] for s in gc.get_stats())
            for i in range(steps):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                wl.step(i)
                e1.record()
                e1.synchronize()
                times.append(e0.elapsed_time(e1))
            collections = sum(s["collections"] for s in gc.get_stats()) - collections
            if mode == "gc frozen+off":
                gc.enable()
                gc.unfreeze()
            times.sort()
            rows.append({"stage": stage, "mode": mode, "median_ms": statistics.median(times),
                         "p90_ms": times[int(0.9 * (len(times) - 1))], "max_ms": times[-1], "gc_collections": collections})
            r = rows[-1]
            print(f"  {stage:8s} {mode:14s} median {r['median_ms']:7.2f}  p90 {r['p90_ms']:7.2f}  max {r['max_ms']:7.2f} ms"
                  f"  collections {collections}", flush=True)
        del wl
        torch.cuda.empty_cache()
    return rows


def thread_profile(model: str, batch: int, stage: str, steps: int, top: int) -> dict:
    """Own time per Python function, per thread, over a few eager steps. cProfile sees only the thread
    that enables it; a backward's Python (autograd Functions, kernel host code) runs on autograd's device
    thread, so this installs a profile function on every thread (Python >= 3.12), the engine's included
    (its thread state exists after the warm-up steps)."""
    import threading
    from collections import defaultdict

    if not hasattr(threading, "setprofile_all_threads"):
        return {"error": "needs Python 3.12 (threading.setprofile_all_threads)"}
    wl = build_stage(model, batch, stage)
    for i in range(3):
        wl.step(i)
    torch.cuda.synchronize()
    now = time.perf_counter
    own: dict = defaultdict(float)
    calls: dict = defaultdict(int)
    stacks: dict = defaultdict(list)   # thread id -> [(key, start, child time)]

    def prof(frame, event, arg):
        tid = threading.get_ident()
        if event in ("call", "c_call"):
            code = frame.f_code
            key = (f"{code.co_name} ({Path(code.co_filename).name}:{code.co_firstlineno})" if event == "call"
                   else f"<{getattr(arg, '__qualname__', str(arg))}>")
            stacks[tid].append([key, now(), 0.0])
        elif event in ("return", "c_return", "c_exception"):
            st = stacks[tid]
            if not st:
                return
            key, t0, child = st.pop()
            dt = now() - t0
            thread = "main" if tid == main_tid else "other"
            own[(thread, key)] += dt - child
            calls[(thread, key)] += 1
            if st:
                st[-1][2] += dt

    main_tid = threading.get_ident()
    threading.setprofile_all_threads(prof)
    try:
        t0 = now()
        for i in range(steps):
            wl.step(i)
        torch.cuda.synchronize()
        wall = now() - t0
    finally:
        threading.setprofile_all_threads(None)
    out = {"wall_ms_per_step": wall / steps * 1e3, "threads": {}}
    for thread in ("main", "other"):
        rows = sorted(((k[1], v) for k, v in own.items() if k[0] == thread), key=lambda kv: -kv[1])[:top]
        out["threads"][thread] = [{"function": k, "own_ms_per_step": v / steps * 1e3,
                                   "calls_per_step": calls[(thread, k)] / steps} for k, v in rows]
        total = sum(v for k, v in own.items() if k[0] == thread) / steps * 1e3
        print(f"  {thread} thread: {total:.1f} ms of Python own time per step (profiled wall "
              f"{out['wall_ms_per_step']:.1f} ms/step)")
        for r in out["threads"][thread]:
            print(f"    {r['own_ms_per_step']:7.2f} ms  {r['calls_per_step']:6.0f}x  {r['function']}")
    return out


def pyprof(model: str, batch: int, stage: str, steps: int, top: int) -> str:
    wl = build_stage(model, batch, stage)
    for i in range(3):
        wl.step(i)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for i in range(steps):
        wl.step(i)
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def launch_counts(stats: pstats.Stats, steps: int) -> dict:
    """Kernel launches per step read off a cProfile of `steps` steps: Inductor's own Triton kernels
    (`_launch_kernel`, its static launcher), Triton kernels launched through Triton's launcher (ours, in
    eager mode or as Inductor's user-defined kernels), and the GEMMs (torch.mm / addmm / bmm calls)."""
    counts = {"inductor_triton": 0, "triton_launcher": 0, "gemm_calls": 0}
    for (filename, _, func), (_, ncalls, *_rest) in stats.stats.items():
        name = func.strip("<>")   # C functions are keyed '<name>' or '<built-in method name>'
        if name.endswith("_launch_kernel"):
            counts["inductor_triton"] += ncalls
        elif name == "__call__" and filename.endswith("backends/nvidia/driver.py"):
            counts["triton_launcher"] += ncalls
        elif name in ("built-in method torch.mm", "built-in method torch.addmm", "built-in method torch.bmm"):
            counts["gemm_calls"] += ncalls
    return {k: v / steps for k, v in counts.items()}


def compile_table(model: str, batch: int, stages: list[str], steps: int, top: int) -> list[dict]:
    from torch._dynamo.utils import counters

    rows = []
    for stage in stages:
        counters.clear()
        t = time.perf_counter()
        wl = build_stage(model, batch, stage)
        for i in range(3):
            wl.step(i)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t
        breaks = {k: v for k, v in counters["graph_break"].items()}
        graphs = counters["stats"].get("unique_graphs", 0)
        host_ms, step_ms = host_and_step_ms(wl, steps)
        prof = cProfile.Profile()
        prof.enable()
        for i in range(3):
            wl.step(i)
        torch.cuda.synchronize()
        prof.disable()
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        stats.sort_stats("tottime").print_stats(top)
        launches = launch_counts(stats, 3)
        row = {"stage": stage, "host_ms_per_step": host_ms, "step_ms": step_ms, "launches_per_step": launches,
               "build_and_compile_s": compile_s, "graph_breaks": breaks, "unique_graphs": graphs,
               "pyprof": buf.getvalue()}
        rows.append(row)
        print(f"  {stage:20s} host enqueue {row['host_ms_per_step']:7.2f} ms   step {row['step_ms']:7.2f} ms   "
              f"graphs {graphs}   graph breaks {sum(breaks.values())}: {breaks}   launches/step {launches}", flush=True)
        print("\n".join(row["pyprof"].splitlines()[:top + 12]), flush=True)
        del wl
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="swin_base_patch4_window7_224")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--stages", default="amp,apex,window,fmha,dense,block")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--pyprof-stage", default="fmha")
    ap.add_argument("--compile-stages", default="torch-compile,fmha-compile")
    ap.add_argument("--parts", default="launch,timeline,stages,threads")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_host needs a CUDA GPU")
        return 2
    record = {"benchmark": "host", "environment": environment_stamp(), "settings": vars(args)}
    parts = args.parts.split(",")
    if "launch" in parts:
        record["launch"] = launch_table()
        for r in record["launch"]:
            print(f"  {r['what']:38s} {r['host_us']:8.1f} µs")
    if "timeline" in parts:
        record["timeline"] = backward_timeline()
        for r in record["timeline"]:
            print(f"  {r['what']:40s} {r['host_us']:8.1f} µs")
    if "stages" in parts:
        record["stages"] = stage_table(args.model, args.batch, args.stages.split(","), args.steps)
    if "fastlaunch" in parts:
        record["fastlaunch"] = fastlaunch_table(args.model, args.batch, args.stages.split(","), args.steps)
    if "paired" in parts:
        record["paired"] = paired_table(args.model, args.batch, args.stages.split(","), args.steps)
    if "phases" in parts:
        record["phases"] = phase_table(args.model, args.batch, args.stages.split(","), args.steps)
    if "gc" in parts:
        record["gc"] = gc_table(args.model, args.batch, args.stages.split(","), args.steps)
    if "threads" in parts:
        record["threads"] = thread_profile(args.model, args.batch, args.pyprof_stage, 3, 25)
    if "pyprof" in parts:
        record["pyprof"] = pyprof(args.model, args.batch, args.pyprof_stage, 3, 40)
        print(record["pyprof"][:6000])
    if "compile" in parts:
        record["compile"] = compile_table(args.model, args.batch, args.compile_stages.split(","), args.steps, 22)
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
