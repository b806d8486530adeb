"""What the passes that patch timm's SwinTransformerBlock share: finding the blocks, square windows,
and whether a dropout / stochastic-depth module is the identity right now."""
from __future__ import annotations

import importlib

import torch

from . import PassContext, PassUnavailable, require_triton


def square(pair) -> int | None:
    """The side of a square timm (h, w) window or shift (or an int), None when not square."""
    a, b = (pair, pair) if isinstance(pair, int) else tuple(pair)
    return int(a) if a == b else None


def inactive(m: torch.nn.Module | None, training: bool) -> bool:
    """m(x) is x now: None or nn.Identity, nn.Dropout with p == 0 or in eval, timm's DropPath with
    drop_prob 0 or in eval."""
    if m is None or isinstance(m, torch.nn.Identity):
        return True
    if isinstance(m, torch.nn.Dropout):
        return m.p == 0 or not training
    if type(m).__name__ == "DropPath":
        return getattr(m, "drop_prob", 1.0) == 0.0 or not training
    return False


def swin_blocks(model: torch.nn.Module, ctx: PassContext, kernels: str, what: str) -> list:
    """Every timm SwinTransformerBlock in `model`, after checking that timm and the Triton kernel module
    `kernels` import and that the device runs Triton; PassUnavailable (naming `what`) otherwise."""
    try:
        from timm.models.swin_transformer import SwinTransformerBlock

        importlib.import_module(kernels)
    except ImportError as exc:
        raise PassUnavailable(f"{what} not importable: {exc}") from exc
    require_triton(ctx.device)
    blocks = [m for m in model.modules() if isinstance(m, SwinTransformerBlock)]
    if not blocks:
        raise PassUnavailable("no timm SwinTransformerBlock in this model")
    return blocks


def autocast_input_dtype(x: torch.Tensor) -> torch.dtype | None:
    """`kernels.layer_norm.autocast_linear_input_dtype`: the dtype an autocast nn.Linear casts an fp32 x to
    (None: no cast). Looked up here, by this name, by every fused norm of the passes."""
    from ..kernels.layer_norm import autocast_linear_input_dtype

    return autocast_linear_input_dtype(x)


def norm_output_dtype(x: torch.Tensor, to_linear: bool, dtype: torch.dtype | None = None) -> torch.dtype | None:
    """The dtype a fused LayerNorm over x (or over a tensor on x's device in `dtype`, such as x plus a
    branch) writes: the autocast dtype when its output goes straight into an nn.Linear (autocast_input_dtype:
    the bits that Linear's cast would give), else the dtype torch's layer_norm returns under autocast
    (kernels.layer_norm.autocast_norm_dtype: fp32 under CUDA autocast). None: the input's dtype."""
    if to_linear:
        return autocast_input_dtype(x)
    from ..kernels.layer_norm import autocast_norm_dtype

    return autocast_norm_dtype(x, dtype)


def _input_goes_to_linear(module: torch.nn.Module, linear: str, class_forward, patched_forward) -> bool:
    """Whether `module` passes its input straight to its nn.Linear `linear`: its forward is the class's
    `class_forward` (not replaced on the instance) or one of our `patched_forward` functions bound to it."""
    if not isinstance(getattr(module, linear, None), torch.nn.Linear):
        return False
    fwd = vars(module).get("forward")
    if fwd is not None:
        return getattr(fwd, "__func__", None) in patched_forward
    return type(module).forward is class_forward


_FORWARDS_INTO_LINEAR: dict = {}


def _forwards_into_linear() -> dict:
    """The forwards whose module hands its input straight to a Linear, resolved on the first call (the
    checks below run per block and step; a plain dict, which torch.compile reads without a warning, where
    an lru_cache would draw one): {Linear's name: (the class's forward, our patched forwards)}."""
    if not _FORWARDS_INTO_LINEAR:
        from timm.layers import Mlp
        from timm.models.swin_transformer import WindowAttention

        from .fused_attention import PATCHED_FORWARDS
        from .fused_linear import mlp_forward_fused

        _FORWARDS_INTO_LINEAR.update(qkv=(WindowAttention.forward, PATCHED_FORWARDS),
                                     fc1=(Mlp.forward, (mlp_forward_fused,)))
    return _FORWARDS_INTO_LINEAR


def merging_norm_goes_to_linear(merging: torch.nn.Module) -> bool:
    """Whether a timm PatchMerging hands its norm's output straight to its `reduction` Linear: its forward
    is the class's (pad, 2x2 gather, norm, reduction)."""
    from timm.models.swin_transformer import PatchMerging

    return isinstance(merging, PatchMerging) and _input_goes_to_linear(merging, "reduction", PatchMerging.forward, ())


