"""Pass `fused_linear`: the Linear layers of every Swin block compute their bias gradient in one fused
reduction, and the MLP's GELU backward is fused into fc1's.

After the fused window and attention kernels, the largest single kernel of an autocast Swin training
step is PyTorch's column sum for each Linear's bias gradient, and the MLP's GELU backward another
elementwise pass over the widest activation. In each SwinTransformerBlock:
  * attn.qkv, attn.proj, mlp.fc1, mlp.fc2 (nn.Linear) -> BiasGradLinear (same Parameters): backward = two
    cuBLAS GEMMs + one Triton reduction for the bias gradient (fp32 accumulation, cast once);
  * the block's plan (block_plan.py) gets `linear`, and `mlp_gelu` where the MLP is timm's Mlp with exact
    GELU, no dropout and no hidden norm: its forward becomes linear(x, fc1, gelu=True) then fc2, and fc1's
    backward computes the GELU backward and fc1's bias gradient in the same kernel.
In inference on a GPU (nothing records a gradient, a half dtype) the fused MLP's fc1 runs its bias and
GELU in the GEMM's epilogue instead (`linear.addmm_gelu`: cuBLASLt, GELU's tanh form, within 5e-4 of the
exact erf GELU): the pre-activation, the widest activation of the block, is never written and read back
(on Swin-B at batch 64 the separate GELU is about a sixth of an inference forward's GPU time). The
block stage (fused_block) does the same in its forward.
Blocks whose Mlp has another activation, dropout or a hidden norm keep timm's Mlp forward (their
Linears are still swapped) and are counted; the plan says why. See workbench/kernels/linear.py for the
numerics.

SwinV2 (a model of SwinTransformerV2Blocks, or of swin_transformer_v2_cr's blocks, only): the MLP is the
same timm Mlp, so each block's attn.proj, mlp.fc1 and mlp.fc2 become BiasGradLinear and each qualifying MLP
runs fc1 + GELU as one Function (in inference, one cuBLASLt GEMM), bound on the Mlp itself (there is no v1
block plan to carry it). swin_transformer_v2's qkv Linear is left: it computes it as F.linear on the
weight with its q/v biases, past the module; -CR's qkv Linear holds its bias and is swapped too.
"""
from __future__ import annotations

import types

import torch

from workbench.optimize.passes import PassContext, PassResult, PassUnavailable, require_triton
from workbench.optimize.passes._swin import has_v2_blocks, named_swin_blocks
from workbench.optimize.passes.block_plan import block_plans

NAME = "fused_linear"
OWN_KERNELS = True   # runs swinbench kernels: a stage with it is not PyTorch alone


def exact_gelu(act: torch.nn.Module) -> bool:
    """torch's exact (erf) nn.GELU, or timm's GELU module (F.gelu, exact), which SwinV2 builds."""
    if type(act) is torch.nn.GELU:
        return act.approximate == "none"
    try:
        from timm.layers.activations import GELU as TimmGELU
    except ImportError:
        return False
    return type(act) is TimmGELU


def _identity_or_no_drop(m: torch.nn.Module) -> bool:
    return isinstance(m, torch.nn.Identity) or (isinstance(m, torch.nn.Dropout) and m.p == 0.0)


def _fusable_mlp(mlp: torch.nn.Module, Mlp) -> bool:
    """A timm Mlp with exact GELU, no dropout and no hidden norm: fc1 and GELU can run as one Function."""
    return (isinstance(mlp, Mlp) and exact_gelu(mlp.act) and _identity_or_no_drop(mlp.drop1)
            and _identity_or_no_drop(mlp.drop2) and isinstance(mlp.norm, torch.nn.Identity))


def _inference_epilogue(ctx: PassContext, mlps_fused: int, epilogue_dtypes) -> bool:
    """Whether fused MLPs run fc1's bias and GELU in the GEMM's epilogue: inference on a GPU, half dtype."""
    return (not ctx.training and ctx.device.type == "cuda" and mlps_fused > 0
            and ctx.precision.amp_dtype in epilogue_dtypes)


def v2_mlp_bound(mlp: torch.nn.Module) -> bool:
    """Whether this pass bound the fused fc1 + GELU forward on a SwinV2 block's Mlp."""
    from workbench.optimize.passes.block_forward import mlp_forward_fused

    return getattr(vars(mlp).get("forward"), "__func__", None) is mlp_forward_fused


