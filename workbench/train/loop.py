"""`swinbench train`: train a Swin on real data with one recipe, or several recipes side by side.

Every run goes through the public API (`workbench.api.optimize_swin`): a timm Swin built with the run's
seed, the recipe's passes, AdamW with a linear warm-up then a cosine decay (a LambdaLR on the API's
`optimizer`), label smoothing in the loss, gradient clipping. One record file per run, JSON lines:

    {"kind": "run", ...}       the setup: recipe, seed, model, data, schedule, passes, environment stamp
    {"kind": "step", "step": 1, "epoch": 0, "loss": 2.31, "lr": 5e-05, "img_per_s": 812.4, "grad_norm": 3.7}
    {"kind": "epoch", "epoch": 0, "step": 18, "val_acc": 41.2, "val_loss": 1.93}
    {"kind": "end", "status": "ok", "img_per_s": ..., "final_val_acc": ..., "notes": [...]}

With `ema` (a decay), optimize_swin keeps an exponential moving average of the weights, and every epoch
also validates it: "val_acc_ema" and "val_loss_ema" in the epoch record, "final_val_acc_ema" in the end's
(and with save_checkpoints the average is saved beside the weights, as <run>-ema.pt).

`loss` is the training batch's (label-smoothed) loss; `img_per_s` the batch over the wall time of its
train_step up to the loss on the host (`loss.item()` waits for the GPU), validation excluded. `grad_norm` (with gradient clipping on) is the
global gradient norm before clipping, the figure that rises before a loss spike. A run's
img/s is the median over its steps after the first tenth, and at least after the first GRAPH_WARMUP_STEPS + 1
(4; a graph recipe under DDP: DDP_GRAPH_WARMUP_STEPS + 1, 12): warm-up, autotuning, compiling and graph
capture. With `compare`, the
reference recipe (`reference`, default the baseline) runs max(baseline_seeds, seeds) seeds (seed, seed + 1,
...) and every other recipe `seeds` seeds from `seed`, so each shares the reference's initial weights,
data order and augmentation seed for seed; the report then gives each recipe the parity verdict against
the reference's spread (workbench.results.parity).
"""
from __future__ import annotations

import contextlib
import gc
import json
import math
import shlex
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from workbench.api import GraphFallbackWarning, RecipeUnavailable, optimize_swin
from workbench.optimize.trainer import GRAPH_WARMUP_STEPS
from workbench.checkpoints import save_checkpoint
from workbench.env import device_label, environment_stamp
from workbench.errors import Interrupted, UserError
from workbench.files import short_repr
from workbench.models import build_model, check_model_name, default_model_for, input_size, own_img_size
from workbench.optimize.distributed import check_parallel
from workbench.optimize.recipes import (chain_passes, inference_only_pass, is_graph_form, replays_inductor_graphs,
                                        resolve_chain)
from workbench.devices import pick_device, resolve_device
from workbench.run_folder import claim_run_folder, refuse_overwrite_and_resume, run_entries
from workbench.datasets import load_data
from workbench.train.progress import TrainProgress

SCHEMA = "swinbench.train/1"
DEFAULT_EPOCHS = 5
MAX_SEEDS = 100
MAX_TRAIN_SEED = 2 ** 50     # seed * 1,000 + rank (each rank's stochastic depth) stays a 64-bit seed
WARMUP_SHARE = 0.05          # of the steps, linear warm-up of the learning rate


