"""docs/reference.md against the code: every ``python -m recipes.X`` command, every ``recipes.bench`` subcommand and
every exit code, no more and no fewer.

What the code has is read from its source (no torch imported): the modules under recipes/ that run as a program (an
``if __name__ == "__main__":`` block), the subparsers ``python -m recipes.bench`` adds, and the exit codes: the
``*_EXIT_CODE`` constants of recipes/, callbacks/ and datamodules/, the codes passed to ``sys.exit``, ``SystemExit``,
``os._exit`` and a launch's ``Launch(code, ...)``, and what a ``main`` returns as a number. What the page has is
read from its text: the commands in backticks and the first column of its exit-code table.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from recipes.run import common

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "docs" / "reference.md"
PACKAGES = ("recipes", "callbacks", "datamodules")
#: The causes of an exit code that the reference must name in that code's row, each with the text in the code
#: that makes it (file, text): a cause gone from the code fails the test too, so the list stays true.
CAUSES: dict[int, dict[str, tuple[str, str]]] = {
    75: {
        "interruption notice": ("callbacks/spot.py", "REQUEUE_EXIT_CODE = 75"),
        "lost peer": ("recipes/run/cli.py", "a peer process was lost"),
        "hang": ("callbacks/utils/watchdog.py", 'f"hang: '),
        "streamed data": ("datamodules/stream_stops.py", "UNAVAILABLE_EXIT_CODE = 75"),
    },
    65: {"damaged": ("datamodules/verified_chunks.py", "DAMAGED_EXIT_CODE = 65")},
    74: {"chunk cache": ("datamodules/verified_chunks.py", "LOCAL_FAULT_EXIT_CODE = 74")},
    130: {"Ctrl-C": ("recipes/run/common.py", "SIGINT_EXIT_CODE = 130")},
    2: {"bad input": ("recipes/run/common.py", "USAGE_EXIT_CODE = 2")},
    1: {"failure during training": ("recipes/run/cli.py", "Launch(1, "),
        "`promote` refused": ("recipes/promote.py", "REFUSED_EXIT_CODE = 1")},
}


def _is_main_guard(node: ast.stmt) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators))


def code_commands() -> set[str]:
    """``recipes.X`` for every module (or package, by its ``__main__.py``) under recipes/ that runs as a program."""
    found = set()
    for path in (REPO / "recipes").rglob("*.py"):
        if any(_is_main_guard(node) for node in ast.parse(path.read_text()).body):
            parts = path.relative_to(REPO).with_suffix("").parts
            found.add(".".join(parts[:-1] if parts[-1] == "__main__" else parts))
    return found


def code_bench_subcommands() -> set[str]:
    """The names ``python -m recipes.bench`` gives its subparsers (``sub.add_parser("overhead", ...)``)."""
    tree = ast.parse((REPO / "recipes" / "bench" / "subcommands.py").read_text())
    return {node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_parser"
            and node.args and isinstance(node.args[0], ast.Constant)}


def _int(node: ast.AST | None, constants: dict[str, int]) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return constants.get(name) if name else None


def code_exit_codes() -> dict[int, set[str]]:
    """Every exit code the code uses, with where: ``{75: {"callbacks/spot.py: REQUEUE_EXIT_CODE", ...}}``."""
    files = {path: ast.parse(path.read_text()) for package in PACKAGES for path in (REPO / package).rglob("*.py")}
    constants: dict[str, int] = {}
    for tree in files.values():
        for node in tree.body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                    and node.targets[0].id.endswith("_EXIT_CODE") and _int(node.value, {}) is not None):
                constants[node.targets[0].id] = _int(node.value, {})
    found: dict[int, set[str]] = {0: {"success"}}
    for path, tree in files.items():
        where = str(path.relative_to(REPO))
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and \
                    node.targets[0].id in constants:
                found.setdefault(constants[node.targets[0].id], set()).add(f"{where}: {node.targets[0].id}")
        for node in ast.walk(tree):
            code = None
            if isinstance(node, ast.Call) and node.args:
                func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if func in ("exit", "_exit", "SystemExit", "Launch"):
                    code = _int(node.args[0], constants)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                    node.name == "main" or node.name.endswith("_main")):
                for inner in ast.walk(node):
                    value = _int(inner.value, constants) if isinstance(inner, ast.Return) else None
                    if value is not None:
                        found.setdefault(value, set()).add(f"{where}: {node.name} returns {value}")
            if code is not None:
                found.setdefault(code, set()).add(f"{where}: line {node.lineno}")
    return found


def reference() -> str:
    return REFERENCE.read_text()


def doc_commands(text: str) -> set[str]:
    """The modules the page names in ``python -m recipes.X`` commands."""
    return set(re.findall(r"python -m (recipes(?:\.[a-z_]+)+)", text))


def doc_bench_subcommands(text: str) -> set[str]:
    return set(re.findall(r"`python -m recipes\.bench ([a-z][\w-]*)", text))


def doc_exit_codes(text: str) -> dict[int, str]:
    """The exit-code table: code -> its row."""
    section = text[text.index("## Exit codes"):]
    return {int(m[1]): m[0] for m in re.finditer(r"^\| (\d+) \|.*$", section, re.MULTILINE)}


def test_every_command_is_documented_and_none_more() -> None:
    code, doc = code_commands(), doc_commands(reference())
    assert "recipes.fit" in code and "recipes.bench" in code  # the discovery works
    assert not code - doc, f"docs/reference.md lacks these commands: {sorted(code - doc)}"
    assert not doc - code, f"docs/reference.md names commands that do not run as programs: {sorted(doc - code)}"


def test_every_bench_subcommand_is_documented_and_none_more() -> None:
    code, doc = code_bench_subcommands(), doc_bench_subcommands(reference())
    assert {"overhead", "lm", "chaos"} <= code  # the discovery works
    assert not code - doc, f"docs/reference.md lacks these `recipes.bench` subcommands: {sorted(code - doc)}"
    assert not doc - code, f"docs/reference.md names `recipes.bench` subcommands there are not: {sorted(doc - code)}"


def test_every_exit_code_is_documented_and_none_more() -> None:
    code, doc = code_exit_codes(), doc_exit_codes(reference())
    # the constants the tools import are the ones found
    for constant in (common.USAGE_EXIT_CODE, common.SIGINT_EXIT_CODE):
        assert any("common.py" in where for where in code[constant])
    missing = {c: sorted(code[c]) for c in set(code) - set(doc)}
    assert not missing, f"docs/reference.md's exit-code table lacks codes the code uses: {missing}"
    assert not set(doc) - set(code), f"docs/reference.md documents exit codes the code never uses: " \
        f"{sorted(set(doc) - set(code))}"


@pytest.mark.parametrize(("code", "cause"), [(c, cause) for c, causes in CAUSES.items() for cause in causes])
def test_each_cause_of_an_exit_code_is_in_its_row(code: int, cause: str) -> None:
    path, text = CAUSES[code][cause]
    assert text in (REPO / path).read_text(), f"{path} no longer has {text!r}: is exit {code} still {cause!r}?"
    row = doc_exit_codes(reference())[code]
    words = cause.lower().replace("`", "").split()
    assert all(word in row.lower() for word in words), f"docs/reference.md's exit {code} row does not name {cause!r}"


def test_fit_docstring_codes_are_documented() -> None:
    """recipes/fit.py's docstring lists its exit codes: each is in the reference."""
    import recipes.fit

    said = {int(c) for c in re.findall(r"\b(\d+) [a-z]", recipes.fit.__doc__.split("Exit codes:", 1)[1])}
    assert said and not said - set(doc_exit_codes(reference()))