def _v2_result(model: torch.nn.Module, ctx: PassContext, Mlp, BiasGradLinear, epilogue_dtypes) -> PassResult:
    """Swap attn.proj, mlp.fc1 and mlp.fc2 of every SwinV2 block (and -CR's attn.qkv) to BiasGradLinear and
    bind the fused fc1 + GELU forward on each Mlp that qualifies -> the pass's result."""
    from workbench.optimize.passes._swin import is_cr, v2_block_classes
    from workbench.optimize.passes.block_forward import mlp_forward_fused

    linears, fused, kept, qkv_left = 0, 0, 0, 0
    for blk in (m for m in model.modules() if isinstance(m, v2_block_classes())):
        cr = is_cr(blk.attn)
        qkv_left += not cr
        for parent, names in ((blk.attn, ("qkv", "proj") if cr else ("proj",)), (blk.mlp, ("fc1", "fc2"))):
            for child_name in names:
                child = getattr(parent, child_name, None)
                if type(child) is torch.nn.Linear:
                    setattr(parent, child_name, BiasGradLinear.from_linear(child))
                    linears += 1
        mlp = blk.mlp
        if _fusable_mlp(mlp, Mlp) and isinstance(mlp.fc1, BiasGradLinear) and "forward" not in vars(mlp):
            mlp.forward = types.MethodType(mlp_forward_fused, mlp)
            fused += 1
        else:
            kept += 1
    if linears == 0:
        raise PassUnavailable("no nn.Linear in this model's SwinV2 blocks")
    which = "proj, fc1, fc2" if qkv_left else "qkv, proj, fc1, fc2"
    changed = f"{linears} SwinV2 Linear ({which}) -> fused bias-gradient backward (Triton); {fused} MLP fc1+GELU fused"
    if qkv_left:
        changed += "; qkv left (SwinV2 runs it as F.linear with its q/v biases)"
    result = _result(ctx, epilogue_dtypes, linears, fused, kept, changed)
    result.details["swinv2"] = True
    return result


def _result(ctx: PassContext, epilogue_dtypes, linears: int, fused: int, kept: int, changed: str) -> PassResult:
    """The pass's result from its counts: `changed` completed with the MLPs kept and the inference epilogue."""
    if kept:
        changed += f"; {kept} MLP kept on timm's forward (other activation, dropout or hidden norm)"
    epilogue = _inference_epilogue(ctx, fused, epilogue_dtypes)
    if epilogue:
        changed += "; inference: fc1's bias and GELU in its GEMM's epilogue (cuBLASLt, tanh GELU)"
    details = {"linears": linears, "mlps_fused": fused, "mlps_kept": kept,
               "implementation": "workbench.kernels.linear (cuBLAS GEMMs + Triton bias/GELU reduction)",
               "inference_gelu": ("fc1 + bias + GELU as one cuBLASLt GEMM (torch._addmm_activation, tanh GELU: "
                                  "within 5e-4 of the exact erf GELU)") if epilogue else "separate (exact erf)"}
    return PassResult(NAME, {}, changed, details)


def apply(model: torch.nn.Module, ctx: PassContext) -> tuple[torch.nn.Module, PassResult]:
    """Swap the Linears of every timm SwinTransformerBlock in place, plan the fused MLP and bind ->
    (model, PassResult)."""
    try:
        from timm.layers import Mlp

        from workbench.kernels.linear import EPILOGUE_DTYPES, BiasGradLinear
    except ImportError as exc:
        raise PassUnavailable(f"fused linear kernel not importable: {exc}") from exc
    require_triton(ctx.device)

    linears, fused_mlps, kept_mlps = 0, [], []
    blocks = named_swin_blocks(model)
    if not blocks and has_v2_blocks(model, cr=True):
        return model, _v2_result(model, ctx, Mlp, BiasGradLinear, EPILOGUE_DTYPES)
    for name, block in blocks:
        for parent in (block.attn, block.mlp):
            for child_name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    setattr(parent, child_name, BiasGradLinear.from_linear(child))
                    linears += 1
        mlp = block.mlp
        if _fusable_mlp(mlp, Mlp) and isinstance(mlp.fc1, BiasGradLinear):
            fused_mlps.append(name)
        else:
            kept_mlps.append(name)
    if linears == 0:
        raise PassUnavailable("no timm SwinTransformerBlock Linear layers in this model")
    plans = block_plans(model)
    for name, _ in blocks:
        plans.update(name, linear=True, mlp_gelu=name in fused_mlps)
        if name in kept_mlps:
            plans.fall_back(name, "mlp_gelu", "an MLP with another activation, dropout or a hidden norm")
    plans.bind(model)
    mlps_fused = len(fused_mlps)
    return model, _result(ctx, EPILOGUE_DTYPES, linears, mlps_fused, len(kept_mlps),
                          f"{linears} Linear -> fused bias-gradient backward (Triton); "
                          f"{mlps_fused} MLP fc1+GELU backward fused")
