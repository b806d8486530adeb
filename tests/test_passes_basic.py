"""The run-mode passes (amp, sdpa_attention, fused_adamw, compile): what each changes, and that SDPA
computes what eager attention computes."""
import pytest
import torch

from workbench.errors import UserError
from workbench.models import TINY_MODEL
from workbench.optimize.passes import apply_pass, default_optimizer_factory
from workbench.optimize.passes.fused_adamw import baseline_hyperparameters
from workbench.optimize.passes.sdpa_attention import window_attention_modules
from workbench.optimize.workload import Workload, WorkloadConfig

CFG = WorkloadConfig(model=TINY_MODEL, batch=2, precision="fp32", device="cpu", seed=0)


@pytest.fixture
def workload():
    return Workload.build(CFG)


def test_amp_bf16_sets_precision(workload):
    model, result = apply_pass("amp", workload.model, workload.ctx, {"dtype": "bf16"})
    assert model is workload.model
    assert workload.ctx.precision.name == "bf16" and workload.ctx.precision.amp_dtype is torch.bfloat16
    assert workload.ctx.grad_scaler is False
    assert result.available and "bf16" in result.changed and "\n" not in result.changed
    _, again = apply_pass("amp", workload.model, workload.ctx, {"dtype": "bf16"})   # a bf16 workload already
    assert again.changed == "autocast bf16, as the workload already ran"


def test_amp_fp16_turns_on_grad_scaler(workload):
    _, result = apply_pass("amp", workload.model, workload.ctx, {"dtype": "fp16"})
    assert workload.ctx.grad_scaler is True and "GradScaler" in result.changed


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_amp_rejects_non_autocast_dtypes(workload, dtype):
    with pytest.raises(UserError):
        apply_pass("amp", workload.model, workload.ctx, {"dtype": dtype})


def test_sdpa_attention_matches_eager_fp32():
    eager = Workload.build(CFG)
    sdpa = Workload.build(CFG)
    _, result = apply_pass("sdpa_attention", sdpa.model, sdpa.ctx)
    mods = window_attention_modules(sdpa.model)
    assert mods and all(m.fused_attn for m in mods)
    assert result.details["modules"] == len(mods) == 4
    outs = []
    for w in (eager, sdpa):
        logits = w.model(w.x)
        torch.nn.functional.cross_entropy(logits, w.y).backward()
        qkv = w.model.layers[0].blocks[1].attn   # a shifted block: bias + mask both go into SDPA
        outs.append((logits.detach(), qkv.qkv.weight.grad.clone(), qkv.relative_position_bias_table.grad.clone()))
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_fused_adamw_on_cpu_keeps_foreach_and_hyperparameters(workload):
    _, result = apply_pass("fused_adamw", workload.model, workload.ctx)
    opt = workload.ctx.optimizer_factory(workload.model.parameters())
    base = default_optimizer_factory([torch.nn.Parameter(torch.zeros(1))])
    for k in ("lr", "weight_decay", "betas", "eps"):
        assert opt.defaults[k] == base.defaults[k]
    assert opt.defaults["foreach"] is True
    assert "CPU" in result.changed and result.details["optimizer"] == workload.ctx.optimizer_name
    assert baseline_hyperparameters()["lr"] == base.defaults["lr"]


def test_fused_adamw_rejects_unknown_impl(workload):
    with pytest.raises(UserError):
        apply_pass("fused_adamw", workload.model, workload.ctx, {"impl": "magic"})


def test_compile_records_options(workload):
    _, result = apply_pass("compile", workload.model, workload.ctx, {"mode": "max-autotune"})
    assert workload.ctx.compile is True
    assert workload.ctx.compile_options["mode"] == "max-autotune"
    assert "torch.compile" in result.changed
    with pytest.raises(UserError):
        apply_pass("compile", workload.model, workload.ctx, {"mode": "ludicrous"})


def test_compile_takes_inductor_options_by_dotted_name(workload):
    _, result = apply_pass("compile", workload.model, workload.ctx,
                           {"inductor": {"cpp_wrapper": True, "triton.cudagraphs": False}})
    assert workload.ctx.compile_options["options"] == {"cpp_wrapper": True, "triton.cudagraphs": False}
    assert "mode" not in workload.ctx.compile_options and "cpp_wrapper=True" in result.changed
    for bad in ({"inductor": {"no_such_setting": 1}}, {"inductor": {"triton.nope": True}},
                {"inductor": {"cpp_wrapper": [1]}}, {"inductor": ["cpp_wrapper"]},
                {"inductor": {"cpp_wrapper": True}, "mode": "reduce-overhead"},
                {"inductor": {"cpp_wrapper": True}, "backend": "aot_eager"}):
        with pytest.raises(UserError):
            apply_pass("compile", workload.model, workload.ctx, bad)


def test_cuda_graph_pass_needs_a_gpu_and_says_so():
    from workbench.optimize.passes import PassContext, apply_pass
    from workbench.precision import resolve_precision

    ctx = PassContext(device=torch.device("cpu"), precision=resolve_precision("bf16"))
    model = torch.nn.Linear(2, 2)
    out, result = apply_pass("cuda_graph", model, ctx)
    assert out is model and not result.available and "CUDA" in result.changed
    assert not ctx.cuda_graph
