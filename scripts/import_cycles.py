"""List the import cycles inside each package under ``packages/*/src``.

An edge A -> B is any import of B written in A: at module level, inside a function, or under
``if TYPE_CHECKING:`` (an annotation that needs the other module is a dependency too).
``from pkg import name`` counts as an import of ``pkg.name`` when that is a module, else of
``pkg``. Cycles are looked for twice: between modules, and between the sub-packages of each
package (``embshard_dist.sharded`` -> ``embshard_dist.planner`` and back is a cycle even when no
two modules import each other). A cycle is a strongly connected component of more than one node;
each is printed with one closed path through it.

    python scripts/import_cycles.py          # prints the cycles; exits 1 if there are any
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def modules_of(src: Path) -> dict[str, Path]:
    """Every module below ``src`` by dotted name (a package is its ``__init__``)."""
    found = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import node of the module, wherever it stands."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def edges_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports."""
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = name.split(".") if is_package else name.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            full = f"{base}.{alias.name}"
            targets.add(full if full in known else base)
    return {t for t in targets if t in known and t != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def closed_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first)."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in parents:
                    parents[child] = node
                    nxt.append(child)
        frontier = nxt
    return component


def subpackage_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between each package's direct sub-packages (and top-level modules)."""

    def group(module: str) -> str:
        return ".".join(module.split(".")[:2])

    collapsed: dict[str, set[str]] = {group(m): set() for m in graph}
    for module, targets in graph.items():
        collapsed[group(module)].update(group(t) for t in targets if group(t) != group(module))
    # The package itself (its __init__) stands above its sub-packages: leave it out.
    tops = {m for m in collapsed if "." not in m}
    return {m: t - tops for m, t in collapsed.items() if m not in tops}


def main() -> int:
    total = 0
    for src in sorted(ROOT.glob("packages/*/src")):
        known = modules_of(src)
        graph = {name: edges_of(name, path, known) for name, path in known.items()}
        for kind, level in (("modules", graph), ("sub-packages", subpackage_graph(graph))):
            for component in cycles(level):
                total += 1
                path = " -> ".join(closed_path(level, component))
                print(f"cycle of {len(component)} {kind}: {path}")
    print(f"{total} import cycle(s) in packages/*/src")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
