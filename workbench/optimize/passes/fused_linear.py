"""Pass `fused_linear`: the Linear layers of every Swin block compute their bias gradient in one fused
reduction, and the MLP's GELU backward is fused into fc1's.

After the fused window and attention kernels, the largest single kernel of an autocast Swin training
step is PyTorch's column sum for each Linear's bias gradient, and the MLP's GELU backward another
elementwise pass over the widest activation. In each SwinTransformerBlock:
  * attn.qkv, attn.proj, mlp.fc1, mlp.fc2 (nn.Linear) -> BiasGradLinear (same Parameters): backward = two
    cuBLAS GEMMs + one Triton reduction for the bias gradient (fp32 accumulation, cast once);
  * the block's plan (block_plan.py) gets `linear`, and `mlp_gelu` where the MLP is timm's Mlp with exact
    GELU, no dropout and no hidden norm: its forward becomes linear(x, fc1, gelu=True) then fc2, and fc1's
    backward computes the GELU backward and fc1's bias gradient in the same kernel.
In inference on a GPU (nothing records a gradient, a half dtype) the fused MLP's fc1 runs its bias and
GELU in the GEMM's epilogue instead (`linear.addmm_gelu`: cuBLASLt, GELU's tanh form, within 5e-4 of the
exact erf GELU): the pre-activation, the widest activation of the block, is never written and read back
(on Swin-B at batch 64 the separate GELU is about a sixth of an inference forward's GPU time). The
block stage (fused_block) does the same in its forward.
Where the MLP is narrow (Swin's stages 1 and 2: at most kernels.mlp.MAX_FEATURES wide; v1 and v2) the whole
MLP can run as one kernel instead, fc1, GELU and fc2 with the hidden (4x the block's width) kept on chip
(`kernels.mlp.fused_mlp`): in inference on a GPU the pass times each such MLP shape at the stage's batch,
graph-replayed, both ways (`measure_mlp_kernel`) and plans the kernel (`mlp_kernel`) where it is faster by
more than KERNEL_MARGIN; the record keeps every shape's times and choice (`mlp_kernel_shapes`). Likewise
each v1 block's qkv Linear can run inside its fused attention kernel (`kernels.qkv_attention`: the packed
qkv never written, one launch fewer): timed per attention shape with the qkv GEMM and without
(`measure_qkv_kernel`), planned (`qkv_kernel`) where faster by the same margin (`qkv_kernel_shapes`).
Blocks whose Mlp has another activation, dropout or a hidden norm keep timm's Mlp forward (their
Linears are still swapped) and are counted; the plan says why. See workbench/kernels/linear.py for the
numerics.

SwinV2 (a model of SwinTransformerV2Blocks, or of swin_transformer_v2_cr's blocks, only): the MLP is the
same timm Mlp, so each block's attn.proj, mlp.fc1 and mlp.fc2 become BiasGradLinear and each qualifying MLP
runs fc1 + GELU as one Function (in inference, one cuBLASLt GEMM), bound on the Mlp itself (there is no v1
block plan to carry it). swin_transformer_v2's qkv Linear is left: it computes it as F.linear on the
weight with its q/v biases, past the module; -CR's qkv Linear holds its bias and is swapped too.
"""
from __future__ import annotations

import types
from typing import Callable

import torch

from workbench.optimize.passes import PassContext, PassResult, PassUnavailable, require_triton
from workbench.optimize.passes._swin import has_v2_blocks, named_swin_blocks
from workbench.optimize.passes.block_plan import block_plans

NAME = "fused_linear"
OWN_KERNELS = True   # runs swinbench kernels: a stage with it is not PyTorch alone
KERNEL_MARGIN = 0.03     # the one-kernel MLP must be at least 3% faster than its two GEMMs to be planned


def exact_gelu(act: torch.nn.Module) -> bool:
    """torch's exact (erf) nn.GELU, or timm's GELU module (F.gelu, exact), which SwinV2 builds."""
    if type(act) is torch.nn.GELU:
        return act.approximate == "none"
    try:
        from timm.layers.activations import GELU as TimmGELU
    except ImportError:
        return False
    return type(act) is TimmGELU


