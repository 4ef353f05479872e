"""OpenRLHF's agent file (`agent_func_path`) in the rollout flow, on the tiny
model (CPU): OpenRLHF's own executor runs it on the engines, and the
iterations train on its rows."""

from __future__ import annotations

from rollout_support import PROMPTS, run_params, small_run

from flows.rollout import rollout
from tasks.run.shards import read_rows

#: An OpenRLHF agent file (as its examples/python/agent_func.py): one step,
#: rewarded for answering "a" (OpenRLHF takes tensors).
OPENRLHF_AGENT = """
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        action = states["action_text"]
        reward = torch.tensor(sum(ch == "a" for ch in action) / max(1, len(action)))
        return {
            "rewards": reward,
            "scores": reward,
            "environment_feedback": "",
            "done": True,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


def test_an_openrlhf_agent_file_runs_in_the_flow(ray_local, tiny_model, tmp_path):
    agent_file = tmp_path / "agent_func.py"
    agent_file.write_text(OPENRLHF_AGENT)
    # Eight prompts, two samples each: one shard. Each prompt's sessions run in
    # a Ray task, and each task's new worker imports transformers: 32 prompts
    # of 4 samples started some 60 workers and spent most of the run there.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(PROMPTS.read_text().splitlines(keepends=True)[:8]))
    params = run_params(
        **small_run(
            tiny_model, tmp_path / "out", num_engines=1, iterations=2, prompts_path=str(prompts)
        ),
        agent_func_path=str(agent_file),
    )
    state = rollout(params, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert [step.weight_version for step in summary.training] == [1, 2]
    rows = read_rows(tmp_path / "out" / summary.run_id / "iter-001")
    assert len(rows) == 8 * 2
    assert all(row["loss_mask"] and row["turns"][0]["role"] == "assistant" for row in rows)
