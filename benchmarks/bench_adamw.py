"""The master weights' optimizer step: swinbench's one-pass AdamW against torch's, on the flat fp32 master
of Swin-T, Swin-B and Swin-L's GEMM weights (every Linear and Conv2d weight and bias).

    python benchmarks/bench_adamw.py --check      # writes benchmarks/results/adamw.{json,md}

Under `master_weights` the bf16 gradients are gathered into one flat bf16 tensor (one torch.cat, the same
either way, not timed here). From there, two ways to step the master and refresh the bf16 weights:
  torch   widen the gradient into the master's fp32 gradient (copy_), torch.optim.AdamW(fused=True).step(),
          narrow the master into the bf16 weights (copy_): 6 + 28 + 6 bytes an element
  flat    workbench.kernels.adamw.adamw_flat_step: the same arithmetic in one pass, 28 bytes an element
and, for reference, `fused alone`: torch's fused AdamW step without the two copies. Then the gather
itself, on one bf16 gradient per parameter (the model's own sizes), two ways:
  cat + flat   torch.cat of the gradients into the flat one (4 bytes an element), then `flat`
  in place     workbench.kernels.adamw.adamw_grads_step: `flat` reading each gradient where it lies
               through a table of addresses (made once, outside the timing), nothing gathered
Timing: triton.testing.do_bench (L2 flushed between repetitions), median and 20th / 80th percentiles.
Floor: 28 bytes an element over the device's copy bandwidth, measured here (Tensor.copy_ of 1 GiB).
--check steps both ways five times from the same state and gradients first and exits 1 if the masters
differ by more than 1e-5 (relative to the largest value) or the bf16 weights are not the masters
rounded. Without a GPU the kernel runs under Triton's interpreter on a small size: a smoke test
(nothing is written unless --out-dir is given).
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
from workbench.kernels.adamw import GradLayout, adamw_flat_step, adamw_grads_step, grad_table  # noqa: E402

MODELS = ["swin_tiny_patch4_window7_224", "swin_base_patch4_window7_224", "swin_large_patch4_window7_224"]
HP = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.05}
TOLERANCE = 1e-5
BYTES_PER_VALUE = 28   # read the gradient (2), the master and both moments (12); write those three (12), the weight (2)


def gemm_sizes(model_name: str) -> list[int]:
    """The sizes of the values the master holds for this model: its Linear and Conv2d weights and biases."""
    import timm

    from workbench.optimize.passes.master_weights import gemm_parameters

    with torch.device("meta"):
        model = timm.create_model(model_name)
    return [p.numel() for p in gemm_parameters(model)]


class Master:
    """A flat master with its AdamW state and bf16 gradient and weights, steppable either way."""

    def __init__(self, sizes: list[int], device, seed: int):
        n = sum(sizes)
        g = torch.Generator(device=device).manual_seed(seed)
        self.master = torch.nn.Parameter(torch.randn(n, generator=g, device=device) * 0.02)
        self.grad_low = (torch.randn(n, generator=g, device=device) * 1e-3).to(torch.bfloat16)
        self.flat = self.master.detach().to(torch.bfloat16)
        self.master.grad = torch.empty_like(self.master)
        fused = device.type == "cuda"
        self.torch_opt = torch.optim.AdamW([self.master], **HP, fused=fused, foreach=None if fused else False)
        self.state = {"step": torch.zeros((), device=device), "exp_avg": torch.zeros_like(self.master),
                      "exp_avg_sq": torch.zeros_like(self.master)}
        self.grads = [gr.clone() for gr in self.grad_low.split(sizes)]   # one gradient a parameter
        self.layout = GradLayout(sizes, device)
        self.table = grad_table(self.grads, device)

    def torch_step(self):
        self.master.grad.copy_(self.grad_low)
        self.torch_opt.step()
        with torch.no_grad():
            self.flat.copy_(self.master)

    def fused_alone(self):
        self.torch_opt.step()

    def flat_step(self):
        adamw_flat_step(self.grad_low, self.master.detach(), self.state["exp_avg"], self.state["exp_avg_sq"],
                        self.state["step"], self.flat, **HP)

    def cat_flat_step(self):
        torch.cat(self.grads, out=self.grad_low)
        self.flat_step()

    def in_place_step(self):
        adamw_grads_step(self.table, self.layout, self.master.detach(), self.state["exp_avg"],
                         self.state["exp_avg_sq"], self.state["step"], self.flat, grad_dtype=torch.bfloat16, **HP)



def check(sizes: list[int], device) -> float:
    """Relative difference of the masters after five steps each way from the same start; AssertionError if
    the bf16 weights are not the masters rounded, or if the in-place step is not the flat one bit for bit."""
    a, b, c = (Master(sizes, device, seed=1) for _ in range(3))
    for _ in range(5):
        a.torch_step()
        b.flat_step()
        c.in_place_step()
    assert torch.equal(b.flat, b.master.detach().to(torch.bfloat16)), "the bf16 weights are not the master rounded"
    assert torch.equal(b.master, c.master) and torch.equal(b.flat, c.flat), "the in-place step differs from the flat one"
    return ((a.master - b.master).abs().max() / a.master.abs().max()).item()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare both steps first; exit 1 on a mismatch")
    add_out_dir_argument(parser)
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    env = environment_stamp(device)
    print(f"# bench_adamw on {device_label(env)}; torch {env.get('torch')}, triton {env.get('triton')}")
    sizes = [(name.split("_")[1], gemm_sizes(name)) for name in MODELS] if gpu else [("smoke", [2048, 10, 2944])]
    bandwidth = copy_gbps(device) if gpu else None
    failures, records = [], []
    for label, param_sizes in sizes:
        n = sum(param_sizes)
        record = {"model": label, "values": n, "parameters": len(param_sizes)}
        if args.check:
            err = check(param_sizes, device)
            record["rel_err"] = err
            if err > TOLERANCE:
                failures.append(f"{label}: {err:.1e}")
        if gpu:
            import triton

            m = Master(param_sizes, device, seed=2)
            for name, fn in (("torch", m.torch_step), ("fused_alone", m.fused_alone), ("flat", m.flat_step),
                             ("cat_flat", m.cat_flat_step), ("in_place", m.in_place_step)):
                q = triton.testing.do_bench(fn, warmup=10, rep=100, quantiles=[0.5, 0.2, 0.8])
                record.update({f"{name}_us": q[0] * 1e3, f"{name}_p20_us": q[1] * 1e3, f"{name}_p80_us": q[2] * 1e3})
            record["floor_us"] = n * BYTES_PER_VALUE / (bandwidth * 1e9) * 1e6
            del m
            torch.cuda.empty_cache()
        else:
            m = Master(param_sizes, device, seed=2)
            m.flat_step()
            m.in_place_step()
        records.append(record)
    fmt = lambda r, k: f"{r[k]:.0f}" if k in r else "-"  # noqa: E731
    headers = ["model (master values)", "torch: widen + fused AdamW + narrow µs", "fused AdamW alone µs",
               "flat µs (p20–p80)", "speedup", "floor µs", "% of floor", "cat + flat µs", "in place µs (p20–p80)"]
    rows = [[f"{r['model']} ({r['values'] / 1e6:.1f}M)", fmt(r, "torch_us"), fmt(r, "fused_alone_us"),
             f"{r['flat_us']:.0f} ({r['flat_p20_us']:.0f}–{r['flat_p80_us']:.0f})" if "flat_us" in r else "-",
             f"{r['torch_us'] / r['flat_us']:.2f}x" if "flat_us" in r else "-", fmt(r, "floor_us"),
             f"{100 * r['floor_us'] / r['flat_us']:.0f}%" if "flat_us" in r else "-", fmt(r, "cat_flat_us"),
             f"{r['in_place_us']:.0f} ({r['in_place_p20_us']:.0f}–{r['in_place_p80_us']:.0f})" if "in_place_us" in r
             else "-"] for r in records]
    table = markdown_table(headers, rows)
    print(table)
    if failures:
        print("# check FAILED: " + "; ".join(failures))
        return 1
    if args.check:
        print(f"# check: {len(records)}/{len(records)} sizes match torch's AdamW within {TOLERANCE:g} after five steps")
    notes = ["torch: the master's fp32 gradient widened from the bf16 one, torch.optim.AdamW(fused=True), the master "
             "narrowed into the bf16 weights; flat: workbench.kernels.adamw.adamw_flat_step, one pass. The gather of "
             "the bf16 gradients (one torch.cat) comes before either and is not timed there; cat + flat times it, "
             "in place (adamw_grads_step) reads the gradients where they lie instead.",
             f"floor: {BYTES_PER_VALUE} bytes an element at the measured copy bandwidth ({bandwidth:.0f} GB/s)."
             if bandwidth else "floor: not measured (no GPU)."]
    written = write_results(out_dir_for(args.out_dir, gpu), "adamw",
                            title="The master weights' AdamW step: one pass against torch's", stamp=env,
                            settings={"models": MODELS, "hyperparameters": HP, "copy_gbps": bandwidth,
                                      "tolerance": TOLERANCE}, records=records, table=table, notes=notes)
    for path in written:
        print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
