"""A recipe is refused when it is loaded, before anything is measured: hostile YAML, names that cannot
be file names, pass parameters of the wrong type or value, and gate tolerances that cannot fail."""
import inspect
import time
from pathlib import Path

import pytest

from workbench.errors import UserError
from workbench.optimize.passes import PASS_MODULES, get_pass
from workbench.optimize.recipes import MAX_NAME_BYTES, chain_passes, gate_tolerance, plan_stages, resolve_chain


def write(tmp_path: Path, text: str | bytes, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return p


def refused(path: Path) -> str:
    with pytest.raises(UserError) as exc:
        plan_stages(str(path))
    msg = str(exc.value)
    assert "\n" not in msg and len(msg) < 600, msg
    return msg


# Nine levels of ten aliases: 10**9 values from a few hundred bytes. `description` must be a string, so
# an unbounded reader would quote the whole expansion in its error.
ALIAS_BOMB = ("name: bomb\nextends: amp\npasses: ["
              + ", ".join(["&a0 [x, x, x, x, x, x, x, x, x, x]"]
                          + [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)])
              + "]\ndescription: *a8\n")


def test_alias_bomb_is_refused_quickly(tmp_path):
    t0 = time.perf_counter()
    msg = refused(write(tmp_path, ALIAS_BOMB))
    assert time.perf_counter() - t0 < 2
    assert "recipe" in msg and ("aliases" in msg or "expands" in msg)


def test_non_utf8_recipe_is_one_line(tmp_path):
    msg = refused(write(tmp_path, b"name: caf\xe9\nextends: amp\n"))
    assert "not UTF-8" in msg


@pytest.mark.parametrize("yaml_name, why", [
    ("x" * (MAX_NAME_BYTES + 1), "longer than"),
    ("é" * (MAX_NAME_BYTES // 2 + 1), "longer than"),       # counted in bytes: each is two in UTF-8
    ("a/b", "holds '/'"),
    (r"a\\b", r"holds '\\'"),     # YAML "a\\b": one backslash
    ("a,b", "holds ','"),
    (r"a\0b", r"holds '\x00'"),
    (r"a\x01b", r"holds '\x01'"),
    (r"a\nb", r"holds '\n'"),
    (r"a\ud800b", r"holds '\ud800'"),     # a lone surrogate cannot be written to a file name
    (" amp2", "holds ' '"),
    ("a[/x]b", "holds '['"),      # rich markup in a name would be read as markup in the progress lines
])
def test_unsafe_or_long_names_are_refused_at_load(tmp_path, yaml_name, why):
    msg = refused(write(tmp_path, f'name: "{yaml_name}"\nextends: amp\n'))
    assert why in msg


def test_longest_allowed_name_loads(tmp_path):
    p = write(tmp_path, f"name: {'x' * MAX_NAME_BYTES}\nextends: amp\n")
    assert [s.name for s in plan_stages(str(p))][-1] == "x" * MAX_NAME_BYTES


@pytest.mark.parametrize("passes, why", [
    ("[{name: amp, params: {dtype: fp32}}]", "must be one of bf16, fp16"),
    ("[{name: amp, params: {dtype: 16}}]", "must be a string"),
    ("[{name: fused_adamw, params: {impl: fast}}]", "must be one of auto, apex, torch"),
    ("[{name: fused_layernorm, params: {colour: red}}]", "takes no parameter 'colour'"),
    ("[{name: fused_layernorm, params: {fuse_residual: 'yes'}}]", "must be true/false"),
    ("[{name: fused_layernorm, params: {impl: [triton]}}]", "must be a string"),
    ("[{name: fused_attention, params: {bias: none}}]", "must be one of auto, table, gather"),
    ("[{name: compile, params: {fullgraph: 1}}]", "must be true/false"),
    ("[{name: compile, params: {mode: fast}}]", "must be one of default"),
    ("[{name: compile, params: {dynamic: maybe}}]", "must be true/false or null"),
    ("[{name: compile, params: {fused_window: 'yes'}}]", "must be true/false"),
    ("[{name: compile, params: {inductor: {no_such_setting: 1}}}]", "not an Inductor config setting"),
    # what torch.compile's options refuse is refused at load, not when the stage runs after the others
    ("[{name: compile, params: {inductor: {cpp_wrapper: 'yes'}}}]", "'cpp_wrapper' must be true/false, got 'yes'"),
    ("[{name: compile, params: {inductor: {triton.cudagraphs: 1}}}]", "'triton.cudagraphs' must be true/false"),
    ("[{name: compile, params: {inductor: {triton: 1}}}]", "'triton' is not an Inductor config setting"),
    ("[{name: compile, params: {inductor: {save_config: 1}}}]", "'save_config' is not an Inductor config setting"),
    ("[{name: cuda_graph, params: {replays: 3}}]", "takes no parameter 'replays'"),
    ("[{name: amp, params: {dtype: [" + ", ".join(["bf16"] * 500) + "]}}]", "must be a string"),
])
def test_pass_parameters_are_checked_at_load(tmp_path, passes, why):
    msg = refused(write(tmp_path, f"name: x\nextends: baseline\npasses: {passes}\n"))
    assert why in msg


def test_good_parameters_load(tmp_path):
    p = write(tmp_path, "name: x\nextends: baseline\npasses: [{name: amp, params: {dtype: fp16}}, "
                        "{name: compile, params: {mode: default, dynamic: null, fullgraph: true, "
                        "inductor: {cpp_wrapper: true, triton.cudagraphs: false, cpp-wrapper: true}}}, "
                        "{name: fused_layernorm, params: {impl: torch, fuse_residual: false}}]\n")
    assert [n for n, _ in chain_passes(str(p))] == ["amp", "compile", "fused_layernorm"]


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "-0.1", "lots", "true", "[0.1]", "1e999"])
def test_gate_tolerance_that_cannot_fail_is_refused(tmp_path, value):
    msg = refused(write(tmp_path, f"name: x\nextends: amp\ngate: {{bf16: {{grad_rel: {value}}}}}\n"))
    assert "gate.bf16.grad_rel must be a" in msg


