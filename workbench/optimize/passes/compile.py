"""compile: run the forward + loss under torch.compile (Inductor). The workload wraps its step function
when it prepares, so this pass only records the wish and the options; compile time shows up in the
stage's first step and is reported as compile_s, never in the step times.

fused_window (default false): the fused window chain stays fused under torch.compile. By default a
compiled Swin stage runs timm's stage and merge forwards (block_forward.stage_forward, the window
forward), so each block's attention merge, residual add and norm2 are three launches (merge_roll, an
Inductor add, add_layer_norm) and each MLP's residual add is an Inductor kernel of its own. With
fused_window the blocks keep eager mode's chain, traced as operators: merge_add_norm (merge, add and
norm2 in one kernel each way) and the deferred MLP add inside the next block's add_norm_shift_partition.
The setting is the model's block plans' `window_under_compile`, which every bind hands to the forwards
it builds, whichever order the passes run in; a model without fused_window's plans is not changed.
"""
from __future__ import annotations

from workbench.errors import UserError
from workbench.optimize.passes import PassContext, PassResult

NAME = "compile"
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# parameter -> (types, allowed values or a check); recipes.py checks a recipe against it when it is loaded
PARAMS = {"mode": (str, MODES), "fullgraph": (bool, None), "dynamic": ((bool, type(None)), None),
          "backend": (str, None), "inductor": ((dict, type(None)), lambda v: _check_inductor_options(v)),
          "fused_window": (bool, None)}


def check_params(params: dict) -> None:
    """What the parameters must be together, checked when a recipe is loaded (before any stage runs)."""
    backend, mode = params.get("backend", "inductor"), params.get("mode", "default")
    if params.get("inductor"):
        if backend != "inductor":
            raise UserError(f"pass compile: inductor options need backend inductor, not {backend!r}")
        if mode != "default":
            raise UserError("pass compile: inductor options need mode default (torch.compile takes a mode or "
                            "options, not both); set triton.cudagraphs: true for what reduce-overhead does")
    if backend != "inductor":
        import torch._dynamo

        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise UserError(f"pass compile: unknown backend {backend!r} (torch._dynamo.list_backends() has them: "
                            "inductor, eager, aot_eager, cudagraphs, ...)")


def _check_inductor_options(inductor) -> dict:
    """Inductor config settings by dotted name (`cpp_wrapper`, `triton.cudagraphs`), each an existing
    setting given a bool, int, float or string of the type torch.compile takes for it (what its `options`
    refuse would otherwise fail the stage only when it runs, after the stages before it were measured)."""
    if not isinstance(inductor, dict):
        raise UserError("pass compile: inductor must be a mapping of Inductor config names to values")
    from torch._inductor import config as inductor_config

    settings = inductor_config.get_config_copy()
    get_type = getattr(inductor_config, "get_type", None)
    for name, value in inductor.items():
        key = str(name).replace("-", "_")
        if key not in settings:     # as torch.compile reads `options`: a submodule or a function is none
            raise UserError(f"pass compile: {name!r} is not an Inductor config setting")
        if not isinstance(value, (bool, int, float, str)):
            raise UserError(f"pass compile: inductor option {name!r} must be a bool, number or string")
        if get_type is not None:
            expected = get_type(key)    # a generic or union type (str | None) is not checked, as torch does not
        else:
            expected = type(settings[key]) if settings[key] is not None else None
        if isinstance(expected, type) and not isinstance(value, expected):
            raise UserError(f"pass compile: inductor option {name!r} must be "
                            f"{_TYPE_WORDS.get(expected, expected.__name__)}, got {value!r}")
    return dict(inductor)


_TYPE_WORDS = {bool: "true/false", int: "an integer", float: "a number with a decimal point (like 1.0)",
               str: "a string", type(None): "null (torch.compile takes no other value for it)"}


# the modes in which Inductor replays its own CUDA graphs (torch._inductor.list_mode_options sets
# triton.cudagraphs for them): a step compiled so is not captured in a graph of ours
OWN_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def replays_own_graphs(options: dict | None) -> bool:
    """Whether a torch.compile with these options (PassContext.compile_options) replays Inductor's own CUDA
    graphs: mode reduce-overhead or max-autotune, or the option triton.cudagraphs."""
    options = options or {}
    return options.get("mode") in OWN_GRAPH_MODES or bool((options.get("options") or {}).get("triton.cudagraphs"))


def in_your_loop(params: dict, ctx: PassContext) -> str:
    """What a loop of your own writes to get this pass (workbench.optimize.patching.patch_swin): the
    recipe's torch.compile settings, around the model or the step."""
    shown = ", ".join(f"{'options' if k == 'inductor' else k}={v!r}" for k, v in params.items()
                      if v is not None and k != "fused_window")
    text = (f"wrap the model or your step in torch.compile({shown}) (the fused kernels trace as custom ops)"
            if shown else "wrap the model or your step in torch.compile (the fused kernels trace as custom ops)")
    if params.get("fused_window"):   # a step-level pass: patch_swin does not apply it, so the model is unchanged
        text += ("; fused_window: call workbench.optimize.passes.compile.keep_fused_window(model) on the patched "
                 "model first, so that the compiled blocks keep the fused window chain")
    return text


def apply(model, ctx: PassContext, mode: str = "default", fullgraph: bool = False, dynamic: bool | None = False,
          backend: str = "inductor", inductor: dict | None = None, fused_window: bool = False):
    """inductor: Inductor config settings for this compile (torch.compile's `options`), e.g.
    {cpp_wrapper: true}. torch.compile takes either a mode or options, so they need mode default;
    {triton.cudagraphs: true} there is what reduce-overhead sets. fused_window: the Swin blocks keep the
    fused window chain (merge_add_norm, the deferred MLP add in add_norm_shift_partition) under
    torch.compile instead of timm's stage and merge paths (see the module's docstring); false by default."""
    if mode not in MODES:
        raise UserError(f"pass compile: mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not isinstance(fullgraph, bool) or not (dynamic is None or isinstance(dynamic, bool)):
        raise UserError("pass compile: fullgraph must be true/false and dynamic true/false/null")
    if not isinstance(fused_window, bool):
        raise UserError("pass compile: fused_window must be true/false")
    options = {"backend": backend, "fullgraph": fullgraph, "dynamic": dynamic}
    if mode != "default":
        options["mode"] = mode
    params = {"mode": mode, "fullgraph": fullgraph, "dynamic": dynamic, "backend": backend}
    check_params({**params, "inductor": inductor})
    if inductor:
        options["options"] = params["inductor"] = _check_inductor_options(inductor)
    ctx.compile = True
    ctx.compile_options = options
    extra = f", {', '.join(f'{k}={v}' for k, v in inductor.items())}" if inductor else ""
    details = dict(options)
    if fused_window:
        params["fused_window"] = True
        details["rebound_blocks"] = keep_fused_window(model)
        extra += ", fused window chain kept"
    return model, PassResult(NAME, params, f"forward+loss under torch.compile({backend}, mode={mode}{extra})", details)


def keep_fused_window(model) -> int:
    """fused_window on a model: set its block plans' window_under_compile and bind them again where a pass
    planned blocks already (a pass that plans them later binds with the setting too) -> block forwards
    bound now. For a loop of your own around a patch_swin'd model too."""
    from workbench.optimize.passes.block_plan import block_plans

    plans = block_plans(model)
    plans.window_under_compile = True
    return plans.bind(model)["block_forwards"] if plans.plans else 0
