"""Stage records: one JSON object per recipe stage, written as soon as the stage finishes, and the one
reader every command goes through (`read_records`), which refuses anything that is not a measurement.

Schema `swinbench.stage/3`, written by `write_record`; `read_records` reads /3, /2 and /1 (/2 lacks
graph, graph_note, gpu_time, pytorch_alone and reused; /1 could leave optional fields out instead of null). Every speed figure comes from the GPU
named in `env`, or from the CPU when `env.device_type` is 'cpu'. "> 0" below means a finite number
greater than 0, ">= 0" a finite number not below 0; an int is a JSON integer (true/false are not).

    schema          'swinbench.stage/3'
    run_id          str (a name: at most 256 characters, no control characters)
    recipe          str: what the user asked for (a recipe name or a YAML path)
    stage           str: a name without '/' (it names the record's file)
    stage_index     int 0..9999: the stage's place in the run; the file is `<stage_index:02d>-<stage>.json`
    status          'ok' | 'not available' | 'error'
    error           str when status is not 'ok', else null
    extends         str | null: the stage this one extends
    description     str
    recipe_source   str | null: the user's YAML file the stage comes from (null: a built-in)
    chain           [{name: str, source: str | null, passes: [{name: str, params: {...}}]}]: the stage's
                    recipe chain, baseline first
    model, mode     str, 'train' | 'infer'
    batch           int >= 1
    precision       str ('fp32', 'tf32', 'bf16', 'fp16')
    device          str | null: the device asked for ('cuda', 'cuda:1', 'cpu')
    seed            int >= 0 | null
    env             environment_stamp(): {device_type: 'cuda' | 'cpu', gpu: str | null, torch: str,
                    triton: str | null (these four always present), driver, cuda, cpu, timm, python, host,
                    date (UTC ISO), swinbench, swinbench_source, triton_launcher: str | null, gpu_count,
                    gpu_memory_bytes, sm_count: int | null, capability: str | null, pdl: bool | null,
                    swinbench_env: {str: str}; further keys with a JSON scalar value are kept as they are}
    timing          {samples_ms: [> 0, ...] (at least one), warmup: int >= 0, clock: 'cuda-events' | 'host',
                    median_ms: > 0, iqr_ms: >= 0, repeats: int = len(samples_ms)}
    img_per_s       > 0: batch / median step time
    step_ms         > 0: the median step time (timing.median_ms)
    step_iqr_ms     >= 0
    peak_mem_bytes  int 1..2**50: peak CUDA memory allocated while timing; null on the CPU
    compile_s       > 0 | null: seconds of the first (compiling) step when the stage compiles
    first_step_s    > 0 | null: seconds of the first forward + backward (the gate's)
    optimizer       str | null
    gate            {status: 'PASS' | 'FAIL' | 'SKIP' | 'REFERENCE', tolerance: {name: >= 0}, metrics:
                    {weights_match: bool, weights_digest: str, logits: {max_abs, rel_l2},
                    loss: {value, reference, abs_diff}, grads: {parameter: {max_abs, rel_l2, missing}},
                    heldout (optional: a checkpoint's held-out images): {images: int >= 1, accuracy_pct,
                    reference_accuracy_pct, accuracy_drop_pts, top1_agreement, logits_rel},
                    further keys: number | str | bool | null}, reason: str | null}; a metric is a number
                    or null, and may be NaN or infinite only when the gate did not PASS
    passes          [{name: str, params: {...}, changed: str, details: {...}, available: bool}]: every pass
                    of the chain up to this stage (params and details: any JSON, at most 8 levels deep)
    stage_passes    [str]: the names of the passes this stage adds
    profile         {backend: str, trace: str | null, category_share_pct: {category: 0..100},
                    top_kernels: [{kernel: str, share_pct: 0..100, category: str (optional)}],
                    kernel_ms_per_step: > 0 | null, api_calls_per_step: {kind: >= 0} | null,
                    kernels_per_step: [{kernel: str, ms_per_step: >= 0, per_step: >= 0}],
                    timeline: str | null (optional): the stage's timeline.png, a path relative to the run
                    folder (the one that holds records/)} | null
    notes           [str]
    activation_dtypes {part: torch dtype name} | null: the output dtype of patch_embed, layers.N, norm and
                    head in one forward under the stage's precision; null where the gate did not run
    interleaved     (`apply --interleave`) {rounds: int >= 1, rounds_planned: int >= rounds, block: int >= 1,
                    with: [stage], step_ms: > 0, iqr_ms: >= 0, samples_ms: [> 0], round_median_ms: [> 0],
                    first_stage: str, x_first: ratio, previous_stage: str | null, x_previous: ratio | null},
                    ratio = {median, q1, q3: > 0, or all three null} | null
    graph           {timing: timing, img_per_s: > 0, step_ms: > 0, step_iqr_ms: >= 0, how: str} | null: the
                    stage's step replayed as one CUDA graph (the host's launch cost removed), timed like
                    `timing`; null where it was not replayed, and graph_note says why
    graph_note      str | null: why there is no graph timing, or how the stage's own step already replays one
    gpu_time        {kernel_ms: > 0, busy_pct: >= 0, steps: int >= 1, source: str, floors: [floor]
                    (optional), floor_peak_gbps: > 0 (optional)} | null: GPU kernel time per step as written
                    (eager) and its share of the step time, and swinbench's costliest kernels in those steps
                    against their memory floor (floor = {kernel, largest_argument: str, calls_per_step,
                    median_us, floor_us, floor_pct: number}, as profile's); null on the CPU
    pytorch_alone   bool | null: the stage's chain uses no swinbench kernel (a PyTorch-alone peer)
    reused          {run_id: str, path: str, date: str} | null: the measurement was not run again but taken
                    from an earlier run's record under the same conditions (`apply` says so)
    scaling         (optional; `apply --nproc N`) the stage again under torchrun, data parallel (DDP or FSDP):
                    {world_size: int >= 1, backend: str, batch_per_process: int >= 1, global_batch: int >= 1,
                    status: 'ok' | 'not run' | 'error', reason: str | null, img_per_s: > 0 | null (global
                    batch / the slowest rank's median step), step_ms: > 0 | null (that median),
                    step_ms_per_rank: [> 0], step_iqr_ms_per_rank: [>= 0] (optional: each rank's
                    interquartile range, in rank order as step_ms_per_rank), efficiency: > 0 | null (img_per_s / (world_size x this record's
                    img_per_s)), gate: {status: 'PASS' | 'FAIL' | 'SKIP' | 'REFERENCE', reason: str | null,
                    ranks: [status per rank], metrics: JSON}, ddp: {setting: JSON}: the data-parallel
                    settings, with "strategy": "ddp" | "fsdp" (none said: DDP), comm: {comm_ms_per_rank: [>= 0],
                    exposed_ms_per_rank: [>= 0], steps: int >= 1} (optional: each rank's communication per
                    step and the part of it no compute kernel of the rank overlaps, from a few steps under
                    torch.profiler after the timing, analysis.ranks.rank_row), comm_error: str (optional:
                    why comm is missing where that profile took the processes down after the figures were
                    written)}; records without them are read as before

    img_size        (optional; `--img-size`) [H, W]: the resolution the model was built at, where not its
                    name's own
    checkpoint      (optional; `apply --checkpoint`) the trained weights every stage loaded: {path: str, and
                    what the checkpoint says of itself: model, num_classes, format, recipe, seed, steps,
                    val_acc, input_size, data (JSON)}

When status is 'ok', timing, img_per_s, step_ms, step_iqr_ms and (on a GPU) peak_mem_bytes are required;
a stage that is 'not available' or ended in an 'error' may leave them null. Nothing else may be null
where a number is due: a figure that is not a finite positive number is not a measurement, and a file
that holds one is refused (UserError naming the file, the stage and the field), never reported.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from workbench.errors import UserError
from workbench.files import atomic_write_text, read_text_bounded, short_repr

SCHEMA = "swinbench.stage/3"
READABLE_SCHEMAS = ("swinbench.stage/1", "swinbench.stage/2", SCHEMA)

STATUSES = ("ok", "not available", "error")
GATE_STATUSES = ("PASS", "FAIL", "SKIP", "REFERENCE")
MODES = ("train", "infer")
CLOCKS = ("cuda-events", "host")
DEVICE_TYPES = ("cuda", "cpu")

MAX_RECORD_BYTES = 4 << 20       # the largest record apply writes is tens of KB
MAX_RECORD_FILES = 10_000
MAX_STAGE_INDEX = 9999
MAX_BYTES = 1 << 50              # peak memory: no device holds a PiB
MAX_COUNT = 1 << 31              # batch, repeats, rounds, warm-up steps, device counts
MAX_SEED = (1 << 64) - 1
MAX_NAME = 256                   # run ids, stage, model and other names
MAX_JSON_DEPTH = 8               # pass params and details


def short_dtype(name: str) -> str:
    """A record's torch dtype name ('float32', 'bfloat16', ...) as reports print it ('fp32', 'bf16', ...)."""
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}.get(name, name)


