"""What importing a module pulls in, seen from a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "vllm")


def imported_with(module: str) -> list[str]:
    """Which of torch, transformers and vllm a fresh interpreter has imported
    after importing `module` from this checkout."""
    code = f"import sys, {module}; print(sorted(set({HEAVY!r}) & set(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return ast.literal_eval(done.stdout.strip())