def _identity_or_no_drop(m: torch.nn.Module) -> bool:
    return isinstance(m, torch.nn.Identity) or (isinstance(m, torch.nn.Dropout) and m.p == 0.0)


def _fusable_mlp(mlp: torch.nn.Module, Mlp) -> bool:
    """A timm Mlp with exact GELU, no dropout and no hidden norm: fc1 and GELU can run as one Function."""
    return (isinstance(mlp, Mlp) and exact_gelu(mlp.act) and _identity_or_no_drop(mlp.drop1)
            and _identity_or_no_drop(mlp.drop2) and isinstance(mlp.norm, torch.nn.Identity))


def _inference_epilogue(ctx: PassContext, mlps_fused: int, epilogue_dtypes) -> bool:
    """Whether fused MLPs run fc1's bias and GELU in the GEMM's epilogue: inference on a GPU, half dtype."""
    return (not ctx.training and ctx.device.type == "cuda" and mlps_fused > 0
            and ctx.precision.amp_dtype in epilogue_dtypes)


def v2_mlp_bound(mlp: torch.nn.Module) -> bool:
    """Whether this pass bound the fused fc1 + GELU forward (or the MLP as one kernel) on a SwinV2 block's Mlp."""
    from workbench.optimize.passes.block_forward import mlp_forward_fused, mlp_forward_whole

    return getattr(vars(mlp).get("forward"), "__func__", None) in (mlp_forward_fused, mlp_forward_whole)


def _v2_result(model: torch.nn.Module, ctx: PassContext, Mlp, BiasGradLinear, epilogue_dtypes) -> PassResult:
    """Swap attn.proj, mlp.fc1 and mlp.fc2 of every SwinV2 block (and -CR's attn.qkv) to BiasGradLinear and
    bind the fused fc1 + GELU forward on each Mlp that qualifies -> the pass's result."""
    from workbench.optimize.passes._swin import is_cr, v2_block_classes
    from workbench.optimize.passes.block_forward import mlp_forward_fused, mlp_forward_whole

    linears, fused, kept, qkv_left = 0, [], 0, 0
    for name, blk in ((n, m) for n, m in model.named_modules() if isinstance(m, v2_block_classes())):
        cr = is_cr(blk.attn)
        qkv_left += not cr
        for parent, names in ((blk.attn, ("qkv", "proj") if cr else ("proj",)), (blk.mlp, ("fc1", "fc2"))):
            for child_name in names:
                child = getattr(parent, child_name, None)
                if type(child) is torch.nn.Linear:
                    setattr(parent, child_name, BiasGradLinear.from_linear(child))
                    linears += 1
        mlp = blk.mlp
        if _fusable_mlp(mlp, Mlp) and isinstance(mlp.fc1, BiasGradLinear) and "forward" not in vars(mlp):
            mlp.forward = types.MethodType(mlp_forward_fused, mlp)
            fused.append(name)
        else:
            kept += 1
    if linears == 0:
        raise PassUnavailable("no nn.Linear in this model's SwinV2 blocks")
    measured = _measured_mlp_kernels(model, fused, ctx, epilogue_dtypes)
    for record in measured.values():
        for name in record["blocks"] if record["choice"] == "kernel" else ():
            mlp = model.get_submodule(f"{name}.mlp")
            mlp.forward = types.MethodType(mlp_forward_whole, mlp)
    which = "proj, fc1, fc2" if qkv_left else "qkv, proj, fc1, fc2"
    changed = (f"{linears} SwinV2 Linear ({which}) -> fused bias-gradient backward (Triton); {len(fused)} MLP "
               "fc1+GELU fused")
    if qkv_left:
        changed += "; qkv left (SwinV2 runs it as F.linear with its q/v biases)"
    result = _with_mlp_kernels(_result(ctx, epilogue_dtypes, linears, len(fused), kept, changed), measured)
    result.details["swinv2"] = True
    return result


