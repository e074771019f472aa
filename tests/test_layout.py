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
#: A product function takes at most this many parameters (`self` and `cls` not counted); more
#: are grouped into what they belong to (a config, a dataclass of inputs, a run context).
MAX_PARAMETERS = 8
#: The click decorators whose function's parameters are the command's flags, one each.
CLICK_COMMANDS = ("command", "group")


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


def parameter_count(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Every parameter, positional, keyword-only, *args and **kwargs, less a method's `self` or `cls`."""
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None) - (names[:1] in (["self"], ["cls"]))


def is_click_command(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated `@x.command(...)` or `@x.group(...)` (click's, or a click group's)."""
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr in CLICK_COMMANDS:
            return True
    return False


def functions_over(limit: int, text: str) -> list[str]:
    """`name:line` of each function in `text` over `limit` parameters that is no click command."""
    return [f"{node.name}:{node.lineno}" for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and parameter_count(node) > limit and not is_click_command(node)]


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


def test_no_product_function_takes_more_than_8_parameters_unless_it_is_a_click_command():
    over = {p.relative_to(ROOT).as_posix(): found for p in product_modules()
            if (found := functions_over(MAX_PARAMETERS, p.read_text(encoding="utf-8")))}
    assert not over, f"functions over {MAX_PARAMETERS} parameters (group them: a config or a dataclass): {over}"


def test_the_parameter_rule_counts_every_kind_of_parameter_and_spares_only_click_commands():
    nine = "def f(a, b, /, c, d=1, *args, e, f=2, g, **kw): pass\n"
    assert functions_over(8, nine) == ["f:1"]
    assert functions_over(8, "class C:\n    def m(self, a, b, c, d, e, f, g, h): pass\n") == []
    assert functions_over(8, "class C:\n    def m(self, a, b, c, d, e, f, g, h, i): pass\n") == ["m:2"]
    assert functions_over(8, "@main.command()\n" + nine) == []
    assert functions_over(8, "@click.group\n" + nine) == []
    assert functions_over(8, "@functools.cache\n" + nine) == ["f:2"]
