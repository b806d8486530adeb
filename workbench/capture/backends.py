"""Capturing a trace of a workload: Nsight Systems when it is there, torch.profiler (Kineto) otherwise.

Under nsys the process re-runs itself (`python -m workbench.capture.worker SPEC.json`) under
`nsys profile -t cuda,nvtx -s none --cpuctxsw=none --capture-range=cudaProfilerApi`, and the worker
brackets only the measured steps with cudaProfilerStart/Stop, so warm-up (and compilation) stays
out of the capture. The report is then exported to SQLite with `nsys export`.

Under torch.profiler the workload runs in this process. Kineto's C++ side writes to file descriptor 2
directly ('ERROR: ... gpuGetDeviceCount failed' on a machine without a GPU, 'USDT: ... profiler_start'),
so while it runs, descriptor 2 goes to `capture.log` in the output folder (`stderr_to_log`); of what
lands there, only the lines a user must see (Python exceptions and warnings) are echoed afterwards.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from workbench import SOURCE_ROOT
from workbench.errors import UserError
from workbench.files import atomic_write_text
from workbench.trace.nsys_sqlite import NSYS_FOLDERS, find_nsys
from workbench.optimize.workload import WorkloadConfig

_ROOT = str(SOURCE_ROOT)   # the folder that holds the workbench package


def python_module_command(module: str, *args: str) -> tuple[list[str], dict]:
    """-> (argv, environment) that run `python -m module args` in a fresh interpreter whose import path
    starts with the folder holding this `workbench` package and never holds the current folder, so a
    `timm.py` or `torch.py` lying in the user's folder is not imported (nor run) by a stage or capture
    process. Python 3.11+ gets `-P`; older ones replace sys.path[0] before importing anything."""
    env = dict(os.environ)
    env["PYTHONPATH"] = _ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module, *args], env
    start = (f"import sys; sys.path[0] = {_ROOT!r}; import runpy; "
             f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [sys.executable, "-c", start, *args], env


def torchrun_module_command(torchrun_args: list[str], module: str, *args: str) -> tuple[list[str], dict]:
    """-> (argv, environment): torchrun (torch.distributed.run, with `torchrun_args`) starting `python -m
    module args` as every rank, each rank's interpreter made as python_module_command makes it. torchrun's
    own `-m` would start the ranks with the current folder first on their import path again."""
    worker, _ = python_module_command(module, *args)
    cmd, env = python_module_command("torch.distributed.run", *torchrun_args, "--no-python", *worker)
    env["PYTHONUNBUFFERED"] = "1"    # what torchrun's `python -u` gives, which --no-python leaves out
    return cmd, env


def stop_process(proc) -> None:
    """Stop a child process (a subprocess.Popen) if it still runs: SIGTERM, then SIGKILL after 10 s. A
    stage process or torchrun must not write on after the run that started it has stopped."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def resolve_backend(backend: str, device: torch.device, nsys: str | None) -> tuple[str, str | None, str | None]:
    """-> (backend, nsys path, note). 'auto' takes nsys on a GPU when nsys is found, else torch.profiler,
    and the note says why; an explicit 'nsys' that cannot run is a UserError. 'auto' off a GPU never looks
    for nsys (it traces CUDA only), so a stale $SWINBENCH_NSYS does not stop a CPU capture; a wrong
    --nsys is still said."""
    if backend not in ("auto", "nsys", "torch"):
        raise UserError(f"unknown backend {backend!r}: choose auto, nsys or torch")
    if backend == "torch":
        return "torch", None, ("--nsys is not used: --backend torch captures with torch.profiler" if nsys else None)
    if backend == "auto" and device.type != "cuda":
        if nsys:
            find_nsys(nsys)     # the user's own --nsys: a wrong path is one line, as on a GPU
        return "torch", None, "no GPU: torch.profiler backend on the CPU (CPU operator times, no GPU kernels)"
    path = find_nsys(nsys)
    if backend == "nsys":
        if path is None:
            raise UserError("nsys not found (tried --nsys, $SWINBENCH_NSYS, PATH, " + ", ".join(NSYS_FOLDERS) + ")")
        if device.type != "cuda":
            raise UserError("the nsys backend traces CUDA: use --device cuda, or --backend torch on the CPU")
        return "nsys", path, None
    if path is None:
        return "torch", None, "nsys not found: torch.profiler (Kineto) backend instead"
    return "nsys", path, None


def _worker_spec(config: WorkloadConfig, recipe: str | None, steps: int, warmup: int, marker: str,
                 out_dir: Path, torch_trace: Path | None = None) -> Path:
    spec = {"config": asdict(config), "recipe": recipe, "steps": steps, "warmup": warmup,
            "marker": marker, "out_dir": str(out_dir), "torch_trace": str(torch_trace) if torch_trace else None}
    return atomic_write_text(out_dir / "capture_spec.json", json.dumps(spec, indent=2))


