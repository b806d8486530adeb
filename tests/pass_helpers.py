"""Test-only passes and how to register them, shared by the gate and apply tests."""
import sys
import types

import torch

from workbench.optimize.passes import PASS_MODULES, PassResult


def register_test_pass(monkeypatch, name: str, apply_fn) -> None:
    """Register a pass module at runtime (as if it were workbench/optimize/passes/<name>.py)."""
    module = types.ModuleType(f"workbench.optimize.passes.{name}")
    module.NAME = name
    module.apply = apply_fn
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(PASS_MODULES, name, name)


def scale_head(model, ctx):
    """A deliberately wrong pass: the gate must catch it."""
    with torch.no_grad():
        model.head.fc.weight.mul_(1.1)
    return model, PassResult("scale_head_test", {}, "head weight x1.1 (deliberately wrong)")


def pass_ctx(device, precision: str = "fp32"):
    """A PassContext for `device` with `precision` resolved (what Workload.build gives a pass)."""
    from workbench.optimize.passes import PassContext
    from workbench.precision import resolve_precision

    return PassContext(device=torch.device(device), precision=resolve_precision(precision))


def model_pair(device, seed: int = 0, build=None, **kwargs):
    """(model, deep copy) on `device`, built right after torch.manual_seed(seed): `build()`, or the tiny
    Swin with build_model's `kwargs` (drop_path_rate, ...). One to patch, one to compare with."""
    import copy

    from workbench.models import TINY_MODEL, build_model

    torch.manual_seed(seed)
    model = (build() if build is not None else build_model(TINY_MODEL, **kwargs)).to(device)
    return model, copy.deepcopy(model)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def assert_same_as_the_cast_path(logits, grads, logits_ref, grads_ref, device) -> None:
    """A fused norm writing a Linear's input dtype itself against the same norm writing fp32 for autocast to
    cast: the logits bit for bit; the gradients bit for bit under the interpreter and to 1e-3 in relative
    norm on a GPU, where the norm backward's row sums run in the register layout Triton picks for dy's
    dtype (bf16 on one path, fp32 on the other) and so add the same values in another order (seen on the
    H200: last-bit differences, which a Linear's bf16 backward upstream can round apart)."""
    assert torch.equal(logits, logits_ref)
    for name, g in grads_ref.items():
        if torch.device(device).type == "cpu":
            assert torch.equal(grads[name], g), name
        else:
            assert rel_err(grads[name], g) < 1e-3, (name, rel_err(grads[name], g))


def tiny_batch(model, batch: int, device, seed: int = 1):
    """(images, labels) for a Swin of 10 classes: `batch` random images of the model's input size and random
    labels, drawn from one generator seeded `seed` (the same batch for every test that asks the same)."""
    from workbench.models import input_size

    g = torch.Generator().manual_seed(seed)
    images = torch.randn((batch, *input_size(model)), generator=g).to(device)
    return images, torch.randint(0, 10, (batch,), generator=g).to(device)


def train_step(model, x, target, autocast=None, rng_seed=None):
    """One forward + cross-entropy + backward from cleared gradients -> (logits fp32, {name: grad fp32}).
    autocast: a dtype to run the forward under, or None for none. rng_seed: reseed first (DropPath draws).
    Parameter names are the module's own, also through torch.compile's wrapper."""
    model.zero_grad(set_to_none=True)
    if rng_seed is not None:
        torch.manual_seed(rng_seed)
    dev = x.device.type
    with torch.autocast(dev, dtype=autocast) if autocast else torch.autocast(dev, enabled=False):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float(), target)
    loss.backward()
    module = getattr(model, "_orig_mod", model)  # torch.compile's wrapper prefixes parameter names
    return logits.detach().float(), {n: p.grad.detach().float().clone() for n, p in module.named_parameters()}


def assert_same_step(ref, fused, x, target, atol, rtol, autocast=None, rng_seed=None):
    """The two models give the same logits and the same gradient for every parameter on one step."""
    logits_ref, grads_ref = train_step(ref, x, target, autocast, rng_seed)
    logits, grads = train_step(fused, x, target, autocast, rng_seed)
    torch.testing.assert_close(logits, logits_ref, atol=atol, rtol=rtol, msg=lambda m: f"logits: {m}")
    assert grads.keys() == grads_ref.keys()
    for name, g_ref in grads_ref.items():
        torch.testing.assert_close(grads[name], g_ref, atol=atol, rtol=rtol, msg=lambda m, n=name: f"grad {n}: {m}")


def assert_step_close(ref, model, x, target, logits_tol: float = 1e-5, grad_tol=1e-4) -> None:
    """One train_step of each: the logits and every parameter gradient of `model` within a relative (norm)
    error of `ref`'s. grad_tol: a number, or a function of the parameter name giving one."""
    logits_ref, grads_ref = train_step(ref, x, target)
    logits, grads = train_step(model, x, target)
    assert rel_err(logits, logits_ref) < logits_tol
    assert grads.keys() == grads_ref.keys()
    for name, g_ref in grads_ref.items():
        err, tol = rel_err(grads[name], g_ref), grad_tol(name) if callable(grad_tol) else grad_tol
        assert err < tol, f"{name}: relative gradient error {err:.2e}"


def assert_timms_function(patched, plain, x, logits_rel: float = 1e-5, grad_rel: float = 1e-4) -> None:
    """A patched model against timm's copy of it (`plain`, the same weights) on images `x`: the logits, and
    the gradient of every parameter after a backward of their sum, within these relative L2 errors."""
    out, want = patched(x), plain(x)
    assert ((out - want).norm() / want.norm()).item() < logits_rel
    out.sum().backward()
    want.sum().backward()
    for (name, p), q in zip(patched.named_parameters(), plain.parameters()):
        assert ((p.grad - q.grad).norm() / (q.grad.norm() + 1e-12)).item() < grad_rel, name


def resize_like_timm(model: torch.nn.Module, device, **sizes) -> torch.nn.Module:
    """timm's model.set_input_size(**sizes) run on the CPU and the model moved back to `device` (timm
    1.0.29 builds the new index on the CPU beside a GPU model's table); the test is skipped where this
    timm cannot resize the model at all."""
    import pytest
    import timm

    try:
        model.cpu().set_input_size(**sizes)
    except RuntimeError as e:
        pytest.skip(f"timm {timm.__version__} cannot resize this model to {sizes}: {e}")
    return model.to(device)


def mlp_kernel_calls(monkeypatch, w, kernel: str, blocks) -> tuple[list, torch.Tensor, torch.Tensor]:
    """The row shapes of each kernels.mlp.<kernel> call in one inference forward of the workload as bound
    and in a second with `blocks`' one-kernel MLP planned off (their two GEMMs), and the two forwards'
    logits in float64."""
    from workbench.kernels import mlp as mlp_kernels
    from workbench.optimize.passes.block_plan import block_plans

    w.prepare()
    calls = []
    real = getattr(mlp_kernels, kernel)
    monkeypatch.setattr(mlp_kernels, kernel, lambda *a: calls.append(tuple(a[0].shape)) or real(*a))
    with torch.inference_mode():
        logits, _ = w.forward_loss()
    plans = block_plans(w.model)
    for name in blocks:
        plans.update(name, mlp_kernel=False)
    plans.bind(w.model)
    with torch.inference_mode():
        off, _ = w.forward_loss()
    return calls, logits.double(), off.double()
