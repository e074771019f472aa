"""The code's shape, as issue 51 counts it: import circles (strongly connected groups of
modules, bench/ included, function-local imports included), tokenmill imports inside
functions, product functions over 8 parameters (click commands left out), and the callers of
`run_job`.  Reads the source with ast; runs nothing of it.  `make lint` enforces the circles
(lint/import_cycles.py) and tests/test_layout.py the parameters; this prints the counts.

    python -m bench.structure [--root DIR]     # DIR: another tree, e.g. a `git archive` of an older commit
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

FOLDERS = ("schemas", "transforms", "pipelines", "jobs")
EXTRA = ("bench",)


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for folder in (*FOLDERS, *EXTRA):
        for p in sorted((root / folder).rglob("*.py")):
            rel = p.relative_to(root).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join(parts) if folder in EXTRA else "tokenmill." + ".".join(parts)
            out[name] = p
    return out


def _targets(node: ast.AST, here: str, is_pkg: bool, known: set[str]) -> list[str]:
    found = []
    if isinstance(node, ast.Import):
        for a in node.names:
            found.append(a.name)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = here.split(".") if is_pkg else here.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        for a in node.names:
            sub = f"{base}.{a.name}"
            found.append(sub if sub in known else base)
    out = []
    for t in found:
        while t and t not in known:
            t = t.rpartition(".")[0]
        if t:
            out.append(t)
    return out


class _Module(ast.NodeVisitor):
    """One module's imports (into `graph`) and its functions' shapes, as `scan` counts them."""

    def __init__(self, name: str, is_pkg: bool, known: set[str], out: dict):
        self.name, self.is_pkg, self.known, self.out = name, is_pkg, known, out
        self.product = name.startswith("tokenmill.")
        self.depth, self.qual = 0, [""]

    def _import(self, node: ast.Import | ast.ImportFrom) -> None:
        ts = [t for t in _targets(node, self.name, self.is_pkg, self.known) if t != self.name]
        self.out["graph"][self.name].update(ts)
        if self.product and any(t.startswith("tokenmill.") for t in ts):
            self.out["internal_imports"] += 1
            self.out["imports_in_functions"] += self.depth > 0

    visit_Import = visit_ImportFrom = _import

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        a = node.args
        n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
        if a.args and a.args[0].arg in ("self", "cls"):
            n -= 1
        click = any("command" in ast.unparse(d) for d in node.decorator_list)
        if self.product and n > 8 and not click:
            self.out["over_8_params"].append(f"{self.name}:{node.name} {n}")
        self.depth += 1
        self.qual.append(f"{self.qual[-1]}.{node.name}")
        self.generic_visit(node)
        self.qual.pop()
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        if fname == "run_job" and self.product:
            self.out["run_job_callers"].append(f"{self.name}:{self.qual[-1].lstrip('.')}")
        self.generic_visit(node)


def scan(root: Path) -> dict:
    mods = modules(root)
    known = set(mods)
    out: dict = {"graph": {m: set() for m in mods}, "internal_imports": 0, "imports_in_functions": 0,
                 "over_8_params": [], "run_job_callers": []}
    for name, path in mods.items():
        _Module(name, path.name == "__init__.py", known, out).visit(ast.parse(path.read_text(), str(path)))
    out["over_8_params"].sort()
    out["run_job_callers"].sort()
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module, each sorted (the lint contract's own
    search, lint/import_cycles.py)."""
    from lint.import_cycles import strongly_connected

    return sorted(sorted(g) for g in strongly_connected({m: sorted(t) for m, t in graph.items()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=".")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    s = scan(Path(args.root))
    cs = circles(s.pop("graph"))
    s["circles"] = cs
    if args.json:
        print(json.dumps(s, indent=1))
        return
    print(f"import circles: {len(cs)}")
    for c in cs:
        print("  " + " <-> ".join(m.removeprefix("tokenmill.") for m in c))
    print(f"tokenmill imports in product code: {s['internal_imports']}, inside functions: {s['imports_in_functions']}")
    print(f"product functions over 8 parameters (click commands left out): {len(s['over_8_params'])}")
    for f in s["over_8_params"]:
        print("  " + f.removeprefix("tokenmill."))
    print(f"callers of run_job in product code: {len(s['run_job_callers'])}")
    for c in s["run_job_callers"]:
        print("  " + c.removeprefix("tokenmill."))


if __name__ == "__main__":
    main()
