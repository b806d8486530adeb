"""`swinbench env`: what this machine gives swinbench, and what each command will fall back to.

One row per capability, each with what it means for the commands: the device and versions that every
record is stamped with, whether Nsight Systems is there (else `profile` and `apply --profile` use
torch.profiler), whether the `nvtx` package is (else ranges go through torch.cuda.nvtx), how the Triton
kernels run (compiled for the GPU, the CPU interpreter, or not at all, in which case the fused-kernel
passes report themselves not available), how eager code launches them, whether apex is importable
(fused_layernorm's `impl: apex`), and the SWINBENCH_* settings in force.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess

import torch

from workbench.env import environment_stamp


def _nsys_row(on_gpu: bool) -> tuple[str, str]:
    from workbench.errors import UserError
    from workbench.trace.nsys_sqlite import find_nsys

    try:
        path = find_nsys()
    except UserError as exc:   # profile (backends.resolve_backend) stops on it where it would use nsys
        if on_gpu:
            return "not usable", f"{exc}: profile and apply --profile stop with this error until it is fixed or unset"
        return "not usable", f"{exc}: not needed here, profile and apply --profile use torch.profiler on the CPU"
    if path is None:
        return "not found", "profile and apply --profile use torch.profiler (Kineto) instead; see docs/gpu-machine.md"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
        version = (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else "?"
    except (OSError, subprocess.TimeoutExpired) as exc:
        version = f"does not run: {exc}"
    return path, version


def _module_row(name: str, without: str) -> tuple[str, str]:
    if importlib.util.find_spec(name) is None:
        return "not installed", without
    try:
        module = __import__(name)
    except Exception as exc:  # an installed package that fails to import is worth saying, not a traceback
        return "fails to import", f"{type(exc).__name__}: {exc}"
    return getattr(module, "__version__", "installed"), ""


def environment_report(device: str = "auto") -> list[dict]:
    """Rows of {"what", "value", "note"}: the machine's capabilities and what swinbench does with them."""
    from workbench.optimize.passes import triton_runs_on
    from workbench.devices import resolve_device

    dev = resolve_device(device)
    stamp = environment_stamp(dev)
    rows = []

    def add(what, value, note=""):
        rows.append({"what": what, "value": "-" if value is None else str(value), "note": note})

    on_gpu = stamp["device_type"] == "cuda"
    add("device", stamp["gpu"] if on_gpu else f"CPU ({stamp['cpu']})",
        f"driver {stamp['driver']}, {stamp.get('sm_count')} SMs, capability {stamp.get('capability')}" if on_gpu
        else "no GPU: commands run the tiny Swin on the CPU and label every figure CPU")
    for key in ("torch", "triton", "timm", "cuda", "python"):
        add(key, stamp.get(key), "the CUDA torch was built for: no CUDA GPU is in use here"
            if key == "cuda" and not on_gpu and stamp.get(key) else "")
    nsys, note = _nsys_row(on_gpu)
    add("nsys", nsys, note)
    version, note = _module_row("nvtx", "NVTX ranges go through torch.cuda.nvtx (no domain); see docs/gpu-machine.md")
    add("nvtx package", version, note)
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if stamp.get("triton") is None:
        kernels, note = "unavailable", "triton is not installed: the fused-kernel passes are not available"
    elif dev.type == "cuda" and not interpret:
        kernels, note = "compiled for the GPU", ""
    elif triton_runs_on(dev):
        kernels, note = "CPU interpreter (TRITON_INTERPRET=1)", "correct but slow: for tests, not for timing"
    else:
        kernels, note = "not on this device", "no GPU: the fused-kernel passes report themselves not available"
    add("Triton kernels", kernels, note)
    if kernels == "compiled for the GPU":
        from workbench.kernels._common import launcher_name, pdl_launch, pdl_supported

        add("eager Triton launches", launcher_name(),
            "SWINBENCH_FAST_LAUNCH=1 / 0 forces the cached launcher on / off (docs/debugging.md)")
        add("programmatic dependent launch", "on" if pdl_launch() else "off",
            "window kernels; SWINBENCH_PDL=0 turns it off" if pdl_supported()
            else "needs a Hopper or newer GPU and a Triton with launch_pdl")
    else:
        add("eager Triton launches", None, "no compiled kernels run here")
    version, note = _module_row("apex", "fused_layernorm uses the Triton LayerNorm (impl: auto)")
    add("apex", version, note)
    settings = stamp.get("swinbench_env") or {}
    add("SWINBENCH_* settings", ", ".join(f"{k}={v}" for k, v in settings.items()) or "none")
    return rows


def render_environment(rows: list[dict], console) -> None:
    from rich.table import Table

    table = Table(title="swinbench env", title_justify="left")
    for col in ("what", "value", "note"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r["what"], r["value"], r["note"])
    console.print(table)
