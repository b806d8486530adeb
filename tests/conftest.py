"""Shared test setup: Triton kernels run under the interpreter on a machine without a GPU."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
