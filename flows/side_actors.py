"""What a run starts beside its engines: an on-policy run's policy (and the
policy's configuration: its transport follows placement), a reward run's
scorer, an agent run's router, warm runners and its sessions' plan."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import ray

from agents.loading import AgentRef, check_func_path
from agents.runner import AgentPlan, AgentRunners, start_runners
from engines import naming
from engines.weight_sync import transport_for
from flows.params import RolloutParams
from tasks.run.pool import EnginePool
from tasks.run.scope import RunScope
from tasks.train import wait_for_policy
from training.config import PolicyConfig
from training.policy import engine_dtype
from training.policy_actor import create_policy_actor


@dataclass
class SideActors:
    """What a run starts beside its engines: an on-policy run's policy (its
    handle, and the future of its start-up) and a reward run's scorer."""

    params: RolloutParams
    scope: RunScope
    model: str
    policy: Any = None
    policy_up: Any = None
    scorer: Any = None
    #: An agent run's router in front of the engines (agents/router/actor.py),
    #: and the warm runners its sessions run in (agents/runner.py).
    router: Any = None
    runners: AgentRunners | None = None

    def agent_plan(self, pool: EnginePool) -> AgentPlan | None:
        """An agent run's sessions: `--agent` through a router started here
        on the ready engines, `--agent-func-path` on the engines directly;
        both in warm runners started here, one per node of the engines."""
        agents = self.params.agents
        if not agents.agentic:
            return None
        plan = AgentPlan(
            agent=AgentRef.parse(agents.agent) if agents.agent else None,
            func_path=check_func_path(agents.agent_func_path) if agents.agent_func_path else None,
            timeout_s=agents.agent_timeout_s,
            model=self.model,
            sampling=self.params.sampling.request().model_copy(update={"n": 1}),
            max_length=self.params.engines.max_len,
        )
        prefix, namespace = self.scope.name_prefix, self.scope.namespace
        timeout_s = self.params.cluster.ready_timeout_s
        if agents.agent:
            # Imported here: only agent runs serve HTTP (fastapi, uvicorn).
            from agents.router.actor import start_router
            from agents.router.proxy import SessionDefaults

            api_key = pool.engines.api_key
            # The run's sampling is its sessions' default; a request's own wins.
            sampling = self.params.sampling
            defaults = SessionDefaults(sampling.max_tokens, sampling.temperature)
            self.router = start_router(
                list(pool.engines),
                api_key,
                "sticky",
                defaults=defaults,
                start_timeout_s=timeout_s,
                name=naming.router_name(prefix),
                namespace=namespace,
            )
            plan = replace(
                plan, router_url=self.router.url, api_key=api_key, router=self.router.actor
            )
        nodes = engine_nodes(pool)
        names = [naming.runner_name(prefix, i) for i in range(len(nodes))]
        self.runners = start_runners(plan, nodes, names, namespace, timeout_s)
        return replace(plan, runners=self.runners)

    def close_agents(self) -> None:
        """End the agent run's runners and router (each ends even when the other fails)."""
        try:
            if self.runners is not None:
                self.runners.close()
        finally:
            if self.router is not None:
                self.router.close()

    def start_policy(self, pool: EnginePool, backend: str) -> None:
        """The policy goes beside the engines on their GPU (colocate), its
        model loaded once they are up, else on a GPU of its own on a GPU
        cluster."""
        params, scope = self.params, self.scope
        timeout_s = params.cluster.ready_timeout_s
        if params.training.colocate:
            placement = pool.engines.placement.trainer_options()
            placement.update(after=pool.engines.up(), after_timeout_s=timeout_s)
            timeout_s *= 2  # its wait for the engines, then its own start
        else:
            placement = {"num_gpus": 1 if backend == "vllm" else 0}
        self.policy = create_policy_actor(
            policy_config(params, self.model, backend),
            name=scope.policy_name,
            namespace=scope.namespace,
            **placement,
        )
        self.policy_up = wait_for_policy.submit(self.policy, ready_timeout_s=timeout_s)


def policy_config(params: RolloutParams, model: str, backend: str) -> PolicyConfig:
    """The reference policy for an on-policy run. The transport follows
    placement: NCCL from the policy's own GPU to vLLM engines, CUDA IPC on
    the GPU it shares with them (colocate), gloo on CPU."""
    on_gpu = backend == "vllm"
    return PolicyConfig(
        pretrain=model,
        learning_rate=params.training.learning_rate,
        micro_batch_tokens=params.training.micro_batch_tokens,
        compute_dtype=params.training.compute_dtype,
        seed=params.sampling.seed,
        device="cuda" if on_gpu else "cpu",
        transport=transport_for(
            colocated=params.training.colocate, device="cuda" if on_gpu else "cpu"
        ),
        sync_backend="nccl" if on_gpu else "gloo",
        max_staleness=params.training.staleness_bound,
        probe=params.training.weight_sync_probe,
        sync_dtype=engine_dtype(model, backend, params.engines.engine_kwargs),
    )


def engine_nodes(pool: EnginePool) -> list[str | None]:
    """The nodes holding the engines' bundles (None: where is not known yet)."""
    group = pool.engines.placement.placement_group
    table = ray.util.placement_group_table(group).get("bundles_to_node_id") or {}
    return sorted(set(table.values())) or [None]
