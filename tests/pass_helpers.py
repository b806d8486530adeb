"""Test-only passes and how to register them, shared by the gate and apply tests."""
import sys
import types

import torch

from workbench.passes import PASS_MODULES, PassResult


def register_test_pass(monkeypatch, name: str, apply_fn) -> None:
    """Register a pass module at runtime (as if it were workbench/passes/<name>.py)."""
    module = types.ModuleType(f"workbench.passes.{name}")
    module.NAME = name
    module.apply = apply_fn
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(PASS_MODULES, name, name)


def scale_head(model, ctx):
    """A deliberately wrong pass: the gate must catch it."""
    with torch.no_grad():
        model.head.fc.weight.mul_(1.1)
    return model, PassResult("scale_head_test", {}, "head weight x1.1 (deliberately wrong)")
