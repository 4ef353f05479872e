"""Fixtures of the benchmarks' tests."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def own_tmp(tmp_path, monkeypatch) -> Path:
    """A folder of this test's for whatever `tempfile` makes: what a benchmark
    leaves behind is found there, not among other runs' folders in /tmp."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder
