"""A recipe's kernels in a model you run yourself: `patch_swin`.

`optimize_swin` owns the step (autocast, the optimizer, master weights, the CUDA graph) and so takes a
classifier, images and targets. A Swin inside something else (a detection or segmentation backbone, a
`features_only` model, a training framework's own loop) wants the kernels alone: `patch_swin` applies
the recipe's passes that change how the model's Swin blocks compute (fused LayerNorm, window kernels,
fused attention, fused Linear backward, patch embedding, the whole-block Function, quantized Linears),
in place. The weights, parameters and state_dict stay as they were, except under a quantizing recipe
(inference), whose Linears hold their quantized weights instead; it quantizes the Linears of the Swin
blocks and patch merging layers only, never the heads or necks of a model of yours. The passes that
belong to the step rather than the model (a pass module with `in_your_loop`: autocast, the optimizer,
master weights, torch.compile, CUDA graphs) are not applied; for each, the result says in one line what
to write in your own loop to get it.

The patched forwards are the same ones `optimize_swin` binds: they find the Swin blocks wherever they sit
in the model and compute timm's function (checked against timm in tests/test_patch_swin.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workbench.arguments import require_bool, require_count
from workbench.errors import UserError
from workbench.optimize.passes import PassContext, PassResult, apply_pass, get_pass, refuse_unpatchable
from workbench.optimize.passes._swin import has_v2_blocks, named_swin_blocks
from workbench.optimize.recipes import RecipeUnavailable, effective_passes, inference_only_pass, resolve_chain
from workbench.precision import resolve_precision
from workbench.files import short_repr


@dataclass
class SwinPatch:
    """What patch_swin did to `model` (patched in place).

    applied: the model passes' results, in the recipe's order. in_your_loop: (pass, what to write in your
    own loop to get it) for each of the recipe's step passes, which patch_swin leaves to you. notes: the
    passes that could not run here (with allow_unavailable) or stood aside on this model, and why. dtype: the autocast dtype the
    patched forwards were planned for (the recipe's, or the one asked)."""

    model: torch.nn.Module
    recipe: str
    dtype: str
    applied: list[PassResult] = field(default_factory=list)
    in_your_loop: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """The patch as text: each pass applied and what it changed, then what is left to your loop."""
        lines = [f"recipe {self.recipe} ({self.dtype}): the model's passes, applied in place"]
        lines += [f"  {r.name}: {r.changed}" for r in self.applied]
        if self.in_your_loop:
            lines.append("left to your loop:")
            lines += [f"  {name}: {line}" for name, line in self.in_your_loop]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _recipe_dtype(specs) -> str:
    """The autocast dtype a chain's amp pass sets (its last one), else fp32."""
    dtype = "fp32"
    for spec in specs:
        if spec.name == "amp":
            dtype = spec.params.get("dtype", "bf16")
    return dtype


def patch_swin(model: torch.nn.Module, recipe: str = "fmha", *, dtype: str | None = None, training: bool = True,
               batch: int | None = None, allow_unavailable: bool = False) -> SwinPatch:
    """Apply a recipe's model passes to every timm Swin block inside `model`, in place -> SwinPatch.

    model: any torch.nn.Module holding timm Swin blocks (a SwinTransformer, a features_only one, a detector
    whose backbone is one), on the device it will run on, in fp32. recipe: a built-in recipe name or a
    recipe YAML path. dtype: the autocast dtype your forward runs under ("bf16", "fp16" or "fp32"; default:
    the recipe's amp dtype). The forwards follow whatever autocast is active when they run; this plans the
    choices made once (fc1's GELU in its GEMM's epilogue for inference in half precision, the attention
    route's timing). training: whether the model will train (inference-only passes, the quantized
    Linears, refuse otherwise; the attention route is timed forward and backward). batch: images per
    forward, for fused_attention's route timing on a GPU (default 32).

    A model without timm Swin blocks is a UserError. A pass that cannot run here (no GPU for the Triton
    kernels) raises RecipeUnavailable, unless allow_unavailable (then `notes` says which and why)."""

    if not isinstance(model, torch.nn.Module):
        raise UserError(f"model must be a torch.nn.Module holding timm Swin blocks, got {short_repr(model)}")
    refuse_unpatchable(model, "patch_swin")
    if not named_swin_blocks(model) and not has_v2_blocks(model, cr=True):
        raise UserError(f"{type(model).__name__} holds no timm Swin block (Swin v1, SwinV2 or swinv2_cr): "
                        "nothing to patch")
    require_bool("training", training)
    require_count("batch", batch, optional=True)
    chain = resolve_chain(str(recipe))
    specs = effective_passes(chain)
    dtype = _recipe_dtype(specs) if dtype is None else dtype
    if dtype not in ("bf16", "fp16", "fp32"):
        raise UserError(f"dtype must be bf16, fp16 or fp32, got {short_repr(dtype)}")
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    ctx = PassContext(device=device, precision=resolve_precision(dtype), training=training, batch=batch,
                      swin_only=True)
    patch = SwinPatch(model, chain[-1].name, dtype)
    if training:
        only = inference_only_pass(chain)
        if only is not None:    # said before any pass changes the model
            raise RecipeUnavailable(patch.recipe, f"{only} runs inference only (no backward): patch with "
                                                  "training=False, or choose a recipe without it", patched=False)
    for spec in specs:
        module = get_pass(spec.name)
        in_your_loop = getattr(module, "in_your_loop", None)
        if in_your_loop is not None:
            line = in_your_loop(dict(spec.params), ctx)
            if line:
                patch.in_your_loop.append((spec.name, line))
            continue
        model, result = apply_pass(spec.name, model, ctx, spec.params)
        if not result.available and not allow_unavailable:
            raise RecipeUnavailable(patch.recipe, f"{result.name} {result.changed}")
        if not result.available:
            patch.notes.append(f"pass {result.name} left out: {result.changed}")
        elif result.details.get("applied") is False:     # stood aside, saying why (fused_block on SwinV2)
            patch.notes.append(f"pass {result.name} {result.changed}")
        else:
            patch.applied.append(result)
    patch.model = model
    return patch
