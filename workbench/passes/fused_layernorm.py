"""fused_layernorm: every last-dim LayerNorm of the model becomes a fused one, and each Swin block's
`x + attn; norm2(x)` becomes one add_layer_norm.

params:
  impl: auto | triton | torch | apex   (default auto)
      apex   - apex.normalization.FusedLayerNorm (weights copied); PassUnavailable if apex is missing.
      triton - workbench.kernels.layer_norm.TritonLayerNorm; PassUnavailable on a CPU without
               TRITON_INTERPRET=1.
      torch  - keep torch's LayerNorm (the model is returned unchanged).
      auto   - apex if importable and the device is a GPU; else AUTO_GPU_IMPL on a GPU; else triton when
               TRITON_INTERPRET=1; else torch.
  fuse_residual: bool (default true) - with the triton implementation, also patch each timm
      SwinTransformerBlock so the residual add before norm2 and norm2 run as one add_layer_norm.

Which modules: those whose class is torch's nn.LayerNorm or timm's LayerNorm (a subclass with the same
math) over one trailing dim. Other nn.LayerNorm subclasses (timm's LayerNorm2d normalizes dim 1,
LayerNormFp32 upcasts) are left alone and counted in details["skipped"]. The replacement keeps the very
Parameter objects, so parameter names, state_dict keys (`weight`, `bias`) and optimizer groups don't change.

Contract with passes that patch SwinTransformerBlock.forward later (fused_window):
  * With fuse_residual, a block gets an instance attribute `forward` (types.MethodType) equal to
    `swin_block_forward_add_norm2` below. Its attention half is timm's own, unchanged:
        x = x + drop_path1(self._attn(self.norm1(x)))        <- the add is what gets fused
    and its MLP half is
        x, h = add_layer_norm(x, drop_path1(attn), norm2.weight, norm2.bias, norm2.eps)  # (B, L, C)
        x = x + drop_path2(mlp(h))
  * Such a block carries `blk._swinbench_add_norm2 = True` and `blk._swinbench_forward_before_add_norm2`
    (the forward it replaced). A later pass may replace the whole forward; when the flag is set it should
    keep the fusion by computing its MLP half with `add_norm2` below (add_layer_norm, as above)
    (shortcut, attention branch after drop_path1 -> (residual stream, normed)).
  * A block whose forward an earlier pass already replaced (an instance `forward` exists) is not
    touched: it is counted in details["blocks_forward_already_patched"].
  * norm1/norm2 stay nn.LayerNorm instances (TritonLayerNorm subclasses it) with .weight/.bias/.eps.
The drop paths don't restrict the fusion: drop_path1 is applied to the attention branch before the add
and drop_path2 to the MLP output after the norm, both exactly as timm does.
Under autocast, when h goes straight into the MLP's fc1 Linear (`_swin.mlp_input_goes_to_linear`),
add_layer_norm writes h in the autocast dtype, the bits fc1's input cast would give (no cast launches).
So does each PatchMerging's norm, whose output goes straight into the `reduction` Linear (the class's
forward; `TritonLayerNorm.into_linear`; a later pass that replaces that forward must keep norm -> reduction).
Otherwise every output has the dtype torch's LayerNorm would give it under autocast: fp32 under CUDA
autocast (`kernels.layer_norm.autocast_norm_dtype`), so the model's residual stream keeps AMP's precision
(fp32 in stage 1, from the patch embedding's norm) and this stage changes kernels, not precision.
"""
from __future__ import annotations

import types

import torch
from torch import nn

from ..errors import UserError
from . import PassContext, PassResult, PassUnavailable, triton_runs_on
from ._swin import merging_norm_goes_to_linear, mlp_input_goes_to_linear, norm_output_dtype

