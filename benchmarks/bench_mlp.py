"""A narrow Swin MLP in one kernel (workbench.kernels.mlp) against its two GEMMs, bf16 and e4m3, at the
shapes of Swin-T's and Swin-B's stages 1 and 2.

    python benchmarks/bench_mlp.py --check        # writes benchmarks/results/mlp.{json,md}

Per model and stage (rows = batch * H * W tokens, C the block's width, hidden 4C):
  bf16   two GEMMs: fc1 with its bias and GELU in cuBLASLt's epilogue (linear.addmm_gelu, what dense runs in
         inference), then fc2 (F.linear); one kernel: kernels.mlp.fused_mlp
  fp8    two GEMMs: the quantized pair, fc1 writing fc2's input in e4m3 at its static scale
         (quant.quant_matmul_act), then fc2 (quant.quant_matmul), from per-row quantized rows (what norm2's
         kernel hands on); one kernel: kernels.mlp.quantized_mlp
GPU time from CUDA-graph replay (16 calls per graph, median of --replays), calls rotating over enough
input sets to span 3x the L2. GB/s: the bytes the one kernel must move (x in, the MLP's output out) over
its time; the hidden is 4x the input, twice over, in the two GEMMs' traffic. TFLOPS: the MLP's 4 * rows
* C * 4C over the one kernel's time.
--check first compares the one kernel with the two GEMMs on every shape (within 1% in norm: fc2's sums
in another order, and a hidden value of the bf16 form rounded by another tanh) and exits 1 on a mismatch.
Without a GPU the kernels run under Triton's interpreter on tiny shapes, unmeasured: a smoke test of the
check and the results files (written only with --out-dir).
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
from workbench.kernels import mlp, quant  # noqa: E402
from workbench.optimize.timing import cuda_graph_us  # noqa: E402

SHAPES = {"Swin-T s1": (56, 96), "Swin-T s2": (28, 192), "Swin-B s1": (56, 128), "Swin-B s2": (28, 256)}
L2_BYTES = 60 * 2**20
HIDDEN_SCALE = 4.0 / 448       # fc2's static input scale (GELU of unit-variance fc1 outputs)
MD_HEADERS = ["format", "model, stage", "rows × C", "two GEMMs µs", "one kernel µs", "speedup", "one kernel GB/s",
              "one kernel TFLOPS"]


def make(fmt: str, rows: int, c: int, seed: int, dev) -> tuple:
    """The operands of one call, (two_gemms_args, one_kernel_args)."""
    g = torch.Generator(dev).manual_seed(seed)
    hid = 4 * c
    x = torch.randn(rows, c, device=dev, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(hid, c, device=dev, generator=g) / c ** 0.5).to(torch.bfloat16)
    b1 = (torch.randn(hid, device=dev, generator=g) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(c, hid, device=dev, generator=g) / hid ** 0.5).to(torch.bfloat16)
    b2 = (torch.randn(c, device=dev, generator=g) * 0.1).to(torch.bfloat16)
    if fmt == "bf16":
        return (x, w1, b1, w2, b2), (x, w1, b1, w2, b2)
    x_q, x_s = quant.quantize_rows(x, "fp8")
    ops = [x_q, x_s]
    for w in (w1, w2):
        s = quant.absmax_scale(w, "fp8", dim=-1)
        ops += [quant.quantize(w, s, "fp8").contiguous(), s.reshape(1, -1).contiguous()]
    x_q, x_s, w1_q, w1_s, w2_q, w2_s = ops
    h_s = torch.tensor(HIDDEN_SCALE, device=dev)
    return (x_q, x_s, w1_q, w1_s, b1, h_s, w2_q, w2_s, b2), (x_q, x_s, w1_q, w1_s, b1, h_s, w2_q, w2_s, b2)


def two_gemms_bf16(x, w1, b1, w2, b2):
    if x.is_cuda:
        from workbench.kernels.linear import addmm_gelu

        h = addmm_gelu(x, w1, b1)
    else:
        h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1), approximate="tanh")
    return torch.nn.functional.linear(h, w2, b2)


def two_gemms_fp8(x_q, x_s, w1_q, w1_s, b1, h_s, w2_q, w2_s, b2):
    h_q = quant.quant_matmul_act(x_q, x_s, w1_q, w1_s, b1, True, h_s)
    return quant.quant_matmul(h_q, h_s, w2_q, w2_s, b2)


FUNCTIONS = {"bf16": (two_gemms_bf16, mlp.fused_mlp), "fp8": (two_gemms_fp8, mlp.quantized_mlp)}


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.double(), b.double()
    return bool((a - b).norm() <= 1e-2 * b.norm())


def main(argv=None) -> int:
    args = batch_bench_parser(__doc__, "compare the one kernel with the two GEMMs first; exit 1 on a mismatch"
                              ).parse_args(argv)
    gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if gpu else "cpu")
    batch = args.batch if gpu else 1
    shapes = SHAPES if gpu else {"tiny s1": (4, 32)}
    formats = ("bf16", "fp8") if gpu and torch.cuda.get_device_capability() >= (8, 9) else ("bf16",) if gpu else \
        ("bf16", "fp8")
    env = environment_stamp(dev)
    print(f"# bench_mlp on {device_label(env)}; torch {env['torch']}, triton {env['triton']}, batch {batch}")
    if not gpu:
        print("# no GPU: Triton interpreter on tiny shapes - a smoke test, nothing is timed")
    records, failures = [], []
    for fmt in formats:
        two, one = FUNCTIONS[fmt]
        for name, (side, c) in shapes.items():
            rows = batch * side * side
            nbytes = rows * c * ((1 if fmt == "fp8" else 2) + 2)
            rec = {"format": fmt, "shape": name, "rows": rows, "c": c, "hidden": 4 * c, "bytes": nbytes}
            a2, a1 = make(fmt, rows, c, 0, dev)
            if args.check and not close(one(*a1), two(*a2)):
                failures.append(f"{fmt} {name}")
            if gpu:
                sets = [make(fmt, rows, c, k, dev) for k in range(max(1, min(8, -(-3 * L2_BYTES // nbytes))))]
                rec["two_gemms_us"] = cuda_graph_us([lambda a=a: two(*a[0]) for a in sets], replays=args.replays)[0]
                rec["one_kernel_us"] = cuda_graph_us([lambda a=a: one(*a[1]) for a in sets], replays=args.replays)[0]
                rec["one_kernel_gbps"] = nbytes / rec["one_kernel_us"] / 1e3
                rec["one_kernel_tflops"] = 4 * rows * c * 4 * c / rec["one_kernel_us"] / 1e6
                rec["input_sets"] = len(sets)
                print(f"{fmt:4s} {name:9s} {rows:6d}x{c:<4d} two GEMMs {rec['two_gemms_us']:8.1f} µs  one kernel "
                      f"{rec['one_kernel_us']:8.1f} µs ({rec['two_gemms_us'] / rec['one_kernel_us']:.2f}x, "
                      f"{rec['one_kernel_tflops']:.0f} TFLOPS)", flush=True)
                del sets
                torch.cuda.empty_cache()
            records.append(rec)
    if args.check:
        print(f"# check: {len(records) - len(failures)}/{len(records)} agree with the two GEMMs (within 1% in norm)"
              + (f"; MISMATCH: {', '.join(failures)}" if failures else ""))
    f = lambda r, k, fmt="{:.1f}": fmt.format(r[k]) if k in r else "-"  # noqa: E731
    rows = [[r["format"], r["shape"], f"{r['rows']}×{r['c']}", f(r, "two_gemms_us"), f(r, "one_kernel_us"),
             f"{r['two_gemms_us'] / r['one_kernel_us']:.2f}x" if "one_kernel_us" in r else "-",
             f(r, "one_kernel_gbps", "{:.0f}"), f(r, "one_kernel_tflops", "{:.0f}")] for r in records]
    written = write_results(
        out_dir_for(args.out_dir, gpu), "mlp",
        title=f"A narrow Swin MLP in one kernel against its two GEMMs (batch {batch})",
        stamp=env, settings={"batch": batch, "replays": args.replays, "graph_calls": 16}, records=records,
        check_failures=failures, table=markdown_table(MD_HEADERS, rows),
        notes=["bf16: addmm_gelu (cuBLASLt, GELU in the epilogue) then F.linear against kernels.mlp.fused_mlp; fp8: "
               "quant_matmul_act (GELU and fc2's static quantization in the epilogue) then quant_matmul against "
               "kernels.mlp.quantized_mlp, from per-row e4m3 rows. CUDA-graph replay, median of the replays."])
    if written:
        print(f"# wrote {', '.join(str(p) for p in written)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
