"""quantize_linear on the tiny CPU Swin: simulate mode against the bf16 model (logits and top-1 agreement),
keep patterns, calibration, the refusals (training, no GPU, fused Linear forwards) as one line each, and
QuantLinear's GPU routes run through the CPU's torch._scaled_mm / torch._int_mm against simulate mode.

The recipes' gate checks logits and loss against the fp32 baseline; top-1 agreement with the bf16 model
is not a gate metric, so it is measured here (`agreement`)."""
import copy
import numpy as np
import pytest
import torch

from workbench.errors import UserError
from workbench.kernels.quant import QuantLinear
from workbench.optimize.passes import PassContext, apply_pass
from workbench.optimize.passes import quantize_linear as ql
from workbench.precision import resolve_precision
from tests.pass_helpers import mlp_kernel_calls, model_pair, rel_err

# What the recipes allow (recipes/fp8.yaml, int8.yaml: gate.bf16.logits_rel against the fp32 baseline)
# and what simulate mode must keep on the tiny Swin.
LOGITS_REL = {"fp8": 0.1, "int8": 0.05}
MIN_AGREEMENT = 0.95


def infer_ctx(training: bool = False) -> PassContext:
    return PassContext(device=torch.device("cpu"), precision=resolve_precision("bf16"), training=training)


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Top-1 agreement: the share of rows whose argmax is the same."""
    return (a.argmax(-1) == b.argmax(-1)).double().mean().item()


def images(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 3, 56, 56, generator=torch.Generator().manual_seed(seed))


def logits(model, x, bf16=True):
    with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        return model(x).double()


@pytest.fixture(scope="module")
def reference():
    """The tiny Swin (eval), a held-out batch, and its fp32 and bf16 logits."""
    model, _ = model_pair("cpu", seed=0, drop_path_rate=0.0)
    model.eval()
    x = images(48, seed=7)
    return model, x, logits(model, x, bf16=False), logits(model, x)


@pytest.mark.parametrize("dtype", ["fp8", "int8"])
@pytest.mark.parametrize("activations", ["dynamic", "static", "mixed"])
def test_simulate_keeps_logits_and_top1(reference, dtype, activations):
    model, x, fp32, bf16 = reference
    q = copy.deepcopy(model)
    q, res = ql.apply(q, infer_ctx(), dtype=dtype, activations=activations, keep=["head.fc"], simulate=True,
                      calibration_batches=2, calibration_batch=4)
    assert res.details["counts"] == {"simulate": 17, "kept": 1}
    assert res.details["layers"]["head.fc"] == "kept bf16: keep pattern 'head.fc'"
    assert sum(isinstance(m, QuantLinear) for m in q.modules()) == 17
    out = logits(q, x)
    assert out.shape == bf16.shape and torch.isfinite(out).all()
    assert rel_err(out, fp32) < LOGITS_REL[dtype]
    assert agreement(out, bf16) >= MIN_AGREEMENT
    # quantization moves the logits: it is not the bf16 model
    assert rel_err(out, bf16) > 1e-3
    if activations != "dynamic":
        scales = res.details["calibration"]["scales"]
        want = 17 if activations == "static" else 4         # mixed: each MLP's fc2 (its hidden) alone
        assert len(scales) == want and all(s > 0 for s in scales.values())
        assert activations == "static" or all(n.endswith(".mlp.fc2") for n in scales)
    assert res.details.get("mlp_pairs", 0) == (4 if activations == "mixed" else 0)


@pytest.mark.parametrize("dtype, calibration, percentile", [("int8", "max", None), ("fp8", "max", None),
                                                            ("fp8", "percentile", 99.9), ("int8", "percentile", 99.99)])
def test_static_scales_are_the_calibration_inputs_range(reference, dtype, calibration, percentile):
    """activations static: each quantized Linear's () input scale is the range of what it saw on the pass's
    calibration images, over qmax, in float64: the largest |x| over the batches (max), or the mean over the
    batches of each batch's |x| percentile (numpy's inverted_cdf) (percentile)."""
    from workbench.kernels.quant import QMAX

    model = reference[0]
    names = [n for n, _ in ql.quantizable_linears(model) if n != "head.fc"]
    seen = {n: [] for n in names}
    handles = [model.get_submodule(n).register_forward_pre_hook(
        lambda m, args, n=n: seen[n].append(np.abs(args[0].detach().double().reshape(-1).numpy()))) for n in names]
    try:    # the images the pass calibrates on, through the same model, under the stage's autocast
        with torch.inference_mode(), infer_ctx().precision.autocast("cpu"):
            for x in ql.synthetic_calibration_batches(model, 2, 3, torch.device("cpu"))[0]:
                model(x)
    finally:
        for h in handles:
            h.remove()
    params = {} if percentile is None else {"percentile": percentile}
    q, res = ql.apply(copy.deepcopy(model), infer_ctx(), dtype=dtype, activations="static", calibration=calibration,
                      keep=["head.fc"], simulate=True, calibration_batches=2, calibration_batch=3, **params)
    cal = res.details["calibration"]
    assert (cal["method"], cal["percentile"], cal["batches"], cal["batch"], cal["data"]) == (
        calibration, percentile, 2, 3, "synthetic")
    assert set(cal["scales"]) == set(names)
    for n in names:
        if calibration == "max":
            amax = max(a.max() for a in seen[n])
        else:
            amax = np.mean([np.percentile(a, percentile, method="inverted_cdf") for a in seen[n]])
        assert len(seen[n]) == 2 and amax > 0
        scale = q.get_submodule(n).input_scale
        assert scale.dtype == torch.float32 and scale.shape == () and cal["scales"][n] == scale.item()
        assert scale.item() == pytest.approx(amax / QMAX[dtype], rel=1e-6), n

def test_keep_patterns_and_shape_rules():
    model, _ = model_pair("cpu", seed=1, drop_path_rate=0.0)
    model.eval()
    model, res = ql.apply(model, infer_ctx(), dtype="fp8", keep=["*.fc2", "layers.*.downsample.reduction", "nope.*"],
                          simulate=True)
    layers = res.details["layers"]
    assert {n for n, r in layers.items() if r.startswith("kept")} == {
        "layers.0.blocks.0.mlp.fc2", "layers.0.blocks.1.mlp.fc2", "layers.1.blocks.0.mlp.fc2",
        "layers.1.blocks.1.mlp.fc2", "layers.1.downsample.reduction", "head.fc"}
    # the head (K=64, N=10) is kept by the fp8 shape rule, not by a pattern
    assert layers["head.fc"] == "kept bf16: K=64, N=10: fp8 GEMMs need multiples of 16"
    assert type(model.layers[0].blocks[0].mlp.fc2) is torch.nn.Linear
    assert isinstance(model.layers[0].blocks[0].mlp.fc1, QuantLinear)
    assert res.details["unmatched_keep"] == ["nope.*"]
    assert "matching nothing: nope.*" in res.changed


def test_int8_shape_rule_is_multiples_of_8():
    model, _ = model_pair("cpu", seed=1, drop_path_rate=0.0)
    model.eval()
    _, res = ql.apply(model, infer_ctx(), dtype="int8", simulate=True)
    # N=10 classes: not a multiple of 8 either
    assert res.details["layers"]["head.fc"].startswith("kept bf16: K=64, N=10")
    assert res.details["counts"] == {"simulate": 17, "kept": 1}


def test_training_is_refused_in_one_line():
    model, _ = model_pair("cpu", seed=0)
    model_out, res = apply_pass("quantize_linear", model, infer_ctx(training=True), {"simulate": True})
    assert not res.available
    assert res.changed == "not available: quantized GEMMs are inference only (no backward): run with --mode infer"
    assert not any(isinstance(m, QuantLinear) for m in model_out.modules())


@pytest.mark.parametrize("dtype", ["fp8", "int8"])
def test_not_available_on_the_cpu_in_one_line(dtype):
    model, _ = model_pair("cpu", seed=0)
    _, res = apply_pass("quantize_linear", model, infer_ctx(), {"dtype": dtype})
    assert not res.available
    assert "\n" not in res.changed
    assert res.changed == (f"not available: {dtype} GEMMs need a CUDA GPU (simulate: true runs the same math "
                           "as fake quantization here)")


@pytest.mark.parametrize("dtype, capability, reason", [
    ("fp8", (8, 6), "FP8 GEMMs need compute capability 8.9 or newer; this GPU is 8.6"),
    ("int8", (7, 0), "INT8 GEMMs (torch._int_mm) need compute capability 7.5 or newer; this GPU is 7.0"),
])
def test_not_available_on_an_older_gpu_in_one_line(monkeypatch, dtype, capability, reason):
    """A GPU without the format's GEMM (here its capability stood in): the stage's one line, the model untouched."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    model, _ = model_pair("cpu", seed=0)
    ctx = PassContext(device=torch.device("cuda"), precision=resolve_precision("bf16"), training=False)
    out, res = apply_pass("quantize_linear", model, ctx, {"dtype": dtype})
    assert not res.available and "\n" not in res.changed
    assert res.changed == f"not available: {reason}"
    assert not any(isinstance(m, QuantLinear) for m in out.modules())

