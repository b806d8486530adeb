"""Pass `fused_attention`: run every timm WindowAttention of the Swin blocks through the fused Triton kernel.

Each block's plan (block_plan.py) gets `attention = triton`: its WindowAttention keeps the qkv and proj
Linears as they are and swaps the attention core (q k^T * scale + bias + mask, softmax, @ v) for the fused
kernel (block_forward.attention_forward): the N x N scores never reach global memory, and the
relative-position bias is read from timm's table by the kernels (bias: table) or gathered from it in one
launch (bias: gather), its gradient summed back into the table by one deterministic Triton launch over the
index's inverse. `bias: auto` (the default) takes, per window shape, the form measured faster on this GPU
(with the route below), or without a measurement the table up to 64 tokens a window and the gather above
(the key-tiled path reads a dense bias faster than the table through its index: on an H100, Swin-B 384's
training step 44.1 -> 43.2 ms; at window 7 the two tie). Blocks whose attention has a non-zero attn_drop
run timm's SDPA path instead (the kernel has no dropout; F.scaled_dot_product_attention has) and are
counted; the plan says why.

Route per shape: windows of up to 64 tokens (window 7: 49) run the kernel that holds a window's keys in
one tile; windows of 65 to 256 tokens (window 12: 144) run its key-tiled path (keys in blocks of 64).
Both beat PyTorch's SDPA at their shapes on an H200 (docs/kernels.md has the figures). Windows above
`max_tokens` tokens (default and largest: 256, what the kernels take) run timm's
F.scaled_dot_product_attention path instead, each plan says why, and the pass result counts them;
a smaller `max_tokens` in a recipe moves the line (`max_tokens: 64` keeps window 12 on SDPA).
Within that line the route is measured (`route: auto`, the default; `_route.py`): on a GPU each distinct
window shape of the model is timed on a copy of its attention, the kernel against PyTorch's own path
(SDPA for v1, and for SwinV2 its cosine attention on SDPA as sdpa_attention writes it), at the stage's
batch and precision, and a shape where PyTorch's path is faster by more than 3% runs it instead, so the
kernel is never used where it would lose.
The result records every shape's times and route; `route: kernel` skips the timing.

SwinV2 (timm's swin_transformer_v2): its WindowAttention computes cosine attention,
normalize(q) @ normalize(k)^T * exp(min(logit_scale, log 100)), plus 16 * sigmoid of a bias table that
cpb_mlp computes from the relative coordinates. Each such module of exactly timm's class gets, bound on the
instance (no new parameters; the index's inverse as a non-persistent buffer: state_dict is unchanged),
v2_attention_forward: the same qkv (q/k/v biases), q and k normalized and the per-head logit scale folded
into q (kernels.cosine), 16 * sigmoid taken on cpb_mlp's ((2w-1)^2, nH) table, which the kernels read
through the index as they read v1's table (its gradient summed in one launch, then through autograd to
cpb_mlp), and the fused kernel with scale 1 for scores + bias + mask, softmax and @ v. `bias` has no
effect there (the table is always read in-kernel). Modules with attn_drop > 0, windows above `max_tokens`
(window 24: 576 tokens) or a head width the kernel does not take run sdpa_attention's SwinV2 forward
(PyTorch's SDPA, as the PyTorch-alone peers do), as does a shape measured faster on PyTorch's path; a
subclass or a forward replaced elsewhere keeps timm's own attention; the result counts each by reason.
timm's swin_transformer_v2_cr WindowMultiHeadAttention (swinv2_cr_* models) scores windows the same way
and gets the same forward: its qkv Linear holds the bias, and meta_mlp's (N*N, nH) output over the token
pairs is the table of an identity index (_swin.py's v2_* helpers give the passes one view of both).
The v1 block plans are not used: fused_block stands aside on SwinV2 blocks (post-norm); fused_window
binds the block's _attn, which calls this forward.
"""
from __future__ import annotations

import contextlib
import types

import torch

