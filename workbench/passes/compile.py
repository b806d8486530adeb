"""compile: run the forward + loss under torch.compile (Inductor). The workload wraps its step function
when it prepares, so this pass only records the wish and the options; compile time shows up in the
stage's first step and is reported as compile_s, never in the step times.
"""
from __future__ import annotations

from ..errors import UserError
from . import PassContext, PassResult

NAME = "compile"
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def apply(model, ctx: PassContext, mode: str = "default", fullgraph: bool = False, dynamic: bool | None = False,
          backend: str = "inductor"):
    if mode not in MODES:
        raise UserError(f"pass compile: mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not isinstance(fullgraph, bool) or not (dynamic is None or isinstance(dynamic, bool)):
        raise UserError("pass compile: fullgraph must be true/false and dynamic true/false/null")
    options = {"backend": backend, "fullgraph": fullgraph, "dynamic": dynamic}
    if mode != "default":
        options["mode"] = mode
    ctx.compile = True
    ctx.compile_options = options
    params = {"mode": mode, "fullgraph": fullgraph, "dynamic": dynamic, "backend": backend}
    return model, PassResult(NAME, params, f"forward+loss under torch.compile({backend}, mode={mode})", options)
