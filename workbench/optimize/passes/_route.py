"""The attention route of each window shape, chosen by measurement: the fused kernel, or PyTorch's own path
where that is faster on this GPU.

`fused_attention` (route: auto, its default) asks `measure_routes` before it binds anything. For every
distinct attention shape of the model (tokens per window, heads, head width, windows per image, masked
or not) it builds one copy of a WindowAttention of that shape and times, on the GPU and at the stage's
precision, the module's forward (and backward when training) two ways on the same random input:

    kernel   the fused Triton kernel, as the pass would bind it (bias read from the table in-kernel; for
             SwinV2 its cosine forward, q and k normalized by kernels.cosine)
    pytorch  PyTorch's SDPA, as the `sdpa_attention` peer runs it: timm's own fused_attn path for Swin v1,
             sdpa_attention.v2_sdpa_forward for SwinV2 (timm's eager cosine attention is slower)

Both time the same qkv and proj Linears around the core, so the difference is the attention's own. A
shape runs PyTorch's path only when it is faster by more than ROUTE_MARGIN (so noise cannot flip a tie),
and the pass records every shape's times and route. A pass with several forms of the kernel (Swin v1's
bias read from the table in-kernel, or gathered first) times each form the same way; the kernel's time is
its fastest form's, and a form other than the first is taken only where it is faster than the first by
more than VARIANT_MARGIN. Copies and random inputs only: the model itself is
not run. Without a GPU nothing is timed; every shape keeps the kernel and the record says it was not
measured.
"""
from __future__ import annotations

import copy
import math
import statistics
import types
from dataclasses import dataclass

import torch

from workbench.optimize.passes._swin import feature_map

ROUTE_MARGIN = 0.03            # PyTorch's path must be at least 3% faster to take a shape from the kernel
VARIANT_MARGIN = 0.01          # another form of the kernel must be at least 1% faster than the first
DEFAULT_IMAGES = 32            # images per step the shapes are timed at when the caller does not say
WARMUP, REPEATS = 3, 10        # untimed calls (Triton compiles and autotunes here), then timed ones
GRAPH_CALLS = 8                # calls per captured graph, so one replay is long against its event pair


@dataclass(frozen=True)
class Shape:
    tokens: int
    heads: int
    head_dim: int
    windows: int               # windows per image (padded feature map / window)
    masked: bool

    def key(self) -> str:
        return (f"{self.tokens} tokens x {self.heads} heads x {self.head_dim}, {self.windows} windows/image"
                + (", masked" if self.masked else ""))


