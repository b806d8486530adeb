"""The `fmha-compile` stack on the tiny Swin: fused_layernorm (triton), fused_window and fused_attention
applied, then torch.compile (aot_eager: Dynamo + AOTAutograd, no Inductor codegen; on a GPU Inductor too).
On the CPU the Triton kernels are opaque custom ops (tracing into Triton's interpreter is not possible);
on a GPU they are triton_ops that AOTAutograd traces into. Logits and every parameter gradient must match the
eager patched model and the unpatched timm model in fp32."""
import copy
import os
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from workbench.optimize.passes import apply_pass  # noqa: E402
from pass_helpers import model_pair, pass_ctx, rel_err, tiny_batch, train_step  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PASSES = (("fused_layernorm", {"impl": "triton"}), ("fused_window", None), ("fused_attention", None))
# block: under torch.compile each block runs the forward it had before fused_block (whose kernels are
# custom ops there); the eager model it is compared with runs the one-Function blocks.
STACKS = {"attn": (("fused_attention", None),), "fmha": PASSES,
          "fmha-gather": PASSES[:2] + (("fused_attention", {"bias": "gather"}),),
          "dense": PASSES + (("fused_linear", None),),
          "block": PASSES + (("fused_linear", None), ("fused_block", None))}
RTOL_FP32 = 1e-4  # relative (norm) error, fp32


# On a GPU also Inductor, which traces into the kernels' triton_ops and launches them from its own code.
BACKENDS = ["aot_eager"] + (["inductor"] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stack", sorted(STACKS))
def test_compiled_fused_passes_match_eager_and_timm_in_fp32(stack, backend):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # No stochastic depth: DropPath draws its per-sample masks differently under aot_eager than in eager
    # (the unpatched timm model's sample 0 already differs by ~10% with the default rate).
    plain, patched = model_pair(DEVICE, drop_path_rate=0.0)
    ctx = pass_ctx(DEVICE)
    for name, params in STACKS[stack]:
        patched, result = apply_pass(name, patched, ctx, params)
        assert result.available, f"{name}: {result.changed}"
    compiled_src = copy.deepcopy(patched)
    compiled = torch.compile(compiled_src, backend=backend)

    images, labels = tiny_batch(plain, 2, DEVICE)
    plain_logits, plain_grads = train_step(plain, images, labels)
    eager_logits, eager_grads = train_step(patched, images, labels)
    torch._dynamo.utils.warn_once_cache.clear()   # Dynamo warns once per message and process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled_logits, compiled_grads = train_step(compiled, images, labels)
    # The kernels' launch-configuration helpers are not traced through an lru_cache (Dynamo warns on
    # every compiled run where they are).
    assert not [str(w.message) for w in caught if "lru_cache" in str(w.message)]

    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    note = f"graph breaks: {sum(breaks.values())} {breaks}"
    assert rel_err(compiled_logits, eager_logits) < RTOL_FP32, note
    assert rel_err(compiled_logits, plain_logits) < RTOL_FP32, note
    assert compiled_grads.keys() == plain_grads.keys() == eager_grads.keys()
    for name in plain_grads:
        for ref_name, ref in (("eager patched", eager_grads), ("timm", plain_grads)):
            err = rel_err(compiled_grads[name], ref[name])
            assert err < RTOL_FP32, f"{name} vs {ref_name}: relative gradient error {err:.2e}; {note}"
    # Graph breaks are reported, not required to be zero; print them for `pytest -s`.
    print(note)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="Inductor traces into triton_ops on a GPU only")
def test_traced_attention_writes_its_outputs_in_place():
    """Under Inductor the attention kernels must write their outputs straight into the buffers the graph
    hands on: a launch whose mutated arguments are views of a fresh buffer (the permuted output, the three
    gradients in the packed qkv buffer) gets functionalized into clones of the views and copies back, five
    extra full-size copy kernels per block's backward, 4.3 ms per Swin-B step on the H200. Generated
    code with pointwise permute/unbind/clone kernels around our kernels means that is back."""
    import re

    from torch._inductor.utils import run_and_get_code

    from workbench.kernels.window_attention import fused_window_attention_qkv

    torch._dynamo.reset()
    g = torch.Generator(device=DEVICE).manual_seed(7)
    bnw, n, nh, d, nw = 12, 49, 3, 32, 4
    qkv = torch.randn(bnw, n, 3, nh, d, device=DEVICE, generator=g).bfloat16().requires_grad_()
    bias = torch.randn(nh, n, n, device=DEVICE, generator=g).requires_grad_()
    mask = torch.randn(nw, n, n, device=DEVICE, generator=g)

    def step(qkv, bias):
        out = fused_window_attention_qkv(qkv, bias, mask)
        out.float().square().sum().backward()

    _, codes = run_and_get_code(torch.compile(step, backend="inductor"), qkv, bias)
    generated = set(re.findall(r"def (triton_\w+)\(", "\n".join(codes)))
    # Pointwise kernels made of layout ops only are the copies; the loss's reductions read the output
    # through its permuted view and carry `permute` in their names legitimately.
    copies = sorted(k for k in generated if re.match(r"triton_poi_\w*(permute|unbind|clone)", k)
                    or re.search(r"unbind|clone", k))
    assert not copies, f"copy kernels around the traced attention: {copies}"


# ----------------------------------------------- the compile pass's fused_window: the fused chain compiled

# fmha-compile with the compile pass's fused_window. A recipe extending fmha-compile could not give the
# compile pass again (a pass runs once per chain), so it extends fmha and lists compile with the option.
FUSED_WINDOW_RECIPE = """name: fmha-compile-fused-window
extends: fmha
peer: true
description: the fmha stage under torch.compile, the fused window chain kept
passes:
  - name: compile
    params: {mode: default, fused_window: true}
"""
CHAIN_KERNEL, TIMM_MERGE_KERNEL = "_merge_norm_fwd_kernel", "_merge_fwd_kernel"