def test_fp8_needs_sm89(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ql.PassUnavailable, match="compute capability 8.9 or newer; this GPU is 8.0"):
        ql.gpu_route("fp8", torch.device("cuda"))
    assert ql.gpu_route("int8", torch.device("cuda")) == "int_mm"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert ql.gpu_route("fp8", torch.device("cuda")) == "scaled_mm"


def test_refuses_blocks_that_run_as_one_function():
    from workbench.optimize.passes.block_plan import block_plans
    from workbench.optimize.passes._swin import named_swin_blocks

    model, _ = model_pair("cpu", seed=0)
    plans = block_plans(model)
    plans.update(named_swin_blocks(model)[0][0], whole_block=True)
    _, res = apply_pass("quantize_linear", model, infer_ctx(), {"simulate": True})
    assert not res.available and "fused_block" in res.changed and "\n" not in res.changed


def test_on_the_dense_stage_fc1_keeps_its_gelu_epilogue(reference):
    # dense (fused_linear) runs each MLP's fc1 + GELU as one GEMM that reads fc1's weight itself: fc1 stays
    # bf16, every other Linear (BiasGradLinear there) quantizes, and the MLPs' fused forwards still run
    from workbench.kernels.linear import BiasGradLinear

    model, x, fp32, _ = reference
    dense = copy.deepcopy(model)
    dense, res = apply_pass("fused_linear", dense, infer_ctx(), {})
    assert res.available and any(type(m) is BiasGradLinear for m in dense.modules())
    fused_mlps = {n for n, m in dense.named_modules() if type(m).__name__ == "Mlp" and "forward" in vars(m)}
    assert fused_mlps
    ref = logits(dense, x)
    q, res = ql.apply(copy.deepcopy(dense), infer_ctx(), dtype="int8", keep=["head.fc"], simulate=True)
    fc1 = {f"{n}.fc1" for n in fused_mlps}
    assert {n for n, why in res.details["layers"].items() if why == f"kept bf16: {ql.GELU_FC1}"} == fc1
    assert res.details["counts"] == {"simulate": 17 - len(fc1), "kept": 1 + len(fc1)}
    mods = dict(q.named_modules())
    assert all(type(mods[n]) is BiasGradLinear for n in fc1) and isinstance(mods["layers.0.blocks.0.mlp.fc2"], QuantLinear)
    assert all("forward" in vars(mods[n]) for n in fused_mlps)
    out = logits(q, x)
    assert rel_err(out, fp32) < LOGITS_REL["int8"] and agreement(out, ref) >= MIN_AGREEMENT
    # nothing left once the rest is kept: the one line counts the fc1s by their reason
    _, res = apply_pass("quantize_linear", copy.deepcopy(dense), infer_ctx(),
                        {"simulate": True, "keep": ["head.fc", "*.qkv", "*.proj", "*.fc2", "*.reduction"]})
    assert not res.available and f"{len(fc1)} fc1 with its GELU in a bf16 GEMM's epilogue (fused_linear)" in res.changed


def test_bad_parameters_are_user_errors():
    model, _ = model_pair("cpu", seed=0)
    with pytest.raises(UserError, match="dtype must be one of fp8, int8"):
        ql.apply(model, infer_ctx(), dtype="int4", simulate=True)
    with pytest.raises(UserError, match="keep must be a list"):
        ql.apply(model, infer_ctx(), keep=[3], simulate=True)
    with pytest.raises(UserError, match="keep must be a list"):
        ql.apply(model, infer_ctx(), keep="head.fc", simulate=True)
    with pytest.raises(UserError, match="percentile must be in"):
        ql.apply(model, infer_ctx(), percentile=0.0, simulate=True)


@pytest.mark.parametrize("dtype,route", [("fp8", "scaled_mm"), ("int8", "int_mm")])
@pytest.mark.parametrize("static", [False, True])
def test_gemm_routes_match_simulate(dtype, route, static):
    """QuantLinear's real routes (torch._scaled_mm / torch._int_mm run on the CPU too) against its simulate
    route on the same weights and inputs: the same quantized operands, so only the sums' order and the
    output rounding differ."""
    torch.manual_seed(3)
    lin = torch.nn.Linear(96, 288)
    x = torch.randn(2, 49, 96)
    scale = torch.tensor(x.abs().max().item() / (448 if dtype == "fp8" else 127)) if static else None
    sim, real = QuantLinear(lin, dtype, "simulate", scale), QuantLinear(lin, dtype, route, scale)
    with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16):
        a, b = sim(x), real(x)
    assert a.dtype == b.dtype == torch.bfloat16 and b.shape == (2, 49, 288)
    # the same quantized operands: the sums' order may move a bf16 output by one step (2^-8 relative)
    assert (b.double() - a.double()).abs().max() <= 2 ** -7 * a.double().abs().max()
    assert rel_err(b, a) < 6e-3   # the CPU _scaled_mm gives 0.0035
    assert not hasattr(real, "weight")
    assert "route=" + route in repr(real)



