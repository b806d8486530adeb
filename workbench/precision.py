"""Precision is resolved here and nowhere else: a name becomes what autocast, the model and TF32 need."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from workbench.errors import UserError

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


@dataclass(frozen=True)
class Precision:
    """`amp_dtype` is the autocast dtype (None: no autocast); the model and data stay fp32 in every mode."""

    name: str
    amp_dtype: torch.dtype | None
    tf32: bool

    @property
    def needs_grad_scaler(self) -> bool:
        return self.amp_dtype is torch.float16

    def autocast(self, device_type: str):
        if self.amp_dtype is None:
            return nullcontext()
        if device_type == "cpu" and self.amp_dtype is torch.float16:
            # CPU autocast in fp16 is slow and patchy; bf16 is what the CPU supports well.
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return torch.autocast(device_type, dtype=self.amp_dtype)

    def runs_as(self, device_type: str) -> str:
        """The precision a step on `device_type` really runs: on the CPU fp16 runs as bf16 (`autocast`) and
        tf32 as fp32 (TF32 is a CUDA matmul mode)."""
        if device_type == "cpu" and self.amp_dtype is torch.float16:
            return "bf16"
        if device_type == "cpu" and self.tf32:
            return "fp32"
        return self.name

    def apply_matmul_mode(self) -> None:
        """Set TF32 for matmul and cuDNN explicitly, so the baseline is fp32 no matter the defaults."""
        torch.backends.cuda.matmul.allow_tf32 = self.tf32
        torch.backends.cudnn.allow_tf32 = self.tf32


def resolve_precision(name: str) -> Precision:
    """'fp32' | 'tf32' | 'bf16' | 'fp16' -> Precision. bf16/fp16 run under autocast with TF32 off."""
    table = {
        "fp32": Precision("fp32", None, False),
        "tf32": Precision("tf32", None, True),
        "bf16": Precision("bf16", torch.bfloat16, False),
        "fp16": Precision("fp16", torch.float16, False),
    }
    try:
        return table[name]
    except KeyError:
        raise UserError(f"unknown precision {name!r}: choose one of {', '.join(PRECISIONS)}") from None
