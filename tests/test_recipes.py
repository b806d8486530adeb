"""Recipe resolution: the built-in chain, user files that extend it, and every user mistake as one line."""
from pathlib import Path

import pytest

from workbench.errors import UserError
from workbench.optimize.recipes import (chain_passes, gate_tolerance, list_recipes, plan_stages, resolve_chain)

CHAIN = ["baseline", "amp", "apex", "window", "fmha"]
PEERS = ["torch-compile", "torch-compile-graphs", "torch-sdpa", "torchao-fp8", "torchao-int8", "torch-compile-graph",
         "fmha-compile", "fmha-compile-graphs", "fmha-graph"]
# what `apply` adds by default: PyTorch-alone peers that are not graph forms, eager before compiled
DEFAULT_PEERS = ["torch-sdpa", "torch-compile"]


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_builtin_chain_order():
    assert [r.name for r in resolve_chain("fmha")] == CHAIN
    assert [r.name for r in resolve_chain("fmha-compile")] == CHAIN + ["fmha-compile"]
    assert [r.name for r in resolve_chain("torch-compile")] == ["baseline", "amp", "torch-compile"]
    assert [r.name for r in resolve_chain("baseline")] == ["baseline"]


def test_list_recipes_main_chain_then_peers():
    recipes = list_recipes()
    assert [r.name for r in recipes] == CHAIN + ["dense", "block", "fp8", "int8"] + PEERS + [
        "dense-graph", "fmha-compile-graph", "block-graph", "fp8-compile", "int8-compile"]
    assert [r.peer for r in recipes] == [False] * 9 + [True] * (len(PEERS) + 5)


def test_pytorch_alone_and_graph_forms():
    from workbench.optimize.recipes import RecipeBook, is_graph_form, is_pytorch_alone

    book = RecipeBook()
    alone = {name for name in book.builtins if is_pytorch_alone(book.chain(name))}
    assert alone == {"baseline", "amp", "torch-sdpa", "torch-compile", "torch-compile-graphs", "torch-compile-graph",
                     "torchao-fp8", "torchao-int8"}
    forms = {name for name, r in book.builtins.items() if is_graph_form(r)}
    assert forms == {"fmha-graph", "dense-graph", "block-graph", "fmha-compile-graph", "torch-compile-graphs",
                     "fmha-compile-graphs", "torch-compile-graph"}


def test_effective_passes_accumulate_in_chain_order():
    assert chain_passes("fmha") == [("amp", {"dtype": "bf16"}), ("fused_layernorm", {}), ("fused_adamw", {}), ("master_weights", {}),
                                    ("fused_window", {}), ("patch_embed", {}), ("fused_attention", {})]
    assert chain_passes("baseline") == []
    assert [n for n, _ in chain_passes("torch-compile")] == ["amp", "sdpa_attention", "fused_adamw", "compile"]


def test_default_stages_peers_and_explicit_stages():
    assert [s.name for s in plan_stages("apex")] == ["baseline", "amp", "apex"]
    assert [s.name for s in plan_stages("dense", peers=True)] == CHAIN + ["dense"] + DEFAULT_PEERS
    assert [s.name for s in plan_stages("fmha-compile")] == CHAIN + ["fmha-compile"]
    assert [s.name for s in plan_stages("fmha", peers=True)] == CHAIN + DEFAULT_PEERS
    # amp's chain reaches amp, which the PyTorch-alone peers extend
    assert [s.name for s in plan_stages("amp", peers=True)] == ["baseline", "amp"] + DEFAULT_PEERS
    assert [s.name for s in plan_stages("baseline", peers=True)] == ["baseline"]
    # quantized peers join a chain that quantizes to their dtype, not a bf16 one
    assert [s.name for s in plan_stages("fp8", peers=True)] == CHAIN + ["dense", "fp8", "torch-sdpa",
                                                                      "torch-compile", "torchao-fp8"]
    assert plan_stages("int8", peers=True)[-1].recipe.name == "torchao-int8"
    plans = plan_stages("fmha", ["baseline", "torch-compile"])
    assert [s.name for s in plans] == ["baseline", "torch-compile"]
    assert plans[1].extends == "amp"


def test_user_file_extends_builtin(tmp_path):
    p = write(tmp_path, "mine.yaml", """
name: mine
extends: amp
description: amp plus SDPA
gate: {bf16: {grad_rel: 0.3}}
passes: [sdpa_attention, {name: compile, params: {mode: max-autotune}}]
""")
    chain = resolve_chain(str(p))
    assert [r.name for r in chain] == ["baseline", "amp", "mine"]
    assert chain[-1].user_source == str(p.resolve())
    assert chain_passes(str(p))[-1] == ("compile", {"mode": "max-autotune"})
    tol = gate_tolerance(chain, "bf16")
    assert tol["grad_rel"] == 0.3 and tol["logits_rel"] == 0.05   # overridden key; inherited key
    assert [s.name for s in plan_stages(str(p))] == ["baseline", "amp", "mine"]
    assert [s.name for s in plan_stages(str(p), ["baseline", "mine"])] == ["baseline", "mine"]


def test_user_file_extends_user_file_by_relative_path(tmp_path):
    write(tmp_path, "a.yaml", "name: a\nextends: amp\npasses: [sdpa_attention]\n")
    b = write(tmp_path, "b.yaml", "name: b\nextends: a.yaml\npasses: [compile]\n")
    assert [r.name for r in resolve_chain(str(b))] == ["baseline", "amp", "a", "b"]