# torchrun's prefix on a rank's output lines: '[rank0]: ', '[default0]: '
_RANK_PREFIX = re.compile(r"^\[[a-z]*\d+\]:\s*")


def _first_error(log: Path) -> str:
    """The line of a log that says what went wrong: the last Python exception line (not torchrun's own
    summary that a child failed, which would hide the rank's error; a rank's without torchrun's prefix),
    else the last line."""
    lines = [_RANK_PREFIX.sub("", ln.strip()) for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.split(":")[0].endswith(("Error", "Exception"))
              and "ChildFailedError" not in ln and "torch.distributed.elastic" not in ln]
    line = (errors or lines or ["no output"])[-1]
    return line if len(line) <= 400 else line[:399] + "…"   # one line, said whole unless it runs on


def _run(cmd: list[str], log: Path, what: str, env: dict | None = None) -> None:
    with open(log, "ab") as fh:
        fh.write(("$ " + " ".join(cmd) + "\n").encode())
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
        try:
            proc.wait()
        except BaseException:
            # Ctrl-C or SIGTERM: SIGTERM first, which torchrun and nsys pass on to the processes they started
            # (subprocess.run's SIGKILL would orphan them, writing on after this run let go of its folder)
            stop_process(proc)
            raise
    if proc.returncode != 0:
        raise UserError(f"{what} failed (exit {proc.returncode}): {_first_error(log)} (full log: {log})")


