"""What `apply` keeps between runs, so that a ladder already measured on this machine is not measured
again, and what compilation can cache is compiled once.

Records: every GPU stage that finished and passed its gate is copied to `<cache>/records/<key>.json`.
The key names everything its measurement depends on: the stage's recipe chain (a user's YAML by its
content), model, mode, batch, seed, timed and warm-up steps, profiling, the GPU and its driver, torch,
triton, timm and Python versions, the digest of swinbench's own code (`env.source_digest`: any change to
a kernel or a pass is another key), the SWINBENCH_* debug settings, the environment variables that change
kernels (KERNEL_ENV_PREFIXES) and whether the stages ran in processes of their own. A record is stored
only when its own env matches this machine's conditions (one kept by --resume was measured under its
run's). A later run that plans the same
stage takes that record instead of running it, marks it `reused` (which run measured it and when) and
says so in its progress, its report and the record itself. `apply --fresh` measures every stage again.
Reuse needs the GPU's name and driver from `nvidia-smi` before any stage starts (the parent process
never touches CUDA); without it, or on the CPU, nothing is reused.

Compilation: stage processes get `TORCHINDUCTOR_CACHE_DIR=<cache>/inductor`, where Inductor keeps its
FX-graph, AOTAutograd and autotuning caches across runs and reboots (its default lives in /tmp); a
compiled stage records how many of its graphs came from there. Triton keeps its own kernel cache
(~/.triton/cache), which the hand-written kernels' first launches hit from the second run on.

The cache folder is `$XDG_CACHE_HOME/swinbench` (default ~/.cache/swinbench), or `apply --cache DIR`.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from pathlib import Path

from workbench.env import installed_version, module_version, source_digest, swinbench_settings
from workbench.errors import UserError
from workbench.files import atomic_write_text
from workbench.results.record import read_record


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "swinbench"


def gpu_identity() -> tuple[str, str] | None:
    """(GPU name, driver) of the GPUs `nvidia-smi` lists, when they are all alike; None without
    nvidia-smi or on a mixed machine (a cached record could not be matched to the GPU that will run)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    rows = {tuple(part.strip() for part in line.split(",", 1)) for line in out.stdout.splitlines() if line.strip()}
    if out.returncode != 0 or len(rows) != 1:
        return None
    (row,) = rows
    return row if len(row) == 2 else None


# Environment variables besides SWINBENCH_* that change which kernels run or how they are timed: Triton's
# interpreter, TF32 forced on or off, cuBLAS's workspace, the caching allocator, Inductor's and Triton's
# settings (their cache folders aside: where a cache lives does not change what it holds)
KERNEL_ENV_PREFIXES = ("TRITON_", "TORCHINDUCTOR_", "TORCH_CUDNN_", "NVIDIA_TF32_OVERRIDE", "CUBLAS_",
                       "CUBLASLT_", "PYTORCH_CUDA_ALLOC_CONF", "CUDA_LAUNCH_BLOCKING")
KERNEL_ENV_IGNORED = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_HOME")


def kernel_settings() -> dict[str, str]:
    """This environment's variables of KERNEL_ENV_PREFIXES, sorted by name."""
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith(KERNEL_ENV_PREFIXES) and k not in KERNEL_ENV_IGNORED}


def machine_conditions(gpu: tuple[str, str]) -> dict:
    """What every stage's key shares on this machine: the GPU and driver, the versions, swinbench's code,
    its debug settings and the environment variables that change kernels."""
    import torch

    return {"gpu": list(gpu), "torch": torch.__version__, "triton": module_version("triton"),
            "timm": module_version("timm"), "torchao": installed_version("torchao"), "apex": module_version("apex"),
            "python": platform.python_version(), "swinbench_source": source_digest(),
            "swinbench_env": _kernel_debug(swinbench_settings()), "kernel_env": kernel_settings()}


def _kernel_debug(settings: dict) -> dict:
    """Of the SWINBENCH_* settings, those that change kernels (kernels._common.DEBUG_VARIABLES): a path to
    nsys or a misspelt name measures the same."""
    from workbench.kernels._common import DEBUG_VARIABLES

    return {k: v for k, v in (settings or {}).items() if k in DEBUG_VARIABLES}


# The fields of a record's env that must match this machine's conditions for the record to be stored or
# reused under them (a kept record of an earlier run, resumed, was measured under that run's conditions)
_RECORD_CONDITIONS = ("torch", "triton", "timm", "torchao", "apex", "python", "swinbench_source", "swinbench_env")


def stage_key(chain: list[dict], config: dict, *, steps: int, warmup: int, profile: bool, machine: dict,
              isolate: bool = True) -> str:
    """The cache key of one stage's measurement (see the module docstring); machine: machine_conditions()."""
    user_files = {}
    for entry in chain:
        source = entry.get("source")
        if source:
            try:
                user_files[source] = hashlib.sha256(Path(source).read_bytes()).hexdigest()
            except OSError:
                user_files[source] = None
    # trained weights and held-out images: the files themselves (size and time stamp) are the condition
    for key in ("checkpoint", "heldout"):
        where = config.get(key)
        if where:
            try:
                st = Path(where).stat()
                user_files[where] = [st.st_size, st.st_mtime_ns]
            except OSError:
                user_files[where] = None
    what = {
        "chain": chain, "user_files": user_files,
        "config": {**{k: config.get(k) for k in ("model", "mode", "batch", "precision", "seed", "num_classes")},
                   **{k: config[k] for k in ("checkpoint", "heldout", "img_size") if config.get(k)}},
        "steps": steps, "warmup": warmup, "profile": profile, **machine,
        **({} if isolate else {"isolate": False}),    # stages sharing one process: another measurement
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]


