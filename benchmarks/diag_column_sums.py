"""Atomic column sums against per-program partial rows in the persistent LayerNorm backward kernels.

Both backward kernels sum dweight/dbias over their rows. By default every program adds its (2C,) partial
atomically into one zeroed row (a memset, then up to a few hundred programs adding into the same 2C
addresses). With torch.use_deterministic_algorithms(True) each program stores its own row and a second
kernel adds them in a fixed order (no memset, no contention, one more launch). The earlier launch sweeps
found more programs slower at the small stages (Swin-B stage 4: 11.6 µs with 196 programs, 12.3 with
392, 16.7 with 784), which points at the atomics. This times both paths, whole host calls (memset, kernel,
reduction) replayed in a CUDA graph, bf16, Swin-B stage shapes at batch 64.

    python benchmarks/diag_column_sums.py        # GPU only
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.timing import cuda_graph_us  # noqa: E402
import workbench.kernels.layer_norm  # noqa: E402,F401  (the package exports functions of the same names)
import workbench.kernels.window  # noqa: E402,F401

ln = sys.modules["workbench.kernels.layer_norm"]
win = sys.modules["workbench.kernels.window"]
STAGES = [("s1", 64, 56, 56, 128), ("s2", 64, 28, 28, 256), ("s3", 64, 14, 14, 512), ("s4", 64, 7, 7, 1024)]
WS, SHIFT, EPS = 7, 3, 1e-5


def main() -> int:
    if not torch.cuda.is_available():
        print("diag_column_sums: needs a CUDA GPU")
        return 1
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}")
    print(f"{'kernel':<22}{'stage':<6}{'atomic µs':>11}{'partials µs':>13}{'ratio':>7}{'max |diff|':>12}")
    for name, B, H, W, C in STAGES:
        x = torch.randn(B, H, W, C, device=dev).bfloat16()
        w = (torch.randn(C, device=dev) * 0.5 + 1).bfloat16()
        b = (torch.randn(C, device=dev) * 0.5).bfloat16()
        _, mean, rstd = win.norm_shift_partition_fwd(x, w, b, EPS, WS, SHIFT)
        dwin = torch.randn(B * (H // WS) * (W // WS), WS * WS, C, device=dev).bfloat16()
        x2, dy2 = x.view(-1, C), torch.randn(B * H * W, C, device=dev).bfloat16()
        _, _, mean2, rstd2 = ln.layer_norm_fwd(x2, None, w, b, EPS, torch.bfloat16)
        cases = {
            "layer_norm_bwd": lambda: ln.layer_norm_bwd(dy2, x2, w, b, mean2, rstd2, None, torch.bfloat16),
            "norm_partition_bwd": lambda: win.norm_shift_partition_bwd(dwin, x, w, mean, rstd, WS, SHIFT),
        }
        for kname, fn in cases.items():
            atomic = cuda_graph_us([fn], replays=30, calls=16)[0]
            ref = fn()[1].clone()
            torch.use_deterministic_algorithms(True)
            try:
                partials = cuda_graph_us([fn], replays=30, calls=16)[0]
                diff = (fn()[1] - ref).abs().max().item()
            finally:
                torch.use_deterministic_algorithms(False)
            print(f"{kname:<22}{name:<6}{atomic:>11.1f}{partials:>13.1f}{partials / atomic:>7.2f}{diff:>12.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
