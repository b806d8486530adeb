"""torchao_quantize, the PyTorch-ecosystem peer of the fp8/int8 recipes, on the tiny CPU Swin: torchao's
dynamic INT8 (it runs on the CPU) against the bf16 model, the same layers as quantize_linear chooses, the
refusals (training, FP8 without a GPU, torchao missing) as one line each, and the recipes that use it."""
import copy
import sys

import pytest
import torch

from workbench.errors import UserError
from workbench.optimize.passes import PassContext, apply_pass, uses_swinbench_kernels
from workbench.optimize.passes import quantize_linear as ql
from workbench.optimize.passes import torchao_quantize as tq
from workbench.precision import resolve_precision
from tests.pass_helpers import model_pair, rel_err

pytest.importorskip("torchao")


def infer_ctx(training: bool = False) -> PassContext:
    return PassContext(device=torch.device("cpu"), precision=resolve_precision("bf16"), training=training)


def logits(model, x):
    with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16):
        return model(x).double()


@pytest.fixture(scope="module")
def tiny():
    model, _ = model_pair("cpu", seed=0, drop_path_rate=0.0)
    model.eval()
    x = torch.randn(32, 3, 56, 56, generator=torch.Generator().manual_seed(3))
    return model, x, logits(model, x)


def test_int8_quantizes_the_layers_quantize_linear_would(tiny):
    model, x, bf16 = tiny
    q, res = tq.apply(copy.deepcopy(model), infer_ctx(), dtype="int8", keep=["head.fc"])
    _, ours = ql.apply(copy.deepcopy(model), infer_ctx(), dtype="int8", keep=["head.fc"], simulate=True)
    chosen = {n for n, r in res.details["layers"].items() if r == "torchao"}
    assert chosen == {n for n, r in ours.details["layers"].items() if r == "simulate"}
    assert res.details["counts"] == {"torchao": 17, "kept": 1} and res.details["library"] == "torchao"
    assert "Int8DynamicActivationInt8WeightConfig" in res.details["implementation"]
    assert type(q.head.fc.weight) is torch.nn.Parameter or type(q.head.fc.weight) is torch.Tensor
    assert type(q.layers[0].blocks[0].mlp.fc1.weight).__module__.startswith("torchao")
    out = logits(q, x)
    assert out.shape == bf16.shape and torch.isfinite(out).all()
    assert 1e-3 < rel_err(out, bf16) < 0.1         # quantized, and close: the int8 recipe's tolerance
    assert (out.argmax(-1) == bf16.argmax(-1)).double().mean() >= 0.9


def test_refusals_are_one_line(monkeypatch):
    model, _ = model_pair("cpu", seed=0)
    _, res = apply_pass("torchao_quantize", model, infer_ctx(training=True), {"dtype": "int8"})
    assert not res.available and res.changed.startswith("not available: torchao's quantized Linear layers")
    _, res = apply_pass("torchao_quantize", model, infer_ctx(), {"dtype": "fp8"})
    assert res.changed == "not available: torchao's FP8 GEMMs need a CUDA GPU with compute capability 8.9 or newer"
    monkeypatch.setitem(sys.modules, "torchao", None)
    _, res = apply_pass("torchao_quantize", model, infer_ctx(), {"dtype": "int8"})
    assert res.changed == "not available: torchao is not installed (pip install torchao)"
    assert all("\n" not in r for r in (res.changed,))
    with pytest.raises(UserError, match="dtype must be one of fp8, int8"):
        tq.apply(model, infer_ctx(), dtype="int4")


def test_the_peer_recipes_are_pytorch_alone_and_ours_are_not():
    from workbench.optimize.recipes import resolve_chain

    for name, dtype in (("torchao-fp8", "fp8"), ("torchao-int8", "int8")):
        chain = resolve_chain(name)
        passes = [p.name for p in chain[-1].passes]
        assert passes == ["sdpa_attention", "torchao_quantize", "compile"] and chain[-1].peer
        assert not any(uses_swinbench_kernels(p.name) for stage in chain for p in stage.passes)
    for name in ("fp8-compile", "int8-compile"):
        chain = resolve_chain(name)
        assert [s.name for s in chain][-2:] == [name.split("-")[0], name]
        assert [p.name for p in chain[-1].passes] == ["compile"]


def test_apply_runs_the_torchao_int8_peer_and_gates_it(tmp_path):
    """The peer end to end in `apply --mode infer` on the CPU: quantized, compiled, gated, recorded."""
    import io

    from rich.console import Console

    from workbench.ladder.apply import run_apply
    from workbench.models import TINY_MODEL
    from workbench.results.record import read_records

    run_apply("amp", model=TINY_MODEL, batch=4, steps=2, warmup=1, device="cpu", progress=False, interleave=0,
              mode="infer", stages=["baseline", "torchao-int8"], out_dir=tmp_path / "run",
              console=Console(file=io.StringIO()))
    records = {r.stage: r for r in read_records(tmp_path / "run" / "records")}
    peer = records["torchao-int8"]
    assert peer.status == "ok" and peer.gate.status == "PASS"
    quant = next(p for p in peer.passes if p.name == "torchao_quantize")
    assert quant.details["counts"] == {"torchao": 17, "kept": 1}
    assert peer.pytorch_alone and "torchao-int8" in (tmp_path / "run" / "report.md").read_text()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with FP8 GEMMs (sm_89+)")
@pytest.mark.parametrize("dtype, tolerance", [("fp8", 0.15), ("int8", 0.1)])
def test_torchao_quantizes_swin_t_on_the_gpu(dtype, tolerance):
    from workbench.models import build_model

    torch.manual_seed(0)
    model = build_model("swin_tiny_patch4_window7_224", drop_path_rate=0.0).cuda().eval()
    x = torch.randn(16, 3, 224, 224, device="cuda")
    ctx = PassContext(device=torch.device("cuda"), precision=resolve_precision("bf16"), training=False)
    with torch.inference_mode(), torch.autocast("cuda", torch.bfloat16):
        ref = model(x).double()
    q, res = tq.apply(copy.deepcopy(model), ctx, dtype=dtype, keep=["head.fc"])
    assert res.details["counts"]["torchao"] > 40
    with torch.inference_mode(), torch.autocast("cuda", torch.bfloat16):
        out = q(x).double()
    assert torch.isfinite(out).all() and rel_err(out, ref) < tolerance
