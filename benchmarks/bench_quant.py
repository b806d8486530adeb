"""The FP8 / INT8 routes' activation quantization and INT8 epilogue on Swin-B's Linear shapes at batch 64:
the torch ops against workbench.kernels.quant's Triton kernels, bf16 in.

    python benchmarks/bench_quant.py --check        # writes benchmarks/results/quant.{json,md}

Per Swin-B stage (rows = 64 * H * W tokens, C = 128, 256, 512, 1024):
  quantize fp8 / int8   a Linear's input (rows, K), K = C (qkv, fc1) and 4C (fc2's input, the MLP hidden
                        width): torch: absmax_scale(x, fmt, dim=-1, check=False) + quantize(x, s, fmt)
                        (quantize_rows_torch); triton: quantize_rows(x, fmt) -> (x_q, (rows, 1) scales)
  gelu+quantize         an MLP's fc1 output (rows, 4C) to fc2's quantized input: torch's GELU then quantize_rows
                        (two launches, what runs without the fusion) against gelu_quantize_rows (one)
  norm1+quantize        a shifted block's fp32 residual stream (64, H, W, C) to its qkv's quantized input:
                        norm_shift_partition_fwd (bf16 windows) then quantize_rows (the torch column: what
                        ran before the fusion) against norm_shift_partition_quant (one pass)
  dequant int8          int8_linear's epilogue on an (rows, N) int32 accumulator, N = C (proj, fc2),
                        3C (qkv), 4C (fc1), per-row x scale, (1, N) w scale, fp32 bias, bf16 out:
                        torch: int8_dequant_torch; triton: int8_dequant
  fc1 act fp8 / int8    an MLP's fc1 writing fc2's input: the quantized GEMM, the tanh-form GELU and the
                        quantization at a static scale as three launches (torch) against quant_matmul_act's one;
                        bf16_us: dense's fc1 (cuBLASLt GEMM with its GELU epilogue, bf16 out)
  gemm fp8 / int8       a block's Linears on quantized operands, (rows, K) @ (N, K)^T + bias -> bf16 for
                        K -> N = C -> 3C (qkv), C -> C (proj), C -> 4C (fc1), 4C -> C (fc2): torch:
                        fp8_linear (_scaled_mm) / int8_linear (_int_mm + int8_dequant); triton:
                        quant_matmul (one GEMM, epilogue fused); bf16_us: the bf16 F.linear of the same
                        shape, for reference; TFLOPS over the Triton time
GPU time from CUDA-graph replay (16 calls per graph, median of --replays), calls rotating over enough
input sets to span 3x the L2. GB/s: the bytes the op must move (quantize: read x, write x_q and the
scales; dequant: read the int32 accumulator, write bf16) over its time.
--check first compares the Triton results with the torch ops' bit for bit on every shape and exits 1 on
a mismatch (the e4m3 GEMMs, which sum in their own order, within 1% in norm); for gelu+quant, GELU's cancelling tail (x < -3, erf's last bit) may put a few values in a
million one quantization step apart (kernels.quant.gelu_quantize_rows), which the check allows. Results: benchmarks/results/quant.json ({"environment", "settings", "records",
"check_failures"}) and quant.md. Without a GPU the kernels run under Triton's interpreter on tiny shapes,
unmeasured: a smoke test of the check and the results files (written only with --out-dir).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import batch_bench_parser, markdown_table, out_dir_for, write_results  # noqa: E402
from workbench.env import device_label, environment_stamp  # noqa: E402
from workbench.kernels.quant import (absmax_scale, fp8_linear, gelu_quantize_rows, int8_dequant,  # noqa: E402
                                     int8_dequant_torch, int8_linear, quant_matmul, quant_matmul_act, quantize,
                                     quantize_rows, quantize_rows_torch)
from workbench.kernels.window import norm_shift_partition_fwd, norm_shift_partition_quant  # noqa: E402
from workbench.optimize.timing import cuda_graph_us  # noqa: E402

STAGES = {"s1": (56, 128), "s2": (28, 256), "s3": (14, 512), "s4": (7, 1024)}
QUANT_WIDTHS = (1, 4)          # K = C and 4C
GEMM_WIDTHS = ((1, 3), (1, 1), (1, 4), (4, 1))   # (K, N) in units of C: qkv, proj, fc1, fc2
DEQUANT_WIDTHS = (1, 3, 4)     # N = C, 3C, 4C
L2_BYTES = 60 * 2**20
WINDOW = 7                     # Swin-B's windows (norm1+quant: a shifted block's, shift 3)

MD_HEADERS = ["op", "stage", "rows × cols", "torch µs", "Triton µs", "speedup", "torch GB/s", "Triton GB/s", "bf16 µs",
              "Triton TFLOPS"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same_bits(a, b) -> bool:
    return all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))


TAIL_DIFF_RATE = 1e-5   # gelu+quant: values allowed one step apart (measured 2.5e-6 on an H200)


def gelu_quant_close(a, b) -> bool:
    """gelu+quant's check: the same scales; quantized values equal but for at most TAIL_DIFF_RATE of them,
    each one quantization step apart (its row's e4m3 or int8 step)."""
    (q, s), (rq, rs) = a, b
    if not torch.equal(bits(s), bits(rs)):
        return False
    qf, rf = q.float(), rq.float()
    differ = qf != rf
    n = int(differ.sum())
    if n == 0:
        return True
    if n > max(2, TAIL_DIFF_RATE * q.numel()):
        return False
    d, r = (qf - rf).abs()[differ], torch.maximum(qf.abs(), rf.abs())[differ]
    step = torch.ones_like(r) if q.dtype == torch.int8 else torch.exp2(torch.floor(torch.log2(r.clamp_min(2.0 ** -6))) - 3)
    return bool((d <= step * 1.0001).all())


def gemm_close(a, b) -> bool:
    """The e4m3 GEMMs' check: both sum exact products in fp32 in their own order, then round to bf16;
    torch's CPU _scaled_mm also rounds before adding the bias. Within 1% in norm."""
    a, b = a.double(), b.double()
    return bool((a - b).norm() <= 1e-2 * b.norm())


def gelu_then_quantize_rows(h, fmt):
    """What an MLP runs without the fusion: torch's GELU (bf16 out), then quantize_rows."""
    return quantize_rows(torch.nn.functional.gelu(h), fmt)


def norm1_then_quantize_rows(x, w, b, fmt):
    """What a block ran before its norm1 wrote the qkv input quantized: norm1 + shift + partition writing
    bf16 windows (and the backward's statistics), then the qkv's quantize_rows."""
    windows, _, _ = norm_shift_partition_fwd(x, w, b, 1e-5, WINDOW, WINDOW // 2, out_dtype=torch.bfloat16)
    return quantize_rows(windows.reshape(-1, windows.shape[-1]), fmt)


def norm1_quantized(x, w, b, fmt):
    """norm_shift_partition_quant: the same windows written quantized, in one pass."""
    _, windows_q, scale = norm_shift_partition_quant(x, w, b, 1e-5, WINDOW, WINDOW // 2, fmt, torch.bfloat16)
    return windows_q.reshape(-1, windows_q.shape[-1]), scale


ACT_SCALE = 4.0 / 448      # fc2's static input scale in fc1 act (GELU of the unit-variance GEMM output)


def fc1_act_torch(x_q, x_scale, w_q, w_scale, bias, fmt):
    """An MLP's fc1 into fc2's static-scale input without the fusion: the quantized GEMM (bf16 out), the
    tanh-form GELU, then quantize at the static scale: three launches, the (rows, 4C) hidden written in
    bf16 twice and read twice."""
    y = (fp8_linear if fmt == "fp8" else int8_linear)(x_q, x_scale, w_q, w_scale, bias)
    return quantize(torch.nn.functional.gelu(y, approximate="tanh"), torch.tensor(ACT_SCALE, device=y.device), fmt)


def fc1_act_fused(x_q, x_scale, w_q, w_scale, bias, fmt):
    """quant_matmul_act: the GEMM with the GELU and the static quantization in its epilogue, one launch."""
    return quant_matmul_act(x_q, x_scale, w_q, w_scale, bias, True, torch.tensor(ACT_SCALE, device=x_q.device))


def act_close(a, b) -> bool:
    """fc1 act's check: the fused epilogue's GELU reads the fp32 result, the unfused path's GELU a bf16 one
    and writes bf16 again (two roundings of up to 2^-9 of the value: a quarter of an int8 step near 127), so
    a value near a rounding boundary of the format may land one step apart: at most 15% of them, each one
    step (int8: 1; e4m3: its binade's step)."""
    af, bf = a.float(), b.float()
    differ = af != bf
    if int(differ.sum()) > 0.15 * a.numel():
        return False
    r = torch.maximum(af.abs(), bf.abs())[differ]
    step = torch.ones_like(r) if a.dtype == torch.int8 else torch.exp2(torch.floor(torch.log2(r.clamp_min(2.0 ** -6))) - 3)
    return bool(((af - bf).abs()[differ] <= step * 1.0001).all())


def cases(stages: dict, batch: int):
    """(op, stage, rows, cols, make_inputs(seed) -> args, torch fn, triton fn, bytes moved)."""
    for sname, (hw, c) in stages.items():
        rows = batch * hw * hw
        for fmt in ("fp8", "int8"):
            def make(seed, hw=hw, c=c, fmt=fmt):
                g = torch.Generator(device=DEV).manual_seed(seed * 7919 + hw + c)
                return (torch.randn(batch, hw, hw, c, device=DEV, generator=g), torch.randn(c, device=DEV, generator=g),
                        torch.randn(c, device=DEV, generator=g), fmt)
            # the fused pass reads the fp32 residual stream and writes e4m3/int8 windows and a scale a token
            yield f"norm1+quant {fmt}", sname, rows, c, make, norm1_then_quantize_rows, norm1_quantized, rows * (c * 5 + 4)
        for fmt in ("fp8", "int8"):
            for k in (w * c for w in QUANT_WIDTHS):
                def make(seed, rows=rows, k=k, fmt=fmt):
                    g = torch.Generator(device=DEV).manual_seed(seed * 7919 + rows + k)
                    return (torch.randn(rows, k, device=DEV, generator=g).to(torch.bfloat16), fmt)
                yield f"quantize {fmt}", sname, rows, k, make, quantize_rows_torch, quantize_rows, rows * (k * 3 + 4)
                if k == 4 * c:      # fc2's input: the MLP's GELU before it
                    yield (f"gelu+quant {fmt}", sname, rows, k, make, gelu_then_quantize_rows, gelu_quantize_rows,
                           rows * (k * 3 + 4))
        for n in (w * c for w in DEQUANT_WIDTHS):
            def make(seed, rows=rows, n=n):
                g = torch.Generator(device=DEV).manual_seed(seed * 7919 + rows + n)
                acc = torch.randint(-2 ** 22, 2 ** 22, (rows, n), device=DEV, dtype=torch.int32, generator=g)
                return (acc, torch.rand(rows, 1, device=DEV, generator=g) / 127,
                        torch.rand(1, n, device=DEV, generator=g) / 127, torch.randn(n, device=DEV, generator=g))
            yield "dequant int8", sname, rows, n, make, int8_dequant_torch, int8_dequant, rows * n * 6
        for fmt in ("fp8", "int8"):
            for kw, nw in GEMM_WIDTHS:
                k, n = kw * c, nw * c

                def make(seed, rows=rows, k=k, n=n, fmt=fmt):
                    g = torch.Generator(device=DEV).manual_seed(seed * 7919 + rows + k + n)
                    x_q, x_scale = quantize_rows(torch.randn(rows, k, device=DEV, generator=g).to(torch.bfloat16), fmt)
                    w = torch.randn(n, k, device=DEV, generator=g) * k ** -0.5
                    w_scale = absmax_scale(w, fmt, dim=-1)
                    bias = torch.randn(n, device=DEV, generator=g)
                    return (x_q, x_scale, quantize(w, w_scale, fmt).contiguous(), w_scale.reshape(1, -1).contiguous(),
                            bias.to(torch.bfloat16) if fmt == "fp8" else bias)
                torch_gemm = fp8_linear if fmt == "fp8" else int8_linear
                yield f"gemm {fmt}", sname, rows, f"{k}->{n}", make, torch_gemm, quant_matmul, rows * (k + 2 * n) + n * k
                if (kw, nw) == (1, 4):      # fc1 writing fc2's input: GELU and static quantization fused
                    def make_act(seed, make=make, fmt=fmt):
                        return (*make(seed), fmt)
                    yield (f"fc1 act {fmt}", sname, rows, f"{k}->{n}", make_act, fc1_act_torch, fc1_act_fused,
                           rows * (k + n) + n * k)


def main(argv=None) -> int:
    global DEV
    args = batch_bench_parser(__doc__, "compare with the torch ops bit for bit first; exit 1 on a mismatch").parse_args(argv)
    gpu = torch.cuda.is_available()
    DEV = torch.device("cuda" if gpu else "cpu")
    batch = args.batch if gpu else 1
    stages = STAGES if gpu else {"s4": (7, 32)}
    env = environment_stamp(DEV)
    print(f"# bench_quant on {device_label(env)}; torch {env['torch']}, triton {env['triton']}, bf16, batch {batch}")
    if not gpu:
        print("# no GPU: Triton interpreter on tiny shapes - a smoke test, nothing is timed")
    records, failures = [], []
    for op, sname, rows, cols, make, torch_fn, triton_fn, nbytes in cases(stages, batch):
        close = (gelu_quant_close if op.startswith("gelu+quant") else gemm_close if op == "gemm fp8"
                 else act_close if op.startswith("fc1 act")
                 else (lambda a, b: same_bits([a], [b])) if op == "gemm int8" else same_bits)
        if args.check and not close(torch_fn(*make(0)), triton_fn(*make(0))):
            failures.append(f"{op} {sname} {rows}x{cols}")
        rec = {"op": op, "stage": sname, "rows": rows, "cols": cols, "bytes": nbytes}
        if gpu:
            sets = [make(k) for k in range(max(1, min(8, -(-3 * L2_BYTES // nbytes))))]
            for impl, fn in (("torch", torch_fn), ("triton", triton_fn)):
                rec[f"{impl}_us"] = cuda_graph_us([lambda a=a: fn(*a) for a in sets], replays=args.replays)[0]
                rec[f"{impl}_gbps"] = nbytes / rec[f"{impl}_us"] / 1e3
            rec["input_sets"] = len(sets)
            if op.startswith(("gemm", "fc1 act")):
                k, n = (int(v) for v in cols.split("->"))
                xs = [torch.randn(rows, k, device=DEV, dtype=torch.bfloat16) for _ in range(min(2, len(sets)))]
                w, b = torch.randn(n, k, device=DEV, dtype=torch.bfloat16), torch.randn(n, device=DEV, dtype=torch.bfloat16)
                # fc1 act's bf16 reference: dense's fc1, the GELU in cuBLASLt's epilogue
                bf16 = ((lambda x: torch._addmm_activation(b, x, w.t(), use_gelu=True)) if op.startswith("fc1 act")
                        else (lambda x: torch.nn.functional.linear(x, w, b)))
                rec["bf16_us"] = cuda_graph_us([lambda x=x: bf16(x) for x in xs], replays=args.replays)[0]
                rec["triton_tflops"] = 2 * rows * k * n / rec["triton_us"] / 1e6
                del xs, w, b
            print(f"{op:13s} {sname} {rows:6d}x{cols!s:<9} torch {rec['torch_us']:8.1f} µs ({rec['torch_gbps']:5.0f} GB/s)"
                  f"  triton {rec['triton_us']:8.1f} µs ({rec['triton_gbps']:5.0f} GB/s)", flush=True)
            del sets
            torch.cuda.empty_cache()
        records.append(rec)
    if args.check:
        print(f"# check: {len(records) - len(failures)}/{len(records)} agree with the torch ops (bit for bit; e4m3 "
              "GEMMs within 1%, gelu+quant up to a few tail values one step apart, fc1 act values one step apart)" +
              (f"; MISMATCH: {', '.join(failures)}" if failures else ""))
    f = lambda r, k, fmt="{:.1f}": fmt.format(r[k]) if k in r else "-"  # noqa: E731
    rows = [[r["op"], r["stage"], f"{r['rows']}×{r['cols']}", f(r, "torch_us"), f(r, "triton_us"),
             f"{r['torch_us'] / r['triton_us']:.2f}x" if "triton_us" in r else "-",
             f(r, "torch_gbps", "{:.0f}"), f(r, "triton_gbps", "{:.0f}"), f(r, "bf16_us"),
             f(r, "triton_tflops", "{:.0f}")] for r in records]
    settings = {"batch": batch, "replays": args.replays, "dtype": "bf16", "graph_calls": 16}
    written = write_results(
        out_dir_for(args.out_dir, gpu), "quant",
        title=(f"FP8 / INT8 activation quantization, INT8 epilogue and quantized GEMMs: torch against Triton "
               f"(Swin-B, batch {batch})"),
        stamp=env, settings=settings, records=records, check_failures=failures,
        table=markdown_table(MD_HEADERS, rows),
        notes=["quantize: absmax_scale + quantize (torch) against quantize_rows (one launch); gelu+quant: torch's "
               "GELU then quantize_rows (the torch column) against gelu_quantize_rows (one launch); norm1+quant: "
               "norm_shift_partition_fwd then quantize_rows (the torch column, Triton both) against "
               "norm_shift_partition_quant (one pass, bytes: fp32 in, the quantized windows and scales out); dequant: "
               "int8_linear's fp32 epilogue (torch) against int8_dequant (one launch); gemm: fp8_linear "
               "(_scaled_mm) / int8_linear (_int_mm, then int8_dequant) against quant_matmul (one Triton GEMM, "
               "epilogue fused), bf16 µs the bf16 F.linear of the same shape; fc1 act: the quantized GEMM, GELU "
               "and static quantization as three launches against quant_matmul_act (one), bf16 µs dense's fc1 "
               "(GEMM + GELU epilogue). GPU time from CUDA-graph "
               "replay (16 calls per graph), median.",
               "GB/s: the bytes the op must move (quantize: read bf16 x, write x_q and fp32 row scales; dequant: "
               "read int32, write bf16; gemm: read both operands, write bf16; fc1 act: write one byte a value) "
               "over its time."])
    for path in written:
        print(f"# wrote {path}")
    return 1 if failures else 0


DEV = torch.device("cpu")

if __name__ == "__main__":
    sys.exit(main())
