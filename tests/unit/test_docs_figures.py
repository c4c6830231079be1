"""The docs' measured figures live in one place, docs/benchmarks.md; a page that restates one restates it exactly.

The convention this test checks (docs/development.md's "Measured figures go to Benchmarks"):

- A *figure* is a number with a unit of time, rate, size or ratio: ``85 s``, ``22.1 min``, ``4 min 18 s``,
  ``10.4 ms per step``, ``4,244 samples/s``, ``134 MB``, ``1.031x``, ``x1.33``, ``0.2 %``, a range (``0.03`` to
  ``0.2 s``, with a dash), or a count of ``tests``. One after ``about`` or ``~`` may round the figure
  benchmarks.md gives (``about 22 min`` for its 22.1 min, ``~23 s`` for 22.7 s); any other is stated as
  benchmarks.md states it.
- A paragraph (or list, or table row) of README.md or a docs page that links to ``benchmarks.md#section`` takes its
  figures from that section: each must be there, the same number with the same unit (``minutes`` and ``min``,
  ``ms a step`` and ``ms per step`` are one unit each), or the same number with no unit (a table cell, a ratio
  whose ``x`` the section leaves out, ``914 in 85 s``). A link without an anchor means the whole of benchmarks.md,
  where a number must come with its unit (any number is bare somewhere in a file that long).
  A table row also takes the links of the paragraph right above its table.
- A comment in a shell block cannot link: how long or how fast its command runs (a figure after ``about`` or
  ``~``: ``# the unit tests: 914 tests in about 85 s``) is checked against the whole of benchmarks.md.

A page that needs a figure benchmarks.md lacks links to benchmarks.md without restating a number, or states it
on a line that does not link (then it is that page's own, unchecked: the reliability results, a tool's defaults).
The changelog is history and is not checked. A section is its heading's text up to the next heading: keeping
older measurements under a subheading of their own keeps them from vouching for a stale figure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "docs" / "benchmarks.md"
#: The pages whose figures are checked (benchmarks.md is the source; the changelog is history).
NOT_CHECKED = {"benchmarks.md", "changelog.md"}

_NUM = r"\d+(?:,\d{3})*(?:\.\d+)?"
DASH = "\N{EN DASH}"  # of a range, as the pages write it
#: A unit as the pages spell it -> the unit it is.
UNITS = {
    "ms/step": "ms", "ms per step": "ms", "ms a step": "ms", "ms": "ms",
    "samples/s": "samples/s", "tokens/s": "tokens/s",
    "s": "s", "seconds": "s", "min": "min", "minutes": "min", "h": "h", "hours": "h",
    "GB": "GB", "MB": "MB", "GiB": "GiB", "MiB": "MiB", "%": "%", "tests": "tests",
}
_UNIT = "|".join(sorted((re.escape(u) for u in UNITS), key=len, reverse=True))
FIGURE = re.compile(
    rf"(?<![\w.,/·-])(?:(?P<minsec>{_NUM}\smin\s{_NUM})\ss|x(?P<xnum>{_NUM})"
    rf"|(?P<num>{_NUM}(?:\s?[{DASH}-]\s?{_NUM})?)(?:(?P<x>x)|\s?(?P<unit>{_UNIT})))(?![\w/])")
#: What makes a figure approximate: it may round the figure benchmarks.md gives ("about 22 min" for 22.1 min).
APPROX = re.compile(r"(?:~|\babout\s)\s?$")
LINK = re.compile(r"\]\((?P<path>[^)#\s]*benchmarks\.md)(?P<anchor>#[^)\s]*)?\)")
FENCE = re.compile(r"^\s*(```|~~~)")
SHELL = ("bash", "sh", "shell", "console")


@dataclass(frozen=True)
class Figure:
    number: str
    unit: str
    approx: bool = field(default=False, compare=False)

    def __str__(self) -> str:
        return f"{self.number}x" if self.unit == "x" else f"{self.number} {self.unit}"


def figures(text: str) -> list[Figure]:
    """The figures stated in ``text`` (bold and line breaks dropped), in order."""
    text = " ".join(text.replace("**", "").split())
    found = []
    for match in FIGURE.finditer(text):
        approx = bool(APPROX.search(text[max(0, match.start() - 8):match.start()]))
        if match["minsec"]:
            found.append(Figure(match["minsec"], "s", approx))
        elif match["xnum"]:
            found.append(Figure(match["xnum"], "x", approx))
        else:
            number = re.sub(rf"\s?[{DASH}-]\s?", DASH, match["num"])
            found.append(Figure(number, "x" if match["x"] else UNITS[match["unit"]], approx))
    return found


def _value(number: str) -> float | None:
    try:
        return float(number.replace(",", ""))
    except ValueError:  # a range, minutes and seconds
        return None


def rounds_to(figure: Figure, number: str) -> bool:
    """Whether ``number`` rounded to ``figure``'s digits is ``figure``'s number (22.1 -> "22"; 0.26 -> "0.3")."""
    target, value = _value(figure.number), _value(number)
    if target is None or value is None:
        return False
    digits = len(figure.number.partition(".")[2])
    return abs(round(value, digits) - target) < 10 ** -(digits + 3)


def slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[-\s]+", "-", text).strip("-")


@dataclass
class Source:
    """What a section of benchmarks.md vouches for."""

    stated: set[Figure]  # number and unit
    bare: set[str]  # numbers stated without a unit: table cells ("| **6.71** (6.56-7.01) |"), "914 in 85 s"

    @classmethod
    def of(cls, text: str, *, bare: bool = True) -> Source:
        text = " ".join(text.replace("**", "").split())
        rest = FIGURE.sub(" ", text)
        return cls(set(figures(text)), set(re.findall(rf"(?<![\d.,]){_NUM}", rest)) if bare else set())

    def vouches(self, figure: Figure) -> bool:
        """Whether the section states ``figure``: with its unit, or its number with none; rounded if it says about."""
        if figure in self.stated or figure.number in self.bare:
            return True
        if not figure.approx:
            return False
        numbers = [f.number for f in self.stated if f.unit == figure.unit] + sorted(self.bare)
        return any(rounds_to(figure, number) for number in numbers)


def sections(markdown: str) -> dict[str, str]:
    """benchmarks.md by anchor: each heading's text up to the next heading ("" is the whole file)."""
    out = {"": markdown}
    anchor, lines, fenced = None, [], False
    for line in markdown.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        heading = None if fenced else re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            if anchor is not None:
                out[anchor] = "\n".join(lines)
            anchor, lines = slug(heading[1]), []
        else:
            lines.append(line)
    if anchor is not None:
        out[anchor] = "\n".join(lines)
    return out


