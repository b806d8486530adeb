"""A recipe in your own training loop: `optimize_swin` and the `OptimizedSwin` it returns.

`optimize_swin(model, recipe)` applies a recipe's passes (`recipes.apply_chain_passes`, what the ladder
applies) to a timm Swin the user built, in place, and builds the optimizer the recipe asks for. The
`OptimizedSwin` then runs what a training loop needs, the way the recipe says:

    train_step(images, targets, loss_fn)   autocast forward, the user's loss, backward, gradient clipping,
                                           gradient accumulation, the optimizer step (fused, over fp32
                                           master weights where the recipe says); with `cuda_graph`,
                                           the whole step replayed as one CUDA graph
    predict(images)                        logits in eval mode, without autograd (a CUDA graph too)
    optimizer                              the torch Optimizer holding the param groups: LR schedulers
    state_dict() / load_state_dict()       the weights as a plain timm Swin holds them (fp32 masters;
                                           under FSDP gathered whole on every rank)
    optimizer_state_dict() / load_...      the optimizer's state, to resume (under FSDP each rank's shard)
    ema_state_dict() / predict(ema=True)   with `ema`: an exponential moving average of the fp32 weights
    averaged_weights()                     (the masters under master weights), updated after every
                                           optimizer step (inside the CUDA graph of a graph recipe); the
                                           block puts the averages in place for a whole evaluation

images: (N, 3, H, W) float at the model's input size, on any device (copied to the model's). targets:
whatever `loss_fn(logits, targets)` takes: class indices (N,) int64, or soft targets (N, classes) float from
mixup / cutmix. `loss_fn` defaults to F.cross_entropy (which takes both) and gets fp32 logits.

CUDA graphs (recipes with the `cuda_graph` pass). The first GRAPH_WARMUP_STEPS optimizer steps run eagerly
on a side stream (Triton autotuning, the optimizer's state); each is a real training step on the batch it
was given. The next call captures the step (forward, backward, clipping, optimizer) into a graph whose
inputs are static buffers, then every call copies its batch into them and replays. With accumulation a
second graph holds the micro-step (forward, backward into persistent gradients). The graph's step reads
the learning rate from a tensor: for torch's Adam and AdamW each group's lr becomes a 0-dim tensor on the
device, which LR schedulers fill in place; a plain number put into a group is copied into that tensor
before the next replay. For other optimizers the lr is a number frozen into the graph, so a changed lr
makes the next call capture again (said once). A batch of another shape or dtype (the last, smaller
batch of an epoch), another loss_fn or a model in eval mode runs that step eagerly instead, on the same
weights, gradients and optimizer state, and says so once per reason (GraphFallbackWarning, `notes`,
`eager_fallbacks`).
Under DDP the all-reduce of the gradients is captured with the step: DDP is built on a side stream, the
first DDP_GRAPH_WARMUP_STEPS optimizer steps run eagerly instead, and an accumulation micro-step's graph
is captured under DDP's no_sync (one all-reduce per optimizer step, in the step's graph).
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from workbench.arguments import require_count, require_positive
from workbench.errors import UserError
from workbench.files import short_repr
from workbench.optimize.distributed import (DDP_GRAPH_WARMUP_STEPS, DataParallel, FullyShard, Parallel, asked_strategy,
                                            data_parallel_settings, full_state_dict, fully_shard_model,
                                            load_full_state_dict, require_shard_units, sharding_blocker,
                                            wrap_data_parallel, world_size)
from workbench.optimize.inference import GraphFallbackWarning, PredictGraphs, check_images
from workbench.optimize.passes import PassContext, PassResult, default_optimizer_factory, refuse_unpatchable
from workbench.optimize.recipes import (Recipe, RecipeUnavailable, apply_chain_passes, inference_only_pass,
                                        is_graph_form, replays_inductor_graphs, resolve_chain)
from workbench.precision import resolve_precision

GRAPH_WARMUP_STEPS = 3        # eager optimizer steps before the training step is captured
ADAMW_SETTINGS = ("lr", "betas", "eps", "weight_decay")

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _adamw_settings(values: dict, where: str) -> dict:
    if not isinstance(values, dict):
        raise UserError(f"{where} must be a dict of AdamW settings ({', '.join(ADAMW_SETTINGS)}), got "
                        f"{short_repr(values)}")
    unknown = sorted(set(values) - set(ADAMW_SETTINGS))
    if unknown:
        raise UserError(f"{where}: unknown AdamW setting {short_repr(unknown[0])} (the recipe picks the "
                        f"implementation; settings: {', '.join(ADAMW_SETTINGS)})")
    for key, value in values.items():
        if key == "betas":
            ok = (isinstance(value, (tuple, list)) and len(value) == 2
                  and all(_real(b) and 0 <= b < 1 for b in value))
            if not ok:
                raise UserError(f"{where}: betas must be two numbers from 0 to below 1, e.g. (0.9, 0.999), got "
                                f"{short_repr(value)}")
        elif isinstance(value, torch.Tensor) and key == "lr":
            if value.numel() != 1 or not value.is_floating_point():
                raise UserError(f"{where}: lr as a tensor must hold one float, got {short_repr(value)}")
        elif not (_real(value) and value >= 0):
            raise UserError(f"{where}: {key} must be a number >= 0, got {short_repr(value)}")
    return dict(values)


def _real(value) -> bool:
    """A finite real number (a float, an int or a numpy scalar), not a bool."""
    import numbers

    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _optimizer_choice(optimizer, optimizer_kwargs) -> tuple[dict | None, Callable | None, str]:
    """-> (AdamW settings, or None; a factory of the user's, or None; its name). AdamW (settings, the class,
    or nothing) lets the recipe choose the implementation; anything else is the user's own optimizer."""
    if optimizer is None or optimizer is torch.optim.AdamW:
        return _adamw_settings(optimizer_kwargs or {}, "optimizer_kwargs"), None, "AdamW"
    if optimizer_kwargs is not None and not isinstance(optimizer, type):
        raise UserError("optimizer_kwargs go with an optimizer class (optimizer=torch.optim.SGD); a factory "
                        "takes its settings itself")
    if isinstance(optimizer, dict):
        return _adamw_settings(optimizer, "optimizer"), None, "AdamW"
    if isinstance(optimizer, type):
        if not issubclass(optimizer, torch.optim.Optimizer):
            raise UserError(f"optimizer {optimizer.__name__} is not a torch.optim.Optimizer class")
        kwargs = dict(optimizer_kwargs or {})
        return None, (lambda params: optimizer(params, **kwargs)), f"{optimizer.__module__}.{optimizer.__name__}"
    if callable(optimizer):
        return None, optimizer, getattr(optimizer, "__name__", type(optimizer).__name__)
    raise UserError(f"optimizer must be None, a dict of AdamW settings, an optimizer class or a factory "
                    f"params -> optimizer, got {short_repr(optimizer)}")


