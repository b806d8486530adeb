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


_SPECIALIZATION_PROBE = """
import sys, torch
sys.path.insert(0, {tests!r})
import aot_compile_kernels as A
import importlib
fn = importlib.import_module("workbench.kernels._common")._sum_partials_kernel
names = [p.name for p in fn.params]
for n in (2048, 1023):
    sig, constexprs, attrs, _ = A._signature(fn, (torch.empty(2 * n), torch.empty(n), 1, n),
                                             dict(BLOCK_P=1, BLOCK_N=1024, num_warps=4))
    print(sig["PARTIAL"], (names.index("PARTIAL"),) in attrs, sig["n_partials"], constexprs.get("n_partials"),
          sig["n_cols"], (names.index("n_cols"),) in attrs)
"""


@pytest.mark.skipif(not _nvidia_backend(), reason="this Triton has no NVIDIA backend to compile with")
def test_ahead_of_time_launches_are_specialized_as_the_jit_specializes_them():
    """The script compiles each launch with the attributes Triton's JIT would give it: an int equal to 1
    is a constexpr, a 16-byte aligned tensor and an int divisible by 16 carry tt.divisibility 16, other
    ints carry nothing. Without them every kernel compiles to scalar memory accesses and other register
    counts than it runs with."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parents[1])] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-c", _SPECIALIZATION_PROBE.format(tests=str(SCRIPT.parent))], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["*fp32", "True", "constexpr", "1", "i32", "True",
                                   "*fp32", "True", "constexpr", "1", "i32", "False"], proc.stdout