# ---------------------------------------------------------------- the record's parts


@dataclass(frozen=True)
class Timing:
    """Per-step times of the timed steps, in ms (timing.StepTiming.to_dict)."""

    samples_ms: tuple[float, ...]
    warmup: int
    clock: str
    median_ms: float
    iqr_ms: float
    repeats: int

    def to_dict(self) -> dict:
        return {"samples_ms": list(self.samples_ms), "warmup": self.warmup, "clock": self.clock,
                "median_ms": self.median_ms, "iqr_ms": self.iqr_ms, "repeats": self.repeats}


@dataclass(frozen=True)
class ErrorStats:
    """One tensor against the baseline's: largest absolute difference and relative L2 error (null when
    the shapes differ or the tensor is missing)."""

    max_abs: float | None = None
    rel_l2: float | None = None
    missing: bool = False
    shape: tuple[int, ...] | None = None
    ref_shape: tuple[int, ...] | None = None

    def to_dict(self) -> dict:
        out: dict = {"max_abs": self.max_abs, "rel_l2": self.rel_l2}
        if self.missing:
            out["missing"] = True
        if self.shape is not None:
            out["shape"] = list(self.shape)
        if self.ref_shape is not None:
            out["ref_shape"] = list(self.ref_shape)
        return out


@dataclass(frozen=True)
class LossStats:
    value: float | None = None
    reference: float | None = None
    abs_diff: float | None = None

    def to_dict(self) -> dict:
        return {"value": self.value, "reference": self.reference, "abs_diff": self.abs_diff}


HELDOUT_KEYS = ("images", "accuracy_pct", "reference_accuracy_pct", "accuracy_drop_pts", "top1_agreement",
                "logits_rel")


@dataclass(frozen=True)
class GateMetrics:
    """What the correctness gate measured (gate.compare); `extra`: further scalar figures."""

    weights_match: bool | None = None
    weights_digest: str | None = None
    logits: ErrorStats | None = None
    loss: LossStats | None = None
    grads: dict[str, ErrorStats] = field(default_factory=dict)
    extra: dict[str, float | str | bool | None] = field(default_factory=dict)
    heldout: dict | None = None     # a trained model's held-out images (gate.heldout_metrics)

    def to_dict(self) -> dict:
        out: dict = {}
        if self.weights_match is not None:
            out["weights_match"] = self.weights_match
        if self.weights_digest is not None:
            out["weights_digest"] = self.weights_digest
        if self.logits is not None:
            out["logits"] = self.logits.to_dict()
        if self.loss is not None:
            out["loss"] = self.loss.to_dict()
        if self.grads or self.logits is not None:
            out["grads"] = {k: v.to_dict() for k, v in self.grads.items()}
        if self.heldout is not None:
            out["heldout"] = dict(self.heldout)
        out.update(self.extra)
        return out


@dataclass(frozen=True)
class Gate:
    status: str                              # PASS | FAIL | SKIP | REFERENCE
    tolerance: dict[str, float] = field(default_factory=dict)
    metrics: GateMetrics = field(default_factory=GateMetrics)
    reason: str | None = None

    def to_dict(self) -> dict:
        return {"status": self.status, "tolerance": dict(self.tolerance), "metrics": self.metrics.to_dict(),
                "reason": self.reason}


@dataclass(frozen=True)
class TopKernel:
    kernel: str
    share_pct: float
    category: str | None = None

    def to_dict(self) -> dict:
        out: dict = {"kernel": self.kernel, "share_pct": self.share_pct}
        if self.category is not None:
            out["category"] = self.category
        return out


@dataclass(frozen=True)
class KernelTime:
    """One kernel's GPU time and launches per step in the stage's capture."""

    kernel: str
    ms_per_step: float
    per_step: float

    def to_dict(self) -> dict:
        return {"kernel": self.kernel, "ms_per_step": self.ms_per_step, "per_step": self.per_step}


@dataclass(frozen=True)
class KernelFloor:
    """One of swinbench's kernels at one argument shape against its memory floor in the stage's capture
    (workbench/analysis/floors.py): launches per step, median µs, the floor's µs, floor / median in %."""

    kernel: str
    largest_argument: str
    calls_per_step: float
    median_us: float
    floor_us: float
    floor_pct: float
    config: str = ""        # the launch configuration its autotuner chose ('' where none, or not recorded)

    TEXT = ("kernel", "largest_argument")                                  # the fields, text then numbers
    NUMBERS = ("calls_per_step", "median_us", "floor_us", "floor_pct")
    OPTIONAL_TEXT = ("config",)

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in (*self.TEXT, *self.NUMBERS)} | ({"config": self.config} if self.config
                                                                           else {})


@dataclass(frozen=True)
class Profile:
    backend: str
    trace: str | None = None
    category_share_pct: dict[str, float] = field(default_factory=dict)
    top_kernels: tuple[TopKernel, ...] = ()
    kernel_ms_per_step: float | None = None
    api_calls_per_step: dict[str, float] | None = None
    kernels_per_step: tuple[KernelTime, ...] = ()
    timeline: str | None = None
    floors: tuple[KernelFloor, ...] = ()        # most time per step first
    floor_peak_gbps: float | None = None        # the bandwidth the floors are at

    def kernels_frame(self):
        """kernels_per_step as a DataFrame (kernel, ms, n) per step, ready for diff.join_per_unit; None
        when the profile holds no per-kernel table."""
        if not self.kernels_per_step:
            return None
        import pandas as pd

        return pd.DataFrame({"kernel": [k.kernel for k in self.kernels_per_step],
                             "ms": [k.ms_per_step for k in self.kernels_per_step],
                             "n": [k.per_step for k in self.kernels_per_step]})

    def to_dict(self) -> dict:
        return {"backend": self.backend, "trace": self.trace, "category_share_pct": dict(self.category_share_pct),
                "top_kernels": [k.to_dict() for k in self.top_kernels], "kernel_ms_per_step": self.kernel_ms_per_step,
                "api_calls_per_step": None if self.api_calls_per_step is None else dict(self.api_calls_per_step),
                "kernels_per_step": [k.to_dict() for k in self.kernels_per_step], "timeline": self.timeline,
                **({"floors": [f.to_dict() for f in self.floors], "floor_peak_gbps": self.floor_peak_gbps}
                   if self.floors else {})}


@dataclass(frozen=True)
class PairedRatio:
    """A paired speedup over the rounds of `apply --interleave`: median and quartiles (all None when no
    round could be paired)."""

    median: float | None
    q1: float | None
    q3: float | None

    def to_dict(self) -> dict:
        return {"median": self.median, "q1": self.q1, "q3": self.q3}


@dataclass(frozen=True)
class Interleaved:
    """The stage timed again in alternation with the others (interleave.interleaved_entries)."""

    rounds: int
    rounds_planned: int
    block: int
    with_stages: tuple[str, ...]             # "with" in the file
    step_ms: float
    iqr_ms: float
    samples_ms: tuple[float, ...]
    round_median_ms: tuple[float, ...]
    first_stage: str
    x_first: PairedRatio | None
    previous_stage: str | None
    x_previous: PairedRatio | None

    def to_dict(self) -> dict:
        return {"rounds": self.rounds, "rounds_planned": self.rounds_planned, "block": self.block,
                "with": list(self.with_stages), "step_ms": self.step_ms, "iqr_ms": self.iqr_ms,
                "samples_ms": list(self.samples_ms), "round_median_ms": list(self.round_median_ms),
                "first_stage": self.first_stage, "x_first": self.x_first and self.x_first.to_dict(),
                "previous_stage": self.previous_stage, "x_previous": self.x_previous and self.x_previous.to_dict()}


