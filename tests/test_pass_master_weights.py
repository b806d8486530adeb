"""master_weights: bf16 GEMM weights with fp32 masters train exactly as autocast does with fp32 weights.

On the tiny Swin on the CPU (bf16 autocast), a few AdamW steps with the pass and without it give the
same losses and the same fp32 values (the masters against autocast's fp32 weights), bit for bit: the
forward sees the same bf16-rounded weights, the gradients are the same bf16 GEMM results, and the
update is the same AdamW on the same fp32 numbers.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from workbench.models import TINY_MODEL  # noqa: E402
from workbench.optimize.passes import apply_pass  # noqa: E402
from workbench.optimize.passes.master_weights import MasterWeights, gemm_parameters  # noqa: E402
from workbench.optimize.workload import Workload, WorkloadConfig  # noqa: E402

# Where the one-pass AdamW kernel runs: the GPU where there is one, else the CPU under the interpreter
# (on a GPU machine the interpreter is off, and a CPU workload takes torch's step).
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_PASSES = [("fused_layernorm", {"impl": "triton"}), ("fused_window", None), ("fused_attention", None),
                 ("fused_linear", None), ("fused_block", None)]


def workload(precision="bf16", mode="train", device="cpu"):
    return Workload.build(WorkloadConfig(model=TINY_MODEL, batch=2, precision=precision, device=device,
                                         seed=0, mode=mode))


def fp32_values(wl) -> dict:
    """Every parameter's fp32 value by name: the master's slice for a bf16 GEMM parameter."""
    mw = wl.ctx.master_weights
    slices = {}
    if mw is not None:
        offset = 0
        for p, n in zip(mw.params, mw.sizes):
            slices[id(p)] = mw.master.detach()[offset:offset + n].view(p.shape)
            offset += n
    return {name: slices.get(id(p), p.detach()).float() for name, p in wl.model.named_parameters()}


def train(wl, steps=3):
    wl.prepare()
    return [wl.step(i).item() for i in range(steps)]


def test_same_losses_and_weights_as_autocast_bit_for_bit():
    """With torch's step on the widened gradients (step: torch)."""
    plain, master = workload(), workload()
    names = [n for n, p in master.model.named_parameters() if any(p is q for q in gemm_parameters(master.model))]
    _, result = apply_pass("master_weights", master.model, master.ctx, {"step": "torch"})
    assert result.available, result.changed
    assert all(dict(master.model.named_parameters())[n].dtype == torch.bfloat16 for n in names)
    assert train(plain) == train(master)

    masters = fp32_values(master)
    by_name = dict(master.model.named_parameters())
    for name, p in plain.model.named_parameters():
        if name in names:
            assert torch.equal(masters[name], p.detach()), name
            assert torch.equal(by_name[name].detach(), p.detach().to(torch.bfloat16)), name
        else:
            assert by_name[name].dtype == torch.float32
            assert torch.equal(by_name[name].detach(), p.detach()), name


def test_one_pass_step_trains_as_torchs_adamw():
    """The default step (the one-pass AdamW kernel on the master, torch's AdamW on the rest) against
    autocast with fp32 weights and torch's AdamW: the same losses to rounding, masters within a few
    units in the last place of fp32, the model's bf16 weights the masters rounded, the other parameters
    stepped by torch as before."""
    plain, master = workload(device=KERNEL_DEVICE), workload(device=KERNEL_DEVICE)
    gemm = {id(p) for p in gemm_parameters(master.model)}
    names = [n for n, p in master.model.named_parameters() if id(p) in gemm]
    _, result = apply_pass("master_weights", master.model, master.ctx)
    assert result.details["step"].startswith("one-pass")
    losses_plain, losses_master = train(plain, 4), train(master, 4)
    assert master.optimizer is not None and master.ctx.master_weights.master.grad is None   # never widened
    assert losses_master == pytest.approx(losses_plain, rel=2e-3)
    masters = fp32_values(master)
    by_name = dict(master.model.named_parameters())
    for name, p in plain.model.named_parameters():
        err = (masters[name] - p.detach()).abs().max().item()
        assert err < 1e-3, f"{name}: {err:.2e}"
        if name in names:
            assert torch.equal(by_name[name].detach(), masters[name].to(torch.bfloat16)), name
    state = master.optimizer.state[master.ctx.master_weights.master]
    assert state["step"].item() == 4 and state["exp_avg"].shape == master.ctx.master_weights.master.shape