@dataclass
class TrainConfig:
    """What `swinbench train` was asked, checked by `check()` before anything is built."""

    model: str | None = None
    recipe: str | None = None              # one recipe (default: amp on a GPU, baseline on the CPU)
    compare: list[str] | None = None       # several recipes; the baseline joins them with baseline_seeds seeds
    baseline_seeds: int | None = None      # with compare: the reference's seeds, default 2, at least 2
    seeds: int = 1                         # seeds of every run (with compare: of each recipe but the reference)
    reference: str | None = None           # with compare: the recipe whose seeds' spread parity measures
    steps: int | None = None
    epochs: int | None = None              # default DEFAULT_EPOCHS when steps is not given
    batch: int = 64
    lr: float = 3e-4                       # 1e-3 at batch 64 sits at the edge of bf16 stability (amp spikes)
    weight_decay: float = 0.05
    label_smoothing: float = 0.1
    clip_grad: float | None = 5.0          # 0 or None: off
    seed: int = 0
    data: Path | None = None
    workers: int = 4
    device: str = "auto"
    command: str = ""                      # the command line, for the report
    nproc: int | None = None               # processes per machine under torchrun (data parallel); None: this one
    nnodes: int = 1                        # machines, with nproc each (needs rdzv_endpoint when > 1)
    rdzv_endpoint: str | None = None       # host:port of the c10d rendezvous every machine joins
    rdzv_id: str | None = None             # the job's name at the rendezvous (None: "swinbench")
    parallel: str | None = None            # with nproc: "ddp" (the default) or "fsdp" (FSDP2, sharded weights)
    save_checkpoints: bool = False         # each finished run's weights to checkpoints/ (swinbench apply --checkpoint)
    img_size: list[int] | None = None      # [H, W]: the model at this resolution; None: its name's
    ema: float | None = None               # decay of an EMA of the weights, validated beside them; None: off

    @property
    def world(self) -> int:
        """Processes in all: nproc x nnodes (1 without --nproc)."""
        return (self.nproc or 1) * self.nnodes

    def check(self) -> None:
        def positive_int(name, value):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise UserError(f"--{name} must be a whole number >= 1, got {short_repr(value)}")

        positive_int("steps", self.steps)
        positive_int("epochs", self.epochs)
        positive_int("batch", self.batch)
        positive_int("nproc", self.nproc)
        positive_int("nnodes", self.nnodes)
        if self.nproc is None and (self.nnodes != 1 or self.rdzv_endpoint is not None):
            raise UserError("--nnodes and --rdzv-endpoint go with --nproc (processes per machine)")
        if self.rdzv_id is not None and self.rdzv_endpoint is None:
            raise UserError("--rdzv-id names the job at --rdzv-endpoint's rendezvous: give both, or neither")
        check_parallel(self.parallel, self.nproc)
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise UserError("--nnodes above 1 needs --rdzv-endpoint HOST:PORT, the same on every machine")
        if self.rdzv_endpoint is not None and not (":" in self.rdzv_endpoint and
                                                   self.rdzv_endpoint.rpartition(":")[2].isdigit()):
            raise UserError(f"--rdzv-endpoint takes HOST:PORT, got {short_repr(self.rdzv_endpoint)}")
        if self.steps is not None and self.epochs is not None:
            raise UserError("give --steps or --epochs, not both")
        for name, value, low in (("lr", self.lr, 0.0), ("weight-decay", self.weight_decay, None),
                                 ("label-smoothing", self.label_smoothing, None)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0 and
                    (low is None or value > low)):
                raise UserError(f"--{name} must be a finite number {'> 0' if low is not None else '>= 0'}, "
                                f"got {short_repr(value)}")
        if self.label_smoothing >= 1:
            raise UserError(f"--label-smoothing must be below 1, got {self.label_smoothing}")
        if self.clip_grad is not None and not (math.isfinite(self.clip_grad) and self.clip_grad >= 0):
            raise UserError(f"--clip-grad must be a finite number >= 0 (0: off), got {short_repr(self.clip_grad)}")
        if self.workers < 0:
            raise UserError(f"--workers must be >= 0, got {self.workers}")
        if self.ema is not None:
            if not (isinstance(self.ema, (int, float)) and not isinstance(self.ema, bool) and 0 < self.ema < 1):
                raise UserError(f"--ema must be a decay between 0 and 1 (e.g. 0.999), got {short_repr(self.ema)}")
            if self.parallel == "fsdp":
                raise UserError("--ema is not kept under --parallel fsdp (an average of sharded weights): use ddp")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < MAX_TRAIN_SEED:
            raise UserError(f"--seed must be a whole number from 0 to {MAX_TRAIN_SEED - 1}, got {short_repr(self.seed)}")
        if not (isinstance(self.seeds, int) and 1 <= self.seeds <= MAX_SEEDS):
            raise UserError(f"--seeds must be between 1 and {MAX_SEEDS}, got {short_repr(self.seeds)}")
        if self.compare is None:
            if self.baseline_seeds is not None:
                raise UserError("--baseline-seeds goes with --compare (the seeds that measure the baseline's spread)")
            if self.reference is not None:
                raise UserError("--reference goes with --compare (the recipe the others are held against)")
        else:
            if not self.compare:
                raise UserError("--compare is empty: give recipe names separated by commas")
            if self.recipe is not None:
                raise UserError("give --recipe or --compare, not both")
            dup = sorted({r for r in self.compare if self.compare.count(r) > 1})
            if dup:
                raise UserError(f"--compare names {short_repr(dup[0])} twice")
            if self.baseline_seeds is None:
                self.baseline_seeds = 2
            if self.baseline_seeds > MAX_SEEDS:
                raise UserError(f"--baseline-seeds must be at most {MAX_SEEDS}, got {self.baseline_seeds}")
            if self.baseline_seeds < 2:
                raise UserError(f"--baseline-seeds must be at least 2 (the spread of one seed is nothing), "
                                f"got {self.baseline_seeds}")


@dataclass
class RunSummary:
    """One finished run, as its end record says."""

    recipe: str
    seed: int
    status: str
    records: Path
    reason: str | None = None
    final_val_acc: float | None = None
    img_per_s: float | None = None
    notes: list[str] = field(default_factory=list)
    checkpoint: Path | None = None


@dataclass
class TrainResult:
    out_dir: Path
    report: Path
    curves: Path
    runs: list[RunSummary]
    table: list[dict]                      # report.summary_rows