def test_apply_infer_runs_simulate_and_reports_fp8_not_available(tmp_path):
    """`swinbench apply --mode infer` on the CPU: a simulate stage of one's own is gated at the fp8
    recipe's tolerance and records the pass's routes; the built-in fp8 stage is not available, in one line."""
    import io

    from rich.console import Console

    from workbench.ladder.apply import run_apply
    from workbench.models import TINY_MODEL

    sim = tmp_path / "fp8-sim.yaml"
    sim.write_text("name: fp8-sim\nextends: amp\ndescription: fp8 fake quantization\n"
                   "gate: {bf16: {logits_rel: 1.5e-1}}\npasses:\n"
                   "  - name: quantize_linear\n    params: {dtype: fp8, keep: [head.fc], simulate: true}\n")
    result = run_apply("baseline", model=TINY_MODEL, batch=8, steps=2, warmup=1, device="cpu", progress=False,
                       interleave=0, mode="infer", out_dir=tmp_path / "run", stages=["baseline", str(sim), "fp8"],
                       console=Console(file=io.StringIO(), width=160))
    by_stage = {r["stage"]: r for r in result.records}
    gate = by_stage["fp8-sim"]["gate"]
    assert gate["status"] == "PASS", gate
    assert 1e-3 < gate["metrics"]["logits"]["rel_l2"] < 0.15
    assert 0 <= gate["metrics"]["top1_agreement"] <= 1
    quant = next(p for p in by_stage["fp8-sim"]["passes"] if p["name"] == "quantize_linear")
    assert quant["details"]["counts"] == {"simulate": 17, "kept": 1}
    fp8 = by_stage["fp8"]
    assert fp8["status"] == "not available"
    quant = next(p for p in fp8["passes"] if p["name"] == "quantize_linear")
    assert quant["changed"] == ("not available: fp8 GEMMs need a CUDA GPU (simulate: true runs the same math "
                                "as fake quantization here)")


def test_nothing_left_to_quantize_is_not_available():
    model, _ = model_pair("cpu", seed=0)
    model.eval()
    model, _ = ql.apply(model, infer_ctx(), dtype="fp8", simulate=True)
    # again: only the head (N=10) is a plain nn.Linear now, and fp8 cannot take it
    _, res = apply_pass("quantize_linear", model, infer_ctx(), {"dtype": "fp8", "simulate": True})
    assert res.changed == ("not available: no Linear left to quantize: 1 kept (1 with K or N not a multiple of 16 "
                           "(fp8))")
    assert res.details["layers"] == {"head.fc": "kept bf16: K=64, N=10: fp8 GEMMs need multiples of 16"}


def test_nothing_left_counts_the_reasons_in_one_short_line():
    kept = {f"l{i}": f"measured faster in bf16 at 64x{i} -> 96: 1.0 us against 2.0 us for int8" for i in range(20)}
    kept.update({"a": "K=2, N=512: int8 GEMMs need multiples of 8", "b": "K=512, N=3: int8 GEMMs need multiples of 8",
                 "head.fc": "keep pattern 'head.fc'"})
    assert ql.nothing_left(kept) == ("no Linear left to quantize: 23 kept (20 measured faster in bf16 on this GPU; "
                                     "2 with K or N not a multiple of 8 (int8); 1 by keep pattern 'head.fc')")


def test_simulate_over_the_fmha_chain():
    """The recipes' composition: fmha's passes (fused LayerNorm, window and attention kernels, under the
    Triton interpreter on the CPU; bf16 master weights), then quantize_linear: the fused forwards call the swapped
    modules, and the logits stay within the fp8 recipe's tolerance of the fmha stage's."""
    from workbench.models import TINY_MODEL
    from workbench.optimize.recipes import apply_chain_passes, resolve_chain
    from workbench.optimize.workload import Workload, WorkloadConfig

    # on a GPU machine the Triton kernels run there (conftest sets the interpreter only without one)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = WorkloadConfig(model=TINY_MODEL, mode="infer", batch=4, precision="fp32", device=device, seed=0)
    out = {}
    for quantized in (False, True):
        w = Workload.build(cfg)
        w.model, results = apply_chain_passes(w.model, w.ctx, resolve_chain("fmha"))
        assert all(r.available for r in results), [r.changed for r in results]
        if quantized:
            w.model, res = apply_pass("quantize_linear", w.model, w.ctx, {"dtype": "fp8", "keep": ["head.fc"],
                                                                          "simulate": True})
            assert res.details["counts"] == {"simulate": 17, "kept": 1}
        w.prepare()
        with torch.inference_mode():
            logits, _ = w.forward_loss()
        out[quantized] = logits.double()
    assert 1e-3 < rel_err(out[True], out[False]) < LOGITS_REL["fp8"]


def test_layer_rows_are_each_linears_tokens_per_image(reference):
    model = reference[0]
    rows = ql.layer_rows(model, ["layers.0.blocks.0.attn.qkv", "layers.0.blocks.0.mlp.fc2", "head.fc"], infer_ctx())
    # the tiny Swin at 56 px: 14x14 tokens in stage 1, one row per image at the head
    assert rows == {"layers.0.blocks.0.attn.qkv": 196, "layers.0.blocks.0.mlp.fc2": 196, "head.fc": 1}


def test_measured_selection_times_each_shape_once_and_keeps_the_slower_ones_wide(reference, monkeypatch):
    """select auto on a GPU route: every distinct (rows, K, N) timed bf16 against its QuantLinear (the CUDA
    timer replaced: the QuantLinear is slower wherever K < 64), its choice applied to every layer of it."""
    from workbench.optimize.passes import _route

    model = copy.deepcopy(reference[0])
    timed = []

    def fake_median_us(call):
        timed.append(call().shape)
        return 10.0
    monkeypatch.setattr(_route, "median_us", fake_median_us)
    ctx = PassContext(device=torch.device("cpu"), precision=resolve_precision("bf16"), training=False, batch=4)
    routes = {n: "int_mm" for n, _ in ql.quantizable_linears(model) if n != "head.fc"}
    measured = ql.measure_layers(model, routes, "int8", ctx, static=False)
    shapes = set(measured)
    assert (4 * 196, 32, 96, False, False) in shapes and (4 * 49, 64, 192, False, False) in shapes  # stage 1, 2 qkv
    assert (4 * 196, 128, 32, True, False) in shapes     # stage 1 fc2, timed with its GELU (interpreter: kernels run)
    assert sum(len(r["layers"]) for r in measured.values()) == len(routes)
    assert len(timed) == 2 * len(measured)                                  # bf16 and quantized, once per shape
    assert all(r["choice"] == "bf16" for r in measured.values())            # a tie stays bf16 (3% margin)