def test_clipped_steps_widen_the_gradients():
    """Gradient clipping needs the fp32 gradients: that step takes torch's path, and the next unclipped
    step the kernel's again, on the same AdamW state."""
    wl = workload(device=KERNEL_DEVICE)
    apply_pass("master_weights", wl.model, wl.ctx)
    wl.prepare()
    mw = wl.ctx.master_weights
    stepper = mw.optimizer(lambda params: torch.optim.AdamW(params, lr=1e-3), wl.model.parameters())
    assert stepper.flat_group is not None
    seen = []
    for clip in (None, lambda params: seen.append(len(params)), None):
        _, loss = wl.forward_loss()
        loss.backward()
        stepper.step(clip_grads=clip)
        stepper.zero_grad()
    assert seen and stepper.inner.state[mw.master]["step"].item() == 3
    assert torch.equal(mw.flat, mw.master.detach().to(torch.bfloat16))


def test_one_pass_step_reads_the_gradients_in_place_as_gathered():
    """The one-pass step reads each bf16 gradient where autograd left it (a table of addresses; the tiny
    Swin's 10-class head bias takes the kernel's unaligned launch) and gives, step after step, the bits
    of the same step on the gradients gathered by torch.cat; a parameter left without a gradient reads
    zeros, as the cat's; a strided gradient makes the step gather them."""
    runs = []
    for gather in (False, True):
        wl = workload(device=KERNEL_DEVICE)
        apply_pass("master_weights", wl.model, wl.ctx)
        wl.prepare()
        mw = wl.ctx.master_weights
        if gather:
            mw.low_grads_table = lambda: None
        assert not all(mw.grads_layout().aligned) and any(mw.grads_layout().aligned)
        for i in range(3):
            _, loss = wl.forward_loss()
            loss.backward()
            if i == 1:
                mw.params[0].grad = None   # as if that weight had not been used this step
            if not gather:
                assert mw.low_grads_table() is not None
            wl.optimizer.step()
            wl.optimizer.zero_grad()
        runs.append((mw.master.detach().clone(), mw.flat.clone()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    _, loss = wl.forward_loss()
    loss.backward()
    weight = next(p for p in mw.params if p.dim() == 2)
    weight.grad = weight.grad.t().contiguous().t()   # its own shape, strided
    assert MasterWeights.low_grads_table(mw) is None


@pytest.mark.parametrize("factory", [lambda ps: torch.optim.SGD(ps, lr=0.1),
                                     lambda ps: torch.optim.AdamW(ps, lr=1e-3, amsgrad=True)])
def test_other_optimizers_step_the_widened_gradients(factory):
    wl = workload()
    apply_pass("master_weights", wl.model, wl.ctx)
    mw = wl.ctx.master_weights
    stepper = mw.optimizer(factory, wl.model.parameters())
    assert stepper.flat_group is None
    _, loss = wl.forward_loss()
    loss.backward()
    stepper.step()
    assert mw.master.grad is not None and torch.equal(mw.flat, mw.master.detach().to(torch.bfloat16))


def test_inference_forward_unchanged():
    plain, master = workload(mode="infer"), workload(mode="infer")
    apply_pass("master_weights", master.model, master.ctx)
    plain.prepare()
    master.prepare()
    assert master.optimizer is None and master.ctx.master_weights.master is None
    assert master.ctx.master_weights._fp32 is None   # no fp32 copy kept for inference
    assert torch.equal(plain.forward_loss()[0], master.forward_loss()[0])


def test_optimizer_surface_and_zero_grad():
    wl = workload(device=KERNEL_DEVICE)
    apply_pass("master_weights", wl.model, wl.ctx)
    wl.prepare()
    opt = wl.optimizer
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["params"][0] is wl.ctx.master_weights.master
    wl.step(0)
    assert all(p.grad is None for p in wl.model.parameters())
    assert wl.ctx.master_weights.master.grad is None   # the one-pass step reads the bf16 gradients


def test_torch_step_keeps_a_persistent_fp32_gradient():
    wl = workload()
    apply_pass("master_weights", wl.model, wl.ctx, {"step": "torch"})
    wl.prepare()
    wl.step(0)
    grad = wl.ctx.master_weights.master.grad
    assert grad is not None and grad.dtype == torch.float32   # persistent buffer, overwritten each step
    wl.step(1)
    assert wl.ctx.master_weights.master.grad is grad


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_needs_bf16_autocast(precision):
    wl = workload(precision)
    model, result = apply_pass("master_weights", wl.model, wl.ctx)
    assert not result.available and "bf16" in result.changed
    assert all(p.dtype == torch.float32 for p in wl.model.parameters())


def test_twice_is_refused():
    wl = workload()
    apply_pass("master_weights", wl.model, wl.ctx)
    _, again = apply_pass("master_weights", wl.model, wl.ctx)
    assert not again.available and "already" in again.changed


def test_with_the_fused_kernels_block_stack():
    """With every kernel pass after it (the block stage's stack; on the CPU under Triton's interpreter),
    one forward and backward match the same stack on fp32 weights: the same loss, the same weight
    gradients, and bias gradients rounded to bf16 (there the fused bias gradient stays fp32; here it
    takes the bf16 bias's dtype, as autocast's own path rounds it). Two training steps then agree."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runs = []
    for with_master in (False, True):
        wl = workload(device=device)
        passes = [("master_weights", None)] if with_master else []
        for name, params in passes + KERNEL_PASSES:
            wl.model, result = apply_pass(name, wl.model, wl.ctx, params)
            assert result.available, f"{name}: {result.changed}"
        wl.prepare()
        _, loss = wl.forward_loss()
        loss.backward()
        grads = {n: p.grad.detach().float().clone() for n, p in wl.model.named_parameters()}
        wl.model.zero_grad(set_to_none=True)
        runs.append((loss.item(), grads, train(wl, 2)))
    (loss_a, grads_a, steps_a), (loss_b, grads_b, steps_b) = runs
    assert loss_a == loss_b
    for name, g in grads_a.items():
        err = ((grads_b[name] - g).norm() / g.norm().clamp_min(1e-30)).item()
        assert err < (5e-3 if name.endswith("bias") else 1e-6), f"{name}: {err:.2e}"
    assert steps_a == pytest.approx(steps_b, rel=1e-3)


def test_under_torch_compile():
    """The compiled step (aot_eager: Dynamo + AOTAutograd) with master weights and the fused attention
    trains as the eager one does (on the GPU when there is one: there the kernels need CUDA tensors)."""
    torch._dynamo.reset()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runs = []
    for compiled in (False, True):
        wl = workload(device=device)
        passes = [("master_weights", None), ("fused_attention", None)]
        if compiled:
            passes.append(("compile", {"backend": "aot_eager"}))
        for name, params in passes:
            wl.model, result = apply_pass(name, wl.model, wl.ctx, params)
            assert result.available, f"{name}: {result.changed}"
        runs.append(train(wl, 2))
    assert runs[0] == pytest.approx(runs[1], rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replay_trains_as_eager():
    """The whole step (forward, backward, the master-weight optimizer step) captured as one CUDA graph
    trains as the eager step does."""
    runs = []
    for graph in (False, True):
        wl = workload(device="cuda")
        passes = [("master_weights", None), ("fused_adamw", None)] + ([("cuda_graph", None)] if graph else [])
        for name, params in passes:
            wl.model, result = apply_pass(name, wl.model, wl.ctx, params)
            assert result.available, f"{name}: {result.changed}"
        wl.prepare()
        if graph:
            wl.capture_graph()   # three eager training steps on a side stream, then the capture and one replay
            # the captured step read the gradients in place, through a table the graph writes
            assert wl.ctx.master_weights._captured
            runs.append([wl.step(i).item() for i in range(2)])
        else:
            runs.append([wl.step(i).item() for i in range(6)][4:])
    assert runs[0] == pytest.approx(runs[1], rel=1e-4)