def capture_nsys(config: WorkloadConfig, recipe: str | None, out_dir: Path, steps: int, warmup: int,
                 nsys: str) -> Path:
    """Run the workload under nsys and export SQLite -> path of `trace.sqlite` (the .nsys-rep stays beside it)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = _worker_spec(config, recipe, steps, warmup, "nvtx", out_dir)
    rep_base = out_dir / "trace"
    for stale in (out_dir / "trace.nsys-rep", out_dir / "trace.qdstrm", out_dir / "trace.sqlite"):
        stale.unlink(missing_ok=True)
    log = out_dir / "nsys.log"
    log.write_text("")
    worker, env = python_module_command("workbench.capture.worker", str(spec))
    _run(_nsys_profile(nsys, rep_base) + worker, log, "nsys profile", env)
    return _export_sqlite(nsys, out_dir, log)


def _nsys_profile(nsys: str, rep_base: Path | str) -> list[str]:
    """`nsys profile` with the capture's settings (CUDA and NVTX, the cudaProfilerApi capture range), up
    to the program it runs."""
    return [nsys, "profile", "-t", "cuda,nvtx", "-s", "none", "--cpuctxsw=none", "--cuda-graph-trace=node",
            "--capture-range=cudaProfilerApi", "--capture-range-end=stop", "--force-overwrite", "true",
            "-o", str(rep_base)]


def _export_sqlite(nsys: str, folder: Path, log: Path) -> Path:
    """folder/trace.nsys-rep exported to folder/trace.sqlite (renamed once complete) -> its path."""
    rep = folder / "trace.nsys-rep"
    if not rep.exists():
        if (folder / "trace.qdstrm").exists():
            raise UserError("nsys wrote only trace.qdstrm: its QdstrmImporter could not make a report "
                            "(on many images it lacks libdw/libelf; see docs/gpu-machine.md)")
        raise UserError(f"nsys wrote no report in {folder} (see {log})")
    sqlite, tmp = folder / "trace.sqlite", folder / ".trace.export.sqlite"
    try:
        _run([nsys, "export", "--type", "sqlite", "--force-overwrite", "true", "-o", str(tmp), str(rep)],
             log, "nsys export")
        tmp.replace(sqlite)
    finally:
        tmp.unlink(missing_ok=True)
    return sqlite


def capture_ranks(config: WorkloadConfig, recipe: str | None, out_dir: Path, steps: int, warmup: int,
                  backend: str, nsys: str | None, nproc: int, parallel: str = "ddp") -> list[Path]:
    """`profile --nproc N`: the workload data parallel (`parallel`: ddp or fsdp) in N processes under
    torchrun, one capture per rank
    into <out>/rank<r>/ (the same warm-up, capture range and NVTX ranges on every rank) -> the ranks'
    traces in rank order (trace.sqlite under nsys, trace.json under torch.profiler)."""
    from workbench.capture.worker import RANK_DIR

    out_dir.mkdir(parents=True, exist_ok=True)
    marker = "nvtx" if backend == "nsys" else "torch"
    spec = out_dir / "capture_spec.json"
    atomic_write_text(spec, json.dumps({"config": asdict(config), "recipe": recipe, "steps": steps, "warmup": warmup,
                                        "marker": marker, "out_dir": str(out_dir), "nproc": nproc,
                                        "parallel": parallel}, indent=2))
    dirs = [out_dir / RANK_DIR.format(rank=r) for r in range(nproc)]
    for d in dirs:
        d.mkdir(exist_ok=True)
        for stale in ("trace.nsys-rep", "trace.qdstrm", "trace.sqlite", "trace.json", "run.json"):
            (d / stale).unlink(missing_ok=True)
    launcher = ["torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc)]
    log = out_dir / ("nsys.log" if backend == "nsys" else "capture.log")
    log.write_text("")
    if backend == "nsys":
        worker, env = python_module_command("workbench.capture.worker", str(spec))
        # torchrun starts nsys as each rank's program; nsys expands %q{RANK} from the rank's environment
        rep_base = out_dir / RANK_DIR.format(rank="%q{RANK}") / "trace"
        cmd, env = python_module_command(*launcher, "--no-python", *_nsys_profile(nsys, rep_base), *worker)
        _run(cmd, log, "torchrun + nsys profile", env)
        return [_export_sqlite(nsys, d, log) for d in dirs]
    cmd, env = torchrun_module_command(launcher[1:], "workbench.capture.worker", str(spec))
    _run(cmd, log, "torchrun", env)
    traces = [d / "trace.json" for d in dirs]
    missing = [t for t in traces if not t.exists()]
    if missing:
        raise UserError(f"no trace from {missing[0].parent.name} (see {log})")
    return traces


# A Python exception line ('RuntimeError: ...') or a warning ('x.py:12: UserWarning: ...'). Kineto's own
# lines ('ERROR:2026-... DeviceProperties.cpp:56] ...', 'USDT:...') start with an upper-case tag instead.
_PYTHON_LINE = re.compile(r"^(?:\S+\.py:\d+: )?(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Warning): ")


def python_lines(log: Path, start: int = 0) -> list[str]:
    """The lines of `log` from byte `start` on that Python wrote as an exception or a warning."""
    with open(log, "rb") as fh:
        fh.seek(start)
        text = fh.read().decode(errors="replace")
    return [ln for ln in text.splitlines() if _PYTHON_LINE.match(ln.strip())]


@contextmanager
def stderr_to_log(log: Path):
    """While the block runs, send this process's file descriptor 2 (where C++ libraries write) to `log`
    (appended); afterwards echo on stderr only the Python exception and warning lines it got."""
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    start = log.stat().st_size if log.exists() else 0
    saved = os.dup(2)
    try:
        with open(log, "ab") as fh:
            os.dup2(fh.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
    finally:
        os.close(saved)
    for line in python_lines(log, start):
        print(line, file=sys.stderr)


def capture_torch(config: WorkloadConfig, recipe: str | None, out_dir: Path, steps: int, warmup: int) -> Path:
    """Run the workload in this process under torch.profiler -> path of `trace.json` (Kineto). The
    profiler's C++ output goes to `capture.log` beside it (`stderr_to_log`)."""
    from workbench.capture.worker import run_capture

    out_dir.mkdir(parents=True, exist_ok=True)
    trace = out_dir / "trace.json"
    log = out_dir / "capture.log"
    try:
        with stderr_to_log(log):
            run_capture(config, recipe, steps=steps, warmup=warmup, marker="torch", out_dir=out_dir,
                        torch_trace=trace)
    except (UserError, KeyboardInterrupt):
        raise
    except Exception as exc:      # the workload failed (out of memory, a kernel's error): one line, the log
        import traceback

        with open(log, "a") as fh:
            traceback.print_exc(file=fh)
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise UserError(f"capture failed: {type(exc).__name__}: {first} (full traceback: {log})") from None
    return trace


def capture_workload(config: WorkloadConfig, recipe_stage: str | None, recipe_source: str | None,
                     out_dir: Path, steps: int, warmup: int, backend: str = "auto",
                     nsys: str | None = None) -> tuple[Path, str]:
    """Capture `steps` steps of the workload (after `warmup`), as the recipe stage leaves the model.
    -> (trace path, backend used: 'nsys' | 'torch')."""
    from workbench.devices import resolve_device

    device = resolve_device(config.device)
    chosen, nsys_path, _ = resolve_backend(backend, device, nsys)
    recipe = recipe_source or recipe_stage
    if chosen == "nsys":
        return capture_nsys(config, recipe, Path(out_dir), steps, warmup, nsys_path), "nsys"
    return capture_torch(config, recipe, Path(out_dir), steps, warmup), "torch"
