"""Pass `quantize_linear`: the Swin's nn.Linear layers as FP8 or INT8 GEMMs, for inference.

Each nn.Linear (attention qkv and proj, MLP fc1 and fc2, patch merging's reduction, the head) becomes a
`kernels.quant.QuantLinear`: its weight quantized per output channel, once; its input quantized per row
in each forward (activations: dynamic) or per tensor with a scale calibrated on a few batches before
(activations: static; calibration max or percentile), or per row but for each MLP's hidden activation,
fc2's input, which takes a calibrated per-tensor scale (activations: mixed; see below). The route each
layer takes:

    scaled_mm   dtype fp8 on CUDA with compute capability >= 8.9: torch._scaled_mm, e4m3 operands with
                rowwise fp32 scales, bias and bf16 output in its epilogue. K and N must be multiples of 16.
    int_mm      dtype int8 on CUDA: torch._int_mm (int32 accumulation), then both scales and the bias in
                fp32, bf16 out. K and N must be multiples of 8 (fewer than 17 rows are padded to 17).
    triton      either dtype on CUDA: kernels.quant.quant_matmul, the e4m3 or int8 GEMM with both scales
                and the bias in its epilogue, bf16 written once. `gemm: auto` (the default) times it
                against the torch GEMM above per shape and keeps the faster; `gemm: triton` forces it,
                `gemm: torch` leaves it out.
    simulate    `simulate: true`, on any device: the same quantize-dequantize math with an fp32 matmul of
                the dequantized operands (fake quantization). Both GEMMs accumulate exactly, so this
                computes what they compute, up to the order of the sums: the accuracy a GPU route costs,
                measured on the CPU. It applies the GPU routes' shape rules, so the same layers stay wide.
    kept bf16   a layer whose name matches a `keep` pattern (fnmatch, e.g. "*.fc2",
                "layers.*.downsample.reduction"), or whose shape the route cannot take: left as it is.

Which layers a GPU route quantizes (`select`): `auto` (the default) measures. For every distinct GEMM
shape among the layers left (rows at the stage's batch x K -> N), it times on the GPU the layer as the
stage runs it (bf16 under autocast) against its QuantLinear (the input's quantization included), on the
same random input (an MLP's fc2 with its GELU: nn.GELU then the layer, against the fused
gelu_quantize_rows then the GEMM; a qkv or fc1 whose norm's kernel writes its input quantized: the GEMM
alone), and quantizes a shape only where that is faster by more than SELECT_MARGIN: a GEMM
of small K moves as many bytes as it computes, and the input's quantization can cost more than the
narrower operands save. The rows of each layer come from one forward of one image. The record lists
every shape's times and choice; a layer left wide says by how much. `all` quantizes every layer the shape
rules allow. simulate, and the CPU, always take every layer (nothing to time).

On the dense stage (fused_linear), the Linears are quantized as on fmha but for each fused MLP's fc1: its
GELU runs in its bf16 GEMM's epilogue, which a quantized GEMM (bf16 out) would move into a pass of its
own, so fc1 stays bf16 and says so; fc2 then quantizes the GELU's output like any input. A block that runs
as one Function (fused_block) reads every weight itself: the pass is not available there.

Without simulate, a CPU (or an FP8 request on a GPU older than sm_89) raises PassUnavailable: the stage is
reported not available, with one line. Training is refused the same way: the quantized GEMMs have no
backward. The attention's arithmetic stays bf16 (with fp8 mixed its inputs and output may be e4m3:
below). PassResult.details records each layer's route (or why it
was kept), the counts, the implementation (with how activations are quantized: one Triton launch per
Linear on the GPU routes with dynamic activations, `kernels.quant.quantize_rows`) and the calibration.

Where the kernels run, an MLP whose fc2 quantizes its input per row also runs its GELU and that
quantization as one launch (`kernels.quant.gelu_quantize_rows`: one read of fc1's output, the bits of
nn.GELU then quantize_rows but for rare tail values one step apart) instead of a GELU kernel writing bf16 and a quantization kernel reading it.

Where a block's fused window forward writes the qkv input with norm1 (fused_window, as on dense) and
the qkv quantizes dynamically with one launch, norm1's kernel writes that input quantized itself
(`kernels.window.norm_shift_partition_quant`: the norm's output rounded to the autocast dtype, then
quantize_rows's bits, in one pass, with the previous block's residual add where the stage defers it), and
the qkv reads it (`kernels.quant.QuantizedRows`) with no quantization launch of its own; likewise the
merge + add + norm2 kernel for a quantized fc1 (`merge_add_norm_quant`; not on dense, whose fc1 stays bf16).
Eager inference only (under torch.compile Inductor fuses the torch-op quantization into the norm). The
record counts those blocks (`norm1_quantizes_qkv_blocks`, `norm2_quantizes_fc1_blocks`).

activations: mixed quantizes each v1 block's MLP as one pair: fc1 on the Triton GEMM with the GELU (its
tanh form, as dense's cuBLASLt epilogue computes it in inference) and fc2's input quantization in its
epilogue (`kernels.quant.quant_matmul_act`: the (rows, 4C) hidden
activation written once, one byte a value, at fc2's calibrated static scale, where no per-row scale could
be taken: a row spans the GEMM's column tiles), fc2 reading it as it is. The block plan's MLP forward is
then fc1 then fc2 (`mlp_quant`); on dense, fc1 leaves its bf16 GELU epilogue for the quantized one, and
norm2's kernel writes fc1's input quantized. Every other Linear quantizes per row as under dynamic. The
measured selection times each MLP shape as a whole (the stage's MLP against the quantized pair) and keeps
both Linears wide where the pair is not faster. The record counts the pairs (`mlp_pairs`). With fp8,
each v1 block's fused window attention may run on e4m3 from its qkv to its proj (an attention triple):
qkv on the Triton GEMM writes q, k and v at one calibrated per-tensor scale (its output's), the attention
kernel reads them (kernels.window_attention.quantized_window_attention) and writes proj's input at proj's
calibrated static scale, proj reads it as it is. The selection times each attention shape as a whole
(measure_triples) and takes the triple only where it beats both the bf16 attention and that attention
less what quantizing its qkv and proj alone saves. The record counts them (`attention_triples`).

Calibration batches are real images where the caller gives them (PassContext.calibration:
`optimize_swin_inference(..., calibration=...)`, and `apply --mode infer --checkpoint` the training images
of the checkpoint's data), else synthetic (random images from a fixed generator, like the workload's
batch): the activation ranges of an untrained model on noise. The record says which.
"""
from __future__ import annotations

import contextlib
import fnmatch
import math
import types

import torch

from workbench.errors import UserError
from workbench.kernels.quant import MAX_QUANT_COLS, QMAX, QuantLinear, gelu_quantize_rows, kernels_run, make_observer
from workbench.optimize.passes import PassContext, PassResult, PassUnavailable
from workbench.optimize.passes._swin import hands_quantized_rows_on