@dataclass(frozen=True)
class GraphTiming:
    """The stage's step replayed as one CUDA graph, timed as `timing` is; `how` says what was captured."""

    timing: Timing
    img_per_s: float
    step_ms: float
    step_iqr_ms: float
    how: str

    def to_dict(self) -> dict:
        return {"timing": self.timing.to_dict(), "img_per_s": self.img_per_s, "step_ms": self.step_ms,
                "step_iqr_ms": self.step_iqr_ms, "how": self.how}


@dataclass(frozen=True)
class GpuTime:
    """GPU kernel time per step of the step as written, and its share of the step time (busy_pct)."""

    kernel_ms: float
    busy_pct: float
    steps: int
    source: str
    floors: tuple[KernelFloor, ...] = ()        # swinbench's kernels in those steps, most time per step first
    floor_peak_gbps: float | None = None

    def to_dict(self) -> dict:
        return {"kernel_ms": self.kernel_ms, "busy_pct": self.busy_pct, "steps": self.steps, "source": self.source,
                **({"floors": [f.to_dict() for f in self.floors], "floor_peak_gbps": self.floor_peak_gbps}
                   if self.floors else {})}


@dataclass(frozen=True)
class Reused:
    """Where a reused measurement comes from: the run, the record file, the date it was measured."""

    run_id: str
    path: str
    date: str

    def to_dict(self) -> dict:
        return {"run_id": self.run_id, "path": self.path, "date": self.date}


@dataclass(frozen=True)
class Scaling:
    """The stage under torchrun with world_size processes (DDP): see the module docstring's `scaling`."""

    world_size: int
    backend: str
    batch_per_process: int
    global_batch: int
    status: str
    reason: str | None = None
    img_per_s: float | None = None
    step_ms: float | None = None
    step_ms_per_rank: tuple[float, ...] = ()
    step_iqr_ms_per_rank: tuple[float, ...] = ()    # empty in records written before it was kept
    efficiency: float | None = None
    gate: dict = field(default_factory=dict)
    ddp: dict = field(default_factory=dict)
    comm: dict = field(default_factory=dict)       # empty in records written before it was measured
    comm_error: str | None = None                   # why `comm` is missing, where the profile ended the ranks

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "backend": self.backend, "batch_per_process": self.batch_per_process,
                "global_batch": self.global_batch, "status": self.status, "reason": self.reason,
                "img_per_s": self.img_per_s, "step_ms": self.step_ms, "step_ms_per_rank": list(self.step_ms_per_rank),
                **({"step_iqr_ms_per_rank": list(self.step_iqr_ms_per_rank)} if self.step_iqr_ms_per_rank else {}),
                "efficiency": self.efficiency, "gate": dict(self.gate), "ddp": dict(self.ddp),
                **({"comm": dict(self.comm)} if self.comm else {}),
                **({"comm_error": self.comm_error} if self.comm_error else {})}


QUANTIZING_PASSES = ("quantize_linear", "torchao_quantize")   # passes that move Linear GEMMs past bf16


@dataclass(frozen=True)
class PassRecord:
    """What one pass did (passes.PassResult.to_dict)."""

    name: str
    params: dict = field(default_factory=dict)
    changed: str = ""
    details: dict = field(default_factory=dict)
    available: bool = True

    def to_dict(self) -> dict:
        return {"name": self.name, "params": self.params, "changed": self.changed, "details": self.details,
                "available": self.available}


@dataclass(frozen=True)
class ChainPass:
    name: str
    params: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"name": self.name, "params": self.params}


@dataclass(frozen=True)
class ChainEntry:
    """One recipe of the stage's chain (recipes.as_jsonable)."""

    name: str
    source: str | None = None
    passes: tuple[ChainPass, ...] = ()

    def to_dict(self) -> dict:
        return {"name": self.name, "source": self.source, "passes": [p.to_dict() for p in self.passes]}


ENV_STRINGS = ("gpu", "driver", "cuda", "cpu", "torch", "triton", "timm", "python", "host", "date", "swinbench",
               "swinbench_source", "triton_launcher", "capability")
ENV_INTS = ("gpu_count", "gpu_memory_bytes", "sm_count")
ENV_REQUIRED = ("device_type", "gpu", "torch", "triton")


@dataclass(frozen=True)
class Env:
    """env.environment_stamp(): what measured the record. `extra`: further keys, kept as they are."""

    device_type: str
    gpu: str | None = None
    torch: str | None = None
    triton: str | None = None
    driver: str | None = None
    cuda: str | None = None
    cpu: str | None = None
    timm: str | None = None
    python: str | None = None
    host: str | None = None
    date: str | None = None
    swinbench: str | None = None
    swinbench_source: str | None = None
    triton_launcher: str | None = None
    capability: str | None = None
    gpu_count: int | None = None
    gpu_memory_bytes: int | None = None
    sm_count: int | None = None
    pdl: bool | None = None
    swinbench_env: dict[str, str] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    @property
    def on_gpu(self) -> bool:
        return self.device_type == "cuda"

    @property
    def device_name(self) -> str:
        """'NVIDIA H200' on a GPU, 'CPU' on the CPU: what a table row says measured it."""
        return (self.gpu or "GPU") if self.on_gpu else "CPU"

    def to_dict(self) -> dict:
        out: dict = {"device_type": self.device_type}
        for key in ENV_STRINGS + ENV_INTS + ("pdl",):
            value = getattr(self, key)
            if value is not None or key in ENV_REQUIRED:
                out[key] = value
        out["swinbench_env"] = dict(self.swinbench_env)
        out.update(self.extra)
        return out


