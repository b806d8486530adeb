"""A recipe for inference: `optimize_swin_inference` and the `InferenceSwin` it returns; and the CUDA graphs
per batch shape that it and `OptimizedSwin.predict` replay.

    swin = optimize_swin_inference(model, "dense")    # a timm Swin, patched in place for inference
    logits = swin(images)                             # fp32 logits; on a GPU one CUDA graph per batch shape

The recipe's passes are planned for inference, as `swinbench apply --mode infer` runs the same recipe:
master weights keep the GEMM weights in bf16 and drop their fp32 values (no autocast casts, no optimizer),
`fused_linear` runs fc1's GELU in its GEMM's epilogue, and the quantizing recipes (`fp8`, `int8`) are
allowed. The forward runs under the recipe's autocast and torch.inference_mode, through torch.compile
where the recipe compiles. On a GPU each batch shape's first PREDICT_WARMUP_CALLS calls run eagerly
(Triton autotuning, compilation) and the next captures the forward as a CUDA graph, which later calls of
that shape replay; the recipe's `cuda_graph` pass is not needed for that. Past MAX_INFERENCE_GRAPHS shapes
a batch runs eagerly, said once.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from workbench.arguments import require_bool, require_count
from workbench.errors import UserError
from workbench.files import short_repr
from workbench.optimize.passes import PassContext, PassResult, refuse_unpatchable
from workbench.optimize.passes.compile import replays_own_graphs
from workbench.optimize.recipes import Recipe, RecipeUnavailable, apply_chain_passes, resolve_chain
from workbench.precision import resolve_precision

PREDICT_WARMUP_CALLS = 2      # eager forwards of a batch shape before its forward is captured
MAX_INFERENCE_GRAPHS = 4      # batch shapes an InferenceSwin keeps a CUDA graph for


class GraphFallbackWarning(UserWarning):
    """A call that a CUDA-graph recipe ran eagerly instead of replaying its graph (said once per reason)."""


@dataclass
class _Graph:
    graph: Any
    x: torch.Tensor
    logits: torch.Tensor


class PredictGraphs:
    """An inference forward `forward(x) -> logits` replayed as CUDA graphs on `device`, one per batch shape
    and dtype, at most `limit` of them: each shape's first `warmup` calls run eagerly, the next captures
    it (each graph in its own memory pool), and later calls copy their batch into the graph's input and
    replay it. A batch of a shape past the limit runs eagerly and `on_eager(key, text)` is told.
    terms_every_call: SwinV2's weight terms (position bias, logit scale) are computed inside the graph,
    for weights that change between replays (training); otherwise the graph reads the terms cached by the
    eager calls before it (eager calls too: with terms_every_call, `forward` computes the terms itself).
    Call under torch.inference_mode with images checked by check_images; the logits returned by a replay
    are the graph's own buffer, overwritten by its next replay."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor], device: torch.device, *,
                 on_eager: Callable[[str, str], None], terms_every_call: bool, warmup: int = PREDICT_WARMUP_CALLS,
                 limit: int = 1):
        self.forward = forward
        self.device = device
        self.on_eager = on_eager
        self.terms_every_call = terms_every_call
        self.warmup = warmup
        self.limit = limit
        self.graphs: dict[tuple, _Graph] = {}
        self._calls: dict[tuple, int] = {}

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        key = (tuple(images.shape), images.dtype)
        g = self.graphs.get(key)
        if g is None and len(self.graphs) >= self.limit:
            held = ", ".join(f"{shape} {dtype}" for shape, dtype in self.graphs)
            self.on_eager("predict:shape", f"predict ran eagerly: a batch of {key[0]} {key[1]} (the graph"
                                           f"{'s hold' if len(self.graphs) > 1 else ' holds'} {held})")
            return self.forward(self._on_device(images))
        if g is None and self._calls.get(key, 0) < self.warmup:
            self._calls[key] = self._calls.get(key, 0) + 1
            return self.forward(self._on_device(images))
        if g is None:
            g = self.graphs[key] = self._capture(images)
        g.x.copy_(images, non_blocking=True)
        g.graph.replay()
        return g.logits

    def _on_device(self, images: torch.Tensor) -> torch.Tensor:
        return images.to(self.device, non_blocking=True)

    def _capture(self, images: torch.Tensor) -> _Graph:
        """One warm-up forward on a side stream, then the capture on that stream, on the model's device
        (which need not be the current one)."""
        from workbench.optimize.passes.fused_attention import terms_in_every_call

        with torch.cuda.device(self.device):
            x = torch.empty_like(images, device=self.device).copy_(images)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.forward(x)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            terms = terms_in_every_call() if self.terms_every_call else contextlib.nullcontext()
            with terms, torch.cuda.graph(graph, stream=side):
                logits = self.forward(x)
            torch.cuda.current_stream(self.device).wait_stream(side)
        return _Graph(graph, x, logits)


