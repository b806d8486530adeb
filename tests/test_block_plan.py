"""Block plans (workbench/optimize/passes/block_plan.py): every order of a recipe's block passes gives the same plans
and binds the same forwards, and every plan the block passes produce computes timm's block, forward and
backward, on the tiny Swin's shifted block. Without a GPU the kernels run in Triton's interpreter
(TRITON_INTERPRET=1, set before triton is imported)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import copy  # noqa: E402
import inspect  # noqa: E402
import itertools  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from workbench.optimize.passes import apply_pass  # noqa: E402
from workbench.optimize.passes._swin import INVERSE_BUFFER  # noqa: E402
from workbench.optimize.passes.block_plan import BlockPlan, block_plans  # noqa: E402
from pass_helpers import model_pair, pass_ctx, rel_err  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RECIPES = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))
# The passes that set fields of a block's plan, with the parameters the recipes give them.
BLOCK_PASSES = {"sdpa_attention": {}, "fused_layernorm": {"impl": "triton"}, "fused_window": {},
                "fused_attention": {}, "fused_linear": {}, "fused_block": {}}
SHIFTED_BLOCK = "layers.0.blocks.1"   # the tiny Swin's 14x14 stage, window 7, shift 3: mask and roll both


@pytest.fixture(scope="module")
def tiny_pair():
    return model_pair(DEVICE, drop_path_rate=0.0)


def _planned(base, passes):
    model = copy.deepcopy(base)
    ctx = pass_ctx(DEVICE)
    for name, params in passes:
        model, result = apply_pass(name, model, ctx, params)
        assert result.available, f"{name}: {result.changed}"
    return model


def _same_function(f, g) -> bool:
    """f and g are the same code over equal values: their code objects, and their closures' contents
    compared the same way (functions) or by ==."""
    if f is g:
        return True
    if not (inspect.isfunction(f) and inspect.isfunction(g)) or f.__code__ is not g.__code__:
        return False
    cells = lambda h: [c.cell_contents for c in h.__closure__ or ()]  # noqa: E731
    return all(_same_function(a, b) if inspect.isfunction(a) else a == b for a, b in zip(cells(f), cells(g)))


def _bound(model) -> dict:
    """What binding gave the model: every instance forward (its function), timm's fused_attn switch, and
    which attention modules carry the index's inverse."""
    out = {}
    for name, m in model.named_modules():
        if "forward" in vars(m):
            out[(name, "forward")] = vars(m)["forward"].__func__
        if "fused_attn" in vars(m):
            out[(name, "fused_attn")] = m.fused_attn
        if INVERSE_BUFFER in m._buffers:
            out[(name, INVERSE_BUFFER)] = True
    return out


def _recipe_block_passes(recipe: str) -> tuple[tuple[str, dict], ...]:
    from workbench.optimize.recipes import effective_passes, resolve_chain

    return tuple((p.name, {**BLOCK_PASSES[p.name], **p.params}) for p in effective_passes(resolve_chain(recipe))
                 if p.name in BLOCK_PASSES)


def _distinct_block_passes() -> dict[str, tuple]:
    """The recipes' block passes, each distinct list once, named by the recipes that have it."""
    by_passes: dict[str, list] = {}
    for recipe in RECIPES:
        by_passes.setdefault(repr(_recipe_block_passes(recipe)), []).append(recipe)
    return {"+".join(names): _recipe_block_passes(names[0]) for names in by_passes.values()}


@pytest.mark.parametrize("passes", list(_distinct_block_passes().values()), ids=list(_distinct_block_passes()))
def test_every_order_of_a_recipe_s_block_passes_gives_the_same_plans_and_forwards(passes, tiny_pair):
    base, _ = tiny_pair
    first = None
    for order in itertools.permutations(passes):
        model = _planned(base, order)
        plans, bound = dict(block_plans(model).plans), _bound(model)
        if first is None:
            first = plans, bound
            continue
        assert plans == first[0], [name for name, _ in order]
        assert bound.keys() == first[1].keys(), [name for name, _ in order]
        for key, value in bound.items():
            assert _same_function(value, first[1][key]) if inspect.isfunction(value) else value == first[1][key], key
    if passes:
        assert first[0][SHIFTED_BLOCK] != BlockPlan()


