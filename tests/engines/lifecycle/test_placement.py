"""Placement on a simulated multi-node cluster with fake GPUs."""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, remove_placement_group
from waiting import SETUP_TIMEOUT_S, wait_until

from engines import create_vllm_engines, destroy_engines
from engines.errors import EngineSpecError
from engines.lifecycle.placement import Placement, PlacementMode, assign_bundles


def test_assign_bundles_groups_by_node_not_by_index():
    # PACK may interleave nodes in index order; an engine must still stay on one node.
    by_node = {"node-a": [0, 2], "node-b": [1, 3]}
    assert assign_bundles(by_node, num_engines=2, tensor_parallel_size=2) == [[0, 2], [1, 3]]


def test_assign_bundles_refuses_to_split_an_engine_across_nodes():
    by_node = {"node-a": [0, 1, 2], "node-b": [3]}
    with pytest.raises(EngineSpecError, match="cannot place 2 engines of tensor_parallel_size=2"):
        assign_bundles(by_node, num_engines=2, tensor_parallel_size=2)


@pytest.fixture(scope="module")
def fake_gpu_cluster():
    """A head node without GPUs and two 2-GPU worker nodes (fake GPU resources)."""
    ray.shutdown()  # the session's local Ray, if a test started it
    # No node waits Ray's fixed 30 s for itself: all are awaited together on
    # the set-up deadline (a loaded box).
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0, "wait": False}
    )
    nodes = [cluster.add_node(num_cpus=2, num_gpus=2, wait=False) for _ in range(2)]
    cluster.wait_for_nodes(timeout=SETUP_TIMEOUT_S)
    ray.init(address=cluster.address)
    yield {node.node_id for node in nodes}
    ray.shutdown()
    cluster.shutdown()


def test_tp2_engines_get_bundles_on_one_node_each(fake_gpu_cluster, tiny_model):
    engines = create_vllm_engines(
        num_engines=2,
        pretrain=tiny_model,
        max_len=256,
        gpu_memory_utilization=0.5,
        tensor_parallel_size=2,
        name_prefix="test-tp2",
    )
    try:
        table = ray.util.placement_group_table(engines.placement.placement_group)
        assert all(spec == {"GPU": 1.0, "CPU": 1.0} for spec in table["bundles"].values())
        node_of = table["bundles_to_node_id"]
        healths = ray.get([e.health.remote() for e in engines], timeout=SETUP_TIMEOUT_S)
        for health, bundles in zip(healths, engines.placement.bundles, strict=True):
            assert len(bundles) == 2
            nodes = {node_of[b] for b in bundles}
            assert len(nodes) == 1, f"engine bundles {bundles} span nodes {nodes}"
            assert nodes <= fake_gpu_cluster  # GPU nodes, not the GPU-less head
            assert health["node_id"] in nodes  # the actor runs where its bundles are
            assert health["bundle_indices"] == bundles
        assert sorted(b for bundles in engines.placement.bundles for b in bundles) == [0, 1, 2, 3]
    finally:
        destroy_engines(engines)


def test_too_many_gpus_is_rejected(fake_gpu_cluster, tiny_model):
    with pytest.raises(EngineSpecError, match="needs 6 GPUs, but the cluster has 4"):
        create_vllm_engines(3, tiny_model, 256, 0.5, tensor_parallel_size=2, name_prefix="x")


def test_shared_pg_is_honoured_and_kept(fake_gpu_cluster, tiny_model):
    """Colocation: engines take a fraction of the caller's bundles, beside a trainer."""
    pg = placement_group([{"GPU": 1, "CPU": 1}] * 2, strategy="PACK")
    ray.get(pg.ready(), timeout=60)

    @ray.remote(num_gpus=0.5, num_cpus=0.5)
    class Trainer:
        def node(self):
            return ray.get_runtime_context().get_node_id()

    strategy = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(pg, 0)
    trainer = Trainer.options(scheduling_strategy=strategy).remote()
    engines = create_vllm_engines(
        2, tiny_model, 256, 0.3, shared_pg=pg, name_prefix="test-colocate"
    )
    try:
        healths = ray.get([e.health.remote() for e in engines], timeout=SETUP_TIMEOUT_S)
        assert [h["bundle_indices"] for h in healths] == [[0], [1]]
        node_of = ray.util.placement_group_table(pg)["bundles_to_node_id"]
        assert healths[0]["node_id"] == node_of[0] == ray.get(trainer.node.remote(), timeout=30)
        assert healths[1]["node_id"] == node_of[1]
    finally:
        destroy_engines(engines)
    # The caller's placement group survives the engines.
    assert ray.util.placement_group_table(pg)["state"] == "CREATED"
    ray.kill(trainer)
    remove_placement_group(pg)


