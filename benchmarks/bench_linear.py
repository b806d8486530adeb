"""The Linear layers' backward on Swin-B shapes at batch 64: PyTorch autograd against the fused bias-gradient
(+ GELU backward) reduction of workbench.kernels.linear, bf16.

    python benchmarks/bench_linear.py --check        # writes benchmarks/results/linear.{json,md}

Per Swin-B stage and layer (qkv: C -> 3C, proj: C -> C, fc1: C -> 4C with GELU, fc2: 4C -> C), rows =
64 * H * W tokens:
  reduce   the part this kernel replaces, GPU time from CUDA-graph replay (16 calls per graph):
           torch: dy.sum(0) in bf16, cast to fp32 (fc1: gelu_backward first, then the sum);
           fused: bias_grad(dy[, pre]) -> (dpre, db fp32)
  bwd      the whole Linear backward (dx, dweight, dbias) through autograd under bf16 autocast,
           torch's F.linear (+ GELU) against workbench.kernels.linear.linear, graph replay.
GB/s for `reduce`: bytes it must move (read dy [and pre], write dpre for GELU) over its time.
--check compares the fused results with torch's on the same inputs first and exits non-zero on a mismatch.
Results: benchmarks/results/linear.json ({"environment", "settings", "records", "check_failures"}) and linear.md.
Without a GPU the kernels run under Triton's interpreter on tiny shapes, unmeasured: a smoke test of the
check and the results files (written only with --out-dir).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch.nn.functional as F  # noqa: E402

from _results import batch_bench_parser, markdown_table, out_dir_for, write_results  # noqa: E402
from workbench.env import device_label, environment_stamp  # noqa: E402
from workbench.kernels.linear import bias_grad, linear  # noqa: E402
from workbench.optimize.timing import cuda_graph_us  # noqa: E402

STAGES = {"s1": (56, 128), "s2": (28, 256), "s3": (14, 512), "s4": (7, 1024)}
LAYERS = {"qkv": (1, 3, False), "proj": (1, 1, False), "fc1": (1, 4, True), "fc2": (4, 1, False)}  # (in x C, out x C, gelu)


MD_HEADERS = ["stage layer", "rows × out", "autograd reduction µs", "fused µs", "speedup", "fused GB/s",
              "Linear fwd+bwd µs, autograd / fused"]


def markdown_rows(records: list[dict]) -> list[list[str]]:
    """One row per stage and layer; '-' where nothing was timed (no GPU)."""
    f = lambda r, k, fmt="{:.1f}": fmt.format(r[k]) if k in r else "-"  # noqa: E731
    return [[f"{r['stage']} {r['layer']}", f"{r['rows']}×{r['out']}", f(r, "torch_reduce_us"), f(r, "fused_reduce_us"),
             f"{r['torch_reduce_us'] / r['fused_reduce_us']:.2f}x" if "fused_reduce_us" in r else "-",
             f(r, "fused_gbps", "{:.0f}"),
             f"{r['torch_fwd_bwd_us']:.1f} / {r['fused_fwd_bwd_us']:.1f}" if "fused_fwd_bwd_us" in r else "-"]
            for r in records]


def main(argv=None) -> int:
    args = batch_bench_parser(__doc__, "compare with torch first; exit 1 on a mismatch").parse_args(argv)
    gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if gpu else "cpu")
    bf = torch.bfloat16
    batch = args.batch if gpu else 1
    stages = STAGES if gpu else {"s4": (7, 32)}
    env = environment_stamp(dev)
    print(f"# bench_linear on {device_label(env)}; torch {env['torch']}, triton {env['triton']}, bf16, batch {batch}")
    records, failures = [], []
    for sname, (hw, c) in stages.items():
        rows = batch * hw * hw
        for lname, (kin, kout, gelu) in LAYERS.items():
            n_in, n_out = kin * c, kout * c
            g = torch.Generator(device=dev).manual_seed(rows + n_out)
            dy = torch.randn(rows, n_out, device=dev, dtype=bf, generator=g)
            pre = torch.randn(rows, n_out, device=dev, dtype=bf, generator=g) if gelu else None

            def torch_reduce():
                d = torch.ops.aten.gelu_backward(dy, pre) if gelu else dy
                return d, d.sum(0).float()

            def fused_reduce():
                return bias_grad(dy, pre, torch.float32)

            if args.check:
                (d_ref, db_ref), (d, db) = torch_reduce(), fused_reduce()
                ok = torch.allclose(d.float(), d_ref.float(), rtol=2e-2, atol=2e-2) and \
                    torch.allclose(db, d.float().sum(0), rtol=1e-3, atol=1e-2) and \
                    torch.allclose(db, db_ref, rtol=2e-2, atol=0.5)
                if not ok:
                    failures.append(f"{sname} {lname}")
            rec = {"stage": sname, "layer": lname, "rows": rows, "in": n_in, "out": n_out, "gelu": gelu}
            if gpu:
                rec["torch_reduce_us"] = cuda_graph_us([torch_reduce], replays=args.replays)[0]
                rec["fused_reduce_us"] = cuda_graph_us([fused_reduce], replays=args.replays)[0]
                nbytes = rows * n_out * 2 * (3 if gelu else 1)
                rec["fused_gbps"] = nbytes / rec["fused_reduce_us"] / 1e3
                rec["torch_gbps"] = nbytes / rec["torch_reduce_us"] / 1e3
                x = torch.randn(rows, n_in, device=dev, dtype=torch.float32, generator=g).requires_grad_()
                w = (torch.randn(n_out, n_in, device=dev, generator=g) * n_in ** -0.5).requires_grad_()
                b = torch.zeros(n_out, device=dev).requires_grad_()
                gout = torch.randn(rows, n_out, device=dev, dtype=bf, generator=g)

                def bwd(fused):
                    def run():
                        with torch.autocast("cuda", dtype=bf):
                            y = linear(x, w, b, gelu) if fused else (
                                F.gelu(F.linear(x, w, b)) if gelu else F.linear(x, w, b))
                        torch.autograd.grad(y, (x, w, b), gout)
                    return run

                rec["torch_fwd_bwd_us"] = cuda_graph_us([bwd(False)], replays=args.replays)[0]
                rec["fused_fwd_bwd_us"] = cuda_graph_us([bwd(True)], replays=args.replays)[0]
                print(f"{sname} {lname:4s} {rows:6d}x{n_out:<5d} reduce torch {rec['torch_reduce_us']:7.1f} µs "
                      f"({rec['torch_gbps']:5.0f} GB/s)  fused {rec['fused_reduce_us']:7.1f} µs "
                      f"({rec['fused_gbps']:5.0f} GB/s) | linear fwd+bwd torch {rec['torch_fwd_bwd_us']:7.1f}  "
                      f"fused {rec['fused_fwd_bwd_us']:7.1f} µs", flush=True)
                del x, w, b, gout
            records.append(rec)
    if args.check:
        print(f"# check: {len(records) - len(failures)}/{len(records)} match torch" +
              (f"; MISMATCH: {', '.join(failures)}" if failures else ""))
    settings = {"batch": batch, "replays": args.replays, "dtype": "bf16", "graph_calls": 16}
    written = write_results(
        out_dir_for(args.out_dir, gpu), "linear",
        title=f"Linear backward: autograd's bias-gradient reduction against the fused one, bf16 (Swin-B, batch {batch})",
        stamp=env, settings=settings, records=records, check_failures=failures,
        table=markdown_table(MD_HEADERS, markdown_rows(records)),
        notes=["Reduction: autograd's bias-gradient sum (fc1: with the GELU backward before it) against "
               "bias_grad; Linear fwd+bwd: the whole layer through autograd under bf16 autocast, F.linear against "
               "workbench.kernels.linear.linear. GPU time from CUDA-graph replay (16 calls per graph), median.",
               "GB/s: the bytes the reduction must move (read dy, and for fc1 pre, write dpre) over its time."])
    for path in written:
        print(f"# wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
