"""The house's plan, checked: no import circles among the project's modules, and no file past ~600 lines
unless it is one concept (listed here with why)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

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
    assert "recipes.bench.gpu" in _imports("recipes.bench.subcommands", known["recipes.bench.subcommands"], known)
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


# --- Private internals of libraries: reached only from the two compat modules ----------------------------------------

#: The modules that hold every coupling to a library's private internal (docs/development.md, "Layout").
COMPAT = ("callbacks/utils/compat.py", "recipes/run/compat.py", "datamodules/compat.py")
#: Underscored names their library documents as public: (module, name).
DOCUMENTED_PRIVATES = {
    ("os", "_exit"),  # the exit without cleanup, documented in the os module
    ("sys", "_current_frames"),  # each thread's frame, documented in the sys module (a watchdog's stack dump)
}
#: Underscored methods a library documents as public on any object of a kind: a named tuple's.
DOCUMENTED_METHODS = {"_replace", "_asdict", "_make", "_fields", "_field_defaults"}
#: Library classes their library says not to construct directly (a public route builds them).
NOT_CONSTRUCTED = {
    "optuna.Trial": "optuna builds a Trial through Study.ask(); its constructor is not public",
    "optuna.trial.Trial": "optuna builds a Trial through Study.ask(); its constructor is not public",
}
#: Uses left where they are, each with why: (file, the line's code). Keyed by the code, not the line number.
ALLOWED_PRIVATES: dict[tuple[str, str], str] = {
    # a method override stays in its class: recipes/run/compat.py's docstring names it, and
    # tests/unit/recipes/run/test_compat.py checks the signature it relies on
    ("recipes/run/cli.py",
     "def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:"):
        "LightningCLI's one hook with the trainer's config and the config's callbacks together",
    ("recipes/run/cli.py", "trainer = super()._instantiate_trainer(config, callbacks + extra)"):
        "LightningCLI's one hook with the trainer's config and the config's callbacks together",
    # the CPython exit hooks stay in the file users copy alone (docs/development.md, "Layout");
    # tests/unit/recipes/run/test_compat.py fails when they change
    ("recipes/run/shutdown.py", "threading._shutdown()"): "shutdown.py is copied alone",
    ("recipes/run/shutdown.py", "atexit._run_exitfuncs()"): "shutdown.py is copied alone",
}


_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def _code(line: str) -> str:
    """A line's code, less its indent and its trailing comment."""
    return line.split("  #")[0].strip()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _aliases(tree: ast.AST, package: str) -> dict[str, str]:
    """Each name a module binds by an import (anywhere in it), to the absolute dotted name it stands for."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                names[alias.asname or alias.name] = f"{base}.{alias.name}"
    return names


def _ours(dotted: str) -> bool:
    return dotted.split(".")[0] in (*PACKAGES, "tests", "__future__")


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The absolute dotted name an expression stands for through the module's imports (``dist.barrier`` ->
    ``torch.distributed.barrier``), or None (a local, an argument, a call's result)."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, aliases)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _resolve(dotted: str) -> Any:
    """The object a library's dotted name stands for (importing its module), or None."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj
    return None


def _library_privates(cls: type) -> set[str]:
    """The private names a library class and its bases define or set on ``self``: what a subclass must not touch."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object or _ours(klass.__module__):
            continue
        names.update(n for n in vars(klass) if _private(n))
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        names.update(n for n in re.findall(r"\bself\.(_\w+)", source) if _private(n))
    return names


class _Project:
    """The project's modules parsed once: their import aliases, classes, and the private names they define."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.trees = {rel: ast.parse(path.read_text()) for rel, path in files.items()}
        self.aliases = {rel: _aliases(tree, _package(rel)) for rel, tree in self.trees.items()}
        self.classes = {f"{_module_of(rel)}.{node.name}": (rel, node) for rel, tree in self.trees.items()
                        for node in tree.body if isinstance(node, ast.ClassDef)}
        self.defined: set[str] = set()  # every private name the project defines (a function, a field, a variable)
        for tree in self.trees.values():
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    self.defined.add(node.name)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    self.defined.add(node.id)
                elif isinstance(node, ast.arg):
                    self.defined.add(node.arg)
        self._cache: dict[str, set[str]] = {}
        for rel, tree in self.trees.items():  # a field a project class sets on itself, less its library base's
            for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
                inherited = self.inherited(rel, cls)
                self.defined.update(node.attr for node in ast.walk(cls)
                                    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                                    and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                                    and node.attr not in inherited)

    def inherited(self, rel: str, cls: ast.ClassDef) -> set[str]:
        """The private names ``cls`` inherits from library classes, through its project bases too."""
        key = f"{rel}:{cls.name}"
        if key not in self._cache:
            self._cache[key] = set()
            names: set[str] = set()
            module = _module_of(rel)
            for base in cls.bases:
                dotted = _dotted(base, self.aliases[rel])
                if dotted is None and isinstance(base, ast.Name):
                    dotted = f"{module}.{base.id}"  # a class of this module
                if dotted is None:
                    continue
                if _ours(dotted):
                    if dotted in self.classes:
                        names |= self.inherited(*self.classes[dotted])
                    continue
                obj = _resolve(dotted)
                if isinstance(obj, type):
                    names |= _library_privates(obj)
            self._cache[key] = names
        return self._cache[key]


