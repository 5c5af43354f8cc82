"""No module of the package imports a module that imports it back, directly or through others.

Every import statement counts: at module level, under ``TYPE_CHECKING`` and inside functions (a type-only or late
import is a circle all the same: the two modules cannot be read, or split, one without the other). Shared types live in
a leaf module instead (`odc_accelerate.engine._common`, as torch's ``_fsdp_common.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "odc_accelerate"


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, whether it is a package's ``__init__``)."""
    modules = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def import_graph() -> dict[str, set[str]]:
    """Each module of the package -> the modules of the package it imports (``from pkg import name`` imports
    ``pkg.name`` where that is a module, else ``pkg``)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = name.split(".")[: None if is_package else -1]
                    parent = parent[: len(parent) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
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


def test_the_graph_sees_type_only_and_late_imports():
    graph = import_graph()
    assert "odc_accelerate.engine._common" in graph["odc_accelerate.engine._hooks"]  # under TYPE_CHECKING
    assert "odc_accelerate" in graph["odc_accelerate.cli.bootstrap"]  # `import odc_accelerate` inside a function
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_one_that_imports_it_back():
    found = circles(import_graph())
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)