def turn_ended(report) -> float | None:
    """When an engine's wait for its turn on a shared GPU ended (None: it had none)."""
    at = report.imports_started
    for phase in report.phases:
        at += phase.seconds
        if phase.name.startswith("its turn"):
            return at
    return None


def test_colocated_engines_and_their_trainer_share_one_gpu(fake_gpu_cluster, tiny_model):
    """colocate_trainer: one bundle of one GPU holds the engines, the spare
    and the trainer, a quarter each; the group goes with the engines."""
    engines = create_vllm_engines(
        2, tiny_model, 256, 0.3, spare_engines=1, colocate_trainer=True, name_prefix="test-coloc"
    )
    pg = engines.placement.placement_group
    try:
        assert ray.util.placement_group_table(pg)["bundles"] == {0: {"GPU": 1.0, "CPU": 1.0}}
        assert engines.placement.bundles == [[0], [0], [0]]

        @ray.remote
        class Trainer:
            def where(self):
                context = ray.get_runtime_context()
                return context.get_node_id(), context.get_assigned_resources()

        options = engines.placement.trainer_options()
        trainer = Trainer.options(**options).remote()
        node, resources = ray.get(trainer.where.remote(), timeout=60)
        assert resources == {"GPU": 0.25, "CPU": 0.25}
        healths = ray.get([e.health.remote() for e in engines], timeout=SETUP_TIMEOUT_S)
        spare = engines.spares[0].handle
        healths.append(ray.get(spare.health.remote(), timeout=SETUP_TIMEOUT_S))
        assert {h["node_id"] for h in healths} == {node}
        assert [h["bundle_indices"] for h in healths] == [[0], [0], [0]]
        # One GPU: each loads its model once the one before it is up.
        reports = ray.get([h.startup_report.remote() for h in [*engines, spare]], timeout=60)
        assert turn_ended(reports[0]) is None
        assert turn_ended(reports[1]) >= reports[0].ready_at - 0.01
        assert turn_ended(reports[2]) >= reports[1].ready_at - 0.01
    finally:
        destroy_engines(engines)
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    # The trainer was in the group: it goes with it. Ray kills a removed
    # group's actors asynchronously, so a call may still be answered first
    # (fresh-clone CI of 7f9faa3).
    wait_until(lambda: trainer_is_gone(trainer), 60, "the trainer to go with its group")


def trainer_is_gone(trainer) -> bool:
    try:
        ray.get(trainer.where.remote(), timeout=30)
    except ray.exceptions.RayActorError:
        return True
    return False


@pytest.mark.parametrize(
    ("engines", "tp", "fraction", "backend", "message"),
    [
        (1, 2, 0.3, "vllm", "tensor_parallel_size must be 1, got 2"),
        (2, 1, 0.5, "vllm", r"2 engines \(spares included\) x gpu_memory_utilization=0.5"),
        (1, 1, None, "vllm", None),  # vLLM's 0.9 leaves a tenth for the trainer
        (2, 1, None, "vllm", "gpu_memory_utilization=0.9 fill the one GPU"),
        (4, 1, 0.5, "hf", None),  # no GPU memory on CPU
    ],
)
def test_colocation_limits(engines, tp, fraction, backend, message):
    placement = Placement(PlacementMode.WITH_TRAINER)
    if message is None:
        placement.check(engines, tp, fraction, backend)
        return
    with pytest.raises(EngineSpecError, match=message):
        placement.check(engines, tp, fraction, backend)


def test_other_modes_have_no_colocation_limits():
    for placement in (Placement(), Placement(PlacementMode.SHARED_GROUP, "a group")):
        placement.check(4, 2, 0.9, "vllm")


@pytest.mark.parametrize(
    ("shared_pg", "colocate_trainer", "mode"),
    [
        (None, False, PlacementMode.OWN_BUNDLES),
        ("a group", False, PlacementMode.SHARED_GROUP),
        (None, True, PlacementMode.WITH_TRAINER),
    ],
)
def test_the_flags_name_one_mode(shared_pg, colocate_trainer, mode):
    placement = Placement.of(shared_pg, colocate_trainer)
    assert placement.mode is mode and placement.group == shared_pg


def test_a_shared_group_with_the_trainer_is_refused():
    with pytest.raises(EngineSpecError, match="drop shared_pg"):
        Placement.of("a group", colocate_trainer=True)


@pytest.mark.parametrize(
    ("mode", "group", "message"),
    [
        (PlacementMode.SHARED_GROUP, None, "'shared group' takes a placement group .* got None"),
        (PlacementMode.OWN_BUNDLES, "a group", "'own bundles' takes a placement group"),
        (PlacementMode.WITH_TRAINER, "a group", "'with trainer' takes a placement group"),
        ("colocated", None, "placement mode must be a PlacementMode, got 'colocated'"),
    ],
)
def test_a_mode_and_its_group_go_together(mode, group, message):
    with pytest.raises(EngineSpecError, match=message):
        Placement(mode, group)
