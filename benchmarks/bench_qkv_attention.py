"""A Swin block's qkv projection and window attention in one kernel (workbench.kernels.qkv_attention) against
the qkv GEMM followed by the fused attention kernel, in inference, at every stage of Swin-T and Swin-B, at
batch 64 and batch 1.

    python benchmarks/bench_qkv_attention.py --check     # writes benchmarks/results/qkv_attention.{json,md}

Per model, stage and batch (windows = batch * (side / 7)^2, 49 tokens, C the block's width, C / 32 heads,
shifted-window mask, the relative-position table read through its index, bf16):
  two kernels  F.linear (cuBLAS, bias in its epilogue) writing the packed qkv, then
               kernels.window_attention.window_attention_fwd on its q, k, v views
  one kernel   kernels.qkv_attention.qkv_window_attention
GPU time from CUDA-graph replay (16 calls per graph, median of --replays), calls rotating over enough input
sets to span 3x the L2. GB/s: the one kernel's x in and output out over its time (the packed qkv, 3x the
input, is what the two kernels also write and read).
--check first compares the two on every shape (within 1% in norm: the projection's sums in another order)
and exits 1 on a mismatch. Without a GPU the kernels run under Triton's interpreter on a tiny shape,
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

from _results import add_out_dir_argument, markdown_table, out_dir_for, write_results  # noqa: E402
from workbench.env import device_label, environment_stamp  # noqa: E402
from workbench.kernels.qkv_attention import qkv_window_attention  # noqa: E402
from workbench.kernels.window_attention import window_attention_fwd  # noqa: E402
from workbench.optimize.timing import cuda_graph_us  # noqa: E402

# (feature map side, width) per stage
STAGES = {"Swin-T": ((56, 96), (28, 192), (14, 384), (7, 768)), "Swin-B": ((56, 128), (28, 256), (14, 512), (7, 1024))}
WINDOW, HEAD = 7, 32
L2_BYTES = 60 * 2**20
MD_HEADERS = ["model, stage", "batch", "windows × heads × C", "two kernels µs", "one kernel µs", "speedup",
              "one kernel GB/s"]


def make(batch: int, side: int, c: int, seed: int, dev) -> tuple:
    """(x, weight, bias, table, mask, index, heads) of one call: the stage's windows (shifted: a mask of
    (side / 7)^2 window positions, none where one window covers the map)."""
    g = torch.Generator(dev).manual_seed(seed)
    nw, n, heads = (side // WINDOW) ** 2, WINDOW * WINDOW, c // HEAD
    x = torch.randn(batch * nw, n, c, device=dev, generator=g).to(torch.bfloat16)
    weight = (torch.randn(3 * c, c, device=dev, generator=g) / c ** 0.5).to(torch.bfloat16)
    bias = (torch.randn(3 * c, device=dev, generator=g) * 0.1).to(torch.bfloat16)
    table = torch.randn((2 * WINDOW - 1) ** 2, heads, device=dev, generator=g)
    coords = torch.stack(torch.meshgrid(torch.arange(WINDOW), torch.arange(WINDOW), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + WINDOW - 1
    index = (rel[..., 0] * (2 * WINDOW - 1) + rel[..., 1]).to(dev)
    mask = None
    if nw > 1:
        mask = torch.where(torch.rand(nw, n, n, device=dev, generator=g) < 0.3, -100.0, 0.0)
    return x, weight, bias, table, mask, index, heads


def two_kernels(x, weight, bias, table, mask, index, heads):
    windows, n, c = x.shape
    qkv = torch.nn.functional.linear(x, weight, bias).view(windows, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
    out, _ = window_attention_fwd(qkv[0], qkv[1], qkv[2], table, mask, HEAD ** -0.5, index=index)
    return out.transpose(1, 2).reshape(windows, n, c)


def one_kernel(x, weight, bias, table, mask, index, heads):
    return qkv_window_attention(x, weight, bias, table, mask, HEAD ** -0.5, heads, index=index)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.double(), b.double()
    return bool((a - b).norm() <= 1e-2 * b.norm())


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare the one kernel with the two first; exit 1 "
                                                             "on a mismatch")
    add_out_dir_argument(parser)
    parser.add_argument("--batches", default="64,1", help="comma-separated batches (default 64,1)")
    parser.add_argument("--replays", type=int, default=20, help="graph replays timed per measurement")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if gpu else "cpu")
    batches = [int(b) for b in args.batches.split(",")] if gpu else [1]
    stages = STAGES if gpu else {"tiny": ((14, 64),)}
    env = environment_stamp(dev)
    print(f"# bench_qkv_attention on {device_label(env)}; torch {env['torch']}, triton {env['triton']}")
    if not gpu:
        print("# no GPU: Triton interpreter on a tiny shape - a smoke test, nothing is timed")
    records, failures = [], []
    for batch in batches:
        for model, shapes in stages.items():
            for s, (side, c) in enumerate(shapes, 1):
                windows, heads = batch * (side // WINDOW) ** 2, c // HEAD
                nbytes = 2 * windows * WINDOW * WINDOW * c * 2
                rec = {"model": model, "stage": s, "batch": batch, "windows": windows, "heads": heads, "c": c,
                       "bytes": nbytes}
                a = make(batch, side, c, 0, dev)
                if args.check and not close(one_kernel(*a), two_kernels(*a)):
                    failures.append(f"{model} s{s} b{batch}")
                if gpu:
                    sets = [make(batch, side, c, k, dev) for k in range(max(1, min(8, -(-3 * L2_BYTES // nbytes))))]
                    rec["two_kernels_us"] = cuda_graph_us([lambda a=a: two_kernels(*a) for a in sets],
                                                          replays=args.replays)[0]
                    rec["one_kernel_us"] = cuda_graph_us([lambda a=a: one_kernel(*a) for a in sets],
                                                         replays=args.replays)[0]
                    rec["one_kernel_gbps"] = nbytes / rec["one_kernel_us"] / 1e3
                    rec["input_sets"] = len(sets)
                    print(f"{model} s{s} b{batch:<3d} {windows:5d}x{heads:<2d}x{c:<4d} two kernels "
                          f"{rec['two_kernels_us']:8.1f} µs  one kernel {rec['one_kernel_us']:8.1f} µs "
                          f"({rec['two_kernels_us'] / rec['one_kernel_us']:.2f}x)", flush=True)
                    del sets
                    torch.cuda.empty_cache()
                records.append(rec)
    if args.check:
        print(f"# check: {len(records) - len(failures)}/{len(records)} agree with the two kernels (within 1% in "
              "norm)" + (f"; MISMATCH: {', '.join(failures)}" if failures else ""))
    f = lambda r, k, fmt="{:.1f}": fmt.format(r[k]) if k in r else "-"  # noqa: E731
    rows = [[f"{r['model']} s{r['stage']}", str(r["batch"]), f"{r['windows']}×{r['heads']}×{r['c']}",
             f(r, "two_kernels_us"), f(r, "one_kernel_us"),
             f"{r['two_kernels_us'] / r['one_kernel_us']:.2f}x" if "one_kernel_us" in r else "-",
             f(r, "one_kernel_gbps", "{:.0f}")] for r in records]
    written = write_results(
        out_dir_for(args.out_dir, gpu), "qkv_attention",
        title="qkv projection and window attention in one kernel against the qkv GEMM and the attention kernel",
        stamp=env, settings={"batches": batches, "replays": args.replays, "graph_calls": 16}, records=records,
        check_failures=failures, table=markdown_table(MD_HEADERS, rows),
        notes=["two kernels: F.linear (cuBLAS) writing the packed qkv, then window_attention_fwd (table bias, "
               "mask); one kernel: kernels.qkv_attention.qkv_window_attention. bf16, window 7, head width 32. "
               "CUDA-graph replay, median of the replays."])
    if written:
        print(f"# wrote {', '.join(str(p) for p in written)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
