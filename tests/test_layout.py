"""The shape of the product code: no module over MAX_LINES lines, and no block of
MIN_REPEATED_LINES or more lines written twice (pylint's similarity checker; comments,
docstrings and import statements left out).  The product code is the four folders that
install as `tokenmill.*`."""

from __future__ import annotations

import ast
import io
from contextlib import redirect_stdout
from pathlib import Path

from pylint.checkers.symilar import Symilar

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("jobs", "pipelines", "transforms", "schemas")
MAX_LINES = 450
MIN_REPEATED_LINES = 6


def product_modules() -> list[Path]:
    return sorted(p for folder in PRODUCT for p in (ROOT / folder).rglob("*.py"))


def without_imports(text: str) -> str:
    """`text` with each import statement's lines blanked (the line numbers kept): two modules
    importing the same names are not a repeated block.  Symilar's own ignore_imports parses
    every module with astroid, a minute here; the standard parser takes milliseconds."""
    lines = text.splitlines(keepends=True)
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for i in range(node.lineno - 1, node.end_lineno or node.lineno):
                lines[i] = "\n"
    return "".join(lines)


def test_the_product_code_is_found():
    names = {p.relative_to(ROOT).as_posix() for p in product_modules()}
    assert {"jobs/cli/app.py", "pipelines/batch.py", "transforms/read.py", "schemas/records.py"} <= names


def test_no_product_module_is_over_450_lines():
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
             for p in product_modules()}
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them by concept): {over}"


def test_no_block_of_six_or_more_lines_is_repeated_in_product_code():
    sim = Symilar(min_lines=MIN_REPEATED_LINES, ignore_comments=True, ignore_docstrings=True)
    for p in product_modules():
        sim.append_stream(p.relative_to(ROOT).as_posix(), io.StringIO(without_imports(p.read_text(encoding="utf-8"))))
    report = io.StringIO()
    with redirect_stdout(report):
        sim.run()
    text = report.getvalue()
    assert " duplicates=0 " in text, f"blocks repeated in product code (give each one home):\n{text}"
