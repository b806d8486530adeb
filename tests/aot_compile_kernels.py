"""Compile every Triton kernel launch the host functions make, ahead of time, for an H200 (sm_90),
without a GPU: Triton's own compiler and its bundled ptxas, down to a cubin.

The CPU tests run the kernels under TRITON_INTERPRET=1, which executes them in numpy and accepts code
that the GPU compiler would reject (a dtype mismatch in a tl.where, a constexpr used as a tensor, a block
shape that is not a power of two, too much shared memory). This script, run in a process WITHOUT
TRITON_INTERPRET, calls the host functions on small CPU tensors with `launch` replaced by a recorder
(nothing runs), so it sees exactly the specializations they would launch (dtypes, constexprs, warps,
stages, register caps; every config of an autotuned kernel), and compiles each once for sm_90.

    python tests/aot_compile_kernels.py [--quick] [--resources] [--sass DIR]   # a line per variant; exit 1 on a failure

--resources adds each variant's registers and stack (spills) as ptxas allocated them for sm_90
(Triton's bundled cuobjdump on the cubin), and lists the variants that spill (apart, those whose
allocation fell to 32 registers with a stack over 4 KB); and, for a kernel whose
loop Triton pipelines (cp.async prefetch into shared memory), the commit groups each of its waits leaves
in flight (`waits`, from the TTGIR): where every wait is 0 the loop waits for a load as soon as it issues
it, so nothing is prefetched while it computes (at num_stages = 2 Triton issues the next iteration's
loads at the end of the loop body), and the variant is listed.
--sass DIR writes each variant's SASS (no addresses or encodings) to
DIR/<kernel>-<hash of its specialization>.sass: diff two such folders, built from two versions of the
code, to see whether a change to a kernel's source changed the instructions it runs.

Every Swin-B stage shape and dtype takes about 240 variants and 3-7 minutes on 2 CPU cores (Triton caches
them on disk after that); --quick compiles one shape per code path (window attention at windows 7 and 12), bf16 and fp32,
which tests/test_kernels_compile_for_gpu.py runs in CI.
"""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H200 (Hopper, sm_90), warp size 32
SM_COUNT = 132
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
          torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}
OPTION_KEYS = ("num_warps", "num_stages", "maxnreg", "num_ctas", "launch_pdl")

MODULES = ("_common", "layer_norm", "window", "window_attention", "linear", "quant", "mlp", "qkv_attention", "cosine", "drop_path",
           "adamw")
RECORDED: list[tuple] = []
COLLAPSED_REGS, COLLAPSED_STACK = 32, 4096   # --resources: a register allocation that fell to the minimum


