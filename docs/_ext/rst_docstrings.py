"""A griffe extension for the API pages: the reStructuredText in the docstrings, rendered as Markdown.

The docstrings are written for ``help()`` and editors in Google style with a few reStructuredText habits:
simple tables of logged metric keys (``====  ====`` borders), roles (:class:`x`), and ``Example::``
before a literal block. mkdocstrings renders docstrings as Markdown, where those would print as rows of
``=`` and stray colons; this rewrites them at load time, leaving the source alone.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

_BORDER = re.compile(r"^\s*=+(?:\s+=+)+\s*$")
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj):`(~?)([^`]+)`")
_LITERAL = re.compile(r"^(\s*)(\S.*?)::\s*$")


def _columns(border: str) -> list[int]:
    return [m.start() for m in re.finditer(r"=+", border)]


def _cells(line: str, starts: list[int]) -> list[str]:
    bounds = [*starts[1:], None]
    return [line[a:b].strip() if b is not None else line[a:].strip() for a, b in zip(starts, bounds, strict=True)]


def _table(lines: list[str]) -> list[str]:
    """A simple table (its lines, borders included) as a Markdown table."""
    indent = len(lines[0]) - len(lines[0].lstrip())
    lines = [line[indent:] for line in lines]
    starts = _columns(lines[0])
    borders = [i for i, line in enumerate(lines) if _BORDER.match(line)]
    rows: list[list[str]] = []
    header: list[str] | None = None
    for i, line in enumerate(lines):
        if i in borders or not line.strip():
            continue
        cells = _cells(line, starts)
        if rows and not cells[0] and (header is not None or i > borders[1]):
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells, strict=True)]  # a continuation line
            continue
        if header is None and len(borders) >= 3 and i < borders[1]:
            header = cells
            continue
        rows.append(cells)
    header = header or [""] * len(starts)

    def row(cells: list[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    return [row(header), "|" + "---|" * len(starts), *(row(r) for r in rows)]


def rst_to_markdown(text: str) -> str:
    """``text`` with its simple tables, roles and ``::`` literal-block markers as Markdown."""
    text = _ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if _BORDER.match(line):
            j, borders = i, 0
            while j < len(lines) and lines[j].strip():
                borders += bool(_BORDER.match(lines[j]))
                j += 1
            if borders >= 2:
                out.extend(["", *_table(lines[i:j]), ""])
                i = j
                continue
        literal = _LITERAL.match(line)
        if line.strip() == "::":  # a literal block's marker alone on its line
            out.append("")
        elif literal and not line.strip().startswith(("..", ">>>")):
            indent, words = literal.groups()
            out.append(f"{indent}**{words}:**" if " " not in words else f"{indent}{words}:")
        else:
            out.append(line)
        i += 1
    return "\n".join(out)


class RstDocstrings(Extension):
    """Rewrite every loaded object's docstring with :func:`rst_to_markdown`."""

    def on_instance(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)
