"""Pass `master_weights`: bf16 GEMM weights with an fp32 master copy in the optimizer (apex's O2 style).

Under autocast every Linear and Conv2d casts its fp32 weight and bias to bf16 in each forward, and the
backward casts their bf16 gradients back to fp32: four small kernels per Linear per step, about 400
launches in a Swin-B training step (and 200 per inference forward), each paid in host time by an eager
step that is bound by the host. This pass stores those weights in bf16 instead, as views of one flat
bf16 buffer, and keeps their fp32 values in one flat master tensor that the optimizer updates. Per
step the optimizer then gathers the bf16 gradients with one `torch.cat`, widens them with one copy,
steps the master tensor, and narrows it back into the model with one copy. With torch's AdamW and the
Triton kernels at hand (param `step`: auto), the widen, the master's update and the narrow are one
kernel instead (`workbench.kernels.adamw`: 28 bytes an element instead of 40), which reads each bf16
gradient where autograd left it, through a table of their addresses, so that nothing is gathered
first (the cat's 4 bytes an element; where a gradient is strided, or one that the kernel reads in
16-byte vectors is not 16-byte aligned, the step gathers them with the cat as before); torch's
optimizer steps the model's other parameters as before.

The arithmetic is the same as autocast's: the forward's weights are the master values rounded to
bf16 (what autocast's cast gives), the gradients are the bf16 results of the same GEMMs and sums
(which autocast's cast-backward only widened), and the update runs on the fp32 master. LayerNorm
weights, the relative-position tables and every other parameter stay fp32 and are stepped as before.

bf16 only: fp16 would need the GradScaler to unscale low-precision gradients. Under FSDP2 the pass
stands aside and leaves the model as it is: FSDP's mixed precision already keeps the parameters as fp32
shards, the optimizer's masters, and gathers them in bf16 for the forward and backward.
"""
from __future__ import annotations

import torch

from workbench.errors import UserError
from workbench.optimize.passes import PassContext, PassResult, PassUnavailable, triton_runs_on

NAME = "master_weights"
STEPS = ("auto", "triton", "torch")
PARAMS = {"step": (str, STEPS)}   # parameter -> (type, allowed values), checked when a recipe is loaded


def gemm_parameters(model: torch.nn.Module, training: bool = True) -> list[torch.nn.Parameter]:
    """The weights and biases of every nn.Linear and nn.Conv2d (autocast's casting ops), each once; for
    training not the frozen ones (requires_grad False), which the optimizer must leave as they are: they
    stay fp32."""
    seen, params = set(), []
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
            for p in (module.weight, module.bias):
                if (p is not None and p.dtype == torch.float32 and (p.requires_grad or not training)
                        and id(p) not in seen):
                    seen.add(id(p))
                    params.append(p)
    return params