OWN_KERNELS = True   # its Triton quantize and GEMM kernels: a stage with it is not PyTorch alone
INFERENCE_ONLY = True  # no backward: a training run is refused before any pass of the recipe changes the model
NAME = "quantize_linear"


def _check_keep(value) -> None:
    if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) and p for p in value):
        raise UserError(f"pass {NAME!r}: keep must be a list of module-name patterns (strings), got {value!r}")


def _check_percentile(value) -> None:
    if not (isinstance(value, (int, float)) and 0 < value <= 100 and math.isfinite(value)):
        raise UserError(f"pass {NAME!r}: percentile must be in (0, 100], got {value!r}")


def _check_positive(value) -> None:
    if value < 1:
        raise UserError(f"pass {NAME!r}: calibration batch counts and sizes must be at least 1, got {value!r}")


PARAMS = {
    "dtype": (str, ("fp8", "int8")),
    "activations": (str, ("dynamic", "static", "mixed")),
    "calibration": (str, ("max", "percentile")),
    "percentile": (float, _check_percentile),
    "calibration_batches": (int, _check_positive),
    "calibration_batch": (int, _check_positive),
    "keep": ((list, type(None)), _check_keep),
    "simulate": (bool, None),
    "select": (str, ("auto", "all")),
    "gemm": (str, ("auto", "torch", "triton")),
}
SELECT_MARGIN = 0.03    # a shape is quantized only where its QuantLinear is at least 3% faster than bf16

# the shape rule of each GEMM: K and N multiples of this
ALIGNMENT = {"fp8": 16, "int8": 8}
IMPLEMENTATION = {
    "scaled_mm": "torch._scaled_mm (e4m3, rowwise fp32 scales, bf16 out)",
    "int_mm": "torch._int_mm (int8 -> int32), scales and bias applied after in fp32 (one Triton launch, int8_dequant)",
    "triton": "kernels.quant.quant_matmul (Triton): the e4m3 or int8 GEMM with both scales and the bias in its "
              "epilogue, bf16 written once",
    "simulate": "fake quantization: quantize-dequantize, fp32 F.linear",
}


def gpu_route(dtype: str, device: torch.device) -> str:
    """'scaled_mm' or 'int_mm' where that GEMM runs on `device`; PassUnavailable with the reason otherwise."""
    if device.type != "cuda":
        raise PassUnavailable(f"{dtype} GEMMs need a CUDA GPU (simulate: true runs the same math as fake "
                              "quantization here)")
    major, minor = torch.cuda.get_device_capability(device)
    if dtype == "fp8" and (major, minor) < (8, 9):
        raise PassUnavailable(f"FP8 GEMMs need compute capability 8.9 or newer; this GPU is {major}.{minor}")
    if dtype == "int8" and (major, minor) < (7, 5):
        raise PassUnavailable(f"INT8 GEMMs (torch._int_mm) need compute capability 7.5 or newer; this GPU is "
                              f"{major}.{minor}")
    return "scaled_mm" if dtype == "fp8" else "int_mm"


def activation_quantization(route: str, activations: str, device: torch.device) -> str:
    """How a forward quantizes its Linear inputs (PassResult.details): one Triton launch per Linear
    (`quantize_rows`) on the GPU routes with dynamic activations, torch ops otherwise."""
    if route != "simulate" and activations != "static" and kernels_run(device):
        text = ("one Triton launch per Linear (quantize_rows: amax, scale, round, cast); under torch.compile, "
                "torch ops that Inductor fuses into the producing kernel")
        if activations == "mixed":
            text += "; each paired MLP's fc2 input written quantized by fc1's GEMM epilogue (static scale)"
        return text
    return "torch ops (abs, amax, divide, round, clamp, cast)"


def quantizable_linears(model: torch.nn.Module, swin_only: bool = False) -> list[tuple[str, torch.nn.Linear]]:
    """Every nn.Linear by qualified name, in model order: plain ones and fused_linear's BiasGradLinear
    (which changes only the backward), not another subclass a pass swapped in, and not SwinV2's
    position-bias MLPs. swin_only: those inside a timm Swin block or patch merging layer only (a model of
    the user's that holds a Swin: its own heads and necks stay as they are)."""
    from workbench.kernels.linear import BiasGradLinear

    # SwinV2's position-bias MLPs (cpb_mlp, -CR's meta_mlp) map a small coordinate table, not the tokens:
    # nothing to gain in their GEMMs (inference computes the bias once), and its values would lose bits
    linears = [(n, m) for n, m in model.named_modules() if type(m) in (torch.nn.Linear, BiasGradLinear)
               and not any(part in ("cpb_mlp", "meta_mlp") for part in n.split("."))]
    if not swin_only:
        return linears
    from workbench.models import SWIN_BLOCK_CLASSES

    owners = [n for n, m in model.named_modules() if type(m).__name__ in (*SWIN_BLOCK_CLASSES, "PatchMerging")]
    return [(n, m) for n, m in linears if any(n.startswith(o + ".") for o in owners)]


def unmatched_patterns(model: torch.nn.Module, keep) -> list[str]:
    """The keep patterns that match no Linear of the model by its full qualified name (a pattern for one
    the pass never quantizes, such as a classifier's head.fc under patch_swin, matches all the same)."""
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    return [p for p in keep if not any(fnmatch.fnmatchcase(n, p) for n in names)]


@contextlib.contextmanager
def _swins_of(model: torch.nn.Module, what: str):
    """-> [(swin, its input size (C, H, W))] for each Swin inside `model` (models.swin_roots), in eval mode
    for the block (each module's own mode put back after): random images go through them, so that a model
    of the user's with other inputs, or BatchNorm in train mode, is neither called nor changed.
    PassUnavailable in one line when no Swin there knows its input."""
    from workbench.models import input_size, swin_roots

    roots = swin_roots(model)
    if not roots:
        raise PassUnavailable(f"{what} runs images through the Swin, and no timm Swin with a patch embedding "
                              "that knows its image size is in this model")
    modes = {m: m.training for root in roots for m in root.modules()}
    for root in roots:
        root.eval()
    try:
        yield [(root, input_size(root)) for root in roots]
    finally:
        for module, training in modes.items():
            module.training = training


def _all_seen(names, seen, what: str) -> None:
    missing = [n for n in names if n not in seen]
    if missing:
        raise PassUnavailable(f"{what}: {len(missing)} Linear layer(s) saw no input when images ran through the "
                              f"Swin(s) of this model (e.g. {missing[0]})")


def plan_routes(linears, dtype: str, route: str, keep, wide: dict[str, str] | None = None
                ) -> tuple[dict[str, str], dict[str, str]]:
    """-> (route by layer name for the layers to quantize, reason by layer name for those kept wide).
    wide: {layer: why} for layers another pass runs in a way a quantized GEMM would undo (GELU_FC1)."""
    routes, kept = {}, {}
    align = ALIGNMENT[dtype]
    wide = wide or {}
    for name, linear in linears:
        pattern = next((p for p in keep if fnmatch.fnmatchcase(name, p)), None)
        if pattern is not None:
            kept[name] = f"keep pattern {pattern!r}"
        elif name in wide:
            kept[name] = wide[name]
        elif linear.in_features % align or linear.out_features % align:
            kept[name] = (f"K={linear.in_features}, N={linear.out_features}: {dtype} GEMMs need multiples of "
                          f"{align}")
        else:
            routes[name] = route
    return routes, kept


