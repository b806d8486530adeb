"""Stage and capture subprocesses import workbench from its own folder and nothing from the current
folder: a `timm.py` (or any module) lying where the user runs swinbench is never executed."""
import sys
from pathlib import Path

import pytest

from workbench.ladder import apply as apply_mod
from workbench.capture import backends as capture
from workbench.capture.backends import python_module_command

PROBE = "swinbench_cwd_probe"


@pytest.fixture
def hostile_cwd(tmp_path, monkeypatch):
    """A current folder holding a module that leaves a marker file when it is imported."""
    marker = tmp_path / "MARKER"
    (tmp_path / f"{PROBE}.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (tmp_path / "timm.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    return marker


def _run(module: str, tmp_path: Path) -> int:
    return apply_mod._stream(module, [], tmp_path / "log.txt", lambda event: None)


@pytest.mark.parametrize("old_python", [False, True])
def test_module_in_the_current_folder_is_not_imported(hostile_cwd, tmp_path, monkeypatch, old_python):
    if old_python:   # the interpreter without -P: sys.path[0] replaced before anything is imported
        monkeypatch.setattr(sys, "version_info", (3, 10, 0))
    assert _run(PROBE, tmp_path) != 0
    assert "No module named" in (tmp_path / "log.txt").read_text()
    assert not hostile_cwd.exists()


def test_workbench_is_found_from_any_folder(hostile_cwd, tmp_path):
    assert _run("workbench.errors", tmp_path) == 0, (tmp_path / "log.txt").read_text()
    assert not hostile_cwd.exists()


def test_nsys_capture_starts_its_worker_the_same_way(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(capture, "_run", lambda cmd, log, what, env=None: seen.append((cmd, env)))
    config = capture.WorkloadConfig(model="swinbench_tiny_cpu", mode="train", batch=1, precision="fp32",
                                    device="cpu", seed=0)
    with pytest.raises(capture.UserError):   # the fake nsys wrote no report
        capture.capture_nsys(config, None, tmp_path, 1, 0, "nsys")
    cmd, env = seen[0]
    worker, worker_env = python_module_command("workbench.capture.worker", str(tmp_path / "capture_spec.json"))
    assert cmd[-len(worker):] == worker
    assert env["PYTHONPATH"] == worker_env["PYTHONPATH"]
