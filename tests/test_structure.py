"""The size limits the product code keeps, so a reader can hold each piece:
modules, classes and functions, `create_vllm_engines`, pydantic models.

Measured with `ast` on the product folders (`engines/ tasks/ flows/ training/ agents/`).
The limits are a guard, not a target: a module near its limit is split by
concern, with headroom (so few modules may sit near it), never trimmed to fit.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("engines", "tasks", "flows", "training", "agents")
MODULE_LINES = 400
CLASS_LINES = 300
FUNCTION_LINES = 80
CREATE_VLLM_ENGINES_LINES = 60
MODEL_FIELDS = 25
# Headroom: at most this many modules above NEAR_LIMIT lines.
NEAR_LIMIT = 350
NEAR_LIMIT_MODULES = 3
# What a reader scans at the top of engines/ before its sub-packages.
ENGINES_TOP_MODULES = 20


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


def test_few_modules_sit_near_the_limit():
    near = [
        f"{path.relative_to(ROOT)}: {lines}"
        for path in product_modules()
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > NEAR_LIMIT
    ]
    assert len(near) <= NEAR_LIMIT_MODULES, "\n".join(near)


def test_engines_top_level_stays_readable():
    top = sorted(path.name for path in (ROOT / "engines").glob("*.py"))
    assert len(top) <= ENGINES_TOP_MODULES, top


def test_no_two_product_classes_share_a_name():
    where: dict[str, list[str]] = {}
    for path in product_modules():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not shared, shared
