"""The commands that do not train answer ``--help`` without importing torch or Lightning (issue 47).

``tests/unit/recipes/run/test_common.py`` checks that importing them pulls in neither; this runs each
command's ``--help`` as a user does (``python -m recipes.X --help``, argparse's exit included) and reads
``sys.modules`` as the process ends.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

#: (module, argv) of each command that does not train, and of its subcommands.
COMMANDS = [("recipes.plan", ["--help"]), ("recipes.plan", ["batch", "--help"]), ("recipes.comm", ["--help"]),
            ("recipes.compare", ["--help"]), ("recipes.promote", ["--help"])]

PROBE = """
import atexit, runpy, sys
atexit.register(lambda: sys.stderr.write("\\nheavy=" + ",".join(m for m in ("torch", "lightning") if m in sys.modules)))
sys.argv = [{module!r}, *{argv!r}]
runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize(("module", "argv"), COMMANDS, ids=[" ".join([m, *a]) for m, a in COMMANDS])
def test_help_imports_neither_torch_nor_lightning(module: str, argv: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(module=module, argv=argv)], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout
    assert proc.stderr.splitlines()[-1] == "heavy="