class _Recorder:
    """What `launch(kernel)[grid](*args, **kwargs)` would launch: recorded, not run."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            k = self.kernel
            if hasattr(k, "configs") and hasattr(k, "fn"):  # an autotuner: every config it may pick
                for cfg in k.configs:
                    kw = dict(kwargs, **cfg.kwargs)
                    for opt in OPTION_KEYS:
                        if getattr(cfg, opt, None) is not None:
                            kw[opt] = getattr(cfg, opt)
                    RECORDED.append((k.fn, args, kw))
                k.best_config = k.configs[0]  # host code reads the chosen config after a launch
            else:
                RECORDED.append((k, args, kwargs))
        return record


def _record_launches(quick: bool) -> None:
    ops = importlib.import_module("workbench.kernels._common")
    assert not ops._INTERPRET, "run without TRITON_INTERPRET"
    for name in MODULES:
        mod = importlib.import_module(f"workbench.kernels.{name}")
        if hasattr(mod, "launch"):
            mod.launch = _Recorder
        if hasattr(mod, "sm_count"):
            mod.sm_count = lambda device: SM_COUNT
    ln = importlib.import_module("workbench.kernels.layer_norm")
    win = importlib.import_module("workbench.kernels.window")
    wa = importlib.import_module("workbench.kernels.window_attention")
    lin = importlib.import_module("workbench.kernels.linear")
    quant = importlib.import_module("workbench.kernels.quant")
    cosine = importlib.import_module("workbench.kernels.cosine")
    drop = importlib.import_module("workbench.kernels.drop_path")
    for fn in (getattr(win, "_norm_bwd_config", None), getattr(ln, "_bwd_grid", None)):
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()

    def r(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape).to(dtype)

    for dt in (torch.float32, torch.bfloat16):
        # 128-1536: the blocks' widths; 512-2048: the patch mergings' 4C (their norms write the reduction
        # Linear's bf16 from an fp32 x at the first merge)
        for C in ((128, 1024) if quick else (128, 512, 1024, 1536, 2048)):
            x, res, w, b = r(64, C, dtype=dt), r(64, C, dtype=dt), r(C, dtype=torch.float32), r(C, dtype=torch.float32)
            zero = torch.empty(2 * C)
            ln.layer_norm_fwd(x, None, w, b, 1e-5, dt, zero_sums=zero)
            ln.layer_norm_fwd(x, None, w, b, 1e-5, dt, torch.float32)
            ln.layer_norm_fwd(x, None, w, b, 1e-5, dt, torch.bfloat16, zero_sums=zero)
            ln.layer_norm_fwd(x, res, w, b, 1e-5, dt, torch.bfloat16, zero_sums=zero)
            # SwinV2's post-norm residual: a bf16 (or fp32) branch normalized and added to the fp32 stream
            ln.post_add_layer_norm_fwd(x, r(64, C, dtype=torch.float32), w, b, 1e-5, torch.float32, zero_sums=zero)
            for atomic_into in (zero, None):
                ln.layer_norm_bwd(r(64, C, dtype=dt), x, w, b, torch.zeros(64), torch.ones(64), r(64, C, dtype=dt), dt,
                                  sums_into=atomic_into)
            for dy_dt in {dt, torch.bfloat16}:  # a plain norm's backward (no residual); dy bf16 where it wrote bf16
                ln.layer_norm_bwd(r(64, C, dtype=dy_dt), x, w, b, torch.zeros(64), torch.ones(64), None, dt, sums_into=zero)
        ops.sum_partials(torch.randn(5, 256))
        # inference's PatchMerging: pad + 2x2 gather + norm from the (B, H, W, C) map, into the reduction's bf16
        for (H, C) in (((56, 128), (7, 96)) if quick else ((56, 128), (28, 256), (14, 512), (7, 96))):
            ln.merging_layer_norm(r(2, H, H, C, dtype=dt), r(4 * C, dtype=torch.float32), r(4 * C, dtype=torch.float32),
                                  1e-5, torch.bfloat16)
    for dt in (torch.float32, torch.bfloat16):
        shapes = ((2, 56, 56, 128), (2, 28, 28, 256), (2, 14, 14, 512), (2, 7, 7, 1024), (1, 9, 15, 33))
        for (B, H, W, C) in (shapes[2:3] + shapes[4:] if quick else shapes):
            x = r(B, H, W, C, dtype=dt)
            w, b = r(C, dtype=torch.float32), r(C, dtype=torch.float32)
            shift = 3 if H > 7 else 0
            win.roll_partition_fwd(x, 7, shift)
            win.roll_partition_fwd(x, 7, shift, out_dtype=torch.bfloat16)  # SwinV2: windows in qkv's dtype
            windows, mean, rstd = win.norm_shift_partition_fwd(x, w, b, 1e-5, 7, shift, out_dtype=torch.bfloat16,
                                                              zero_sums=torch.empty(2 * C))
            win.add_norm_shift_partition_fwd(x, r(B, H, W, C), w, b, 1e-5, 7, shift)
            # the previous block's MLP branch (bf16) under stochastic depth, each way
            win.add_norm_shift_partition_fwd(x, r(B, H, W, C), w, b, 1e-5, 7, shift, keep=torch.ones(B))
            win._norm_bwd(windows, x, w, mean, rstd, 7, shift, x, torch.empty_like(x), r(B, H, W, C),
                          torch.empty(2 * C), keep=torch.ones(B, dtype=torch.bfloat16), res_out=True)
            win.merge_roll_fwd(windows, 7, shift, H, W, x)
            win.merge_roll_fwd(windows, 7, shift, H, W)
            win.norm_shift_partition_bwd(windows, x, w, mean, rstd, 7, shift, ds=x)
            win.norm_shift_partition_bwd(windows, x, w, mean, rstd, 7, shift, sums_into=torch.empty(2 * C))
            # a block's merge + add + norm2: bf16 attention windows into the residual stream (fp32 or bf16),
            # the norm writing fc1's bf16
            s, _, mean, rstd = win.merge_add_norm_fwd(windows, x, w, b, 1e-5, 7, shift, y_dtype=torch.bfloat16,
                                                      zero_sums=torch.empty(2 * C))
            win.merge_add_norm_bwd(r(B, H, W, C), s, w, mean, rstd, 7, shift, x, torch.bfloat16, dt,
                                   sums_into=torch.empty(2 * C))
            # SwinV2's post-norm attention half: bf16 attention windows, norm1, added to the stream
            out, mean, rstd = win.merge_norm_add_fwd(windows, x, w, b, 1e-5, 7, shift, dt, zero_sums=torch.empty(2 * C))
            win.merge_norm_add_bwd(out, windows, w, mean, rstd, 7, shift, sums_into=torch.empty(2 * C))
            # programmatic dependent launch (on where supported)
            ops.PDL_LAUNCH, ops._PDL_SUPPORTED = True, True
            try:
                win.roll_partition_fwd(x, 7, shift)
                win.merge_roll_fwd(windows, 7, shift, H, W, x)
                windows, mean, rstd = win.norm_shift_partition_fwd(x, w, b, 1e-5, 7, shift,
                                                                  zero_sums=torch.empty(2 * C))
                win.norm_shift_partition_bwd(windows, x, w, mean, rstd, 7, shift, sums_into=torch.empty(2 * C))
                s, _, mean, rstd = win.merge_add_norm_fwd(windows, x, w, b, 1e-5, 7, shift,
                                                          zero_sums=torch.empty(2 * C))
                win.merge_add_norm_bwd(r(B, H, W, C), s, w, mean, rstd, 7, shift, x, torch.bfloat16, dt,
                                       sums_into=torch.empty(2 * C))
                win._norm_grads(torch.empty(2 * C), w.to(torch.bfloat16), b.to(torch.bfloat16))
                win._norm_grads(torch.empty(16, 2 * C), w.to(torch.bfloat16), b.to(torch.bfloat16))
                win._norm_grads(torch.empty(16, 2 * C), w, b)
            finally:
                ops.PDL_LAUNCH, ops._PDL_SUPPORTED = None, None
    for dt in ((torch.bfloat16,) if quick else (torch.bfloat16, torch.float32)):
        attn_shapes = ((7, 4, 16, True), (7, 32, 1, False), (12, 4, 4, True))
        for (ws, heads, nw, masked) in (attn_shapes[::2] if quick else attn_shapes):  # quick: windows 7 and 12
            n, d = ws * ws, 32
            q, k, v = (r(2 * nw, heads, n, d, dtype=dt) for _ in range(3))
            bias, mask = r(heads, n, n, dtype=torch.float32), (r(nw, n, n, dtype=torch.float32) if masked else None)
            out, lse = wa.window_attention_fwd(q, k, v, bias, mask, d ** -0.5)
            wa.window_attention_bwd(q, k, v, out, lse, r(2 * nw, heads, n, d, dtype=dt), bias, mask, d ** -0.5)
            n_table = (2 * ws - 1) ** 2
            from timm.models.swin_transformer import get_relative_position_index

            index = get_relative_position_index(ws, ws).to(torch.int64)
            inverse = wa.rel_pos_inverse(index, n_table)
            table = r(n_table, heads, dtype=torch.float32)
            out, lse = wa.window_attention_fwd(q, k, v, table, mask, d ** -0.5, index=index)
            # SwinV2 inference: q and k normalized in the kernel, q times the head's logit scale
            wa.window_attention_fwd(q, k, v, table, mask, 1.0, index=index, cosine=torch.ones(heads))
            wa.window_attention_bwd(q, k, v, out, lse, r(2 * nw, heads, n, d, dtype=dt), table, mask, d ** -0.5,
                                    index=index, inverse=inverse)
            wa.rel_pos_table_grad_host(r(1, heads, n * n, dtype=torch.float32), inverse, torch.float32)
            if dt == torch.bfloat16:    # FP8 inference: e4m3 qkv in, e4m3 proj input out, dense bias and table
                qkv_q = torch.zeros(2 * nw, n, 3, heads, d, dtype=torch.float8_e4m3fn)
                wa.quantized_window_attention(qkv_q, torch.ones(()), bias, mask, d ** -0.5, torch.ones(()))
                wa.quantized_window_attention(qkv_q, torch.ones(()), table, mask, d ** -0.5, torch.ones(()), index=index)
    for dt in ((torch.bfloat16,) if quick else (torch.bfloat16, torch.float32)):
        for C in ((512,) if quick else (128, 512, 3072)):
            lin.bias_grad_host(r(256, C, dtype=dt), None, torch.float32)
            lin.bias_grad_host(r(256, C, dtype=dt), r(256, C, dtype=dt), torch.float32)
    # the FP8 / INT8 routes' activation quantization (a bf16 input; fp32 where autocast hands a LayerNorm's
    # fp32 output to the Linear) and INT8's epilogue (per-row or static scale, with and without bias)
    for fmt in ("fp8", "int8"):
        for dt in (torch.bfloat16, torch.float32):
            for K in ((128, 4096) if quick else (128, 256, 512, 1024, 2048, 4096)):
                quant.quantize_rows.fn(r(64, K, dtype=dt), fmt)
    # norm1 and norm2 writing the qkv / fc1 input quantized (fp32 or bf16 residual stream, bf16 rounding)
    for fmt in ("fp8", "int8"):
        for dt in ((torch.float32,) if quick else (torch.float32, torch.bfloat16)):
            for C in ((128,) if quick else (128, 512)):
                ln_w, ln_b = r(C, dtype=torch.float32), r(C, dtype=torch.float32)
                win.norm_shift_partition_quant(r(1, 14, 14, C, dtype=dt), ln_w, ln_b, 1e-5, 7, 3, fmt, torch.bfloat16)
                win.merge_add_norm_quant(r(4, 49, C, dtype=torch.bfloat16), r(1, 14, 14, C, dtype=dt), ln_w, ln_b,
                                         1e-5, 7, 3, fmt, torch.bfloat16)
    for N in ((512,) if quick else (128, 384, 512, 1000, 4096)):
        acc = torch.zeros(64, N, dtype=torch.int32)
        for x_scale in (torch.ones(64, 1), torch.ones(())):
            for bias in (torch.zeros(N), None):
                quant.int8_dequant.fn(acc, x_scale, torch.ones(1, N), bias)
    # the quantized GEMM with its fused epilogue: both formats, per-row or static scale, with and without
    # bias, K a multiple of the tile or not
    for fmt, qdt in (("fp8", torch.float8_e4m3fn), ("int8", torch.int8)):
        for K in ((512, 264) if quick else (128, 512, 2048, 264)):
            x_q, w_q = torch.zeros(64, K, dtype=qdt), torch.zeros(256, K, dtype=qdt)
            for x_scale in ((torch.ones(64, 1),) if quick else (torch.ones(64, 1), torch.ones(()))):
                for bias in (torch.zeros(256, dtype=torch.bfloat16), None):
                    quant.quant_matmul.fn(x_q, x_scale, w_q, torch.ones(1, 256), bias)
            # an MLP's fc1: its GELU and fc2's static quantization in the epilogue, or the GELU alone
            for out_scale in (torch.ones(()), None):
                quant.quant_matmul_act.fn(x_q, torch.ones(64, 1), w_q, torch.ones(1, 256), None, True, out_scale)
    # Hopper's persistent TMA kernel for the same GEMMs: every tile config the host may choose (it times them
    # itself), e4m3 and int8, bf16 out or GELU + static quantization out
    tma_kernel = quant._quant_matmul_tma_kernel
    quant._quant_matmul_tma_kernel = _Recorder(tma_kernel)
    try:
        for fmt, qdt in (("fp8", torch.float8_e4m3fn), ("int8", torch.int8)):
            for K in ((512, 272) if quick else (128, 512, 2048, 272)):
                x_q, w_q = torch.zeros(512, K, dtype=qdt), torch.zeros(256, K, dtype=qdt)
                for cfg in quant.TMA_CONFIGS:
                    for bias, gelu, out_scale in ((torch.zeros(256, dtype=torch.bfloat16), False, None),
                                                  (torch.zeros(256, dtype=torch.bfloat16), True, torch.ones(())),
                                                  (None, True, None)):
                        out = torch.empty(512, 256, dtype=torch.bfloat16 if out_scale is None else qdt)
                        quant._quant_matmul_tma(x_q, torch.ones(512, 1), w_q, torch.ones(1, 256), bias, out, out_scale,
                                                gelu, cfg=cfg)
    finally:
        quant._quant_matmul_tma_kernel = tma_kernel
    # the whole MLP in one kernel (stages 1 and 2: Swin-T's 96 and 192 wide, Swin-B's 128 and 256), bf16 and
    # the e4m3 pair's, every config the autotuner times
    mlp = importlib.import_module("workbench.kernels.mlp")
    for C in ((96, 256) if quick else (96, 128, 192, 256)):
        mlp.fused_mlp(r(64, C, dtype=torch.bfloat16), r(4 * C, C, dtype=torch.bfloat16), r(4 * C, dtype=torch.bfloat16),
                      r(C, 4 * C, dtype=torch.bfloat16), r(C, dtype=torch.bfloat16))
        for x_scale in (torch.ones(64, 1), torch.ones(())):
            mlp.quantized_mlp(torch.zeros(64, C, dtype=torch.float8_e4m3fn), x_scale,
                              torch.zeros(4 * C, C, dtype=torch.float8_e4m3fn), torch.ones(4 * C),
                              torch.zeros(4 * C, dtype=torch.bfloat16), torch.ones(()),
                              torch.zeros(C, 4 * C, dtype=torch.float8_e4m3fn), torch.ones(C),
                              torch.zeros(C, dtype=torch.bfloat16))
    # the qkv projection and window attention in one kernel: window 7, head width 32, every stage width of
    # Swin-T and Swin-B (96..1024) where not quick, masked and not, bf16 (and fp32, the tests' dots)
    qa = importlib.import_module("workbench.kernels.qkv_attention")
    for C in ((96, 512) if quick else (96, 128, 192, 256, 384, 512, 768, 1024)):
        for dt in ((torch.bfloat16,) if C > 96 else (torch.bfloat16, torch.float32)):
            for mask in (torch.zeros(4, 49, 49), None):
                qa.qkv_window_attention(r(8, 49, C, dtype=dt), r(3 * C, C, dtype=dt), r(3 * C, dtype=dt),
                                        r(169, C // 32, dtype=torch.float32), mask, 32 ** -0.5, C // 32,
                                        index=torch.zeros(49, 49, dtype=torch.int64))
    # SwinV2's normalized q (scaled per head) and k, forward and backward, at its head width 32 (and 16,
    # 64 where not quick), from the strided views of a packed qkv
    for d in ((32,) if quick else (16, 32, 64)):
        for dt in (torch.bfloat16, torch.float32):
            x = r(2, 64, 3, 4, d, dtype=dt).permute(2, 0, 3, 1, 4)[0]
            for scale in (torch.ones(4), None):
                _, rnorm = cosine.cosine_rows_fwd.fn(x, scale, torch.bfloat16)
                cosine.cosine_rows_bwd.fn(x, r(2, 4, 64, d), torch.ones(2 * 4 * 64), scale)
    # stochastic depth's per-sample multiply (a branch of 56 x 56 tokens x 128 channels per sample)
    for dt in (torch.bfloat16, torch.float32):
        drop.scale_samples_host(r(2, 56 * 56 * 128, dtype=dt), torch.ones(2, dtype=dt))
    # the master weights' one-pass AdamW: from one flat bf16 gradient, and from the gradients in place through
    # their address table (aligned and unaligned parameters), which kernels write from their arguments
    adamw = importlib.import_module("workbench.kernels.adamw")
    sizes = (4096, 1000, 10)
    master = r(sum(sizes), dtype=torch.float32)
    state = dict(exp_avg=torch.zeros_like(master), exp_avg_sq=torch.zeros_like(master), out=master.to(torch.bfloat16),
                 lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05)
    for lr_on_device in (False, True):
        hyper = dict(state, lr=torch.tensor(1e-3)) if lr_on_device else state
        adamw.adamw_flat_step(master.to(torch.bfloat16), master, step=torch.zeros(()), **hyper)
        adamw.adamw_grads_step(torch.zeros(len(sizes), dtype=torch.int64), adamw.GradLayout(list(sizes), "cpu"),
                               master, step=torch.zeros(()), grad_dtype=torch.bfloat16, **hyper)
    addresses = tuple([2 ** 40 + 512 * i for i in range(100)] + [0] * (adamw._TABLE_CHUNK - 100))
    adamw.launch(adamw._addresses_kernel)[(1,)](torch.zeros(adamw._TABLE_CHUNK, dtype=torch.int64), addresses,
                                               N=adamw._TABLE_CHUNK)


def _signature(fn, args, kwargs):
    """(signature {param: type or 'constexpr'}, constexprs {param: value}, attrs, options), specialized as
    Triton's JIT specializes a launch (its own native_specialize_impl): an int equal to 1 becomes a
    constexpr, and an int divisible by 16 or a tensor whose address is 16-byte aligned carries
    tt.divisibility 16, which is what lets the compiler vectorize loads and stores. Without these
    attributes a kernel compiles to scalar memory accesses and different register counts."""
    options = {k: kwargs[k] for k in OPTION_KEYS if kwargs.get(k) is not None}
    values = dict(zip((p.name for p in fn.params), args))
    values.update({k: v for k, v in kwargs.items() if k not in OPTION_KEYS})
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        if p.name not in values:
            if not p.has_default:
                raise ValueError(f"{fn.__name__}: no value for {p.name}")
            values[p.name] = p.default
        v = values[p.name]
        if p.is_constexpr or v is None:
            signature[p.name] = "constexpr"
            constexprs[p.name] = v
            continue
        if isinstance(v, tuple):   # a tuple of scalars: each element specialized as a scalar argument is
            kinds = []
            for j, e in enumerate(v):
                kind, attr = native_specialize_impl(CUDABackend, e, p.is_const, not p.do_not_specialize,
                                                    not p.do_not_specialize_on_alignment)
                if kind == "constexpr":
                    raise ValueError(f"{fn.__name__}: {p.name}[{j}] = {e!r} would be a constexpr")
                kinds.append(kind)
                if isinstance(attr, str) and attr:
                    attrs[(i, j)] = CUDABackend.parse_attr(attr)
            signature[p.name] = tuple(kinds)
            continue
        if not isinstance(v, (torch.Tensor, bool, int, float, TensorDescriptor)):
            raise TypeError(f"{fn.__name__}: {p.name} = {v!r}")
        kind, attr = native_specialize_impl(CUDABackend, v, p.is_const, not p.do_not_specialize,
                                            not p.do_not_specialize_on_alignment)
        signature[p.name] = kind
        if kind == "constexpr":
            constexprs[p.name] = attr
        elif isinstance(attr, str) and attr:
            attrs[(i,)] = CUDABackend.parse_attr(attr)
    return signature, constexprs, attrs, options


def _resources(cubin: bytes) -> dict[str, int]:
    """{'REG': registers per thread, 'STACK': bytes of stack (spills), ...} of a cubin's kernel."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}


