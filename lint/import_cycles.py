"""An import-linter contract type: no import circles among the modules of some packages.

import-linter's own `acyclic_siblings` compares packages, not modules, and does not name a
circle's modules; this one reads grimp's module graph (imports inside functions counted, as
grimp counts every import statement) and names each circle's modules in import order.

Registered in pyproject.toml as `contract_types = ["no_cycles: lint.import_cycles.NoCyclesContract"]`:
`lint-imports` puts the folder it runs in (the repository root) on sys.path, so `lint` is
found there without being installed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping

import grimp
from importlinter import Contract, ContractCheck, fields, output


def find_circles(imports: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The import circles of a graph (module -> modules it imports): one shortest circle
    through each module that lies on any, each listed from its first module in import order,
    circles of one strongly connected group together and the groups in name order."""
    graph = {m: sorted(set(targets)) for m, targets in imports.items()}
    circles: list[list[str]] = []
    for group in sorted(strongly_connected(graph), key=min):
        covered: set[str] = set()
        for start in sorted(group):
            if start not in covered:
                circle = _shortest_circle(graph, start, group)
                covered.update(circle)
                circles.append(circle)
    return circles


def strongly_connected(graph: Mapping[str, list[str]]) -> list[set[str]]:
    """The groups of two or more modules that all reach each other (Tarjan, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(graph.get(root, ())))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(group)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(graph.get(child, ()))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return groups


def _shortest_circle(graph: Mapping[str, list[str]], start: str, group: set[str]) -> list[str]:
    """The shortest path from `start` back to itself inside `group` (breadth first)."""
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in graph.get(node, ()):
            if child not in group:
                continue
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return path[::-1]
            if child not in came_from:
                came_from[child] = node
                queue.append(child)
    raise AssertionError(f"{start} lies on no circle of its group")  # a group's members all reach each other


class NoCyclesContract(Contract):
    """No module of `containers` (packages, their modules included) imports itself through
    others of them."""

    type_name = "no_cycles"
    containers = fields.ListField(subfield=fields.StringField())

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        modules: set[str] = set()
        for package in self.containers:  # type: ignore[attr-defined]
            modules |= {package} | graph.find_descendants(package)
        imports = {m: graph.find_modules_directly_imported_by(m) & modules for m in modules}
        circles = find_circles(imports)
        lines = [[(m, _lines(graph, m, circle[(i + 1) % len(circle)])) for i, m in enumerate(circle)]
                 for circle in circles]
        return ContractCheck(kept=not circles, metadata={"circles": lines})

    def render_broken_contract(self, check: ContractCheck) -> None:
        circles = check.metadata["circles"]
        output.print_error(f"{len(circles)} import circle{'s' if len(circles) != 1 else ''}:")
        output.new_line()
        for circle in circles:
            hops = " -> ".join(f"{m} (l. {where})" for m, where in circle)
            output.print_error(f"-   {hops} -> {circle[0][0]}", bold=False)
        output.new_line()


def _lines(graph: grimp.ImportGraph, importer: str, imported: str) -> str:
    """The line numbers where `importer` imports `imported`."""
    details = graph.get_import_details(importer=importer, imported=imported)
    return ", ".join(str(d["line_number"]) for d in details) or "?"