def attn_input_goes_to_linear(attn: torch.nn.Module) -> bool:
    """Whether a block's attention module does nothing with its input but pass it to its qkv nn.Linear:
    timm's WindowAttention forward, or fused_attention's."""
    return _input_goes_to_linear(attn, "qkv", *_forwards_into_linear()["qkv"])


def mlp_input_goes_to_linear(mlp: torch.nn.Module) -> bool:
    """Whether a block's MLP does nothing with its input but pass it to its fc1 nn.Linear: timm's Mlp
    forward, or fused_linear's (whose fc1 Function casts to the autocast dtype as F.linear does)."""
    return _input_goes_to_linear(mlp, "fc1", *_forwards_into_linear()["fc1"])


def gather_rel_pos_bias(table: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """timm's relative-position bias, (nH, n, n) contiguous, bias[h, i, j] = table[index[i, j], h]: one
    gather launch (timm's `_get_rel_pos_bias` gathers and then copies the permuted result)."""
    return table.t().index_select(1, index.view(-1)).view(-1, n, n)


def scatter_rel_pos_grad(d_rel: torch.Tensor, index: torch.Tensor, table_shape, table_dtype,
                         into: torch.Tensor | None = None) -> torch.Tensor:
    """The table's gradient from the bias's (nH, n, n): a memset and one index_add_ (atomic adds; PyTorch
    switches to a deterministic kernel under torch.use_deterministic_algorithms). Autograd's backward of
    timm's gather is index_put_ with accumulate, which sorts the indices first. into: a zeroed tensor of the
    table's shape and dtype to add into instead of a fresh one (no memset of its own)."""
    heads = d_rel.shape[0]
    out = d_rel.new_zeros(table_shape, dtype=table_dtype) if into is None else into
    return out.index_add_(0, index.view(-1), d_rel.reshape(heads, -1).t().to(table_dtype))


class RelPosBias(torch.autograd.Function):
    """gather_rel_pos_bias with, as its backward, one deterministic Triton launch when the module carries
    the index's inverse (`rel_pos_inverse`, set by fused_attention), else scatter_rel_pos_grad (a memset and
    an index_add_): two or three launches per block and step where timm's gather, copy and sorted
    index_put take five or more."""

    @staticmethod
    def forward(ctx, table, index, n, inverse):
        ctx.save_for_backward(index, inverse)
        ctx.table = (table.shape, table.dtype)
        return gather_rel_pos_bias(table, index, n)

    @staticmethod
    def backward(ctx, d_rel):
        index, inverse = ctx.saved_tensors
        if inverse is not None:
            from ..kernels.window_attention import rel_pos_table_grad

            return rel_pos_table_grad(d_rel, inverse, ctx.table[1]), None, None, None
        return scatter_rel_pos_grad(d_rel, index, *ctx.table), None, None, None


INVERSE_BUFFER = "_swinbench_rel_pos_inverse"


def add_rel_pos_inverse(attn: torch.nn.Module) -> bool:
    """Give a timm WindowAttention its relative-position index's inverse, as a non-persistent buffer (it
    follows the module across devices; state_dict does not change), for RelPosBias's one-launch backward.
    False when the module has no standard table and index."""
    from ..kernels.window_attention import rel_pos_inverse

    table, index = getattr(attn, "relative_position_bias_table", None), getattr(attn, "relative_position_index", None)
    if table is None or index is None or table.dim() != 2:
        return False
    if getattr(attn, INVERSE_BUFFER, None) is None:
        attn.register_buffer(INVERSE_BUFFER, rel_pos_inverse(index, table.shape[0]), persistent=False)
    return True


def rel_pos_bias(attn: torch.nn.Module) -> torch.Tensor:
    """A timm WindowAttention's (nH, N, N) relative-position bias through RelPosBias, or through its own
    `_get_rel_pos_bias` when a subclass computes the bias some other way."""
    from timm.models.swin_transformer import WindowAttention

    if type(attn)._get_rel_pos_bias is WindowAttention._get_rel_pos_bias:
        return RelPosBias.apply(attn.relative_position_bias_table, attn.relative_position_index, attn.window_area,
                                getattr(attn, INVERSE_BUFFER, None))
    bias = attn._get_rel_pos_bias()
    return bias.reshape(bias.shape[-3:])