def _sass(cubin: bytes) -> str:
    """The cubin's SASS, one instruction a line, without addresses and encodings: two builds of a kernel
    compare equal here exactly when they run the same instructions."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True).stdout
    lines = (re.sub(r"/\*[^*]*\*/", "", ln).strip() for ln in out.splitlines() if re.match(r"\s*/\*[0-9a-f]{4}\*/", ln))
    return "\n".join(ln.rstrip(" ;") for ln in lines if ln) + "\n"


def main() -> int:
    _record_launches(quick="--quick" in sys.argv[1:])
    resources = "--resources" in sys.argv[1:]
    sass_dir = Path(sys.argv[sys.argv.index("--sass") + 1]) if "--sass" in sys.argv[1:] else None
    if sass_dir is not None:
        sass_dir.mkdir(parents=True, exist_ok=True)
    spilling: list[str] = []
    collapsed: list[str] = []
    unhidden: list[str] = []    # pipelined loops that wait for each load as they issue it
    seen, failures, t0 = set(), [], time.perf_counter()
    for fn, args, kwargs in RECORDED:
        try:
            signature, constexprs, attrs, options = _signature(fn, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - report, don't stop
            failures.append(f"{getattr(fn, '__name__', fn)}: {exc}")
            continue
        key = (fn.__name__, tuple(sorted(signature.items())), tuple(sorted((k, repr(v)) for k, v in constexprs.items())),
               tuple(sorted(attrs)), tuple(sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        label = f"{fn.__name__} {' '.join(f'{k}={v}' for k, v in constexprs.items() if v is not None)} {options}"
        try:
            kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), target=TARGET,
                                    options=options)
            line = f"ok   {label}  cubin {len(kernel.asm['cubin'])} bytes, shared {kernel.metadata.shared} bytes"
            if sass_dir is not None:
                import hashlib

                name = f"{fn.__name__}-{hashlib.sha1(label.encode()).hexdigest()[:12]}.sass"
                (sass_dir / name).write_text(f"# {label}\n" + _sass(kernel.asm["cubin"]))
            if resources:
                res = _resources(kernel.asm["cubin"])
                line += f", {res.get('REG')} registers, stack {res.get('STACK')} bytes"
                if res.get("STACK"):
                    spilling.append(f"{label} ({res.get('REG')} registers, stack {res['STACK']} bytes)")
                    if int(res.get("REG") or 0) <= COLLAPSED_REGS and int(res["STACK"]) > COLLAPSED_STACK:
                        collapsed.append(label)
                waits = [int(n) for n in re.findall(r"ttg\.async_wait .*?\{num = (\d+) : i32\}", kernel.asm["ttgir"])]
                if waits:
                    line += f", waits {waits}"
                    if not any(waits):
                        unhidden.append(label)
            print(line)
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{label}: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:400] if str(exc).strip() else ''}")
            traceback.print_exc(limit=1)
    print(f"# {len(seen)} kernel variants from {len(RECORDED)} recorded launches compiled for sm_90 in "
          f"{time.perf_counter() - t0:.1f} s (triton {triton.__version__}); {len(failures)} failed")
    for f in failures:
        print(f"FAILED {f}")
    if resources:
        print(f"# {len(spilling)} variant(s) use stack (spill registers):")
        for v in spilling:
            print(f"  {v}")
        print(f"# {len(collapsed)} variant(s) where ptxas kept {COLLAPSED_REGS} registers or fewer and a stack over "
              f"{COLLAPSED_STACK} bytes (the fp32 window-attention backward configs that gave wrong gradients on an "
              "H100 compiled so; keep such configs from the autotuner):")
        for v in collapsed:
            print(f"  {v}")
        print(f"# {len(unhidden)} variant(s) prefetch nothing while they compute (every async_wait 0):")
        for v in unhidden:
            print(f"  {v}")
    return 1 if failures or not seen else 0


if __name__ == "__main__":
    sys.exit(main())
