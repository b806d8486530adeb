"""fused_layernorm: every last-dim LayerNorm of the model becomes a fused one, and each Swin block's
`x + attn; norm2(x)` becomes one add_layer_norm.

params:
  impl: auto | triton | torch | apex   (default auto)
      apex   - apex.normalization.FusedLayerNorm (weights copied); PassUnavailable if apex is missing.
      triton - workbench.kernels.layer_norm.TritonLayerNorm; PassUnavailable on a CPU without
               TRITON_INTERPRET=1.
      torch  - keep torch's LayerNorm (the model is returned unchanged).
      auto   - apex if importable and the device is a GPU; else AUTO_GPU_IMPL on a GPU; else triton when
               TRITON_INTERPRET=1; else not available (PassUnavailable: torch's LayerNorm kept under this
               pass's name would be reported as a fused one).
  fuse_residual: bool (default true) - with the triton implementation, each timm SwinTransformerBlock's
      residual add before norm2 and norm2 also run as one add_layer_norm (the plan's add_norm2), and in
      inference each PatchMerging's pad and gather run in its norm's pass (below).

Which modules: those whose class is torch's nn.LayerNorm or timm's LayerNorm (a subclass with the same
math) over one trailing dim. Other nn.LayerNorm subclasses (timm's LayerNorm2d normalizes dim 1,
LayerNormFp32 upcasts) are left alone and counted in details["skipped"]. The replacement keeps the very
Parameter objects, so parameter names, state_dict keys (`weight`, `bias`) and optimizer groups don't change.

Per timm SwinTransformerBlock the pass sets the block's plan (block_plan.py): `norm` (triton or apex)
and, with fuse_residual, `add_norm2`: the block's `x + attn; norm2(x)` runs as one add_layer_norm, in
whatever forward the plan builds (timm's attention half with it, or fused_window's):
    x, h = add_layer_norm(x, drop_path1(attn), norm2.weight, norm2.bias, norm2.eps)  # (B, L, C)
    x = x + drop_path2(mlp(h))
A block whose forward was replaced outside the plans is left alone and counted in
details["blocks_forward_already_patched"]. The drop paths don't restrict the fusion: drop_path1 is applied
to the attention branch before the add and drop_path2 to the MLP output after the norm, both exactly as
timm does.

SwinV2's blocks are post-norm (`x = x + drop_path(norm(branch))`): with fuse_residual each block's two
residual adds run in the LayerNorm pass that normalizes the branch (post_add_layer_norm, bound as the
block's forward: block_forward.v2_block_forward), so the normalized branch is never written (with
fused_window's kernels, the attention's windows are merged back in the same pass: merge_norm_add); where a drop
path is active in training, or the norm's output is narrower than the sum, that add runs as timm's.

Dtypes: under autocast, when h goes straight into the MLP's fc1 Linear, add_layer_norm writes h in the
autocast dtype, the bits fc1's input cast would give (no cast launches). So does each PatchMerging's
norm, whose output goes straight into the `reduction` Linear (the class's forward;
`TritonLayerNorm.into_linear`). With fuse_residual, without autograd (inference), each such PatchMerging
runs its zero pad, 2x2 gather and norm as one Triton pass over its input (the stage's plan binds
block_forward.merging_forward), where timm copies the input twice before the norm reads it. Otherwise every output has the dtype torch's LayerNorm would give it under
autocast: fp32 under CUDA autocast (`kernels.layer_norm.autocast_norm_dtype`), so the model's residual
stream keeps AMP's precision (fp32 in stage 1, from the patch embedding's norm) and this pass changes
kernels, not precision.
"""
from __future__ import annotations

import types

import torch
from torch import nn

from workbench.errors import UserError
from workbench.optimize.passes import PassContext, PassResult, PassUnavailable, triton_runs_on
from workbench.optimize.passes._swin import merging_norm_goes_to_linear, named_swin_blocks
from workbench.optimize.passes.block_plan import block_plans

NAME = "fused_layernorm"
OWN_KERNELS = True   # runs swinbench kernels: a stage with it is not PyTorch alone
IMPLS = ("auto", "triton", "torch", "apex")
# parameter -> (type, allowed values); recipes.py checks a recipe against it when it is loaded
PARAMS = {"impl": (str, IMPLS), "fuse_residual": (bool, None)}
# What `auto` picks on a GPU when apex is missing: the faster of the two on benchmarks/bench_layer_norm.py
# (fwd+bwd, Swin-B shapes).
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
    if not triton_runs_on(device):   # torch's LayerNorm under this pass's name would be another stage
        raise PassUnavailable("the Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1 on the CPU)")
    return "triton"


def _fused_classes() -> tuple[type, ...]:
    """The LayerNorm classes this pass swaps in (left alone when met again)."""
    classes = [c for c in (_apex_layer_norm_class(),) if c is not None]
    try:
        from workbench.kernels.layer_norm import TritonLayerNorm

        classes.append(TritonLayerNorm)
    except ImportError:  # no triton: only apex's can be there
        pass
    return tuple(classes)


def _replace_layer_norms(model: nn.Module, make) -> tuple[nn.Module, dict[str, int], dict[str, int]]:
    """Swap each replaceable LayerNorm for make(old). -> (model, replaced by class, skipped by class)."""
    replaceable = _replaceable_classes()
    fused = _fused_classes()
    replaced: dict[str, int] = {}
    skipped: dict[str, int] = {}
    targets = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.LayerNorm) or isinstance(module, fused):
            continue
        cls = type(module).__name__
        if type(module) in replaceable and len(module.normalized_shape) == 1:
            targets.append((name, module))
        else:
            skipped[cls] = skipped.get(cls, 0) + 1
    for name, module in targets:
        new = make(module)
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


