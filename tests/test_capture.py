"""Backend choice and nsys discovery (no nsys on the CPU test machine: the fallbacks are what is tested)."""
import os
import stat

import pytest
import torch

from workbench.capture.backends import find_nsys, resolve_backend
from workbench.errors import UserError

CPU = torch.device("cpu")


def test_auto_on_cpu_falls_back_to_torch_profiler_and_says_why():
    backend, path, note = resolve_backend("auto", CPU, None)
    assert backend == "torch" and path is None and "torch.profiler" in note


def test_auto_on_cpu_never_needs_nsys_but_a_wrong_nsys_flag_is_said(tmp_path, monkeypatch):
    """A stale $SWINBENCH_NSYS (set for the GPU machine) does not stop a CPU capture, which never uses nsys."""
    monkeypatch.setenv("SWINBENCH_NSYS", str(tmp_path / "missing"))
    backend, path, note = resolve_backend("auto", CPU, None)
    assert backend == "torch" and path is None and "torch.profiler" in note
    with pytest.raises(UserError, match="nsys not found at .*--nsys"):
        resolve_backend("auto", CPU, str(tmp_path / "nope"))


def test_explicit_nsys_without_gpu_or_binary_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("SWINBENCH_NSYS", raising=False)
    with pytest.raises(UserError, match="nsys not found at"):
        resolve_backend("nsys", CPU, str(tmp_path / "nope"))
    with pytest.raises(UserError, match="unknown backend"):
        resolve_backend("perfetto", CPU, None)


def test_a_given_nsys_with_the_torch_backend_is_said_unused(tmp_path):
    backend, path, note = resolve_backend("torch", CPU, str(tmp_path / "nsys"))
    assert backend == "torch" and path is None and "--nsys is not used" in note
    assert resolve_backend("torch", CPU, None) == ("torch", None, None)


def test_find_nsys_prefers_flag_then_environment(tmp_path, monkeypatch):
    fake = tmp_path / "nsys"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("SWINBENCH_NSYS", str(fake))
    assert find_nsys() == str(fake)
    assert find_nsys(str(fake)) == str(fake)
    monkeypatch.setenv("SWINBENCH_NSYS", str(tmp_path / "missing"))
    with pytest.raises(UserError):
        find_nsys()
    assert os.environ["SWINBENCH_NSYS"]


def test_the_ranges_leave_a_compiled_forward_in_one_graph():
    """The modules' range hooks are no-ops while torch.compile traces: the compiled step profile captures
    is the one apply times, not one split at every push and pop."""
    import torch

    from workbench.optimize.ranges import RangeMarker, annotate_modules
    from workbench.optimize.workload import Workload, WorkloadConfig

    w = Workload.build(WorkloadConfig(model="swinbench_tiny_cpu", mode="infer", batch=2, device="cpu",
                                      precision="fp32"))
    w.marker = RangeMarker("torch")
    annotate_modules(w.model, w.marker)
    explained = torch._dynamo.explain(w._forward)(w.x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