def test_select_auto_quantizes_only_the_shapes_measured_faster(reference, monkeypatch):
    model = copy.deepcopy(reference[0])
    monkeypatch.setattr(ql, "gpu_route", lambda dtype, device: "int_mm")

    def measured(model, routes, dtype, ctx, static, candidates):
        assert candidates == ("int_mm", "triton")      # gemm auto: both GEMMs timed per shape
        shapes = {}
        for name in routes:
            lin = model.get_submodule(name)
            shapes.setdefault((196 * 8, lin.in_features, lin.out_features, False, False), []).append(name)
        # K >= 64 quantizes: on Triton's GEMM where N >= 128, on torch._int_mm otherwise
        return {s: {"bf16_us": 10.0, "int_mm_us": 5.0 if s[1] >= 64 else 12.0, "triton_us": 4.0 if s[2] >= 128 else 6.0,
                    "quant_us": 5.0 if s[1] >= 64 else 12.0, "route": "triton" if s[2] >= 128 else "int_mm",
                    "choice": "quantize" if s[1] >= 64 else "bf16", "layers": names} for s, names in shapes.items()}
    monkeypatch.setattr(ql, "measure_layers", measured)
    q, res = ql.apply(model, infer_ctx(), dtype="int8", keep=["head.fc"])
    wide = {n for n, r in res.details["layers"].items() if r.startswith("kept bf16: measured faster in bf16")}
    quantized = {n for n, r in res.details["layers"].items() if r in ("int_mm", "triton")}
    assert wide and quantized and res.details["selected_by_measurement"] and res.params["select"] == "auto"
    assert all(q.get_submodule(n).in_features < 64 for n in wide)
    assert all(isinstance(q.get_submodule(n), QuantLinear) and q.get_submodule(n).in_features >= 64 for n in quantized)
    assert all(q.get_submodule(n).route == ("triton" if q.get_submodule(n).out_features >= 128 else "int_mm")
               for n in quantized)
    assert set(res.details["counts"]) == {"int_mm", "triton", "kept"} and res.details["gemm"] == "auto"
    assert f"{res.details['counts']['triton']} triton" in res.changed
    assert f"({len(wide)} measured faster in bf16 on this GPU)" in res.changed
    assert "12.0 us against 5.0" not in res.details["layers"][next(iter(wide))]
    assert "10.0 us against 12.0 us for int8" in res.details["layers"][next(iter(wide))]
    assert {s["choice"] for s in res.details["shapes"]} == {"quantize", "bf16"}
    # select all: every layer the shape rules allow, nothing timed
    monkeypatch.setattr(ql, "measure_layers", lambda *a: pytest.fail("select all must not measure"))
    _, res = ql.apply(copy.deepcopy(reference[0]), infer_ctx(), dtype="int8", keep=["head.fc"], select="all")
    assert res.details["counts"] == {"int_mm": 17, "kept": 1} and not res.details["selected_by_measurement"]
    with pytest.raises(UserError, match="select must be one of auto, all"):
        ql.apply(copy.deepcopy(reference[0]), infer_ctx(), dtype="int8", select="some")
    # gemm triton with select all: Triton's GEMM everywhere, nothing timed
    q, res = ql.apply(copy.deepcopy(reference[0]), infer_ctx(), dtype="int8", keep=["head.fc"], select="all",
                      gemm="triton")
    assert res.details["counts"] == {"triton": 17, "kept": 1}
    assert all(m.route == "triton" for m in q.modules() if isinstance(m, QuantLinear))
    with pytest.raises(UserError, match="gemm must be one of auto, torch, triton"):
        ql.apply(copy.deepcopy(reference[0]), infer_ctx(), dtype="int8", gemm="cublas")


@pytest.mark.parametrize("dtype,route", [("fp8", "scaled_mm"), ("int8", "int_mm")])
def test_mlps_run_gelu_and_fc2s_quantization_as_one_launch(reference, monkeypatch, dtype, route):
    """Where the kernels run (here Triton's interpreter), each MLP whose fc2 quantizes per row runs GELU
    and that quantization as one gelu_quantize_rows: the logits of the unfused path, layer for layer."""
    from workbench.kernels import quant

    model, x, _, _ = reference
    monkeypatch.setattr(ql, "gpu_route", lambda d, device: route)
    q, res = ql.apply(copy.deepcopy(model), infer_ctx(), dtype=dtype, keep=["head.fc"], select="all")
    mlps = [m for m in q.modules() if type(m).__name__ == "Mlp"]
    assert res.details["gelu_fused_mlps"] == len(mlps) == 4
    assert all(vars(m)["forward"].__func__ is ql.gelu_quant_mlp_forward for m in mlps)
    assert "in 4 MLPs GELU and fc2's input quantization run as one Triton launch" in res.changed
    launches = []
    real = quant.gelu_quantize_rows
    monkeypatch.setattr(ql, "gelu_quantize_rows", lambda h, fmt: launches.append(h.shape) or real(h, fmt))
    fused = logits(q, x[:4])
    assert len(launches) == 4
    for m in mlps:                     # timm's own forward on the same modules
        del m.forward
    plain = logits(q, x[:4])
    assert rel_err(fused, plain) < 1e-2 and (fused.argmax(-1) == plain.argmax(-1)).all()
    # a second run keeps what is bound; static activations, simulate and training bind nothing
    again = copy.deepcopy(q)
    assert ql.fuse_mlp_activations(again, torch.device("cpu")) == 4
    assert ql.fuse_mlp_activations(again, torch.device("cpu")) == 0
    _, res = ql.apply(copy.deepcopy(model), infer_ctx(), dtype=dtype, activations="static", keep=["head.fc"],
                      select="all", calibration_batches=1, calibration_batch=2)
    assert res.details["gelu_fused_mlps"] == 0
    _, res = ql.apply(copy.deepcopy(model), infer_ctx(), dtype=dtype, keep=["head.fc"], simulate=True)
    assert res.details["gelu_fused_mlps"] == 0


@pytest.mark.parametrize("dtype,route", [("fp8", "scaled_mm"), ("int8", "int_mm")])
def test_the_triton_gemm_gives_the_torch_routes_logits(reference, monkeypatch, dtype, route):
    """gemm triton against gemm torch on the whole tiny Swin (Triton's interpreter here): int8 the same
    bits, e4m3 the same logits to bf16 rounding and the same top-1."""
    model, x, _, _ = reference
    monkeypatch.setattr(ql, "gpu_route", lambda d, device: route)
    out = {}
    for gemm in ("torch", "triton"):
        q, res = ql.apply(copy.deepcopy(model), infer_ctx(), dtype=dtype, keep=["head.fc"], select="all", gemm=gemm)
        assert set(res.details["counts"]) == {route if gemm == "torch" else "triton", "kept"}
        out[gemm] = logits(q, x[:2])
    if dtype == "int8":
        assert torch.equal(out["triton"], out["torch"])
    else:
        assert rel_err(out["triton"], out["torch"]) < 2e-2 and agreement(out["triton"], out["torch"]) == 1.0


def tiny_swinv2():
    """A SwinV2 of embed_dim 32 at 32 px (window 4: 8x8 tokens in stage 1), its q/v biases drawn."""
    from timm.models.swin_transformer_v2 import SwinTransformerV2

    torch.manual_seed(0)
    model = SwinTransformerV2(img_size=32, patch_size=4, window_size=4, embed_dim=32, depths=(2, 2),
                              num_heads=(2, 4), num_classes=10, drop_path_rate=0.0).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_bias", "v_bias")):
                p.normal_(0.0, 0.1)
    return model


def test_swinv2_qkv_is_timed_at_its_rows_and_a_wide_one_keeps_timm_s_linear(monkeypatch):
    """The measured selection sees SwinV2's qkv called as a module (its real rows per image, not 1); a qkv
    measured faster wide goes back to timm's F.linear with its biases inside."""
    from timm.models.swin_transformer_v2 import WindowAttention

    model = tiny_swinv2()
    monkeypatch.setattr(ql, "gpu_route", lambda dtype, device: "int_mm")
    seen = {}

    def measured(model, routes, dtype, ctx, static, candidates):
        rows = ql.layer_rows(model, list(routes), ctx)
        seen.update(rows)
        return {(rows[n], i, 1, False, False): {"bf16_us": 10.0, "int_mm_us": 5.0, "quant_us": 5.0 if "mlp" in n else 12.0,
                                         "route": "int_mm", "choice": "quantize" if "mlp" in n else "bf16",
                                         "layers": [n]} for i, n in enumerate(routes)}
    monkeypatch.setattr(ql, "measure_layers", measured)
    q, res = ql.apply(model, infer_ctx(), dtype="int8", keep=["head.fc"])
    assert seen["layers.0.blocks.0.attn.qkv"] == 64 and seen["layers.1.blocks.0.attn.qkv"] == 16
    attns = [m for m in q.modules() if isinstance(m, WindowAttention)]
    assert all(type(m.qkv) is torch.nn.Linear and not m.qkv_bias_separate for m in attns)
    assert res.details["swinv2_qkv_bias_after_gemm"] == 0