def check_images(images, model: torch.nn.Module, what: str) -> torch.Tensor:
    """`images` as a model takes them: a float tensor (N >= 1, C, H, W) at the model's input size, as fp32
    (an fp16 or fp64 batch converted); UserError (one line) for anything else. what: the call, for the
    message."""
    from workbench.models import input_size

    if not isinstance(images, torch.Tensor) or images.dim() != 4 or not images.is_floating_point():
        raise UserError(f"{what}: images must be a float tensor (N, C, H, W), got {short_repr(images)}")
    try:
        want = tuple(input_size(model))
    except Exception:        # a model whose input size cannot be read: its own forward will say
        want = None
    embed = getattr(model, "patch_embed", None)
    if want is not None and (getattr(embed, "strict_img_size", True) is False or getattr(model, "dynamic_img_size",
                                                                                       False)):
        want = None          # timm takes other sizes here (padded or interpolated): its forward decides
    if images.shape[0] < 1 or (want is not None and tuple(images.shape[1:]) != want):
        raise UserError(f"{what}: images must be (N >= 1, {', '.join(map(str, want or ('C', 'H', 'W')))}), got "
                        f"{tuple(images.shape)}")
    return images if images.dtype == torch.float32 else images.float()


class InferenceSwin:
    """A timm Swin patched by a recipe for inference. Build it with `optimize_swin_inference`.

    model: the patched model (the object given, in eval mode; its weights as the recipe keeps them for
    inference: bf16 GEMM weights under master weights, quantized Linears under fp8/int8). recipe, chain,
    passes: the recipe's name, its chain and every pass's PassResult. notes: what the user should know
    (passes left out, fallbacks; said once each). graphed: whether calls replay CUDA graphs. graphs: the
    batch shapes captured so far. eager_fallbacks: calls that ran eagerly past the graph limit."""

    def __init__(self, model: torch.nn.Module, ctx: PassContext, chain: list[Recipe], passes: list[PassResult],
                 *, graphed: bool, notes: list[str]):
        self.model = model.eval().requires_grad_(False)    # inference: the weights stay as they are
        self.ctx = ctx
        self.chain = chain
        self.recipe = chain[-1].name if chain else "baseline"
        self.passes = passes
        self.notes = list(notes)
        self.device = ctx.device
        self.graphed = graphed
        self.eager_fallbacks = 0
        self._said: set[str] = set()
        ctx.precision.apply_matmul_mode()
        forward = self._forward_eager
        if ctx.compile:
            forward = torch.compile(self._forward_eager, **ctx.compile_options)
        self._forward = forward
        self._graphs = (PredictGraphs(forward, self.device, on_eager=self._fell_back, terms_every_call=False,
                                      limit=MAX_INFERENCE_GRAPHS) if graphed else None)

    def _forward_eager(self, x: torch.Tensor) -> torch.Tensor:
        with self.ctx.precision.autocast(self.device.type):
            return self.model(x)

    def _fell_back(self, key: str, text: str) -> None:
        self.eager_fallbacks += 1
        if key not in self._said:
            self._said.add(key)
            self.notes.append(text)
            warnings.warn(text, GraphFallbackWarning, stacklevel=4)

    @property
    def graphs(self) -> list[tuple[int, ...]]:
        return [shape for shape, _ in self._graphs.graphs] if self._graphs is not None else []

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """Logits (N, classes) fp32 of `images` ((N, 3, H, W) float at the model's input size, on any device),
        a new tensor on the model's device."""
        images = check_images(images, self.model, "InferenceSwin")
        with torch.inference_mode():
            if self._graphs is not None:
                out = self._graphs(images)
            else:
                out = self._forward(images.to(self.device, non_blocking=True))
        # a copy (the output of a graph or of a compiled forward is its own buffer), made outside inference
        # mode: a tensor autograd can use, such as a distillation target
        return out.to(torch.float32, copy=True)

    predict = __call__

    def describe(self) -> str:
        """A few lines: the recipe, its precision, the graphs, what each pass changed, the notes."""
        lines = [f"recipe {self.recipe} ({' -> '.join(r.name for r in self.chain)}) for inference, precision "
                 f"{self.ctx.precision.name}" + (", CUDA graph per batch shape" if self.graphed else ", eager")]
        lines += [f"  {p.name}: {p.changed}" for p in self.passes]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"InferenceSwin(recipe={self.recipe!r}, precision={self.ctx.precision.name!r}, device={self.device})"


