"""The package's layers import downward only: no module imports one of a higher layer, and no two
modules import each other in a loop (imports inside functions count too)."""
import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "workbench"

# bottom to top; a module may import its own layer and those below it. The kernels are the ground
# floor (torch and Triton only); the base modules stamp records with how the kernels launch.
LAYERS = {
    "kernels": 0,
    "base": 1,       # errors, files, run_folder, env, labels, precision, models, the package itself
    "trace": 2,
    "analysis": 3,
    "results": 4,
    "optimize": 5,
    "capture": 6,
    "ladder": 7,
    "api": 8,        # workbench/api.py: the public Python API, re-exported from the layers below
    "train": 9,      # `swinbench train`: a training loop on real data, built on the public API
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else "base"


def imports_of(path: Path) -> set[str]:
    """The workbench modules `path` imports, anywhere in it."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("workbench")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.startswith("workbench"):
                found.add(base)
                found |= {f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}")}
    return found


def _is_module(name: str) -> bool:
    path = PACKAGE.parent / Path(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


@functools.lru_cache(maxsize=None)
def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: {i for i in imports_of(p) if i in modules and i != m} for m, p in modules.items()}


def test_every_subpackage_has_a_layer():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders <= set(LAYERS), folders - set(LAYERS)


@pytest.mark.parametrize("module", sorted(graph()))
def test_imports_go_down(module):
    up = [i for i in graph()[module]
          if LAYERS[layer(i)] > LAYERS[layer(module)] and not module.startswith(i + ".")]
    assert not up, f"{module} ({layer(module)}) imports a higher layer: {up}"


def test_no_import_circles():
    edges = {m: {i for i in deps if not m.startswith(i + ".")} for m, deps in graph().items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
