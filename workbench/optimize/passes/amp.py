"""amp: mixed-precision training. Sets the autocast dtype the workload runs under; the model stays fp32.

bf16 (the default) needs no loss scaling; fp16 adds a GradScaler (the workload builds it on CUDA).
TF32 stays off, as in the baseline, so the only change this stage measures is autocast.
"""
from __future__ import annotations

from workbench.errors import UserError
from workbench.precision import resolve_precision
from workbench.optimize.passes import PassContext, PassResult

NAME = "amp"
# parameter -> (type, allowed values); recipes.py checks a recipe against it when it is loaded
PARAMS = {"dtype": (str, ("bf16", "fp16"))}


def in_your_loop(params: dict, ctx: PassContext) -> str | None:
    """What a loop of your own writes to get this pass (workbench.optimize.patching.patch_swin): autocast at
    the dtype the patch was planned for; None for a patch planned for fp32."""
    if ctx.precision.amp_dtype is None:
        return None
    line = f"run the forward and the loss under torch.autocast(device_type, dtype={ctx.precision.amp_dtype})"
    scaler = ctx.precision.needs_grad_scaler and ctx.training    # fp16 training: the gradients underflow
    return line + (", and scale the loss with torch.amp.GradScaler" if scaler else "")


def apply(model, ctx: PassContext, dtype: str = "bf16"):
    precision = resolve_precision(dtype)
    if precision.amp_dtype is None:
        raise UserError(f"pass amp: dtype must be bf16 or fp16 (autocast), got {dtype!r}")
    before = ctx.precision.name
    ctx.precision = precision
    ctx.grad_scaler = precision.needs_grad_scaler
    changed = (f"autocast {dtype} (was {before})" if before != precision.name else
               f"autocast {dtype}, as the workload already ran")
    changed += ", GradScaler on" if ctx.grad_scaler else ""
    details = {"amp_dtype": str(precision.amp_dtype), "grad_scaler": ctx.grad_scaler}
    if ctx.device.type == "cpu" and dtype == "fp16":
        details["note"] = "CPU autocast runs fp16 as bf16 (see precision.Precision.autocast)"
    return model, PassResult(NAME, {"dtype": dtype}, changed, details)