@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_swinv2_qkv_quantizes_under_the_fused_attention(activations):
    """timm's SwinV2 attention passes its q/v biases to F.linear with qkv.weight, which a QuantLinear does
    not hold: the pass switches those modules to timm's qkv_bias_separate (the Linear called as a module,
    the biases added after), so the fused SwinV2 forward, timm's own and the calibration hooks all see the
    quantized layer; the logits stay within the int8 recipe's tolerance."""
    from timm.models.swin_transformer_v2 import WindowAttention

    plain = tiny_swinv2()
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    ref = logits(plain, x, bf16=False)
    for fused in (False, True):
        model = copy.deepcopy(plain)
        if fused:
            model, _ = apply_pass("fused_attention", model, infer_ctx())
        model, res = ql.apply(model, infer_ctx(), dtype="int8", activations=activations, keep=["head.fc"],
                              simulate=True, calibration_batches=1, calibration_batch=2)
        attns = [m for m in model.modules() if isinstance(m, WindowAttention)]
        assert res.details["swinv2_qkv_bias_after_gemm"] == len(attns) == 4
        assert all(isinstance(m.qkv, QuantLinear) and m.qkv_bias_separate for m in attns)
        if activations == "static":
            assert all(f"{n}.qkv" in res.details["calibration"]["scales"] for n, m in model.named_modules()
                       if isinstance(m, WindowAttention))
        assert rel_err(logits(model, x), ref) < LOGITS_REL["int8"]


def test_swinv2_position_bias_mlps_stay_wide():
    """cpb_mlp maps the window's coordinate table, not the tokens: never a candidate, even where its
    output width (the heads) would fit the GEMM's alignment (8 heads, int8)."""
    from timm.models.swin_transformer_v2 import SwinTransformerV2

    model = SwinTransformerV2(img_size=32, patch_size=4, window_size=4, embed_dim=64, depths=(2,), num_heads=(8,),
                              num_classes=16)
    names = [n for n, _ in ql.quantizable_linears(model)]
    assert names and not any("cpb_mlp" in n for n in names)
    assert any(n.endswith("attn.qkv") for n in names)


@pytest.mark.parametrize("chain", ["fmha", "dense"])
@pytest.mark.parametrize("dtype,route", [("fp8", "scaled_mm"), ("int8", "int_mm")])
def test_the_norms_write_the_qkv_and_fc1_inputs_quantized(monkeypatch, dtype, route, chain):
    """On the fused window forwards (fmha's passes, the Triton interpreter here), each block's norm1 kernel
    writes its qkv's input quantized (norm_shift_partition_quant, the residual add of the deferred MLP
    branch included), and its merge + add + norm2 kernel the fc1's (merge_add_norm_quant); the Linears read
    them with no quantization launch: the logits of the path where each Linear quantizes the norm's bf16
    output itself, bit for bit. On dense fc1 stays bf16 (its GELU epilogue): norm2 writes bf16 there."""
    from workbench.models import TINY_MODEL
    from workbench.optimize.recipes import apply_chain_passes, resolve_chain
    from workbench.optimize.workload import Workload, WorkloadConfig

    monkeypatch.setattr(ql, "gpu_route", lambda d, device: route)
    cfg = WorkloadConfig(model=TINY_MODEL, mode="infer", batch=2, precision="bf16", device="cpu", seed=0)
    w = Workload.build(cfg)
    w.model, results = apply_chain_passes(w.model, w.ctx, resolve_chain(chain))
    assert all(r.available for r in results), [r.changed for r in results]
    w.model, res = apply_pass("quantize_linear", w.model, w.ctx, {"dtype": dtype, "keep": ["head.fc"], "select": "all"})
    from workbench.optimize.passes._swin import named_swin_blocks

    n2 = 4 if chain == "fmha" else 0
    assert res.details["norm1_quantizes_qkv_blocks"] == len(named_swin_blocks(w.model)) == 4
    assert res.details["norm2_quantizes_fc1_blocks"] == n2
    assert "in 4 blocks norm1's kernel writes the qkv input quantized" in res.changed
    assert ("in 4 blocks norm2's kernel writes the fc1 input quantized" in res.changed) == (chain == "fmha")
    w.prepare()
    out = _fused_and_unfused(monkeypatch, w, epilogue=False)
    assert torch.equal(out[True][0], out[False][0])
    assert out[False][1] - out[True][1] == 4 + n2     # a quantize_rows launch fewer per fused norm


def _fused_and_unfused(monkeypatch, w, epilogue: bool) -> dict:
    """{fused: (logits in float64, quantize_rows launches, torch GELU calls)} of one inference forward of
    the workload as bound, then with the norms' quantized outputs off (each Linear quantizing its own
    input), and where `epilogue`, fc1's fused GELU and output quantization off too."""
    from workbench.kernels import quant
    from workbench.optimize.passes import block_forward

    calls, gelus = [], []
    real, real_gelu = quant.quantize_rows, torch.nn.functional.gelu
    monkeypatch.setattr(quant, "quantize_rows", lambda x2, fmt: calls.append(x2.shape) or real(x2, fmt))
    monkeypatch.setattr(torch.nn.functional, "gelu", lambda x, **kw: gelus.append(1) or real_gelu(x, **kw))
    out = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(block_forward, "norm1_quantizes_qkv", lambda blk, x: None)
            monkeypatch.setattr(block_forward, "norm2_quantizes_fc1", lambda blk, x: None)
            if epilogue:
                monkeypatch.setattr(quant.QuantLinear, "epilogue_fused", lambda self, device: False)
        calls.clear()
        gelus.clear()
        with torch.inference_mode():
            logits, _ = w.forward_loss()
        out[fused] = (logits.double(), len(calls), len(gelus))
    return out