def nothing_left(kept: dict[str, str]) -> str:
    """The one line for a model with no Linear left to quantize: how many were kept, by kind of reason (the
    reason of each layer stays in the pass's details where one is recorded)."""
    kinds: dict[str, int] = {}
    for why in kept.values():
        if why.startswith("measured faster in bf16"):
            why = "measured faster in bf16 on this GPU"
        elif "GEMMs need multiples of" in why:
            dtype, align = why.split(": ", 1)[1].split(" GEMMs need multiples of ")
            why = f"with K or N not a multiple of {align} ({dtype})"
        elif why.startswith("keep pattern"):
            why = f"by {why}"
        elif why == GELU_FC1:
            why = "fc1 with its GELU in a bf16 GEMM's epilogue (fused_linear)"
        kinds[why] = kinds.get(why, 0) + 1
    return (f"no Linear left to quantize: {len(kept)} kept ("
            + "; ".join(f"{c} {why}" for why, c in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))) + ")")


def layer_rows(model: torch.nn.Module, names: list[str], ctx: PassContext) -> dict[str, int]:
    """{layer: rows of its input per image}: one forward of one random image on ctx.device, in inference."""
    modules, rows = dict(model.named_modules()), {}

    def seen(name):
        def hook(module, args):      # returns None: the input goes on unchanged
            rows.setdefault(name, args[0].numel() // args[0].shape[-1])
        return hook
    handles = [modules[n].register_forward_pre_hook(seen(n)) for n in names]
    try:
        with _swins_of(model, "the measured selection") as swins, torch.inference_mode(), \
                ctx.precision.autocast(ctx.device.type):
            for root, size in swins:
                root(torch.randn(1, *size, device=ctx.device))
    finally:
        for h in handles:
            h.remove()
    _all_seen(names, rows, "the measured selection")
    return rows


def measure_layers(model: torch.nn.Module, routes: dict[str, str], dtype: str, ctx: PassContext,
                   static: bool, candidates: tuple[str, ...] | None = None) -> dict[tuple, dict]:
    """{(rows, K, N, gelu, normed): {"bf16_us", "<route>_us" for each candidate, "quant_us" (the fastest of
    them), "route" (that one), "choice": "quantize" | "bf16", "layers": [names]}} for the distinct GEMM
    shapes among `routes` at the stage's batch (see the module docstring). normed: the layers' input comes
    quantized from their norm's kernel (block_forward.norm_writes_input), so their quantized form is timed
    as its GEMM alone. candidates: the GEMM routes timed per shape (default: each layer's own route)."""
    from workbench.kernels.quant import quantize_rows
    from workbench.optimize.passes._route import DEFAULT_IMAGES, median_us
    from workbench.optimize.passes.block_forward import norm_writes_input

    images = ctx.batch or DEFAULT_IMAGES
    rows = layer_rows(model, list(routes), ctx)
    shapes: dict[tuple, list[str]] = {}
    for name in routes:
        lin = model.get_submodule(name)
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        # an MLP's fc2 whose GELU fuse_mlp_activations would fold into its quantization: timed that way
        gelu = (not static and name.endswith(".fc2") and _gelu_mlp(parent) and kernels_run(ctx.device)
                and lin.in_features <= MAX_QUANT_COLS)
        normed = (not static and kernels_run(ctx.device) and lin.in_features <= MAX_QUANT_COLS
                  and norm_writes_input(model, name))
        shapes.setdefault((rows.get(name, 1) * images, lin.in_features, lin.out_features, gelu, normed),
                          []).append(name)
    out = {}
    gen = torch.Generator(ctx.device).manual_seed(0)
    for (m, k, n, gelu, normed), names in shapes.items():
        lin = model.get_submodule(names[0])
        x = torch.randn(m, k, device=ctx.device, generator=gen)
        timed = {}
        with torch.inference_mode(), ctx.precision.autocast(ctx.device.type):
            x = x.to(torch.bfloat16)
            if gelu:    # nn.GELU then fc2, against one gelu_quantize_rows then fc2's GEMM
                bf16_us = median_us(lambda: lin(torch.nn.functional.gelu(x)))
            else:
                bf16_us = median_us(lambda: lin(x))
            for route in candidates or (routes[names[0]],):
                quant = QuantLinear(lin, dtype, route, torch.tensor(1.0) if static else None).to(ctx.device)
                if gelu:
                    timed[route] = median_us(lambda: quant.forward_quantized(*gelu_quantize_rows(x, dtype),
                                                                             x.shape[:-1], x))
                elif normed:    # the norm's kernel writes the input quantized: the GEMM alone
                    x_q, x_scale = quantize_rows(x, dtype)
                    timed[route] = median_us(lambda: quant.forward_quantized(x_q, x_scale, x.shape[:-1], x))
                    del x_q, x_scale
                else:
                    timed[route] = median_us(lambda: quant(x))
                del quant
        del x
        out[(m, k, n, gelu, normed)] = _choice(bf16_us, timed, names)
    torch.cuda.empty_cache()
    return out


def _choice(bf16_us: float, timed: dict[str, float], layers: list[str]) -> dict:
    """A measured shape's record: its times, the fastest quantized route, and whether that beats bf16 by
    more than SELECT_MARGIN."""
    best = min(timed, key=timed.get)
    choice = "quantize" if timed[best] < bf16_us * (1 - SELECT_MARGIN) else "bf16"
    return {"bf16_us": round(bf16_us, 2), **{f"{r}_us": round(t, 2) for r, t in timed.items()},
            "quant_us": round(timed[best], 2), "route": best, "choice": choice, "layers": layers}


def select_measured(routes: dict[str, str], kept: dict[str, str], measured: dict[tuple, dict], dtype: str) -> int:
    """Move the layers of shapes measured faster in bf16 from routes to kept, and give the others the GEMM
    route measured fastest for their shape (in place) -> how many moved to bf16."""
    moved = 0
    for (m, k, n, gelu, normed), f in measured.items():
        if f["choice"] == "quantize" and "route" in f:
            for name in f["layers"]:
                routes[name] = f["route"]
        if f["choice"] == "bf16":
            for name in f["layers"]:
                routes.pop(name, None)
                what = " (the MLP, fc1 + GELU + fc2)" if gelu == "mlp" else " after its GELU" if gelu else ""
                kept[name] = (f"measured faster in bf16 at {m}x{k} -> {n}{what}"
                              f"{' (its input quantized by its norm)' if normed else ''}: "
                              f"{f['bf16_us']:.1f} us against {f['quant_us']:.1f} us for {dtype}")
                moved += 1
    return moved


def synthetic_calibration_batches(model: torch.nn.Module, count: int, batch: int, device: torch.device):
    """For each Swin inside `model` (models.swin_roots), `count` synthetic batches (batch, C, H, W) fp32 of its
    input size, from a fixed generator (not the workload's own) -> one list per Swin."""
    gen = torch.Generator().manual_seed(20_27)
    with _swins_of(model, "static calibration") as swins:
        return [[torch.randn(batch, *size, generator=gen).to(device) for _ in range(count)] for _, size in swins]


def calibration_images(model: torch.nn.Module, ctx: PassContext, count: int, batch: int):
    """-> (one list of batches per Swin inside `model`, where they come from): the caller's real images
    (ctx.calibration) where the model holds one Swin, else synthetic_calibration_batches."""
    if ctx.calibration is not None:
        with _swins_of(model, "static calibration") as swins:
            if len(swins) == 1:
                images = [torch.as_tensor(x).to(ctx.device, torch.float32) for x in ctx.calibration(count, batch)]
                want = tuple(swins[0][1])
                bad = next((tuple(x.shape) for x in images if x.dim() != 4 or tuple(x.shape[1:]) != want), None)
                if not images or bad is not None:
                    raise UserError(f"static calibration: images must be batches (N, {', '.join(map(str, want))}), "
                                    f"got {bad if bad is not None else 'none'}")
                return [images], ctx.calibration_source or "the caller's images"
    return synthetic_calibration_batches(model, count, batch, ctx.device), "synthetic"


def calibrate_scales(model: torch.nn.Module, names, batches, ctx: PassContext, dtype: str,
                     method: str = "percentile", percentile: float = 99.99,
                     outputs=()) -> dict[str, torch.Tensor]:
    """The per-tensor input scale of each Linear in `names`, from the forwards of the Swins inside `model` over
    `batches` (synthetic_calibration_batches: one list per Swin) under the stage's precision (inference
    mode): -> {name: () fp32 scale}; and for each Linear in `outputs`, its output's, keyed name + OUTPUT.
    ValueError for an inf/NaN input."""
    modules = dict(model.named_modules())
    observers = {**{n: make_observer(method, percentile) for n in names},
                 **{n + OUTPUT: make_observer(method, percentile) for n in outputs}}
    seen: set[str] = set()

    def observe(name):
        def hook(module, args, out=None):
            seen.add(name)
            observers[name].observe(args[0] if out is None else out)
        return hook
    handles = [modules[n].register_forward_pre_hook(observe(n)) for n in names]
    handles += [modules[n].register_forward_hook(observe(n + OUTPUT)) for n in outputs]
    try:
        with _swins_of(model, "static calibration") as swins, torch.inference_mode(), \
                ctx.precision.autocast(ctx.device.type):
            for (root, _), xs in zip(swins, batches):
                for x in xs:
                    root(x)
    finally:
        for h in handles:
            h.remove()
    _all_seen(list(observers), seen, "static calibration")
    return {n: obs.scale(dtype) for n, obs in observers.items()}


OUTPUT = ":output"      # calibrate_scales' key suffix for a Linear's output scale


def call_v2_qkv_as_a_module(model: torch.nn.Module, names) -> dict[str, torch.nn.Module]:
    """Make each timm SwinV2 attention whose qkv Linear is among `names` and which adds its q/v biases inside
    F.linear(x, qkv.weight, bias) (timm's default) add them after the Linear instead (timm's own switch,
    qkv_bias_separate): a QuantLinear holds no float weight, and the Linear's forward hooks (its rows for
    the measured selection, calibration) see its input only when it is called as a module. The same
    function up to one more rounding (the biases added to the layer's bf16 output) -> {qkv name: its
    attention} for those switched (set qkv_bias_separate back on those whose qkv stays wide)."""
    from timm.models.swin_transformer_v2 import WindowAttention

    switched = {}
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if (attr == "qkv" and isinstance(parent, WindowAttention) and parent.q_bias is not None
                and not parent.qkv_bias_separate):
            parent.qkv_bias_separate = True
            switched[name] = parent
    return switched


def quantize_model(model: torch.nn.Module, routes: dict[str, str], dtype: str,
                   input_scales: dict[str, torch.Tensor] | None = None) -> None:
    """Replace each Linear named in `routes` by a QuantLinear on that route (in place); static input scales
    by name where given, dynamic per-row scaling otherwise."""
    for name, route in routes.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, attr)
        scale = None if input_scales is None else input_scales.get(name)
        # QuantLinear keeps no float weight: the inference_mode tensors it builds need no autograd
        with torch.no_grad():
            setattr(parent, attr, QuantLinear(linear, dtype, route, scale))


