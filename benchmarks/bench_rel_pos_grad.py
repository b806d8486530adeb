"""The relative-position table's gradient: swinbench's one-launch sum through the index's inverse against
PyTorch's index_add_, on Swin-B's window-7 and window-12 shapes, fp32 table.

    python benchmarks/bench_rel_pos_grad.py --check      # writes benchmarks/results/rel_pos_grad.{json,md}

The fused attention's backward leaves the bias gradient as fp32 slices (n_lead, nH, N*N): each backward
program (or group of windows) writes one slice of every pair's gradient, in a fixed order. The table's
gradient ((2w-1)^2, nH) is their sum gathered per table row through the index. Two ways, same input:
  fused   workbench.kernels.window_attention.rel_pos_table_grad_host: one launch reading each row's
          pairs through the index's inverse (past 64 tokens a window the slices are summed first, one
          more launch), deterministic
  torch   what autograd of timm's table[index] does after the slices: d.sum(0), then zeros +
          index_add_ of the (N*N, nH) pairs into the table (three launches; index_add_ on CUDA uses
          atomics, so its sums are not bitwise repeatable)
Shapes (Swin-B at batch 64 / 384 px at batch 32, stage 1 and stage 3): (window, n_lead, heads).
Timing: triton.testing.do_bench (L2 flushed between repetitions), median and 20th / 80th percentiles.
Floor: the bytes that must move (read every slice once, write the table) over the device's copy bandwidth,
measured here (Tensor.copy_ of 1 GiB).
--check compares both with a float64 index_add_ of the same slices first and exits 1 past 1e-5 (relative
to the largest entry). Without a GPU the kernel runs under Triton's interpreter on two small shapes: a
smoke test (nothing is written unless --out-dir is given).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import add_out_dir_argument, copy_gbps, markdown_table, out_dir_for, write_results  # noqa: E402
from workbench.env import device_label, environment_stamp  # noqa: E402
from workbench.kernels.window_attention import rel_pos_inverse, rel_pos_table_grad_host  # noqa: E402

# (label, window, n_lead, heads): Swin-B stage 1 and stage 3 at window 7 (224 px, batch 64) and 12 (384 px, 32)
SHAPES = [("w7 s1", 7, 64, 4), ("w7 s3", 7, 16, 16), ("w12 s1", 12, 32, 4), ("w12 s3", 12, 8, 16)]
CPU_SHAPES = [("w7 s3", 7, 2, 4), ("w12 s3", 12, 2, 2)]
TOLERANCE = 1e-5


def relative_index(window: int) -> torch.Tensor:
    """timm's relative_position_index for a square window: (N, N) values in [0, (2w-1)^2)."""
    coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
    return rel[..., 0] * (2 * window - 1) + rel[..., 1]


def torch_table_grad(d_rel: torch.Tensor, index: torch.Tensor, n_table: int) -> torch.Tensor:
    """The slices summed, then index_add_ of every pair into the table: autograd's way for table[index]."""
    n_heads = d_rel.shape[1]
    pairs = d_rel.sum(0).reshape(n_heads, -1).t()
    return torch.zeros(n_table, n_heads, dtype=d_rel.dtype, device=d_rel.device).index_add_(0, index.reshape(-1), pairs)



def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with float64 first; exit 1 on a mismatch")
    add_out_dir_argument(parser)
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    shapes = SHAPES if gpu else CPU_SHAPES
    env = environment_stamp(device)
    print(f"# bench_rel_pos_grad on {device_label(env)}; torch {env.get('torch')}, triton {env.get('triton')}")
    failures, records = [], []
    bandwidth = copy_gbps(device) if gpu else None
    for label, window, n_lead, heads in shapes:
        n_tokens, n_table = window * window, (2 * window - 1) ** 2
        index = relative_index(window).to(device)
        inverse = rel_pos_inverse(index, n_table)
        g = torch.Generator(device=device).manual_seed(window * 1000 + n_lead)
        d_rel = torch.randn(n_lead, heads, n_tokens * n_tokens, generator=g, device=device)
        fused = lambda: rel_pos_table_grad_host(d_rel, inverse, torch.float32)  # noqa: E731
        plain = lambda: torch_table_grad(d_rel, index, n_table)  # noqa: E731
        record = {"shape": label, "window": window, "n_lead": n_lead, "heads": heads, "n_table": n_table}
        if args.check:
            exact = torch_table_grad(d_rel.double(), index, n_table)
            scale = exact.abs().max().item()
            for name, fn in (("fused", fused), ("torch", plain)):
                err = (fn().double() - exact).abs().max().item() / scale
                record[f"{name}_rel_err"] = err
                if err > TOLERANCE:
                    failures.append(f"{label} {name}: {err:.1e}")
            record["fused_repeatable"] = bool(torch.equal(fused(), fused()))
        if gpu:
            import triton

            for name, fn in (("fused", fused), ("torch", plain)):
                q = triton.testing.do_bench(fn, warmup=25, rep=200, quantiles=[0.5, 0.2, 0.8])
                record.update({f"{name}_us": q[0] * 1e3, f"{name}_p20_us": q[1] * 1e3, f"{name}_p80_us": q[2] * 1e3})
            floor_bytes = d_rel.numel() * 4 + n_table * heads * 4
            record["floor_us"] = floor_bytes / (bandwidth * 1e9) * 1e6
        else:
            fused()
        records.append(record)
    fmt = lambda r, k: f"{r[k]:.1f}" if k in r else "-"  # noqa: E731
    headers = ["shape (window, slices × heads)", "torch µs", "fused µs (p20–p80)", "speedup", "floor µs", "% of floor",
               "repeatable (fused)"]
    rows = [[f"{r['shape']} ({r['window']}, {r['n_lead']} × {r['heads']})", fmt(r, "torch_us"),
             f"{r['fused_us']:.1f} ({r['fused_p20_us']:.1f}–{r['fused_p80_us']:.1f})" if "fused_us" in r else "-",
             f"{r['torch_us'] / r['fused_us']:.2f}x" if "fused_us" in r else "-", fmt(r, "floor_us"),
             f"{100 * r['floor_us'] / r['fused_us']:.0f}%" if "fused_us" in r else "-",
             {True: "yes", False: "no"}.get(r.get("fused_repeatable"), "-")] for r in records]
    table = markdown_table(headers, rows)
    print(table)
    if failures:
        print("# check FAILED: " + "; ".join(failures))
        return 1
    if args.check:
        print(f"# check: {len(records)}/{len(records)} shapes match float64 within {TOLERANCE:g}")
    notes = ["torch: slices summed, zeros, index_add_ (atomics on CUDA); fused: one launch through the index's "
             "inverse (two past 64 tokens a window), deterministic.",
             f"floor: read the slices once and write the table at the measured copy bandwidth "
             f"({bandwidth:.0f} GB/s)." if bandwidth else "floor: not measured (no GPU)."]
    written = write_results(out_dir_for(args.out_dir, gpu), "rel_pos_grad",
                            title="Relative-position table gradient: fused against index_add_", stamp=env,
                            settings={"shapes": shapes, "copy_gbps": bandwidth, "tolerance": TOLERANCE},
                            records=records, table=table, notes=notes)
    for path in written:
        print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
