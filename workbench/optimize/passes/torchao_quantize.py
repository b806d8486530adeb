"""Pass `torchao_quantize`: the Swin's nn.Linear layers quantized by torchao, PyTorch's own quantization
library, for inference. The peers of the `fp8` and `int8` recipes: what a user gets from PyTorch's
ecosystem alone, with no swinbench kernel.

    dtype fp8   torchao.quantization.Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()):
                e4m3 weights per output channel, activations per row in each forward, torch._scaled_mm
                (CUDA with compute capability 8.9 or newer).
    dtype int8  torchao.quantization.Int8DynamicActivationInt8WeightConfig(): int8 weights per output
                channel, activations per row in each forward (any device; on CUDA through torch._int_mm).

It chooses the layers by `quantize_linear`'s `keep` patterns and shape rules, as a user of torchao would
quantize the model: every Linear they allow. (quantize_linear's default `select: auto` then keeps the
GEMM shapes it measures faster in bf16 wide; with `select: all` the two quantize the same GEMMs.) torchao's tensor subclasses run their quantization as
torch ops: under the `compile` pass Inductor fuses them into the producers, which is how torchao is meant
to run. Training is refused (inference only), and so is a missing torchao or an FP8 request on a device
without FP8 GEMMs: the stage is then not available, with one line.
"""
from __future__ import annotations


import torch

from workbench.errors import UserError
from workbench.optimize.passes import PassContext, PassResult, PassUnavailable
from workbench.optimize.passes.quantize_linear import _check_keep, nothing_left, plan_routes, quantizable_linears, unmatched_patterns

NAME = "torchao_quantize"
OWN_KERNELS = False
INFERENCE_ONLY = True
PARAMS = {
    "dtype": (str, ("fp8", "int8")),
    "keep": ((list, type(None)), _check_keep),
}
CONFIGS = {"fp8": "Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())",
           "int8": "Int8DynamicActivationInt8WeightConfig()"}


def _config(dtype: str):
    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, Int8DynamicActivationInt8WeightConfig,
                                      PerRow)

    if dtype == "fp8":
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    return Int8DynamicActivationInt8WeightConfig()


def _check_device(dtype: str, device: torch.device) -> None:
    if dtype != "fp8":
        return
    if device.type != "cuda":
        raise PassUnavailable("torchao's FP8 GEMMs need a CUDA GPU with compute capability 8.9 or newer")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise PassUnavailable(f"torchao's FP8 GEMMs need compute capability 8.9 or newer; this GPU is {major}.{minor}")


def apply(model: torch.nn.Module, ctx: PassContext, dtype: str = "fp8", keep: list | None = None):
    if dtype not in PARAMS["dtype"][1]:
        raise UserError(f"pass {NAME!r}: dtype must be one of {', '.join(PARAMS['dtype'][1])}, got {dtype!r}")
    keep = [] if keep is None else keep
    _check_keep(keep)
    if ctx.training:
        raise PassUnavailable("torchao's quantized Linear layers are run for inference here: use --mode infer")
    try:
        import torchao
        from torchao.quantization import quantize_
    except ImportError:
        raise PassUnavailable("torchao is not installed (pip install torchao)") from None
    _check_device(dtype, ctx.device)
    linears = quantizable_linears(model, ctx.swin_only)
    if not linears:
        raise PassUnavailable("no nn.Linear in this model")
    routes, kept = plan_routes(linears, dtype, "torchao", keep)
    if not routes:
        raise PassUnavailable(nothing_left(kept))
    chosen = {id(m) for n, m in linears if n in routes}
    # torchao quantizes the weight in its dtype: the GEMM weights go to the autocast dtype first, as a
    # user of torchao does (model.to(bfloat16)); their biases follow
    low = ctx.precision.amp_dtype or torch.float32
    with torch.no_grad():
        for name, linear in linears:
            if name in routes:
                linear.to(low)
    quantize_(model, _config(dtype), filter_fn=lambda module, fqn: id(module) in chosen)
    unmatched = unmatched_patterns(model, keep)
    details = {"dtype": dtype, "implementation": f"torchao {torchao.__version__}: quantize_({CONFIGS[dtype]})",
               "library": "torchao", "library_version": torchao.__version__, "weights_dtype_before": str(low),
               "layers": {**{n: "torchao" for n in routes}, **{n: f"kept: {why}" for n, why in kept.items()}},
               "counts": {"torchao": len(routes), "kept": len(kept)}, "unmatched_keep": unmatched}
    changed = f"{len(routes)} Linear layers {dtype} by torchao ({CONFIGS[dtype]}), {len(kept)} kept"
    if unmatched:
        changed += f"; keep patterns matching nothing: {', '.join(unmatched)}"
    return model, PassResult(NAME, {"dtype": dtype, "keep": list(keep)}, changed, details)
