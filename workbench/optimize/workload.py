"""The workload: a Swin model, its optimizer and one synthetic batch, stepped with named ranges.

Everything that runs a model goes through `Workload`: `profile` captures its steps, `apply` times
them and compares them with the baseline. Stochastic depth and dropout are off (drop_path_rate=0)
so that every recipe stage computes the same function and the correctness gate can compare them.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from workbench.errors import UserError
from workbench.models import build_model, input_size
from workbench.optimize.passes import PassContext
from workbench.precision import Precision, resolve_precision
from workbench.optimize.ranges import RangeMarker


@dataclass
class WorkloadConfig:
    model: str
    mode: str = "train"          # 'train' | 'infer'
    batch: int = 32
    precision: str = "bf16"
    device: str = "cuda"
    seed: int = 0
    num_classes: int | None = None

    def __post_init__(self):
        if self.mode not in ("train", "infer"):
            raise UserError(f"unknown mode {self.mode!r}: choose train or infer")
        if self.batch < 1:
            raise UserError(f"--batch must be at least 1, got {self.batch}")


def pick_device(name: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'; any other name is returned as it is."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def resolve_device(name: str) -> torch.device:
    """'auto', 'cuda', 'cuda:1' or 'cpu' -> torch.device; a CUDA device that is not there is a UserError."""
    name = pick_device(name)
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}: use cuda, cuda:N or cpu") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError("no CUDA GPU is visible here: use --device cpu (a tiny Swin on the CPU)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"device {name} is not there: {torch.cuda.device_count()} GPU(s) visible")
    elif dev.type != "cpu":
        raise UserError(f"unsupported device {name!r}: use cuda or cpu")
    return dev


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
    optimizer: torch.optim.Optimizer | None = None
    scaler: object = None
    marker: RangeMarker = field(default_factory=RangeMarker)
    _step_fn: object = None
    _graph: object = None
    _graph_loss: object = None
    graph_warmup: int = 3        # eager steps before the step is captured (more under DDP)
    graph_stream: object = None  # the side stream the step is warmed up and captured on (DDP is built on it)

    @classmethod
    def build(cls, config: WorkloadConfig, *, fused_attn: bool = False) -> "Workload":
        device = resolve_device(config.device)
        precision = resolve_precision(config.precision)
        torch.manual_seed(config.seed)
        # On a GPU the weights are created there: initializing Swin-B's 88M parameters on a slow host
        # takes seconds per stage process; the seed makes them the same in every stage all the same.
        with torch.device(device) if device.type == "cuda" else contextlib.nullcontext():
            model = build_model(config.model, fused_attn=fused_attn, num_classes=config.num_classes,
                                drop_path_rate=0.0)
        model.to(device)
        model.train(config.mode == "train")
        num_classes = model.num_classes
        x, y = synthetic_batch(model, config.batch, num_classes, device, config.seed)
        ctx = PassContext(device=device, precision=precision, training=config.mode == "train")
        return cls(config=config, model=model, ctx=ctx, x=x, y=y)

    @property
    def precision(self) -> Precision:
        return self.ctx.precision

    def prepare(self) -> None:
        """Build the optimizer and step function from the (possibly pass-changed) model and context.
        Call after every pass has run and before the first step."""
        self.ctx.precision.apply_matmul_mode()
        if self.config.mode == "train":
            if self.ctx.master_weights is not None:
                self.optimizer = self.ctx.master_weights.optimizer(self.ctx.optimizer_factory, self.model.parameters())
            else:
                self.optimizer = self.ctx.optimizer_factory(self.model.parameters())
            if self.ctx.grad_scaler and self.ctx.device.type == "cuda":
                self.scaler = torch.amp.GradScaler("cuda")
        self._step_fn = self._forward_loss
        if self.ctx.compile:
            self._step_fn = torch.compile(self._forward_loss, **self.ctx.compile_options)

    def forward_loss(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, loss) of the batch through the step's forward (compiled when the stage compiles)."""
        if self._step_fn is None:
            self.prepare()
        return self._step_fn(self.x, self.y)

    def _forward_loss(self, x, y):
        with self.ctx.precision.autocast(self.ctx.device.type):
            logits = self.model(x)
            loss = F.cross_entropy(logits.float(), y)
        return logits, loss

    def _eager_step(self) -> torch.Tensor:
        if self.config.mode == "infer":
            with torch.inference_mode():
                return self._step_fn(self.x, self.y)[1]
        _, loss = self._step_fn(self.x, self.y)
        loss.backward()
        self.optimizer.step()
        return loss

    def wrap_data_parallel(self, settings) -> None:
        """Train data parallel: the model in DistributedDataParallel with `settings` (a DataParallel), built
        after prepare(). A graph-replayed stage then captures DDP's all-reduce in its graph, after
        DDP_GRAPH_WARMUP_STEPS eager steps."""
        from workbench.optimize.distributed import DDP_GRAPH_WARMUP_STEPS, wrap_data_parallel

        if self.ctx.cuda_graph and self.ctx.device.type == "cuda":
            self.graph_stream = torch.cuda.Stream(self.ctx.device)
        self.model = wrap_data_parallel(self.model, self.ctx.device, settings, stream=self.graph_stream)
        self.graph_warmup = max(self.graph_warmup, DDP_GRAPH_WARMUP_STEPS)

    def capture_graph(self, warmup: int | None = None) -> None:
        """Capture one whole step in a CUDA graph (see passes/cuda_graph.py). The warm-up steps (default
        `graph_warmup`) run on a side stream, as CUDA graph capture requires; they train the model like
        any other step."""
        warmup = self.graph_warmup if warmup is None else warmup
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                if "capturable" in group and not group["capturable"]:
                    group["capturable"] = True
                    # a for-each AdamW that stepped eagerly keeps its step counters on the host; a
                    # capturable one reads them on the device
                    for p in group["params"]:
                        state = self.optimizer.state.get(p, {})
                        step = state.get("step")
                        if torch.is_tensor(step) and step.device != p.device:
                            state["step"] = step.to(device=p.device, dtype=torch.float32)
        side = self.graph_stream = self.graph_stream or torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                if self.optimizer is not None:
                    self.optimizer.zero_grad(set_to_none=True)
                self._eager_step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph, stream=side):
            # Gradients are allocated inside the graph's pool and overwritten by every replay.
            self._graph_loss = self._eager_step()
        self._graph = graph

    def own_graphs(self) -> str | None:
        """How this workload's step already replays CUDA graphs (None: it launches its kernels itself)."""
        if self.ctx.cuda_graph:
            return "the stage's step is one CUDA graph"
        options = self.ctx.compile_options if self.ctx.compile else {}
        if options.get("mode") == "reduce-overhead" or (options.get("options") or {}).get("triton.cudagraphs"):
            return "the stage replays Inductor's CUDA graphs (reduce-overhead)"
        return None

    def parallel_blocker(self, strategy: str) -> str | None:
        """Why this stage's step does not run data parallel under `strategy` ('ddp' or 'fsdp'), None: it
        does. A step captured as one CUDA graph runs under DDP (its all-reduce captured with it), not under
        FSDP; Inductor's own CUDA graphs (reduce-overhead) run under neither."""
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

    def step(self, i: int) -> torch.Tensor:
        """One training step (forward, backward, optimizer) or one inference forward, with ranges."""
        if self._step_fn is None:
            self.prepare()
        m = self.marker
        if self.ctx.cuda_graph:
            if self._graph is None:
                self.capture_graph()
            with m.range(f"step{i}"), m.range("graph"):
                self._graph.replay()
            return self._graph_loss
        with m.range(f"step{i}"):
            if self.config.mode == "infer":
                with m.range("forward"), torch.inference_mode():
                    logits, loss = self._step_fn(self.x, self.y)
                return loss
            with m.range("forward"):
                logits, loss = self._step_fn(self.x, self.y)
            with m.range("backward"):
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            with m.range("optimizer"):
                if self.scaler:
                    self.scaler.step(self.optimizer)
                    self.scaler.update()
                else:
                    self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        return loss

    def images_per_step(self) -> int:
        return self.config.batch