NAME = "fused_layernorm"
IMPLS = ("auto", "triton", "torch", "apex")
# parameter -> (type, allowed values); recipes.py checks a recipe against it when it is loaded
PARAMS = {"impl": (str, IMPLS), "fuse_residual": (bool, None)}
# What `auto` picks on a GPU when apex is missing. Keep it the faster one on benchmarks/bench_layer_norm.py
# (fwd+bwd, Swin-B shapes); set it to "torch" if the Triton kernel loses there.
AUTO_GPU_IMPL = "triton"


def _apex_layer_norm_class():
    try:
        from apex.normalization import FusedLayerNorm
    except Exception:  # ImportError, or apex built without its CUDA extensions
        return None
    return FusedLayerNorm


def _replaceable_classes() -> tuple[type, ...]:
    classes: list[type] = [nn.LayerNorm]
    try:
        from timm.layers import LayerNorm as TimmLayerNorm

        classes.append(TimmLayerNorm)
    except ImportError:  # pragma: no cover - timm is a dependency
        pass
    return tuple(classes)


def resolve_impl(impl: str, device: torch.device) -> str:
    """'auto' | 'triton' | 'torch' | 'apex' -> the implementation to use here; PassUnavailable if it can't run."""
    if impl not in IMPLS:
        raise UserError(f"unknown impl {impl!r}: choose one of {', '.join(IMPLS)}")
    on_gpu = device.type == "cuda"
    if impl == "apex":
        if _apex_layer_norm_class() is None:
            raise PassUnavailable("impl apex: apex.normalization.FusedLayerNorm is not importable")
        return "apex"
    if impl == "triton":
        if not triton_runs_on(device):
            raise PassUnavailable("impl triton: needs a CUDA device, or TRITON_INTERPRET=1 on the CPU")
        return "triton"
    if impl == "torch":
        return "torch"
    if on_gpu:
        return "apex" if _apex_layer_norm_class() is not None else AUTO_GPU_IMPL
    return "triton" if triton_runs_on(device) else "torch"


def _replace_layer_norms(model: nn.Module, make) -> tuple[nn.Module, dict[str, int], dict[str, int]]:
    """Swap each replaceable LayerNorm for make(old). -> (model, replaced by class, skipped by class)."""
    replaceable = _replaceable_classes()
    replaced: dict[str, int] = {}
    skipped: dict[str, int] = {}
    targets = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.LayerNorm) or getattr(module, "_swinbench_fused", False):
            continue
        cls = type(module).__name__
        if type(module) in replaceable and len(module.normalized_shape) == 1:
            targets.append((name, module))
        else:
            skipped[cls] = skipped.get(cls, 0) + 1
    for name, module in targets:
        new = make(module)
        new._swinbench_fused = True
        if name == "":
            model = new
        else:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        cls = type(module).__name__
        replaced[cls] = replaced.get(cls, 0) + 1
    return model, replaced, skipped


def _apex_from(ln: nn.LayerNorm) -> nn.Module:
    FusedLayerNorm = _apex_layer_norm_class()
    new = FusedLayerNorm(ln.normalized_shape, eps=ln.eps, elementwise_affine=ln.elementwise_affine)
    if ln.weight is not None:
        new = new.to(device=ln.weight.device, dtype=ln.weight.dtype)
        new.load_state_dict(ln.state_dict())
    return new.train(ln.training)


