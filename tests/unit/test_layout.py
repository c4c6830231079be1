"""The house's plan, checked: no import circles among the project's modules, and no file past ~600 lines
unless it is one concept (listed here with why)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("recipes", "callbacks", "datamodules")
#: Files allowed past the line budget: each is one concept whose parts would only import each other.
ONE_CONCEPT = {
    "recipes/soak/soak.py": "one chain of faults driven and checked step by step (a state machine)",
    "callbacks/timing.py": "StepTiming, a single callback (copied alone into other projects)",
}
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in (REPO / package).rglob("*.py")}


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports anywhere in its body (inside functions too), by absolute name."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from a.b import c, d`: each name that is a module, else a.b itself (c is a function or a class)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_walk_sees_relative_and_in_function_imports() -> None:
    known = _modules()
    # relative, at the top: callbacks/cost.py imports .analysis.cost_model
    assert "callbacks.analysis.cost_model" in _imports("callbacks.cost", known["callbacks.cost"], known)
    # absolute, inside a function: the bench command line imports the GPU bench only for its subcommand
    assert "recipes.bench.gpu" in _imports("recipes.bench.cli", known["recipes.bench.cli"], known)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_walk_sees_every_module_of_one_from_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from pkg import a, b, helper\n")
    known = {"pkg": tmp_path, "pkg.a": tmp_path, "pkg.b": tmp_path, "pkg.m": module}
    assert _imports("pkg.m", module, known) == {"pkg.a", "pkg.b", "pkg"}  # helper is a name in pkg itself


def test_no_import_circles() -> None:
    known = _modules()
    graph = {name: _imports(name, path, known) for name, path in known.items()}
    # a package's __init__ that only documents its modules imports nothing: edges to it are not circles
    assert _cycles(graph) == []


def test_no_file_past_the_line_budget_unless_one_concept() -> None:
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in _modules().values()}
    assert {f for f, n in sizes.items() if n > MAX_LINES} <= set(ONE_CONCEPT), sorted(
        (n, f) for f, n in sizes.items() if n > MAX_LINES)
    assert all(sizes[f] > MAX_LINES for f in ONE_CONCEPT), "a listed file is back under the budget: unlist it"
