"""The correctness gate: amp passes at its bf16 tolerance on the CPU, a deliberately wrong pass fails."""
from dataclasses import replace

import pytest

from workbench.optimize.gate import (capture_parameters, compare, compute_reference, forward_backward,
                            gate_parameter_names, weights_digest)
from workbench.models import TINY_MODEL
from workbench.optimize.passes import apply_pass
from workbench.optimize.recipes import gate_tolerance, resolve_chain
from workbench.optimize.workload import Workload, WorkloadConfig
from pass_helpers import register_test_pass, scale_head

CFG = WorkloadConfig(model=TINY_MODEL, batch=2, precision="fp32", device="cpu", seed=0)


@pytest.fixture(scope="module")
def reference():
    return compute_reference(CFG)


def stage_outputs(passes):
    w = Workload.build(CFG)
    digest = weights_digest(w.model)
    params = capture_parameters(w.model)
    for name, p in passes:
        w.model, _ = apply_pass(name, w.model, w.ctx, p)
    w.prepare()
    out = forward_backward(w, params)
    out.weights_digest = digest
    return out, w.ctx.precision.name


def test_gate_parameters_are_the_named_ones():
    names = gate_parameter_names(Workload.build(CFG).model)
    assert names == ["layers.0.blocks.0.attn.qkv.weight", "layers.0.blocks.0.norm1.weight",
                     "layers.0.blocks.0.attn.relative_position_bias_table", "head.fc.weight"]


def test_same_seed_same_weights_and_zero_diff(reference):
    assert weights_digest(Workload.build(CFG).model) == reference.weights_digest
    assert weights_digest(Workload.build(replace(CFG, seed=1)).model) != reference.weights_digest
    out, prec = stage_outputs([])
    result = compare(out, reference, gate_tolerance(resolve_chain("baseline"), prec), is_reference=True)
    assert result.status == "REFERENCE" and result.metrics["logits"]["max_abs"] == 0.0


def test_amp_bf16_passes_with_recipe_tolerance(reference):
    out, prec = stage_outputs([("amp", {"dtype": "bf16"})])
    assert prec == "bf16"
    result = compare(out, reference, gate_tolerance(resolve_chain("amp"), prec))
    assert result.status == "PASS", result.reason
    assert 0 < result.metrics["logits"]["rel_l2"] < 0.05   # bf16 really ran, and stayed close


def test_wrong_pass_fails_the_gate(monkeypatch, reference):
    register_test_pass(monkeypatch, "scale_head_test", scale_head)
    out, prec = stage_outputs([("scale_head_test", {})])
    result = compare(out, reference, gate_tolerance(resolve_chain("baseline"), prec))
    assert result.status == "FAIL"
    assert "logits rel L2" in result.reason and "loss diff" in result.reason
    # even at the loose bf16 tolerance a 10% wrong head is caught
    loose = compare(out, reference, gate_tolerance(resolve_chain("amp"), "bf16"))
    assert loose.status == "FAIL"


def test_different_initial_weights_fail_the_gate(reference):
    w = Workload.build(replace(CFG, seed=1))
    digest = weights_digest(w.model)
    params = capture_parameters(w.model)
    w.x, w.y = reference_batch()
    w.prepare()
    out = forward_backward(w, params)
    out.weights_digest = digest
    result = compare(out, reference, gate_tolerance(resolve_chain("baseline"), "fp32"))
    assert result.status == "FAIL" and "initial weights differ" in result.reason


def reference_batch():
    w = Workload.build(CFG)
    return w.x, w.y


def test_nan_fails(reference):
    out, prec = stage_outputs([])
    out.logits = out.logits.clone()
    out.logits[0, 0] = float("nan")
    assert compare(out, reference, gate_tolerance(resolve_chain("baseline"), prec)).status == "FAIL"


def test_top1_agreement_is_recorded_not_gated(reference):
    from workbench.optimize.gate import top1_agreement
    import torch

    out, prec = stage_outputs([])
    result = compare(out, reference, gate_tolerance(resolve_chain("baseline"), prec), is_reference=True)
    assert result.metrics["top1_agreement"] == 1.0
    a = torch.tensor([[0.0, 1.0], [2.0, 0.0], [0.0, 3.0], [1.0, 0.0]])
    b = torch.tensor([[0.0, 1.0], [0.0, 2.0], [0.0, 3.0], [1.0, 0.0]])
    assert top1_agreement(a, b) == 0.75
    assert top1_agreement(a, b[:3]) is None and top1_agreement(a[:, 0], b[:, 0]) is None