def default_run_name(config: TrainConfig, model: str, recipe: str) -> str:
    """The default --out folder's name: train-<recipe, or "compare">-<model>-<time>."""
    what = "compare" if config.compare else recipe
    return f"train-{Path(what).stem}-{model}-{time.strftime('%Y%m%d-%H%M%S')}"


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def warmup_cosine(total: int):
    """The LR factor per optimizer step: linear from 1/warm-up to 1 over the first WARMUP_SHARE of the
    steps (at least one), then a cosine to 0 at `total`."""
    warmup = max(1, round(WARMUP_SHARE * total))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return factor


def evaluate(swin, data, batch: int, device, ema: bool = False) -> tuple[float, float]:
    """(accuracy %, mean cross-entropy) of `swin.predict` over the validation split (ema: of the averaged
    weights, put in place once for the whole split)."""
    correct, loss, n = 0, 0.0, 0
    with swin.averaged_weights() if ema else contextlib.nullcontext():
        for x, y in data.val_batches(batch, device):
            logits = swin.predict(x)
            correct += (logits.argmax(1) == y).sum().item()
            loss += F.cross_entropy(logits, y, reduction="sum").item()
            n += len(y)
    return 100.0 * correct / n, loss / n


class RecordFile:
    """A run's records, one JSON object per line, each written and flushed as it is made."""

    def __init__(self, path: Path):
        self.path = path
        self._fh = None          # made at the first record: a run stopped before its header leaves no file

    def write(self, record: dict) -> None:
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "w", encoding="utf-8")
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()


def run_setup(config: TrainConfig, data, model_name: str, world: int) -> dict:
    """What a run's header says of its setup (besides recipe, seed, schedule, command and environment):
    the fields --resume compares (RESUME_KEYS) among them."""
    steps_per_epoch = data.train_size // (config.batch * world)
    return {"model": model_name, "data": data.describe(), "batch": config.batch, "world_size": world,
            "global_batch": config.batch * world, "parallel": parallel_strategy(config, world),
            "steps": config.steps or config.epochs * steps_per_epoch,
            "steps_per_epoch": steps_per_epoch, "reference": reference_name(config),
            "optimizer": {"lr": config.lr, "weight_decay": config.weight_decay},
            "label_smoothing": config.label_smoothing, "clip_grad": config.clip_grad or None, "ema": config.ema}


def parallel_strategy(config: TrainConfig, world: int) -> str | None:
    """How `world` processes train: "ddp" or "fsdp" (--parallel, DDP by default); None for one process."""
    return (config.parallel or "ddp") if world > 1 else None