from workbench.errors import UserError
from workbench.kernels._common import traced
from workbench.optimize.passes import PassContext, PassResult
from workbench.optimize.passes._route import block_shape, measure_routes, route_details
from workbench.optimize.passes._swin import (passes_input_to_qkv, rel_pos_inverse_of, swin_blocks,
                                             v2_attention_classes, v2_block_classes, v2_index, v2_qkv, v2_table_rows,
                                             v2_term_tensors, v2_terms, v2_terms_draw, v2_why_not_class)
from workbench.optimize.passes.block_plan import BIAS_MODES, block_plans

NAME = "fused_attention"
OWN_KERNELS = True   # runs swinbench kernels: a stage with it is not PyTorch alone
ROUTES = ("auto", "kernel")
# parameter -> (type, allowed values)
KERNEL_MAX_TOKENS = 256   # the largest window (tokens) the kernels take (kernels.window_attention.MAX_WINDOW_TOKENS)


def _check_max_tokens(value) -> None:
    if not 1 <= value <= KERNEL_MAX_TOKENS:
        raise UserError(f"pass fused_attention: max_tokens must be a whole number from 1 to {KERNEL_MAX_TOKENS}, "
                        f"got {value}")


BIAS_CHOICES = ("auto", *BIAS_MODES)
GATHER_ABOVE_TOKENS = 64  # bias auto, unmeasured: windows above this many tokens (the key-tiled path) gather
PARAMS = {"bias": (str, BIAS_CHOICES), "max_tokens": (int, _check_max_tokens), "route": (str, ROUTES)}
MAX_TOKENS = KERNEL_MAX_TOKENS   # default: every window the kernels take runs on them


def _reads_timm_table(attn: torch.nn.Module) -> bool:
    """Whether the module's bias is timm's gather from a 2-D table through its index (what the kernels can
    read themselves), not a computation of a subclass's own."""
    from timm.models.swin_transformer import WindowAttention

    table, index = getattr(attn, "relative_position_bias_table", None), getattr(attn, "relative_position_index", None)
    return (table is not None and index is not None and table.dim() == 2
            and type(attn)._get_rel_pos_bias is WindowAttention._get_rel_pos_bias)


def window_tokens(blk: torch.nn.Module) -> int:
    """Tokens per attention window of a timm SwinTransformerBlock as built now."""
    area = getattr(blk.attn, "window_area", None)
    if area is None:
        ws = blk.window_size if isinstance(blk.window_size, (tuple, list)) else (blk.window_size,) * 2
        area = int(ws[0]) * int(ws[1])
    return int(area)


@passes_input_to_qkv
def v2_attention_forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """timm's SwinV2 WindowAttention.forward with the fused kernel for its core: the same qkv (q/k/v biases
    concatenated, or added after the Linear with qkv_bias_separate), cosine scores with the per-head logit
    scale folded into q (each of q and k normalized in one Triton launch: kernels.cosine; in inference
    inside the attention kernel as it loads them: cosine_window_attention), 16 * sigmoid
    of the cpb_mlp table, read by the kernels through the index (autograd carries its gradient to
    cpb_mlp), the (nW, N, N) mask, softmax, @ v in the kernel (scale 1), proj. Without autograd (inference) the terms
    that depend on the weights alone (the qkv bias, the logit scale, the position bias) are computed once
    and kept until a weight changes (`_v2_constants`)."""
    from workbench.kernels.cosine import cosine_qk
    from workbench.kernels.window_attention import cosine_window_attention, fused_window_attention_from_table

    b_, n, c = x.shape
    if n > KERNEL_MAX_TOKENS:                   # a window resized past the kernels after binding: timm's own
        return type(self).forward(self, x, mask)
    qkv_bias, logit_scale, table = _v2_constants(self)
    q, k, v = v2_qkv(self, x, qkv_bias).reshape(b_, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    if not torch.is_grad_enabled():
        # inference: q and k normalized inside the attention kernel as it loads them (the same bits)
        x = cosine_window_attention(q, k, v, table, v2_index(self), logit_scale, mask)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(b_, n, c)))
    # normalize(q) * logit_scale and normalize(k), in v's dtype: one Triton launch per tensor each way
    q, k = cosine_qk(q, k, logit_scale, v.dtype)
    # the kernels read the bias from the (2w-1)^2 x nH table through the index: no (nH, N, N) gather,
    # and the backward sums the table's gradient in one launch
    x = fused_window_attention_from_table(q, k, v, table, v2_index(self), _v2_inverse(self), mask,
                                          scale=1.0).transpose(1, 2).reshape(b_, n, c)
    return self.proj_drop(self.proj(x))


