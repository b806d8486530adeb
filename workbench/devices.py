"""Which device a command runs on: 'auto', 'cuda', 'cuda:N' or 'cpu', checked against what is here."""
from __future__ import annotations

import torch

from workbench.errors import UserError


def pick_device(name: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'; any other name is returned as it is."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def resolve_device(name: str, what: str | None = None) -> torch.device:
    """'auto', 'cuda', 'cuda:1' or 'cpu' -> torch.device; a CUDA device that is not there is a UserError.
    what: the API function whose `device` argument this is (its messages then speak of that argument, not
    of the CLI's --device)."""
    name = pick_device(name)
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}: use cuda, cuda:N or cpu") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            fix = ("use --device cpu (a tiny Swin on the CPU)" if what is None else
                   f"give {what} device='cpu', or leave device out (where the model's parameters are)")
            raise UserError(f"no CUDA GPU is visible here: {fix}")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"device {name} is not there: {torch.cuda.device_count()} GPU(s) visible")
    elif dev.type != "cpu":
        raise UserError(f"unsupported device {name!r}: use cuda or cpu")
    return dev