@dataclass(frozen=True)
class StageRecord:
    """One stage's record (see the module docstring for every field). Build one from a dict with
    `StageRecord.from_dict` (which validates it) or read files with `read_records`; `to_dict()` is what
    `write_record` writes. `source` says where it was read from (not written)."""

    run_id: str
    recipe: str
    stage: str
    stage_index: int
    status: str
    model: str
    mode: str
    batch: int
    precision: str
    env: Env
    gate: Gate
    error: str | None = None
    extends: str | None = None
    description: str = ""
    recipe_source: str | None = None
    chain: tuple[ChainEntry, ...] = ()
    device: str | None = None
    seed: int | None = None
    timing: Timing | None = None
    img_per_s: float | None = None
    step_ms: float | None = None
    step_iqr_ms: float | None = None
    peak_mem_bytes: int | None = None
    compile_s: float | None = None
    first_step_s: float | None = None
    optimizer: str | None = None
    passes: tuple[PassRecord, ...] = ()
    stage_passes: tuple[str, ...] = ()
    profile: Profile | None = None
    notes: tuple[str, ...] = ()
    activation_dtypes: dict[str, str] | None = None
    interleaved: Interleaved | None = None
    graph: GraphTiming | None = None
    graph_note: str | None = None
    gpu_time: GpuTime | None = None
    pytorch_alone: bool | None = None
    reused: Reused | None = None
    scaling: Scaling | None = None
    checkpoint: dict | None = None      # the trained weights every stage loaded (apply --checkpoint)
    img_size: tuple[int, int] | None = None     # (H, W) where not the model name's own (--img-size)
    source: str | None = field(default=None, compare=False)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def gate_status(self) -> str:
        return self.gate.status

    @property
    def kernel_floors(self) -> tuple[tuple[KernelFloor, ...], float | None]:
        """(swinbench's costliest kernels against their memory floor, the bandwidth they are at): the nsys
        capture's where the stage was profiled, else those of the steps torch.profiler timed (gpu_time)."""
        for source in (self.profile, self.gpu_time):
            if source is not None and source.floors:
                return source.floors, source.floor_peak_gbps
        return (), None

    @property
    def precision_label(self) -> str:
        """The precision as a table shows it: with the GEMM dtype where a pass quantized the Linear layers
        ('bf16, fp8 GEMMs'; 'simulated' where the quantization ran as fake-quant math)."""
        quantized = [p for p in self.passes if p.name in QUANTIZING_PASSES and p.available]
        if not quantized:
            return self.precision
        dtypes = "/".join(sorted({str(p.params.get("dtype", "fp8")) for p in quantized}))
        simulated = " simulated" if any(p.params.get("simulate") for p in quantized) else ""
        return f"{self.precision}, {dtypes} GEMMs{simulated}"

    @property
    def file_name(self) -> str:
        return f"{self.stage_index:02d}-{self.stage}.json"

    @property
    def shape_label(self) -> str | None:
        """'384x384' where the model was built at another resolution than its name's (--img-size), else None."""
        return f"{self.img_size[0]}x{self.img_size[1]}" if self.img_size else None

    @property
    def weights(self) -> str | None:
        """The trained weights' path every stage loaded (apply --checkpoint), else None (random weights)."""
        return (self.checkpoint or {}).get("path")

    def ancestors(self) -> list[str]:
        """The stages this one may be compared with, nearest first: the stage it extends, then that stage's
        own chain back to the baseline (from the stored recipe chain)."""
        if not self.extends:
            return []
        names = [c.name for c in self.chain]
        if self.extends in names:
            return names[: names.index(self.extends) + 1][::-1]
        return [self.extends]

    def to_dict(self) -> dict:
        """The record as `write_record` writes it (schema swinbench.stage/3, every field present)."""
        return {
            "schema": SCHEMA, "run_id": self.run_id, "recipe": self.recipe, "stage": self.stage,
            "stage_index": self.stage_index, "status": self.status, "error": self.error, "extends": self.extends,
            "description": self.description, "recipe_source": self.recipe_source,
            "chain": [c.to_dict() for c in self.chain], "model": self.model, "mode": self.mode, "batch": self.batch,
            "precision": self.precision, "device": self.device, "seed": self.seed, "env": self.env.to_dict(),
            "timing": self.timing and self.timing.to_dict(), "img_per_s": self.img_per_s, "step_ms": self.step_ms,
            "step_iqr_ms": self.step_iqr_ms, "peak_mem_bytes": self.peak_mem_bytes, "compile_s": self.compile_s,
            "first_step_s": self.first_step_s, "optimizer": self.optimizer, "gate": self.gate.to_dict(),
            "passes": [p.to_dict() for p in self.passes], "stage_passes": list(self.stage_passes),
            "profile": self.profile and self.profile.to_dict(), "notes": list(self.notes),
            "activation_dtypes": None if self.activation_dtypes is None else dict(self.activation_dtypes),
            "interleaved": self.interleaved and self.interleaved.to_dict(),
            "graph": self.graph and self.graph.to_dict(), "graph_note": self.graph_note,
            "gpu_time": self.gpu_time and self.gpu_time.to_dict(), "pytorch_alone": self.pytorch_alone,
            "reused": self.reused and self.reused.to_dict(),
            **({"scaling": self.scaling.to_dict()} if self.scaling is not None else {}),
            **({"checkpoint": dict(self.checkpoint)} if self.checkpoint is not None else {}),
            **({"img_size": list(self.img_size)} if self.img_size is not None else {}),
        }

    @classmethod
    def from_dict(cls, data, source: str | None = None) -> StageRecord:
        """Validate a parsed record (schema /1, /2 or /3) -> StageRecord. UserError (one line, naming `source`,
        the stage and the field) for anything that is not as the module docstring says. A `_path` key (what
        in-memory records carry) names the source when `source` is not given."""
        if isinstance(data, dict) and source is None and isinstance(data.get("_path"), str):
            source = data["_path"]
        return _Parser(source or "<record in memory>").record(data)


def as_records(items) -> list[StageRecord]:
    """StageRecords as they are; dicts (records being built in memory) as `write_record` would write them
    (through JSON: tuples become lists) and then `StageRecord.from_dict`."""
    return [r if isinstance(r, StageRecord) else StageRecord.from_dict(_as_json(r)) for r in items]


def _as_json(record: dict) -> dict:
    """A record dict as it reads back from its file: passed through JSON, values JSON cannot hold as strings."""
    return json.loads(json.dumps({k: v for k, v in record.items() if k != "_path"}, default=str))


# ---------------------------------------------------------------- validation


_TOP_KEYS = {"schema", "run_id", "recipe", "stage", "stage_index", "status", "error", "extends", "description",
             "recipe_source", "chain", "model", "mode", "batch", "precision", "device", "seed", "env", "timing",
             "img_per_s", "step_ms", "step_iqr_ms", "peak_mem_bytes", "compile_s", "first_step_s", "optimizer",
             "gate", "passes", "stage_passes", "profile", "notes", "activation_dtypes", "interleaved", "graph",
             "graph_note", "gpu_time", "pytorch_alone", "reused", "scaling", "checkpoint", "img_size", "_path"}
_REQUIRED = ("run_id", "recipe", "stage", "stage_index", "status", "model", "mode", "batch", "precision", "env",
             "gate")


def _shown(value) -> str:
    """A value from the file as an error line quotes it (JSON's null for None)."""
    return "null" if value is None else short_repr(value)


def _bound(n: int) -> str:
    """2**50 rather than 1125899906842624 in an error line."""
    for k in range(20, 65):
        if n == 1 << k:
            return f"2**{k}"
        if n == (1 << k) - 1:
            return f"2**{k}-1"
    return str(n)


def _given(value, default):
    """`value`, or `default` where it is null or absent (not where it is false, 0 or empty: those are
    checked as they are)."""
    return default if value is None else value


