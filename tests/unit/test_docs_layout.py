"""The performance documents' rules (benchmarks/README.md), checked on the files.

docs/performance.md holds today's figures only: at most MAX_LINES lines, one
table per suite, no table cell over MAX_CELL characters, and every record it
cites is in benchmarks/results/. benchmarks/ holds at most MAX_SUITES suites
(top-level scripts with a ``__main__`` block; helpers have none), each listed
in benchmarks/README.md's table and given a section in docs/performance.md.
History goes to docs/lab/, one-off scripts out of benchmarks/.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PERFORMANCE = REPO / "docs" / "performance.md"
BENCHMARKS = REPO / "benchmarks"
RESULTS = BENCHMARKS / "results"
MAX_LINES = 300
MAX_CELL = 200
MAX_SUITES = 12
RECORD = re.compile(r"[A-Za-z0-9_.-]+-\d{8}-\d{6}(?:-\d+)?\.json")
SEPARATOR = re.compile(r"^\|(\s*:?-{3,}:?\s*\|)+\s*$")


def tables(text: str) -> list[list[list[str]]]:
    """Every markdown table in ``text``: its rows (header first, the separator
    left out), each a list of stripped cells. A table is a header line starting
    with ``|`` followed by a separator line; it runs to the first line that does
    not start with ``|``. An escaped pipe (``\\|``) stays inside its cell."""
    lines = text.splitlines()
    found = []
    i = 0
    while i < len(lines) - 1:
        if lines[i].startswith("|") and SEPARATOR.match(lines[i + 1]):
            rows = [lines[i]]
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(lines[i])
                i += 1
            found.append([cells(row) for row in rows])
        else:
            i += 1
    return found


def cells(row: str) -> list[str]:
    inner = row.strip().removeprefix("|").removesuffix("|")
    return [c.strip() for c in re.split(r"(?<!\\)\|", inner)]


def suites() -> list[str]:
    """benchmarks/*.py files with an ``if __name__ == "__main__":`` block."""
    out = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.If) and ast.unparse(node.test) in (
                "__name__ == '__main__'",
                "'__main__' == __name__",
            ):
                out.append(path.name)
                break
    return out


def test_the_table_parser_reads_cells_and_skips_prose():
    text = "intro | not a table\n\n| a | b \\| c |\n| --- | --- |\n| 1 | 2 |\n\nafter\n"
    assert tables(text) == [[["a", "b \\| c"], ["1", "2"]]]


def test_performance_md_is_at_most_300_lines():
    n = len(PERFORMANCE.read_text().splitlines())
    assert n <= MAX_LINES, f"docs/performance.md has {n} lines; history goes to docs/lab/"


def test_performance_md_tables_have_short_cells():
    found = tables(PERFORMANCE.read_text())
    assert len(found) >= len(suites()), "fewer tables than suites: the parser found too few"
    assert all(len(t) >= 2 for t in found), "a table without a row"
    long = [
        (t[0][0], cell[:60], len(cell))
        for t in found
        for row in t
        for cell in row
        if len(cell) > MAX_CELL
    ]
    assert not long, f"cells over {MAX_CELL} characters: {long}"


def test_every_record_performance_md_cites_is_kept():
    cited = set(RECORD.findall(PERFORMANCE.read_text()))
    assert cited, "docs/performance.md cites no record"
    missing = sorted(name for name in cited if not (RESULTS / name).is_file())
    assert not missing, f"cited but not in benchmarks/results/: {missing}"


def test_at_most_12_suites_each_listed_and_with_its_section():
    found = suites()
    assert "offline_throughput.py" in found, "the suite scan found no suite it should"
    assert len(found) <= MAX_SUITES, f"{len(found)} suites: {found}"
    (readme_table,) = [
        t for t in tables((BENCHMARKS / "README.md").read_text()) if t[0][0] == "suite"
    ]
    listed = {row[0].strip("`") for row in readme_table[1:]}
    assert listed == set(found), (
        f"benchmarks/README.md lists {sorted(listed)}; the suites are {found}"
    )
    headings = [line for line in PERFORMANCE.read_text().splitlines() if line.startswith("## ")]
    missing = [s for s in found if not any(f"`{s}`" in h for h in headings)]
    assert not missing, f"suites without a section in docs/performance.md: {missing}"
