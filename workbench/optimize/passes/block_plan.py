"""The fused Swin block as one explicit thing: a `BlockPlan` says what each timm SwinTransformerBlock of a
model runs, and `BlockPlans.bind` is the one place that makes it run so.

The passes that change how a block runs (fused_layernorm, fused_window, fused_attention, fused_linear,
fused_block, sdpa_attention) never replace a forward themselves. Each swaps the modules it swaps
(LayerNorm -> TritonLayerNorm, Linear -> BiasGradLinear), sets its own fields of the blocks' plans, and
calls `bind`, which replaces every forward the plans call for (the block's, its attention's, its MLP's,
its stage's) with one built from the plan's fields (block_forward.py), keeping what it replaced in its
own record so that it can put it back. Each field is set by the passes the table names, and a forward
depends on nothing but the plan (and the module types the passes leave), so the order the passes run in
does not matter: the same set of passes gives the same plans and the same forwards.

A model's plans live in one place: the BlockPlans that `block_plans(model)` keeps on the model, as its
attribute `block_plans`, by each block's qualified name. A deep copy of the model copies them with it.

    plan field     set by           what it says
    norm           fused_layernorm  norm1/norm2 modules: torch | triton (TritonLayerNorm) | apex
    add_norm2      fused_layernorm  the residual add before norm2 runs in norm2's kernel (add_layer_norm); in
                                    inference the stage's PatchMerging runs its pad and gather in its norm's
                                    pass (block_forward.merging_forward; its norm a TritonLayerNorm into
                                    the reduction Linear)
    window         fused_window     norm1 + shift + partition and the merge back run as fused kernels;
                                    with add_norm2, the merge, add and norm2 as one (merge_add_norm)
    sdpa           sdpa_attention,  timm's F.scaled_dot_product_attention path (its fused_attn switch);
                   fused_attention  fused_attention sets it for the blocks it leaves off the kernel
                                    (measured faster, above max_tokens, attention dropout)
    attention      fused_attention  timm (timm's module forward, eager or sdpa) | triton (the fused kernel)
    attention_bias fused_attention  the fused kernel's bias: table (read in-kernel) | gather (gathered first)
    linear         fused_linear     the block's Linears compute their bias gradient in one reduction
    mlp_gelu       fused_linear     the MLP's fc1 and GELU run as one Function
    mlp_quant      quantize_linear  the MLP's fc1 is a QuantLinear that runs the GELU itself, in its GEMM's
                                    epilogue with fc2's input quantization (inference; over mlp_gelu)
    mlp_kernel     fused_linear,    the MLP (mlp_gelu's, or mlp_quant's pair) runs as one kernel, its hidden
                   quantize_linear  kept on chip (kernels.mlp; inference, where measured faster than its two
                                    GEMMs)
    qkv_kernel     fused_linear     the qkv Linear runs inside the fused attention kernel, the packed qkv never
                                    written (kernels.qkv_attention; inference, float qkv weights, where
                                    measured faster than the qkv GEMM and the attention kernel)
    whole_block    fused_block      the block runs as one autograd Function (block_forward.SwinBlockFunction)
    fallbacks      every pass       (field, reason) for what a pass asked for and the block cannot run

Runtime conditions still choose within a plan (torch.compile tracing, active dropout or stochastic depth,
a window made non-square after binding): block_forward.py says where. One setting holds for the whole
model rather than per block: `BlockPlans.window_under_compile` (set by the compile pass's fused_window),
whether the window forwards and deferring stages keep their fused chain (add_norm_shift_partition,
merge_add_norm) while torch.compile traces instead of falling back to timm's stage and merge paths;
bind hands it to the forwards it builds as a plain value.
"""
from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass

import torch

from workbench.optimize.passes._swin import (INVERSE_BUFFER, add_rel_pos_inverse, merging_norm_goes_to_linear,
                                             named_swin_blocks)
from workbench.optimize.passes.block_forward import (attention_forward, block_forward, merging_forward,
                                                     mlp_forward_fused, mlp_forward_quantized,
                                                     mlp_forward_quantized_whole, mlp_forward_whole,
                                                     qkv_kernel_forward, stage_forward, stage_hands_on,
                                                     stages_forward)

NORMS = ("torch", "triton", "apex")
ATTENTIONS = ("timm", "triton")
BIAS_MODES = ("table", "gather")
PLANS_ATTRIBUTE = "block_plans"


