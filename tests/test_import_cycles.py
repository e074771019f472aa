"""The `no_cycles` import-linter contract (lint/import_cycles.py) that `make lint` runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from lint.import_cycles import find_circles

REPO = Path(__file__).resolve().parents[1]


def test_find_circles_names_each_circle_in_import_order_and_nothing_without_one():
    imports = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": [], "e": ["f"], "f": ["e"], "g": ["a"]}
    assert find_circles(imports) == [["a", "b", "c"], ["e", "f"]]
    assert find_circles({"a": ["b"], "b": ["c"], "c": [], "d": ["a", "c"]}) == []


def test_find_circles_gives_every_module_of_a_group_a_circle():
    # one group, two circles through b: a <-> b, then the one through c (not yet named)
    assert find_circles({"a": ["b"], "b": ["a", "c"], "c": ["b"]}) == [["a", "b"], ["c", "b"]]


def _lint(tmp_path: Path, modules: dict[str, str]) -> subprocess.CompletedProcess:
    pkg = tmp_path / "tinypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in modules.items():
        (pkg / f"{name}.py").write_text(textwrap.dedent(text))
    (tmp_path / ".importlinter").write_text(textwrap.dedent("""\
        [importlinter]
        root_package = tinypkg
        contract_types =
            no_cycles: lint.import_cycles.NoCyclesContract

        [importlinter:contract:circles]
        name = No circles
        type = no_cycles
        containers =
            tinypkg
        """))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_lint_imports_fails_on_a_circle_through_an_import_inside_a_function(tmp_path):
    res = _lint(tmp_path, {
        "a": "from tinypkg import b\n",
        "b": "def f():\n    from tinypkg import c\n",
        "c": "import tinypkg.a\n",
        "d": "import tinypkg.a\n",
    })
    assert res.returncode == 1, res.stdout + res.stderr
    out = " ".join(res.stdout.split())  # rich wraps long lines
    assert "No circles BROKEN" in out
    assert "1 import circle:" in out
    assert "tinypkg.a (l. 1) -> tinypkg.b (l. 2) -> tinypkg.c (l. 1) -> tinypkg.a" in out


def test_lint_imports_passes_a_package_without_a_circle(tmp_path):
    res = _lint(tmp_path, {"a": "from tinypkg import b\n", "b": "import tinypkg.c\n", "c": "x = 1\n"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "No circles KEPT" in res.stdout