class MasterWeights:
    """Low-precision parameters as views of one flat buffer, their fp32 masters made on demand (kept
    only for training: an inference workload needs no optimizer)."""

    def __init__(self, params: list[torch.nn.Parameter], dtype: torch.dtype, keep_master: bool = True,
                 flat_step: bool = False):
        self.params = params
        self.dtype = dtype
        self.flat_step = flat_step   # step the master with the one-pass AdamW kernel where the optimizer allows
        device = params[0].device
        self.sizes = [p.numel() for p in params]
        total = sum(self.sizes)
        self.flat = torch.empty(total, dtype=dtype, device=device)
        self._fp32 = torch.empty(total, dtype=torch.float32, device=device) if keep_master else None
        offset = 0
        for p, n in zip(params, self.sizes):
            if keep_master:
                self._fp32[offset:offset + n].copy_(p.detach().reshape(-1))
            self.flat[offset:offset + n].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset:offset + n].view(p.shape)
            offset += n
        self.master = None
        self._layout = None      # the kernel's chunk tables (adamw.GradLayout)
        if flat_step:            # made here, never inside a CUDA-graph capture (its tables are host copies)
            from workbench.kernels.adamw import GradLayout

            self._layout = GradLayout(self.sizes, device)
        self._table = None       # (addresses, table on the device) of the last step's gradients
        self._captured = []      # tables a CUDA graph captured: its replays write and read them again
        self._zeros = None       # the gradient of a parameter that received none

    def master_parameter(self) -> torch.nn.Parameter:
        """The flat fp32 master (one Parameter), made on first use. Its gradient is a persistent buffer
        that gather_grads makes on first use (the one-pass step reads the low-precision one instead)."""
        if self.master is None:
            if self._fp32 is None:
                raise RuntimeError("master weights were not kept (the pass ran for an inference workload)")
            self.master = torch.nn.Parameter(self._fp32)
            self._grads = torch.empty_like(self.flat)
        self._fp32 = None
        return self.master

    def gather_low_grads(self) -> torch.Tensor:
        """The parameters' low-precision gradients as one flat tensor laid out as the master (one cat). A
        parameter without a gradient contributes zeros (as autograd's would-be zero gradient)."""
        grads = [p.grad.reshape(-1) if p.grad is not None else self.flat.new_zeros(n)
                 for p, n in zip(self.params, self.sizes)]
        torch.cat(grads, out=self._grads)
        return self._grads

    def low_grads_table(self) -> torch.Tensor | None:
        """The parameters' low-precision gradients as a table of their addresses for the one-pass AdamW
        (`adamw.adamw_grads_step`, layout `grads_layout()`), or None where the kernel cannot read them in
        place (a strided or wider gradient, or one the kernel reads in 16-byte vectors that is not 16-byte
        aligned): gather them then. A parameter without a gradient reads zeros. The table is written anew
        only when an address changed since the last step (`adamw.grad_table`, kernels that a CUDA graph
        captures with the step); a table that a capture uses is kept for as long as this object lives, since
        the graph's replays read it (and, made under the capture, write it) again."""
        layout = self.grads_layout()
        if layout is None:
            return None
        grads = []
        for p, n, aligned in zip(self.params, self.sizes, layout.aligned):
            g = p.grad
            if g is None:
                if self._zeros is None:
                    self._zeros = self.flat.new_zeros(max(self.sizes))
                g = self._zeros
            elif g.dtype != self.dtype or not g.is_contiguous() or (aligned and g.data_ptr() % 16):
                return None
            grads.append(g)
        addresses = tuple(g.data_ptr() for g in grads)
        if self._table is None or self._table[0] != addresses:
            from workbench.kernels.adamw import grad_table

            self._table = (addresses, grad_table(grads, self.flat.device))
        if self.flat.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            self._captured.append(self._table[1])   # the graph reads it: never freed while this object lives
        return self._table[1]

    def grads_layout(self):
        """The flat master's chunk tables for the one-pass AdamW (adamw.GradLayout); None unless the master
        weights were made for it (flat_step)."""
        return self._layout

    def gather_grads(self) -> None:
        """The parameters' low-precision gradients into the master's fp32 gradient: one cat, one copy."""
        if self.master.grad is None:
            self.master.grad = torch.empty_like(self.master)
        self.master.grad.copy_(self.gather_low_grads())

    def scatter_params(self) -> None:
        """The stepped masters back into the model's parameters (one rounding copy)."""
        with torch.no_grad():
            self.flat.copy_(self.master)

    def fp32_views(self) -> list[torch.Tensor]:
        """Each parameter's fp32 value, shaped like it: views of the master (of the fp32 copy until the
        master is made). What a checkpoint holds for these parameters."""
        source = self.master.detach() if self.master is not None else self._fp32
        if source is None:
            raise RuntimeError("master weights were not kept (the pass ran for an inference workload)")
        return self.views_of(source)

    def views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's slice of a flat tensor laid out as the master (an average of it, say), shaped
        like the parameter."""
        views, offset = [], 0
        for p, n in zip(self.params, self.sizes):
            views.append(flat[offset:offset + n].view(p.shape))
            offset += n
        return views

    def load_fp32(self, values: list[torch.Tensor]) -> None:
        """Set each parameter's fp32 master from `values` (in `params` order, same shapes), and its
        low-precision copy to the master rounded, as a step's scatter_params does. In place."""
        with torch.no_grad():
            views = self.fp32_views()
            for view, value in zip(views, values):
                view.copy_(value)
            self.flat.copy_(self.master if self.master is not None else self._fp32)

    def optimizer(self, factory, params) -> "MasterWeightOptimizer":
        return MasterWeightOptimizer(self, factory, params)