@dataclass(frozen=True)
class BlockPlan:
    """What one timm SwinTransformerBlock runs (the fields: see the module's docstring). The default is
    timm's block as it is."""

    norm: str = "torch"
    add_norm2: bool = False
    window: bool = False
    sdpa: bool = False
    attention: str = "timm"
    attention_bias: str = "table"
    linear: bool = False
    mlp_gelu: bool = False
    mlp_quant: bool = False
    mlp_kernel: bool = False
    qkv_kernel: bool = False
    whole_block: bool = False
    fallbacks: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        if self.norm not in NORMS or self.attention not in ATTENTIONS or self.attention_bias not in BIAS_MODES:
            raise ValueError(f"not a block plan: {self}")
        fields = {f.name for f in dataclasses.fields(self)}
        if any(name not in fields for name, _ in self.fallbacks):
            raise ValueError(f"fallbacks name an unknown field: {self.fallbacks}")

    @property
    def norm_kernel(self) -> str:
        """torch | triton | apex, '+ add' where the residual add before norm2 runs in norm2's kernel."""
        return self.norm + (" + add" if self.add_norm2 else "")

    @property
    def window_kernel(self) -> str:
        """torch | fused shift+partition | fused shift+partition, merged with norm2."""
        if not self.window:
            return "torch"
        return "fused shift+partition" + (", merged with norm2" if self.add_norm2 else "")

    @property
    def attention_kernel(self) -> str:
        """timm eager | sdpa | triton (bias table | gather), '; inference: with qkv' where the qkv Linear runs
        inside it (qkv_kernel)."""
        if self.attention == "triton":
            return f"triton (bias {self.attention_bias})" + ("; inference: with qkv" if self.qkv_kernel else "")
        return "sdpa" if self.sdpa else "timm eager"

    @property
    def linear_kernel(self) -> str:
        """torch | triton bias gradient, '+ GELU' where fc1 and GELU are one Function."""
        if self.mlp_quant:
            return "quantized MLP in one kernel" if self.mlp_kernel else "quantized fc1 + GELU epilogue"
        if self.mlp_gelu and self.mlp_kernel:
            return "triton bias gradient; inference: the MLP in one kernel"
        if not self.linear:
            return "torch"
        return "triton bias gradient" + (" + GELU" if self.mlp_gelu else "")

    @property
    def defers_mlp_add(self) -> bool:
        """Whether the block, in a stage of such blocks, hands its MLP branch to the next one unadded."""
        return self.window and not self.whole_block

    def describe(self) -> str:
        """One line: the kernels of each part, and what falls back."""
        text = (f"norm {self.norm_kernel}; window {self.window_kernel}; attention {self.attention_kernel}; "
                f"linear {self.linear_kernel}" + ("; whole block as one Function" if self.whole_block else ""))
        return text + "".join(f"; {name} not used: {why}" for name, why in self.fallbacks)