@dataclass
class Statement:
    """A paragraph, table row or shell comment of a page, with the benchmarks.md sections it links to."""

    line: int
    text: str
    anchors: list[str]  # "" for the whole file


def _anchors(text: str) -> list[str]:
    return [(m["anchor"] or "#")[1:] for m in LINK.finditer(text)]


def statements(markdown: str) -> list[Statement]:
    """``markdown`` cut into what this test checks: paragraphs, table rows and the comments of shell blocks."""
    out: list[Statement] = []
    block: list[tuple[int, str]] = []
    caption: list[str] = []  # the links of the paragraph right above a table
    fence: str | None = None

    def close() -> None:
        nonlocal caption
        if block:
            text = "\n".join(line for _, line in block)
            out.append(Statement(block[0][0], text, _anchors(text)))
            caption = _anchors(text)
            block.clear()

    for number, line in enumerate(markdown.splitlines(), 1):
        if fence is not None:
            if FENCE.match(line):
                fence = None
            elif fence in SHELL and " # " in f" {line}":
                comment = f" {line}".split(" # ", 1)[1]
                # how long or how fast a command runs: the figures after "about" or "~" (not its inputs or output)
                claims = " ".join(m[0] for m in re.finditer(rf"(?:~|\babout )\s?{FIGURE.pattern}", comment))
                if claims:
                    out.append(Statement(number, claims, [""]))
            continue
        if FENCE.match(line):
            close()
            fence = line.strip().lstrip("`~").strip().split(" ")[0].lower()
            continue
        if line.lstrip().startswith("|"):
            close()  # a paragraph right above the table: its caption
            out.append(Statement(number, line, _anchors(line) + caption))
            continue
        if not line.strip():
            close()
            continue
        if line.lstrip().startswith("#"):  # a heading ends a paragraph and is none
            close()
            caption = []
            continue
        block.append((number, line))
    close()
    return out


def mismatches(page: str, benchmarks: str) -> list[str]:
    """Each figure of ``page`` that the benchmarks.md sections it links to do not state, as ``line: figure``."""
    known = sections(benchmarks)
    sources: dict[str, Source] = {}
    problems = []
    for statement in statements(page):
        if not statement.anchors:
            continue
        missing = [a for a in statement.anchors if a not in known]
        if missing:
            problems.append(f"line {statement.line}: benchmarks.md has no section #{missing[0]}")
            continue
        scope = [sources.setdefault(a, Source.of(known[a], bare=bool(a))) for a in dict.fromkeys(statement.anchors)]
        for figure in figures(re.sub(r"\]\([^)]*\)", "]", statement.text)):  # not the numbers in link targets
            if not any(source.vouches(figure) for source in scope):
                where = ", ".join(f"#{a}" if a else "the whole file" for a in dict.fromkeys(statement.anchors))
                problems.append(f"line {statement.line}: {figure} is not in benchmarks.md ({where})")
    return problems


