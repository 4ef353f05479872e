"""The import profile (benchmarks/import_profile.py): `-X importtime`'s lines
read into modules, and what one side imports that the other does not."""

from __future__ import annotations

import pytest

from benchmarks import import_profile
from benchmarks.import_profile import Profile, parse, report

STDERR = """\
import time: self [us] | cumulative | imported package
import time:      1500 |       1500 |   shared.base
import time:    200000 |     201500 | shared
import time:     30000 |      30000 |     extra.deep
import time:   2000000 |    2030000 |   extra
import time:      1000 |    2232500 | ours
some warning the child printed
"""


def test_parse_reads_times_in_seconds_and_nesting():
    modules = parse(STDERR)
    assert [(m.name, m.depth) for m in modules] == [
        ("shared.base", 1),
        ("shared", 0),
        ("extra.deep", 2),
        ("extra", 1),
        ("ours", 0),
    ]
    assert modules[3].self_s == pytest.approx(2.0)
    assert modules[4].cumulative_s == pytest.approx(2.2325)


def test_report_names_what_ours_imports_beyond_plain():
    ours = Profile("ours: the actor", "import ours", 2.5, parse(STDERR))
    plain = Profile(import_profile.PLAIN, "import shared", 0.4, parse(STDERR)[:2])
    lines = report([plain, ours], top=3)
    assert lines[0].startswith(f"{import_profile.PLAIN} (import shared): 0.40 s wall, 2 modules")
    assert "own time by package (s): extra 2.03, shared 0.20, ours 0.00" in lines[4]
    assert lines[6] == "  not in plain: vllm.LLM: 3 modules, 2.03 s: extra 2.03, ours 0.00"


def test_a_real_statement_is_profiled_in_its_own_process(tmp_path, capsys):
    out = tmp_path / "imports.json"
    assert import_profile.main(["--target", "j=import json.decoder", "--json", str(out)]) == 0
    assert "json.decoder" in out.read_text()
    assert capsys.readouterr().out.startswith("j (import json.decoder): ")


def test_a_failing_statement_says_why(capsys):
    with pytest.raises(SystemExit, match="no_such_module"):
        import_profile.main(["--target", "x=import no_such_module"])


def test_a_target_without_its_statement_is_refused(capsys):
    with pytest.raises(SystemExit):
        import_profile.main(["--target", "x="])
    assert "--target 'x=': expected NAME=STATEMENT" in capsys.readouterr().err
