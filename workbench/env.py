"""The stamp every measurement carries: which GPU, driver and library versions produced it, and when."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
import subprocess
from pathlib import Path

import torch

from workbench import SOURCE_ROOT


def module_version(module: str) -> str | None:
    """The installed version of `module` ('3.6.0'), None when it does not import or says none."""
    try:
        mod = __import__(module)
    except Exception:
        return None
    return getattr(mod, "__version__", None)


def installed_version(distribution: str) -> str | None:
    """The installed version of a distribution, read from its metadata without importing it (importing
    torchao costs seconds and logs torch's warnings into every command's stderr); None when not installed."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def _git_revision() -> str | None:
    """The swinbench checkout's commit ('abc1234', '+dirty' when it has uncommitted changes), or None
    outside a git checkout (an installed package, a copied tree)."""
    root = SOURCE_ROOT
    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True, timeout=10)
        # a package inside someone else's checkout (site-packages in a project's .venv) is not that commit
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != Path(root).resolve():
            return None
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def source_digest(root=SOURCE_ROOT) -> str:
    """sha256 (first 12 hex digits) of the code that measures: every .py under root/workbench/, cli.py and
    the recipes' YAML, by relative path and content (root: the folder that holds the package). Unlike the commit it names the code that ran even in a
    copied or uncommitted tree (the GPU machine gets a copy of the working tree, not its commits): two
    records with the same digest ran the same swinbench code."""
    import hashlib

    files = sorted([*root.joinpath("workbench").rglob("*.py"), root / "cli.py", *root.joinpath("recipes").glob("*.yaml")])
    h = hashlib.sha256()
    for f in files:
        if f.is_file():
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def swinbench_settings() -> dict[str, str]:
    """The SWINBENCH_* debug settings of this environment (docs/debugging.md), sorted by name."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("SWINBENCH_")}


def _triton_launcher() -> str | None:
    """How eager code launches the Triton kernels (workbench.kernels._common.launcher_name), None without Triton."""
    try:
        from workbench.kernels._common import launcher_name
    except ImportError:
        return None
    return launcher_name()


def _pdl() -> bool | None:
    """Whether the window kernels launch with programmatic dependent launch (workbench.kernels._common.pdl_launch),
    None without Triton."""
    try:
        from workbench.kernels._common import pdl_launch
    except ImportError:
        return None
    return pdl_launch()


def cpu_name() -> str:
    """The host processor's model ('Intel(R) Xeon(R) Platinum 8480+'), not only its architecture: two x86_64
    hosts run a host-bound step at different speeds. Falls back to the architecture where the model is
    not to be read (platform.processor() is empty or the architecture on Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Hardware", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment_stamp(device: str | torch.device = "cuda") -> dict:
    """A flat dict: device kind, GPU name (or CPU model), driver, CUDA, torch, triton, timm, python, date (UTC ISO),
    the swinbench commit and source digest that measured it, how eager code launched the Triton kernels
    and the SWINBENCH_* settings of the environment."""
    dev = torch.device(device)
    on_gpu = dev.type == "cuda" and torch.cuda.is_available()
    stamp = {
        "device_type": "cuda" if on_gpu else "cpu",
        "gpu": torch.cuda.get_device_name(dev) if on_gpu else None,
        "gpu_count": torch.cuda.device_count() if on_gpu else 0,
        "driver": _nvidia_driver() if on_gpu else None,
        "cuda": torch.version.cuda,
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "triton": module_version("triton"),
        "timm": module_version("timm"),
        "torchao": installed_version("torchao"),  # the torchao-* peers' quantized GEMMs
        "apex": module_version("apex"),           # fused_layernorm / fused_adamw with impl apex
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "swinbench": _git_revision(),
        "swinbench_source": source_digest(),
        "triton_launcher": _triton_launcher(),
        "pdl": _pdl(),
        "swinbench_env": swinbench_settings(),
    }
    if on_gpu:
        props = torch.cuda.get_device_properties(dev)
        stamp["gpu_memory_bytes"] = props.total_memory
        stamp["sm_count"] = props.multi_processor_count
        stamp["capability"] = f"{props.major}.{props.minor}"
    return stamp


def device_label(stamp: dict) -> str:
    """One short line for tables: 'NVIDIA H200 (driver 580.159.04)' or 'CPU (<model>) - no GPU'."""
    if stamp.get("device_type") == "cuda":
        return f"{stamp['gpu']} (driver {stamp.get('driver') or '?'})"
    return f"CPU ({stamp.get('cpu')}) - no GPU, speed figures are not GPU figures"