@pytest.mark.parametrize("chain", ["fmha", "dense"])
@pytest.mark.parametrize("dtype,route", [("fp8", "scaled_mm"), ("int8", "int_mm")])
def test_mixed_runs_each_mlp_as_one_quantized_pair(monkeypatch, dtype, route, chain):
    """activations: mixed on the fused window forwards (the Triton interpreter here): norm1's kernel writes the
    qkv input quantized per row, merge + add + norm2's the fc1 input (on dense too: fc1 leaves its bf16
    GELU epilogue for the quantized GEMM's), and fc1's GEMM applies the GELU and writes fc2's input at fc2's
    calibrated static scale: no quantize_rows and no GELU launch of their own for the MLP. The logits are
    within 2% of the unfused path's (each Linear quantizing its own input, torch's GELU on fc1's bf16
    output): the epilogue's GELU reads the fp32 result and no bf16 rounding, so a quantized value may land
    one step apart."""
    from workbench.models import TINY_MODEL
    from workbench.optimize.recipes import apply_chain_passes, resolve_chain
    from workbench.optimize.workload import Workload, WorkloadConfig

    monkeypatch.setattr(ql, "gpu_route", lambda d, device: route)
    monkeypatch.setattr(ql, "attention_triples", lambda model, dtype: {})   # the attention's test is its own
    w = Workload.build(WorkloadConfig(model=TINY_MODEL, mode="infer", batch=2, precision="bf16", device="cpu", seed=0))
    w.model, results = apply_chain_passes(w.model, w.ctx, resolve_chain(chain))
    assert all(r.available for r in results)
    w.model, res = apply_pass("quantize_linear", w.model, w.ctx, {
        "dtype": dtype, "keep": ["head.fc"], "select": "all", "activations": "mixed", "calibration_batches": 1,
        "calibration_batch": 2})
    d = res.details
    assert (d["mlp_pairs"], d["norm1_quantizes_qkv_blocks"], d["norm2_quantizes_fc1_blocks"]) == (4, 4, 4)
    assert d["counts"] == {route: 13, "triton": 4, "kept": 1} and d["gelu_fused_mlps"] == 0
    assert set(d["calibration"]["scales"]) == {f"layers.{i}.blocks.{j}.mlp.fc2" for i in range(2) for j in range(2)}
    assert "in 4 MLPs GELU and fc2's static input quantization run in fc1's GEMM epilogue" in res.changed
    fc1, fc2 = w.model.layers[0].blocks[0].mlp.fc1, w.model.layers[0].blocks[0].mlp.fc2
    assert fc1.gelu and torch.equal(fc1.output_scale, fc2.input_scale) and fc1.epilogue_fused(torch.device("cpu"))
    w.prepare()
    out = _fused_and_unfused(monkeypatch, w, epilogue=True)
    # fused: proj and the merging reductions quantize their own input; unfused also qkv and fc1 (fc2's
    # static input takes torch ops), and the GELU is torch's
    assert out[False][1] - out[True][1] == 8 and (out[True][2], out[False][2]) == (0, 4)
    assert rel_err(out[True][0], out[False][0]) < 2e-2


def test_mixed_selection_times_each_mlp_shape_as_a_whole(monkeypatch):
    """activations: mixed on dense: the selection times each MLP shape once as the stage's MLP (fc1 + GELU
    epilogue + fc2, bf16) against the quantized pair from norm2's quantized rows, and moves both Linears of
    the MLPs of a shape measured slower to bf16 (fc1 keeping its bf16 GELU epilogue there)."""
    from workbench.models import TINY_MODEL
    from workbench.optimize.passes import _route
    from workbench.optimize.recipes import apply_chain_passes, resolve_chain
    from workbench.optimize.workload import Workload, WorkloadConfig

    w = Workload.build(WorkloadConfig(model=TINY_MODEL, mode="infer", batch=2, precision="bf16", device="cpu", seed=0))
    w.model, _ = apply_chain_passes(w.model, w.ctx, resolve_chain("dense"))
    pairs = ql.mlp_pairs(w.model)
    assert len(pairs) == 4
    timed = []
    monkeypatch.setattr(_route, "median_us", lambda call: call() is None or timed.append(1) or 10.0)
    measured = ql.measure_pairs(w.model, pairs, "int8", w.ctx, ("int_mm", "triton"))
    assert sorted(measured) == [(98, 64, 256, "mlp", True), (392, 32, 128, "mlp", True)]
    assert len(timed) == 2 * 3 and all(len(r["layers"]) == 4 for r in measured.values())
    # stage 1's MLPs measured faster quantized, stage 2's not
    fast = {(392, 32, 128, "mlp", True): 5.0, (98, 64, 256, "mlp", True): 20.0}
    monkeypatch.setattr(ql, "gpu_route", lambda d, device: "int_mm")
    monkeypatch.setattr(ql, "measure_pairs", lambda model, pairs, dtype, ctx, candidates: {
        k: {**v, "int_mm_us": fast[k], "quant_us": fast[k], "route": "int_mm",
            "choice": "quantize" if fast[k] < 10 else "bf16"} for k, v in measured.items()})
    monkeypatch.setattr(ql, "measure_layers", lambda model, routes, *a: {})
    _, res = ql.apply(w.model, w.ctx, dtype="int8", activations="mixed", keep=["head.fc"], calibration_batches=1,
                      calibration_batch=2)
    layers = res.details["layers"]
    assert res.details["mlp_pairs"] == 2 and set(res.details["calibration"]["scales"]) == {
        "layers.0.blocks.0.mlp.fc2", "layers.0.blocks.1.mlp.fc2"}
    assert layers["layers.0.blocks.0.mlp.fc1"] == "triton" and layers["layers.0.blocks.0.mlp.fc2"] == "int_mm"
    assert layers["layers.1.blocks.0.mlp.fc1"].startswith("kept bf16: measured faster in bf16 at 98x64 -> 256 (the MLP")
    assert [s["mlp_pair"] for s in res.details["shapes"]] == [True, True]
    assert type(w.model.layers[1].blocks[0].mlp.fc1).__name__ == "BiasGradLinear"