@hands_quantized_rows_on
def gelu_quant_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """A timm Mlp whose fc2 is a QuantLinear: fc1, then GELU and fc2's input quantization in one launch
    (gelu_quantize_rows), then fc2's GEMM; timm's own order (act, drop1, norm, fc2) in training, under
    torch.compile (whose torch-op quantization Inductor fuses into the GELU itself) and where the kernels
    do not run."""
    h = self.fc1(x)
    fc2 = self.fc2
    if self.training or not fc2.fused_quantize(h.device):
        return self.drop2(fc2(self.norm(self.drop1(self.act(h)))))
    x_q, x_scale = gelu_quantize_rows(h.reshape(-1, h.shape[-1]), fc2.fmt)
    return self.drop2(fc2.forward_quantized(x_q, x_scale, h.shape[:-1], h))


def fuse_mlp_activations(model: torch.nn.Module, device: torch.device) -> int:
    """Bind gelu_quant_mlp_forward to every timm Mlp it computes exactly: fc2 a QuantLinear on a GEMM
    route with dynamic activations that fit one block, act an exact-erf nn.GELU, norm an Identity, and
    its forward timm's own -> how many. Nothing where the kernels do not run on `device`."""
    if not kernels_run(device):
        return 0
    count = 0
    for mlp in model.modules():
        fc2 = getattr(mlp, "fc2", None)
        if (_gelu_mlp(mlp) and isinstance(fc2, QuantLinear) and fc2.route != "simulate"
                and fc2.input_scale is None and fc2.in_features <= MAX_QUANT_COLS):
            mlp.forward = types.MethodType(gelu_quant_mlp_forward, mlp)
            count += 1
    return count


def _gelu_mlp(mlp: torch.nn.Module) -> bool:
    """A timm Mlp running timm's own forward with an exact-erf GELU (torch's or timm's, which SwinV2 builds)
    and no norm between act and fc2."""
    from workbench.optimize.passes.fused_linear import exact_gelu

    return (type(mlp).__name__ == "Mlp" and "forward" not in vars(mlp) and exact_gelu(getattr(mlp, "act", None))
            and isinstance(getattr(mlp, "norm", None), torch.nn.Identity))