_V2_CACHE = "_swinbench_constants"   # instance attribute (not a buffer: state_dict is unchanged)


def _v2_inverse(attn: torch.nn.Module) -> torch.Tensor:
    """The index's inverse (kernels.window_attention.rel_pos_inverse over _swin.v2_index), kept as the
    non-persistent buffer INVERSE_BUFFER (binding adds it; a copy timed for the route gets it here)."""
    return rel_pos_inverse_of(attn, v2_index(attn), v2_table_rows(attn))


_UNCACHED = [0]   # > 0 inside terms_in_every_call()


@contextlib.contextmanager
def terms_in_every_call():
    """Inside the block, SwinV2's weight terms are computed in every forward, not taken from the cache: for a
    CUDA graph captured once and replayed while the weights change (OptimizedSwin.predict during training),
    which must compute them in the graph rather than bake in the values of its capture."""
    _UNCACHED[0] += 1
    try:
        yield
    finally:
        _UNCACHED[0] -= 1


def _v2_constants(attn: torch.nn.Module):
    """v2_terms, computed once per weights of a frozen model (inference: none of the tensors they read
    requires grad): a forward at batch 1 otherwise spends most of its launches on them. Kept under a key of
    the weights' identities and versions (a load_state_dict changes it), the device and the autocast dtype;
    recomputed where autograd records, while torch.compile traces (it handles them itself), where they
    draw random numbers (-CR's meta_mlp dropout in training mode), inside terms_in_every_call(), and for
    weights that train: a fused optimizer or a replayed graph steps them in place without a new version,
    so an eval between training steps would read the terms of older weights."""
    if torch.is_grad_enabled() or traced() or _UNCACHED[0] or v2_terms_draw(attn):
        return v2_terms(attn)
    tensors = v2_term_tensors(attn)
    if any(t.requires_grad for t in tensors):
        return v2_terms(attn)
    device = attn.logit_scale.device
    key = (tuple((t.data_ptr(), t._version) for t in tensors), str(device),
           torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None)
    kept = vars(attn).get(_V2_CACHE)
    if kept is None or kept[0] != key:
        kept = (key, v2_terms(attn))
        attn.__dict__[_V2_CACHE] = kept
    return kept[1]


def _v1_width_why_not(attn: torch.nn.Module) -> str | None:
    """Why the kernel cannot take this Swin v1 attention's heads (None: it can): their width, timm's head_dim
    (C // heads unless given), must be a power of two from 16 to 128."""
    d = attn.qkv.out_features // (3 * attn.num_heads)
    return None if 16 <= d <= 128 and not d & (d - 1) else f"head width {d}: the kernel takes powers of two from 16 to 128"


def _v1_kernel(table: bool):
    """attn -> its forward on the fused kernel, as binding the pass's plan gives it (for timing a copy)."""
    from workbench.optimize.passes._swin import add_rel_pos_inverse
    from workbench.optimize.passes.block_forward import attention_forward

    def bind(attn: torch.nn.Module):
        inverse = add_rel_pos_inverse(attn)
        return types.MethodType(attention_forward(table and inverse and _reads_timm_table(attn), inverse), attn)
    return bind


def _v2_why_not(attn: torch.nn.Module, max_tokens: int) -> str | None:
    """None when the kernel can run this SwinV2 attention, else why it keeps timm's path."""
    from workbench.optimize.passes.sdpa_attention import bound_here

    why = v2_why_not_class(attn)
    if why:
        return why
    if "forward" in vars(attn) and not bound_here(attn):
        return "its forward was replaced elsewhere"
    tokens = int(attn.window_size[0]) * int(attn.window_size[1])
    if tokens > max_tokens:
        return f"{tokens}-token windows, above max_tokens {max_tokens}"
    if attn.attn_drop.p > 0:
        return "attn_drop > 0: the kernel has no dropout"
    d = attn.qkv.in_features // attn.num_heads
    if not 16 <= d <= 128 or d & (d - 1):
        return f"head width {d}: the kernel takes powers of two from 16 to 128"
    return None