def _workload_grads(workload):
    """(logits, loss, {name: grad}) of one forward + backward of the workload's step function (compiled where
    the stage compiles), from cleared gradients."""
    workload.model.zero_grad(set_to_none=True)
    logits, loss = workload.forward_loss()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in workload.model.named_parameters() if p.grad is not None}
    return logits.detach().float(), loss.detach().float(), grads


@pytest.fixture(scope="module")
def fused_window_stage(tmp_path_factory):
    """The tiny Swin (batch 2, fp32) under the recipe above, compiled once for every test below: its first
    compiled forward + backward with its launches, the graph breaks, and the eager fmha stage's step."""
    from types import SimpleNamespace

    from workbench.kernels._common import launch_log
    from workbench.ladder.interleave import build_stage_workload
    from workbench.models import TINY_MODEL
    from workbench.optimize.workload import WorkloadConfig

    recipe = tmp_path_factory.mktemp("recipes") / "fmha-compile-fused-window.yaml"
    recipe.write_text(FUSED_WINDOW_RECIPE)
    config = WorkloadConfig(model=TINY_MODEL, batch=2, device=DEVICE.type, precision="fp32")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled, results = build_stage_workload(config, str(recipe))
    with launch_log() as log:
        got = _workload_grads(compiled)
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    eager, _ = build_stage_workload(config, "fmha")
    return SimpleNamespace(workload=compiled, results=results, log=log, got=got, breaks=breaks,
                           want=_workload_grads(eager))


def test_a_compiled_stage_with_fused_window_keeps_the_chain_and_matches_the_eager_stage(fused_window_stage):
    """With the compile pass's fused_window the compiled blocks run merge_add_norm (and the deferred MLP adds
    in add_norm_shift_partition) as operators: one graph, no break; on the CPU the compiled graph calls the
    host functions back, so the log shows the merge-add-norm kernel and no plain merge. Logits, loss and
    every gradient match the eager fmha stage's on the same seed."""
    stage = fused_window_stage
    compile_result = next(r for r in stage.results if r.name == "compile")
    assert compile_result.params["fused_window"] is True
    assert not stage.breaks, f"graph breaks: {stage.breaks}"
    if DEVICE.type == "cpu":   # on a GPU Inductor launches the kernels: the eager-step test below sees them
        names = {e["kernel"] for e in stage.log}
        assert CHAIN_KERNEL in names and TIMM_MERGE_KERNEL not in names, sorted(names)
    (logits, loss, grads), (logits_ref, loss_ref, grads_ref) = stage.got, stage.want
    assert rel_err(logits, logits_ref) < RTOL_FP32 and rel_err(loss, loss_ref) < RTOL_FP32
    assert grads.keys() == grads_ref.keys()
    for name, g in grads_ref.items():
        assert rel_err(grads[name], g) < RTOL_FP32, name


def test_with_fused_window_the_eager_step_launches_what_the_compiled_step_launches(fused_window_stage):
    """The forced-eager step (`as_compiled`) takes the fused chain as the compiled step does, and launches
    the same kernels with the same bytes in the same order (see tests/test_floors.py,
    test_the_eager_step_launches_what_the_compiled_step_launches, for fmha-compile)."""
    from workbench.kernels._common import launch_log

    workload = fused_window_stage.workload
    with launch_log() as eager:
        workload.eager_step()
    names = {e["kernel"] for e in eager}
    assert CHAIN_KERNEL in names and TIMM_MERGE_KERNEL not in names, sorted(names)
    if DEVICE.type == "cuda":
        pytest.skip("on a GPU Inductor launches the compiled step's kernels: the launch log does not see them")
    workload.step(0)
    with launch_log() as compiled:
        workload.step(1)
    assert compiled, "the compiled step's launches were not seen"
    assert [(e["kernel"], e["bytes"]) for e in eager] == [(e["kernel"], e["bytes"]) for e in compiled]


@pytest.mark.parametrize("fused_window", [False, True])
def test_fused_window_binds_the_chain_for_compile_whichever_pass_runs_first(fused_window):
    """The compile pass runs first here, before the passes that plan the blocks: the setting is the model's
    block plans', and every bind hands it on. A step with torch.compile's branches taken (`as_compiled`, no
    compile) then runs the fused chain with the option, timm's stage and merge without it, each matching
    the eager model, stochastic depth on (the factors drawn with timm's calls in the same order)."""
    from workbench.kernels._common import as_compiled, launch_log
    from workbench.optimize.passes.block_plan import block_plans

    _, model = model_pair(DEVICE, drop_path_rate=0.3)
    model.train()
    ctx = pass_ctx(DEVICE)
    model, _ = apply_pass("compile", model, ctx, {"fused_window": fused_window})
    for name, params in PASSES:
        model, result = apply_pass(name, model, ctx, params)
        assert result.available, f"{name}: {result.changed}"
    assert block_plans(model).window_under_compile is fused_window
    images, labels = tiny_batch(model, 3, DEVICE)
    want_logits, want_grads = train_step(model, images, labels, rng_seed=5)
    with as_compiled(), launch_log() as log:
        logits, grads = train_step(model, images, labels, rng_seed=5)
    names = {e["kernel"] for e in log}
    assert (CHAIN_KERNEL in names) is fused_window and (TIMM_MERGE_KERNEL in names) is not fused_window
    assert rel_err(logits, want_logits) < RTOL_FP32
    for name, g in want_grads.items():
        assert rel_err(grads[name], g) < RTOL_FP32, name