class _Parser:
    """Reads one record's fields, raising UserError('record FILE (stage S): FIELD ...') at the first fault."""

    def __init__(self, source: str):
        self.source = source
        self.stage: str | None = None

    def fail(self, problem: str) -> UserError:
        where = f"record {self.source}" + (f" (stage {self.stage!r})" if self.stage is not None else "")
        return UserError(f"{where}: {problem}")

    # -- scalars

    def get(self, data: dict, key: str, where: str, required: bool = False):
        if key not in data:
            if required:
                raise self.fail(f"lacks required field {where + key!r}")
            return None
        return data[key]

    def mapping(self, value, name: str, optional: bool = False) -> dict | None:
        if value is None and optional:
            return None
        if not isinstance(value, dict):
            raise self.fail(f"{name!r} must be a mapping{' or null' if optional else ''}, got {_shown(value)}")
        for key in value:
            if not isinstance(key, str):
                raise self.fail(f"{name!r} has a key that is not a string: {_shown(key)}")
        return value

    def known(self, data: dict, keys, name: str) -> None:
        unknown = [k for k in data if k not in keys]
        if unknown:
            raise self.fail(f"unknown field {(name + '.' if name else '') + unknown[0]!r} "
                            f"(not in schema {SCHEMA})")

    def sequence(self, value, name: str, optional: bool = False) -> list | None:
        if value is None and optional:
            return None
        if not isinstance(value, list):
            raise self.fail(f"{name!r} must be a list{' or null' if optional else ''}, got {_shown(value)}")
        return value

    def string(self, value, name: str, *, optional: bool = False, choices=None, is_name: bool = False,
               non_empty: bool = False) -> str | None:
        if value is None and optional:
            return None
        if not isinstance(value, str):
            raise self.fail(f"{name!r} must be a string{' or null' if optional else ''}, got {_shown(value)}")
        if choices is not None and value not in choices:
            raise self.fail(f"{name!r} must be one of {', '.join(map(repr, choices))}, got {_shown(value)}")
        if is_name:
            if not value or len(value) > MAX_NAME or any(ord(c) < 32 or ord(c) == 127 for c in value):
                raise self.fail(f"{name!r} must be a name of 1 to {MAX_NAME} printable characters, "
                                f"got {_shown(value)}")
        elif non_empty and not value:
            raise self.fail(f"{name!r} must not be empty")
        return value

    def integer(self, value, name: str, low: int, high: int, *, optional: bool = False) -> int | None:
        if value is None and optional:
            return None
        if type(value) is not int or not low <= value <= high:
            raise self.fail(f"{name!r} must be an integer {low}..{_bound(high)}{' or null' if optional else ''}, "
                            f"got {_shown(value)}")
        return value

    def number(self, value, name: str, *, positive: bool = True, high: float | None = None,
               optional: bool = False, finite: bool = True) -> float | None:
        """A JSON number: > 0 (positive) or >= 0, at most `high`; NaN and infinities only when not `finite`."""
        if value is None and optional:
            return None
        rule = ("> 0" if positive else ">= 0") + (f" and <= {high:g}" if high is not None else "")
        rule += " (finite)" + (" or null" if optional else "")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(f"{name!r} must be a number {rule}, got {_shown(value)}")
        try:
            x = float(value)
        except OverflowError:
            x = math.inf
        if not math.isfinite(x):
            if finite:
                raise self.fail(f"{name!r} must be a number {rule}, got {_shown(value)}")
            return x
        if x < 0 or (positive and x == 0) or (high is not None and x > high):
            raise self.fail(f"{name!r} must be a number {rule}, got {_shown(value)}")
        return x

    def any_number(self, value, name: str, *, finite: bool) -> float | None:
        """A number of either sign, or null (gate metrics)."""
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(f"{name!r} must be a number or null, got {_shown(value)}")
        try:
            x = float(value)
        except OverflowError:
            x = math.inf if value > 0 else -math.inf
        if finite and not math.isfinite(x):
            raise self.fail(f"{name!r} must be finite where the gate passed, got {_shown(value)}")
        return x

    def boolean(self, value, name: str, optional: bool = False) -> bool | None:
        if value is None and optional:
            return None
        if not isinstance(value, bool):
            raise self.fail(f"{name!r} must be true or false, got {_shown(value)}")
        return value

    def numbers(self, value, name: str, *, non_empty: bool = True) -> tuple[float, ...]:
        items = self.sequence(value, name)
        if non_empty and not items:
            raise self.fail(f"{name!r} must hold at least one measurement")
        return tuple(self.number(x, f"{name}[{i}]") for i, x in enumerate(items))

    def strings(self, value, name: str) -> tuple[str, ...]:
        return tuple(self.string(x, f"{name}[{i}]") for i, x in enumerate(self.sequence(value, name)))

    def json_object(self, value, name: str) -> dict:
        """A free-form JSON mapping (pass params and details); null reads as {}."""
        return self.json_value(self.mapping(_given(value, {}), name), name)

    def json_value(self, value, name: str, depth: int = 0):
        """Free-form JSON (pass params and details): plain values, bounded depth."""
        if depth > MAX_JSON_DEPTH:
            raise self.fail(f"{name!r} is nested more than {MAX_JSON_DEPTH} levels deep")
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, list):
            return [self.json_value(v, f"{name}[{i}]", depth + 1) for i, v in enumerate(value)]
        if isinstance(value, dict):
            self.mapping(value, name)
            return {k: self.json_value(v, f"{name}.{k}", depth + 1) for k, v in value.items()}
        raise self.fail(f"{name!r} holds a {type(value).__name__}, not JSON")

    # -- parts

    def record(self, data) -> StageRecord:
        if not isinstance(data, dict):
            raise self.fail(f"is not a swinbench stage record (a JSON object with schema {SCHEMA!r} expected), "
                            f"got {_shown(data)}")
        schema = data.get("schema")
        if schema not in READABLE_SCHEMAS:
            raise self.fail(f"is not a swinbench stage record (schema {' or '.join(map(repr, READABLE_SCHEMAS))} "
                            f"expected, got {_shown(schema)})")
        stage = self.get(data, "stage", "", required=True)
        self.stage = self.string(stage, "stage", is_name=True)
        if "/" in stage or stage in (".", ".."):
            raise self.fail(f"'stage' must be a name without '/', got {_shown(stage)}")
        self.known(data, _TOP_KEYS, "")
        for key in _REQUIRED:
            self.get(data, key, "", required=True)
        env = self.env(data["env"])
        status = self.string(data["status"], "status", choices=STATUSES)
        ok = status == "ok"
        error = self.string(data.get("error"), "error", optional=True)
        if not ok and error is None:
            raise self.fail(f"'error' must say why the stage is {status!r}, got null")
        gate = self.gate(data["gate"])
        if ok:
            for key in ("timing", "img_per_s", "step_ms", "step_iqr_ms"):
                self.get(data, key, "", required=True)
        timing = self.timing(data.get("timing"), required=ok)
        measured = {key: self.number(data.get(key), key, optional=not ok) for key in ("img_per_s", "step_ms")}
        measured["step_iqr_ms"] = self.number(data.get("step_iqr_ms"), "step_iqr_ms", positive=False,
                                              optional=not ok)
        mem_required = ok and env.on_gpu
        if mem_required:
            self.get(data, "peak_mem_bytes", "", required=True)
        peak = self.integer(data.get("peak_mem_bytes"), "peak_mem_bytes", 1, MAX_BYTES, optional=not mem_required)
        return StageRecord(
            run_id=self.string(data["run_id"], "run_id", is_name=True),
            recipe=self.string(data["recipe"], "recipe", non_empty=True),
            stage=self.stage,
            stage_index=self.integer(data["stage_index"], "stage_index", 0, MAX_STAGE_INDEX),
            status=status,
            model=self.string(data["model"], "model", is_name=True),
            mode=self.string(data["mode"], "mode", choices=MODES),
            batch=self.integer(data["batch"], "batch", 1, MAX_COUNT),
            precision=self.string(data["precision"], "precision", is_name=True),
            env=env, gate=gate, error=error,
            extends=self.string(data.get("extends"), "extends", optional=True, is_name=True),
            description=self.string(_given(data.get("description"), ""), "description"),
            recipe_source=self.string(data.get("recipe_source"), "recipe_source", optional=True),
            chain=self.chain(data.get("chain")),
            device=self.string(data.get("device"), "device", optional=True, is_name=True),
            seed=self.integer(data.get("seed"), "seed", 0, MAX_SEED, optional=True),
            timing=timing, peak_mem_bytes=peak, **measured,
            compile_s=self.number(data.get("compile_s"), "compile_s", optional=True),
            first_step_s=self.number(data.get("first_step_s"), "first_step_s", optional=True),
            optimizer=self.string(data.get("optimizer"), "optimizer", optional=True),
            passes=self.passes(data.get("passes")),
            stage_passes=self.strings(_given(data.get("stage_passes"), []), "stage_passes"),
            profile=self.profile(data.get("profile")),
            notes=self.strings(_given(data.get("notes"), []), "notes"),
            activation_dtypes=self.activation_dtypes(data.get("activation_dtypes")),
            interleaved=self.interleaved(data.get("interleaved")),
            graph=self.graph(data.get("graph")),
            graph_note=self.string(data.get("graph_note"), "graph_note", optional=True),
            gpu_time=self.gpu_time(data.get("gpu_time")),
            pytorch_alone=self.boolean(data.get("pytorch_alone"), "pytorch_alone", optional=True),
            reused=self.reused(data.get("reused")),
            scaling=self.scaling(data.get("scaling")),
            checkpoint=self.checkpoint(data.get("checkpoint")),
            img_size=self.img_size(data.get("img_size")),
            source=None if self.source == "<record in memory>" else self.source,
        )

    def env(self, value) -> Env:
        env = self.mapping(value, "env")
        for key in ENV_REQUIRED:
            self.get(env, key, "env.", required=True)
        device_type = self.string(env["device_type"], "env.device_type", choices=DEVICE_TYPES)
        values: dict = {k: self.string(env.get(k), f"env.{k}", optional=True) for k in ENV_STRINGS}
        if device_type == "cuda" and not values["gpu"]:
            raise self.fail(f"'env.gpu' must name the GPU of a cuda record, got {_shown(env['gpu'])}")
        values["torch"] = self.string(env["torch"], "env.torch", non_empty=True)
        values.update({k: self.integer(env.get(k), f"env.{k}", 0, MAX_BYTES, optional=True) for k in ENV_INTS})
        values["pdl"] = self.boolean(env.get("pdl"), "env.pdl", optional=True)
        settings = self.mapping(_given(env.get("swinbench_env"), {}), "env.swinbench_env")
        for key, setting in settings.items():
            self.string(setting, f"env.swinbench_env.{key}")
        known = {"device_type", "swinbench_env", "pdl", *ENV_STRINGS, *ENV_INTS}
        extra = {}
        for key, item in env.items():
            if key in known:
                continue
            if item is not None and not isinstance(item, (bool, int, float, str)):
                raise self.fail(f"'env.{key}' must be a string, number, true/false or null, got {_shown(item)}")
            extra[key] = item
        return Env(device_type=device_type, swinbench_env=dict(settings), extra=extra, **values)

    def timing(self, value, required: bool) -> Timing | None:
        if value is None:
            if required:
                raise self.fail("'timing' must hold the timed steps of an 'ok' stage, got null")
            return None
        t = self.mapping(value, "timing")
        self.known(t, {"samples_ms", "warmup", "clock", "median_ms", "iqr_ms", "repeats"}, "timing")
        for key in ("samples_ms", "warmup", "clock", "median_ms", "iqr_ms", "repeats"):
            self.get(t, key, "timing.", required=True)
        samples = self.numbers(t["samples_ms"], "timing.samples_ms")
        repeats = self.integer(t["repeats"], "timing.repeats", 1, MAX_COUNT)
        if repeats != len(samples):
            raise self.fail(f"'timing.repeats' is {repeats} but 'timing.samples_ms' holds {len(samples)} steps")
        return Timing(samples_ms=samples, warmup=self.integer(t["warmup"], "timing.warmup", 0, MAX_COUNT),
                      clock=self.string(t["clock"], "timing.clock", choices=CLOCKS),
                      median_ms=self.number(t["median_ms"], "timing.median_ms"),
                      iqr_ms=self.number(t["iqr_ms"], "timing.iqr_ms", positive=False), repeats=repeats)

    def gate(self, value) -> Gate:
        g = self.mapping(value, "gate")
        self.known(g, {"status", "tolerance", "metrics", "reason"}, "gate")
        status = self.string(self.get(g, "status", "gate.", required=True), "gate.status", choices=GATE_STATUSES)
        tolerance = {k: self.number(v, f"gate.tolerance.{k}", positive=False)
                     for k, v in self.mapping(_given(g.get("tolerance"), {}), "gate.tolerance").items()}
        return Gate(status=status, tolerance=tolerance,
                    metrics=self.gate_metrics(_given(g.get("metrics"), {}), finite=status == "PASS"),
                    reason=self.string(g.get("reason"), "gate.reason", optional=True))

    def error_stats(self, value, name: str, finite: bool) -> ErrorStats:
        m = self.mapping(value, name)
        self.known(m, {"max_abs", "rel_l2", "missing", "shape", "ref_shape"}, name)
        shapes = {k: None if m.get(k) is None else tuple(self.integer(d, f"{name}.{k}[{i}]", 0, MAX_BYTES)
                                                          for i, d in enumerate(self.sequence(m[k], f"{name}.{k}")))
                  for k in ("shape", "ref_shape")}
        return ErrorStats(max_abs=self.any_number(m.get("max_abs"), f"{name}.max_abs", finite=finite),
                          rel_l2=self.any_number(m.get("rel_l2"), f"{name}.rel_l2", finite=finite),
                          missing=bool(self.boolean(m.get("missing"), f"{name}.missing", optional=True)), **shapes)

    def gate_metrics(self, value, finite: bool) -> GateMetrics:
        m = self.mapping(value, "gate.metrics")
        loss = None
        if m.get("loss") is not None:
            lm = self.mapping(m["loss"], "gate.metrics.loss")
            self.known(lm, {"value", "reference", "abs_diff"}, "gate.metrics.loss")
            loss = LossStats(**{k: self.any_number(lm.get(k), f"gate.metrics.loss.{k}", finite=finite)
                                for k in ("value", "reference", "abs_diff")})
        grads = {k: self.error_stats(v, f"gate.metrics.grads.{k}", finite)
                 for k, v in self.mapping(_given(m.get("grads"), {}), "gate.metrics.grads").items()}
        extra = {}
        for key, item in m.items():
            if key in ("weights_match", "weights_digest", "logits", "loss", "grads", "heldout"):
                continue
            if isinstance(item, (int, float)) and not isinstance(item, bool):
                item = self.any_number(item, f"gate.metrics.{key}", finite=finite)
            elif item is not None and not isinstance(item, (bool, str)):
                raise self.fail(f"'gate.metrics.{key}' must be a number, string, true/false or null, "
                                f"got {_shown(item)}")
            extra[key] = item
        return GateMetrics(
            weights_match=self.boolean(m.get("weights_match"), "gate.metrics.weights_match", optional=True),
            weights_digest=self.string(m.get("weights_digest"), "gate.metrics.weights_digest", optional=True),
            logits=None if m.get("logits") is None else self.error_stats(m["logits"], "gate.metrics.logits", finite),
            loss=loss, grads=grads, extra=extra, heldout=self.heldout(m.get("heldout"), finite))

    def heldout(self, value, finite: bool) -> dict | None:
        h = self.mapping(value, "gate.metrics.heldout", optional=True)
        if h is None:
            return None
        self.known(h, set(HELDOUT_KEYS), "gate.metrics.heldout")
        out = {"images": self.integer(self.get(h, "images", "gate.metrics.heldout.", required=True),
                                      "gate.metrics.heldout.images", 1, MAX_COUNT)}
        for key in HELDOUT_KEYS[1:]:
            out[key] = self.any_number(h.get(key), f"gate.metrics.heldout.{key}", finite=finite)
        return out

    def img_size(self, value) -> tuple[int, int] | None:
        if value is None:
            return None
        sides = self.sequence(value, "img_size")
        if len(sides) != 2:
            raise self.fail(f"'img_size' must be [H, W], got {_shown(value)}")
        return tuple(self.integer(v, f"img_size[{i}]", 1, MAX_COUNT) for i, v in enumerate(sides))

    def checkpoint(self, value) -> dict | None:
        c = self.mapping(value, "checkpoint", optional=True)
        if c is None:
            return None
        self.string(self.get(c, "path", "checkpoint.", required=True), "checkpoint.path", non_empty=True)
        return self.json_object(c, "checkpoint")

    def chain(self, value) -> tuple[ChainEntry, ...]:
        out = []
        for i, item in enumerate(self.sequence(_given(value, []), "chain")):
            name = f"chain[{i}]"
            c = self.mapping(item, name)
            self.known(c, {"name", "source", "passes"}, name)
            passes = []
            for j, p in enumerate(self.sequence(_given(c.get("passes"), []), f"{name}.passes")):
                pname = f"{name}.passes[{j}]"
                p = self.mapping(p, pname)
                self.known(p, {"name", "params"}, pname)
                passes.append(ChainPass(self.string(self.get(p, "name", pname + ".", required=True), f"{pname}.name",
                                                    is_name=True),
                                        self.json_object(p.get("params"), f"{pname}.params")))
            out.append(ChainEntry(self.string(self.get(c, "name", name + ".", required=True), f"{name}.name",
                                              is_name=True),
                                  self.string(c.get("source"), f"{name}.source", optional=True), tuple(passes)))
        return tuple(out)

    def passes(self, value) -> tuple[PassRecord, ...]:
        out = []
        for i, item in enumerate(self.sequence(_given(value, []), "passes")):
            name = f"passes[{i}]"
            p = self.mapping(item, name)
            self.known(p, {"name", "params", "changed", "details", "available"}, name)
            out.append(PassRecord(
                name=self.string(self.get(p, "name", name + ".", required=True), f"{name}.name", is_name=True),
                params=self.json_object(p.get("params"), f"{name}.params"),
                changed=self.string(_given(p.get("changed"), ""), f"{name}.changed"),
                details=self.json_object(p.get("details"), f"{name}.details"),
                available=self.boolean(p.get("available", True), f"{name}.available")))
        return tuple(out)

    def profile(self, value) -> Profile | None:
        if value is None:
            return None
        p = self.mapping(value, "profile")
        self.known(p, {"backend", "trace", "category_share_pct", "top_kernels", "kernel_ms_per_step",
                       "api_calls_per_step", "kernels_per_step", "timeline", "floors", "floor_peak_gbps"}, "profile")
        shares = self.mapping(_given(p.get("category_share_pct"), {}), "profile.category_share_pct")
        shares = {k: self.number(v, f"profile.category_share_pct.{k}", positive=False, high=100.0 + 1e-6)
                  for k, v in shares.items()}
        calls = self.mapping(p.get("api_calls_per_step"), "profile.api_calls_per_step", optional=True)
        if calls is not None:
            calls = {k: self.number(v, f"profile.api_calls_per_step.{k}", positive=False) for k, v in calls.items()}
        top = []
        for i, item in enumerate(self.sequence(_given(p.get("top_kernels"), []), "profile.top_kernels")):
            name = f"profile.top_kernels[{i}]"
            k = self.mapping(item, name)
            self.known(k, {"kernel", "share_pct", "category", "name", "pct"}, name)
            key, pct = ("kernel", "share_pct") if "kernel" in k or "name" not in k else ("name", "pct")
            top.append(TopKernel(self.string(self.get(k, key, name + ".", required=True), f"{name}.{key}"),
                                 self.number(self.get(k, pct, name + ".", required=True), f"{name}.{pct}",
                                             positive=False, high=100.0 + 1e-6),
                                 self.string(k.get("category"), f"{name}.category", optional=True)))
        kernels = []
        for i, item in enumerate(self.sequence(_given(p.get("kernels_per_step"), []), "profile.kernels_per_step")):
            name = f"profile.kernels_per_step[{i}]"
            k = self.mapping(item, name)
            self.known(k, {"kernel", "ms_per_step", "per_step"}, name)
            kernels.append(KernelTime(
                self.string(self.get(k, "kernel", name + ".", required=True), f"{name}.kernel"),
                self.number(self.get(k, "ms_per_step", name + ".", required=True), f"{name}.ms_per_step",
                            positive=False),
                self.number(self.get(k, "per_step", name + ".", required=True), f"{name}.per_step", positive=False)))
        return Profile(backend=self.string(self.get(p, "backend", "profile.", required=True), "profile.backend"),
                       trace=self.string(p.get("trace"), "profile.trace", optional=True),
                       category_share_pct=shares, top_kernels=tuple(top),
                       kernel_ms_per_step=self.number(p.get("kernel_ms_per_step"), "profile.kernel_ms_per_step",
                                                      optional=True),
                       api_calls_per_step=calls, kernels_per_step=tuple(kernels),
                       timeline=self.string(p.get("timeline"), "profile.timeline", optional=True),
                       floors=self.floors(p.get("floors")),
                       floor_peak_gbps=self.number(p.get("floor_peak_gbps"), "profile.floor_peak_gbps", optional=True))

    def floors(self, value, where: str = "profile.floors") -> tuple[KernelFloor, ...]:
        out = []
        for i, item in enumerate(self.sequence(_given(value, []), where)):
            name = f"{where}[{i}]"
            k = self.mapping(item, name)
            self.known(k, {*KernelFloor.TEXT, *KernelFloor.NUMBERS, *KernelFloor.OPTIONAL_TEXT}, name)
            text = {f: self.string(self.get(k, f, name + ".", required=True), f"{name}.{f}") for f in KernelFloor.TEXT}
            text |= {f: self.string(k[f], f"{name}.{f}") for f in KernelFloor.OPTIONAL_TEXT if k.get(f)}
            nums = {f: self.number(self.get(k, f, name + ".", required=True), f"{name}.{f}")
                    for f in KernelFloor.NUMBERS}
            out.append(KernelFloor(**text, **nums))
        return tuple(out)

    def activation_dtypes(self, value) -> dict[str, str] | None:
        d = self.mapping(value, "activation_dtypes", optional=True)
        if d is None:
            return None
        return {k: self.string(v, f"activation_dtypes.{k}", is_name=True) for k, v in d.items()}

    def ratio(self, value, name: str) -> PairedRatio | None:
        r = self.mapping(value, name, optional=True)
        if r is None:
            return None
        self.known(r, {"median", "q1", "q3"}, name)
        values = [r.get(k) for k in ("median", "q1", "q3")]
        if all(v is None for v in values):
            return PairedRatio(None, None, None)
        return PairedRatio(*(self.number(r.get(k), f"{name}.{k}") for k in ("median", "q1", "q3")))

    def graph(self, value) -> GraphTiming | None:
        g = self.mapping(value, "graph", optional=True)
        if g is None:
            return None
        keys = ("timing", "img_per_s", "step_ms", "step_iqr_ms", "how")
        self.known(g, set(keys), "graph")
        for key in keys:
            self.get(g, key, "graph.", required=True)
        timing = self.timing(g["timing"], required=True)
        return GraphTiming(timing=timing, img_per_s=self.number(g["img_per_s"], "graph.img_per_s"),
                           step_ms=self.number(g["step_ms"], "graph.step_ms"),
                           step_iqr_ms=self.number(g["step_iqr_ms"], "graph.step_iqr_ms", positive=False),
                           how=self.string(g["how"], "graph.how"))

    def gpu_time(self, value) -> GpuTime | None:
        g = self.mapping(value, "gpu_time", optional=True)
        if g is None:
            return None
        keys = ("kernel_ms", "busy_pct", "steps", "source")
        self.known(g, {*keys, "floors", "floor_peak_gbps"}, "gpu_time")
        for key in keys:
            self.get(g, key, "gpu_time.", required=True)
        return GpuTime(kernel_ms=self.number(g["kernel_ms"], "gpu_time.kernel_ms"),
                       busy_pct=self.number(g["busy_pct"], "gpu_time.busy_pct", positive=False),
                       steps=self.integer(g["steps"], "gpu_time.steps", 1, MAX_COUNT),
                       source=self.string(g["source"], "gpu_time.source"),
                       floors=self.floors(g.get("floors"), "gpu_time.floors"),
                       floor_peak_gbps=self.number(g.get("floor_peak_gbps"), "gpu_time.floor_peak_gbps", optional=True))

    def scaling(self, value) -> Scaling | None:
        g = self.mapping(value, "scaling", optional=True)
        if g is None:
            return None
        keys = ("world_size", "backend", "batch_per_process", "global_batch", "status", "reason", "img_per_s",
                "step_ms", "step_ms_per_rank", "step_iqr_ms_per_rank", "efficiency", "gate", "ddp", "comm",
                "comm_error")
        self.known(g, set(keys), "scaling")
        for key in ("world_size", "backend", "batch_per_process", "global_batch", "status"):
            self.get(g, key, "scaling.", required=True)
        status = self.string(g["status"], "scaling.status", choices=("ok", "not run", "error"))
        ok = status == "ok"
        gate = self.mapping(_given(g.get("gate"), {}), "scaling.gate")
        self.known(gate, {"status", "reason", "ranks", "metrics"}, "scaling.gate")
        gate_status = self.string(_given(gate.get("status"), "SKIP"), "scaling.gate.status", choices=GATE_STATUSES)
        medians = self.numbers(_given(g.get("step_ms_per_rank"), []), "scaling.step_ms_per_rank", non_empty=ok)
        iqrs = tuple(self.number(x, f"scaling.step_iqr_ms_per_rank[{i}]", positive=False)
                     for i, x in enumerate(self.sequence(_given(g.get("step_iqr_ms_per_rank"), []),
                                                         "scaling.step_iqr_ms_per_rank")))
        if iqrs and len(iqrs) != len(medians):
            raise self.fail(f"'scaling.step_iqr_ms_per_rank' holds {len(iqrs)} ranks and 'scaling.step_ms_per_rank' "
                            f"{len(medians)}")
        return Scaling(
            world_size=self.integer(g["world_size"], "scaling.world_size", 1, MAX_COUNT),
            backend=self.string(g["backend"], "scaling.backend", is_name=True),
            batch_per_process=self.integer(g["batch_per_process"], "scaling.batch_per_process", 1, MAX_COUNT),
            global_batch=self.integer(g["global_batch"], "scaling.global_batch", 1, MAX_COUNT),
            status=status, reason=self.string(g.get("reason"), "scaling.reason", optional=True),
            img_per_s=self.number(g.get("img_per_s"), "scaling.img_per_s", optional=not ok),
            step_ms=self.number(g.get("step_ms"), "scaling.step_ms", optional=not ok),
            step_ms_per_rank=medians, step_iqr_ms_per_rank=iqrs,
            efficiency=self.number(g.get("efficiency"), "scaling.efficiency", optional=True),
            gate={"status": gate_status, "reason": self.string(gate.get("reason"), "scaling.gate.reason", optional=True),
                  "ranks": [self.string(x, "scaling.gate.ranks[]", choices=GATE_STATUSES)
                            for x in self.sequence(_given(gate.get("ranks"), []), "scaling.gate.ranks")],
                  "metrics": self.json_object(gate.get("metrics"), "scaling.gate.metrics")},
            ddp=self.json_object(g.get("ddp"), "scaling.ddp"),
            comm=self.scaling_comm(g.get("comm"), len(medians)),
            comm_error=self.string(g.get("comm_error"), "scaling.comm_error", optional=True))

    def scaling_comm(self, value, ranks: int) -> dict:
        c = self.mapping(value, "scaling.comm", optional=True)
        if c is None:
            return {}
        self.known(c, {"comm_ms_per_rank", "exposed_ms_per_rank", "steps"}, "scaling.comm")
        out = {"steps": self.integer(self.get(c, "steps", "scaling.comm.", required=True), "scaling.comm.steps", 1,
                                     MAX_COUNT)}
        for key in ("comm_ms_per_rank", "exposed_ms_per_rank"):
            values = [self.number(x, f"scaling.comm.{key}[{i}]", positive=False)
                      for i, x in enumerate(self.sequence(self.get(c, key, "scaling.comm.", required=True),
                                                          f"scaling.comm.{key}"))]
            if len(values) != ranks:
                raise self.fail(f"'scaling.comm.{key}' holds {len(values)} ranks and 'scaling.step_ms_per_rank' {ranks}")
            out[key] = values
        return out

    def reused(self, value) -> Reused | None:
        r = self.mapping(value, "reused", optional=True)
        if r is None:
            return None
        self.known(r, {"run_id", "path", "date"}, "reused")
        for key in ("run_id", "path", "date"):
            self.get(r, key, "reused.", required=True)
        return Reused(run_id=self.string(r["run_id"], "reused.run_id", is_name=True),
                      path=self.string(r["path"], "reused.path"), date=self.string(r["date"], "reused.date"))

    def interleaved(self, value) -> Interleaved | None:
        e = self.mapping(value, "interleaved", optional=True)
        if e is None:
            return None
        keys = ("rounds", "block", "with", "step_ms", "iqr_ms", "samples_ms", "round_median_ms", "first_stage",
                "x_first", "previous_stage", "x_previous")
        self.known(e, {*keys, "rounds_planned"}, "interleaved")
        for key in keys:
            self.get(e, key, "interleaved.", required=True)
        rounds = self.integer(e["rounds"], "interleaved.rounds", 1, MAX_COUNT)
        planned = self.integer(e.get("rounds_planned", rounds), "interleaved.rounds_planned", rounds, MAX_COUNT)
        return Interleaved(
            rounds=rounds, rounds_planned=planned,
            block=self.integer(e["block"], "interleaved.block", 1, MAX_COUNT),
            with_stages=tuple(self.string(s, f"interleaved.with[{i}]", is_name=True)
                              for i, s in enumerate(self.sequence(e["with"], "interleaved.with"))),
            step_ms=self.number(e["step_ms"], "interleaved.step_ms"),
            iqr_ms=self.number(e["iqr_ms"], "interleaved.iqr_ms", positive=False),
            samples_ms=self.numbers(e["samples_ms"], "interleaved.samples_ms"),
            round_median_ms=self.numbers(e["round_median_ms"], "interleaved.round_median_ms"),
            first_stage=self.string(e["first_stage"], "interleaved.first_stage", is_name=True),
            x_first=self.ratio(e["x_first"], "interleaved.x_first"),
            previous_stage=self.string(e["previous_stage"], "interleaved.previous_stage", optional=True,
                                       is_name=True),
            x_previous=self.ratio(e["x_previous"], "interleaved.x_previous"))