# where a SwinV2 attention the kernel does not run goes
SDPA_MEASURED, SDPA_FALLBACK, TIMM = "sdpa_measured_faster", "sdpa_beyond_kernel", "timm"


def _apply_v2(model: torch.nn.Module, max_tokens: int, faster: set[int] = frozenset()
              ) -> tuple[int, dict[tuple[str, str], int]]:
    """Bind v2_attention_forward to every SwinV2 WindowAttention the kernel can run -> (patched, {(path,
    reason): modules left off the kernel}), path one of SDPA_MEASURED, SDPA_FALLBACK and TIMM. A module this
    pass bound before counts as patched. faster: the ids of the modules whose shape runs faster on PyTorch's
    SDPA (measured): they get
    sdpa_attention's SwinV2 forward, as do the modules the kernel cannot take (window above max_tokens,
    head width, attention dropout) where that forward computes their function."""
    from workbench.optimize.passes.sdpa_attention import bind_v2, v2_why_not

    classes = v2_attention_classes()
    patched, left = 0, {}
    for m in model.modules():
        if not isinstance(m, classes):
            continue
        if getattr(vars(m).get("forward"), "__func__", None) is v2_attention_forward:
            patched += 1
            continue
        reason = _v2_why_not(m, max_tokens)
        path = TIMM
        if reason is None and id(m) in faster:
            bind_v2(m)
            path, reason = SDPA_MEASURED, "measured faster at this shape on this GPU"
        elif reason is not None and v2_why_not(m) is None:
            # the kernel cannot take it (window size, head width, dropout): PyTorch's SDPA form can, and
            # is faster than timm's eager attention (never slower than the PyTorch-alone peers, which run it)
            bind_v2(m)
            path = SDPA_FALLBACK
        if reason is None:
            m.forward = types.MethodType(v2_attention_forward, m)
            _v2_inverse(m)      # the index's inverse, for the kernels' one-launch table gradient
            patched += 1
        else:
            left[path, reason] = left.get((path, reason), 0) + 1
    return patched, left


