"""What the passes that plan timm's SwinTransformerBlocks share: finding the blocks, square windows,
whether a dropout / stochastic-depth module is the identity right now, timm's stochastic depth with its
multiply in Triton, the dtype a fused norm writes, and the relative-position bias gathered from timm's table."""
from __future__ import annotations

import importlib
import math

import torch

from workbench.optimize.passes import PassContext, PassResult, PassUnavailable, require_triton


def square(pair) -> int | None:
    """The side of a square timm (h, w) window or shift (or an int), None when not square."""
    a, b = (pair, pair) if isinstance(pair, int) else tuple(pair)
    return int(a) if a == b else None


def timm_drop_path(m: torch.nn.Module | None) -> bool:
    """Whether m is timm's DropPath (whose draw drop_path_keep repeats)."""
    return type(m).__name__ == "DropPath"


def inactive(m: torch.nn.Module | None, training: bool) -> bool:
    """m(x) is x now: None or nn.Identity, nn.Dropout with p == 0 or in eval, timm's DropPath with
    drop_prob 0 or in eval."""
    if m is None or isinstance(m, torch.nn.Identity):
        return True
    if isinstance(m, torch.nn.Dropout):
        return m.p == 0 or not training
    if timm_drop_path(m):
        return getattr(m, "drop_prob", 1.0) == 0.0 or not training
    return False