@pytest.mark.parametrize("text, message", [
    ("name: x\nextends: nope\npasses: []\n", "unknown recipe 'nope'"),
    ("name: x\nextends: amp\npasses: [warp_speed]\n", "unknown pass 'warp_speed'"),
    ("name: x\nextends: amp\npasses: [{name: amp, params: {dtype: bf16, colour: red}}]\n", "takes no parameter 'colour'"),
    ("name: x\nextends: amp\npasses: {amp: 1}\n", "passes must be a list"),
    ("name: x\nextends: amp\npasses: [amp\n", "is not valid YAML"),
    ("- just\n- a list\n", "must be a YAML mapping"),
    ("name: [x]\nextends: amp\n", "name must be a non-empty string"),
    ("name: x\nextends: 3\n", "extends must be"),
    ("name: x\nextends: amp\npeer: maybe\n", "peer must be true or false"),
    ("name: x\nextends: amp\ngate: {bf16: {grad_rel: lots}}\n", "gate.bf16.grad_rel must be a number"),
    ("name: x\nextends: amp\ngate: {fp8: {grad_rel: 0.1}}\n", "unknown precision 'fp8'"),
    ("name: x\nextends: amp\ngate: {bf16: {grad_atol: 0.1}}\n", "unknown key 'grad_atol'"),
    ("name: x\nextends: amp\npasess: []\n", "unknown key 'pasess'"),
    ("name: amp\nextends: baseline\n", "is a built-in recipe"),
])
def test_user_mistakes_are_one_line_user_errors(tmp_path, text, message):
    p = write(tmp_path, "bad.yaml", text)
    with pytest.raises(UserError) as exc:
        resolve_chain(str(p))
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_unknown_recipe_lists_known_ones():
    with pytest.raises(UserError, match=r"unknown recipe 'fmah'.*baseline, amp, apex, window, fmha"):
        resolve_chain("fmah")


def test_missing_file_and_cycle(tmp_path):
    with pytest.raises(UserError, match="no such recipe file"):
        resolve_chain(str(tmp_path / "nothere.yaml"))
    write(tmp_path, "a.yaml", "name: a\nextends: b.yaml\n")
    b = write(tmp_path, "b.yaml", "name: b\nextends: a.yaml\n")
    with pytest.raises(UserError, match="cycle in recipe extends: b -> a -> b"):
        resolve_chain(str(b))
    s = write(tmp_path, "self.yaml", "name: s\nextends: self.yaml\n")
    with pytest.raises(UserError, match="cycle"):
        resolve_chain(str(s))


def test_unknown_and_duplicate_stages():
    with pytest.raises(UserError, match="unknown recipe 'ampp'"):
        plan_stages("fmha", ["baseline", "ampp"])
    with pytest.raises(UserError, match="twice"):
        plan_stages("fmha", ["amp", "amp"])


def test_missing_tolerance_for_precision_is_a_user_error(tmp_path):
    chain = resolve_chain("amp")
    chain[0].gate = {}
    with pytest.raises(UserError, match="no gate tolerance"):
        gate_tolerance(chain, "bf16")



@pytest.mark.parametrize("recipe,dtype,logits_rel", [("fp8", "fp8", 0.15), ("int8", "int8", 0.1)])
def test_quantized_recipes_extend_dense_with_their_own_tolerance(recipe, dtype, logits_rel):
    # dense is the best bf16 inference stage: the quantized ones build on it
    chain = resolve_chain(recipe)
    assert [r.name for r in chain] == CHAIN + ["dense", recipe]
    # fp8: each MLP's hidden activation at a calibrated scale, written by fc1's epilogue; int8 per row
    activations = "mixed" if recipe == "fp8" else "dynamic"
    assert chain_passes(recipe)[-1] == ("quantize_linear", {"dtype": dtype, "activations": activations,
                                                             "keep": ["head.fc"]})
    tol = gate_tolerance(chain, "bf16")
    assert tol["logits_rel"] == logits_rel and tol["loss_atol"] == gate_tolerance(resolve_chain("fmha"), "bf16")["loss_atol"]


def test_quantize_linear_parameters_are_checked_when_loaded(tmp_path):
    for params, msg in [("{dtype: int4}", "must be one of fp8, int8"), ("{keep: head.fc}", "must be a list"),
                        ("{keep: [3]}", "keep must be a list of module-name patterns"),
                        ("{percentile: 0}", "percentile must be in"), ("{calibration_batches: 0}", "at least 1"),
                        ("{simulate: 1}", "must be true/false"), ("{bits: 4}", "takes no parameter 'bits'")]:
        p = write(tmp_path, "q.yaml", "name: q\nextends: fmha\ndescription: q\npasses:\n"
                                      f"  - name: quantize_linear\n    params: {params}\n")
        with pytest.raises(UserError, match=msg):
            resolve_chain(str(p))


def test_every_recipe_written_out_in_the_docs_loads(tmp_path):
    # docs/recipes.md's examples are meant to be copied into a file and run: each must load, passes checked
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "recipes.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "passes:" in b and "extends:" in b]
    assert len(blocks) >= 3
    for i, block in enumerate(blocks):
        path = tmp_path / f"doc{i}.yaml"
        path.write_text(block)
        assert resolve_chain(str(path))[-1].passes