def _result(ctx: PassContext, epilogue_dtypes, linears: int, fused: int, kept: int, changed: str) -> PassResult:
    """The pass's result from its counts: `changed` completed with the MLPs kept and the inference epilogue."""
    if kept:
        changed += f"; {kept} MLP kept on timm's forward (other activation, dropout or hidden norm)"
    epilogue = _inference_epilogue(ctx, fused, epilogue_dtypes)
    if epilogue:
        changed += "; inference: fc1's bias and GELU in its GEMM's epilogue (cuBLASLt, tanh GELU)"
    details = {"linears": linears, "mlps_fused": fused, "mlps_kept": kept,
               "implementation": "workbench.kernels.linear (cuBLAS GEMMs + Triton bias/GELU reduction)",
               "inference_gelu": ("fc1 + bias + GELU as one cuBLASLt GEMM (torch._addmm_activation, tanh GELU: "
                                  "within 5e-4 of the exact erf GELU)") if epilogue else "separate (exact erf)"}
    return PassResult(NAME, {}, changed, details)


def mlp_kernel_applies(mlp: torch.nn.Module) -> bool:
    """Whether the one-kernel MLP (kernels.mlp) takes this Mlp: its widths within the kernel's, both Linears
    with a bias."""
    from workbench.kernels.mlp import applies

    fc1, fc2 = mlp.fc1, mlp.fc2
    return (applies(fc1.in_features, fc1.out_features, fc2.out_features) and getattr(fc1, "bias", None) is not None
            and getattr(fc2, "bias", None) is not None)