def pages() -> list[Path]:
    docs = sorted(p for p in (REPO / "docs").rglob("*.md") if p.name not in NOT_CHECKED)
    return [REPO / "README.md", *docs]


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_page_states_figures_as_benchmarks_does(page: Path) -> None:
    problems = mismatches(page.read_text(), BENCHMARKS.read_text())
    assert not problems, f"{page.relative_to(REPO)} restates figures that docs/benchmarks.md does not give:\n" + \
        "\n".join(problems)


BENCH = f"""# Benchmarks

## The test suite

2026-12-06: the unit tests **914 in 85 s**, the end-to-end tests 512 in 22.1 min; about 27 min in all.

| phase | fresh launch |
|---|---|
| **spawn to first step** | **6.71** (6.56{DASH}7.01) |

## The first run

22.7 s wall in all, 10.4 ms
per step. Notice to checkpoint: 0.03{DASH}0.2 s; x1.33 over the floor; 1.031x the time.
"""


def test_a_figure_that_differs_fails() -> None:
    page = "Unit tests: 914 tests in about 75 s ([figures](benchmarks.md#the-test-suite)).\n"
    assert mismatches(page, BENCH) == ["line 1: 75 s is not in benchmarks.md (#the-test-suite)"]


def test_figures_restated_exactly_pass() -> None:
    page = ("The whole suite, about 27 minutes; unit 914 tests in about 85 s, end-to-end 22.1 min, a launch 6.71 s\n"
            "to its first step ([the figures](benchmarks.md#the-test-suite)).\n\n"
            f"The first run: 22.7 s, 10.4 ms/step, a notice on disk in 0.03{DASH}0.2 s, x1.33 and 1.031x\n"
            "([more](benchmarks.md#the-first-run)).\n")
    assert mismatches(page, BENCH) == []


def test_the_section_linked_is_the_source() -> None:
    # 22.7 s is in benchmarks.md, but not in the section this paragraph links to
    page = "The first run took 22.7 s ([figures](benchmarks.md#the-test-suite)).\n"
    assert mismatches(page, BENCH) == ["line 1: 22.7 s is not in benchmarks.md (#the-test-suite)"]
    assert mismatches(page.replace("#the-test-suite", ""), BENCH) == []


def test_table_rows_take_the_caption_links() -> None:
    page = ("Figures in [Benchmarks](benchmarks.md#the-first-run).\n\n| what | result |\n|---|---|\n"
            "| first run | 22.7 s wall |\n| bf16 | about 6x slower |\n")
    assert mismatches(page, BENCH) == ["line 6: 6x is not in benchmarks.md (#the-first-run)"]


def test_shell_comments_are_checked_against_the_whole_file() -> None:
    page = ("```bash\npytest -m 'not e2e' -n 2   # 914 tests in about 85 s\n"
            "python -m recipes.fit --config configs/gpt.yaml   # ~4 min on 2 cores\n```\n")
    assert mismatches(page, BENCH) == ["line 3: 4 min is not in benchmarks.md (the whole file)"]


def test_a_missing_section_fails() -> None:
    page = "See [the figures](benchmarks.md#the-gpt-recipe).\n"
    assert mismatches(page, BENCH) == ["line 1: benchmarks.md has no section #the-gpt-recipe"]


def test_figures_are_read_as_stated() -> None:
    text = "a 2-core machine, 2026-12-06, 4 layers x 128, 8x8 digits, 10 steps, ~23 s, 1.5 min, 4,244 samples/s, 95 %"
    assert [str(f) for f in figures(text)] == ["23 s", "1.5 min", "4,244 samples/s", "95 %"]


@pytest.mark.parametrize(("real", "planted", "figure"), [
    ("end-to-end 15.2 min", "end-to-end 17.6 min", "17.6 min"),  # a paragraph that links to #the-test-suite
    ("(5.16 s) | 6.71 s fresh", "(5.16 s) | 6.17 s fresh", "6.17 s"),  # a table row with its own link
    ("# CPU-sized: 300 steps on 2 cores", "# CPU-sized: ~4 min 40 s on 2 cores", "4 min 40 s"),  # a shell comment
])
def test_a_figure_planted_in_the_readme_fails(real: str, planted: str, figure: str) -> None:
    readme, benchmarks = (REPO / "README.md").read_text(), BENCHMARKS.read_text()
    assert real in readme and mismatches(readme, benchmarks) == []
    problems = mismatches(readme.replace(real, planted, 1), benchmarks)
    assert len(problems) == 1 and f": {figure} is not in benchmarks.md" in problems[0], problems