def _plan_blocks(model: nn.Module, norm_class: type, norm: str, fuse_residual: bool) -> dict[str, int]:
    """Set `norm` in the plan of every block whose norm1 and norm2 are now `norm_class`, and with
    fuse_residual `add_norm2` where norm2 is a TritonLayerNorm; then bind. -> counts."""
    plans = block_plans(model)
    counts = {"blocks_fused": 0, "blocks_forward_already_patched": 0, "blocks_norm2_not_fusable": 0}
    for name, blk in named_swin_blocks(model):
        if isinstance(blk.norm1, norm_class) and isinstance(blk.norm2, norm_class):
            plans.update(name, norm=norm)
        if not fuse_residual or plans.plan(name).add_norm2:
            continue
        if norm != "triton":
            plans.fall_back(name, "add_norm2", f"{norm} has no fused add + LayerNorm")
        elif plans.forward_replaced_elsewhere(name, blk):
            counts["blocks_forward_already_patched"] += 1
            plans.fall_back(name, "add_norm2", "the block's forward was replaced outside its plan")
        elif not isinstance(blk.norm2, norm_class) or not hasattr(blk.norm2, "eps"):
            counts["blocks_norm2_not_fusable"] += 1
            plans.fall_back(name, "add_norm2", "norm2 is not a LayerNorm this pass replaces")
        else:
            plans.update(name, add_norm2=True)
            counts["blocks_fused"] += 1
    plans.bind(model)
    return counts


def _bind_v2_blocks(model: nn.Module, norm_class: type) -> dict[str, int]:
    """Bind v2_block_forward on every SwinV2 block whose norm1 and norm2 are now `norm_class` and whose
    forward is timm's -> counts (blocks bound, blocks left on timm's forward)."""
    from workbench.optimize.passes.block_forward import v2_block_forward

    counts = {"swinv2_post_norm_blocks": 0, "swinv2_blocks_left": 0}
    for blk in model.modules():
        kind = type(blk).__name__
        if kind not in ("SwinTransformerV2Block", "SwinTransformerV2CrBlock"):
            continue
        if (isinstance(blk.norm1, norm_class) and isinstance(blk.norm2, norm_class)
                and "forward" not in vars(blk) and type(blk).forward.__qualname__ == f"{kind}.forward"):
            blk.forward = types.MethodType(v2_block_forward, blk)
            counts["swinv2_post_norm_blocks"] += 1
        else:
            counts["swinv2_blocks_left"] += 1
    return counts


def apply(model: nn.Module, ctx: PassContext, impl: str = "auto", fuse_residual: bool = True,
          **unknown) -> tuple[nn.Module, PassResult]:
    params = {"impl": impl, "fuse_residual": fuse_residual}
    if unknown:
        raise UserError(f"fused_layernorm: unknown parameter(s) {', '.join(sorted(unknown))}: takes impl, fuse_residual")
    chosen = resolve_impl(impl, torch.device(ctx.device))
    details: dict = {"implementation": chosen}

    if chosen == "torch":
        details.update(replaced=0, fused_residual_blocks=0)
        return model, PassResult(NAME, params, "kept torch LayerNorm (asked for)", details)

    if chosen == "apex":
        model, replaced, skipped = _replace_layer_norms(model, _apex_from)
        n = sum(replaced.values())
        _plan_blocks(model, _apex_layer_norm_class(), "apex", fuse_residual)
        details.update(replaced=n, replaced_by_class=replaced, skipped=skipped, fused_residual_blocks=0)
        note = "; apex has no fused add+LayerNorm, residual adds left as they are" if fuse_residual else ""
        return model, PassResult(NAME, params, f"{n} LayerNorm -> apex FusedLayerNorm{note}", details)

    from workbench.kernels.layer_norm import TritonLayerNorm

    model, replaced, skipped = _replace_layer_norms(model, TritonLayerNorm.from_layer_norm)
    n = sum(replaced.values())
    merging = 0
    for module in model.modules():  # PatchMerging: norm -> reduction Linear, the norm writes its dtype
        if isinstance(getattr(module, "norm", None), TritonLayerNorm) and merging_norm_goes_to_linear(module):
            module.norm.into_linear = True
            merging += 1
    details.update(replaced=n, replaced_by_class=replaced, skipped=skipped, merging_norms_into_linear=merging)
    changed = f"{n} LayerNorm -> Triton LayerNorm"
    counts = _plan_blocks(model, TritonLayerNorm, "triton", fuse_residual)
    if fuse_residual:
        details.update(fused_residual_blocks=counts["blocks_fused"], **counts)
        v2 = _bind_v2_blocks(model, TritonLayerNorm)
        if counts["blocks_fused"] or not (v2["swinv2_post_norm_blocks"] or v2["swinv2_blocks_left"]):
            changed += f", {counts['blocks_fused']} blocks add+norm2 -> add_layer_norm"
        if v2["swinv2_post_norm_blocks"] or v2["swinv2_blocks_left"]:
            details.update(v2)
            changed += (f", {v2['swinv2_post_norm_blocks']} SwinV2 blocks' x + norm(branch) -> "
                        "post_add_layer_norm")
            if v2["swinv2_blocks_left"]:
                changed += (f" ({v2['swinv2_blocks_left']} kept on timm's forward: another norm, a subclass or "
                            "a forward replaced elsewhere)")
    else:
        details["fused_residual_blocks"] = 0
    return model, PassResult(NAME, params, changed, details)