def mlp_pairs(model: torch.nn.Module) -> dict[str, tuple[str, str]]:
    """{block: (fc1, fc2)} by qualified name for the v1 Swin blocks whose MLP can run as a quantized pair,
    fc1's GELU and fc2's input quantization in fc1's epilogue (activations: mixed): timm's Mlp with an
    exact-erf GELU and no hidden norm, its forward timm's or its block plan's (fused_linear's mlp_gelu)."""
    from timm.models.swin_transformer import SwinTransformerBlock

    from workbench.optimize.passes._swin import named_swin_blocks
    from workbench.optimize.passes.block_plan import block_plans
    from workbench.optimize.passes.fused_linear import exact_gelu

    plans = block_plans(model)
    pairs = {}
    for name, blk in named_swin_blocks(model):
        mlp = getattr(blk, "mlp", None)
        if (type(blk) is SwinTransformerBlock and type(mlp).__name__ == "Mlp" and exact_gelu(getattr(mlp, "act", None))
                and isinstance(getattr(mlp, "norm", None), torch.nn.Identity)
                and ("forward" not in vars(mlp) or plans.plan(name).mlp_gelu or plans.plan(name).mlp_quant)):
            pairs[name] = (f"{name}.mlp.fc1", f"{name}.mlp.fc2")
    return pairs


def measure_pairs(model: torch.nn.Module, pairs: dict[str, tuple[str, str]], dtype: str, ctx: PassContext,
                  candidates: tuple[str, ...]) -> dict[tuple, dict]:
    """{(rows, C, hidden, "mlp", normed): {"bf16_us", "<route>_us", "quant_us", "route", "choice", "layers"}}
    for the distinct MLP shapes among `pairs` at the stage's batch: the MLP as the stage runs it (bf16)
    against fc1 on the Triton GEMM with GELU and fc2's input quantization in its epilogue, then fc2 on each
    candidate route (normed: fc1's input comes quantized from its norm's kernel, so the pair is timed from
    a quantized input). `route` is fc2's; `layers` both Linears of each MLP."""
    from workbench.kernels.quant import QuantizedRows, quantize_rows
    from workbench.optimize.passes._route import DEFAULT_IMAGES, median_us
    from workbench.optimize.passes.block_forward import mlp_forward_quantized_whole, norm_writes_input
    from workbench.optimize.passes.fused_linear import KERNEL_MARGIN, mlp_kernel_applies

    images = ctx.batch or DEFAULT_IMAGES
    rows = layer_rows(model, [fc2 for _, fc2 in pairs.values()], ctx)    # fc1's rows (dense calls no fc1 module)
    shapes: dict[tuple, list[str]] = {}
    for block, (fc1, fc2) in pairs.items():
        lin = model.get_submodule(fc1)
        # the pair's MLP forward (mlp_quant) hands its input to fc1: norm2's kernel writes it where bound to
        normed = lin.in_features <= MAX_QUANT_COLS and norm_writes_input(model, fc1, handed_on=True)
        shapes.setdefault((rows[fc2] * images, lin.in_features, lin.out_features, "mlp", normed), []).append(block)
    out = {}
    gen = torch.Generator(ctx.device).manual_seed(0)
    for key, blocks in shapes.items():
        m, k, _, _, normed = key
        mlp = model.get_submodule(f"{blocks[0]}.mlp")
        x = torch.randn(m, k, device=ctx.device, generator=gen)
        timed = {}
        with torch.inference_mode(), ctx.precision.autocast(ctx.device.type):
            x = x.to(torch.bfloat16)
            bf16_us = median_us(lambda: mlp(x))
            q1 = QuantLinear(mlp.fc1, dtype, "triton").to(ctx.device)    # the same fc1 for every fc2 route
            q1.fuse_output(True, torch.tensor(1.0))
            x_q, x_scale = quantize_rows(x, dtype) if normed else (None, None)
            for route in candidates:
                q2 = QuantLinear(mlp.fc2, dtype, route, torch.tensor(1.0)).to(ctx.device)
                if normed:
                    timed[route] = median_us(lambda: q2(q1.forward_quantized(x_q, x_scale, x.shape[:-1], x)))
                else:
                    timed[route] = median_us(lambda: q2(q1(x)))
                del q2
            kernel_us = None
            if dtype == "fp8" and "triton" in candidates and mlp_kernel_applies(mlp):
                q2 = QuantLinear(mlp.fc2, dtype, "triton", torch.tensor(1.0)).to(ctx.device)
                whole = _with_children(mlp, fc1=q1, fc2=q2)
                x_in = QuantizedRows(x_q, x_scale, x.shape, x.dtype) if normed else x
                try:
                    kernel_us = median_us(lambda: mlp_forward_quantized_whole(whole, x_in))
                except Exception:  # noqa: BLE001  (a GPU or Triton the kernel fails on: the pair's GEMMs)
                    kernel_us = None
                del q2, whole, x_in
            del q1, x_q, x_scale
        del x
        out[key] = _choice(bf16_us, timed, [n for b in blocks for n in pairs[b]])
        if kernel_us is not None:
            record = out[key]
            record["kernel_us"] = round(kernel_us, 2)
            record["mlp_kernel"] = kernel_us < record["quant_us"] * (1 - KERNEL_MARGIN)
            if record["mlp_kernel"]:
                record["choice"] = "quantize" if kernel_us < bf16_us * (1 - SELECT_MARGIN) else "bf16"
    torch.cuda.empty_cache()
    return out


def suspend_bf16_mlp_kernels(model: torch.nn.Module) -> dict[str, list[str]]:
    """Take fused_linear's one-kernel forms off every block that runs them: the bf16 one-kernel MLP
    (mlp_kernel) and the qkv Linear inside the attention kernel (qkv_kernel). Those kernels read the float
    weights themselves, past the modules' hooks: the measured selection and the calibration see the
    Linears' inputs only with the modules called. -> {"mlp": names, "qkv": names}, for
    restore_bf16_mlp_kernels."""
    from workbench.optimize.passes.block_plan import PLANS_ATTRIBUTE

    plans = vars(model).get(PLANS_ATTRIBUTE)
    if plans is None:
        return {"mlp": [], "qkv": []}
    names = {"mlp": [n for n, p in plans.plans.items() if p.mlp_kernel and not p.mlp_quant],
             "qkv": [n for n, p in plans.plans.items() if p.qkv_kernel]}
    for name in names["mlp"]:
        plans.update(name, mlp_kernel=False)
    for name in names["qkv"]:
        plans.update(name, qkv_kernel=False)
    if names["mlp"] or names["qkv"]:
        plans.bind(model)
    return names


def restore_bf16_mlp_kernels(model: torch.nn.Module, names: dict[str, list[str]]) -> int:
    """Give the one-kernel forms back (suspend_bf16_mlp_kernels) to the blocks whose Linears they read this
    pass left float: the MLP kernel where fc1 and fc2 are, the qkv kernel where qkv is -> how many MLP
    kernels came back."""
    from workbench.optimize.passes.block_plan import PLANS_ATTRIBUTE

    plans = vars(model).get(PLANS_ATTRIBUTE)
    floats = lambda n, fcs: not any(isinstance(model.get_submodule(f"{n}.{fc}"), QuantLinear)  # noqa: E731
                                    for fc in fcs)
    mlps = [n for n in names["mlp"] if floats(n, ("mlp.fc1", "mlp.fc2"))]
    qkvs = [n for n in names["qkv"] if floats(n, ("attn.qkv",))]
    for name in mlps:
        plans.update(name, mlp_kernel=True)
    for name in qkvs:
        plans.update(name, qkv_kernel=True)
    if mlps or qkvs:
        plans.bind(model)
    return len(mlps)


