"""Recipes: staged optimizations as data. A recipe is one YAML file in `recipes/` (or a user's own file):

    name: apex                       # what --recipe / --stages and every table call it
    extends: amp                     # the stage before it (a built-in name, or a path to another YAML
                                     # relative to this file), or null for the baseline
    description: one line
    peer: false                      # true: not on the main chain, shown next to it (torch-compile)
    gate: {bf16: {grad_rel: 0.2}}    # optional: correctness-gate tolerances per precision, merged over
                                     # the ones it extends (keys: logits_rel, loss_atol, grad_rel; and
                                     # accuracy_drop, top1_agreement for a checkpoint's held-out images)
    passes: [fused_layernorm, {name: fused_adamw, params: {impl: torch}}]

A stage's effective passes are its chain's passes, baseline first. Everything a user can get wrong
here is a one-line UserError when the recipe is loaded, before anything is measured: unknown recipe or
pass, a cycle in `extends`, malformed or oversized YAML (read through `files.load_yaml_file`), a name
that cannot be part of a file name, pass parameters that the pass's `apply` does not take or whose
type or value its `PARAMS` does not allow, a gate tolerance that is not a finite number >= 0.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench import SOURCE_ROOT
from workbench.errors import UserError
from workbench.files import load_yaml_file, short_repr
from workbench.optimize.passes import PASS_MODULES, get_pass, uses_swinbench_kernels
from workbench.precision import PRECISIONS

RECIPE_DIR = SOURCE_ROOT / "recipes"
GATE_KEYS = ("logits_rel", "loss_atol", "grad_rel")
# optional: gated only where a checkpoint's held-out images were run (apply --checkpoint; gate.py)
HELDOUT_GATE_KEYS = ("accuracy_drop", "top1_agreement")
_TOP_KEYS = {"name", "extends", "description", "peer", "gate", "passes"}
# A stage's name goes into its record's, log's and profile folder's file names
# (`<out>/logs/NN-<name>.traceback.txt`, a temporary `.NN-<name>.json.XXXXXXXX.tmp`): short enough for
# any file system's 255-byte limit with those around it.
MAX_NAME_BYTES = 100


class RecipeUnavailable(UserError):
    """A pass of the recipe cannot run here (no GPU for its kernels, no CUDA for graphs): `recipe` its name,
    `reason` the pass and why. Raised by optimize_swin, optimize_swin_inference and patch_swin."""

    def __init__(self, recipe: str, reason: str, patched: bool = True):
        super().__init__(f"recipe {recipe!r} cannot run here: pass {reason}"
                         + (" (the model may be partly patched; build it again for another recipe)" if patched
                            else " (the model is unchanged)"))
        self.recipe, self.reason = recipe, reason


@dataclass(frozen=True)
class PassSpec:
    """One pass as a recipe lists it: its registry name and keyword parameters for its `apply`."""

    name: str
    params: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"name": self.name, "params": dict(self.params)}


@dataclass
class Recipe:
    """One stage. `passes` and `gate` are what this file itself says; the chain adds the rest.
    `source` is the YAML file it came from; `builtin` says whether that is one of `recipes/*.yaml`."""

    name: str
    extends: str | None
    description: str
    passes: list[PassSpec]
    gate: dict[str, dict[str, float]]
    peer: bool
    source: Path
    builtin: bool
    parent_key: str | None = None   # how `extends` was resolved: a built-in name or a resolved file path

    @property
    def user_source(self) -> str | None:
        """The file to hand to another process for a user's recipe (None for a built-in: its name is enough)."""
        return None if self.builtin else str(self.source)


# ---------------------------------------------------------------- loading and validation


def _fail(source: Path, msg: str) -> UserError:
    return UserError(f"recipe {source}: {msg}")


def _as_float(value, source: Path, where: str) -> float:
    # YAML 1.1 reads `1e-4` (no dot) as a string; accept it rather than make users learn that.
    if isinstance(value, bool):
        raise _fail(source, f"{where} must be a number, got {short_repr(value)}")
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):
        raise _fail(source, f"{where} must be a number, got {short_repr(value)}") from None
    # inf or NaN would make a gate that cannot fail
    if not (math.isfinite(out) and out >= 0):
        raise _fail(source, f"{where} must be a finite number >= 0, got {short_repr(value)}")
    return out


def _check_name(name, source: Path) -> str:
    """A recipe's name names the stage in tables, --stages lists and the file names of its record, log
    and profile: letters, digits and . _ + - only, at most MAX_NAME_BYTES bytes of UTF-8."""
    if not isinstance(name, str) or not name:
        raise _fail(source, f"name must be a non-empty string, got {short_repr(name)}")
    bad = next((c for c in name if not (c.isalnum() or c in "._+-")), None)
    if bad is not None:
        raise _fail(source, f"name {short_repr(name)} holds {short_repr(bad)}: a recipe name is part of file "
                            "names and --stages lists, so it takes letters, digits and . _ + - only")
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise _fail(source, f"name {short_repr(name)} is longer than {MAX_NAME_BYTES} bytes (it is part of "
                            "file names)")
    return name


def _parse_pass(item, source: Path, i: int) -> PassSpec:
    if isinstance(item, str):
        name, params = item, {}
    elif isinstance(item, dict):
        extra = set(item) - {"name", "params"}
        if extra or "name" not in item:
            raise _fail(source, f"passes[{i}] must be a pass name or {{name: ..., params: {{...}}}}, "
                                f"got {short_repr(item)}")
        name, params = item["name"], item.get("params") or {}
        if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
            raise _fail(source, f"passes[{i}].params must be a mapping, got {short_repr(params)}")
    else:
        raise _fail(source, f"passes[{i}] must be a pass name or a mapping, got {short_repr(item)}")
    if not isinstance(name, str) or name not in PASS_MODULES:
        raise _fail(source, f"unknown pass {short_repr(name)}: known passes are {', '.join(sorted(PASS_MODULES))}")
    _check_params(name, params, source)
    return PassSpec(name, dict(params))


def _type_names(types: tuple) -> str:
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string", dict: "a mapping",
             list: "a list", type(None): "null"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _check_value(name: str, key: str, value, spec, source: Path) -> None:
    """One parameter against its declared (types, allowed): allowed is None, a tuple of values, or a
    function that raises UserError for a value it refuses."""
    types, allowed = spec
    types = types if isinstance(types, tuple) else (types,)
    # YAML reads `yes` as true: a bool passes only where bool is declared, an int where a float is
    ok = any(type(value) is t or (t is float and type(value) is int) for t in types)
    if not ok:
        raise _fail(source, f"pass {name!r}: parameter {short_repr(key)} must be {_type_names(types)}, "
                            f"got {short_repr(value)}")
    if allowed is None or value is None:
        return
    if callable(allowed):
        try:
            allowed(value)
        except UserError as exc:
            raise _fail(source, str(exc)) from None
    elif value not in allowed:
        raise _fail(source, f"pass {name!r}: parameter {short_repr(key)} must be one of "
                            f"{', '.join(map(str, allowed))}, got {short_repr(value)}")


def _check_params(name: str, params: dict, source: Path) -> None:
    """Check a pass's parameters before anything runs: the names against its `apply` signature (or its
    declared PARAMS when `apply` takes **kwargs), the values against PARAMS' types and allowed values.
    A pass that cannot be imported here (no Triton) is checked when it runs, and reported as unavailable
    then."""
    try:
        module = get_pass(name)
    except ImportError:
        return
    declared = getattr(module, "PARAMS", None)
    sig = inspect.signature(module.apply)
    if declared is not None:
        known = list(declared)
    elif any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return
    else:
        known = list(sig.parameters)[2:]
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise _fail(source, f"pass {name!r} takes no parameter {', '.join(map(short_repr, unknown))} "
                            f"(it takes: {', '.join(known) or 'none'})")
    for key, value in params.items():
        if declared is not None:
            _check_value(name, key, value, declared[key], source)
    together = getattr(module, "check_params", None)     # what the parameters must be together
    if together is not None:
        try:
            together(dict(params))
        except UserError as exc:
            raise _fail(source, str(exc)) from None