def train_run(config: TrainConfig, recipe: str, seed: int, data, model_name: str, device: torch.device,
              records: RecordFile, progress: TrainProgress, index: int, *, skip_unavailable: bool,
              rank: int = 0, world: int = 1, checkpoint: Path | None = None) -> RunSummary:
    """Train one recipe with one seed, writing its records -> its summary. A recipe that cannot run here
    is a 'not available' run when `skip_unavailable`, else UserError.

    Data parallel (`rank` of `world` processes under torchrun, the process group initialized): each rank
    trains on its share of every global batch of world x config.batch images, the model in DDP
    (optimize_swin's default) or sharded by FSDP2 (config.parallel "fsdp"); a step's loss is the mean of the
    ranks' losses (the global batch's) and its img/s the sum of theirs; rank 0 validates (under FSDP every
    rank runs the validation forwards with it, which gather the weights), and only its `records` and
    `progress` should write. `checkpoint`: where a run that ends well saves its weights (every rank takes
    part in gathering them under FSDP; rank 0 writes; the end record names the file)."""
    setup = run_setup(config, data, model_name, world)
    total = setup["steps"]
    name = resolve_chain(recipe)[-1].name
    torch.manual_seed(seed)
    model = build_model(model_name, num_classes=data.classes, img_size=config.img_size)
    if world > 1:
        torch.manual_seed(seed * 1_000 + rank)   # every rank its own stochastic-depth draws
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=config.label_smoothing)
    header = {"kind": "run", "schema": SCHEMA, "recipe": name, "recipe_ref": recipe, "seed": seed,
              "recipe_passes": recipe_passes(recipe), "input_size": list(input_size(model)), **setup,
              "schedule": f"linear warm-up over {max(1, round(WARMUP_SHARE * total))} steps, cosine to 0",
              "command": config.command, "env": environment_stamp(device)}
    try:
        swin = optimize_swin(model, recipe, optimizer={"lr": config.lr, "weight_decay": config.weight_decay},
                             loss_fn=loss_fn, grad_clip=config.clip_grad or None, device=device,
                             distributed=setup["parallel"], batch=config.batch, ema=config.ema)
    except RecipeUnavailable as exc:
        if not skip_unavailable:
            raise
        records.write({**header, "passes": []})
        records.write({"kind": "end", "status": "not available", "reason": exc.reason})
        progress.start_run(index, f"{name} seed {seed}", total)
        progress.end_run(f"not available here: {exc.reason}")
        return RunSummary(name, seed, "not available", records.path, reason=exc.reason,
                          notes=[f"not available here: {exc.reason}"])
    header.update(precision=swin.ctx.precision.name, optimizer_impl=swin.ctx.optimizer_name
                  + (" on fp32 master weights" if swin.ctx.master_weights is not None else ""),
                  graphed=swin.graphed, passes=[{"name": p.name, "changed": p.changed} for p in swin.passes])
    records.write(header)
    schedule = torch.optim.lr_scheduler.LambdaLR(swin.optimizer, warmup_cosine(total))
    progress.start_run(index, f"{name} seed {seed}", total)
    rates, step, epoch, status, reason = [], 0, 0, "ok", None
    started = time.perf_counter()
    val_acc = val_acc_ema = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphFallbackWarning)   # said once each in swin.notes, printed below
        while step < total and status == "ok":
            for x, y in data.train_batches(epoch, config.batch, seed, device, rank, world):
                lr = float(swin.optimizer.param_groups[0]["lr"])
                t0 = time.perf_counter()
                loss = swin.train_step(x, y).item()
                seconds = time.perf_counter() - t0
                schedule.step()
                step += 1
                rate = config.batch / seconds
                if world > 1:
                    loss, rate = _over_ranks(loss, rate, world, device)
                rates.append(rate)
                # the same on every rank: the gradients were averaged before clipping
                norm = swin.last_grad_norm
                records.write({"kind": "step", "step": step, "epoch": epoch, "loss": _finite_or_none(loss),
                               "lr": lr, "img_per_s": rate,
                               **({"grad_norm": _finite_or_none(float(norm))} if norm is not None else {})})
                progress.step(step, loss, rate)
                if not math.isfinite(loss):
                    status, reason = "diverged", f"loss {loss} at step {step}"
                    break
                if step >= total:
                    break
            averaged = {}
            if status == "ok" and (rank == 0 or swin.sharded):
                val_acc, val_loss = evaluate(swin, data, config.batch, device)
                if config.ema is not None:
                    val_acc_ema, val_loss_ema = evaluate(swin, data, config.batch, device, ema=True)
                    averaged = {"val_acc_ema": val_acc_ema, "val_loss_ema": _finite_or_none(val_loss_ema)}
            if status == "ok" and rank == 0:
                records.write({"kind": "epoch", "epoch": epoch, "step": step, "val_acc": val_acc,
                               "val_loss": _finite_or_none(val_loss), **averaged})
                progress.validation(epoch, val_acc, val_acc_ema)
            if status == "ok" and world > 1:
                torch.distributed.barrier()      # the other ranks wait for rank 0's validation
            epoch += 1
    # warm-up excluded: the first tenth, and at least the first GRAPH_WARMUP_STEPS + 1 steps (autotuning,
    # compiling; a graph recipe's eager steps and its capture, more of them under DDP)
    warm = swin.graph_warmup_steps if swin.graphed else GRAPH_WARMUP_STEPS
    skip = max(warm + 1, len(rates) // 10)
    notes = list(swin.notes)
    img_per_s = statistics.median(rates[skip:]) if len(rates) > skip else None
    if rates and img_per_s is None:   # a warm-up step's rate is not the recipe's: say so rather than show it
        notes.append(f"img/s not measured: all {len(rates)} steps were warm-up (the first {skip} are left out; "
                     "run more steps)")
    end = {"kind": "end", "status": status, "reason": reason, "steps": step, "epochs": epoch,
           "final_val_acc": val_acc, **({"final_val_acc_ema": val_acc_ema} if config.ema is not None else {}),
           "img_per_s": img_per_s, "img_per_s_from_step": skip + 1,
           "seconds": time.perf_counter() - started, "eager_fallbacks": swin.eager_fallbacks, "notes": notes}
    saved = None
    if checkpoint is not None and status == "ok":
        state = swin.state_dict()        # a plain timm state_dict; under FSDP every rank gathers it
        meta = dict(model=model_name, num_classes=data.classes, input_size=input_size(model), recipe=name, seed=seed,
                    data=None if config.data is None else Path(config.data).resolve(), steps=step)
        if rank == 0:
            saved = save_checkpoint(checkpoint, state, **meta, val_acc=val_acc)
            end["checkpoint"] = str(saved)
        if config.ema is not None and rank == 0:
            averaged_path = checkpoint.with_name(f"{checkpoint.stem}-ema{checkpoint.suffix}")
            end["checkpoint_ema"] = str(save_checkpoint(averaged_path, swin.ema_state_dict(), **meta,
                                                        val_acc=val_acc_ema))
        del state
    records.write(end)
    text = (f"{'diverged: ' + reason if reason else 'done'}; val accuracy "
            f"{'-' if val_acc is None else f'{val_acc:.2f}%'}"
            + (f" (EMA {val_acc_ema:.2f}%)" if val_acc_ema is not None else "")
            + (f", {img_per_s:,.1f} img/s" if img_per_s is not None else ", img/s not measured (warm-up steps only)"))
    progress.end_run(text)
    del swin, model, schedule
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return RunSummary(name, seed, status, records.path, reason, val_acc, img_per_s, list(end["notes"]), saved)


def _over_ranks(loss: float, rate: float, world: int, device: torch.device) -> tuple[float, float]:
    """(mean of the ranks' losses, sum of their img/s): one all-reduce, after the step was timed."""
    both = torch.tensor([loss, rate], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(both)
    return both[0].item() / world, both[1].item()


def plan_runs(config: TrainConfig, on_gpu: bool) -> tuple[list[tuple[str, int]], list[str]]:
    """-> ([(recipe, seed)] in the order they train, notes). Every recipe is resolved first, so a typo
    stops the command before anything trains; under FSDP, a recipe that replays CUDA graphs is refused
    (optimize_swin runs those under DDP only)."""
    runs, notes = _plan_runs(config, on_gpu)
    if config.world > 1:
        for recipe, _ in runs:
            chain = resolve_chain(recipe)
            if replays_inductor_graphs(chain):
                raise UserError(f"recipe {chain[-1].name!r} replays Inductor's own CUDA graphs (reduce-overhead), "
                                "which swinbench runs under neither DDP nor FSDP: train a recipe that captures its "
                                "whole step (a *-graph recipe) under DDP, or its compiled form without graphs")
    if config.world > 1 and parallel_strategy(config, config.world) == "fsdp":
        for recipe, _ in runs:
            chain = resolve_chain(recipe)
            if any(is_graph_form(r) for r in chain):
                raise UserError(f"recipe {chain[-1].name!r} replays CUDA graphs, which swinbench does not run under "
                                f"FSDP: train it under DDP (--parallel ddp), or train "
                                f"{chain[-2].name if len(chain) > 1 else 'baseline'} (the recipe it extends)")
    return runs, notes


def _refuse_inference_only(recipe: str) -> None:
    """Resolve `recipe` (a typo stops the command); UserError when it runs inference only."""
    chain = resolve_chain(recipe)
    only = inference_only_pass(chain)
    if only is not None:
        raise UserError(f"recipe {chain[-1].name!r} runs inference only ({only} has no backward): it cannot "
                        "train; measure it with `swinbench apply --mode infer`")


def _plan_runs(config: TrainConfig, on_gpu: bool) -> tuple[list[tuple[str, int]], list[str]]:
    notes = []
    seeds = range(config.seed, config.seed + config.seeds)
    if config.compare is None:
        # the default is PyTorch's own bf16 autocast: no swinbench kernel between the user and their loss
        recipe = config.recipe or ("amp" if on_gpu else "baseline")
        _refuse_inference_only(recipe)
        return [(recipe, s) for s in seeds], notes
    reference = config.reference or "baseline"
    ref_name = resolve_chain(reference)[-1].name
    names = [resolve_chain(r)[-1].name for r in config.compare]
    for recipe in [reference, *config.compare]:
        _refuse_inference_only(recipe)
    if ref_name not in names:
        notes.append(f"{ref_name} joins --compare: parity is measured against it")
    others = [r for r, n in zip(config.compare, names) if n != ref_name]
    runs = [(reference, config.seed + i) for i in range(max(config.baseline_seeds, config.seeds))]
    return runs + [(r, s) for r in others for s in seeds], notes


def reference_name(config: TrainConfig) -> str:
    """The recipe name parity is measured against: --reference's, or the baseline."""
    return resolve_chain(config.reference)[-1].name if config.reference else "baseline"


RESUME_KEYS = ("model", "data", "batch", "world_size", "steps", "optimizer", "label_smoothing", "clip_grad",
               "reference", "ema")


def recipe_passes(recipe: str) -> list[dict]:
    """Every pass of the recipe's chain with its parameters, as a run's header stores them (JSON): what
    --resume holds a run to, so a recipe file edited between sittings is not mixed into one row."""
    return json.loads(json.dumps([{"name": n, "params": p} for n, p in chain_passes(recipe)], default=str))


def _device_of(env) -> str:
    """The device a run trained on, from its header's env: the GPU's name, else the device kind."""
    env = env if isinstance(env, dict) else {}
    return str(env.get("gpu") or env.get("device_type") or "an unknown device")


def kept_runs(out_dir: Path, runs: list[tuple[str, int]], expected: dict,
              device_label: str | None = None) -> tuple[set[int], list[str], list[tuple[Path, Path]]]:
    """With --resume: the indices of the planned `runs` whose record file in out_dir/records finished
    (ok, diverged or not available) with this setup (`expected`: run_setup, compared on RESUME_KEYS, and
    `device_label`, the device this command trains on), notes, and the record files to renumber: a run is
    found by its recipe and seed, and when the plan grew (more --seeds) its file moves to its new place in
    the order (renumber_runs does it, under the folder's lock). UserError when the folder holds a record
    file this plan would not write, or one (finished or not) of another setup, recipe passes or device:
    those are kept as they are, never trained over. An empty record file (a run stopped before its header) holds nothing and is trained."""
    from workbench.results.train_runs import read_runs

    records = out_dir / "records"
    if not records.is_dir() or not any(records.glob("*.jsonl")):
        if records.is_dir() and any(records.iterdir()):
            raise UserError(f"--resume: {records} holds no swinbench train records (another command's run?): "
                            "choose another --out")
        others = run_entries(out_dir)
        if others:
            raise UserError(f"--resume: {out_dir} holds another command's run ({', '.join(e.name for e in others[:3])}"
                            f"{', ...' if len(others) > 3 else ''}) and no swinbench train records: choose another --out")
        return set(), [], []
    planned = {_run_key(record_path(out_dir, i, r, s).name): i for i, (r, s) in enumerate(runs)}
    keep, notes, moves = set(), [], []
    empty = [p for p in records.glob("*.jsonl") if not p.read_text(encoding="utf-8", errors="replace").strip()]
    for path in empty:
        if _run_key(path.name) not in planned:
            raise UserError(f"--resume: {path} is not a run of this plan: give the command that made it, or "
                            "another --out")
        notes.append(f"{path.name}: stopped before its first record; trained from the start")
    for run in read_runs(records, skip=empty):
        i = planned.get(_run_key(run.path.name))
        if i is None:
            raise UserError(f"--resume: {run.path} is not a run of this plan (recipes, seeds and their order "
                            "come from --recipe/--compare, --seed, --seeds, --baseline-seeds and --reference): "
                            "give the command that made it, or another --out")
        differs = [k for k in RESUME_KEYS if run.header.get(k) != expected.get(k)]
        if differs:    # finished or not: what it measured belongs to another setup, and is never trained over
            k = differs[0]
            raise UserError(f"--resume: {run.path.name} was trained with {k} {run.header.get(k)!r}, this command "
                            f"asks for {expected.get(k)!r}: give the same settings, or another --out")
        passes = recipe_passes(runs[i][0])
        if "recipe_passes" in run.header and run.header["recipe_passes"] != passes:
            raise UserError(f"--resume: {run.path.name} was trained with recipe {run.recipe}'s passes "
                            f"{short_repr(run.header['recipe_passes'])}, which now reads {short_repr(passes)} "
                            "(its file changed?): give the recipe it trained with, or another --out")
        finished = run.status in ("ok", "diverged", "not available")
        trained_on = _device_of(run.header.get("env"))
        if device_label is not None and trained_on != device_label:
            raise UserError(f"--resume: {run.path.name} was trained on {trained_on}, this command trains on "
                            f"{device_label}: their speeds and numerics do not belong in one comparison; "
                            "choose another --out")
        target = record_path(out_dir, i, *runs[i])
        if target.name != run.path.name:
            moves.append((run.path, target))
        if finished:
            keep.add(i)
        else:
            notes.append(f"{run.recipe} seed {run.seed}: its record did not finish; trained again from the start")
    sources = sorted(moves, key=lambda m: _place(m[0]))
    if [_place(t) for _, t in sources] != sorted(_place(t) for _, t in sources):
        raise UserError("--resume: this plan orders the runs otherwise than the one that made them (the recipes "
                        "of --compare in another order?): give them in the order of that command")
    if moves:
        notes.append(f"{len(moves)} record file(s) renumbered to their place in the grown plan")
    return keep, notes, moves


def _place(path: Path) -> int:
    """A record file's place in its plan: '03-amp-seed1.jsonl' -> 3."""
    head = path.name.split("-", 1)[0]
    return int(head) if head.isdigit() else 0


def _run_key(name: str) -> str:
    """A record file's name without its place in the plan: '03-amp-seed1.jsonl' -> 'amp-seed1.jsonl'."""
    return name.split("-", 1)[1] if "-" in name else name


def renumber_runs(moves: list[tuple[Path, Path]]) -> None:
    """Rename record files to their new places (kept_runs' moves, which keep the runs' order): those moving
    earlier in the order first, nearest place first, then those moving later, furthest place first; so no
    file is renamed onto one that has not moved yet. A checkpoint keeps its name (its run's end record
    names it)."""
    earlier = sorted((m for m in moves if _place(m[1]) < _place(m[0])), key=lambda m: _place(m[1]))
    later = sorted((m for m in moves if _place(m[1]) > _place(m[0])), key=lambda m: _place(m[1]), reverse=True)
    for source, target in earlier + later:
        if target.exists():
            if target.read_text(encoding="utf-8", errors="replace").strip():
                raise UserError(f"--resume: cannot renumber {source.name} to {target.name}, which holds a run; "
                                "nothing was moved after it")
            target.unlink()      # a run of this plan stopped before its first record: nothing in it
        source.rename(target)


def run_train(config: TrainConfig, *, out_dir: Path | None = None, overwrite: bool = False, console=None,
              progress: bool = True, resume: bool = False) -> TrainResult:
    """`swinbench train`: check the config, claim the output folder, train every run, write report.md and
    curves.png after each run (so a run stopped part-way keeps what finished). Raises UserError (exit 2)
    for a mistake in the config, the data or the folder, before anything trains, and after everything is
    written when a run diverged."""
    from rich.console import Console

    from workbench.train.report import render_train_report, spread_line, summary_rows, write_curves

    console = console or Console()
    config.check()
    refuse_overwrite_and_resume(overwrite, resume)   # first: which run the folder keeps, then how it trained
    device_name = pick_device(config.device)
    device = resolve_device(device_name)
    on_gpu = device.type == "cuda"
    if config.nproc is not None:
        from workbench.train.launch import check_devices

        check_devices(config, device)
    model_name = config.model or default_model_for(device_name)
    check_model_name(model_name)
    own = own_img_size(model_name, config.img_size)
    config.img_size = list(own) if own else None
    runs, notes = plan_runs(config, on_gpu)
    size = input_size(build_model(model_name, img_size=config.img_size))[1:]
    data = load_data(config.data, size, config.workers)
    if data.train_size // (config.batch * config.world) < 1:
        raise UserError(f"--batch {config.batch}" + (f" x {config.world} processes" if config.world > 1 else "")
                        + f" is larger than the {data.train_size} training images")
    if config.steps is None and config.epochs is None:
        config.epochs = DEFAULT_EPOCHS
    out_dir = Path(out_dir) if out_dir else Path("reports") / "runs" / default_run_name(config, model_name, runs[0][0])
    if resume and config.nproc is not None:
        raise UserError("--resume with --nproc is not built: run the data-parallel comparison in one go")
    if resume and not out_dir.is_dir():
        raise UserError(f"--resume continues the run in --out, and {out_dir} does not exist")
    keep: set[int] = set()
    moves: list[tuple[Path, Path]] = []
    if resume:
        keep, resume_notes, moves = kept_runs(out_dir, runs, run_setup(config, data, model_name, config.world),
                                              _device_of(environment_stamp(device)))
        notes = notes + resume_notes + ([f"--resume: {len(keep)} of {len(runs)} runs finished before and are kept"]
                                        if keep else [])
        if config.save_checkpoints:
            bare = [f"{r} seed {s}" for i, (r, s) in enumerate(runs)
                    if i in keep and not _saved_checkpoint(out_dir, i, r, s)]
            if bare:
                notes.append(f"--save-checkpoints: {len(bare)} kept run(s) saved no checkpoint and are not trained "
                             f"again ({', '.join(bare[:3])}{', ...' if len(bare) > 3 else ''})")
    claim = claim_run_folder(out_dir, command="train", overwrite=overwrite, keep=resume)
    with claim:
        renumber_runs(moves)
        for note in claim.notes + notes:
            console.print(f"[yellow]note:[/] {note}", highlight=False)
        if not on_gpu:
            console.print(f"[yellow]note:[/] {device_label(environment_stamp(device))}: the img/s figures show "
                          "the workflow, not what the recipes do on a GPU", highlight=False)
        summaries: list[RunSummary] = []
        report, curves = out_dir / "report.md", out_dir / "curves.png"
        if config.nproc is not None:
            from workbench.train.launch import launch_ranks

            try:
                launch_ranks(config, runs, model_name, device, out_dir, console)
            except BaseException:
                # the runs that finished before a rank failed keep their report, as a run of one process does
                with contextlib.suppress(Exception):
                    if run_summaries(out_dir / "records"):
                        render_train_report(out_dir / "records", report)
                        write_curves(out_dir / "records", curves)
                raise
            summaries = run_summaries(out_dir / "records")
            if not summaries:   # a machine of a multi-node run that held no rank 0
                console.print("this machine held no rank 0: the records and report are on the machine of global "
                              "rank 0", highlight=False)
                return TrainResult(out_dir, report, curves, [], [])
            render_train_report(out_dir / "records", report)
            write_curves(out_dir / "records", curves)
        else:
            summaries = _train_here(config, runs, data, model_name, device, out_dir, console, progress, report,
                                    curves, keep)
            if keep:    # the kept runs' report, also when nothing was left to train
                render_train_report(out_dir / "records", report)
                write_curves(out_dir / "records", curves)
        for s in summaries:
            for n in s.notes:
                console.print(f"[yellow]note:[/] {s.recipe} seed {s.seed}: {n}", highlight=False)
        table = summary_rows(out_dir / "records")
        _print_table(console, summary_rows(out_dir / "records", short=True), on_gpu)
        spread = spread_line(out_dir / "records")
        if spread:
            console.print(spread, highlight=False)
        console.print(f"records in {out_dir / 'records'}, report {report}, curves {curves}", highlight=False)
        saved = [s.checkpoint for s in summaries if s.checkpoint is not None]
        if saved:
            console.print(f"checkpoints in {saved[0].parent}: measure one with `swinbench apply --mode infer "
                          f"--checkpoint {saved[0]}`", highlight=False)
        result = TrainResult(out_dir, report, curves, summaries, table)
        diverged = [r for r in run_summaries(out_dir / "records") if r.status == "diverged"]
    if diverged:    # after the folder's lock is released: everything the runs measured is written
        first = diverged[0]
        raise UserError(f"{len(diverged)} of {len(runs)} run(s) diverged ({first.recipe} seed {first.seed}: "
                        f"{first.reason}); their records and report are in {out_dir}", exit_code=2)
    return result


def run_summaries(records_dir: Path) -> list:
    """The RunSummary of each record file in records_dir ([] when there is none)."""
    from workbench.results.train_runs import read_runs

    if not records_dir.is_dir() or not any(records_dir.glob("*.jsonl")):
        return []
    return [RunSummary(r.recipe, r.seed, r.status, r.path, (r.end or {}).get("reason"), r.final_accuracy,
                       r.img_per_s, list((r.end or {}).get("notes") or []),
                       Path(r.end["checkpoint"]) if (r.end or {}).get("checkpoint") else None)
            for r in read_runs(records_dir)]


def record_path(out_dir: Path, index: int, recipe: str, seed: int) -> Path:
    """records/NN-<recipe>-seed<S>.jsonl of the index-th run."""
    name = Path(recipe).stem if recipe.endswith((".yaml", ".yml")) else recipe
    return out_dir / "records" / f"{index + 1:02d}-{name}-seed{seed}.jsonl"


def checkpoint_path(out_dir: Path, index: int, recipe: str, seed: int) -> Path:
    """checkpoints/NN-<recipe>-seed<S>.pt of the index-th run (beside its records file)."""
    return out_dir / "checkpoints" / record_path(out_dir, index, recipe, seed).with_suffix(".pt").name


def _saved_checkpoint(out_dir: Path, index: int, recipe: str, seed: int) -> bool:
    """Whether the index-th run's checkpoint is in out_dir/checkpoints, under any place's number: a kept run
    renumbered by --resume keeps the name it was saved under."""
    key = _run_key(checkpoint_path(out_dir, index, recipe, seed).name)
    return any(_run_key(p.name) == key for p in (out_dir / "checkpoints").glob("*.pt"))


def _train_here(config, runs, data, model_name, device, out_dir, console, progress, report, curves,
                keep: set[int] = frozenset()) -> list[RunSummary]:
    """Every run in this process but those in `keep` (finished before: --resume), the report and curves
    rewritten after each."""
    from workbench.train.report import render_train_report, write_curves

    summaries: list[RunSummary] = []
    try:
        with TrainProgress(console, progress, len(runs)) as bar:
            for i, (recipe, seed) in enumerate(runs):
                if i in keep:
                    continue
                records = RecordFile(record_path(out_dir, i, recipe, seed))
                try:
                    summaries.append(train_run(config, recipe, seed, data, model_name, device, records, bar, i,
                                               skip_unavailable=config.compare is not None,
                                               checkpoint=checkpoint_path(out_dir, i, recipe, seed)
                                               if config.save_checkpoints else None))
                finally:
                    records.close()
                render_train_report(out_dir / "records", report)
                write_curves(out_dir / "records", curves)
                done = summaries[-1]
                if config.compare is not None and i == 0 and done.status == "not available":
                    # the reference's runs come first: without them no recipe has a verdict to earn
                    raise UserError(f"the reference {done.recipe} is not available here ({done.reason}): nothing "
                                    f"to hold the other recipes against, so none was trained; choose another "
                                    f"--reference (the record is in {out_dir / 'records'})")
    except KeyboardInterrupt:
        finished = len(summaries) + len(keep)
        where = (f"their records and report are in {out_dir}" if finished else
                 f"the records of the run cut short are in {out_dir / 'records'} (--resume trains it again)")
        raise Interrupted(f"interrupted: {finished} of {len(runs)} runs finished; {where}") from None
    return summaries


def _print_table(console, rows: list[dict], on_gpu: bool) -> None:
    from rich.table import Table

    if not rows:
        return
    table = Table(title="swinbench train" + ("" if on_gpu else ", CPU — not a GPU speed figure"),
                  title_justify="left")
    for col in rows[0]:
        table.add_column(col, justify="left" if col in ("recipe", "parity", "seeds") else "right", overflow="fold",
                         min_width=max(len(str(r[col])) for r in rows) if col == "recipe" else None)
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    console.print(table)


def command_line(argv: list[str] | None = None) -> str:
    """The command as the user typed it, for the report: `swinbench train ...`."""
    args = sys.argv[1:] if argv is None else argv
    return "swinbench " + " ".join(shlex.quote(a) for a in args)


