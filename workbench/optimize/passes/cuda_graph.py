"""cuda_graph: capture the whole training step (forward, backward, optimizer) in one CUDA graph and
replay it, so the host launches one graph per step instead of thousands of kernels.

Why: a hand-fused eager model still pays the host's per-launch cost for every kernel (a Triton launch
can cost the host more than the kernel takes on the GPU); once the GPU work per step shrinks below the
host's launch time, the step is host-bound and fusion stops paying. Replaying a graph removes that cost. The workload
captures lazily, at its first step (after the correctness gate has run the same model eagerly):
three warm-up steps on a side stream (Triton autotuning happens there), then one captured step.
Requirements it checks: a CUDA device, no torch.compile mode that replays its own graphs
(`reduce-overhead`; a default-mode compiled step is captured like an eager one), no GradScaler (its inf check syncs with the host). The optimizer is
made capturable (its step counter lives on the GPU).
"""
from __future__ import annotations

from workbench.optimize.passes import PassContext, PassResult, PassUnavailable

NAME = "cuda_graph"


def in_your_loop(params: dict, ctx: PassContext) -> str:
    """What a loop of your own writes to get this pass (workbench.optimize.patching.patch_swin): the whole
    training step, or for a patch planned for inference the forward, in a graph."""
    if not ctx.training:
        return ("capture your forward in a CUDA graph with torch.cuda.graph after a few warm-up calls, with a "
                "static input buffer")
    return ("capture your whole step (forward, backward, optimizer) in a CUDA graph with torch.cuda.graph "
            "after a few warm-up steps, with static input buffers and a capturable optimizer")


def apply(model, ctx: PassContext):
    if ctx.device.type != "cuda":
        raise PassUnavailable("CUDA graphs need a CUDA device")
    from workbench.optimize.passes.compile import replays_own_graphs

    if ctx.compile and replays_own_graphs(ctx.compile_options):
        raise PassUnavailable("the compiled step replays Inductor's own CUDA graphs (reduce-overhead, "
                              "max-autotune)")
    if ctx.grad_scaler:
        raise PassUnavailable("fp16 GradScaler syncs with the host every step; use bf16 for CUDA graphs")
    ctx.cuda_graph = True
    return model, PassResult(NAME, {}, "whole training step captured once and replayed as one CUDA graph",
                             {"capture": "lazy, at the first step, after 3 side-stream warm-up steps"})