def _parse_gate(raw, source: Path) -> dict[str, dict[str, float]]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _fail(source, f"gate must map a precision to tolerances, got {short_repr(raw)}")
    out = {}
    for prec, tol in raw.items():
        if prec not in PRECISIONS:
            raise _fail(source, f"gate: unknown precision {short_repr(prec)} (choose from {', '.join(PRECISIONS)})")
        if not isinstance(tol, dict):
            raise _fail(source, f"gate.{prec} must map {', '.join(GATE_KEYS)} to numbers, got {short_repr(tol)}")
        bad = sorted(set(tol) - set(GATE_KEYS) - set(HELDOUT_GATE_KEYS), key=str)
        if bad:
            raise _fail(source, f"gate.{prec}: unknown key {short_repr(bad[0])} "
                                f"(keys: {', '.join(GATE_KEYS + HELDOUT_GATE_KEYS)})")
        out[prec] = {k: _as_float(v, source, f"gate.{prec}.{k}") for k, v in tol.items()}
        if out[prec].get("top1_agreement", 0.0) > 1:
            raise _fail(source, f"gate.{prec}.top1_agreement must be a share from 0 to 1, got "
                                f"{short_repr(tol['top1_agreement'])}")
    return out


def load_recipe_file(path: Path, *, builtin: bool = False) -> Recipe:
    """Parse and validate one YAML file -> Recipe (its own passes; `extends` not followed yet)."""
    path = Path(path)
    raw = load_yaml_file(path, "recipe")
    if not isinstance(raw, dict):
        raise _fail(path, "must be a YAML mapping with name, extends, description and passes")
    unknown = sorted((k for k in raw if k not in _TOP_KEYS), key=str)
    if unknown:
        raise _fail(path, f"unknown key {short_repr(unknown[0])} (keys: {', '.join(sorted(_TOP_KEYS))})")
    name = _check_name(raw.get("name"), path)
    extends = raw.get("extends")
    if extends is not None and not isinstance(extends, str):
        raise _fail(path, f"extends must be a recipe name, a YAML path or null, got {short_repr(extends)}")
    description = raw.get("description", "")
    if not isinstance(description, str):
        raise _fail(path, f"description must be a string, got {short_repr(description)}")
    peer = raw.get("peer", False)
    if not isinstance(peer, bool):
        raise _fail(path, f"peer must be true or false, got {short_repr(peer)}")
    passes = raw.get("passes") or []
    if not isinstance(passes, list):
        raise _fail(path, f"passes must be a list, got {short_repr(passes)}")
    return Recipe(name=name, extends=extends, description=description.strip(),
                  passes=[_parse_pass(p, path, i) for i, p in enumerate(passes)],
                  gate=_parse_gate(raw.get("gate"), path), peer=peer, source=path.resolve(), builtin=builtin)


def _builtin_recipes() -> dict[str, Recipe]:
    found = {}
    for f in sorted(RECIPE_DIR.glob("*.yaml")):
        r = load_recipe_file(f, builtin=True)
        if r.name in found:
            raise _fail(f, f"recipe name {r.name!r} is also used by {found[r.name].source}")
        found[r.name] = r
    return found


def _is_path(ref: str) -> bool:
    return ref.endswith((".yaml", ".yml")) or "/" in ref or "\\" in ref