def add_norm2(blk, x: torch.Tensor, branch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's `x + branch` and its norm2 of that sum in one add_layer_norm -> (sum, normed), both
    (B, L, C): the normed output in the dtype its consumer wants (`_swin.norm_output_dtype`: the autocast
    dtype when it goes straight into the MLP's fc1). The MLP half of every forward that keeps this fusion."""
    from ..kernels.layer_norm import add_layer_norm

    B, C = x.shape[0], x.shape[-1]
    return add_layer_norm(x.reshape(B, -1, C), branch.reshape(B, -1, C), blk.norm2.weight, blk.norm2.bias,
                          blk.norm2.eps, norm2_output_dtype(blk, x, branch.dtype))


def norm2_output_dtype(blk, x: torch.Tensor, branch_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a block's fused add + norm2 writes for the residual x plus a branch in branch_dtype
    (`_swin.norm_output_dtype`: fc1's autocast input dtype where the MLP takes it straight)."""
    return norm_output_dtype(x, mlp_input_goes_to_linear(blk.mlp), torch.promote_types(x.dtype, branch_dtype))


def swin_block_forward_add_norm2(self, x: torch.Tensor) -> torch.Tensor:
    """timm SwinTransformerBlock.forward with the add before norm2 fused into norm2. x: (B, H, W, C)."""
    B, H, W, C = x.shape
    x, h = add_norm2(self, x, self.drop_path1(self._attn(self.norm1(x))))
    x = x + self.drop_path2(self.mlp(h))
    return x.reshape(B, H, W, C)


def _fuse_residual_norm2(model: nn.Module) -> dict[str, int]:
    from timm.models.swin_transformer import SwinTransformerBlock

    counts = {"blocks_fused": 0, "blocks_forward_already_patched": 0, "blocks_norm2_not_fusable": 0}
    for module in model.modules():
        if not isinstance(module, SwinTransformerBlock) or getattr(module, "_swinbench_add_norm2", False):
            continue
        if "forward" in vars(module):
            counts["blocks_forward_already_patched"] += 1
            continue
        norm2 = module.norm2
        if not getattr(norm2, "_swinbench_fused", False) or not hasattr(norm2, "eps"):
            counts["blocks_norm2_not_fusable"] += 1
            continue
        module._swinbench_forward_before_add_norm2 = module.forward
        module.forward = types.MethodType(swin_block_forward_add_norm2, module)
        module._swinbench_add_norm2 = True
        counts["blocks_fused"] += 1
    return counts


def apply(model: nn.Module, ctx: PassContext, impl: str = "auto", fuse_residual: bool = True,
          **unknown) -> tuple[nn.Module, PassResult]:
    params = {"impl": impl, "fuse_residual": fuse_residual}
    if unknown:
        raise UserError(f"fused_layernorm: unknown parameter(s) {', '.join(sorted(unknown))}: takes impl, fuse_residual")
    chosen = resolve_impl(impl, torch.device(ctx.device))
    details: dict = {"implementation": chosen}

    if chosen == "torch":
        reason = "asked for" if impl == "torch" else "no GPU and TRITON_INTERPRET unset"
        details.update(replaced=0, fused_residual_blocks=0)
        return model, PassResult(NAME, params, f"kept torch LayerNorm ({reason})", details)

    if chosen == "apex":
        model, replaced, skipped = _replace_layer_norms(model, _apex_from)
        n = sum(replaced.values())
        details.update(replaced=n, replaced_by_class=replaced, skipped=skipped, fused_residual_blocks=0)
        note = "; apex has no fused add+LayerNorm, residual adds left as they are" if fuse_residual else ""
        return model, PassResult(NAME, params, f"{n} LayerNorm -> apex FusedLayerNorm{note}", details)

    from ..kernels.layer_norm import TritonLayerNorm

    model, replaced, skipped = _replace_layer_norms(model, TritonLayerNorm.from_layer_norm)
    n = sum(replaced.values())
    merging = 0
    for module in model.modules():  # PatchMerging: norm -> reduction Linear, the norm writes its dtype
        if isinstance(getattr(module, "norm", None), TritonLayerNorm) and merging_norm_goes_to_linear(module):
            module.norm.into_linear = True
            merging += 1
    details.update(replaced=n, replaced_by_class=replaced, skipped=skipped, merging_norms_into_linear=merging)
    changed = f"{n} LayerNorm -> Triton LayerNorm"
    if fuse_residual:
        counts = _fuse_residual_norm2(model)
        details.update(fused_residual_blocks=counts["blocks_fused"], **counts)
        changed += f", {counts['blocks_fused']} blocks add+norm2 -> add_layer_norm"
    else:
        details["fused_residual_blocks"] = 0
    return model, PassResult(NAME, params, changed, details)
