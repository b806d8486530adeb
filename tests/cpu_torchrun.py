"""Start a test worker script in WORLD processes under torchrun on the CPU (gloo), the repository on the
workers' path and one thread each, and wait for it (the data-parallel tests' launcher).

A rank that dies in gloo's C++ teardown ("terminate called without an active exception", SIGABRT, no Python
traceback: a worker thread torn down joinable) is torch's, not the code under test; such a run is started
once more, and a second failure is reported with the head and the tail of both runs' output."""
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORLD = 2
TEARDOWN_ABORT = "terminate called without an active exception"


def _native_teardown_abort(done: subprocess.CompletedProcess) -> bool:
    return done.returncode != 0 and TEARDOWN_ABORT in done.stderr and "SIGABRT" in done.stderr \
        and "Traceback (most recent call last)" not in done.stderr.split(TEARDOWN_ABORT)[0]


def _start(args, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(WORLD), *args], capture_output=True, text=True, timeout=timeout, env=env)


def run_output(done: subprocess.CompletedProcess) -> str:
    """A failed run's output for an assertion: the head (where a rank's own traceback is) and the tail."""
    err = done.stderr
    return err if len(err) <= 6000 else f"{err[:3000]}\n...\n{err[-3000:]}"


def torchrun(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    done = _start(args, timeout)
    if not _native_teardown_abort(done):
        return done
    again = _start(args, timeout)
    if again.returncode != 0:
        again.stderr = (f"first run (gloo teardown abort):\n{done.stderr[:1500]}\n...\n{done.stderr[-1500:]}\n"
                        f"second run:\n{again.stderr[:1500]}\n...\n{again.stderr[-1500:]}")
    return again