@pytest.mark.parametrize("dtype,route", [("fp8", "scaled_mm"), ("int8", "int_mm")])
def test_mixed_runs_each_fp8_window_attention_on_e4m3(monkeypatch, dtype, route):
    """activations: mixed, fp8, on fmha's fused window attention (the Triton interpreter here): each block's qkv
    GEMM writes q, k, v in e4m3 at their calibrated output scale, the attention kernel reads them and writes
    proj's input in e4m3 at proj's calibrated input scale (quantized_window_attention), proj reads it as it
    is. The logits stay within 3% of the path with a bf16 attention. int8 keeps the attention wide."""
    from workbench.kernels import window_attention as wa
    from workbench.models import TINY_MODEL
    from workbench.optimize.recipes import apply_chain_passes, resolve_chain
    from workbench.optimize.workload import Workload, WorkloadConfig

    monkeypatch.setattr(ql, "gpu_route", lambda d, device: route)
    params = {"dtype": dtype, "keep": ["head.fc"], "select": "all", "activations": "mixed", "calibration_batches": 1,
              "calibration_batch": 2}
    logits = {}
    for triples in (True, False):
        if not triples:
            monkeypatch.setattr(ql, "attention_triples", lambda model, dtype: {})
        w = Workload.build(WorkloadConfig(model=TINY_MODEL, mode="infer", batch=2, precision="bf16", device="cpu",
                                          seed=0))
        w.model, _ = apply_chain_passes(w.model, w.ctx, resolve_chain("fmha"))
        w.model, res = apply_pass("quantize_linear", w.model, w.ctx, params)
        w.prepare()
        calls = []
        real = wa.quantized_window_attention
        monkeypatch.setattr(wa, "quantized_window_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
        with torch.inference_mode():
            logits[triples], _ = w.forward_loss()
        monkeypatch.setattr(wa, "quantized_window_attention", real)
        n = 4 if triples and dtype == "fp8" else 0
        assert res.details["attention_triples"] == len(calls) == n
        if n:
            scales = res.details["calibration"]["scales"]
            assert {f"layers.{i}.blocks.{j}.attn.{x}" for i in range(2) for j in range(2)
                    for x in ("proj", "qkv" + ql.OUTPUT)} <= set(scales)
            assert "in 4 blocks the window attention runs on e4m3 from qkv's epilogue to proj" in res.changed
            assert res.details["attention"].startswith("e4m3 in 4 blocks")
            qkv = w.model.layers[0].blocks[0].attn.qkv
            assert qkv.route == "triton" and qkv.output_scale is not None and not qkv.gelu
    assert rel_err(logits[True].double(), logits[False].double()) < 3e-2


def test_the_attention_triple_is_chosen_only_where_it_beats_the_singles(monkeypatch):
    """The measured selection times each attention shape as the stage would run it (bf16 Linears) and as the
    e4m3 triple; the triple must also beat that time less what quantizing qkv and proj alone saves
    (measure_layers' records). Stage 1 here: triple 7 us against singles 10 - 2 = 8: taken, both Linears on
    the triple's routes; stage 2: triple 9 against 10 - 3 = 7: the singles' choices stand."""
    from workbench.models import TINY_MODEL
    from workbench.optimize.passes import _route
    from workbench.optimize.recipes import apply_chain_passes, resolve_chain
    from workbench.optimize.workload import Workload, WorkloadConfig

    w = Workload.build(WorkloadConfig(model=TINY_MODEL, mode="infer", batch=2, precision="bf16", device="cpu", seed=0))
    w.model, _ = apply_chain_passes(w.model, w.ctx, resolve_chain("fmha"))
    triples = ql.attention_triples(w.model, "fp8")
    assert len(triples) == 4 and ql.attention_triples(w.model, "int8") == {}
    times = iter([])

    def median_us(call):
        call()
        return next(times)
    monkeypatch.setattr(_route, "median_us", median_us)
    singles = {("s1", "qkv"): {"layers": [t[0] for b, t in triples.items() if b.startswith("layers.0")],
                               "bf16_us": 5.0, "quant_us": 4.0, "choice": "quantize"},
               ("s1", "proj"): {"layers": [t[1] for b, t in triples.items() if b.startswith("layers.0")],
                                "bf16_us": 3.0, "quant_us": 2.0, "choice": "quantize"},
               ("s2", "qkv"): {"layers": [t[0] for b, t in triples.items() if b.startswith("layers.1")],
                               "bf16_us": 5.0, "quant_us": 2.0, "choice": "quantize"},
               ("s2", "proj"): {"layers": [t[1] for b, t in triples.items() if b.startswith("layers.1")],
                                "bf16_us": 3.0, "quant_us": 4.0, "choice": "bf16"}}
    # per shape (stage 1, then stage 2): bf16, then each route
    times = iter([10.0, 7.0, 7.5, 10.0, 9.0, 9.5])
    measured = ql.measure_triples(w.model, triples, w.ctx, ("scaled_mm", "triton"), singles)
    by_stage = {k[0]: f for k, f in measured.items()}
    assert len(measured) == 2 and all(k[3] == "attn" and len(f["layers"]) == 4 for k, f in measured.items())
    s1, s2 = by_stage[max(by_stage)], by_stage[min(by_stage)]
    assert (s1["singles_us"], s1["choice"], s1["route"]) == (8.0, "quantize", "scaled_mm")
    assert (s2["singles_us"], s2["choice"]) == (7.0, "bf16")
    # kernels that fail on this GPU: no triple, the error in the record
    times = iter([10.0] * 2)
    monkeypatch.setattr(ql, "QuantLinear", lambda *a: (_ for _ in ()).throw(RuntimeError("no e4m3 here\nmore")))
    failed = ql.measure_triples(w.model, triples, w.ctx, ("scaled_mm",), singles)
    monkeypatch.undo()
    monkeypatch.setattr(_route, "median_us", median_us)
    assert all(f["choice"] == "bf16" and f["error"] == "RuntimeError: no e4m3 here" for f in failed.values())
    # in the pass: stage 1's triples take their qkv (Triton, its epilogue) and proj back from the singles'
    # choices (proj measured faster in bf16 alone there), stage 2's layers keep theirs
    monkeypatch.setattr(ql, "gpu_route", lambda d, device: "scaled_mm")

    def layers(model, routes, *a):
        return {(i, 0, 0, False, False): {"layers": [n], "bf16_us": 5.0, "quant_us": 4.0, "route": "scaled_mm",
                                           "choice": "bf16" if n.endswith("proj") else "quantize"}
                for i, n in enumerate(routes)}
    monkeypatch.setattr(ql, "measure_layers", layers)
    monkeypatch.setattr(ql, "measure_pairs", lambda *a: {})
    monkeypatch.setattr(ql, "measure_triples", lambda model, triples, ctx, candidates, singles: {
        (k[0], k[1], k[2], "attn", k[4]): {**f, "layers": [n for n in f["layers"] if n in
                                                           {x for t in triples.values() for x in t}]}
        for k, f in measured.items()})
    _, res = ql.apply(w.model, w.ctx, dtype="fp8", activations="mixed", keep=["head.fc"], calibration_batches=1,
                      calibration_batch=2)
    got = res.details["layers"]
    assert res.details["attention_triples"] == 2
    assert got["layers.0.blocks.1.attn.qkv"] == "triton" and got["layers.0.blocks.1.attn.proj"] == "scaled_mm"
    assert got["layers.1.blocks.0.attn.qkv"] == "scaled_mm" and got["layers.1.blocks.0.attn.proj"].startswith("kept bf16")


def test_selection_times_a_norm_fed_linear_as_its_gemm_alone(monkeypatch):
    """On fmha's fused window forwards each qkv and fc1 takes its input quantized from its norm's kernel:
    the measured selection groups them apart (normed) and times their quantized form without a
    quantization launch; the other Linears (proj, fc2, the merging reduction) as before."""
    from workbench.kernels import quant
    from workbench.models import TINY_MODEL
    from workbench.optimize.passes import _route
    from workbench.optimize.recipes import apply_chain_passes, resolve_chain
    from workbench.optimize.workload import Workload, WorkloadConfig

    w = Workload.build(WorkloadConfig(model=TINY_MODEL, mode="infer", batch=2, precision="bf16", device="cpu", seed=0))
    w.model, _ = apply_chain_passes(w.model, w.ctx, resolve_chain("fmha"))
    monkeypatch.setattr(_route, "median_us", lambda call: call() is None or 10.0)
    launches = []
    real = quant.QuantLinear.forward
    monkeypatch.setattr(quant.QuantLinear, "forward", lambda self, x: launches.append(1) or real(self, x))
    routes = {n: "int_mm" for n, _ in ql.quantizable_linears(w.model) if n != "head.fc"}
    measured = ql.measure_layers(w.model, routes, "int8", w.ctx, static=False)
    normed = {n for key, r in measured.items() if key[4] for n in r["layers"]}
    assert normed == {n for n in routes if n.endswith((".attn.qkv", ".mlp.fc1"))} and len(normed) == 8
    # QuantLinear.forward (its input quantization included) timed for the other shapes only
    assert len(launches) == sum(1 for key in measured if not key[4] and not key[3])
    monkeypatch.setattr(ql, "gpu_route", lambda d, device: "int_mm")
    _, res = ql.apply(w.model, w.ctx, dtype="int8", keep=["head.fc"], select="all")
    assert res.details["norm1_quantizes_qkv_blocks"] == 4


def test_mixed_runs_a_pair_measured_faster_whole_as_one_kernel(monkeypatch):
    """fp8 mixed: measure_pairs also times each narrow MLP shape as one kernel (kernels.mlp.quantized_mlp: fc1,
    GELU, the hidden quantized at fc2's scale and kept on chip, fc2), and a pair whose kernel beats its two
    GEMMs by the margin runs that way: stage 1's here (kernel 4 us, pair 8, bf16 10), not stage 2's
    (kernel 7.9 against 8). The logits are the two-GEMM pair's up to the order of fc2's sums."""
    from workbench.models import TINY_MODEL
    from workbench.optimize.passes import _route, block_forward
    from workbench.optimize.recipes import apply_chain_passes, resolve_chain
    from workbench.optimize.workload import Workload, WorkloadConfig

    w = Workload.build(WorkloadConfig(model=TINY_MODEL, mode="infer", batch=2, precision="bf16", device="cpu", seed=0))
    w.model, _ = apply_chain_passes(w.model, w.ctx, resolve_chain("fmha"))
    pairs = ql.mlp_pairs(w.model)
    stage1 = (392, 32, 128, "mlp", True)
    monkeypatch.setattr(_route, "median_us", lambda call: call() is None or 10.0)
    measured = ql.measure_pairs(w.model, pairs, "fp8", w.ctx, ("triton",))
    assert all("kernel_us" in r for r in measured.values()) and len(measured) == 2
    times = {stage1: (8.0, 4.0), (98, 64, 256, "mlp", True): (8.0, 7.9)}
    monkeypatch.setattr(ql, "gpu_route", lambda d, device: "triton")
    monkeypatch.setattr(ql, "attention_triples", lambda model, dtype: {})
    monkeypatch.setattr(ql, "measure_layers", lambda model, routes, *a: {})
    monkeypatch.setattr(ql, "measure_pairs", lambda model, pairs, dtype, ctx, candidates: {
        k: {**v, "triton_us": times[k][0], "quant_us": times[k][0], "route": "triton", "choice": "quantize",
            "kernel_us": times[k][1], "mlp_kernel": times[k][1] < times[k][0] * 0.97} for k, v in measured.items()})
    w.model, res = ql.apply(w.model, w.ctx, dtype="fp8", activations="mixed", keep=["head.fc"],
                            calibration_batches=1, calibration_batch=2)
    assert res.details["mlp_pairs"] == 4 and res.details["mlp_pairs_in_one_kernel"] == 2
    assert "(2 of them the whole MLP in one kernel)" in res.changed
    assert vars(w.model.layers[0].blocks[0].mlp)["forward"].__func__ is block_forward.mlp_forward_quantized_whole
    assert vars(w.model.layers[1].blocks[1].mlp)["forward"].__func__ is block_forward.mlp_forward_quantized
    calls, logits, pair = mlp_kernel_calls(monkeypatch, w, "quantized_mlp", ("layers.0.blocks.0", "layers.0.blocks.1"))
    assert calls == [(392, 32), (392, 32)] and rel_err(logits, pair) < 1e-2


def _dense_with_every_mlp_kernel(monkeypatch):
    """The tiny Swin's bf16 inference workload through dense, its one-kernel MLP planned on every shape (the
    GPU measurement forced: the kernels run in the interpreter)."""
    from workbench.models import TINY_MODEL
    from workbench.optimize.passes import _route, fused_linear
    from workbench.optimize.recipes import apply_chain_passes, resolve_chain
    from workbench.optimize.workload import Workload, WorkloadConfig

    monkeypatch.setattr(fused_linear, "_inference_epilogue", lambda ctx, n, dtypes: True)
    monkeypatch.setattr(fused_linear, "measure_qkv_kernel", lambda *a: {})     # the MLPs' measurement alone
    times = iter([10.0, 5.0] * 2)       # per MLP shape: the two GEMMs, then the kernel
    monkeypatch.setattr(_route, "median_us", lambda call: call() is None or next(times))
    w = Workload.build(WorkloadConfig(model=TINY_MODEL, mode="infer", batch=2, precision="bf16", device="cpu", seed=0))
    w.model, results = apply_chain_passes(w.model, w.ctx, resolve_chain("dense"))
    assert results[-1].details["mlp_kernel_blocks"] == 4
    return w


def test_a_single_quantized_fc2_takes_the_bf16_one_kernel_mlp_off(monkeypatch):
    """dense planned the bf16 one-kernel MLP (here on every shape: its measurement forced); int8 with dynamic
    activations quantizes fc2 alone (fc1 keeps its bf16 GELU epilogue): that kernel reads both float
    weights, so the pass plans it off and the MLP runs fc1 then the quantized fc2 as modules."""
    from workbench.optimize.passes import block_forward
    from workbench.optimize.passes.block_plan import block_plans

    w = _dense_with_every_mlp_kernel(monkeypatch)
    monkeypatch.setattr(ql, "gpu_route", lambda d, device: "int_mm")
    w.model, res = apply_pass("quantize_linear", w.model, w.ctx, {"dtype": "int8", "keep": ["head.fc"],
                                                                  "select": "all"})
    assert not any(p.mlp_kernel for p in block_plans(w.model).plans.values())
    mlp = w.model.layers[0].blocks[0].mlp
    assert vars(mlp)["forward"].__func__ is block_forward.mlp_forward_fused and type(mlp.fc2) is QuantLinear
    w.prepare()
    with torch.inference_mode():
        logits, _ = w.forward_loss()
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("faster", ["quantized", "bf16"])
def test_measurement_sees_the_mlps_that_dense_runs_as_one_kernel(monkeypatch, faster):
    """dense planned the bf16 one-kernel MLP on every shape (its measurement forced), and the qkv Linear
    inside the attention kernel: those kernels read the float weights past their modules, so the measured
    selection and the calibration, which hook the modules, take them off for their forwards. Quantized
    faster: the pairs run quantized and no block keeps either kernel. bf16 faster everywhere: nothing is
    quantized, and every block gets both back."""
    from workbench.optimize.passes import _route
    from workbench.optimize.passes.block_plan import block_plans

    w = _dense_with_every_mlp_kernel(monkeypatch)
    plans = block_plans(w.model)        # and the qkv Linear inside the attention kernel everywhere
    for name in list(plans.plans):
        plans.update(name, qkv_kernel=True)
    plans.bind(w.model)
    # the real measurements (their hooks must see every layer's input), then the choices made `faster`
    monkeypatch.setattr(_route, "median_us", lambda call: call() is None or 10.0)
    choice = {"quantized": "quantize", "bf16": "bf16"}[faster]
    for fn in ("measure_layers", "measure_pairs"):
        real = getattr(ql, fn)
        monkeypatch.setattr(ql, fn, lambda *a, real=real, **k: {key: {**r, "choice": choice, "mlp_kernel": False}
                                                                 for key, r in real(*a, **k).items()})
    monkeypatch.setattr(ql, "gpu_route", lambda d, device: "triton")
    monkeypatch.setattr(ql, "attention_triples", lambda model, dtype: {})
    params = {"dtype": "fp8", "activations": "mixed", "keep": ["head.fc"], "calibration_batches": 1,
              "calibration_batch": 2}
    if faster == "quantized":
        w.model, res = apply_pass("quantize_linear", w.model, w.ctx, params)
        assert res.details["mlp_pairs"] == 4 and res.details["bf16_mlp_kernels"] == 0
        assert not any(p.mlp_kernel and not p.mlp_quant for p in block_plans(w.model).plans.values())
        assert not any(p.qkv_kernel for p in block_plans(w.model).plans.values())
    else:
        w.model, res = apply_pass("quantize_linear", w.model, w.ctx, params)     # not available: none left
        assert all(why.startswith("kept bf16") for why in res.details["layers"].values())
        assert all(p.mlp_kernel and p.qkv_kernel for p in block_plans(w.model).plans.values())
