"""Start-up pairs split over calls (benchmarks/startup.py --resume): a
resumed run goes on alternating where the last call stopped, reuses that
run's model and compile caches, and refuses settings it cannot compare."""

from __future__ import annotations

import json

import pytest

from benchmarks import startup


@pytest.fixture
def starts(monkeypatch, tmp_path, own_tmp):
    """Each child start recorded as (side, cache directory name) instead of run;
    the folders a run keeps (its logs, its caches) made in the test's own."""
    calls: list[tuple[str, str]] = []

    def fake_child(args, kind, cache, log):
        calls.append((kind, f"{cache.parent.name}/{cache.name}"))
        return {"ready_s": 10.0, "first_request_s": 0.1, "phases": {}}

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setattr(startup, "run_child", fake_child)
    monkeypatch.setattr(startup, "default_model", lambda args, work: str(model))
    return calls


def test_resumed_pairs_alternate_on_and_warm_starts_reuse_the_first_cache(starts, tmp_path):
    out = tmp_path / "s.json"
    base = ["--backend", "hf", "--json", str(out), "--pairs", "1"]
    startup.main([*base, "--cache-root", str(tmp_path / "cache")])
    startup.main([*base, "--resume"])
    assert starts == [
        ("plain", "plain/cold-0"),
        ("ours", "ours/cold-0"),
        ("plain", "plain/cold-0"),
        ("ours", "ours/cold-0"),
        # the second call: pair 1, ours first, a fresh cache for each cold start
        ("ours", "ours/cold-1"),
        ("plain", "plain/cold-1"),
        ("ours", "ours/cold-0"),
        ("plain", "plain/cold-0"),
    ]
    results = json.loads(out.read_text())
    assert [len(results["states"][s]["ours"]) for s in ("cold", "warm")] == [2, 2]


def test_resume_refuses_other_settings_and_a_lost_cache(starts, tmp_path, own_tmp):
    out = tmp_path / "s.json"
    startup.main(["--backend", "hf", "--states", "cold", "--pairs", "1", "--json", str(out)])
    kept = set(own_tmp.glob("startup-bench-*"))  # the run's logs and caches
    with pytest.raises(SystemExit, match="enforce_eager=False, this call enforce_eager=True"):
        startup.main(["--backend", "hf", "--json", str(out), "--resume", "--enforce-eager"])
    with pytest.raises(SystemExit, match="gpu_memory_utilization=0.85, this call gpu_memory"):
        startup.main(
            ["--backend", "hf", "--json", str(out), "--resume", "--gpu-memory-utilization", "0.5"]
        )
    results = json.loads(out.read_text())
    results["cache_root"] = str(tmp_path / "elsewhere")
    out.write_text(json.dumps(results))
    with pytest.raises(SystemExit, match="cache_root .* is gone"):
        startup.main(["--backend", "hf", "--json", str(out), "--resume"])
    assert set(own_tmp.glob("startup-bench-*")) == kept  # a refused call makes none


def test_resume_needs_an_earlier_run(tmp_path, capsys):
    with pytest.raises(SystemExit):
        startup.parse_args(["--resume", "--json", str(tmp_path / "none.json")])
    assert "--resume needs the --json of an earlier run" in capsys.readouterr().err
