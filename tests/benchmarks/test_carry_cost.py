"""The carry-cost benchmark (benchmarks/carry_cost.py): its carry is what a
`partial` iteration leaves at the long tail's lengths (the longest groups,
each sample part-way through its budget), and a run writes its figures and
leaves no folder behind."""

from __future__ import annotations

import json

from benchmarks import carry_cost
from training.long_tail import make_rows


def test_the_carry_is_the_groups_the_batch_leaves():
    groups = carry_cost.make_carry(prompts=20, n=3, scale=4, in_flight=1.5, seed=1)
    budgets = sorted(int(make_rows(20, seed=1, scale=4)[s % 20]["max_tokens"]) for s in range(30))
    assert len(groups) == 10
    assert sorted(g.samples[0].budget for g in groups) == budgets[20:]
    for group in groups:
        assert len(group.samples) == 3
        for sample in group.samples:
            assert 1 <= len(sample.token_ids) == len(sample.positions) <= sample.budget
            assert sample.done == (len(sample.token_ids) == sample.budget)


def test_a_run_writes_its_figures_and_no_folder(tmp_path, own_tmp, capsys):
    out = tmp_path / "carry.json"
    carry_cost.main(
        ["--scale", "32", "--prompts", "8", "--n", "2", "--rounds", "2", "--json", str(out)]
    )
    result = json.loads(out.read_text())
    assert set(result["seconds"]) == {"json.dumps", "dumps", "write", "load"}
    assert all(len(s) == 2 for s in result["seconds"].values()) and result["positions"] > 0
    assert "json.dumps / dumps" in capsys.readouterr().out
    assert not list(own_tmp.iterdir())