def _calibration_from(images, model: torch.nn.Module):
    """A PassContext.calibration over the user's iterable of image batches (or (images, labels) pairs):
    (count, batch) -> its first `count` batches, checked against the model's input size (batch: theirs)."""
    if isinstance(images, torch.Tensor) or not hasattr(images, "__iter__"):
        raise UserError(f"calibration must be an iterable of image batches (a list, a DataLoader), got "
                        f"{short_repr(images)}")

    def take(count: int, batch: int) -> list[torch.Tensor]:
        out = []
        for item in images:
            x = item[0] if isinstance(item, (tuple, list)) else item
            out.append(check_images(x, model, "calibration"))
            if len(out) >= count:
                break
        return out

    return take


def _without_cuda_graph(recipe: Recipe) -> Recipe:
    import dataclasses

    return dataclasses.replace(recipe, passes=[p for p in recipe.passes if p.name != "cuda_graph"])


def optimize_swin_inference(model: torch.nn.Module, recipe: str = "dense", *, graph: bool = True,
                            device: str | torch.device | None = None, batch: int | None = None,
                            calibration=None, allow_unavailable: bool = False) -> InferenceSwin:
    """Patch a timm Swin for a recipe's inference form -> InferenceSwin (call it on images for logits).

    model: a timm Swin (v1, SwinV2 or swinv2_cr), in fp32 with the weights it will keep (load them first:
    the recipe may store them in bf16 or quantize them), patched in place. recipe: a built-in recipe name
    or a recipe YAML path; `dense` is the fastest bf16 form, `fp8` and `int8` quantize the Linears. graph:
    on a GPU, replay the forward as one CUDA graph per batch shape (not where the recipe's torch.compile
    replays its own, reduce-overhead); on the CPU it runs eagerly either way (said in `notes`). device:
    where to run (default: where the model's parameters are). batch: the images per call you will run,
    for the passes that time their choices at the model's shapes on a GPU (fused_attention's route per
    window shape, the quantized GEMMs' selection); default 32. calibration: real images for a recipe that
    calibrates static activation scales (quantize_linear with activations: static): an iterable of image
    batches (N, C, H, W), or of (images, labels) pairs such as a DataLoader's; its first
    `calibration_batches` batches (the recipe's, default 4) are run. Default: synthetic images, whose
    ranges are an untrained model's on noise. allow_unavailable: go on without passes that cannot run
    here (no GPU for the Triton kernels) instead of raising; `notes` lists them.

    The model is left in eval mode with requires_grad off on every parameter (inference takes no
    gradients, and the fused SwinV2 attention then keeps its position-bias terms instead of computing
    them in every call). It is patched for inference only: to train, build a fresh timm model, load the
    weights into it (saved before this call: the recipe may keep them in bf16 or quantized) and give it
    to optimize_swin, rather than turning requires_grad back on.

    A pass that cannot run here raises RecipeUnavailable, a UserError (the model may then be partly
    patched: build it again)."""
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"model must be a torch.nn.Module (a timm Swin), got {short_repr(model)}")
    refuse_unpatchable(model, "optimize_swin_inference")
    require_bool("graph", graph)
    require_count("batch", batch, optional=True)
    # the graphs are this object's own (one per batch shape): a recipe's cuda_graph pass, which captures a
    # training step, is left out
    chain = [_without_cuda_graph(r) for r in resolve_chain(str(recipe))]
    if device is not None:
        from workbench.devices import resolve_device

        dev = resolve_device(str(device), "optimize_swin_inference")
        model.to(dev)
    else:
        param = next(iter(model.parameters()), None)
        dev = param.device if param is not None else torch.device("cpu")
    model.eval()
    ctx = PassContext(device=dev, precision=resolve_precision("fp32"), training=False, batch=batch)
    if calibration is not None:
        ctx.calibration = _calibration_from(calibration, model)
        ctx.calibration_source = "the caller's images"
    model, results = apply_chain_passes(model, ctx, chain, stop_unavailable=not allow_unavailable)
    unavailable = [r for r in results if not r.available]
    if unavailable and not allow_unavailable:
        first = unavailable[0]
        raise RecipeUnavailable(chain[-1].name, f"{first.name} {first.changed}")
    notes = [f"pass {r.name} left out: {r.changed}" for r in unavailable]
    notes += [f"pass {r.name} {r.changed}" for r in results if r.details.get("applied") is False]
    if calibration is not None and not any("calibration" in r.details for r in results):
        notes.append(f"calibration images given, and recipe {chain[-1].name} calibrates nothing (no static "
                     "activation scales): not used")
    graphed = False
    if graph:
        if dev.type != "cuda":
            notes.append(f"no CUDA graphs on the {dev.type.upper()}: every call runs eagerly")
        elif ctx.compile and replays_own_graphs(ctx.compile_options):
            notes.append("the recipe's torch.compile replays its own CUDA graphs (reduce-overhead, max-autotune): "
                         "no graph of ours")
        else:
            graphed = True
    return InferenceSwin(model, ctx, chain, results, graphed=graphed, notes=notes)