def test_bind_puts_back_what_it_replaced(tiny_pair):
    """Unbinding restores timm's forwards and switches and drops the inverse buffers; binding again gives
    the same forwards; a deep copy carries its plans and forwards bound to its own modules."""
    base, _ = tiny_pair
    model = _planned(base, [(n, BLOCK_PASSES[n]) for n in BLOCK_PASSES])
    plans = block_plans(model)
    bound = _bound(model)
    plans.unbind(model)
    assert _bound(model) == _bound(base)
    plans.bind(model)
    assert all(_same_function(v, bound[k]) if inspect.isfunction(v) else v == bound[k] for k, v in _bound(model).items())
    copied = copy.deepcopy(model)
    blk = copied.get_submodule(SHIFTED_BLOCK)
    assert block_plans(copied).plans == plans.plans and blk.forward.__self__ is blk


def _subsets():
    """Every set of block passes without fused_block, fused_block alone and on top of all of them, and
    timm's SDPA alone and under fused_attention."""
    kernel_passes = ["fused_layernorm", "fused_window", "fused_attention", "fused_linear"]
    sets = [list(c) for r in range(len(kernel_passes) + 1) for c in itertools.combinations(kernel_passes, r)]
    return sets + [["fused_block"], kernel_passes + ["fused_block"], ["sdpa_attention"],
                   ["sdpa_attention", "fused_attention"]]


def _block_step(blk, x, autocast):
    """The block's output and the gradients of x and of every block parameter, fp32, for a fixed
    random upstream gradient."""
    x = x.clone().requires_grad_(True)
    blk.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
        out = blk(x)
    g = torch.Generator().manual_seed(7)
    out.float().backward(torch.randn(out.shape, generator=g).to(DEVICE))
    grads = {"x": x.grad.float()}
    grads.update({n: p.grad.float() for n, p in blk.named_parameters()})
    return out.detach().float(), grads


@pytest.mark.parametrize("passes", _subsets(), ids=lambda s: "+".join(s) or "none")
def test_each_plan_computes_timm_s_block(passes, tiny_pair):
    """The shifted block as its plan runs it against timm's: fp32 to 1e-4 in relative norm (output, the
    input's and every parameter's gradient); under bf16 autocast, held to timm's fp32 result, at least as
    close as timm's own bf16 block (plus a little)."""
    base, ref = tiny_pair
    model = _planned(base, [(n, BLOCK_PASSES[n]) for n in passes])
    blk, ref_blk = model.get_submodule(SHIFTED_BLOCK), ref.get_submodule(SHIFTED_BLOCK)
    for b in (blk, ref_blk):
        b.train()
    g = torch.Generator().manual_seed(3)
    x = torch.randn((1, 14, 14, blk.dim), generator=g).to(DEVICE)
    truth, truth_grads = _block_step(ref_blk, x, autocast=False)
    out, grads = _block_step(blk, x, autocast=False)
    assert rel_err(out, truth) < 1e-4
    assert grads.keys() == truth_grads.keys()
    for name, want in truth_grads.items():
        assert rel_err(grads[name], want) < 1e-4, name
    plain, plain_grads = _block_step(ref_blk, x, autocast=True)
    out, grads = _block_step(blk, x, autocast=True)
    assert rel_err(out, truth) <= 1.5 * rel_err(plain, truth) + 1e-2
    for name, want in truth_grads.items():
        pe, fe = rel_err(plain_grads[name], want), rel_err(grads[name], want)
        assert fe <= 1.5 * pe + 2e-2, (name, fe, pe)
