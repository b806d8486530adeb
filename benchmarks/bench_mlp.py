"""A Swin MLP's training step (fc1 -> GELU -> fc2, forward and backward) on Swin-B shapes at batch 64, bf16:
autograd, torch.compile, swinbench's fused reduction and its GELU-in-the-GEMM-epilogue form.

    python benchmarks/bench_mlp.py --check        # writes benchmarks/results/mlp.{json,md}

Per Swin-B stage (rows = 64 * H * W tokens, C -> 4C -> C), under bf16 autocast with fp32 parameters and
a bf16 input, GPU time from CUDA-graph replay:
  autograd   F.linear, F.gelu, F.linear through autograd
  compiled   the same function under torch.compile (Inductor, default mode)
  fused      workbench.kernels.linear: fc1 + GELU as one Function, each bias gradient (and the GELU
             backward) in one Triton reduction (the `fused_linear` pass's MLP)
  epilogue   workbench.kernels.mlp.gelu_mlp: GELU in fc1's GEMM epilogue, its backward and fc1's bias
             gradient in the epilogue of fc2's input-gradient GEMM (Triton GEMMs)
and the two GEMMs that the epilogue form replaces, alone: fc1's forward (cuBLAS addmm against gemm_gelu,
which also writes GELU(pre)) and fc2's input gradient (cuBLAS mm against gemm_dgelu, which also reads pre
and sums fc1's bias gradient).
--check holds every form's output and gradients to a float64 autograd reference first (relative L2 error
under 0.02) and exits 1 on a mismatch.
Results: benchmarks/results/mlp.json ({"environment", "settings", "records", "check_failures"}) and mlp.md.
Without a GPU the kernels run under Triton's interpreter on a tiny shape, unmeasured: a smoke test of the
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
from workbench.kernels.linear import linear  # noqa: E402
from workbench.kernels.mlp import gelu_mlp, gemm_dgelu, gemm_gelu  # noqa: E402
from workbench.optimize.timing import cuda_graph_us  # noqa: E402

STAGES = {"s1": (56, 128), "s2": (28, 256), "s3": (14, 512), "s4": (7, 1024)}
FORMS = ("autograd", "compiled", "fused", "epilogue")


def plain_mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def fused_mlp(x, w1, b1, w2, b2):
    return linear(linear(x, w1, b1, gelu=True), w2, b2)


def rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


MD_HEADERS = ["stage", "rows: C → 4C → C", "autograd µs", "compiled µs", "fused µs", "epilogue µs",
              "epilogue vs best other", "fc1 GEMM µs: addmm / gemm_gelu", "fc2 dgrad µs: mm / gemm_dgelu"]


def markdown_rows(records: list[dict]) -> list[list[str]]:
    def f(r, k):
        return f"{r[k]:.1f}" if k in r else "-"

    rows = []
    for r in records:
        best = min((r[f"{k}_us"] for k in FORMS[:3] if f"{k}_us" in r), default=None)
        rows.append([r["stage"], f"{r['rows']}: {r['c']} → {4 * r['c']} → {r['c']}", *(f(r, f"{k}_us") for k in FORMS),
                     f"{best / r['epilogue_us']:.2f}x" if best else "-",
                     f"{f(r, 'addmm_us')} / {f(r, 'gemm_gelu_us')}", f"{f(r, 'mm_us')} / {f(r, 'gemm_dgelu_us')}"])
    return rows


def main(argv=None) -> int:
    args = batch_bench_parser(__doc__, "hold every form to float64 first; exit 1 on a mismatch").parse_args(argv)
    gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if gpu else "cpu")
    bf = torch.bfloat16
    batch = args.batch if gpu else 1
    stages = STAGES if gpu else {"s4": (3, 32)}
    env = environment_stamp(dev)
    print(f"# bench_mlp on {device_label(env)}; torch {env['torch']}, triton {env['triton']}, bf16, batch {batch}")
    compiled = torch.compile(plain_mlp) if gpu else None
    fns = {"autograd": plain_mlp, "compiled": compiled, "fused": fused_mlp, "epilogue": gelu_mlp}
    records, failures = [], []
    for sname, (hw, c) in stages.items():
        rows = batch * hw * hw
        g = torch.Generator(device=dev).manual_seed(rows + c)
        x = torch.randn(rows, c, device=dev, generator=g).to(bf).requires_grad_()
        params = [(torch.randn(4 * c, c, device=dev, generator=g) * c ** -0.5).requires_grad_(),
                  (torch.randn(4 * c, device=dev, generator=g) * 0.1).requires_grad_(),
                  (torch.randn(c, 4 * c, device=dev, generator=g) * (4 * c) ** -0.5).requires_grad_(),
                  (torch.randn(c, device=dev, generator=g) * 0.1).requires_grad_()]
        gout = torch.randn(rows, c, device=dev, dtype=bf, generator=g)
        inputs = (x, *params)
        rec = {"stage": sname, "rows": rows, "c": c}

        def step(fn):
            def run():
                with torch.autocast(dev.type, dtype=bf):
                    y = fn(*inputs)
                return (y, *torch.autograd.grad(y, inputs, gout))
            return run

        if args.check:
            ref_in = [t.detach().double().requires_grad_() for t in inputs]
            y_ref = plain_mlp(*ref_in)
            refs = (y_ref, *torch.autograd.grad(y_ref, ref_in, gout.double()))
            for name, fn in fns.items():
                if fn is None:
                    continue
                errs = [rel_l2(a, r) for a, r in zip(step(fn)(), refs)]
                rec[f"{name}_max_rel_l2"] = max(errs)
                if max(errs) > 0.02:
                    failures.append(f"{sname} {name} ({max(errs):.3g})")
        if gpu:
            for name, fn in fns.items():
                rec[f"{name}_us"] = cuda_graph_us([step(fn)], replays=args.replays, calls=4)[0]
            xb, w1, b1, w2 = x.detach(), params[0].detach().to(bf), params[1].detach().to(bf), params[2].detach().to(bf)
            pre = torch.addmm(b1, xb, w1.t())
            rec["addmm_us"] = cuda_graph_us([lambda: torch.addmm(b1, xb, w1.t())], replays=args.replays)[0]
            rec["gemm_gelu_us"] = cuda_graph_us([lambda: gemm_gelu(xb, w1, b1)], replays=args.replays)[0]
            rec["mm_us"] = cuda_graph_us([lambda: gout @ w2], replays=args.replays)[0]
            rec["gemm_dgelu_us"] = cuda_graph_us([lambda: gemm_dgelu(gout, w2, pre, torch.float32)],
                                                 replays=args.replays)[0]
            print(f"{sname} {rows:6d}x{c:<5d} " + "  ".join(f"{k} {rec[f'{k}_us']:7.1f}" for k in FORMS) +
                  f" | fc1 addmm {rec['addmm_us']:6.1f} gemm_gelu {rec['gemm_gelu_us']:6.1f}"
                  f" | fc2 dgrad mm {rec['mm_us']:6.1f} gemm_dgelu {rec['gemm_dgelu_us']:6.1f} µs", flush=True)
        records.append(rec)
    if args.check:
        print(f"# check: {len(records) * sum(f is not None for f in fns.values()) - len(failures)} forms within 0.02 "
              f"of float64" + (f"; MISMATCH: {', '.join(failures)}" if failures else ""))
    settings = {"batch": batch, "replays": args.replays, "dtype": "bf16", "graph_calls": 4}
    written = write_results(
        out_dir_for(args.out_dir, gpu), "mlp",
        title=f"A Swin MLP's training step, forward and backward, bf16 (Swin-B, batch {batch})",
        stamp=env, settings=settings, records=records, check_failures=failures,
        table=markdown_table(MD_HEADERS, markdown_rows(records)),
        notes=["One MLP (fc1 C -> 4C, exact GELU, fc2 4C -> C) forward and backward under bf16 autocast, fp32 "
               "parameters, bf16 input; GPU time from CUDA-graph replay (4 steps per graph), median. "
               "GEMMs alone: 16 calls per graph."])
    for path in written:
        print(f"# wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