class RecipeBook:
    """The built-in recipes plus any user files loaded through it; resolves names, paths and chains."""

    def __init__(self):
        self.builtins = _builtin_recipes()
        self.by_key: dict[str, Recipe] = dict(self.builtins)   # built-in name or resolved file path
        self.user_by_name: dict[str, Recipe] = {}
        # a built-in named by its file's path (recipes/amp.yaml) is that built-in
        self.builtin_files = {str(Path(r.source).resolve()): name for name, r in self.builtins.items() if r.source}

    def known(self) -> str:
        return ", ".join(r.name for r in ordered(self.builtins.values(), self))

    def load(self, ref: str, base: Path | None = None) -> tuple[str, Recipe]:
        """A name or a YAML path (relative to `base`, the file that names it) -> (key, Recipe)."""
        if not _is_path(ref):
            if ref in self.by_key:
                return ref, self.by_key[ref]
            if ref in self.user_by_name:
                r = self.user_by_name[ref]
                return str(r.source), r
            where = f" (in {base})" if base else ""
            raise UserError(f"unknown recipe {short_repr(ref)}{where}: known recipes are {self.known()} "
                            "(or give a path to a .yaml file)")
        path = Path(ref).expanduser()
        if base is not None and not path.is_absolute():
            path = base.parent / path
        if not path.is_file():
            where = f" (extends in {base})" if base else ""
            raise UserError(f"no such recipe file: {short_repr(str(path), 200)}{where}")
        key = str(path.resolve())
        if key in self.builtin_files:
            name = self.builtin_files[key]
            return name, self.builtins[name]
        if key not in self.by_key:
            r = load_recipe_file(path)
            if r.name in self.builtins:
                raise _fail(path, f"name {r.name!r} is a built-in recipe; give your recipe its own name")
            other = self.user_by_name.get(r.name)
            if other is not None and other.source != r.source:
                raise _fail(path, f"name {r.name!r} is also used by {other.source}")
            self.by_key[key] = r
            self.user_by_name[r.name] = r
        return key, self.by_key[key]

    def chain(self, ref: str) -> list[Recipe]:
        """The recipes from the baseline to `ref`, baseline first. UserError on a cycle."""
        key, recipe = self.load(ref)
        seen = [key]
        out = [recipe]
        while recipe.extends is not None:
            key, parent = self.load(recipe.extends, base=recipe.source)
            recipe.parent_key = key
            if key in seen:
                names = " -> ".join([self.by_key[k].name for k in seen] + [parent.name])
                raise UserError(f"cycle in recipe extends: {names}")
            seen.append(key)
            out.append(parent)
            recipe = parent
        chain = out[::-1]
        _refuse_a_pass_twice(chain)
        return chain


def _refuse_a_pass_twice(chain: list[Recipe]) -> None:
    """A pass runs once per chain: given again (to change its parameters, say) it would find the model
    already patched and change nothing while its result said otherwise. UserError naming both recipes."""
    first: dict[str, Recipe] = {}
    for r in chain:
        for spec in r.passes:
            if spec.name in first:
                owner = first[spec.name]
                where = "twice in it" if owner is r else f"in its chain already (recipe {owner.name!r})"
                parent = next((c.name for c, n in zip(chain, chain[1:]) if n is owner), None)
                hint = (f"; for other parameters, extend {parent!r} instead and list the passes {owner.name!r} "
                        f"adds, {spec.name} with yours" if owner is not r and parent else "")
                raise UserError(f"recipe {chain[-1].name!r}: pass {spec.name!r} is {where}: a pass runs once "
                                f"per chain{hint}")
            first[spec.name] = r


def ordered(recipes, book: RecipeBook) -> list[Recipe]:
    """Main-chain recipes first (by depth), then peers (by depth), names breaking ties."""
    return sorted(recipes, key=lambda r: (r.peer, len(book.chain(str(r.source) if not r.builtin else r.name)),
                                          r.name))


# ---------------------------------------------------------------- the functions callers use


def resolve_chain(name_or_path: str) -> list[Recipe]:
    """A recipe name or YAML path -> the chain of recipes from the baseline to it, baseline first."""
    return RecipeBook().chain(str(name_or_path))


def effective_passes(chain: list[Recipe]) -> list[PassSpec]:
    """Every pass of the chain, in order (baseline's first)."""
    return [p for r in chain for p in r.passes]


def apply_chain_passes(model, ctx, chain: list[Recipe], stop_unavailable: bool = False) -> tuple[Any, list]:
    """Apply every pass of a resolved recipe chain, the baseline's first, to `model` with `ctx` -> (the model
    as the last pass returns it, the passes' PassResults in order). A pass that is not available here
    leaves the model as it was and says so in its result (`passes.apply_pass`); with `stop_unavailable` no
    pass after it runs (the results end with it), so a recipe refused for it changes no more of the
    model than the passes before it did."""
    from workbench.optimize.passes import apply_pass

    results = []
    for p in effective_passes(chain):
        model, result = apply_pass(p.name, model, ctx, p.params)
        results.append(result)
        if stop_unavailable and not result.available:
            break
    return model, results


