"""Start a test worker script in WORLD processes under torchrun on the CPU (gloo), the repository on the
workers' path and one thread each, and wait for it (the data-parallel tests' launcher)."""
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORLD = 2


def torchrun(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(WORLD), *args], capture_output=True, text=True, timeout=timeout, env=env)
