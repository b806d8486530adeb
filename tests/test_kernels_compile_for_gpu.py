"""Every Triton kernel variant the host functions launch compiles for an H200 (sm_90) with Triton's own
compiler and bundled ptxas, on this machine, GPU or not (tests/aot_compile_kernels.py --quick: one shape
per code path). The interpreter the other CPU tests use accepts code the GPU compiler rejects; this
catches that before a GPU session spends its time on it."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("aot_compile_kernels.py")


def _nvidia_backend() -> bool:
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


@pytest.mark.skipif(not _nvidia_backend(), reason="this Triton has no NVIDIA backend to compile with")
def test_every_kernel_variant_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick"], env=env, capture_output=True, text=True,
                          timeout=900)
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    assert proc.returncode == 0, tail
    assert "0 failed" in proc.stdout and "_partition_fwd_kernel" in proc.stdout, tail
