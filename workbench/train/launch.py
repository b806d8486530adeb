"""`swinbench train --nproc N`: the same runs, data parallel, one process per GPU under torchrun.

The command checks everything and claims its folder as it does for one process, then starts

    python -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node N --no-python \
        python -P -m workbench.train.rank SPEC        (backends.torchrun_module_command)

(with --nnodes M: `--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID` instead of --standalone) and
waits. SPEC (ranks.json in the run's folder) holds the checked config and the planned runs. Each rank
initializes the process group (nccl on CUDA, cuda:LOCAL_RANK; gloo on the CPU), loads the data and trains
every run through `loop.train_run` on its share of each global batch of N x --batch images, the model in
DDP (optimize_swin's default under torchrun) or, with --parallel fsdp, sharded by FSDP2. Rank 0 alone
writes the record files and prints progress; the command then renders report.md and curves.png from them
as for one process. The ranks' stderr goes
to torchrun.log in the run's folder; a rank's UserError comes back as the command's one-line error.

This module is the launching side; `rank.py` is what runs in each process.
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import asdict
from pathlib import Path

import torch

from workbench.errors import Interrupted, UserError
from workbench.files import atomic_write_text

SPEC_FILE = "ranks.json"
LOG_FILE = "torchrun.log"
ERROR_PREFIX = "swinbench-rank-error: "


def check_devices(config, device: torch.device) -> None:
    """UserError unless this machine has a device for each of config.nproc processes."""
    if device.type != "cuda":
        return
    if device.index is not None:
        raise UserError(f"--nproc gives each process its own GPU (cuda:0 to cuda:{config.nproc - 1}): use --device "
                        f"cuda, not {device}")
    have = torch.cuda.device_count()
    if config.nproc > have:
        raise UserError(f"--nproc {config.nproc} needs {config.nproc} GPUs on this machine; it has {have}")


def torchrun_arguments(config) -> list[str]:
    """torch.distributed.run's options for config's --nproc, --nnodes and rendezvous."""
    if config.nnodes == 1 and config.rdzv_endpoint is None:
        where = ["--standalone", "--nnodes", "1"]
    else:
        where = ["--nnodes", str(config.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", config.rdzv_endpoint,
                 "--rdzv-id", config.rdzv_id or "swinbench"]
    return [*where, "--nproc-per-node", str(config.nproc)]


def write_spec(config, runs: list[tuple[str, int]], model_name: str, device: torch.device, out_dir: Path) -> Path:
    """ranks.json: what every rank trains."""
    cfg = asdict(config)
    cfg["data"] = None if config.data is None else str(config.data)
    spec = {"config": cfg, "runs": [list(r) for r in runs], "model": model_name, "device_type": device.type,
            "out_dir": str(out_dir)}
    path = out_dir / SPEC_FILE
    atomic_write_text(path, json.dumps(spec, indent=1) + "\n")
    return path


def launch_ranks(config, runs: list[tuple[str, int]], model_name: str, device: torch.device, out_dir: Path,
                 console) -> None:
    """Run every planned run under torchrun (workbench.train.rank in each process), streaming rank 0's
    progress to `console`. A rank's UserError is raised here as it was said there."""
    from workbench.capture.backends import stop_process, torchrun_module_command

    spec = write_spec(config, runs, model_name, device, out_dir)
    console.print(f"torchrun: {config.nproc} process{'es' if config.nproc > 1 else ''} per machine x "
                  f"{config.nnodes} machine{'s' if config.nnodes > 1 else ''}, {config.batch} images per process a "
                  f"step (global batch {config.batch * config.world}); the ranks' stderr in {out_dir / LOG_FILE}",
                  highlight=False)
    cmd, env = torchrun_module_command(torchrun_arguments(config), "workbench.train.rank", str(spec))
    log_path = out_dir / LOG_FILE
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        try:
            for line in proc.stdout:
                console.print(line.rstrip("\n"), markup=False, highlight=False, soft_wrap=True)
            code = proc.wait()
        except KeyboardInterrupt:
            raise Interrupted(f"interrupted: what rank 0 finished is in {out_dir / 'records'}") from None
        finally:
            stop_process(proc)
    if code != 0:
        text = log_path.read_text(errors="replace")
        errors = [line[len(ERROR_PREFIX):] for line in text.splitlines() if line.startswith(ERROR_PREFIX)]
        if errors:
            raise UserError(errors[0])
        raise UserError(f"torchrun exited with {code}: a rank failed; its traceback is in {log_path}")
