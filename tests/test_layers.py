"""The product's import graph: no circle of files, and no import from a lower
layer to a higher one.

The layers, highest first. A package may import those below it, never those
above: the flow drives the tasks, the tasks run agents and train, agents call
training's helpers (rewards), and everything stands on the engines.

Every import counts, read with `ast`: those at the top of a module, those
inside functions (lazy) and those under `if TYPE_CHECKING:` (type-only), since
each still ties the two files together for a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("flows", "tasks", "agents", "training", "engines")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def product_modules(root: Path) -> dict[str, Path]:
    return {
        module_name(path, root): path
        for layer in LAYERS
        if (root / layer).is_dir()
        for path in (root / layer).rglob("*.py")
    }


def imported(tree: ast.AST, package: str) -> set[str]:
    """Dotted names a module imports (`from a import b` gives `a.b`, which
    resolves to module `a.b` when there is one, else to `a`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = product_modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = {resolve(n) for n in imported(ast.parse(path.read_text("utf-8")), package)}
        graph[name] = {t for t in targets if t and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def upward(graph: dict[str, set[str]]) -> list[str]:
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    return sorted(
        f"{source} -> {target}"
        for source, targets in graph.items()
        for target in targets
        if rank[target.split(".")[0]] < rank[source.split(".")[0]]
    )


def test_no_circle_of_files():
    found = circles(import_graph(ROOT))
    assert not found, "\n".join(" <-> ".join(c) for c in found)


def test_no_import_from_a_lower_layer_to_a_higher_one():
    found = upward(import_graph(ROOT))
    assert not found, "\n".join(found)


def test_the_checks_find_a_type_only_circle_and_a_lazy_upward_import(tmp_path):
    for layer in LAYERS:
        (tmp_path / layer).mkdir()
        (tmp_path / layer / "__init__.py").write_text("")
    (tmp_path / "engines" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engines.b import B\n"
    )
    (tmp_path / "engines" / "b.py").write_text("from engines import a\n")
    (tmp_path / "training" / "c.py").write_text("def f():\n    from tasks import d\n")
    (tmp_path / "tasks" / "d.py").write_text("")
    graph = import_graph(tmp_path)
    assert circles(graph) == [["engines.a", "engines.b"]]
    assert upward(graph) == ["training.c -> tasks.d"]
