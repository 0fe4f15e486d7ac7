"""The package's shape (docs/ARCHITECTURE.md): layers import only downwards, no import circles between
wings, package ``__init__`` files only re-export, and only ``stages/`` reads the flat-buffer layout.

Imports are read from the source with ``ast`` (every ``import`` statement, also those inside functions),
so nothing is imported and no rank is spawned.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "zero_kernels"

# Each wing's layer: a module may import its own wing and any wing of a lower layer, never a higher one.
LAYERS = {
    "env": 0,
    "log": 0,
    "live": 0,
    "liveness": 0,
    "schedulers": 0,
    "wording": 0,
    "_build": 1,
    "config": 1,
    "kernels": 2,
    "comm": 2,
    "offload": 2,
    "planner": 3,
    "stages": 3,
    "optim": 4,
    "checkpoint": 4,
    "integrations": 5,
    "entry": 6,
    "__main__": 6,
    "_compat": 6,
    "": 7,  # the top-level face
}
# The top level holds only the faces and the bottom layer.
TOP_LEVEL = {"__init__", "__main__", "_compat", "entry", "env", "live", "liveness", "log", "schedulers", "wording"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _runtime_nodes(tree: ast.Module) -> list[ast.stmt]:
    """The import statements run when the module is imported (not those under ``if TYPE_CHECKING``, nor
    those inside functions, which run at a call)."""
    return [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]


def _imports(name: str, path: Path, known: set[str], runtime_only: bool = False) -> set[str]:
    """The package's modules that ``name`` imports (a name imported from a package counts as the package,
    or as its sub-module when it is one); ``runtime_only``: only the imports made at import time."""
    tree = ast.parse(path.read_text())
    nodes = _runtime_nodes(tree) if runtime_only else list(ast.walk(tree))
    is_package = path.name == "__init__.py"
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("zero_kernels"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                here = here[: len(here) - node.level + 1]
                base = ".".join(here + ([node.module] if node.module else []))
            if base.startswith("zero_kernels"):
                found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return {m for m in found if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _wing(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_wing_has_a_layer() -> None:
    assert {_wing(m) for m in _modules()} <= set(LAYERS)


def test_the_top_level_holds_only_faces_and_the_bottom_layer() -> None:
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert top == TOP_LEVEL


def test_no_import_goes_up_a_layer() -> None:
    upward = [
        f"{m} -> {d}"
        for m, deps in _graph().items()
        for d in deps
        if LAYERS[_wing(d)] > LAYERS[_wing(m)] or (LAYERS[_wing(d)] == LAYERS[_wing(m)] and _wing(d) != _wing(m))
    ]
    assert upward == []


def test_no_import_circles_at_import_time() -> None:
    """Between wings there are no circles at all (the layers above); inside a wing a module may name a
    higher one only for type checking or inside a function (run at a call), never at import time."""
    modules = _modules()
    graph = {name: _imports(name, path, set(modules), runtime_only=True) for name, path in modules.items()}
    assert _cycles(graph) == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("init", sorted(p for p in PACKAGE.rglob("__init__.py")), ids=lambda p: _module_name(p))
def test_package_faces_only_re_export(init: Path) -> None:
    """A package ``__init__`` holds a docstring, imports, ``__all__`` and nothing else."""
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
            continue
        if init.parent == PACKAGE and _is_top_level_setup(node):
            continue
        pytest.fail(f"{init.relative_to(PACKAGE.parent)}:{node.lineno} holds code: {ast.unparse(node)[:80]}")


def _is_top_level_setup(node: ast.stmt) -> bool:
    """The top-level face also states the version, sets up the logger and registers the old paths."""
    if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__version__"]:
        return True
    return isinstance(node, ast.Expr) and ast.unparse(node) in ("log.setup(settings().log_level)", "_compat.register()")


def test_only_stages_import_the_layout() -> None:
    layout = {"zero_kernels.stages.layout", "zero_kernels.layout"}  # its place, and its place before stages/
    importers = {m for m, deps in _graph().items() if deps & layout}
    assert {m for m in importers if not m.startswith("zero_kernels.stages")} == set()
