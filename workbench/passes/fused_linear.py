"""Pass `fused_linear`: the Linear layers of every Swin block compute their bias gradient in one fused
reduction, and the MLP's GELU backward is fused into fc1's.

After the fused window and attention kernels, the largest single kernel in an autocast Swin training
step is PyTorch's column sum for each Linear's bias gradient (13.5% of the `fmha` stage's GPU time on
the H200, Swin-B batch 64), and the MLP's GELU backward another elementwise pass over the widest
activation. In each SwinTransformerBlock:
  * attn.qkv, attn.proj, mlp.fc2 (nn.Linear) -> BiasGradLinear (same Parameters): backward = two cuBLAS
    GEMMs + one Triton reduction for the bias gradient (fp32 accumulation, cast once);
  * mlp.forward (timm Mlp with exact GELU, no dropout, no hidden norm) -> linear(x, fc1, gelu=True)
    then fc2: fc1's backward computes the GELU backward and fc1's bias gradient in the same kernel.
Blocks whose Mlp has another activation, dropout or a hidden norm keep timm's Mlp forward (their
Linears are still swapped) and are counted. See workbench/kernels/linear.py for the numerics.
"""
from __future__ import annotations

import types

import torch

from . import PassContext, PassResult, PassUnavailable, require_triton

NAME = "fused_linear"


def _exact_gelu(act: torch.nn.Module) -> bool:
    return isinstance(act, torch.nn.GELU) and act.approximate == "none"


def _identity_or_no_drop(m: torch.nn.Module) -> bool:
    return isinstance(m, torch.nn.Identity) or (isinstance(m, torch.nn.Dropout) and m.p == 0.0)


def mlp_forward_fused(self, x: torch.Tensor) -> torch.Tensor:
    """timm Mlp.forward (fc1 -> GELU -> fc2, no dropout, no hidden norm) with fc1 and GELU as one Function."""
    from ..kernels.linear import linear

    return self.fc2(linear(x, self.fc1.weight, self.fc1.bias, gelu=True))


def apply(model: torch.nn.Module, ctx: PassContext) -> tuple[torch.nn.Module, PassResult]:
    """Swap the Linears of every timm SwinTransformerBlock in place -> (model, PassResult)."""
    try:
        from timm.layers import Mlp
        from timm.models.swin_transformer import SwinTransformerBlock

        from ..kernels.linear import BiasGradLinear
    except ImportError as exc:
        raise PassUnavailable(f"fused linear kernel not importable: {exc}") from exc
    require_triton(ctx.device)

    linears, mlps_fused, mlps_kept = 0, 0, 0
    for block in model.modules():
        if not isinstance(block, SwinTransformerBlock):
            continue
        for parent in (block.attn, block.mlp):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    setattr(parent, name, BiasGradLinear.from_linear(child))
                    linears += 1
        mlp = block.mlp
        if (isinstance(mlp, Mlp) and _exact_gelu(mlp.act) and _identity_or_no_drop(mlp.drop1)
                and _identity_or_no_drop(mlp.drop2) and isinstance(mlp.norm, torch.nn.Identity)
                and isinstance(mlp.fc1, BiasGradLinear)):
            mlp.forward = types.MethodType(mlp_forward_fused, mlp)
            mlps_fused += 1
        else:
            mlps_kept += 1
    if linears == 0:
        raise PassUnavailable("no timm SwinTransformerBlock Linear layers in this model")
    changed = (f"{linears} Linear -> fused bias-gradient backward (Triton); "
               f"{mlps_fused} MLP fc1+GELU backward fused")
    if mlps_kept:
        changed += f"; {mlps_kept} MLP kept on timm's forward (other activation, dropout or hidden norm)"
    details = {"linears": linears, "mlps_fused": mlps_fused, "mlps_kept": mlps_kept,
               "implementation": "workbench.kernels.linear (cuBLAS GEMMs + Triton bias/GELU reduction)"}
    return model, PassResult(NAME, {}, changed, details)
