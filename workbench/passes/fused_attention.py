"""Pass `fused_attention`: run every timm WindowAttention through the fused Triton kernel.

Each WindowAttention instance gets its forward replaced (types.MethodType) by one that keeps the
qkv and proj Linears as they are and swaps the attention core (q k^T * scale + bias + mask,
softmax, @ v) for `fused_window_attention_qkv`: the N x N scores never reach global memory and
the relative-position bias is gathered from timm's table in one launch and its gradient summed back
into the table by one deterministic Triton launch over the index's inverse (`_swin.RelPosBias`).
Instances with a non-zero attn_drop are left unpatched (the kernel has no dropout) and counted.
"""
from __future__ import annotations

import importlib
import types

import torch

from . import PassContext, PassResult, PassUnavailable, require_triton
from ..errors import UserError
from ._swin import INVERSE_BUFFER, add_rel_pos_inverse, rel_pos_bias

NAME = "fused_attention"


def _around_the_core(self, x: torch.Tensor, core) -> torch.Tensor:
    """timm WindowAttention.forward around an attention core: qkv Linear, core(qkv) -> (B_*N, C) token
    rows, proj Linear, proj_drop. x: (B*nW, N, C). The Linears take token rows (a 3-D input costs two
    autograd view nodes inside each Linear); q, k, v are strided views of the packed qkv."""
    B_, N, C = x.shape
    qkv = self.qkv(x.reshape(B_ * N, C)).view(B_, N, 3, self.num_heads, -1)
    x = self.proj(core(qkv))
    x = self.proj_drop(x)
    return x.view(B_, N, -1)


def fused_window_attention_forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """timm WindowAttention.forward with the fused kernel. x: (B*nW, N, C); mask: (nW, N, N) or None."""
    from ..kernels.window_attention import fused_window_attention_qkv

    # the kernel's output comes as token rows, the layout it writes (no copy)
    return _around_the_core(self, x, lambda qkv: fused_window_attention_qkv(qkv, rel_pos_bias(self), mask, self.scale,
                                                                             tokens=True))


def fused_window_attention_forward_table(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """As fused_window_attention_forward, with the bias gathered from the table inside the kernels and the
    table's gradient summed from the kernel's partials in one launch (`fused_window_attention_table`)."""
    from ..kernels.window_attention import fused_window_attention_table

    return _around_the_core(self, x, lambda qkv: fused_window_attention_table(
        qkv, self.relative_position_bias_table, self.relative_position_index, getattr(self, INVERSE_BUFFER), mask,
        self.scale, tokens=True))


PATCHED_FORWARDS = (fused_window_attention_forward, fused_window_attention_forward_table)
BIAS_MODES = ("gather", "table")
PARAMS = {"bias": (str, BIAS_MODES)}   # parameter -> (type, allowed values), checked when a recipe is loaded


def apply(model: torch.nn.Module, ctx: PassContext, bias: str = "table") -> tuple[torch.nn.Module, PassResult]:
    """Patch every timm WindowAttention in `model` in place -> (model, PassResult).

    bias: 'table' (default) has the kernels read timm's relative-position table through its index
    themselves and the backward sum the bias gradient straight into the table (two launches fewer per
    block than 'gather'); 'gather' gathers the (nH, N, N) bias from the table in one launch before the
    kernel. A module with its own bias computation (a subclass overriding _get_rel_pos_bias) gets
    'gather'. On the H200 (Swin-B, batch 64, training) 'table' was 1.04-1.08x faster eager, the same
    under CUDA graphs, and 25.1 against 30.0 ms per step under torch.compile (docs/measurements.md)."""
    if bias not in BIAS_MODES:
        raise UserError(f"pass fused_attention: bias must be one of {', '.join(BIAS_MODES)}, not {bias!r}")
    try:
        from timm.models.swin_transformer import WindowAttention

        importlib.import_module("workbench.kernels.window_attention")
    except ImportError as exc:
        raise PassUnavailable(f"fused window attention kernel not importable: {exc}") from exc
    require_triton(ctx.device)

    patched, skipped_dropout, table_modules = 0, 0, 0
    for module in model.modules():
        if not isinstance(module, WindowAttention):
            continue
        if module.attn_drop.p > 0:
            skipped_dropout += 1  # the kernel has no attention dropout: keep timm's path
            continue
        has_inverse = add_rel_pos_inverse(module)
        table = (bias == "table" and has_inverse
                 and type(module)._get_rel_pos_bias is WindowAttention._get_rel_pos_bias)
        forward = fused_window_attention_forward_table if table else fused_window_attention_forward
        module.forward = types.MethodType(forward, module)
        patched += 1
        table_modules += bool(table)
    if patched == 0 and skipped_dropout == 0:
        raise PassUnavailable("no timm WindowAttention modules in this model")
    changed = f"{patched} WindowAttention -> fused Triton window attention (fwd+bwd)"
    if skipped_dropout:
        changed += f"; {skipped_dropout} left on timm's path (attn_drop > 0)"
    if bias == "table":
        changed += f", {table_modules} reading the bias table in-kernel"
    else:
        changed += ", the bias gathered before the kernel"
    details = {
        "patched_modules": patched,
        "skipped_attn_dropout": skipped_dropout,
        "bias": bias,
        "table_modules": table_modules,
        "implementation": ("workbench.kernels.window_attention.fused_window_attention_table (Triton)" if table_modules
                           else "workbench.kernels.window_attention.fused_window_attention_qkv (Triton)"),
    }
    return model, PassResult(NAME, {"bias": bias} if bias != "table" else {}, changed, details)