def drop_path_keep(m: torch.nn.Module, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The per-sample factors timm's DropPath m would multiply a branch of `shape` (in like's dtype and
    device) by, drawn with timm's own calls (the same random numbers: the same samples dropped for the
    same seed) -> (B,) 0 or 1/keep_prob, or None where m is not an active timm DropPath (nothing drawn)."""
    if not timm_drop_path(m) or inactive(m, m.training):
        return None
    keep_prob = 1.0 - m.drop_prob
    keep = like.new_empty((shape[0],) + (1,) * (len(shape) - 1)).bernoulli_(keep_prob)
    if keep_prob > 0.0 and getattr(m, "scale_by_keep", True):
        keep.div_(keep_prob)
    return keep.view(-1)


def drop_path(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """m(x) for a block's drop path m. timm's DropPath, while active, takes its factors from drop_path_keep
    and multiplies in one Triton pass each way (kernels.drop_path: bit for bit torch's product) instead
    of torch's broadcast multiply. Anything else, or an inactive DropPath, is called as it is."""
    keep = drop_path_keep(m, x, tuple(x.shape))
    if keep is None:
        return m(x)
    from workbench.kernels.drop_path import scale_samples

    return scale_samples(x, keep)


_QKV_INPUT = "_swinbench_input_to_qkv"


def passes_input_to_qkv(forward):
    """Mark a SwinV2 WindowAttention forward that a pass binds as doing nothing with its input but pass it
    to the module's qkv Linear (first, through v2_qkv), as timm's own forward does: the window kernels may
    then write the windows in that Linear's autocast dtype (block_forward.v2_attention_takes_linear_input)."""
    setattr(forward, _QKV_INPUT, True)
    return forward


def input_goes_to_qkv(forward) -> bool:
    """Whether `forward` (a function, or None) was marked by passes_input_to_qkv."""
    return bool(getattr(forward, _QKV_INPUT, False))


_QUANTIZED_ROWS = "_swinbench_hands_quantized_rows_on"


def hands_quantized_rows_on(forward):
    """Mark a forward that a pass binds as reading nothing of its input x but its shape before handing it
    to its first Linear (a v1 WindowAttention's `self.qkv(x.reshape(B*nW*N, C))`, an Mlp's `self.fc1(x)`):
    it then takes a kernels.quant.QuantizedRows in place of x, which that Linear, quantized, reads
    (block_forward.norm1_quantizes_qkv, norm2_quantizes_fc1)."""
    setattr(forward, _QUANTIZED_ROWS, True)
    return forward


def takes_quantized_rows(forward) -> bool:
    """Whether `forward` (a function, or None) was marked by hands_quantized_rows_on."""
    return bool(getattr(forward, _QUANTIZED_ROWS, False))


_QUANTIZED_QKV = "_swinbench_reads_quantized_qkv"


def reads_quantized_qkv(forward):
    """Mark a v1 WindowAttention forward that runs its attention on an e4m3 qkv where its qkv Linear writes
    one (a QuantLinear whose fuse_output gave it an output scale) and hands proj that attention's output
    in e4m3 at proj's static input scale (block_forward._around_the_core)."""
    setattr(forward, _QUANTIZED_QKV, True)
    return forward


def takes_quantized_qkv(forward) -> bool:
    """Whether `forward` (a function, or None) was marked by reads_quantized_qkv."""
    return bool(getattr(forward, _QUANTIZED_QKV, False))


# timm builds SwinV2 two ways, and both score a window the same: normalize(q) . normalize(k) times a per-head
# exp(min(logit_scale, log 100)), plus a position bias from a small MLP, plus the shift mask.
#   swin_transformer_v2     WindowAttention: q and v biases beside the qkv Linear; cpb_mlp over a ((2w-1)^2, 2)
#                           coordinate table, 16 * sigmoid, gathered through relative_position_index
#   swin_transformer_v2_cr  WindowMultiHeadAttention: the qkv Linear's own bias; meta_mlp over the window's
#                           N x N token pairs' log coordinates, in pair order (no sigmoid, no index: the
#                           table of an identity index, which the fused kernels read like any other)
# The helpers below give the passes one view of both.
PAIR_INDEX_BUFFER = "relative_pair_index"   # the identity index a -CR module gets beside its buffers


def swin_stages(model: torch.nn.Module) -> tuple[str, list[torch.nn.Module]]:
    """(attribute, stages) of a timm Swin's stage Sequential: `layers` (v1, v2), `stages` (-CR); ("", [])
    for a model without one."""
    for attr in ("layers", "stages"):
        stages = getattr(model, attr, None)
        if isinstance(stages, torch.nn.Sequential):
            return attr, list(stages)
    return "", []


def feature_map(blk: torch.nn.Module) -> tuple[int, int]:
    """(H, W) of the map a timm Swin block is built for: `input_resolution` (v1, v2), `feat_size` (-CR)."""
    return tuple(getattr(blk, "input_resolution", None) or blk.feat_size)


def v2_attention_classes() -> tuple[type, ...]:
    """timm's two SwinV2 window-attention classes (swin_transformer_v2's, swin_transformer_v2_cr's)."""
    from timm.models.swin_transformer_v2 import WindowAttention
    from timm.models.swin_transformer_v2_cr import WindowMultiHeadAttention

    return WindowAttention, WindowMultiHeadAttention


def v2_block_classes() -> tuple[type, ...]:
    """timm's two SwinV2 block classes, in the order of v2_attention_classes."""
    from timm.models.swin_transformer_v2 import SwinTransformerV2Block
    from timm.models.swin_transformer_v2_cr import SwinTransformerV2CrBlock

    return SwinTransformerV2Block, SwinTransformerV2CrBlock


def is_cr(attn: torch.nn.Module) -> bool:
    """Whether attn is (a subclass of) timm's swin_transformer_v2_cr WindowMultiHeadAttention."""
    return isinstance(attn, v2_attention_classes()[1])


def v2_why_not_class(attn: torch.nn.Module) -> str | None:
    """None for a module of exactly one of timm's SwinV2 attention classes, else why a pass leaves it."""
    classes = v2_attention_classes()
    if type(attn) in classes:
        return None
    return f"a subclass of timm's {next(c for c in classes if isinstance(attn, c)).__name__}"


def v2_terms(attn: torch.nn.Module):
    """(qkv bias or None, logit scale (nH,), position-bias table (rows, nH)) of a timm SwinV2 attention,
    from the weights alone: timm's arithmetic. swin_transformer_v2: the q/k/v biases concatenated (None
    without them) and 16 * sigmoid taken on cpb_mlp's ((2w-1)^2, nH) table before the gather through the
    relative-position index (an elementwise function commutes with it). -CR: None (its qkv Linear holds
    the bias) and meta_mlp's (N*N, nH) output, one row per token pair in order."""
    logit_scale = torch.clamp(attn.logit_scale, max=math.log(1. / 0.01)).exp().reshape(-1)
    if is_cr(attn):
        return None, logit_scale, attn.meta_mlp(attn.relative_coordinates_log)
    qkv_bias = None if attn.q_bias is None else torch.cat((attn.q_bias, attn.k_bias, attn.v_bias))
    table = 16 * torch.sigmoid(attn.cpb_mlp(attn.relative_coords_table).view(-1, attn.num_heads))
    return qkv_bias, logit_scale, table


def v2_term_tensors(attn: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers v2_terms reads."""
    if is_cr(attn):
        return [attn.logit_scale, attn.relative_coordinates_log, *attn.meta_mlp.parameters()]
    return [attn.logit_scale, attn.relative_coords_table, attn.relative_position_index, *attn.cpb_mlp.parameters(),
            *(() if attn.q_bias is None else (attn.q_bias, attn.v_bias))]


def v2_terms_draw(attn: torch.nn.Module) -> bool:
    """Whether v2_terms draws random numbers now: -CR's meta_mlp has a dropout, active in training."""
    mlp = attn.meta_mlp if is_cr(attn) else attn.cpb_mlp
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 and m.training for m in mlp.modules())


def v2_index(attn: torch.nn.Module) -> torch.Tensor:
    """(N, N) rows of v2_terms' table for each query-key pair: timm's relative_position_index, or for -CR
    the identity (row i * N + j), kept as the non-persistent buffer PAIR_INDEX_BUFFER (state_dict does not
    change; it follows the module across devices)."""
    index = getattr(attn, "relative_position_index", None)
    if index is not None:
        return index
    index = getattr(attn, PAIR_INDEX_BUFFER, None)
    n = int(attn.window_size[0]) * int(attn.window_size[1])
    if index is None or index.shape != (n, n) or _made_in_inference(index):
        with torch.inference_mode(False):    # built in a validation forward, it must serve training too
            index = torch.arange(n * n, device=attn.logit_scale.device).view(n, n)
        attn.register_buffer(PAIR_INDEX_BUFFER, index, persistent=False)
    return index


def v2_table_rows(attn: torch.nn.Module) -> int:
    """Rows of v2_terms' table: (2w-1)^2 coordinates for swin_transformer_v2, N*N pairs for -CR."""
    if is_cr(attn):
        return (int(attn.window_size[0]) * int(attn.window_size[1])) ** 2
    coords = attn.relative_coords_table
    return int(coords.shape[1] * coords.shape[2])


def v2_bias(attn: torch.nn.Module, table: torch.Tensor, n: int) -> torch.Tensor:
    """The (nH, n, n) position bias from v2_terms' table, as a PyTorch user writes it: timm's gather for
    swin_transformer_v2, -CR's transpose and reshape."""
    if is_cr(attn):
        return table.t().reshape(-1, n, n)
    return table[attn.relative_position_index.view(-1)].view(n, n, -1).permute(2, 0, 1)


def v2_qkv(attn: torch.nn.Module, x: torch.Tensor, qkv_bias: torch.Tensor | None) -> torch.Tensor:
    """A timm SwinV2 attention's packed qkv of x as timm computes it: the q/k/v biases concatenated
    (qkv_bias, from v2_terms) in the Linear, or added after it with qkv_bias_separate; the Linear alone
    where it holds the bias (qkv_bias None)."""
    if qkv_bias is None:
        return attn.qkv(x)
    if attn.qkv_bias_separate:   # timm's in-place add: in fp32, rounded back to the Linear's output dtype
        qkv = attn.qkv(x)
        qkv += qkv_bias
        return qkv
    return torch.nn.functional.linear(x, attn.qkv.weight, qkv_bias)


def named_swin_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, block) of every timm SwinTransformerBlock in `model`, in module order."""
    from timm.models.swin_transformer import SwinTransformerBlock

    return [(name, m) for name, m in model.named_modules() if isinstance(m, SwinTransformerBlock)]


def swin_blocks(model: torch.nn.Module, ctx: PassContext, kernels: str, what: str) -> list[tuple[str, torch.nn.Module]]:
    """named_swin_blocks(model), after checking that timm and the Triton kernel module `kernels` import
    and that the device runs Triton; PassUnavailable (naming `what`) otherwise, or without Swin blocks of
    timm's three kinds. [] for a model of SwinV2 blocks only (swin_transformer_v2's or -CR's): a pass of
    v1 blocks stands aside (stand_aside_v2) or binds its SwinV2 forms itself (fused_attention, fused_window)."""
    try:
        import timm.models.swin_transformer  # noqa: F401

        importlib.import_module(kernels)
    except ImportError as exc:
        raise PassUnavailable(f"{what} not importable: {exc}") from exc
    require_triton(ctx.device)
    blocks = named_swin_blocks(model)
    if not blocks and not has_v2_blocks(model, cr=True):
        raise PassUnavailable("no timm SwinTransformerBlock or SwinTransformerV2Block in this model")
    return blocks


def has_v2_blocks(model: torch.nn.Module, cr: bool = False) -> bool:
    """Whether `model` holds a timm SwinTransformerV2Block (cr: or a swin_transformer_v2_cr block)."""
    names = ("SwinTransformerV2Block", "SwinTransformerV2CrBlock") if cr else ("SwinTransformerV2Block",)
    return any(type(m).__name__ in names for m in model.modules())


def stand_aside_v2(model: torch.nn.Module, name: str, why: str) -> tuple[torch.nn.Module, PassResult]:
    """(model unchanged, the result of pass `name` standing aside on SwinV2 blocks, `why` in one line)."""
    changed = (f"not applied: SwinV2 blocks (post-norm, cosine attention, position bias from an MLP): {why}")
    return model, PassResult(name, {}, changed, {"applied": False})


def autocast_input_dtype(x: torch.Tensor) -> torch.dtype | None:
    """`kernels.layer_norm.autocast_linear_input_dtype`: the dtype an autocast nn.Linear casts an fp32 x to
    (None: no cast). Every fused norm of the passes looks it up here, through norm_output_dtype."""
    from workbench.kernels.layer_norm import autocast_linear_input_dtype

    return autocast_linear_input_dtype(x)


def norm_output_dtype(x: torch.Tensor, to_linear: bool, dtype: torch.dtype | None = None) -> torch.dtype | None:
    """The dtype a fused LayerNorm over x (or over a tensor on x's device in `dtype`, such as x plus a
    branch) writes: the autocast dtype when its output goes straight into an nn.Linear (autocast_input_dtype:
    the bits that Linear's cast would give), else the dtype torch's layer_norm returns under autocast
    (kernels.layer_norm.autocast_norm_dtype: fp32 under CUDA autocast). None: the input's dtype."""
    if to_linear:
        return autocast_input_dtype(x)
    from workbench.kernels.layer_norm import autocast_norm_dtype

    return autocast_norm_dtype(x, dtype)


_MERGING_FORWARD = "_swinbench_merging_forward"


def merging_forward_of_the_pass(forward):
    """Mark a PatchMerging forward a pass binds as computing the class's (pad, 2x2 gather, norm, reduction)."""
    setattr(forward, _MERGING_FORWARD, True)
    return forward


def merging_norm_goes_to_linear(merging: torch.nn.Module) -> bool:
    """Whether a timm PatchMerging hands its norm's output straight to its `reduction` Linear: its forward
    is the class's (pad, 2x2 gather, norm, reduction), or one a pass bound that computes the same
    (merging_forward_of_the_pass), not replaced elsewhere on the instance."""
    from timm.models.swin_transformer import PatchMerging

    bound = vars(merging).get("forward")
    return (isinstance(merging, PatchMerging) and isinstance(getattr(merging, "reduction", None), torch.nn.Linear)
            and type(merging).forward is PatchMerging.forward
            and (bound is None or getattr(getattr(bound, "__func__", None), _MERGING_FORWARD, False)))


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
    """gather_rel_pos_bias with, as its backward, one deterministic Triton launch when given the index's
    inverse (`kernels.window_attention.rel_pos_inverse`), else scatter_rel_pos_grad (a memset and an
    index_add_): two or three launches per block and step where timm's gather, copy and sorted index_put
    take five or more."""

    @staticmethod
    def forward(ctx, table, index, n, inverse):
        ctx.save_for_backward(index, inverse)
        ctx.table = (table.shape, table.dtype)
        return gather_rel_pos_bias(table, index, n)

    @staticmethod
    def backward(ctx, d_rel):
        index, inverse = ctx.saved_tensors
        if inverse is not None:
            from workbench.kernels.window_attention import rel_pos_table_grad

            return rel_pos_table_grad(d_rel, inverse, ctx.table[1]), None, None, None
        return scatter_rel_pos_grad(d_rel, index, *ctx.table), None, None, None


# The buffer that holds a WindowAttention's relative-position index inverse while the fused kernel runs it
# (block_plan binds and unbinds it), beside timm's relative_position_index.
INVERSE_BUFFER = "relative_position_inverse"


def add_rel_pos_inverse(attn: torch.nn.Module) -> bool:
    """Give a timm WindowAttention its relative-position index's inverse (n_table, P) int32, as the
    non-persistent buffer INVERSE_BUFFER (it follows the module across devices; state_dict does not
    change), for the fused attention's one-launch table gradient. False when the module has no standard
    table and index."""
    table, index = getattr(attn, "relative_position_bias_table", None), getattr(attn, "relative_position_index", None)
    if table is None or index is None or table.dim() != 2:
        return False
    rel_pos_inverse_buffer(attn)
    return True


def rel_pos_inverse_buffer(attn: torch.nn.Module) -> torch.Tensor:
    """A timm WindowAttention's index inverse (rel_pos_inverse_of over its relative_position_index and
    table): what add_rel_pos_inverse registers and the fused forwards read."""
    return rel_pos_inverse_of(attn, attn.relative_position_index, attn.relative_position_bias_table.shape[0])


def _made_in_inference(t: torch.Tensor) -> bool:
    """Whether a buffer was made under torch.inference_mode (a training step cannot save it for backward).
    Not asked while Dynamo traces (it does not take is_inference); the eager forwards before rebuild it."""
    return not torch.compiler.is_compiling() and t.is_inference()


# The window (and table rows) attn's INVERSE_BUFFER was built for, a plain attribute beside it.
INVERSE_KEY = "_swinbench_inverse_of"


def rel_pos_inverse_of(attn: torch.nn.Module, index: torch.Tensor, rows: int) -> torch.Tensor:
    """attn's INVERSE_BUFFER: the inverse of `index` into a table of `rows` rows, registered on first use
    and again when the window has changed since. timm's set_window_size (which set_input_size calls)
    rebuilds the table and the index for the new window but knows nothing of the inverse, so the inverse
    is kept with the window and row count it was built for (a (4, 8) and an (8, 4) window have as many
    rows, and other indices). Built outside inference mode: a first forward in a validation pass under
    torch.inference_mode must not leave an inference tensor that a later training step saves."""
    inverse = getattr(attn, INVERSE_BUFFER, None)
    key = (tuple(int(v) for v in attn.window_size), int(rows))
    if inverse is None or getattr(attn, INVERSE_KEY, None) != key or _made_in_inference(inverse):
        from workbench.kernels.window_attention import rel_pos_inverse

        with torch.inference_mode(False):
            inverse = rel_pos_inverse(index, rows)
        attn.register_buffer(INVERSE_BUFFER, inverse, persistent=False)
        setattr(attn, INVERSE_KEY, key)
    return inverse


def rel_pos_bias(attn: torch.nn.Module, inverse: torch.Tensor | None = None) -> torch.Tensor:
    """A timm WindowAttention's (nH, N, N) relative-position bias through RelPosBias (its backward one launch
    over `inverse`, the index's inverse, where given), or through its own `_get_rel_pos_bias` when a
    subclass computes the bias some other way."""
    from timm.models.swin_transformer import WindowAttention

    if type(attn)._get_rel_pos_bias is WindowAttention._get_rel_pos_bias:
        return RelPosBias.apply(attn.relative_position_bias_table, attn.relative_position_index, attn.window_area,
                                inverse)
    bias = attn._get_rel_pos_bias()
    return bias.reshape(bias.shape[-3:])