def fuse_pairs(model: torch.nn.Module, pairs: dict[str, tuple[str, str]], kernel_blocks=frozenset()) -> int:
    """Make each quantized MLP pair run as one: fc1 applies the GELU and writes fc2's input quantized at fc2's
    static scale (QuantLinear.fuse_output), its block plan's MLP forward fc1 then fc2 (mlp_quant), or, for the
    blocks in `kernel_blocks`, both in one kernel (mlp_kernel: kernels.mlp.quantized_mlp) -> how many."""
    from workbench.optimize.passes.block_plan import block_plans

    plans = block_plans(model)
    count = 0
    for block, (fc1, fc2) in pairs.items():
        q1, q2 = model.get_submodule(fc1), model.get_submodule(fc2)
        if isinstance(q1, QuantLinear) and isinstance(q2, QuantLinear) and q2.input_scale is not None:
            q1.fuse_output(True, q2.input_scale)
            plans.update(block, mlp_quant=True, mlp_kernel=block in kernel_blocks)
            count += 1
    if count:
        plans.bind(model)
    return count


def attention_triples(model: torch.nn.Module, dtype: str) -> dict[str, tuple[str, str]]:
    """{block: (qkv, proj)} by qualified name for the v1 Swin blocks whose attention can run on e4m3 from qkv to
    proj (activations: mixed, fp8): a forward that reads a quantized qkv (block_forward's fused window
    attention, reads_quantized_qkv). int8 keeps the attention wide: one per-tensor int8 scale for q, k and v
    together would cost too much of their range."""
    from timm.models.swin_transformer import SwinTransformerBlock

    from workbench.optimize.passes._swin import named_swin_blocks, takes_quantized_qkv

    if dtype != "fp8":
        return {}
    return {name: (f"{name}.attn.qkv", f"{name}.attn.proj") for name, blk in named_swin_blocks(model)
            if type(blk) is SwinTransformerBlock
            and takes_quantized_qkv(getattr(vars(blk.attn).get("forward"), "__func__", None))}