def chain_passes(name_or_path: str) -> list[tuple[str, dict]]:
    """(pass name, params) for every pass from the baseline to this recipe (`swinbench profile` resolves a
    recipe with it before capturing)."""
    return [(p.name, dict(p.params)) for p in effective_passes(resolve_chain(name_or_path))]


def is_pytorch_alone(chain: list[Recipe]) -> bool:
    """Whether the chain runs none of swinbench's own kernels: what a user gets from PyTorch alone."""
    return not any(uses_swinbench_kernels(p.name) for p in effective_passes(chain))


# passes that quantize the GEMMs -> their dtype parameter's default
QUANTIZING_PASSES = {"quantize_linear": "fp8", "torchao_quantize": "fp8"}


def quantized_dtypes(chain: list[Recipe]) -> set[str]:
    """The dtypes (fp8, int8) the chain quantizes its GEMMs to; empty for a chain that does not."""
    return {p.params.get("dtype", QUANTIZING_PASSES[p.name]) for p in effective_passes(chain)
            if p.name in QUANTIZING_PASSES}


def is_graph_form(recipe: Recipe) -> bool:
    """Whether the recipe replays its step as CUDA graphs: a cuda_graph pass, or compile in a mode that
    replays Inductor's own (reduce-overhead, max-autotune, triton.cudagraphs). `apply` measures the graph
    form of every stage in its graph column already, and FSDP runs none of them."""
    return any(p.name == "cuda_graph" or _compiles_own_graphs(p) for p in recipe.passes)


def replays_inductor_graphs(chain: list[Recipe]) -> bool:
    """Whether the chain compiles its step in a mode that replays Inductor's own CUDA graphs (reduce-overhead,
    max-autotune, triton.cudagraphs): swinbench runs such a step under neither DDP nor FSDP."""
    return any(_compiles_own_graphs(p) for p in effective_passes(chain))


def _compiles_own_graphs(spec: PassSpec) -> bool:
    """A compile pass whose settings replay Inductor's own CUDA graphs (passes.compile.replays_own_graphs)."""
    from workbench.optimize.passes.compile import replays_own_graphs

    return spec.name == "compile" and replays_own_graphs({"mode": spec.params.get("mode"),
                                                          "options": spec.params.get("inductor")})


def inference_only_pass(chain: list[Recipe]) -> str | None:
    """The first pass of the chain that runs inference only (no backward: the quantized Linears), or None."""
    from workbench.optimize.passes import inference_only

    return next((p.name for p in effective_passes(chain) if inference_only(p.name)), None)


def graph_recipes() -> dict[str, str]:
    """{stage: the built-in recipe that only replays that stage's step as one CUDA graph}: fmha ->
    fmha-graph, dense -> dense-graph, block -> block-graph, fmha-compile -> fmha-compile-graph and
    torch-compile -> torch-compile-graph (compiled in default mode, captured like an eager step; Inductor's
    own graphs, reduce-overhead, are another stage)."""
    return {r.extends: r.name for r in RecipeBook().builtins.values()
            if r.extends and r.passes and all(p.name == "cuda_graph" for p in r.passes)}


def gate_tolerance(chain: list[Recipe], precision: str) -> dict[str, float]:
    """The gate tolerances for a stage that runs in `precision`: each recipe's values over its parent's."""
    tol: dict[str, float] = {}
    for r in chain:
        tol.update(r.gate.get(precision, {}))
    missing = [k for k in GATE_KEYS if k not in tol]
    if missing:
        raise UserError(f"recipe {chain[-1].name!r}: no gate tolerance {', '.join(missing)} for precision "
                        f"{precision!r} in its chain (add gate.{precision} to it or to the baseline)")
    return tol