def _package(rel: str) -> str:
    name = _module_of(rel)
    return name if rel.endswith("__init__.py") else name.rpartition(".")[0]


def _module_of(rel: str) -> str:
    parts = Path(rel).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _private_uses(rel: str, project: _Project) -> list[tuple[int, str]]:
    """Each use in file ``rel`` of a library's private internal: (line, what)."""
    tree, aliases = project.trees[rel], project.aliases[rel]
    libraries = {name.split(".")[0] for names in project.aliases.values() for name in names.values()
                 if not _ours(name)}
    found: list[tuple[int, str]] = []

    def attribute(line: int, owner: ast.AST, name: str, cls: tuple[str, ast.ClassDef] | None, how: str) -> None:
        if not _private(name):
            return
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls") and cls is not None:
            if name in project.inherited(*cls):
                found.append((line, f"{how}{owner.id}.{name}: {cls[1].name}'s library base's private"))
            return
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
            if cls is not None and name in project.inherited(*cls):
                found.append((line, f"{how}super().{name}: {cls[1].name}'s library base's private"))
            return
        dotted = _dotted(owner, aliases)
        if dotted is not None:
            if not _ours(dotted) and (dotted, name) not in DOCUMENTED_PRIVATES:
                found.append((line, f"{how}{dotted}.{name}"))
            return
        if name not in project.defined and name not in DOCUMENTED_METHODS:
            found.append((line, f"{how}<object>.{name}"))

    def key(line: int, name: str) -> None:
        """A private key of a library's state (a dict it returns): a name the project does not define."""
        if _private(name) and name not in project.defined:
            found.append((line, f"key {name!r}"))

    def visit(node: ast.AST, cls: tuple[str, ast.ClassDef] | None) -> None:
        if isinstance(node, ast.ClassDef):
            cls = (rel, node)
            inherited = project.inherited(rel, node)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(item.name) \
                        and item.name in inherited:
                    found.append((item.lineno, f"overrides {node.name}.{item.name}: its library base's private"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if any(_private(part) for part in alias.name.split(".")):
                    found.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and not node.level and not _ours(node.module or ""):
            module = node.module or ""
            if any(_private(part) for part in module.split(".")):
                found.append((node.lineno, f"from {module} import ..."))
            for alias in node.names:
                if _private(alias.name) and (module, alias.name) not in DOCUMENTED_PRIVATES:
                    found.append((node.lineno, f"from {module} import {alias.name}"))
        elif isinstance(node, ast.Attribute):
            attribute(node.lineno, node.value, node.attr, cls, "")
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                and isinstance(node.slice.value, str):
            key(node.lineno, node.slice.value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _DOTTED.fullmatch(node.value) \
                and node.value.split(".")[0] in libraries and any(_private(p) for p in node.value.split(".")):
            found.append((node.lineno, f"names {node.value!r}"))  # a logger's or a module's name
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("getattr", "hasattr", "setattr", "delattr") \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                    and isinstance(node.args[1].value, str):
                attribute(node.lineno, node.args[0], node.args[1].value, cls, f"{func.id}: ")
            if isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault") and node.args \
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                key(node.lineno, node.args[0].value)
            dotted = _dotted(func, aliases)
            if dotted in NOT_CONSTRUCTED:
                found.append((node.lineno, f"constructs {dotted}: {NOT_CONSTRUCTED[dotted]}"))
        for child in ast.iter_child_nodes(node):
            visit(child, cls)

    visit(tree, None)
    return sorted(set(found))


def _project() -> _Project:
    return _Project({str(p.relative_to(REPO)): p for p in _modules().values()})


def private_internals(project: _Project | None = None) -> list[str]:
    """Every use of a library's private internal outside the compat modules, as ``file:line: what``, less the
    allowed ones."""
    project = project or _project()
    found = []
    for rel in sorted(project.trees):
        if rel in COMPAT:
            continue
        lines = (REPO / rel).read_text().splitlines()
        for line, what in _private_uses(rel, project):
            if (rel, _code(lines[line - 1])) not in ALLOWED_PRIVATES:
                found.append(f"{rel}:{line}: {what}")
    return found


_EACH_KIND = '''
import os
import threading
import mlflow
import optuna
import torch.distributed as dist
from torch._dynamo import config
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import RichProgressBar

from .helpers import _own


class Bar(RichProgressBar):
    def __init__(self) -> None:
        super().__init__()
        self._drawn = 0

    def _get_train_description(self, current_epoch):
        return super()._get_train_description(current_epoch)

    def on_train_start(self, trainer, pl_module):
        self._leave = False
        self._drawn += 1
        trainer._logger_connector.log_metrics({})
        getattr(trainer, "_logger_connector")
        trainer.state_dict()["_snapshot"]
        threading._shutdown()
        dist._register_comm_hook
        _own()._drawn
        "mlflow.tracking._tracking_service.client"
        optuna.Trial(None, 0)
        os._exit(0)
'''


def test_the_private_check_sees_each_kind(tmp_path: Path) -> None:
    (tmp_path / "callbacks").mkdir()
    module = tmp_path / "callbacks" / "bar.py"
    module.write_text(_EACH_KIND)
    project = _Project({"callbacks/bar.py": module})
    found = {line: what for line, what in _private_uses("callbacks/bar.py", project)}
    lines = _EACH_KIND.splitlines()
    assert {lines[line - 1].strip(): what.split(":")[0] for line, what in found.items()} == {
        "from torch._dynamo import config": "from torch._dynamo import ...",
        "from lightning.fabric.utilities.types import _PATH": "from lightning.fabric.utilities.types import _PATH",
        "def _get_train_description(self, current_epoch):": "overrides Bar._get_train_description",
        "return super()._get_train_description(current_epoch)": "super()._get_train_description",
        "self._leave = False": "self._leave",
        "trainer._logger_connector.log_metrics({})": "<object>._logger_connector",
        'getattr(trainer, "_logger_connector")': "getattr",
        'trainer.state_dict()["_snapshot"]': "key '_snapshot'",
        "threading._shutdown()": "threading._shutdown",
        "dist._register_comm_hook": "torch.distributed._register_comm_hook",
        '"mlflow.tracking._tracking_service.client"': "names 'mlflow.tracking._tracking_service.client'",
        "optuna.Trial(None, 0)": "constructs optuna.Trial",
    }  # not: the class's own self._drawn, a project helper's _own()._drawn, os._exit (documented)


def test_no_private_internals_of_libraries_outside_the_compat_modules() -> None:
    found = private_internals()
    assert found == [], "a library's private internal outside callbacks/utils/compat.py and recipes/run/compat.py " \
        "(move it there with a test that fails on upgrade, or use a public route):\n" + "\n".join(found)


# --- Import direction: the rules docs/development.md's "Layout" section states -----------------------------------

#: (who, what it must not import, what of that it may still import, the layout's words). Each is a module or a
#: package (itself and every module under it); imports inside functions count.
MUST_NOT_IMPORT: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("callbacks", "recipes", (), "imports are one-way: callbacks import neither recipes nor datamodules"),
    ("callbacks", "datamodules", (), "imports are one-way: callbacks import neither recipes nor datamodules"),
    ("datamodules", "recipes", (), "imports are one-way: datamodules import neither recipes nor callbacks"),
    ("datamodules", "callbacks", (), "imports are one-way: datamodules import neither recipes nor callbacks"),
    ("callbacks.analysis", "callbacks", ("callbacks.analysis",), "analysis/ imports nothing of ours but itself"),
    ("callbacks.utils", "callbacks", ("callbacks.utils", "callbacks.storage", "callbacks.analysis"),
     "imports point down and inward: what the callbacks share never imports a callback"),
    ("callbacks.storage", "callbacks", ("callbacks.utils", "callbacks.storage", "callbacks.analysis"),
     "imports point down and inward: what the callbacks share never imports a callback"),
    ("recipes.run.common", "torch", (), "common.py: no torch or Lightning (the tools that do not train)"),
    ("recipes.run.common", "lightning", (), "common.py: no torch or Lightning (the tools that do not train)"),
    ("recipes.bench.stats", "torch", (), "bench/stats: paired bootstrap, verdicts; no torch"),
    ("recipes.run.shutdown", "recipes", (), "shutdown.py is copied alone (torch and the standard library)"),
    ("recipes.run.shutdown", "callbacks", (), "shutdown.py is copied alone (torch and the standard library)"),
)
#: Modules nothing imports back, but the one that runs them: module -> its runner.
NOT_IMPORTED_BACK = {
    "recipes.bench.subcommands": ("recipes.bench.__main__",
                                  "bench/subcommands: options and dispatch; nothing imports it back"),
}
#: Modules that stay free of torch and Lightning when imported, with everything they import at import time (their
#: packages' __init__ and the project modules they import at the top, transitively).
#: ``package.*`` names each module under the package.
TORCH_FREE_AT_IMPORT: dict[str, str] = {
    "recipes": "`import recipes` stays torch-free (recipes/api.py)",
    "recipes.run.common": "the tools that do not train import neither torch nor Lightning",
    # at import: comm_model's measure_allreduce imports torch inside itself, to time a real all-reduce
    "callbacks.analysis.*": "analysis/: pure math, no torch or Lightning",
}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _all_imports(name: str, path: Path, top_level: bool) -> set[str]:
    """Every module ``name`` imports, by absolute name (the project's and the libraries'); ``top_level``: only what
    runs at import time (not inside a function, not under ``if TYPE_CHECKING:``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if top_level and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if top_level and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base != "__future__":
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)  # a module or a name in base
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def _direction_breaks(known: dict[str, Path]) -> list[str]:
    """Each import against :data:`MUST_NOT_IMPORT` or :data:`NOT_IMPORTED_BACK`, as ``file imports x: why``."""
    breaks = []
    for name, path in sorted(known.items()):
        imported = _all_imports(name, path, top_level=False)
        rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
        for who, what, allowed, why in MUST_NOT_IMPORT:
            if _under(name, who):
                breaks += [f"{rel} imports {t}: {why}" for t in sorted(imported)
                           if _under(t, what) and not any(_under(t, a) for a in allowed)]
        for module, (runner, why) in NOT_IMPORTED_BACK.items():
            if module in imported and name not in (module, runner):
                breaks.append(f"{rel} imports {module}: {why}")
    return breaks


def _imported_at_import(name: str, known: dict[str, Path]) -> dict[str, set[str]]:
    """Each project module importing ``name`` loads (its packages too), with the libraries it imports at the top."""
    seen: dict[str, set[str]] = {}
    todo = [name]
    while todo:
        current = todo.pop()
        if current in seen or current not in known:
            continue
        imported = _all_imports(current, known[current], top_level=True)
        seen[current] = {t for t in imported if not _ours(t)}
        parents = [".".join(current.split(".")[:i]) for i in range(1, current.count(".") + 1)]
        todo += [t for t in imported if t in known] + parents
    return seen


def test_imports_go_the_way_the_layout_says() -> None:
    assert _direction_breaks(_modules()) == []


def test_the_direction_check_sees_a_break_inside_a_function(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from recipes.bench import subcommands\n    from .. import spot\n")
    assert sorted(_direction_breaks({"callbacks.analysis.bad": bad, "recipes.bench.fit": bad})) == sorted([
        "bad.py imports callbacks.spot: analysis/ imports nothing of ours but itself",
        "bad.py imports callbacks: analysis/ imports nothing of ours but itself",
        "bad.py imports recipes.bench: imports are one-way: callbacks import neither recipes nor datamodules",
        "bad.py imports recipes.bench.subcommands: imports are one-way: callbacks import neither recipes nor "
        "datamodules",
        "bad.py imports recipes.bench.subcommands: bench/subcommands: options and dispatch; nothing imports it back",
        "bad.py imports recipes.bench.subcommands: bench/subcommands: options and dispatch; nothing imports it back",
    ])
    heavy = tmp_path / "heavy.py"
    heavy.write_text("from typing import TYPE_CHECKING\nimport numpy\nif TYPE_CHECKING:\n    import torch\n"
                     "def f():\n    import lightning\nfrom . import light\n")
    light = tmp_path / "light.py"
    light.write_text("import torch.nn\n")
    assert _imported_at_import("callbacks.heavy", {"callbacks.heavy": heavy, "callbacks.light": light}) == {
        "callbacks.heavy": {"typing", "typing.TYPE_CHECKING", "numpy"}, "callbacks.light": {"torch.nn"}}


def test_torch_free_modules_load_neither_torch_nor_lightning() -> None:
    known = _modules()
    for prefix, why in TORCH_FREE_AT_IMPORT.items():
        names = [m for m in known if _under(m, prefix[:-2])] if prefix.endswith(".*") else [prefix]
        for name in sorted(names):
            loaded = _imported_at_import(name, known)
            heavy = {module: sorted(t for t in libs if t.split(".")[0] in ("torch", "lightning"))
                     for module, libs in loaded.items()}
            assert not {m: t for m, t in heavy.items() if t}, f"importing {name} loads them: {why}"