class RecordCache:
    """The records part of the cache. `usable` is False (lookups miss, stores do nothing) on the CPU,
    without a GPU identity, or with --fresh for lookups (stores still happen)."""

    def __init__(self, folder: Path, *, on_gpu: bool, fresh: bool):
        self.folder = Path(folder)
        self.gpu = gpu_identity() if on_gpu else None
        self.usable = self.gpu is not None
        self.fresh = fresh
        self.machine = machine_conditions(self.gpu) if self.usable else None

    def key(self, chain: list[dict], config: dict, **plan) -> str | None:
        return stage_key(chain, config, machine=self.machine, **plan) if self.usable else None

    def lookup(self, key: str | None) -> dict | None:
        """The cached record for key as a dict (None: none, --fresh, or it no longer reads as a record)."""
        if key is None or self.fresh:
            return None
        path = self.folder / "records" / f"{key}.json"
        if not path.is_file():
            return None
        try:
            record = read_record(path)
        except UserError:
            return None
        if not record.ok or record.gate.status not in ("PASS", "REFERENCE"):
            return None
        data = record.to_dict()
        if not self._measured_here(data):    # the GPU and driver, the versions, swinbench's code and settings
            return None
        data["_cache_path"] = str(path)
        return data

    def _measured_here(self, record: dict) -> bool:
        """Whether a record's own env says it was measured under this machine's conditions (GPU, driver,
        versions, swinbench's code and settings)."""
        env = record.get("env") or {}
        if [env.get("gpu"), env.get("driver")] != list(self.machine["gpu"]):
            return False
        mine = {**env, "swinbench_env": _kernel_debug(env.get("swinbench_env"))}
        return all(mine.get(k) == self.machine[k] for k in _RECORD_CONDITIONS if k in env)

    def store(self, key: str | None, record: dict, run_folder: Path | None = None) -> None:
        """Keep a finished stage's record (ok and passing its gate, measured under this machine's
        conditions) for later runs; its profile's files named by absolute paths (run_folder: the run's
        folder its relative paths start from), so a run that reuses it links to them."""
        if key is None or record.get("status") != "ok" or record.get("reused"):
            return
        if (record.get("gate") or {}).get("status") not in ("PASS", "REFERENCE") or not self._measured_here(record):
            return
        data = {k: v for k, v in record.items() if not k.startswith("_")}
        profile = data.get("profile")
        if isinstance(profile, dict) and run_folder is not None:
            data["profile"] = {**profile, **{k: os.path.abspath(Path(run_folder) / profile[k])
                                             for k in ("timeline", "trace") if profile.get(k)}}
        try:
            atomic_write_text(self.folder / "records" / f"{key}.json", json.dumps(data, indent=1, default=str) + "\n")
        except OSError:
            pass   # a cache that cannot be written costs the next run time, never this run's results


def reused_record(cached: dict, *, run_id: str, recipe: str, stage_index: int) -> dict:
    """A cached record as a stage of this run: this run's id, recipe and place, and where it came from."""
    record = {k: v for k, v in cached.items() if not k.startswith("_")}
    record["reused"] = {"run_id": cached["run_id"], "path": cached["_cache_path"],
                        "date": str((cached.get("env") or {}).get("date") or "")}
    record.update(run_id=run_id, recipe=recipe, stage_index=stage_index)
    return record


def compile_cache_env(cache: Path) -> dict[str, str]:
    """What a stage process's environment adds so that Inductor's caches outlive /tmp (kept when the
    user set it)."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return {}
    return {"TORCHINDUCTOR_CACHE_DIR": str(Path(cache) / "inductor")}


def compile_cache_counts() -> dict[str, int]:
    """Inductor's and AOTAutograd's cache hits and misses in this process so far."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    out = {}
    for group, name in (("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
                        ("aot_autograd", "autograd_cache_hit"), ("aot_autograd", "autograd_cache_miss")):
        out[name] = int(counters[group][name])
    return out


def compile_cache_note(counts: dict[str, int]) -> str | None:
    """'compile caches: FX graphs 3 of 3 reused, AOTAutograd 1 of 1 reused', None when nothing compiled."""
    fx = counts.get("fxgraph_cache_hit", 0), counts.get("fxgraph_cache_miss", 0)
    aot = counts.get("autograd_cache_hit", 0), counts.get("autograd_cache_miss", 0)
    if not sum(fx) and not sum(aot):
        return None
    return (f"compile caches: FX graphs {fx[0]} of {sum(fx)} reused, AOTAutograd graphs {aot[0]} of {sum(aot)} "
            "reused")
