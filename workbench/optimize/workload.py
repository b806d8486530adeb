"""The workload: a Swin model, its optimizer and one synthetic batch, stepped with named ranges.

Everything that runs a model goes through `Workload`: `profile` captures its steps, `apply` times
them and compares them with the baseline. A training step is the public API's: `prepare` builds the
`OptimizedSwin` that `optimize_swin` would return for the recipe (its optimizer, master weights, DDP or
FSDP, CUDA graph), and every step is its `train_step`, so what is measured is what a user's loop runs.
Stochastic depth and dropout are off (drop_path_rate=0) so that every recipe stage computes the same
function and the correctness gate can compare them.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from workbench.devices import resolve_device
from workbench.errors import UserError
from workbench.results.record import MAX_COUNT
from workbench.models import build_model, input_size
from workbench.optimize.passes import PassContext
from workbench.precision import Precision, resolve_precision
from workbench.optimize.ranges import RangeMarker


MAX_SEED = 2 ** 62     # seeds and the generators' seed + offsets stay inside torch's 64-bit seeds


@dataclass
class WorkloadConfig:
    model: str
    mode: str = "train"          # 'train' | 'infer'
    batch: int = 32
    precision: str = "bf16"
    device: str = "cuda"
    seed: int = 0
    num_classes: int | None = None
    checkpoint: str | None = None    # trained weights to load (checkpoints.load_checkpoint), inference only
    heldout: str | None = None       # the held-out images' ImageFolder; None: the checkpoint's own data
    img_size: list[int] | None = None  # [H, W]: the model at this resolution; None: its name's

    def __post_init__(self):
        if self.mode not in ("train", "infer"):
            raise UserError(f"unknown mode {self.mode!r}: choose train or infer")
        if not 1 <= self.batch <= MAX_COUNT:
            raise UserError(f"--batch must be a whole number from 1 to {MAX_COUNT}, got {self.batch}")
        if not 0 <= self.seed < MAX_SEED:
            raise UserError(f"--seed must be a whole number from 0 to {MAX_SEED - 1}, got {self.seed}")
        if self.checkpoint is not None and self.mode != "infer":
            raise UserError("--checkpoint goes with --mode infer: it measures the trained model's held-out accuracy")
        if self.heldout is not None and self.checkpoint is None:
            raise UserError("--data goes with --checkpoint: the held-out images a trained model is measured on")


def synthetic_batch(model: torch.nn.Module, batch: int, num_classes: int, device: torch.device, seed: int):
    """Random images (N, 3, H, W) fp32 and labels, from their own generator so every stage gets the same."""
    gen = torch.Generator().manual_seed(seed + 1)
    c, h, w = input_size(model)
    x = torch.randn(batch, c, h, w, generator=gen)
    y = torch.randint(0, num_classes, (batch,), generator=gen)
    return x.to(device), y.to(device)


@dataclass
class Workload:
    """A built model on its device, ready to step. Build with `Workload.build`."""

    config: WorkloadConfig
    model: torch.nn.Module
    ctx: PassContext
    x: torch.Tensor
    y: torch.Tensor
    optimizer: object = None     # training: what steps the weights (the session's optimizer, or master-weight stepper)
    marker: RangeMarker = field(default_factory=RangeMarker)
    chain: list = field(default_factory=list)      # the recipe chain whose passes ran (apply_chain)
    results: list = field(default_factory=list)    # their PassResults
    session: object = None       # training: the API's OptimizedSwin that runs every step
    _step_fn: object = None
    _graph: object = None        # inference: the captured forward
    _graph_logits: object = None
    _heldout_data: object = None

    @classmethod
    def build(cls, config: WorkloadConfig, *, fused_attn: bool = False) -> "Workload":
        device = resolve_device(config.device)
        if device.type == "cuda" and device.index is not None:
            # the current device: CUDA events, streams and graphs made without one go there (cuda:0 else)
            torch.cuda.set_device(device)
        precision = resolve_precision(config.precision)
        torch.manual_seed(config.seed)
        # On a GPU the weights are created there: initializing Swin-B's 88M parameters on a slow host
        # takes seconds per stage process; the seed makes them the same in every stage all the same.
        checkpoint = None
        if config.checkpoint is not None:
            from workbench.checkpoints import load_checkpoint

            checkpoint = load_checkpoint(config.checkpoint)
            if checkpoint.model is not None and checkpoint.model != config.model:
                raise UserError(f"--checkpoint {config.checkpoint} holds a {checkpoint.model}, not --model {config.model}")
        with torch.device(device) if device.type == "cuda" else contextlib.nullcontext():
            model = build_model(config.model, fused_attn=fused_attn, drop_path_rate=0.0,
                                num_classes=checkpoint.num_classes if checkpoint else config.num_classes,
                                img_size=tuple(config.img_size) if config.img_size else None)
        if checkpoint is not None:
            from workbench.checkpoints import load_into

            load_into(model, checkpoint)
        model.to(device)
        model.train(config.mode == "train")
        if config.mode == "infer":
            model.requires_grad_(False)     # weights that never change (SwinV2's terms are computed once)
        num_classes = model.num_classes
        x, y = synthetic_batch(model, config.batch, num_classes, device, config.seed)
        ctx = PassContext(device=device, precision=precision, training=config.mode == "train", batch=config.batch)
        workload = cls(config=config, model=model, ctx=ctx, x=x, y=y)
        if checkpoint is not None:   # a trained model: static calibration on real images, not noise
            ctx.calibration = workload.training_images
            ctx.calibration_source = (f"training images of --data {config.heldout}" if config.heldout else
                                      "training images of the checkpoint's data")
        return workload

    def training_images(self, count: int, batch: int) -> list[torch.Tensor]:
        """`count` batches of `batch` images from the training split of the held-out data (--data, else the
        checkpoint's own data: its first
        epoch's order for the workload's seed, with the training augmentation): static calibration's, kept
        apart from the held-out images the stage is measured on."""
        out = []
        for x, _ in self.heldout_data().train_batches(0, batch, self.config.seed, self.ctx.device):
            out.append(x)
            if len(out) >= count:
                break
        return out

    @property
    def precision(self) -> Precision:
        return self.ctx.precision

    def take_shard(self, rank: int, world: int) -> None:
        """Keep rank's share of the global synthetic batch of world x this batch's images (the same seed on
        every rank, so the ranks' shares together are one process's global batch)."""
        b = self.config.batch
        x, y = synthetic_batch(self.model, b * world, self.model.num_classes, self.ctx.device, self.config.seed)
        self.x, self.y = x[rank * b:(rank + 1) * b].contiguous(), y[rank * b:(rank + 1) * b].contiguous()

    def apply_chain(self, chain: list) -> list:
        """Apply every pass of a resolved recipe chain (baseline first) -> the passes' PassResults, in order.
        The chain is kept: prepare() builds the training session of that recipe."""
        from workbench.optimize.recipes import apply_chain_passes

        self.chain = list(chain)
        self.model, self.results = apply_chain_passes(self.model, self.ctx, self.chain)
        return self.results

    def prepare(self, data_parallel=None) -> None:
        """Build what steps the (pass-changed) model. Call after every pass has run and before the first step.

        Training: the public API's OptimizedSwin over this model, context and chain (the optimizer the
        recipe builds, autocast, master weights, the CUDA graph of the whole step): what a user's
        `optimize_swin(model, recipe).train_step(images, targets)` runs, with F.cross_entropy, no clipping.
        `data_parallel` (a DataParallel or FullyShard, under torchrun): DDP or FSDP2, as the API runs them.
        Inference: the forward under the recipe's autocast and inference_mode (compiled when the stage
        compiles), replayed as a CUDA graph with cuda_graph."""
        self.ctx.precision.apply_matmul_mode()
        if self.config.mode == "train":
            from workbench.optimize.trainer import OptimizedSwin

            self.session = OptimizedSwin(self.model, self.ctx, self.chain, self.results, loss_fn=F.cross_entropy,
                                         grad_clip=None, accumulate=1, notes=[], data_parallel=data_parallel)
            self.optimizer = self.session.stepper
            self._step_fn = self._session_forward_loss
            return
        # Inference times the forward alone: the loss the gate compares is computed after it, outside
        # the timed step and the captured graph.
        self._step_fn = self._forward
        if self.ctx.compile:
            self._step_fn = torch.compile(self._forward, **self.ctx.compile_options)

    def forward_loss(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, loss) of the batch through the step's forward (compiled when the stage compiles; under
        DDP through its wrapper). Inference: the loss in fp32 on the forward's logits."""
        if self._step_fn is None:
            self.prepare()
        if self.config.mode == "train":
            return self._step_fn(self.x, self.y)
        logits = self._step_fn(self.x)
        return logits, F.cross_entropy(logits.float(), self.y)

    def _session_forward_loss(self, x, y):
        return self.session._forward_loss(x, y, F.cross_entropy)

    def _forward(self, x):
        with self.ctx.precision.autocast(self.ctx.device.type):
            return self.model(x)

    @property
    def has_heldout(self) -> bool:
        """Whether this workload measures a trained model on held-out images (a checkpoint was given)."""
        return self.config.checkpoint is not None

    def heldout_data(self):
        """The held-out images of the checkpoint: --data's ImageFolder, or the data the checkpoint was
        trained on (its ImageFolder, or the shipped digits' fixed validation split)."""
        if self._heldout_data is None:
            from workbench.checkpoints import load_checkpoint
            from workbench.datasets import load_data

            path = self.config.heldout
            if path is None:
                checkpoint = load_checkpoint(self.config.checkpoint)
                if checkpoint.meta is None:
                    raise UserError(f"--checkpoint {self.config.checkpoint} is a plain state_dict, which does not say "
                                    "what it was trained on: give --data DIR (an ImageFolder) to measure it on")
                path = checkpoint.data
            # an ImageFolder is decoded by worker processes, as training reads it
            self._heldout_data = load_data(None if path is None else Path(path), input_size(self.model)[1:],
                                           min(8, os.cpu_count() or 1))
            if self._heldout_data.classes != self.model.num_classes:
                raise UserError(f"the held-out data has {self._heldout_data.classes} classes and the checkpoint's "
                                f"head {self.model.num_classes}")
        return self._heldout_data

    def heldout_outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits (N, classes) fp32 on the CPU, labels (N,)) of the held-out images through the stage's own
        forward (compiled where the stage compiles), in batches of the workload's batch: the last one padded
        to it with copies of its first image, so a compiled or captured forward sees one shape."""
        data, b = self.heldout_data(), self.config.batch
        if self._step_fn is None:
            self.prepare()
        logits, labels = [], []
        with torch.inference_mode():
            for x, y in data.val_batches(b, self.ctx.device):
                n = len(y)
                if n < b:
                    x = torch.cat([x, x[:1].expand(b - n, *x.shape[1:])])
                    y = torch.cat([y, y[:1].expand(b - n)])
                logits.append(self._step_fn(x)[:n].float().cpu())
                labels.append(y[:n].cpu())
        return torch.cat(logits), torch.cat(labels)

    def use_graph(self, on: bool = True) -> None:
        """Replay the step as one CUDA graph from the next step on (captured then, after its warm-up steps),
        or (off) step eagerly again: how apply times a stage's graph-replayed form on its own workload."""
        self.ctx.cuda_graph = on
        if self.session is not None:
            self.session.use_graph(on)

    def capture_graph(self) -> None:
        """Capture the step as one CUDA graph now (see passes/cuda_graph.py), after its eager warm-up steps
        on a side stream, as capture requires; every warm-up step trains the model like any other step.
        Training: the session's train_step until it has captured (GRAPH_WARMUP_STEPS eager steps, 11 under
        DDP, then the capture and one replay). Inference: three forwards, then the capture."""
        if self.config.mode == "train":
            if not self.session.graphed:
                raise UserError("this stage's recipe does not capture its step as a CUDA graph")
            while not self.session.graph_captured:
                self.session.train_step(self.x, self.y)
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self._infer_step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            self._graph_logits = self._infer_step()
        self._graph = graph

    def _infer_step(self) -> torch.Tensor:
        with torch.inference_mode():
            return self._step_fn(self.x)

    def own_graphs(self) -> str | None:
        """How this workload's step already replays CUDA graphs (None: it launches its kernels itself)."""
        if self.ctx.cuda_graph:
            return "the stage's step is one CUDA graph"
        options = self.ctx.compile_options if self.ctx.compile else {}
        from workbench.optimize.passes.compile import replays_own_graphs

        if replays_own_graphs(options):
            return "the stage replays Inductor's CUDA graphs (reduce-overhead)"
        return None

    def parallel_blocker(self, strategy: str) -> str | None:
        """Why this stage's step does not run data parallel under `strategy` ('ddp' or 'fsdp'), None: it
        does. A step captured as one CUDA graph runs under DDP (its all-reduce captured with it), not under
        FSDP; Inductor's own CUDA graphs (reduce-overhead) run under neither."""
        if strategy == "fsdp":
            from workbench.optimize.distributed import sharding_blocker

            blocker = sharding_blocker(self.ctx.grad_scaler, self.ctx.device)
            if blocker:
                return blocker
        graphs = self.own_graphs()
        if graphs is None or (strategy == "ddp" and self.ctx.cuda_graph):
            return None
        return (f"{graphs}: swinbench does not run it under {strategy.upper()} (the collectives inside "
                "captured graphs are built and checked for DDP and the stage's own whole-step graph only)")

    def graph_blocker(self) -> str | None:
        """Why this workload's step cannot be captured as one CUDA graph (None: it can)."""
        if self.ctx.device.type != "cuda":
            return "no CUDA graphs on the CPU"
        if self.ctx.grad_scaler:
            return "fp16 GradScaler syncs with the host every step"
        return None

    def eager_step(self) -> None:
        """One more step with torch.compile's code run as written (torch.compiler.set_stance('force_eager'))
        and no CUDA graph replayed, before the warm-up: under torch.compile on a GPU Inductor launches
        swinbench's Triton kernels itself, and this step launches the same kernels on the same shapes from
        Python, where `launch_log` sees them. Call it before the first `step`: a stage that replays a CUDA
        graph takes it as one of its eager warm-up steps (trainer.GRAPH_WARMUP_STEPS)."""
        if self._step_fn is None:
            self.prepare()
        from workbench.kernels._common import as_compiled

        with torch.compiler.set_stance("force_eager"), as_compiled():
            if self.config.mode == "train":
                self.session.train_step(self.x, self.y)
            else:
                self._infer_step()

    def step(self, i: int) -> torch.Tensor:
        """One training step (forward, backward, optimizer; returns the loss) or one inference forward
        (returns the logits; no loss is computed in the timed step), with ranges. A stage that replays a
        CUDA graph warms up and captures it in its first step."""
        if self._step_fn is None:
            self.prepare()
        m = self.marker
        if self.config.mode == "train":
            session = self.session
            session.marker = m if m.kind != "none" else None
            if session.graphed and not session.graph_captured:
                self.capture_graph()
            with m.range(f"step{i}"):
                return session.train_step(self.x, self.y)
        if self.ctx.cuda_graph:
            if self._graph is None:
                self.capture_graph()
            with m.range(f"step{i}"), m.range("graph"):
                self._graph.replay()
            return self._graph_logits
        with m.range(f"step{i}"), m.range("forward"), torch.inference_mode():
            return self._step_fn(self.x)