def _tensor_lr_ok(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` takes a tensor lr in its capturable step (torch's Adam and AdamW do)."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


def _capturable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether replaying a captured step of `optimizer` updates like stepping it: it has a capturable
    mode (its step count lives on the device), or keeps no step count on the host (SGD)."""
    return all("capturable" in g for g in optimizer.param_groups) or isinstance(optimizer, torch.optim.SGD)


@dataclass
class _TrainGraphs:
    """The captured training step: graphs by kind ('step': forward, backward, update; 'micro': forward and
    backward of an accumulation step), each with its static (logits, loss); what it was captured for."""

    graphs: dict[str, tuple[Any, torch.Tensor, torch.Tensor]]
    x: torch.Tensor
    y: torch.Tensor
    loss_fn: Callable
    training: bool
    number_lrs: list            # the lr of each group that keeps it as a number (None where a tensor)
    grad_norm: torch.Tensor | None = None   # the step graph's gradient norm before clipping (with grad_clip)


class OptimizedSwin:
    """A timm Swin patched by a recipe, with the optimizer the recipe builds and the calls a training loop
    needs (see the module's docstring). Build it with `optimize_swin`.

    model: the patched model (the object given to optimize_swin; under FSDP sharded in place, its
    parameters DTensor shards). optimizer: the torch Optimizer whose param_groups set the learning rate;
    step it through train_step only (under master weights it holds the fp32 masters, and train_step
    gathers their gradients first). recipe: its name; passes: the PassResult of every pass of its chain;
    notes: what the user should know (said once each). optimizer_steps, micro_steps: counts; updated:
    whether the last train_step stepped the optimizer. last_logits: the logits of the last train_step
    (overwritten by the next one). last_grad_norm: with grad_clip, the global gradient norm before
    clipping of the last optimizer step (a 0-dim fp32 tensor on the device, read without a host sync;
    None before the first step or without clipping): the figure to watch for loss spikes.
    data_parallel: the DataParallel or FullyShard settings, or None; ddp: the DDP wrapper the training
    step runs, or None; sharded: whether FSDP2 shards the model.
    """

    def __init__(self, model: torch.nn.Module, ctx: PassContext, chain: list[Recipe], passes: list[PassResult],
                 *, loss_fn: LossFn | None, grad_clip: float | None, accumulate: int, notes: list[str],
                 data_parallel: Parallel | None = None, ema: float | None = None):
        self.model = model
        self.ctx = ctx
        self.chain = chain
        self.recipe = chain[-1].name if chain else "baseline"
        self.passes = passes
        self.loss_fn = loss_fn or F.cross_entropy
        self.grad_clip = grad_clip
        self.accumulate = accumulate
        self.notes = list(notes)
        self.device = ctx.device
        self.micro_steps = 0
        self.optimizer_steps = 0
        self.updated = False
        self.eager_fallbacks = 0
        self.last_logits: torch.Tensor | None = None
        self.last_grad_norm: torch.Tensor | None = None
        # NVTX / torch.profiler ranges around forward, backward, optimizer and a graph's replay (the
        # harness's RangeMarker while it profiles; None: no ranges)
        self.marker = None

        ctx.precision.apply_matmul_mode()
        self.data_parallel = data_parallel
        self.world_size = world_size() if data_parallel is not None else 1
        self.ddp = None
        self.sharded = isinstance(data_parallel, FullyShard)
        if self.sharded:
            # the optimizer steps the DTensor shards, so it is built after sharding
            bf16 = ctx.precision.amp_dtype is torch.bfloat16
            fully_shard_model(model, data_parallel, torch.bfloat16 if bf16 else None)
        self._master = ctx.master_weights
        if self._master is not None:
            self._stepper = self._master.optimizer(ctx.optimizer_factory, model.parameters())
            self.optimizer = self._stepper.inner
        else:
            from workbench.optimize.passes.master_weights import check_optimizer

            given = list(model.parameters())
            self._stepper = self.optimizer = check_optimizer(ctx.optimizer_factory(given), given,
                                                             "the model's parameters")
        self.graphed = bool(ctx.cuda_graph)
        # the one side stream of a graph recipe: DDP is built, warmed up, captured and falls back on it
        self._graph_stream = torch.cuda.Stream(self.device) if self.graphed and self.device.type == "cuda" else None
        if isinstance(data_parallel, DataParallel):
            self.ddp = wrap_data_parallel(model, self.device, data_parallel, stream=self._graph_stream)
            if self._master is not None:
                # DDP broadcast rank 0's bf16 weights; the fp32 masters the optimizer steps must follow
                import torch.distributed as dist

                dist.broadcast(self._master.master.data, src=0)
                self._master.scatter_params()
        self.scaler = torch.amp.GradScaler("cuda") if ctx.grad_scaler and self.device.type == "cuda" else None
        self.ema_decay = ema
        self._ema: list[torch.Tensor] = []          # the averages, in the order of _ema_sources
        self._ema_sources: list[torch.Tensor] = []  # the fp32 weights they follow (the flat master first)
        self._ema_params: list[torch.nn.Parameter] = []  # the parameters outside the master, after it in _ema
        self._averaged = False                      # inside averaged_weights(): the model holds the averages
        if ema is not None:
            self._build_ema()
        # eager optimizer steps before a CUDA graph is captured (DDP's reducer needs more of them)
        self.graph_warmup_steps = DDP_GRAPH_WARMUP_STEPS if self.ddp is not None else GRAPH_WARMUP_STEPS
        self._forward_loss = self._forward_loss_eager
        self._predict_forward = self._predict_eager
        if ctx.compile:
            self._forward_loss = torch.compile(self._forward_loss_eager, **ctx.compile_options)
            self._predict_forward = torch.compile(self._predict_eager, **ctx.compile_options)

        # accumulation under a graph adds into gradient buffers that live across steps
        self._persistent_grads = self.graphed and accumulate > 1
        self._lr_tensors: list[torch.Tensor | None] = [None] * len(self.optimizer.param_groups)
        self._train_graphs: _TrainGraphs | None = None
        # predict's graph: one batch shape (a validation's last, smaller batch runs eagerly); the weights
        # change between replays, so SwinV2's weight terms are computed in the graph
        self._predict_graphs = (PredictGraphs(lambda x: self._predict_forward(x), self.device,
                                              on_eager=self._predict_fell_back, terms_every_call=True)
                                if self.device.type == "cuda" else None)
        self._warm_micro_steps = 0
        self._said: set[str] = set()
        if self.graphed:
            self._make_capturable()

    # ------------------------------------------------------------------ building

    def _make_capturable(self) -> None:
        if not _capturable(self.optimizer):
            raise UserError(f"recipe {self.recipe!r} captures the training step in a CUDA graph, and "
                            f"{type(self.optimizer).__name__} has no capturable mode (its step count lives on "
                            "the host): use AdamW, Adam, SGD, or a recipe without cuda_graph")
        for i, group in enumerate(self.optimizer.param_groups):
            if "capturable" in group:
                group["capturable"] = True
                # an optimizer that stepped eagerly (for-each AdamW) keeps its step counts on the host; a
                # capturable one reads them on the device
                for p in group["params"]:
                    state = self.optimizer.state.get(p, {})
                    step = state.get("step")
                    if torch.is_tensor(step) and step.device != p.device:
                        state["step"] = step.to(device=p.device, dtype=torch.float32)
            if _tensor_lr_ok(self.optimizer):
                self._lr_tensors[i] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=self.device)
                group["lr"] = self._lr_tensors[i]

    def use_graph(self, on: bool = True) -> None:
        """Replay the training step as one CUDA graph from the next train_step on (its eager warm-up steps,
        then the capture), or (off) step eagerly again, on the same weights and optimizer state: a recipe
        without cuda_graph timed in its graph-replayed form, as `apply` does. The optimizer stays in its
        capturable mode once on."""
        if on == self.graphed:
            return
        if on and self.sharded:
            raise UserError("use_graph: swinbench does not capture an FSDP step as a CUDA graph (its all-gathers and "
                            "reduce-scatters inside a captured step are not built and checked); use DDP")
        self.graphed = on
        self._persistent_grads = on and self.accumulate > 1
        self._train_graphs = None
        self._warm_micro_steps = 0
        if on:
            if self._graph_stream is None and self.device.type == "cuda":
                self._graph_stream = torch.cuda.Stream(self.device)
            self._make_capturable()
        else:
            # the gradients were the graph's buffers: eager steps start from none
            self._stepper.zero_grad(set_to_none=True)

    def describe(self) -> str:
        """A few lines: the recipe, what each pass changed, the optimizer, the precision, the notes."""
        lines = [f"recipe {self.recipe} ({' -> '.join(r.name for r in self.chain)}), precision "
                 f"{self.ctx.precision.name}, optimizer {self.ctx.optimizer_name}"
                 + (" on fp32 master weights" if self._master is not None else "")
                 + (", CUDA graph" if self.graphed else "")
                 + (f", EMA of the weights (decay {self.ema_decay})" if self._ema else "")
                 + (f", {self.data_parallel.strategy.upper()} over {self.world_size} processes "
                    f"({self.data_parallel})" if self.data_parallel is not None else "")]
        lines += [f"  {p.name}: {p.changed}" for p in self.passes]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"OptimizedSwin(recipe={self.recipe!r}, precision={self.ctx.precision.name!r}, device={self.device})"

    # ------------------------------------------------------------------ modes

    def train(self, mode: bool = True) -> "OptimizedSwin":
        self.model.train(mode)
        return self

    def eval(self) -> "OptimizedSwin":
        return self.train(False)

    # ------------------------------------------------------------------ training

    def _forward_loss_eager(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable):
        with self.ctx.precision.autocast(self.device.type):
            logits = (self.ddp if self.ddp is not None else self.model)(x)
            loss = loss_fn(logits.float(), y)
        return logits, loss

    def _clip(self, params) -> None:
        norm = torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], self.grad_clip)
        # under FSDP the norm of sharded gradients is a DTensor: the plain tensor every rank agrees on
        self.last_grad_norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def _update(self) -> None:
        """Clip (when asked) and step the optimizer, from the gradients in place; then move the EMA."""
        clip = self._clip if self.grad_clip is not None else None
        if self.scaler is not None:
            if clip is not None:
                self.scaler.unscale_(self.optimizer)
                clip(self.model.parameters())
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif self._master is not None:
            self._stepper.step(clip_grads=clip)
        else:
            if clip is not None:
                clip(self.model.parameters())
            self._stepper.step()
        if self._ema:
            with torch.no_grad():
                torch._foreach_lerp_(self._ema, self._ema_sources, 1.0 - self.ema_decay)

    # ------------------------------------------------------------------ the EMA of the weights

    def _build_ema(self) -> None:
        """The averages start at the weights as they are now: fp32 copies of the flat master (under master
        weights) and of every other floating parameter."""
        lowp = set()
        if self._master is not None:
            self._ema_sources.append(self._master.master.detach())
            lowp = {id(p) for p in self._master.params}
        for name, p in self.model.named_parameters():
            if id(p) in lowp or not p.is_floating_point():
                continue
            if p.dtype != torch.float32:
                raise UserError(f"ema: parameter {name} is {p.dtype}; the average is kept of fp32 weights (give "
                                "optimize_swin the model in fp32)")
            self._ema_params.append(p)
            self._ema_sources.append(p.detach())
        self._ema = [t.clone() for t in self._ema_sources]

    def _reseed_ema(self) -> None:
        """The averages start again at the weights as they are now (after load_state_dict: pretrained or
        resumed weights; a resumed run then loads its average with load_ema_state_dict)."""
        if self._ema:
            with torch.no_grad():
                torch._foreach_copy_(self._ema, self._ema_sources)

    def _require_ema(self, what: str) -> None:
        if not self._ema:
            raise UserError(f"{what}: this OptimizedSwin keeps no EMA of its weights (give optimize_swin ema=DECAY)")

    def _ema_values(self) -> dict[str, torch.Tensor]:
        """state_dict key -> the average of that parameter (views of the averages); every name of a tied
        parameter maps to its one average."""
        first = 1 if self._master is not None else 0
        index = {id(p): first + i for i, p in enumerate(self._ema_params)}
        values = {name: self._ema[index[id(p)]] for name, p in self.model.named_parameters(remove_duplicate=False)
                  if id(p) in index}
        if self._master is not None:
            views = self._master.views_of(self._ema[0])
            values.update({name: views[i] for name, i in self._master_names().items()})
        return values

    def ema_state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged weights as a plain timm Swin holds them (its keys, fp32; buffers as the model's
        now): save it beside state_dict(), or load it into timm's model to evaluate the average."""
        self._require_ema("ema_state_dict")
        state = self.model.state_dict()
        state.update({name: value.detach().clone() for name, value in self._ema_values().items()})
        return state

    def load_ema_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Set the averages from what ema_state_dict() gave (or any state_dict of the same Swin), to resume
        a run with its EMA. In place: a captured graph stays valid."""
        self._require_ema("load_ema_state_dict")
        self._refuse_while_averaged("load_ema_state_dict")
        values = self._ema_values()
        missing = sorted(set(values) - set(state_dict))
        if missing:
            raise UserError(f"load_ema_state_dict: the state_dict lacks {len(missing)} parameter(s), e.g. {missing[0]}")
        with torch.no_grad():
            for name, value in values.items():
                given = state_dict[name]
                if not isinstance(given, torch.Tensor):
                    raise UserError(f"load_ema_state_dict: {name} is {short_repr(given)}, not a tensor")
                if tuple(given.shape) != tuple(value.shape):
                    raise UserError(f"load_ema_state_dict: {name} is {tuple(given.shape)}, the model's "
                                    f"{tuple(value.shape)}")
                value.copy_(given)

    @contextlib.contextmanager
    def averaged_weights(self):
        """The model computes with the averaged weights inside the block (rounded to bf16 where it computes
        with bf16 copies of fp32 masters) and with its trained weights again after it, bit for bit: in
        place, so captured graphs stay valid. Put them in place once around a whole evaluation:

            with swin.averaged_weights():
                for images, targets in val_loader:
                    logits = swin.predict(images)

        Inside it predict() computes with the averages; train_step, state_dict and the loads are refused
        (ema_state_dict() gives the averaged weights)."""
        self._require_ema("averaged_weights()")
        if self._averaged:
            raise UserError("averaged_weights(): already inside an averaged_weights() block")
        first = 1 if self._master is not None else 0
        with torch.no_grad():
            saved_flat = self._master.flat.clone() if self._master is not None else None
            saved = [p.detach().clone() for p in self._ema_params]
            if self._master is not None:
                self._master.flat.copy_(self._ema[0])
            for i, p in enumerate(self._ema_params):
                p.detach().copy_(self._ema[first + i])
        self._averaged = True
        try:
            yield self
        finally:
            self._averaged = False
            with torch.no_grad():
                if saved_flat is not None:
                    self._master.flat.copy_(saved_flat)
                for p, value in zip(self._ema_params, saved):
                    p.detach().copy_(value)

    def _refuse_while_averaged(self, what: str) -> None:
        if self._averaged:
            raise UserError(f"{what} inside averaged_weights(): the model holds the averaged weights there; "
                            "call it after the block")

    def _range(self, name: str):
        return self.marker.range(name) if self.marker is not None else contextlib.nullcontext()

    def _eager_step(self, x, y, loss_fn, last: bool) -> torch.Tensor:
        # under DDP, an accumulation micro-step keeps its gradients local: one all-reduce per optimizer step
        with (self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()):
            with self._range("forward"):
                logits, loss = self._forward_loss(x, y, loss_fn)
            with self._range("backward"):
                backward = loss / self.accumulate if self.accumulate > 1 else loss
                (self.scaler.scale(backward) if self.scaler is not None else backward).backward()
        if last:
            with self._range("optimizer"):
                self._update()
                self._stepper.zero_grad(set_to_none=not self._persistent_grads)
        self.last_logits = logits.detach()
        return loss.detach()

    def train_step(self, images: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn | None = None) -> torch.Tensor:
        """One micro-batch: forward under the recipe's autocast, loss_fn(fp32 logits, targets) (default: the
        one given to optimize_swin, else F.cross_entropy), backward (of loss / accumulate), and on every
        `accumulate`-th call gradient clipping and the optimizer step. -> the micro-batch's loss (0-dim fp32,
        not divided by accumulate). `updated` says whether the optimizer stepped."""
        self._refuse_while_averaged("train_step")
        images = check_images(images, self.model, "train_step")
        if not isinstance(targets, torch.Tensor) or targets.dim() < 1 or targets.shape[0] != images.shape[0]:
            raise UserError(f"train_step: targets must be a tensor with one row per image ({images.shape[0]}), got "
                            f"{short_repr(targets) if not isinstance(targets, torch.Tensor) else tuple(targets.shape)}")
        loss_fn = loss_fn or self.loss_fn
        last = (self.micro_steps + 1) % self.accumulate == 0
        if self.graphed:
            loss = self._graph_train_step(images, targets, loss_fn, last)
        else:
            loss = self._eager_step(self._on_device(images), self._on_device(targets), loss_fn, last)
        self.micro_steps += 1
        self.updated = last
        self.optimizer_steps += int(last)
        return loss

    @property
    def stepper(self):
        """What steps the weights: `optimizer` itself, or with master weights the stepper that widens the
        gradients, steps `optimizer` over the fp32 masters and narrows them back (its `step`/`zero_grad`)."""
        return self._stepper

    @property
    def graph_captured(self) -> bool:
        """Whether the training step has been captured as a CUDA graph (after the eager warm-up steps)."""
        return self._train_graphs is not None

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ the CUDA graph of the training step

    def _say(self, key: str, text: str) -> None:
        if key not in self._said:
            self._said.add(key)
            self.notes.append(text)
            warnings.warn(text, GraphFallbackWarning, stacklevel=4)

    def _graph_train_step(self, images, targets, loss_fn, last: bool) -> torch.Tensor:
        if self._train_graphs is None and self._warm_micro_steps < self.graph_warmup_steps * self.accumulate:
            self._warm_micro_steps += 1
            with self._on_graph_stream():
                return self._eager_step(self._on_device(images), self._on_device(targets), loss_fn, last)
        if self._train_graphs is None:
            self._capture_train(images, targets, loss_fn)
        reason = self._train_mismatch(images, targets, loss_fn)
        if reason is not None:
            self.eager_fallbacks += 1
            self._say(f"train:{reason[0]}", f"train_step ran eagerly: {reason[1]}")
            if not self._persistent_grads:
                # the gradients are the graph's buffers: start from none, as each replay does
                self._stepper.zero_grad(set_to_none=True)
            with self._on_graph_stream():
                return self._eager_step(self._on_device(images), self._on_device(targets), loss_fn, last)
        self._sync_lr()
        tg = self._train_graphs
        tg.x.copy_(images, non_blocking=True)
        tg.y.copy_(targets, non_blocking=True)
        graph, logits, loss = tg.graphs["step" if last else "micro"]
        with self._range("graph"):
            graph.replay()
        self.last_logits = logits
        if last and tg.grad_norm is not None:
            self.last_grad_norm = tg.grad_norm
        return loss.clone()

    @contextlib.contextmanager
    def _on_graph_stream(self):
        """Run eager work of a graph recipe on its side stream (ordered after, and before, the current
        stream's work): where capture requires warm-up to run, and where DDP's hooks were made."""
        if self._graph_stream is None:     # use_graph(True) off a GPU: say so rather than fail on None
            raise UserError(f"a CUDA graph of the training step needs a CUDA device; this model is on {self.device}")
        current = torch.cuda.current_stream(self.device)
        self._graph_stream.wait_stream(current)
        with torch.cuda.stream(self._graph_stream):
            yield
        current.wait_stream(self._graph_stream)

    def _train_mismatch(self, images, targets, loss_fn) -> tuple[str, str] | None:
        tg = self._train_graphs
        if images.shape != tg.x.shape or images.dtype != tg.x.dtype:
            return "shape", (f"a batch of {tuple(images.shape)} {images.dtype} (the graph holds "
                             f"{tuple(tg.x.shape)} {tg.x.dtype}): such batches run eagerly, on the same weights")
        if targets.shape != tg.y.shape or targets.dtype != tg.y.dtype:
            return "targets", (f"targets of {tuple(targets.shape)} {targets.dtype} (the graph holds "
                               f"{tuple(tg.y.shape)} {tg.y.dtype})")
        if loss_fn is not tg.loss_fn:
            return "loss_fn", "a loss_fn other than the one the graph was captured with"
        if self.model.training != tg.training:
            return "mode", (f"the model is in {'train' if self.model.training else 'eval'} mode; the graph was "
                            f"captured in {'train' if tg.training else 'eval'} mode")
        return None

    def _number_lrs(self) -> list:
        return [None if t is not None else g["lr"] for g, t in zip(self.optimizer.param_groups, self._lr_tensors)]

    def _sync_lr(self) -> None:
        """Make the captured step see the groups' learning rates: a number put where the graph reads a
        tensor is copied into that tensor; a changed number the graph holds frozen means capturing again."""
        for group, t in zip(self.optimizer.param_groups, self._lr_tensors):
            if t is not None and group["lr"] is not t:
                t.fill_(group["lr"])
                group["lr"] = t
        tg = self._train_graphs
        if self._number_lrs() != tg.number_lrs:
            self._say("lr", f"the learning rate changed and {type(self.optimizer).__name__} keeps it as a number "
                            "in the CUDA graph: the step is captured again at every change")
            self._capture_train(tg.x, tg.y, tg.loss_fn)

    def _capture_train(self, images, targets, loss_fn) -> None:
        """Capture the training step (and with accumulation the micro-step) for batches like these."""
        self._train_graphs = None
        x = torch.empty_like(images, device=self.device).copy_(images)
        y = torch.empty_like(targets, device=self.device).copy_(targets)
        torch.cuda.synchronize(self.device)
        if not self._persistent_grads:
            # gradients are then allocated inside the graph's pool and written by every replay
            self._stepper.zero_grad(set_to_none=True)
        pool = torch.cuda.graph_pool_handle()
        graphs, norm = {}, None
        for kind in (("micro", "step") if self.accumulate > 1 else ("step",)):
            graph = torch.cuda.CUDAGraph()
            # under DDP a micro-step keeps its gradients local: the step's graph holds the one all-reduce
            local = self.ddp.no_sync() if self.ddp is not None and kind == "micro" else contextlib.nullcontext()
            with local, torch.cuda.graph(graph, pool=pool, stream=self._graph_stream):
                logits, loss = self._forward_loss(x, y, loss_fn)
                (loss / self.accumulate if self.accumulate > 1 else loss).backward()
                if kind == "step":
                    self._update()
                    norm = self.last_grad_norm if self.grad_clip is not None else None
                    if self._persistent_grads:
                        self._stepper.zero_grad(set_to_none=False)
            graphs[kind] = (graph, logits.detach(), loss.detach())
        self._train_graphs = _TrainGraphs(graphs, x, y, loss_fn, self.model.training, self._number_lrs(), norm)

    # ------------------------------------------------------------------ inference

    def _predict_eager(self, x: torch.Tensor) -> torch.Tensor:
        with self.ctx.precision.autocast(self.device.type):
            return self.model(x)

    def predict(self, images: torch.Tensor, ema: bool = False) -> torch.Tensor:
        """Logits (N, classes) fp32 of `images` with the model in eval mode (put back as it was after) under
        the recipe's autocast and torch.inference_mode. With `cuda_graph`, replayed as one graph, captured
        for the first batch shape called three times; batches of another shape run eagerly (said once). ema: with the averaged
        weights (optimize_swin's `ema`), put in place for the call and the trained ones back after it (inside
        averaged_weights() every call computes with them, and they stay in place)."""
        from workbench.optimize.passes.fused_attention import terms_in_every_call

        if ema:
            self._require_ema("predict(ema=True)")
        images = check_images(images, self.model, "predict")
        modes = [(m, m.training) for m in self.model.modules()]    # each module's own, restored after
        self.model.eval()
        try:
            averaged = self.averaged_weights() if ema and not self._averaged else contextlib.nullcontext()
            # the weights change between calls, also where no op says so (a graph's replayed step, a fused
            # optimizer writing through pointers): SwinV2's weight terms are computed in every forward
            with averaged, terms_in_every_call():
                with torch.inference_mode():
                    if self.graphed and self._predict_graphs is not None:
                        out = self._predict_graphs(images)
                    else:
                        out = self._predict_forward(self._on_device(images))
                # copied outside inference mode: a tensor autograd can use (a distillation target)
                return out.to(torch.float32, copy=True)
        finally:
            for module, training in modes:
                module.training = training

    def _predict_fell_back(self, key: str, text: str) -> None:
        self.eager_fallbacks += 1
        self._say(key, text)

    # ------------------------------------------------------------------ checkpoints

    def _master_names(self) -> dict[str, int]:
        """state_dict key -> index into the master weights' parameters."""
        index = {id(p): i for i, p in enumerate(self._master.params)}
        return {name: index[id(p)] for name, p in self.model.named_parameters(remove_duplicate=False)
                if id(p) in index}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights under the keys, dtypes and values a plain timm Swin holds: under master
        weights the fp32 masters (copies), not their bf16 copies; under FSDP every tensor gathered whole
        (a collective: every rank calls it, and every rank gets it all). Loads into timm's model as it is."""
        self._refuse_while_averaged("state_dict()")
        if self.sharded:
            return full_state_dict(self.model)
        state = self.model.state_dict()
        if self._master is not None:
            views = self._master.fp32_views()
            for name, i in self._master_names().items():
                state[name] = views[i].detach().clone()
        return state

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True):
        """Load weights saved by `state_dict()` or by a plain timm Swin of the same architecture, in place
        (a captured graph stays valid). Under master weights the fp32 values go to the masters, and the
        bf16 weights become the masters rounded. Under FSDP every rank gives the whole state_dict and keeps
        its shards. With `ema`, the average starts again at the loaded weights (load_ema_state_dict after
        this to resume one). -> torch's (missing_keys, unexpected_keys)."""
        self._refuse_while_averaged("load_state_dict")
        from torch.nn.modules.module import _IncompatibleKeys

        if self.sharded:
            return load_full_state_dict(self.model, state_dict, strict=strict)
        if self._master is None:
            result = self.model.load_state_dict(state_dict, strict=strict)
            self._reseed_ema()
            return result
        expected = set(self.model.state_dict())
        missing = sorted(expected - set(state_dict))
        unexpected = sorted(set(state_dict) - expected)
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self.model).__name__}: missing keys "
                               f"{missing[:5]}, unexpected keys {unexpected[:5]}")
        masters = self._master_names()
        rest = {k: v for k, v in state_dict.items() if k not in masters}
        self.model.load_state_dict(rest, strict=False)
        values = list(self._master.fp32_views())
        for name, i in masters.items():
            if name in state_dict:
                value = state_dict[name]
                if tuple(value.shape) != tuple(values[i].shape):
                    raise RuntimeError(f"size mismatch for {name}: checkpoint {tuple(value.shape)}, model "
                                       f"{tuple(values[i].shape)}")
                values[i] = value
        self._master.load_fp32(values)
        self._reseed_ema()
        return _IncompatibleKeys(missing, unexpected)

    def optimizer_state_dict(self) -> dict:
        """The optimizer's state_dict (under master weights: over the flat fp32 master, so it loads into
        the same recipe's optimizer; under FSDP this rank's shards, which load into the same recipe on the
        same number of processes), with learning rates as numbers."""
        state = self.optimizer.state_dict()
        for group in state["param_groups"]:
            if isinstance(group.get("lr"), torch.Tensor):
                group["lr"] = float(group["lr"])
        return state

    def load_optimizer_state_dict(self, state_dict: dict) -> None:
        """Load what `optimizer_state_dict()` gave (of the same recipe and model). A captured training step
        is captured again at the next call: the optimizer's state tensors are new."""
        if self.graphed:
            groups = [{**g, "capturable": True} if "capturable" in g else dict(g) for g in state_dict["param_groups"]]
            state_dict = {**state_dict, "param_groups": groups}
        self.optimizer.load_state_dict(state_dict)
        for group, t in zip(self.optimizer.param_groups, self._lr_tensors):
            if t is not None:
                t.fill_(group["lr"])
                group["lr"] = t
        if self._train_graphs is not None:
            self._train_graphs = None
            self._stepper.zero_grad(set_to_none=not self._persistent_grads)


def optimize_swin(model: torch.nn.Module, recipe: str = "fmha", *, optimizer=None, optimizer_kwargs: dict | None = None,
                  loss_fn: LossFn | None = None, grad_clip: float | None = None, accumulate: int = 1,
                  device: str | torch.device | None = None, allow_unavailable: bool = False,
                  distributed: bool | str | dict | DataParallel | FullyShard | None = None,
                  batch: int | None = None, ema: float | None = None) -> OptimizedSwin:
    """Patch a timm Swin for a recipe and build what trains it -> OptimizedSwin.

    model: a timm Swin (SwinTransformer), in fp32, patched in place (use the returned `.model`).
    recipe: a built-in recipe name (`swinbench recipes`) or a path to a recipe YAML.
    optimizer: None (AdamW with the baseline's settings: lr 1e-4, weight decay 0.05), a dict of AdamW
    settings (lr, betas, eps, weight_decay), or torch.optim.AdamW with `optimizer_kwargs`: the recipe picks
    the implementation (for-each, fused, apex). Another optimizer class (with `optimizer_kwargs`) or a
    factory `params -> Optimizer` is used as it is (the recipe's optimizer choice is then not applied).
    loss_fn: loss_fn(fp32 logits, targets) -> scalar; default F.cross_entropy. grad_clip: max global
    gradient norm, or None. accumulate: micro-batches per optimizer step. device: where to run (default:
    where the model's parameters are). allow_unavailable: go on without passes that cannot run here (no
    GPU for the Triton kernels, no CUDA for graphs) instead of raising; `notes` lists them.
    distributed: data parallel over torch.distributed (the process group initialized by the caller, the
    processes started by torchrun). None: the patched model is wrapped in DistributedDataParallel when
    the group has more than one process; False: never; True, "ddp", a dict of DataParallel settings
    (bucket_cap_mb, gradient_as_bucket_view, static_graph, broadcast_buffers) or a DataParallel: DDP.
    "fsdp", a dict with "strategy": "fsdp" and FullyShard settings (unit, reshard_after_forward) or a
    FullyShard: the patched model is sharded with FSDP2 (fully_shard per Swin block or stage, then the
    root; bf16 recipes gather bf16 parameters and reduce fp32 gradients), the optimizer built over the
    shards, and the master_weights pass stands aside. Each rank then passes its own shard of the global
    batch to train_step; gradients are averaged over the ranks before clipping and the optimizer step.
    Under DDP a recipe that replays CUDA graphs captures the all-reduce inside its graph (after
    DDP_GRAPH_WARMUP_STEPS eager steps); under FSDP such recipes are refused (UserError), and so is fp16
    with its GradScaler on a GPU.
    batch: the images per train_step you will train with (per process), for the passes that time their
    choices at the model's shapes (fused_attention's route per window shape, on a GPU); default 32.
    ema: keep an exponential moving average of the weights with this decay (0 < ema < 1, e.g. 0.9998):
    after every optimizer step average = ema * average + (1 - ema) * weights, over the fp32 weights (the
    masters under master weights, whose bf16 copies are too coarse to average), starting from the weights
    as given or as load_state_dict loads them later. `ema_state_dict()` and `predict(images, ema=True)`
    read it. Not under FSDP.

    A pass that cannot run here raises RecipeUnavailable, a UserError (the model may then be partly
    patched: build it again).
    """
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"model must be a torch.nn.Module (a timm Swin), got {short_repr(model)}")
    refuse_unpatchable(model, "optimize_swin")
    if next(iter(model.parameters()), None) is None:
        raise UserError(f"optimize_swin trains a model's parameters, and this {type(model).__name__} has none: "
                        "give it a timm Swin")
    narrow = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()
                     if p.is_floating_point() and p.dtype != torch.float32})
    if narrow:
        raise UserError(f"optimize_swin takes an fp32 model (the recipe sets the precision), got {', '.join(narrow)} "
                        "parameters: call model.float() first")
    require_count("accumulate", accumulate)
    require_positive("grad_clip", grad_clip, optional=True)
    require_count("batch", batch, optional=True)
    if ema is not None and (isinstance(ema, bool) or not isinstance(ema, (int, float)) or not 0 < ema < 1):
        raise UserError(f"ema must be a decay between 0 and 1 (e.g. 0.9998) or None, got {short_repr(ema)}")
    settings, factory, name = _optimizer_choice(optimizer, optimizer_kwargs)
    chain = resolve_chain(str(recipe))
    only = inference_only_pass(chain)
    if only is not None:    # said before any pass changes the model
        raise RecipeUnavailable(chain[-1].name, f"{only} runs inference only (no backward): optimize_swin "
                                                "trains; measure the recipe with `swinbench apply --mode infer`",
                                patched=False)
    strategy = asked_strategy(distributed)
    if strategy == "fsdp" and any(is_graph_form(r) for r in chain):
        raise UserError(f"recipe {chain[-1].name!r} replays CUDA graphs, which swinbench does not run under FSDP "
                        "(its all-gathers and reduce-scatters inside a captured step are not built and checked): "
                        f"use DDP, or the recipe it extends ({chain[-2].name if len(chain) > 1 else 'baseline'})")
    if strategy == "fsdp" and ema is not None:
        raise UserError("ema: an average of FSDP's sharded weights is not built here; use DDP (distributed='ddp') "
                        "or train without ema")
    data_parallel = data_parallel_settings(distributed, accumulate)
    if isinstance(data_parallel, FullyShard):
        require_shard_units(model, data_parallel.unit)    # said before any pass changes the model
    if data_parallel is not None and replays_inductor_graphs(chain):
        raise UserError(f"recipe {chain[-1].name!r} replays Inductor's own CUDA graphs (reduce-overhead), which "
                        f"swinbench runs under neither DDP nor FSDP: use a recipe that captures the whole step "
                        "(fmha-graph, fmha-compile-graph) under DDP")
    if device is not None:
        from workbench.devices import resolve_device

        dev = resolve_device(str(device), "optimize_swin")
        model.to(dev)
    else:
        dev = next(model.parameters()).device
    ctx = PassContext(device=dev, precision=resolve_precision("fp32"), training=True,
                      sharded=isinstance(data_parallel, FullyShard), batch=batch)
    if factory is not None:
        ctx.optimizer_factory, ctx.optimizer_name = factory, f"{name} (given)"
    elif settings:
        from workbench.optimize.passes.fused_adamw import baseline_hyperparameters

        hp = {**baseline_hyperparameters(), **settings}
        ctx.optimizer_settings = settings
        ctx.optimizer_factory = lambda params: torch.optim.AdamW(params, **hp, foreach=True)
    else:
        ctx.optimizer_factory = default_optimizer_factory
    model, results = apply_chain_passes(model, ctx, chain, stop_unavailable=not allow_unavailable)
    notes = []
    unavailable = [r for r in results if not r.available]
    if unavailable and not allow_unavailable:
        first = unavailable[0]
        raise RecipeUnavailable(chain[-1].name, f"{first.name} {first.changed}")
    notes += [f"pass {r.name} left out: {r.changed}" for r in unavailable]
    notes += [f"pass {r.name} {r.changed}" for r in results if r.details.get("applied") is False]
    blocker = sharding_blocker(ctx.grad_scaler, dev) if ctx.sharded else None
    if blocker:
        raise UserError(f"recipe {chain[-1].name!r}: {blocker}")
    if factory is not None:
        # the recipe's: what a pass (fused_adamw) put in its place, else the plain recipes' for-each AdamW
        recipe_optimizer = (ctx.optimizer_name if ctx.optimizer_factory is not factory
                            else PassContext.optimizer_name)
        notes.append(f"the optimizer given is used, not the recipe's {recipe_optimizer}")
        ctx.optimizer_factory, ctx.optimizer_name = factory, f"{name} (given)"
    if isinstance(data_parallel, DataParallel):
        notes.append(f"DDP over {world_size()} processes: gradients are averaged over the ranks before each step")
    elif data_parallel is not None:
        notes.append(f"FSDP over {world_size()} processes: each rank holds 1/{world_size()} of the weights, gradients "
                     "and optimizer state; gradients are averaged over the ranks before each step")
    return OptimizedSwin(model, ctx, chain, results, loss_fn=loss_fn, grad_clip=grad_clip, accumulate=accumulate,
                         notes=notes, data_parallel=data_parallel, ema=None if ema is None else float(ema))