def apply(model: torch.nn.Module, ctx: PassContext, bias: str = "auto",
          max_tokens: int = MAX_TOKENS, route: str = "auto") -> tuple[torch.nn.Module, PassResult]:
    """Plan the fused attention for every timm SwinTransformerBlock in `model` and bind -> (model, PassResult).

    bias: 'table' has the kernels read timm's relative-position table through its index themselves and
    the backward sum the bias gradient straight into the table (two launches fewer per block than
    'gather'); 'gather' gathers the (nH, N, N) bias from the table in one launch before the kernel; 'auto'
    (default) takes per window shape the one measured faster with the route (route 'auto' on a GPU), else
    'table' up to GATHER_ABOVE_TOKENS tokens a window and 'gather' above. A module with its own bias
    computation (a subclass overriding _get_rel_pos_bias) gets 'gather'. max_tokens: blocks with larger
    windows run timm's SDPA path (the module docstring says why).
    route: 'auto' (default) times the kernel against PyTorch's own attention at each of the model's window
    shapes on the GPU and leaves a shape on PyTorch's path where that is faster (`_route.py`); 'kernel'
    runs the kernel wherever it can without timing."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= KERNEL_MAX_TOKENS:
        raise UserError(f"pass fused_attention: max_tokens must be a whole number from 1 to {KERNEL_MAX_TOKENS} "
                        f"(the kernels' largest window), not {max_tokens!r}")
    if bias not in BIAS_CHOICES:
        raise UserError(f"pass fused_attention: bias must be one of {', '.join(BIAS_CHOICES)}, not {bias!r}")
    if route not in ROUTES:
        raise UserError(f"pass fused_attention: route must be one of {', '.join(ROUTES)}, not {route!r}")
    blocks = swin_blocks(model, ctx, "workbench.kernels.window_attention", "fused window attention kernel")
    if not blocks:  # SwinV2 blocks only
        return model, _v2_result(model, ctx, bias, max_tokens, route)
    plans = block_plans(model)
    patched, skipped_dropout, skipped_width, table_modules, measured_sdpa = 0, 0, 0, 0, 0
    routed: dict[int, int] = {}        # window tokens -> blocks sent to SDPA
    candidates = [(n, b) for n, b in blocks if window_tokens(b) <= max_tokens and b.attn.attn_drop.p == 0
                  and _v1_width_why_not(b.attn) is None]
    forms = ({"table": _v1_kernel(True), "gather": _v1_kernel(False)} if bias == "auto"
             else _v1_kernel(bias == "table"))
    routes = measure_routes(candidates, ctx, ctx.batch, v2=False, kernel_forward=forms) if route == "auto" else {}
    for name, blk in blocks:
        tokens = window_tokens(blk)
        if tokens > max_tokens:
            routed[tokens] = routed.get(tokens, 0) + 1
            plans.update(name, sdpa=True)
            plans.fall_back(name, "attention", f"{tokens} tokens per window, above max_tokens {max_tokens}: "
                                               + ("PyTorch's SDPA runs (the kernels take at most "
                                                  f"{KERNEL_MAX_TOKENS})" if tokens > KERNEL_MAX_TOKENS
                                                  else "PyTorch's SDPA runs, as the recipe asks"))
            continue
        if blk.attn.attn_drop.p > 0:
            skipped_dropout += 1  # the kernel has no attention dropout: timm's SDPA path has
            plans.update(name, sdpa=True)
            plans.fall_back(name, "attention", "attn_drop > 0: the kernel has no dropout; PyTorch's SDPA runs")
            continue
        width = _v1_width_why_not(blk.attn)
        if width:
            skipped_width += 1
            plans.update(name, sdpa=True)
            plans.fall_back(name, "attention", f"{width}; PyTorch's SDPA runs")
            continue
        timed = routes.get(block_shape(blk))
        if timed is not None and timed["route"] == "pytorch":
            measured_sdpa += 1
            plans.update(name, sdpa=True)
            plans.fall_back(name, "attention", f"measured on this GPU: PyTorch's SDPA {timed['pytorch_us']:.0f} us "
                                               f"against the kernel's {timed['kernel_us']:.0f} us at this shape")
            continue
        wanted = bias if bias != "auto" else _auto_bias(tokens, timed)
        table = wanted == "table" and _reads_timm_table(blk.attn)
        plans.update(name, attention="triton", attention_bias="table" if table else "gather")
        if wanted == "table" and not table:
            plans.fall_back(name, "attention_bias", "the module computes its relative-position bias itself")
        patched += 1
        table_modules += bool(table)
    plans.bind(model)
    changed = f"{patched} WindowAttention -> fused Triton window attention (fwd+bwd)"
    if skipped_dropout:
        changed += f"; {skipped_dropout} on timm's SDPA path (attn_drop > 0: the kernel has no dropout)"
    if skipped_width:
        changed += (f"; {skipped_width} on timm's SDPA path (head widths the kernel does not take: powers of two "
                    "from 16 to 128)")
    for tokens, count in sorted(routed.items()):
        changed += f"; {count} with {tokens}-token windows on PyTorch's SDPA (above max_tokens {max_tokens})"
    if measured_sdpa:
        changed += f"; {measured_sdpa} on PyTorch's SDPA, faster at their shapes on this GPU (measured)"
    if table_modules:
        changed += f", {table_modules} reading the bias table in-kernel"
    if patched - table_modules:
        changed += (f", {patched - table_modules} with the bias gathered before the kernel"
                    + (" (measured faster at their shapes)" if bias == "auto" and routes else ""))
    details = {
        "patched_modules": patched,
        "skipped_attn_dropout": skipped_dropout,
        "skipped_head_width": skipped_width,
        "sdpa_routed": sum(routed.values()) + measured_sdpa,
        "sdpa_measured_faster": measured_sdpa,
        "max_tokens": max_tokens,
        "bias": bias,
        **({"bias_rule": ("measured per window shape with the route (each shape's form in routes)" if routes
                          else f"not measured: the table up to {GATHER_ABOVE_TOKENS} tokens a window, the "
                               "gather above")} if bias == "auto" else {}),
        "table_modules": table_modules,
        "gather_modules": patched - table_modules,
        "implementation": " + ".join(
            ["workbench.kernels.window_attention.fused_window_attention_table (Triton)"] * bool(table_modules)
            + ["workbench.kernels.window_attention.fused_window_attention_qkv (Triton)"] * bool(patched - table_modules)
        ) or "none",
        **route_details(routes, ctx, ctx.batch, route),
    }
    return model, PassResult(NAME, _params(bias, max_tokens, route), changed, details)


def _auto_bias(tokens: int, timed: dict | None) -> str:
    """bias 'auto' for one block: its shape's measured form, else the table up to GATHER_ABOVE_TOKENS tokens."""
    if timed is not None and "form" in timed:
        return timed["form"]
    return "gather" if tokens > GATHER_ABOVE_TOKENS else "table"


