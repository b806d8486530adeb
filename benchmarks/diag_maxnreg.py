"""What the persistent backward kernels lose when launched without their register cap.

The LayerNorm backward and the LayerNorm + shift + partition backward size their grids for exactly one
wave of resident programs under a `maxnreg` cap. Inductor launches traced user kernels with num_warps
and num_stages only (no maxnreg), so under torch.compile they run uncapped on the same grid. This script
times both launches of each kernel on Swin-B's stage shapes (batch 64, bf16) and prints the registers
and spills of every compiled variant, so the cost of the missing cap is a number, not a guess.

    python benchmarks/diag_maxnreg.py        # GPU only
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

from bench_window import EPS, SHIFT, SWIN_B_STAGES, WINDOW, make_inputs  # also puts the repo on sys.path
from workbench.timing import cuda_graph_us
import workbench.kernels.layer_norm  # noqa: F401  (the package exports functions of the same names)
import workbench.kernels.window  # noqa: F401

ln = sys.modules["workbench.kernels.layer_norm"]
win = sys.modules["workbench.kernels.window"]


def backward_cases(B: int, H: int, W: int, C: int, device) -> dict:
    """{name: (host call, programs)} for the two persistent backward kernels on one bf16 stage shape:
    LayerNorm backward over the (B*H*W, C) rows, and LayerNorm + shift + partition backward."""
    t = make_inputs(B, H, W, C, torch.bfloat16, device)
    x, w, b = t["x"], t["w"], t["b"]
    _, mean, rstd = win.norm_shift_partition_fwd(x, w, b, EPS, WINDOW, SHIFT)
    x2, dy2 = x.view(-1, C), t["d_img"].view(-1, C)
    _, _, mean2, rstd2 = ln.layer_norm_fwd(x2, None, w, b, EPS, torch.bfloat16)
    return {
        "layer_norm_bwd": (lambda: ln.layer_norm_bwd(dy2, x2, w, b, mean2, rstd2, None, torch.bfloat16),
                           ln._bwd_grid(B * H * W, C, 2, device)[0]),
        "norm_partition_bwd": (lambda: win.norm_shift_partition_bwd(t["d_win"], x, w, mean, rstd, WINDOW, SHIFT),
                               win._norm_bwd_config(B * H * W, C, 2, device)[3]),
    }


@contextmanager
def uncapped():
    """launch_options without maxnreg, as while traced."""
    saved = ln.launch_options, win.launch_options
    ln.launch_options = win.launch_options = lambda maxnreg=None, pdl=False: {"launch_pdl": True} if pdl else {}
    try:
        yield
    finally:
        ln.launch_options, win.launch_options = saved


def compiled_variants(kernel) -> list[tuple]:
    """(maxnreg, num_warps, n_regs, n_spills) of each compiled variant in the kernel's device caches."""
    rows = set()
    for cache in kernel.device_caches.values():
        for ck in cache[0].values():
            md = ck.metadata
            rows.add((getattr(md, "maxnreg", None), md.num_warps, ck.n_regs, ck.n_spills))
    return sorted(rows, key=str)


def main() -> int:
    if not torch.cuda.is_available():
        print("diag_maxnreg: needs a CUDA GPU")
        return 1
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}  SMs {ln.sm_count(dev)}")
    print(f"{'kernel':<22}{'stage':<6}{'programs':>9}{'capped µs':>11}{'uncapped µs':>13}{'ratio':>7}")
    for name, B, H, W, C in SWIN_B_STAGES:
        for kname, (fn, programs) in backward_cases(B, H, W, C, dev).items():
            capped = cuda_graph_us([fn], replays=30, calls=16)[0]
            with uncapped():
                free = cuda_graph_us([fn], replays=30, calls=16)[0]
            print(f"{kname:<22}{name:<6}{programs:>9}{capped:>11.1f}{free:>13.1f}{free / capped:>7.2f}")
    for kernel in (ln._layer_norm_bwd_kernel, win._norm_partition_bwd_kernel):
        print(kernel.fn.__name__, "(maxnreg, num_warps, n_regs, n_spills):", compiled_variants(kernel))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