# ---------------------------------------------------------------- files


def write_record(record: StageRecord | dict, folder: Path) -> Path:
    """Write `record` as `<folder>/<stage_index:02d>-<stage>.json`, schema swinbench.stage/3, atomically.
    A dict is first passed through JSON (values JSON cannot hold become strings) and `from_dict`, so that
    nothing is written that `read_records` would refuse: a record that does not validate raises UserError."""
    if not isinstance(record, StageRecord):
        record = StageRecord.from_dict(_as_json(record), source=f"being written to {folder}")
    path = Path(folder) / record.file_name
    atomic_write_text(path, json.dumps(record.to_dict(), indent=2) + "\n")
    return path


def record_files(paths) -> list[Path]:
    """The record files that `paths` name: files as given; of a folder, its *.json not starting with '_'
    (of the folder `apply --out` wrote, those in its records/)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir() and (p / "matrix.json").is_file():
            raise UserError(f"{p} is a swinbench matrix: render it with `swinbench matrix --render-only {p}`, or "
                            "name one of its cell folders")
        if p.is_dir():
            folder = p / "records" if (p / "records").is_dir() else p
            files += sorted(q for q in folder.glob("*.json") if not q.name.startswith("_") and q.is_file())
        elif p.is_file():
            files.append(p)
        else:
            raise UserError(f"no such record file or folder: {p}")
        if len(files) > MAX_RECORD_FILES:
            raise UserError(f"more than {MAX_RECORD_FILES:,} record files in {', '.join(map(str, paths))}; not read")
    if not files:
        trained = [p for p in map(Path, paths) if p.is_dir() and any((p / "records").glob("*.jsonl"))]
        trained += [p.parent for p in map(Path, paths) if p.is_dir() and p.name == "records" and any(p.glob("*.jsonl"))]
        if trained:
            raise UserError(f"{trained[0]} is a `swinbench train` run (records/*.jsonl), not stage records: its "
                            "report is the report.md train wrote beside them")
        raise UserError(f"no stage records (*.json) found in {', '.join(map(str, paths))}")
    unique = {}
    for f in files:     # a file named twice (itself and its folder) is read once
        unique.setdefault(f.resolve(), f)
    return list(unique.values())


def read_record(path: Path) -> StageRecord:
    """One record file -> StageRecord; UserError (one line) for anything unreadable or invalid."""
    path = Path(path)
    text = read_text_bounded(path, "record", MAX_RECORD_BYTES)
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"record {path} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except (ValueError, RecursionError) as exc:   # an integer of thousands of digits; nesting too deep
        why = str(exc).splitlines()[0][:120] if str(exc).strip() else "nested too deep"
        raise UserError(f"record {path} is not valid JSON ({why})") from None
    return StageRecord.from_dict(parsed, source=str(path))


def read_records(paths) -> list[StageRecord]:
    """Stage records from files and folders (folders: every *.json in them not starting with '_'), sorted
    by run and stage_index. The one way records are read: UserError (one line, naming the file, the stage
    and the field) for a missing path, a file over MAX_RECORD_BYTES, unreadable JSON, a file that is not a
    stage record, or any field that is not as the module docstring says."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    records = [read_record(f) for f in record_files(list(paths))]
    return sorted(records, key=lambda r: (r.run_id, r.stage_index))


def read_distinct_records(paths) -> list[StageRecord]:
    """read_records for a table of runs (a report, the README's table): UserError (one line) when two files
    hold the same stage of the same run (a copied folder given beside its original), which would show as
    two rows of one measurement. Runs keep the order in which `paths` name them (a report of a training
    and an inference run shows them as given), stages their stage_index."""
    files = record_files([paths] if isinstance(paths, (str, Path)) else list(paths))
    records = [read_record(f) for f in files]
    refuse_copies(files, records)
    first = {}
    for r in records:
        first.setdefault(r.run_id, len(first))
    return sorted(records, key=lambda r: (first[r.run_id], r.stage_index))


def refuse_copies(files: list[Path], records: list[StageRecord]) -> None:
    """UserError (one line) when two of `files` (read as `records`, in the same order) hold the same stage
    of the same run."""
    seen: dict = {}
    for f, r in zip(files, records):
        other = seen.setdefault((r.run_id, r.stage), f)
        if other is not f:
            raise UserError(f"records {other} and {f} hold the same stage {r.stage} of run {r.run_id} (a copy?): "
                            "give one of them")
