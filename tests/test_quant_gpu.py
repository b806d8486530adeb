"""The FP8 and INT8 GEMM routes on a GPU: QuantLinear on torch._scaled_mm and torch._int_mm against the bf16
nn.Linear and against its own simulate route, on Swin-B's real shapes; a quantized forward captured in a
CUDA graph; and the tiny Swin end to end through `apply --mode infer`. Skipped without a GPU (FP8 also
below compute capability 8.9).

    python -m pytest -q -m gpu tests/test_quant_gpu.py
"""
import io

import pytest
import torch

from workbench.kernels.quant import QuantLinear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def fp8_supported() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8 = pytest.mark.skipif(not fp8_supported(), reason="FP8 GEMMs need compute capability 8.9+")

# (M, K, N): token rows x in_features -> out_features. Swin-B at batch 64 (stage 1: 200,704 tokens of 128,
# stage 3: 12,544 of 512, stage 4: 3,136 of 1024), a 4096-row slice, batch 1 (49 tokens at stage 4), and
# fewer rows than _int_mm takes (padded to 17).
SHAPES = [
    (200704, 128, 384),    # stage 1 qkv
    (12544, 512, 1536),    # stage 3 qkv
    (12544, 2048, 512),    # stage 3 fc2
    (4096, 512, 1536),
    (3136, 1024, 4096),    # stage 4 fc1
    (3136, 2048, 1024),    # stage 3 -> 4 patch merging reduction
    (49, 1024, 3072),      # batch 1, stage 4 qkv
    (16, 512, 1536),
]
ROUTES = [pytest.param("fp8", "scaled_mm", marks=needs_fp8), ("int8", "int_mm")]
# relative L2 error of one GEMM against bf16, random normal data: e4m3's 3 mantissa bits give ~3-4%,
# int8 with per-row / per-channel scales ~1%; a wrong layout or scale gives ~1
VS_BF16 = {"fp8": 0.06, "int8": 0.02}


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("fmt,route", ROUTES)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_quant_linear_on_real_shapes(fmt, route, static, M, K, N):
    torch.manual_seed(M + K + N)
    lin = torch.nn.Linear(K, N, device="cuda").to(torch.bfloat16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    scale = (x.float().abs().amax() / (448 if fmt == "fp8" else 127)) if static else None
    real, sim = QuantLinear(lin, fmt, route, scale), QuantLinear(lin, fmt, "simulate", scale)
    with torch.inference_mode(), torch.autocast("cuda", torch.bfloat16):
        ref, out, sim_out = lin(x), real(x), sim(x)
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    assert torch.isfinite(out).all()
    # the same quantized operands as simulate: only the sums' order and bf16 rounding differ
    assert rel_err(out, sim_out) < 1e-2
    assert rel_err(out, ref) < VS_BF16[fmt] * (3 if static else 1)


@pytest.mark.parametrize("fmt,route", ROUTES)
def test_three_dim_input_and_no_bias(fmt, route):
    lin = torch.nn.Linear(256, 768, bias=False, device="cuda")
    x = torch.randn(64, 49, 256, device="cuda")
    q = QuantLinear(lin, fmt, route)
    with torch.inference_mode(), torch.autocast("cuda", torch.bfloat16):
        out = q(x)
    assert out.shape == (64, 49, 768) and out.dtype == torch.bfloat16
    assert rel_err(out, lin(x)) < VS_BF16[fmt]
    # outside autocast an fp32 input gets an fp32 output (nn.Linear's dtype)
    with torch.inference_mode():
        assert q(x).dtype == torch.float32


@pytest.mark.parametrize("dtype", [pytest.param("fp8", marks=needs_fp8), "int8"])
@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_tiny_swin_quantized_forward_in_a_cuda_graph(dtype, activations):
    """The pass on the tiny Swin on the GPU (plain timm forward): routes recorded, logits close to bf16,
    and the forward captured in a CUDA graph replays the same logits (no host sync in the routes)."""
    from workbench.models import TINY_MODEL, build_model
    from workbench.optimize.passes import PassContext
    from workbench.optimize.passes import quantize_linear as ql
    from workbench.precision import resolve_precision

    torch.manual_seed(0)
    model = build_model(TINY_MODEL, drop_path_rate=0.0).cuda().eval()
    x = torch.randn(32, 3, 56, 56, device="cuda")
    with torch.inference_mode(), torch.autocast("cuda", torch.bfloat16):
        bf16 = model(x).float()
    ctx = PassContext(device=torch.device("cuda"), precision=resolve_precision("bf16"), training=False)
    model, res = ql.apply(model, ctx, dtype=dtype, activations=activations, keep=["head.fc"], select="all")
    route = "scaled_mm" if dtype == "fp8" else "int_mm"
    assert res.details["counts"] == {route: 17, "kept": 1}
    assert res.details["gelu_fused_mlps"] == (4 if activations == "dynamic" else 0)
    with torch.inference_mode(), torch.autocast("cuda", torch.bfloat16):
        eager = model(x).float()
        assert rel_err(eager, bf16) < 0.1
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                model(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = model(x)
        graph.replay()
        torch.cuda.synchronize()
    # the same kernels on the same inputs; cuBLAS may pick another algorithm under capture (workspace)
    assert rel_err(captured.float(), eager) < 1e-2


def test_apply_infer_dense_fp8_int8_on_the_tiny_swin(tmp_path):
    """`swinbench apply --mode infer --stages baseline,dense,fp8,int8` on the tiny Swin: the quantized stages
    run their GEMM routes and pass their gates; fp8 is not available below sm_89, with one line."""
    from rich.console import Console

    from workbench.ladder.apply import run_apply
    from workbench.models import TINY_MODEL

    result = run_apply("fmha", model=TINY_MODEL, batch=32, steps=5, warmup=2, device="cuda", progress=False,
                       interleave=0, mode="infer", out_dir=tmp_path / "run", stages=["baseline", "dense", "fp8", "int8"],
                       console=Console(file=io.StringIO(), width=160))
    by_stage = {r["stage"]: r for r in result.records}
    for stage, route in (("fp8", "scaled_mm"), ("int8", "int_mm")):
        rec = by_stage[stage]
        if stage == "fp8" and not fp8_supported():
            assert rec["status"] == "not available"
            continue
        if rec["status"] == "not available":    # select auto: every shape of the tiny Swin faster in bf16
            assert "no Linear left to quantize" in rec["error"] and "measured faster in bf16" in rec["error"]
            continue
        assert rec["gate"]["status"] == "PASS", rec["gate"]
        quant = next(p for p in rec["passes"] if p["name"] == "quantize_linear")
        counts = quant["details"]["counts"]
        assert counts[route] >= 1 and counts[route] + counts["kept"] == 18, quant["details"]
        fc1 = [n for n, why in quant["details"]["layers"].items() if n.endswith(".fc1")]
        assert fc1 and all("GELU" in quant["details"]["layers"][n] for n in fc1), quant["details"]["layers"]
        assert rec["gate"]["metrics"]["top1_agreement"] >= 0.8   # untrained, random batch: near ties


@pytest.mark.parametrize("dtype", [pytest.param("fp8", marks=needs_fp8), "int8"])
def test_select_auto_times_every_gemm_shape_of_swin_t(dtype):
    """select auto on Swin-T at batch 64: every distinct shape timed both ways on this GPU, each choice by
    the 3% rule, every layer of a shape routed alike, the quantized model close to bf16."""
    from workbench.models import build_model
    from workbench.optimize.passes import PassContext, PassUnavailable
    from workbench.optimize.passes import quantize_linear as ql
    from workbench.precision import resolve_precision

    torch.manual_seed(0)
    model = build_model("swin_tiny_patch4_window7_224", drop_path_rate=0.0).cuda().eval()
    ctx = PassContext(device=torch.device("cuda"), precision=resolve_precision("bf16"), training=False, batch=64)
    try:
        model, res = ql.apply(model, ctx, dtype=dtype, keep=["head.fc"])
    except PassUnavailable as exc:
        assert "measured faster in bf16" in str(exc)
        return
    shapes = res.details["shapes"]
    assert res.details["selected_by_measurement"] and sum(s["layers"] for s in shapes) == 48 + 3
    for s in shapes:
        assert s["bf16_us"] > 0 and s["quant_us"] > 0 and s["rows"] % 64 == 0
        assert s["choice"] == ("quantize" if s["quant_us"] < s["bf16_us"] * (1 - ql.SELECT_MARGIN) else "bf16")
    quantized = sum(1 for r in res.details["layers"].values() if not r.startswith("kept"))
    assert quantized == sum(s["layers"] for s in shapes if s["choice"] == "quantize")