def list_recipes() -> list[Recipe]:
    """The built-in recipes: the main chain in order, then the peers."""
    book = RecipeBook()
    return ordered(book.builtins.values(), book)


@dataclass
class StagePlan:
    """One stage to run: its recipe and its chain (baseline first)."""

    recipe: Recipe
    chain: list[Recipe]

    @property
    def name(self) -> str:
        return self.recipe.name

    @property
    def extends(self) -> str | None:
        return self.chain[-2].name if len(self.chain) > 1 else None


def plan_stages(recipe: str, stages: list[str] | None = None, peers: bool = False) -> list[StagePlan]:
    """The stages `swinbench apply` runs, in order.

    Default: the chain from the baseline to `recipe` (for a peer like fmha-compile, the whole chain to
    it). `peers=True` adds, after the chain, the built-in PyTorch-alone peers (no swinbench kernel) that
    extend a stage of it, except graph forms (`is_graph_form`: each stage's graph-replayed form is
    measured in its own graph column), and quantized peers only where the chain quantizes to the same
    dtype: for fmha, torch-sdpa and torch-compile; for fp8, torchao-fp8 too. `stages` picks stages explicitly, by name (a
    built-in, a recipe of `recipe`'s file chain) or YAML path, in the order given.
    """
    book = RecipeBook()
    main = book.chain(str(recipe))
    if stages:
        names = [s.strip() for s in stages if s.strip()]
        if not names:
            raise UserError("--stages is empty: give stage names separated by commas")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise UserError(f"--stages names {short_repr(dup[0])} twice")
        plans = [StagePlan(book.chain(n)[-1], book.chain(n)) for n in names]
        resolved = [str(p.recipe.source) if not p.recipe.builtin else p.recipe.name for p in plans]
        dup = sorted({n for n, r in zip(names, resolved) if resolved.count(r) > 1})
        if dup:
            raise UserError(f"--stages names one recipe twice ({', '.join(map(short_repr, dup))})")
    else:
        plans = [StagePlan(r, main[: i + 1]) for i, r in enumerate(main)]
        if peers:
            in_chain = {r.name for r in main}
            candidates = ordered([r for r in book.builtins.values() if r.peer and not is_graph_form(r)], book)
            # eager peers before compiled ones: the table climbs to the strongest
            candidates.sort(key=lambda r: any(p.name == "compile" for p in effective_passes(book.chain(r.name))))
            quantized = quantized_dtypes(main)
            for peer in candidates:
                if (peer.name not in in_chain and peer.extends in in_chain
                        and is_pytorch_alone(book.chain(peer.name))
                        and quantized_dtypes(book.chain(peer.name)) <= quantized):
                    plans.append(StagePlan(peer, book.chain(peer.name)))
    for plan in plans:    # a chain without the gate's tolerances would fail only when its stage runs
        autocast = {str(p.params.get("dtype", "bf16")) for p in effective_passes(plan.chain) if p.name == "amp"}
        for precision in autocast or {"fp32"}:
            gate_tolerance(plan.chain, precision)
    return plans


def render_recipes(console) -> None:
    """`swinbench recipes`: a table of the built-in recipes, what each extends and the passes it adds."""
    from rich.table import Table

    table = Table(title="swinbench recipes (main chain, then peers)", title_justify="left")
    for col in ("recipe", "extends", "adds passes", "description"):
        table.add_column(col)
    for r in list_recipes():
        adds = ", ".join(p.name + (f"({', '.join(f'{k}={v}' for k, v in p.params.items())})" if p.params else "")
                         for p in r.passes) or "-"
        table.add_row(r.name + (" (peer)" if r.peer else ""), r.extends or "-", adds, r.description)
    console.print(table)
    console.print("Run one: swinbench apply --recipe NAME (or a path to your own YAML that extends one of these).")


def as_jsonable(chain: list[Recipe]) -> list[dict[str, Any]]:
    """The chain as plain dicts for records: name, source, own passes."""
    return [{"name": r.name, "source": None if r.builtin else str(r.source),
             "passes": [p.to_dict() for p in r.passes]} for r in chain]