def block_shape(blk: torch.nn.Module) -> Shape:
    """The attention shape of a timm Swin block (v1, v2 or v2_cr, whose feature map is its feat_size) as built."""
    attn = blk.attn
    ws = blk.window_size if isinstance(blk.window_size, (tuple, list)) else (blk.window_size,) * 2
    h, w = feature_map(blk)
    windows = math.ceil(h / ws[0]) * math.ceil(w / ws[1])
    shift = blk.shift_size if isinstance(blk.shift_size, (tuple, list)) else (blk.shift_size,) * 2
    return Shape(int(ws[0] * ws[1]), int(attn.num_heads), int(attn.qkv.out_features // 3 // attn.num_heads),
                 int(windows), any(int(s) > 0 for s in shift))


def _mask(blk: torch.nn.Module, shape: Shape, device) -> torch.Tensor | None:
    """The block's shift mask: its buffer, or for a shifted block that builds it per call, one built now from
    the padded map's shape, as the block does in its forward (some timm versions build it from the unpadded
    feature map when given no input, which fails where the windows pad)."""
    mask = getattr(blk, "attn_mask", None)
    if mask is None and shape.masked and hasattr(blk, "get_attn_mask"):
        ws = blk.window_size if isinstance(blk.window_size, (tuple, list)) else (blk.window_size,) * 2
        h, w = feature_map(blk)
        padded = torch.empty((1, math.ceil(h / ws[0]) * ws[0], math.ceil(w / ws[1]) * ws[1], 1), device=device)
        mask = blk.get_attn_mask(padded)
    return None if mask is None else mask.to(device)


def pytorch_forward(attn: torch.nn.Module, v2: bool):
    """PyTorch's SDPA path as the sdpa_attention peer binds it: timm's forward with fused_attn on for v1,
    sdpa_attention.v2_sdpa_forward for v2."""
    if v2:
        from workbench.optimize.passes.sdpa_attention import v2_sdpa_forward

        return types.MethodType(v2_sdpa_forward, attn)
    attn.fused_attn = True
    return types.MethodType(type(attn).forward, attn)


def median_us(call) -> float:
    """Median GPU microseconds of call(), host launch cost excluded: warm-up calls on a side stream, then
    calls captured into one CUDA graph whose replays are timed with CUDA events (optimize.timing's
    cuda_graph_us). The stages these routes serve run graph-replayed or compiled, so the host's cost of
    launching each op eagerly (which on a slow host is larger than a small GEMM) must not decide a route.
    A call that cannot be captured is timed eagerly instead: CUDA events around each call."""
    from workbench.optimize.timing import cuda_graph_us

    try:
        return cuda_graph_us([call], replays=REPEATS, calls=GRAPH_CALLS)[0]
    except Exception:                       # not capturable (a host sync inside): time it as written
        torch.cuda.synchronize()
    times = []
    for i in range(WARMUP + REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        if i >= WARMUP:
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _time(fn, x: torch.Tensor, mask, training: bool, autocast) -> float:
    """Median microseconds of fn(x, mask) (+ backward of its sum when training), CUDA events."""
    def call():
        with autocast:
            out = fn(x, mask)
        if training:
            out.float().sum().backward()
    return median_us(call)


def rank_zero_measures(measure):
    """measure() on this process, or under torchrun on rank 0 only, its result broadcast to every rank (so
    the ranks build the same model)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        shared = [measure() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        return shared[0]
    return measure()


def measure_routes(blocks: list[tuple[str, torch.nn.Module]], ctx, images: int | None, v2: bool,
                   kernel_forward) -> dict[Shape, dict]:
    """{shape: {"kernel_us", "pytorch_us", "route": "kernel" | "pytorch", "blocks": count}} for the blocks'
    distinct shapes, timed on ctx.device at ctx.precision (see the module docstring); {} off a GPU.
    kernel_forward(attn) -> attn's forward as the pass binds it (on a copy, which it may change); or
    {form: such a function} for a kernel with several forms, first the default: then each shape also has
    "<form>_us" for every form and "form", the one its kernel_us is (choose_form)."""
    if ctx.device.type != "cuda" or not blocks:
        return {}
    # data parallel: every rank runs rank 0's routes, so the ranks compute the same function
    return rank_zero_measures(lambda: _measure(blocks, ctx, images or DEFAULT_IMAGES, v2, kernel_forward))


def _measure(blocks, ctx, images: int, v2: bool, kernel_forward) -> dict[Shape, dict]:
    forms = kernel_forward if isinstance(kernel_forward, dict) else {"kernel": kernel_forward}
    by_shape: dict[Shape, list] = {}
    for name, blk in blocks:
        by_shape.setdefault(block_shape(blk), []).append(blk)
    out = {}
    for shape, members in by_shape.items():
        blk = members[0]
        x = torch.randn(images * shape.windows, shape.tokens, blk.attn.qkv.in_features, device=ctx.device,
                        generator=torch.Generator(ctx.device).manual_seed(0), requires_grad=ctx.training)
        mask = _mask(blk, shape, ctx.device)
        figures = {}
        for route, build in (*forms.items(), ("pytorch", lambda a: pytorch_forward(a, v2))):
            attn = copy.deepcopy(blk.attn).to(ctx.device).train(ctx.training)
            if not ctx.training:
                attn.requires_grad_(False)
            with torch.inference_mode(not ctx.training):
                figures[f"{route}_us"] = _time(build(attn), x, mask,
                                               ctx.training, ctx.precision.autocast("cuda"))
            del attn
        if len(forms) > 1:
            form = choose_form({f: figures[f"{f}_us"] for f in forms})
            figures.update(form=form, kernel_us=figures[f"{form}_us"])
        out[shape] = {**figures, "route": choose(figures["kernel_us"], figures["pytorch_us"]), "blocks": len(members)}
    torch.cuda.empty_cache()
    return out


def choose_form(times_us: dict[str, float]) -> str:
    """The kernel form to run: the fastest, where it beats the first form (the default) by more than
    VARIANT_MARGIN; else the first."""
    first = next(iter(times_us))
    fastest = min(times_us, key=times_us.get)
    return fastest if times_us[fastest] < times_us[first] * (1 - VARIANT_MARGIN) else first


def choose(kernel_us: float, pytorch_us: float) -> str:
    """'pytorch' where PyTorch's path is faster than the kernel by more than ROUTE_MARGIN, else 'kernel'."""
    return "pytorch" if pytorch_us < kernel_us * (1 - ROUTE_MARGIN) else "kernel"


def route_details(routes: dict[Shape, dict], ctx, images: int | None, route: str) -> dict:
    """What the pass result records of the routes: the rule and each shape's figures."""
    if route != "auto":
        return {"route": route, "routes_measured": False}
    if not routes:
        return {"route": "auto", "routes_measured": False,
                "routes_note": "not measured: no GPU here; every shape runs the kernel"}
    return {"route": "auto", "routes_measured": True, "route_margin": ROUTE_MARGIN,
            "routes_timed_at": {"images": images or DEFAULT_IMAGES, "precision": ctx.precision.name,
                                "what": "forward + backward" if ctx.training else "forward"},
            "routes": [{"shape": s.key(), "tokens": s.tokens, "heads": s.heads, "head_dim": s.head_dim,
                        "windows_per_image": s.windows, "masked": s.masked, **f} for s, f in routes.items()]}