class BlockPlans:
    """The BlockPlan of each timm SwinTransformerBlock of one model, by the block's qualified name (blocks
    no pass planned run timm's forward), and the record of what `bind` replaced."""

    def __init__(self):
        self.plans: dict[str, BlockPlan] = {}
        # the compile pass's fused_window: the window forwards keep the fused chain under torch.compile
        self.window_under_compile = False
        # (module's qualified name, attribute) -> (whether the module had it, its value) before bind set it
        self._replaced: dict[tuple[str, str], tuple[bool, object]] = {}

    def plan(self, name: str) -> BlockPlan:
        """The plan of the block called `name` (timm's block as it is where no pass planned it)."""
        return self.plans.get(name, BlockPlan())

    def update(self, name: str, **fields) -> BlockPlan:
        """Set fields of a block's plan; a fallback noted for one of them goes. -> the new plan."""
        old = self.plan(name)
        kept = tuple(f for f in old.fallbacks if f[0] not in fields)
        self.plans[name] = dataclasses.replace(old, fallbacks=kept, **fields)
        return self.plans[name]

    def fall_back(self, name: str, field: str, reason: str) -> BlockPlan:
        """Note that a pass asked for `field` in a block's plan and the block cannot run it, and why."""
        old = self.plan(name)
        fallbacks = dict(old.fallbacks)
        fallbacks[field] = reason
        self.plans[name] = dataclasses.replace(old, fallbacks=tuple(sorted(fallbacks.items())))
        return self.plans[name]

    def forward_replaced_elsewhere(self, name: str, module: torch.nn.Module) -> bool:
        """Whether `module` (called `name`) has a forward of its own that no plan bound: a pass leaves such a
        block's forward alone."""
        return "forward" in vars(module) and (name, "forward") not in self._replaced

    def bind(self, model: torch.nn.Module) -> dict[str, int]:
        """Make `model` run its plans: put back what the last bind replaced, then replace, for each planned
        block, the forwards its plan calls for; a stage of two or more blocks that defer their MLP add runs
        stage_forward. Blocks whose forward was replaced elsewhere keep it. -> counts of what was bound."""
        from timm.layers import Mlp
        from timm.models.swin_transformer import SwinTransformerStage, WindowAttention

        self.unbind(model)
        counts = {"block_forwards": 0, "attention_forwards": 0, "mlp_forwards": 0, "deferring_stages": 0,
                  "merging_forwards": 0, "stage_hand_offs": 0}
        defers: dict[str, bool] = {}
        for name, blk in named_swin_blocks(model):
            plan = self.plans.get(name)
            if plan is None:
                continue
            attn, mlp = blk.attn, blk.mlp
            attn_to_linear = _input_goes_to_linear(attn, "qkv", plan.attention == "triton", WindowAttention.forward)
            mlp_to_linear = _input_goes_to_linear(mlp, "fc1", plan.mlp_gelu or plan.mlp_quant, Mlp.forward)
            if plan.sdpa and hasattr(attn, "fused_attn"):
                self._set(f"{name}.attn", attn, "fused_attn", True)
            if plan.attention == "triton":
                has_inverse = add_rel_pos_inverse(attn)
                if has_inverse:
                    self._replaced[(f"{name}.attn", INVERSE_BUFFER)] = (False, None)
                table = plan.attention_bias == "table" and has_inverse
                forward = attention_forward(table, has_inverse)
                if plan.qkv_kernel:
                    forward = qkv_kernel_forward(forward)
                self._set(f"{name}.attn", attn, "forward", types.MethodType(forward, attn))
                counts["attention_forwards"] += 1
            if plan.mlp_quant or plan.mlp_gelu:
                forward = {(True, False): mlp_forward_quantized, (True, True): mlp_forward_quantized_whole,
                           (False, False): mlp_forward_fused, (False, True): mlp_forward_whole}[
                    (plan.mlp_quant, plan.mlp_kernel)]
                self._set(f"{name}.mlp", mlp, "forward", types.MethodType(forward, mlp))
                counts["mlp_forwards"] += 1
            forward = block_forward(plan.add_norm2, plan.window, plan.whole_block, attn_to_linear, mlp_to_linear,
                                    self.window_under_compile)
            if forward is not None and "forward" not in vars(blk):
                self._set(name, blk, "forward", types.MethodType(forward, blk))
                counts["block_forwards"] += 1
                defers[name] = plan.defers_mlp_add
        for name, stage in model.named_modules():
            if not isinstance(stage, SwinTransformerStage):
                continue
            prefix = f"{name}.blocks." if name else "blocks."
            merging = stage.downsample
            if (any(self.plan(f"{prefix}{i}").add_norm2 for i in range(len(stage.blocks)))
                    and getattr(getattr(merging, "norm", None), "into_linear", False)
                    and merging_norm_goes_to_linear(merging)):
                self._set(f"{name}.downsample" if name else "downsample", merging, "forward",
                          types.MethodType(merging_forward, merging))
                counts["merging_forwards"] += 1
            if "forward" in vars(stage):
                continue
            stage_defers = tuple(defers.get(f"{prefix}{i}", False) for i in range(len(stage.blocks)))
            if sum(stage_defers) >= 2:
                self._set(name, stage, "forward",
                          types.MethodType(stage_forward(stage_defers, self.window_under_compile), stage))
                counts["deferring_stages"] += 1
        for name, layers in model.named_modules():     # a Swin's `layers`: the stages in turn
            if (type(layers) is not torch.nn.Sequential or len(layers) < 2 or "forward" in vars(layers)
                    or not all(isinstance(s, SwinTransformerStage) for s in layers)):
                continue
            hand_offs = sum(stage_hands_on(a) and stage_hands_on(b) for a, b in zip(layers, list(layers)[1:]))
            if hand_offs:
                self._set(name, layers, "forward", types.MethodType(stages_forward, layers))
                counts["stage_hand_offs"] += hand_offs
        return counts

    def unbind(self, model: torch.nn.Module) -> None:
        """Put back everything bind replaced (the modules then run the forwards they had)."""
        for (name, attr), (had, value) in reversed(list(self._replaced.items())):
            try:
                module = model.get_submodule(name)
            except AttributeError:  # the model no longer has that module
                continue
            if had:
                setattr(module, attr, value)
            elif attr in vars(module) or attr in module._buffers:
                delattr(module, attr)
        self._replaced.clear()

    def _set(self, name: str, module: torch.nn.Module, attr: str, value) -> None:
        """setattr(module, attr, value), the module's own value (if it had one) kept in the record first."""
        key = (name, attr)
        if key not in self._replaced:
            self._replaced[key] = (attr in vars(module), vars(module).get(attr))
        setattr(module, attr, value)


def _input_goes_to_linear(module: torch.nn.Module, linear: str, planned: bool, class_forward) -> bool:
    """Whether `module` does nothing with its input but pass it to its nn.Linear `linear` (or the QuantLinear
    quantize_linear put there) so that a fused norm before it can write the Linear's input itself: its
    forward is one the plan binds (`planned`: the fused attention or MLP, which keep that order) or the
    class's `class_forward`, not replaced on the instance."""
    from workbench.kernels.quant import QuantLinear

    if not isinstance(getattr(module, linear, None), (torch.nn.Linear, QuantLinear)):
        return False
    return planned or ("forward" not in vars(module) and type(module).forward is class_forward)


def block_plans(model: torch.nn.Module) -> BlockPlans:
    """The BlockPlans of `model`, made on first use and kept on the model (its attribute PLANS_ATTRIBUTE):
    the one place a model's block plans live."""
    plans = vars(model).get(PLANS_ATTRIBUTE)
    if plans is None:
        plans = BlockPlans()
        setattr(model, PLANS_ATTRIBUTE, plans)
    return plans