def _time_kernel(ctx: PassContext, bound: str, as_bound: Callable, kernel: Callable) -> dict:
    """{"<bound>_us", "kernel_us" (or "error"), "choice": "kernel" | bound}: the forward as bound and the
    one-kernel form, each graph-replayed (_route.median_us) in inference under the stage's autocast; the
    kernel is the choice where it is faster by more than KERNEL_MARGIN. A kernel that fails to compile or
    run is not chosen and the record says why."""
    from workbench.optimize.passes._route import median_us

    record: dict = {}
    with torch.inference_mode(), ctx.precision.autocast(ctx.device.type):
        record[f"{bound}_us"] = round(median_us(as_bound), 2)
        try:
            record["kernel_us"] = round(median_us(kernel), 2)
        except Exception as e:  # noqa: BLE001  (a GPU or Triton the kernel fails on: the record says so)
            record["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    faster = "kernel_us" in record and record["kernel_us"] < record[f"{bound}_us"] * (1 - KERNEL_MARGIN)
    return {**record, "choice": "kernel" if faster else bound}


def measure_mlp_kernel(model: torch.nn.Module, blocks: list[str], ctx: PassContext) -> dict[tuple, dict]:
    """{(rows, C, hidden): {"two_gemms_us", "kernel_us", "choice": "kernel" | "two_gemms", "blocks"}} for the
    distinct shapes of the named blocks' MLPs that the one-kernel MLP takes (kernels.mlp.applies, biases
    on both Linears), at the stage's batch: the MLP's inference forward as fused_linear binds it (fc1 with
    its bias and GELU in cuBLASLt's epilogue, then fc2) against kernels.mlp.fused_mlp, on the same random
    rows, graph-replayed (_route.median_us). A shape whose kernel fails to compile or run keeps the two
    GEMMs and its record says why."""
    from workbench.optimize.passes._route import DEFAULT_IMAGES
    from workbench.optimize.passes._swin import feature_map
    from workbench.optimize.passes.block_forward import mlp_forward_fused, mlp_forward_whole

    images = ctx.batch or DEFAULT_IMAGES
    shapes: dict[tuple, list[str]] = {}
    for name in blocks:
        blk = model.get_submodule(name)
        if mlp_kernel_applies(blk.mlp):
            h, w = feature_map(blk)
            shapes.setdefault((h * w * images, blk.mlp.fc1.in_features, blk.mlp.fc1.out_features), []).append(name)
    out = {}
    gen = torch.Generator(ctx.device).manual_seed(0)
    for (m, c, hidden), names in shapes.items():
        mlp = model.get_submodule(f"{names[0]}.mlp")
        x = torch.randn(m, c, device=ctx.device, generator=gen).to(ctx.precision.amp_dtype)
        record = _time_kernel(ctx, "two_gemms", lambda: mlp_forward_fused(mlp, x), lambda: mlp_forward_whole(mlp, x))
        del x
        out[(m, c, hidden)] = {**record, "blocks": names}
    torch.cuda.empty_cache()
    return out


def _measured_mlp_kernels(model: torch.nn.Module, blocks: list[str], ctx: PassContext, epilogue_dtypes) -> dict:
    """measure_mlp_kernel's records for the blocks whose MLP this pass fused, in inference on a GPU (on rank
    0 under torchrun, shared: one plan on every rank); {} elsewhere."""
    from workbench.optimize.passes._route import rank_zero_measures

    if not _inference_epilogue(ctx, len(blocks), epilogue_dtypes):
        return {}
    return rank_zero_measures(lambda: measure_mlp_kernel(model, blocks, ctx))


def measure_qkv_kernel(model: torch.nn.Module, blocks: list[str], ctx: PassContext) -> dict[tuple, dict]:
    """{(windows, N, C, heads, masked): {"two_kernels_us", "kernel_us", "choice": "kernel" | "two_kernels",
    "blocks"}} for the distinct attention shapes of the named blocks whose fused attention
    (fused_attention's plan) the qkv kernel takes, at the stage's batch: the attention module's inference
    forward as bound (the qkv GEMM, then the attention kernel, then proj) against the same with the qkv
    projection inside the attention kernel (block_forward.qkv_kernel_forward), on the same random windows
    with the block's own mask, graph-replayed (_route.median_us). A shape whose kernel fails to compile or
    run keeps the two kernels and its record says why."""
    from workbench.kernels.qkv_attention import applies
    from workbench.optimize.passes._route import DEFAULT_IMAGES
    from workbench.optimize.passes._swin import feature_map
    from workbench.optimize.passes.block_forward import qkv_kernel_forward

    images = ctx.batch or DEFAULT_IMAGES
    plans = block_plans(model)
    shapes: dict[tuple, list[str]] = {}
    for name in blocks:
        blk = model.get_submodule(name)
        attn, forward = blk.attn, vars(blk.attn).get("forward")
        n = attn.window_area if hasattr(attn, "window_area") else None
        if plans.plan(name).attention != "triton" or forward is None or n is None:
            continue
        c = attn.qkv.in_features
        if not applies(n, c, attn.num_heads) or getattr(attn.qkv, "bias", None) is None:
            continue
        h, w = feature_map(blk)
        mask = getattr(blk, "attn_mask", None)
        windows = images * (-(-h // blk.window_size[0])) * (-(-w // blk.window_size[1]))
        shapes.setdefault((windows, n, c, attn.num_heads, mask is not None), []).append(name)
    out = {}
    gen = torch.Generator(ctx.device).manual_seed(0)
    for (windows, n, c, heads, masked), names in shapes.items():
        blk = model.get_submodule(names[0])
        attn, mask = blk.attn, getattr(blk, "attn_mask", None)
        bound = vars(attn)["forward"].__func__
        fused = qkv_kernel_forward(bound)
        x = torch.randn(windows, n, c, device=ctx.device, generator=gen).to(attn.qkv.weight.dtype)
        record = _time_kernel(ctx, "two_kernels", lambda: bound(attn, x, mask), lambda: fused(attn, x, mask))
        del x
        out[(windows, n, c, heads, masked)] = {**record, "blocks": names}
    torch.cuda.empty_cache()
    return out


def _with_mlp_kernels(result: PassResult, measured: dict) -> PassResult:
    """The pass's result with the one-kernel MLP's records (where measured) in its line and details."""
    if measured:
        kernel = sum(len(r["blocks"]) for r in measured.values() if r["choice"] == "kernel")
        result.changed += f"; inference: {kernel} MLP as one kernel (measured faster than the two GEMMs)"
        result.details["mlp_kernel_shapes"] = [{"rows": m, "c": c, "hidden": h, **{k: v for k, v in r.items()
                                                                                   if k != "blocks"},
                                                "blocks": len(r["blocks"])} for (m, c, h), r in measured.items()]
        result.details["mlp_kernel_blocks"] = kernel
    return result


def apply(model: torch.nn.Module, ctx: PassContext) -> tuple[torch.nn.Module, PassResult]:
    """Swap the Linears of every timm SwinTransformerBlock in place, plan the fused MLP and bind ->
    (model, PassResult)."""
    try:
        from timm.layers import Mlp

        from workbench.kernels.linear import EPILOGUE_DTYPES, BiasGradLinear
    except ImportError as exc:
        raise PassUnavailable(f"fused linear kernel not importable: {exc}") from exc
    require_triton(ctx.device)

    linears, fused_mlps, kept_mlps = 0, [], []
    blocks = named_swin_blocks(model)
    if not blocks and has_v2_blocks(model, cr=True):
        return model, _v2_result(model, ctx, Mlp, BiasGradLinear, EPILOGUE_DTYPES)
    for name, block in blocks:
        for parent in (block.attn, block.mlp):
            for child_name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    setattr(parent, child_name, BiasGradLinear.from_linear(child))
                    linears += 1
        mlp = block.mlp
        if _fusable_mlp(mlp, Mlp) and isinstance(mlp.fc1, BiasGradLinear):
            fused_mlps.append(name)
        else:
            kept_mlps.append(name)
    if linears == 0:
        raise PassUnavailable("no timm SwinTransformerBlock Linear layers in this model")
    plans = block_plans(model)
    for name, _ in blocks:
        plans.update(name, linear=True, mlp_gelu=name in fused_mlps, qkv_kernel=False)   # measured below
        if name in kept_mlps:
            plans.fall_back(name, "mlp_gelu", "an MLP with another activation, dropout or a hidden norm")
    measured = _measured_mlp_kernels(model, fused_mlps, ctx, EPILOGUE_DTYPES)
    for record in measured.values():
        for name in record["blocks"]:
            plans.update(name, mlp_kernel=record["choice"] == "kernel")
    plans.bind(model)
    qkv_measured = {}
    if _inference_epilogue(ctx, len(blocks), EPILOGUE_DTYPES):
        from workbench.optimize.passes._route import rank_zero_measures

        qkv_measured = rank_zero_measures(lambda: measure_qkv_kernel(model, [n for n, _ in blocks], ctx))
        for record in qkv_measured.values():
            for name in record["blocks"]:
                plans.update(name, qkv_kernel=record["choice"] == "kernel")
        if qkv_measured:
            plans.bind(model)
    mlps_fused = len(fused_mlps)
    result = _with_mlp_kernels(_result(ctx, EPILOGUE_DTYPES, linears, mlps_fused, len(kept_mlps),
                                       f"{linears} Linear -> fused bias-gradient backward (Triton); "
                                       f"{mlps_fused} MLP fc1+GELU backward fused"), measured)
    return model, _with_qkv_kernels(result, qkv_measured)


def _with_qkv_kernels(result: PassResult, measured: dict) -> PassResult:
    """The pass's result with the qkv-in-attention kernel's records (where measured) in its line and details."""
    if measured:
        kernel = sum(len(r["blocks"]) for r in measured.values() if r["choice"] == "kernel")
        result.changed += f"; inference: {kernel} qkv Linear inside the attention kernel (measured faster)"
        result.details["qkv_kernel_shapes"] = [
            {"windows": b, "tokens": n, "c": c, "heads": h, "masked": m,
             **{k: v for k, v in r.items() if k != "blocks"}, "blocks": len(r["blocks"])}
            for (b, n, c, h, m), r in measured.items()]
        result.details["qkv_kernel_blocks"] = kernel
    return result