def _with_children(module: torch.nn.Module, **children: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of `module` with the named child modules swapped (the original keeps its own): the
    same parameters and buffers, for timing a variant of one layer without rebuilding it."""
    import copy

    clone = copy.copy(module)
    clone._modules = {**module._modules, **children}
    return clone


def measure_triples(model: torch.nn.Module, triples: dict[str, tuple[str, str]], ctx: PassContext,
                    candidates: tuple[str, ...], singles: dict[tuple, dict]) -> dict[tuple, dict]:
    """{(rows, C, N, "attn", normed): {"bf16_us", "singles_us", "<route>_us", "quant_us", "route", "choice",
    "layers"}} for the distinct attention shapes among `triples` at the stage's batch (timed on a shifted
    block's, with its mask, where the shape has one): the attention module as the stage would run it (bf16_us:
    bf16 Linears; singles_us: that, less what the measured selection of its qkv and proj alone saves, from
    `singles`, measure_layers' records) against qkv on the Triton GEMM writing e4m3 at a static scale, the
    attention on e4m3 (quantized_window_attention) and proj reading it on each candidate route (normed: qkv's
    input comes quantized from norm1's kernel). The triple is chosen where it beats both by SELECT_MARGIN; where
    its kernels fail to run on this GPU the shape stays off the triple and its record keeps the error."""
    from workbench.kernels.quant import QuantizedRows, quantize_rows
    from workbench.optimize.passes._route import DEFAULT_IMAGES, median_us
    from workbench.optimize.passes._swin import named_swin_blocks, square
    from workbench.optimize.passes.block_forward import norm_writes_input

    images = ctx.batch or DEFAULT_IMAGES
    blocks = dict(named_swin_blocks(model))
    rows = layer_rows(model, [qkv for qkv, _ in triples.values()], ctx)
    saved = {}      # what the singles' selection saves per layer (us)
    for record in singles.values():
        for name in record["layers"]:
            saved[name] = record["bf16_us"] - record["quant_us"] if record["choice"] == "quantize" else 0.0
    shapes: dict[tuple, list[str]] = {}
    for block, (qkv, proj) in triples.items():
        lin, blk = model.get_submodule(qkv), blocks[block]
        normed = lin.in_features <= MAX_QUANT_COLS and norm_writes_input(model, qkv)
        shapes.setdefault((rows[qkv] * images, lin.in_features, square(blk.window_size), normed), []).append(block)
    out = {}
    gen = torch.Generator(ctx.device).manual_seed(0)
    for (m, c, _, normed), names in shapes.items():
        # a shifted block's where the shape has one (its mask costs the kernels a little more)
        blk = next((blocks[b] for b in names if getattr(blocks[b], "attn_mask", None) is not None), blocks[names[0]])
        attn, mask = blk.attn, getattr(blk, "attn_mask", None)
        forward = vars(attn)["forward"].__func__
        n_tok = square(blk.window_size) ** 2
        x = torch.randn(m // n_tok, n_tok, c, device=ctx.device, generator=gen)
        timed = {}
        with torch.inference_mode(), ctx.precision.autocast(ctx.device.type):
            x = x.to(torch.bfloat16)
            bf16_us = median_us(lambda: forward(attn, x, mask))
            error = None
            try:
                qkv = QuantLinear(attn.qkv, "fp8", "triton").to(ctx.device)
                qkv.fuse_output(False, torch.tensor(1.0))
                x_in = QuantizedRows(*quantize_rows(x.reshape(-1, c), "fp8"), x.shape, x.dtype) if normed else x
                for route in candidates:
                    clone = _with_children(attn, qkv=qkv, proj=QuantLinear(attn.proj, "fp8", route,
                                                                           torch.tensor(1.0)).to(ctx.device))
                    timed[route] = median_us(lambda: forward(clone, x_in, mask))
                    del clone
            except Exception as e:  # noqa: BLE001  (a GPU or Triton the e4m3 kernels fail on: the record says so)
                error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        del x
        layers = [n for b in names for n in triples[b]]
        singles_us = bf16_us - saved.get(triples[names[0]][0], 0.0) - saved.get(triples[names[0]][1], 0.0)
        if error is None:
            record = _choice(min(bf16_us, singles_us), timed, layers)
        else:
            record = {"choice": "bf16", "error": error, "layers": layers}
        record.update(bf16_us=round(bf16_us, 2), singles_us=round(singles_us, 2))
        out[(m, c, n_tok, "attn", normed)] = record
    torch.cuda.empty_cache()
    return out


def fuse_triples(model: torch.nn.Module, triples: dict[str, tuple[str, str]], scales: dict[str, torch.Tensor]) -> int:
    """Make each quantized attention triple run on e4m3: qkv writes its output quantized at its calibrated
    scale (QuantLinear.fuse_output), which the attention forward (reads_quantized_qkv) runs on, handing proj
    its input at proj's static scale -> how many."""
    count = 0
    for qkv, proj in triples.values():
        q1, q2 = model.get_submodule(qkv), model.get_submodule(proj)
        if isinstance(q1, QuantLinear) and isinstance(q2, QuantLinear) and q2.input_scale is not None:
            q1.fuse_output(False, scales[qkv + OUTPUT])
            count += 1
    return count


def check_params(params: dict) -> None:
    """What the parameters must be together (recipes.py checks it when a recipe is loaded): the calibration
    settings act on static activations only, the GEMM choices on real quantized GEMMs only (`simulate`
    runs none); given otherwise they would be dropped without a word."""
    if params.get("activations", "dynamic") == "dynamic":
        given = [k for k in ("calibration", "percentile", "calibration_batches", "calibration_batch") if k in params]
        if given:
            raise UserError(f"pass {NAME!r}: {', '.join(given)} set{'s' if len(given) == 1 else ''} the calibration of "
                            "static activations: give activations: static or mixed, or leave "
                            f"{'it' if len(given) == 1 else 'them'} out (dynamic scales are taken per row as it runs)")
    if params.get("calibration", "percentile") != "percentile" and "percentile" in params:
        raise UserError(f"pass {NAME!r}: percentile goes with calibration: percentile")
    if params.get("simulate"):
        given = [k for k in ("gemm", "select") if k in params]
        if given:
            raise UserError(f"pass {NAME!r}: {' and '.join(given)} choose{'s' if len(given) == 1 else ''} among the "
                            "real quantized GEMMs; simulate: true runs none (it rounds in bf16)")


GELU_FC1 = ("fc1 + GELU run as one bf16 GEMM with the GELU in its epilogue (fused_linear): a quantized fc1 "
            "would write its output and run the GELU as a pass of its own")


def _whole_blocks(model: torch.nn.Module) -> list[str]:
    """Blocks that run as one Function reading the Linear weights itself (fused_block)."""
    from workbench.optimize.passes.block_plan import PLANS_ATTRIBUTE

    plans = vars(model).get(PLANS_ATTRIBUTE)
    return [] if plans is None else [n for n, p in plans.plans.items() if p.whole_block]


def gelu_fused_fc1(model: torch.nn.Module) -> list[str]:
    """The fc1 Linears whose MLP forward runs fc1 and its GELU as one (fused_linear: a v1 block plan's
    mlp_gelu, a SwinV2 MLP's bound forward): that forward reads fc1's weight itself."""
    from workbench.optimize.passes.block_plan import PLANS_ATTRIBUTE
    from workbench.optimize.passes.fused_linear import v2_mlp_bound

    plans = vars(model).get(PLANS_ATTRIBUTE)
    planned = [] if plans is None else [f"{n}.mlp.fc1" for n, p in plans.plans.items() if p.mlp_gelu]
    return planned + [f"{n}.fc1" for n, m in model.named_modules() if type(m).__name__ == "Mlp" and v2_mlp_bound(m)]


def apply(model: torch.nn.Module, ctx: PassContext, dtype: str = "fp8", activations: str = "dynamic",
          calibration: str = "percentile", percentile: float = 99.99, calibration_batches: int = 4,
          calibration_batch: int = 8, keep: list | None = None, simulate: bool = False, select: str = "auto",
          gemm: str = "auto"):
    for key, value in (("dtype", dtype), ("activations", activations), ("calibration", calibration),
                       ("select", select), ("gemm", gemm)):
        if value not in PARAMS[key][1]:
            raise UserError(f"pass {NAME!r}: {key} must be one of {', '.join(PARAMS[key][1])}, got {value!r}")
    keep = [] if keep is None else keep
    _check_keep(keep)
    _check_percentile(percentile)
    _check_positive(calibration_batches)
    _check_positive(calibration_batch)
    if ctx.training:
        raise PassUnavailable("quantized GEMMs are inference only (no backward): run with --mode infer")
    route = "simulate" if simulate else gpu_route(dtype, ctx.device)
    candidates = (route,)
    if route != "simulate" and gemm != "torch":
        candidates = ("triton",) if gemm == "triton" else (route, "triton")
        route = candidates[0]
    whole = _whole_blocks(model)
    if whole:
        raise PassUnavailable(f"{len(whole)} blocks run as one fused_block Function that reads the Linear weights "
                              "itself: quantize a stage without it (dense)")
    linears = quantizable_linears(model, ctx.swin_only)
    if not linears:
        raise PassUnavailable("no nn.Linear in this model" + ("'s Swin blocks" if ctx.swin_only else ""))
    # activations: mixed, each MLP whose fc1 can run its GELU and fc2's input quantization in its epilogue
    # (the Triton GEMM, or simulate's same math): both Linears quantized as a pair
    pairs = {}
    if activations == "mixed" and (route == "simulate" or "triton" in candidates):
        pairs = mlp_pairs(model)
    paired_fc1 = {fc1 for fc1, _ in pairs.values()}
    gelu_fc1 = set(gelu_fused_fc1(model))
    routes, kept = plan_routes(linears, dtype, route, keep, {n: GELU_FC1 for n in gelu_fc1 - paired_fc1})
    pairs = {b: (fc1, fc2) for b, (fc1, fc2) in pairs.items() if fc1 in routes and fc2 in routes}
    for fc1 in paired_fc1 - {fc1 for fc1, _ in pairs.values()}:
        if fc1 in routes and fc1 in gelu_fc1:   # its fc2 stays wide: no pair, fc1 keeps its GELU epilogue
            del routes[fc1]
            kept[fc1] = GELU_FC1
    for fc1, _ in pairs.values():
        routes[fc1] = "simulate" if route == "simulate" else "triton"
    # fp8 mixed: each fused window attention on e4m3 from its qkv's epilogue to its proj (measured below)
    triples = {}
    if activations == "mixed" and route != "simulate" and "triton" in candidates:
        triples = {b: t for b, t in attention_triples(model, dtype).items() if t[0] in routes and t[1] in routes}
    switched = call_v2_qkv_as_a_module(model, routes)
    suspended = suspend_bf16_mlp_kernels(model)
    try:
        measured, moved = {}, 0
        if select == "auto" and route != "simulate" and routes:
            from workbench.optimize.passes._route import rank_zero_measures

            singles = {n: r for n, r in routes.items() if not any(n in pair for pair in pairs.values())}

            def measure():
                layers = (measure_layers(model, singles, dtype, ctx, activations == "static", candidates)
                          if singles else {})
                return {**layers, **(measure_pairs(model, pairs, dtype, ctx, candidates) if pairs else {}),
                        **(measure_triples(model, triples, ctx, candidates, layers) if triples else {})}
            measured = rank_zero_measures(measure)
            # the singles' and pairs' choices first; a triple measured faster then takes its two layers back
            moved = select_measured(routes, kept, {k: f for k, f in measured.items() if k[3] != "attn"}, dtype)
            pairs = {b: p for b, p in pairs.items() if p[0] in routes and p[1] in routes}
            for fc1, _ in pairs.values():
                routes[fc1] = "triton"      # the route measured is fc2's; fc1's epilogue is the Triton GEMM's
            taken = {n: f["route"] for k, f in measured.items() if k[3] == "attn" and f["choice"] == "quantize"
                     for n in f["layers"]}
            for name, gemm_route in taken.items():     # the route measured is proj's; qkv's is set below
                moved -= name in kept
                kept.pop(name, None)
                routes[name] = gemm_route
            triples = {b: t for b, t in triples.items() if t[0] in taken}
        for qkv, _ in triples.values():
            routes[qkv] = "triton"          # its epilogue writes the e4m3 qkv
        input_scales = None
        static_names = (list(routes) if activations == "static"
                        else [fc2 for _, fc2 in pairs.values()] + [proj for _, proj in triples.values()])
        if activations != "dynamic" and static_names:
            batches, calibrated_on = calibration_images(model, ctx, calibration_batches, calibration_batch)
            input_scales = calibrate_scales(model, static_names, batches, ctx, dtype, calibration, percentile,
                                                  outputs=[qkv for qkv, _ in triples.values()])
    except BaseException:
        for attn in switched.values():  # the model as it was: timm's own F.linear again
            attn.qkv_bias_separate = False
        restore_bf16_mlp_kernels(model, suspended)
        raise
    for name, attn in switched.items():
        if name not in routes:          # measured faster wide: timm's own F.linear again
            attn.qkv_bias_separate = False
    if not routes:
        restore_bf16_mlp_kernels(model, suspended)
        raise PassUnavailable(nothing_left(kept), {"layers": {n: f"kept bf16: {why}" for n, why in kept.items()},
                                                   "select": select, "selected_by_measurement": bool(measured)})
    unmatched = unmatched_patterns(model, keep)
    counts = {r: sum(v == r for v in routes.values()) for r in sorted(set(routes.values()))}
    details = {"dtype": dtype, "route": "/".join(counts), "implementation": {r: IMPLEMENTATION[r] for r in counts},
               "gemm": gemm, "gemm_candidates": list(candidates),
               "activations": {"dynamic": "dynamic per-row", "static": "static per-tensor",
                               "mixed": "dynamic per-row; each MLP's hidden (fc2's input) static per-tensor, "
                                        "written quantized by fc1's epilogue"}[activations],
               "weights": "per output channel", "qmax": QMAX[dtype], "attention": "bf16 (not quantized)",
               "layers": {**routes, **{n: f"kept bf16: {why}" for n, why in kept.items()}},
               "counts": {**counts, "kept": len(kept)}, "unmatched_keep": unmatched,
               "activation_quantization": activation_quantization(route, activations, ctx.device),
               "select": select, "selected_by_measurement": bool(measured),
               "shapes": [{"rows": m, "k": k, "n": n, "with_gelu": gelu is True, "mlp_pair": gelu == "mlp",
                           "attention_triple": gelu == "attn",
                           "input_from_norm": normed, **{f: v for f, v in r.items() if f != "layers"},
                           "layers": len(r["layers"])}
                          for (m, k, n, gelu, normed), r in measured.items()]}
    details["swinv2_qkv_bias_after_gemm"] = sum(name in routes for name in switched)
    if input_scales is not None:
        details["calibration"] = {"method": calibration, "percentile": percentile if calibration == "percentile" else None,
                                  "batches": len(batches[0]), "batch": int(batches[0][0].shape[0]),
                                  "data": calibrated_on,
                                  "scales": {n: float(s) for n, s in input_scales.items()}}
    quantize_model(model, routes, dtype, input_scales)
    details["bf16_mlp_kernels"] = restore_bf16_mlp_kernels(model, suspended)
    kernel_blocks = {fc1.rpartition(".mlp.")[0] for k, f in measured.items()
                     if k[3] == "mlp" and f.get("mlp_kernel") and f["choice"] == "quantize"
                     for fc1 in f["layers"][::2]}
    details["mlp_pairs"] = fuse_pairs(model, pairs, kernel_blocks)
    details["mlp_pairs_in_one_kernel"] = sum(b in kernel_blocks for b in pairs)
    details["attention_triples"] = fuse_triples(model, triples, input_scales) if triples else 0
    if details["attention_triples"]:
        details["attention"] = (f"e4m3 in {details['attention_triples']} blocks: qkv's epilogue writes q, k, v and "
                                "the kernel proj's input at calibrated scales, bf16 math inside")
    gelu_fused = fuse_mlp_activations(model, ctx.device)
    details["gelu_fused_mlps"] = gelu_fused
    from workbench.optimize.passes.block_forward import quantized_norm_blocks

    norm_fused, norm2_fused = quantized_norm_blocks(model, ctx.device)
    details["norm1_quantizes_qkv_blocks"] = norm_fused
    details["norm2_quantizes_fc1_blocks"] = norm2_fused
    acts = {"dynamic": "dynamic per-row", "static": f"static per-tensor ({calibration})",
            "mixed": f"dynamic per-row, each MLP's hidden static per-tensor ({calibration})"}[activations]
    how = ", ".join(f"{c} {r}" for r, c in counts.items()) if len(counts) > 1 else next(iter(counts))
    changed = (f"{len(routes)} Linear layers {dtype} ({how}, {acts} activations, per-channel weights), "
               f"{len(kept)} kept bf16" + (f" ({moved} measured faster in bf16 on this GPU)" if moved else ""))
    if gelu_fused:
        changed += f"; in {gelu_fused} MLPs GELU and fc2's input quantization run as one Triton launch"
    if details["mlp_pairs"]:
        where = "in fc1's GEMM epilogue" if kernels_run(ctx.device) and route != "simulate" else "after fc1"
        changed += f"; in {details['mlp_pairs']} MLPs GELU and fc2's static input quantization run {where}"
        if details["mlp_pairs_in_one_kernel"]:
            changed += f" ({details['mlp_pairs_in_one_kernel']} of them the whole MLP in one kernel)"
    if details["attention_triples"]:
        changed += (f"; in {details['attention_triples']} blocks the window attention runs on e4m3 from qkv's "
                    "epilogue to proj")
    fed = [f"in {n} blocks {which} kernel writes the {linear} input quantized"
           for n, which, linear in ((norm_fused, "norm1's", "qkv"), (norm2_fused, "norm2's", "fc1")) if n]
    if fed:
        changed += "; " + ", ".join(fed)
    if details["swinv2_qkv_bias_after_gemm"]:
        changed += (f"; {details['swinv2_qkv_bias_after_gemm']} SwinV2 qkv layers add their q/v biases after the "
                    "quantized GEMM")
    if unmatched:
        changed += f"; keep patterns matching nothing: {', '.join(unmatched)}"
    params = {"dtype": dtype, "activations": activations, "keep": list(keep), "simulate": simulate, "select": select,
              "gemm": gemm}
    if activations != "dynamic":
        params.update(calibration=calibration, calibration_batches=calibration_batches,
                      calibration_batch=calibration_batch, **({"percentile": percentile} if calibration == "percentile" else {}))
    return model, PassResult(NAME, params, changed, details)

