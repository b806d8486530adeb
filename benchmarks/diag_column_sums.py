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

import torch

from bench_window import SWIN_B_STAGES
from diag_maxnreg import backward_cases
from workbench.timing import cuda_graph_us


def main() -> int:
    if not torch.cuda.is_available():
        print("diag_column_sums: needs a CUDA GPU")
        return 1
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}")
    print(f"{'kernel':<22}{'stage':<6}{'atomic µs':>11}{'partials µs':>13}{'ratio':>7}{'max |diff|':>12}")
    for name, B, H, W, C in SWIN_B_STAGES:
        for kname, (fn, _) in backward_cases(B, H, W, C, dev).items():
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