def check_optimizer(optimizer, given: list, what: str, required=None):
    """The optimizer a user's factory built over `given` (what: those parameters in words), or UserError
    (one line) when it is no torch.optim.Optimizer, steps a parameter it was not given, or leaves out
    `required` (the master of the GEMM weights): a factory that builds its optimizer over the model's own
    parameters instead would leave the master unstepped, and the model would train only in part. A subset
    of `given` is fine (parameters left frozen)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(f"the optimizer factory returned an object of type {type(optimizer).__name__}, not a "
                        "torch.optim.Optimizer")
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    foreign = len(held - {id(p) for p in given})
    if foreign or (required is not None and id(required) not in held):
        raise UserError(f"the optimizer factory must build its optimizer over the parameters it is passed ({what}), "
                        f"not others ({foreign} of its parameters were not passed"
                        + (", and it leaves out the fp32 master" if required is not None and id(required) not in held
                           else "") + "): build it from the argument, e.g. lambda params: torch.optim.AdamW(params, "
                        "lr=...)")
    return optimizer


class MasterWeightOptimizer:
    """The optimizer `factory` builds over the fp32 master and the model's other parameters, stepped
    through the low-precision parameters' gradients. What the workload uses of an optimizer:
    step, zero_grad, param_groups (CUDA-graph capture sets `capturable` there)."""

    def __init__(self, weights: MasterWeights, factory, params):
        self.weights = weights
        lowp = {id(p) for p in weights.params}
        self.model_params = list(params)
        others = [p for p in self.model_params if id(p) not in lowp]
        master = weights.master_parameter()
        given = [master, *others]
        self.inner = check_optimizer(factory(given), given, "under master weights, one flat fp32 master of the GEMM "
                                     "weights and the model's other parameters", required=master)
        self.flat_group = self._flat_adamw_group() if weights.flat_step else None

    def _flat_adamw_group(self) -> dict | None:
        """The master's parameter group when the one-pass kernel computes its update: torch's AdamW (not a
        subclass) without amsgrad, maximize or differentiable, numbers for betas, eps and weight decay."""
        if type(self.inner) is not torch.optim.AdamW:
            return None
        master = self.weights.master
        group = next(g for g in self.inner.param_groups if any(p is master for p in g["params"]))
        plain = not (group.get("amsgrad") or group.get("maximize") or group.get("differentiable"))
        numbers = not any(torch.is_tensor(x) for x in (*group["betas"], group["eps"], group["weight_decay"]))
        return group if plain and numbers else None

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def step(self, clip_grads=None) -> None:
        """Gather the gradients, step, scatter. clip_grads(params), when given, runs between the gather and
        the update on the inner optimizer's parameters (the fp32 master and the others), so that gradient
        clipping sees fp32 gradients, as it does under autocast. Without clipping, and with an AdamW the
        one-pass kernel computes (flat_group), the master is left out of torch's step (no gradient) and
        the kernel updates it from the low-precision gradients and writes the model's weights."""
        if self.flat_group is not None and clip_grads is None:
            table = self.weights.low_grads_table()
            self._flat_step(self.weights.gather_low_grads() if table is None else table, table is not None)
            return
        self.weights.gather_grads()
        if clip_grads is not None:
            clip_grads([p for group in self.inner.param_groups for p in group["params"]])
        self.inner.step()
        self.weights.scatter_params()

    def _flat_step(self, grads: torch.Tensor, in_place: bool) -> None:
        """The master's one-pass AdamW step from its gradients: one flat low-precision tensor, or (in_place)
        the table of their addresses (MasterWeights.low_grads_table)."""
        from workbench.kernels.adamw import adamw_flat_step, adamw_grads_step

        master, group = self.weights.master, self.flat_group
        if master.grad is not None:   # a clipped step made the fp32 gradient: torch's step must not see it
            master.grad = None
        self.inner.step()
        state = self.inner.state[master]
        if not state:   # as torch's AdamW starts a parameter's state (its step count on the device)
            state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
            state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        hyper = dict(lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"])
        with torch.no_grad():
            if in_place:
                adamw_grads_step(grads, self.weights.grads_layout(), master.detach(), state["exp_avg"],
                                 state["exp_avg_sq"], state["step"], self.weights.flat, grad_dtype=self.weights.dtype,
                                 **hyper)
            else:
                adamw_flat_step(grads, master.detach(), state["exp_avg"], state["exp_avg_sq"], state["step"],
                                self.weights.flat, **hyper)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # The master's gradient is a persistent buffer that gather_grads overwrites: left alone.
        for p in self.model_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


def in_your_loop(params: dict, ctx: PassContext) -> str | None:
    """What a loop of your own gets instead of this pass (workbench.optimize.patching.patch_swin): its bf16
    weights need optimize_swin's optimizer over the fp32 masters, so they stay fp32 here. None for a patch
    planned for inference, or for fp32 (no autocast: nothing to say about its casts)."""
    if not ctx.training or ctx.precision.amp_dtype is None:
        return None
    return ("not applied: the weights stay fp32 and autocast casts them per GEMM (bf16 weights with fp32 "
            "masters come with optimize_swin's step)")


def apply(model: torch.nn.Module, ctx: PassContext, step: str = "auto"):
    if step not in STEPS:
        raise UserError(f"pass master_weights: step must be one of {', '.join(STEPS)}, got {step!r}")
    if step == "triton" and not triton_runs_on(ctx.device):
        raise PassUnavailable("step triton: the Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1 on the CPU)")
    dtype = ctx.precision.amp_dtype
    if dtype is not torch.bfloat16:
        raise PassUnavailable(f"master weights need bf16 autocast (this stage runs {ctx.precision.name}); "
                              "fp16 would need the GradScaler to unscale low-precision gradients")
    if ctx.master_weights is not None:
        raise PassUnavailable("master weights are already in place")
    if ctx.sharded:
        return model, PassResult(NAME, {}, "not applied under FSDP: its mixed precision keeps fp32 sharded "
                                           "parameters and gathers them in bf16", {"applied": False})
    params = gemm_parameters(model, ctx.training)
    if not params:
        raise PassUnavailable("no fp32 Linear or Conv2d parameters in this model")
    flat = ctx.training and step != "torch" and triton_runs_on(ctx.device)
    ctx.master_weights = MasterWeights(params, dtype, keep_master=ctx.training, flat_step=flat)
    n = sum(p.numel() for p in params)
    stepped = "by the optimizer" + (" (torch's AdamW: in one kernel from the bf16 gradients)" if flat else "")
    changed = (f"{len(params)} Linear/Conv2d weights and biases ({n / 1e6:.1f}M values) stored in bf16 "
               + (f"(no autocast casts), fp32 masters stepped {stepped}" if ctx.training else
                  "(no autocast casts); inference keeps no fp32 copy"))
    details = {"parameters": len(params), "values": n, "dtype": "bfloat16"}
    if ctx.training:
        details["step"] = "one-pass AdamW kernel for torch's AdamW" if flat else "torch"
    return model, PassResult(NAME, {"step": step}, changed, details)
