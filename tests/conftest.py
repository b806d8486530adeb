"""Shared test setup: Triton kernels run under the interpreter on a machine without a GPU, and with
one fixed launch configuration everywhere (tests check results, not speed; autotuning every test
shape would cost minutes of compiles on a GPU)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SWINBENCH_AUTOTUNE", "0")
