"""The size limits the product code keeps, so a reader can hold each piece:
modules, classes and functions, `create_vllm_engines`, pydantic models.

Measured with `ast` on the product folders (`engines/ tasks/ flows/ training/`).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("engines", "tasks", "flows", "training")
MODULE_LINES = 400
CLASS_LINES = 300
FUNCTION_LINES = 80
CREATE_VLLM_ENGINES_LINES = 60
MODEL_FIELDS = 25


def product_modules() -> list[Path]:
    return sorted(path for folder in PRODUCT for path in (ROOT / folder).rglob("*.py"))


def span(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def oversized(path: Path, root: Path = ROOT) -> list[str]:
    source = path.read_text(encoding="utf-8")
    where = path.relative_to(root)
    found = []
    lines = len(source.splitlines())
    if lines > MODULE_LINES:
        found.append(f"{where}: {lines} lines (at most {MODULE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            if span(node) > CLASS_LINES:
                found.append(f"{where}: class {node.name} {span(node)} lines")
            fields = [s for s in node.body if isinstance(s, ast.AnnAssign)]
            if len(fields) > MODEL_FIELDS:
                found.append(f"{where}: class {node.name} has {len(fields)} fields")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            limit = (
                CREATE_VLLM_ENGINES_LINES if node.name == "create_vllm_engines" else FUNCTION_LINES
            )
            if span(node) > limit:
                found.append(f"{where}: {node.name}() {span(node)} lines (at most {limit})")
    return found


def test_product_code_keeps_its_size_limits():
    found = [line for path in product_modules() for line in oversized(path)]
    assert not found, "\n".join(found)


def test_the_check_finds_an_oversized_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LINES))
    path = tmp_path / "probe.py"
    path.write_text(f"def f():\n{body}\n", encoding="utf-8")
    assert oversized(path, tmp_path) == [f"probe.py: f() {FUNCTION_LINES + 1} lines (at most 80)"]