def test_gate_tolerance_in_yaml11_exponent_form_loads(tmp_path):
    chain = resolve_chain(str(write(tmp_path, "name: x\nextends: amp\ngate: {bf16: {grad_rel: 1e-4}}\n")))
    assert gate_tolerance(chain, "bf16")["grad_rel"] == 1e-4


def test_every_pass_declares_the_parameters_its_apply_takes():
    """PARAMS (name -> (types, allowed)) is what a recipe is checked against; it must name exactly the
    keyword parameters of `apply`, and each default must pass its own spec."""
    for name in PASS_MODULES:
        try:
            module = get_pass(name)
        except ImportError:
            continue
        sig = inspect.signature(module.apply)
        keywords = {k: p for k, p in list(sig.parameters.items())[2:] if p.kind is not p.VAR_KEYWORD}
        declared = getattr(module, "PARAMS", None)
        if not keywords:
            assert not declared, name
            continue
        assert declared is not None and set(declared) == set(keywords), name
        for key, spec in declared.items():
            types = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
            default = keywords[key].default
            assert type(default) in types, (name, key)
            if isinstance(spec[1], tuple):
                assert default in spec[1], (name, key)


@pytest.mark.parametrize("text, needle", [
    # a pass given again to change its parameters would find the model patched and change nothing
    ("name: fa16\nextends: fmha\npasses:\n  - {name: fused_attention, params: {max_tokens: 16}}\n",
     "pass 'fused_attention' is in its chain already (recipe 'fmha')"),
    ("name: d\nextends: baseline\npasses: [sdpa_attention, sdpa_attention]\n", "'sdpa_attention' is twice in it"),
    ("name: d\nextends: amp\npasses: [amp]\n", "pass 'amp' is in its chain already"),
    # values wrong alone or together: refused at load, not after earlier stages were measured
    ("name: m\nextends: window\npasses:\n  - {name: fused_attention, params: {max_tokens: 1000}}\n",
     "max_tokens must be a whole number from 1 to 256"),
    ("name: m\nextends: window\npasses:\n  - {name: fused_attention, params: {max_tokens: 0}}\n",
     "max_tokens must be a whole number from 1 to 256"),
    ("name: c\nextends: amp\npasses:\n  - {name: compile, params: {backend: nosuchbackend}}\n",
     "unknown backend 'nosuchbackend'"),
    ("name: c\nextends: amp\npasses:\n  - {name: compile, params: {mode: max-autotune, inductor: {cpp_wrapper: true}}}\n",
     "inductor options need mode default"),
    ("name: c\nextends: amp\npasses:\n  - {name: compile, params: {backend: eager, inductor: {cpp_wrapper: true}}}\n",
     "inductor options need backend inductor"),
    # quantize_linear settings that would be dropped without a word
    ("name: q\nextends: fmha\npasses:\n  - {name: quantize_linear, params: {dtype: int8, calibration: max}}\n",
     "calibration sets the calibration of static activations"),
    ("name: q\nextends: fmha\npasses:\n  - {name: quantize_linear, params: {dtype: int8, activations: static, "
     "calibration: max, percentile: 50.0}}\n", "percentile goes with calibration: percentile"),
    ("name: q\nextends: fmha\npasses:\n  - {name: quantize_linear, params: {dtype: int8, simulate: true, "
     "gemm: triton}}\n", "gemm chooses among the real quantized GEMMs"),
    # a chain of its own (no extends) without the gate's tolerances
    ("name: root\npasses: [sdpa_attention]\n", "no gate tolerance"),
])
def test_a_recipe_that_cannot_run_as_written_is_refused_at_load(tmp_path, text, needle):
    assert needle in refused(write(tmp_path, text))


def test_a_builtin_named_by_its_file_is_that_builtin(tmp_path):
    builtin = Path(__file__).parents[1] / "recipes" / "amp.yaml"
    assert [r.name for r in resolve_chain(str(builtin))] == ["baseline", "amp"]
    mine = write(tmp_path, f"name: mine\nextends: {builtin}\npasses: [sdpa_attention]\n")
    assert [r.name for r in resolve_chain(str(mine))] == ["baseline", "amp", "mine"]


def test_stages_naming_one_recipe_twice_are_refused(tmp_path):
    mine = write(tmp_path, "name: mine\nextends: amp\npasses: [sdpa_attention]\n")
    with pytest.raises(UserError, match="names one recipe twice"):
        plan_stages("amp", [str(mine), f"{tmp_path}/./r.yaml"])


def test_a_missing_extends_file_names_the_recipe_that_extends_it(tmp_path):
    write(tmp_path, "name: mid\nextends: nofile.yaml\n", "mid.yaml")
    top = write(tmp_path, "name: top\nextends: mid.yaml\n", "top.yaml")
    msg = refused(top)
    assert f"no such recipe file: '{tmp_path / 'nofile.yaml'}' (extends in {tmp_path / 'mid.yaml'})" in msg