def test_planted_drift_fails(tmp_path: Path) -> None:
    """The checks catch a command, a subcommand or an exit code gone from the page, or one the code lacks."""
    text = reference()
    dropped = re.sub(r"^\| `python -m recipes\.sweep .*\n", "", text, flags=re.MULTILINE)
    assert code_commands() - doc_commands(dropped) == {"recipes.sweep"}
    dropped = re.sub(r"^\| `python -m recipes\.bench stream` .*\n", "", text, flags=re.MULTILINE)
    assert code_bench_subcommands() - doc_bench_subcommands(dropped) == {"stream"}
    assert doc_bench_subcommands(text + "\n`python -m recipes.bench warp`\n") - code_bench_subcommands() == {"warp"}
    dropped = re.sub(r"^\| 75 \|.*\n", "", text, flags=re.MULTILINE)
    assert set(code_exit_codes()) - set(doc_exit_codes(dropped)) == {75}
    extra = text.rstrip("\n") + "\n| 3 | something |\n"
    assert set(doc_exit_codes(extra)) - set(code_exit_codes()) == {3}


def test_the_readme_exit_codes_are_the_references() -> None:
    readme = (REPO / "README.md").read_text()
    assert set(doc_exit_codes(readme)) == set(doc_exit_codes(reference()))
