"""kernels.adamw (AdamW on a flat fp32 master from low-precision gradients) against torch's fused AdamW's
arithmetic in float64 and against torch.optim.AdamW itself, over several steps, on fresh random inputs
and odd sizes; the learning rate and the step count as numbers or as tensors on the device.
Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from workbench.kernels.adamw import GradLayout, adamw_flat_step, adamw_grads_step, grad_table  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HP = {"lr": 3e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.05}


def reference_step(p, m, v, g, t, lr, betas, eps, weight_decay):
    """torch's fused AdamW update (its order of operations), in float64 from the betas as fp32 (what torch's
    kernel and this one hold: 1 - beta2 is 0.00099998713 for 0.999)."""
    b1, b2 = (float(torch.tensor(b, dtype=torch.float32)) for b in betas)
    p = p - lr * weight_decay * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = v.sqrt() / (1 - b2 ** t) ** 0.5 + eps
    return p - (lr / (1 - b1 ** t)) * m / denom, m, v


@pytest.mark.parametrize("n", [1, 2047, 2049, 4096, 5003])
@pytest.mark.parametrize("lr_tensor", [False, True])
def test_matches_fused_adamw_arithmetic(n, lr_tensor):
    gen = torch.Generator().manual_seed(n * 2 + lr_tensor)
    p = torch.randn(n, generator=gen, dtype=torch.float64)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    master = p.float().to(DEVICE)
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    step = torch.zeros((), dtype=torch.float32, device=DEVICE)
    out = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    lr = torch.tensor(HP["lr"], device=DEVICE) if lr_tensor else HP["lr"]
    for t in range(1, 5):
        g = torch.randn(n, generator=gen).to(torch.bfloat16)
        adamw_flat_step(g.to(DEVICE), master, exp_avg, exp_avg_sq, step, out, **{**HP, "lr": lr})
        p, m, v = reference_step(p, m, v, g.double(), t, **HP)
        assert step.item() == t
        # a few units in the last place of fp32 on values near 1, compounded over the steps
        assert (master.cpu().double() - p).abs().max().item() < 4e-6
        assert (exp_avg.cpu().double() - m).abs().max().item() < 1e-6
        assert ((exp_avg_sq.cpu().double() - v).abs() / v.clamp_min(1e-30)).max().item() < 1e-5
        assert torch.equal(out, master.to(torch.bfloat16))


def test_matches_torch_adamw_with_a_step_count_on_the_host():
    """The step count on the CPU (an eager for-each AdamW keeps it there) is read as a number."""
    gen = torch.Generator().manual_seed(7)
    n = 3001
    ref = torch.nn.Parameter(torch.randn(n, generator=gen))
    opt = torch.optim.AdamW([ref], **HP, foreach=True)
    master = ref.detach().clone().to(DEVICE)
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    step = torch.zeros((), dtype=torch.float32)
    out = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    for _ in range(6):
        g = torch.randn(n, generator=gen).to(torch.bfloat16)
        ref.grad = g.float()
        opt.step()
        adamw_flat_step(g.to(DEVICE), master, exp_avg, exp_avg_sq, step, out, **HP)
    assert step.item() == opt.state[ref]["step"].item() == 6
    assert (master.cpu() - ref.detach()).abs().max().item() < 4e-6
    assert (exp_avg.cpu() - opt.state[ref]["exp_avg"]).abs().max().item() < 1e-6


@pytest.mark.parametrize("bad", ["grad_size", "master_dtype", "strided", "betas"])
def test_refuses_what_it_cannot_step(bad):
    n = 64
    master = torch.zeros(n, device=DEVICE)
    args = dict(grad=torch.zeros(n, dtype=torch.bfloat16, device=DEVICE), master=master,
                exp_avg=torch.zeros_like(master), exp_avg_sq=torch.zeros_like(master),
                step=torch.zeros((), device=DEVICE), out=torch.zeros(n, dtype=torch.bfloat16, device=DEVICE))
    hp = dict(HP)
    if bad == "grad_size":
        args["grad"] = args["grad"][:-1]
    elif bad == "master_dtype":
        args["master"] = master.double()
    elif bad == "strided":
        args["exp_avg"] = torch.zeros(2 * n, device=DEVICE)[::2]
    else:
        hp["betas"] = (0.9, 1.0)
    with pytest.raises(ValueError, match="adamw_flat_step"):
        adamw_flat_step(**args, **hp)
    assert args["step"].item() == 0   # nothing stepped


@pytest.mark.parametrize("sizes", [[8], [2048, 8, 2056, 16], [4104, 6000, 24, 2040], [2056, 10, 7688, 10]])
@pytest.mark.parametrize("lr_tensor", [False, True])
def test_grads_in_place_step_as_the_flat_one(sizes, lr_tensor):
    """adamw_grads_step, reading each gradient where it lies (chunks that never straddle two of them, a
    short last chunk), gives the flat step's bits on the gradients gathered by torch.cat, step after step."""
    gen = torch.Generator().manual_seed(sum(sizes) + lr_tensor)
    n = sum(sizes)
    layout = GradLayout(sizes, DEVICE)
    assert sum(chunks for _, _, chunks in layout.groups) == sum(-(-s // 2048) for s in sizes)
    # a size or an offset that is no multiple of 8 puts the parameter in the second launch
    assert layout.aligned == [s % 8 == 0 and sum(sizes[:j]) % 8 == 0 for j, s in enumerate(sizes)]
    master = torch.randn(n, generator=gen).to(DEVICE)
    ref = master.clone()
    moments = [torch.zeros_like(master) for _ in range(4)]
    steps = [torch.zeros((), dtype=torch.float32, device=DEVICE) for _ in range(2)]
    out, ref_out = (torch.empty(n, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    lr = torch.tensor(HP["lr"], device=DEVICE) if lr_tensor else HP["lr"]
    for _ in range(3):
        grads = [torch.randn(s, generator=gen).to(torch.bfloat16).to(DEVICE) for s in sizes]
        table = grad_table(grads, DEVICE)
        assert table.tolist() == [g.data_ptr() for g in grads]
        adamw_grads_step(table, layout, master, moments[0], moments[1], steps[0], out, grad_dtype=torch.bfloat16,
                         **{**HP, "lr": lr})
        adamw_flat_step(torch.cat(grads), ref, moments[2], moments[3], steps[1], ref_out, **{**HP, "lr": lr})
        assert torch.equal(master, ref) and torch.equal(out, ref_out)
        assert torch.equal(moments[0], moments[2]) and torch.equal(moments[1], moments[3])
    assert steps[0].item() == 3


def test_grads_in_place_step_refuses_a_mismatched_layout():
    master = torch.zeros(24, device=DEVICE)
    args = dict(master=master, exp_avg=torch.zeros_like(master), exp_avg_sq=torch.zeros_like(master),
                step=torch.zeros((), device=DEVICE), out=torch.zeros(24, dtype=torch.bfloat16, device=DEVICE),
                grad_dtype=torch.bfloat16, **HP)
    grads = [torch.zeros(12, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    with pytest.raises(ValueError, match="a layout of 16 values"):
        adamw_grads_step(grad_table(grads, DEVICE), GradLayout([8, 8], DEVICE), **args)
    assert args["step"].item() == 0   # nothing stepped


def test_grad_table_holds_every_address_past_one_launch():
    """More gradients than one launch of the table's kernel takes (128): every address, in order."""
    grads = [torch.zeros(8 + i % 3, dtype=torch.bfloat16, device=DEVICE) for i in range(300)]
    assert grad_table(grads, DEVICE).tolist() == [g.data_ptr() for g in grads]