def _params(bias: str, max_tokens: int, route: str = "auto") -> dict:
    return {**({"bias": bias} if bias != "auto" else {}),
            **({"max_tokens": max_tokens} if max_tokens != MAX_TOKENS else {}),
            **({"route": route} if route != "auto" else {})}


def _v2_result(model: torch.nn.Module, ctx: PassContext, bias: str, max_tokens: int, route: str) -> PassResult:
    """Bind the fused forward to the SwinV2 WindowAttentions of `model` -> the pass's result. The bias is
    cpb_mlp's table, which the kernels read in-kernel whatever `bias` asks.
    With route 'auto' the shapes where PyTorch's SDPA form (sdpa_attention's SwinV2 forward) is faster on
    this GPU run it instead."""
    routes, faster = {}, set()
    if route == "auto":
        v2_blocks = [(n, b) for n, b in model.named_modules() if type(b) in v2_block_classes()
                     and _v2_why_not(b.attn, max_tokens) is None]
        routes = measure_routes(v2_blocks, ctx, ctx.batch, v2=True,
                                kernel_forward=lambda attn: types.MethodType(v2_attention_forward, attn))
        for _, b in v2_blocks:
            timed = routes.get(block_shape(b))
            if timed is not None and timed["route"] == "pytorch":
                faster.add(id(b.attn))
    patched, left = _apply_v2(model, max_tokens, faster)
    changed = (f"{patched} SwinV2 attention modules -> fused Triton window attention (fwd+bwd; cosine scores, "
               "q and k normalized and the logit scale folded into q in one launch each, in inference inside the "
               "kernel, the MLP's position-bias table read in-kernel)")
    said = {SDPA_MEASURED: "on PyTorch's SDPA: {}", SDPA_FALLBACK: "on PyTorch's SDPA, beyond the kernel ({})",
            TIMM: "left on timm's path ({})"}
    for (path, reason), count in sorted(left.items(), key=lambda item: said[item[0][0]].format(item[0][1])):
        changed += f"; {count} " + said[path].format(reason)
    by_path = {p: {r: c for (q, r), c in left.items() if q == p} for p in said}
    details = {"swinv2_patched_modules": patched, "swinv2_sdpa_measured_faster": sum(by_path[SDPA_MEASURED].values()),
               "swinv2_sdpa_beyond_kernel": by_path[SDPA_FALLBACK], "swinv2_left_on_timm": by_path[TIMM],
               "max_tokens": max_tokens,
               "bias": "table (cpb_mlp's, read in-kernel)",
               "implementation": "workbench.kernels.cosine.cosine_qk + "
                                 "workbench.kernels.window_attention.fused_window_attention_from_table (Triton); "
                                 "inference: workbench.kernels.window_attention.cosine_window_attention",
               **route_details(routes, ctx, ctx.batch, route)}
    return PassResult(NAME, _params(bias, max_tokens, route), changed, details)
