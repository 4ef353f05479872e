"""Placement of engines on the cluster: the only module that creates or
removes placement groups.

An engine set is placed in one mode (`Placement`): on bundles of its own, on
a caller's placement group, or on one GPU with its trainer.

One placement group holds the whole engine set, one bundle per tensor-parallel
rank. The bundles of one engine must sit on one node (TP runs over NVLink /
shared memory), so bundle indices are grouped by node, the way OpenRLHF's
`get_bundle_indices` does, instead of assuming index order follows nodes.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from enum import Enum

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engines.client import collect, raise_first_error
from engines.errors import EngineSpecError, EngineTimeoutError
from engines.naming import placement_group_name

logger = logging.getLogger(__name__)

#: What vLLM takes for `gpu_memory_utilization=None` (EngineArgs, v0.26.0).
VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

# OpenRLHF's hybrid engine gives each colocated engine this share of a bundle's
# GPU, so the trainer's actor fits beside it on the same device.
COLOCATED_SHARE = 0.2


@dataclass
class EnginePlacement:
    """Where each engine goes: `bundles[i]` are engine i's bundle indices
    (spares' bundles follow the engines')."""

    placement_group: PlacementGroup
    bundles: list[list[int]]
    uses_gpu: bool
    owns_group: bool  # False for a caller's shared_pg: we never remove it
    #: The fraction of its bundle's GPU and CPU an engine actor takes: all of
    #: it on bundles of its own, less where actors share a bundle.
    share: float = 1.0
    #: Every engine and spare sits on bundle 0 beside their trainer, which
    #: takes a share of its own (`trainer_options`).
    with_trainer: bool = False

    @property
    def one_at_a_time(self) -> bool:
        """Engines may share a GPU, so they start one at a time
        (`startup.wait_turn`): placed with their trainer, or on bundles holding
        a fraction of a GPU (Ray may put several on one GPU)."""
        return self.uses_gpu and (
            self.with_trainer
            or any(spec.get("GPU", 0) < 1 for spec in self.placement_group.bundle_specs)
        )

    def trainer_options(self) -> dict:
        """Ray actor options that put the set's trainer on its GPU, beside
        the engines (`place_with_trainer`)."""
        if not self.with_trainer:
            raise EngineSpecError("these engines were not placed with a trainer")
        return {
            "num_cpus": self.share,
            "num_gpus": self.share if self.uses_gpu else 0.0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=0
            ),
        }

    def strategy(self, bundles: list[int]) -> PlacementGroupSchedulingStrategy:
        """Where an engine on `bundles` (one of `self.bundles`) goes."""
        return PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group,
            placement_group_bundle_index=bundles[0],
            # vLLM's Ray executor starts its TP workers as child tasks of the
            # engine actor: they must land in the same placement group.
            placement_group_capture_child_tasks=True,
        )


def check_cluster_fits(num_engines: int, tensor_parallel_size: int, uses_gpu: bool) -> None:
    """Raise before anything is created when the cluster cannot hold the engines."""
    resource = "GPU" if uses_gpu else "CPU"
    needed = num_engines * tensor_parallel_size
    have = ray.cluster_resources().get(resource, 0)
    if needed > have:
        raise EngineSpecError(
            f"num_engines={num_engines} x tensor_parallel_size={tensor_parallel_size} needs "
            f"{needed} {resource}s, but the cluster has {have:g}"
        )


def bundles_by_node(pg: PlacementGroup) -> dict[str, list[int]]:
    table = ray.util.placement_group_table(pg)
    by_node: dict[str, list[int]] = defaultdict(list)
    for index, node in sorted(table["bundles_to_node_id"].items()):
        by_node[node].append(int(index))
    return dict(by_node)


def assign_bundles(
    by_node: dict[str, list[int]], num_engines: int, tensor_parallel_size: int
) -> list[list[int]]:
    """Give each engine `tensor_parallel_size` bundles of a single node."""
    groups: list[list[int]] = []
    for node in sorted(by_node, key=lambda n: min(by_node[n])):
        indices = sorted(by_node[node])
        whole = len(indices) - len(indices) % tensor_parallel_size
        for start in range(0, whole, tensor_parallel_size):
            groups.append(indices[start : start + tensor_parallel_size])
    if len(groups) < num_engines:
        layout = {node[:8]: len(ix) for node, ix in by_node.items()}
        raise EngineSpecError(
            f"cannot place {num_engines} engines of tensor_parallel_size="
            f"{tensor_parallel_size} with each engine on one node; bundles per node: {layout}"
        )
    return groups[:num_engines]


def wait_ready(pg: PlacementGroup, timeout_s: float, what: str) -> None:
    (result,) = collect([pg.ready()], [f"placement group for {what}"], "scheduling", timeout_s)
    if isinstance(result.error, EngineTimeoutError):
        raise EngineTimeoutError(
            f"placement group for {what} was not scheduled within {timeout_s:g}s "
            f"(bundles {pg.bundle_specs}); the cluster lacks free resources"
        )
    raise_first_error([result])


def place_engines(
    *,
    num_engines: int,
    tensor_parallel_size: int,
    uses_gpu: bool,
    name_prefix: str,
    timeout_s: float,
    strategy: str = "PACK",
) -> EnginePlacement:
    """Create the engine set's placement group and assign bundles to engines."""
    check_cluster_fits(num_engines, tensor_parallel_size, uses_gpu)
    bundle = {"GPU": 1, "CPU": 1} if uses_gpu else {"CPU": 1}
    pg = placement_group(
        [dict(bundle) for _ in range(num_engines * tensor_parallel_size)],
        strategy=strategy,
        name=placement_group_name(name_prefix),
    )
    try:
        wait_ready(pg, timeout_s, f"engines {name_prefix}-*")
        bundles = assign_bundles(bundles_by_node(pg), num_engines, tensor_parallel_size)
    except BaseException:
        remove_placement_group(pg)
        raise
    logger.info("placement group %s: engine bundles %s", placement_group_name(name_prefix), bundles)
    return EnginePlacement(pg, bundles, uses_gpu, owns_group=True)


def place_with_trainer(
    *, num_engines: int, uses_gpu: bool, name_prefix: str, timeout_s: float
) -> EnginePlacement:
    """One bundle (one GPU, or one CPU) for the engines and their trainer
    together: each takes an equal share of it, and the trainer's weights reach
    the engines through CUDA IPC on that GPU. A share of a single bundle,
    not a bundle each: bundles with GPU fractions may land on different GPUs
    of one node, where CUDA IPC from the trainer's tensors does not reach."""
    check_cluster_fits(1, 1, uses_gpu)
    bundle = {"GPU": 1, "CPU": 1} if uses_gpu else {"CPU": 1}
    pg = placement_group([bundle], strategy="PACK", name=placement_group_name(name_prefix))
    try:
        wait_ready(pg, timeout_s, f"engines {name_prefix}-* and their trainer")
    except BaseException:
        remove_placement_group(pg)
        raise
    logger.info(
        "placement group %s: %d engines and their trainer on one %s",
        placement_group_name(name_prefix),
        num_engines,
        "GPU" if uses_gpu else "CPU",
    )
    return EnginePlacement(
        pg,
        [[0]] * num_engines,
        uses_gpu,
        owns_group=True,
        share=1.0 / (num_engines + 1),
        with_trainer=True,
    )


def use_shared_group(
    pg: PlacementGroup, *, num_engines: int, tensor_parallel_size: int, timeout_s: float
) -> EnginePlacement:
    """Place engines on a caller's placement group (colocation with a trainer)."""
    specs = pg.bundle_specs
    needed = num_engines * tensor_parallel_size
    if len(specs) < needed:
        raise EngineSpecError(
            f"shared_pg has {len(specs)} bundles; num_engines={num_engines} x "
            f"tensor_parallel_size={tensor_parallel_size} needs {needed}"
        )
    wait_ready(pg, timeout_s, "the shared placement group")
    bundles = assign_bundles(bundles_by_node(pg), num_engines, tensor_parallel_size)
    uses_gpu = all(spec.get("GPU", 0) > 0 for spec in specs)
    return EnginePlacement(pg, bundles, uses_gpu, owns_group=False, share=COLOCATED_SHARE)


def remove_named_groups(name_prefix: str) -> int:
    """Remove every live placement group named for this engine set; returns how many."""
    name = placement_group_name(name_prefix)
    removed = 0
    for pg_id, info in ray.util.placement_group_table().items():
        if info.get("name") == name and info.get("state") != "REMOVED":
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
            removed += 1
    return removed


class PlacementMode(Enum):
    #: A placement group of the set's own, one bundle per tensor-parallel rank.
    OWN_BUNDLES = "own bundles"
    #: A caller's placement group (OpenRLHF's `shared_pg`), a fraction of each
    #: bundle per engine, beside the caller's trainer; the caller keeps it.
    SHARED_GROUP = "shared group"
    #: One bundle of one GPU for the engines, spares and their trainer, an
    #: equal share each, as verl's hybrid engine (on-policy RL on one GPU);
    #: `EnginePlacement.trainer_options()` are the trainer's Ray options and
    #: weights go over CUDA IPC.
    WITH_TRAINER = "with trainer"


@dataclass(frozen=True)
class Placement:
    """Where an engine set goes: one mode, and the caller's group for
    `SHARED_GROUP` (only there)."""

    mode: PlacementMode = PlacementMode.OWN_BUNDLES
    group: PlacementGroup | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mode, PlacementMode):
            raise EngineSpecError(f"placement mode must be a PlacementMode, got {self.mode!r}")
        if (self.mode is PlacementMode.SHARED_GROUP) != (self.group is not None):
            raise EngineSpecError(
                f"placement {self.mode.value!r} takes a placement group if and only if it is "
                f"{PlacementMode.SHARED_GROUP.value!r}, got {self.group!r}"
            )

    @classmethod
    def of(cls, shared_pg: PlacementGroup | None, colocate_trainer: bool) -> Placement:
        """The mode `create_vllm_engines`' two flags (OpenRLHF's `shared_pg`,
        our `colocate_trainer`) name; they exclude each other."""
        if colocate_trainer and shared_pg is not None:
            raise EngineSpecError("colocate_trainer places the engines itself: drop shared_pg")
        if colocate_trainer:
            return cls(PlacementMode.WITH_TRAINER)
        if shared_pg is not None:
            return cls(PlacementMode.SHARED_GROUP, shared_pg)
        return cls()

    def check(
        self,
        engines: int,
        tensor_parallel_size: int,
        gpu_memory_utilization: float | None,
        backend: str,
    ) -> None:
        """`WITH_TRAINER`'s limits: one GPU holds every engine (spares
        included), each with `gpu_memory_utilization` of it, and the trainer."""
        if self.mode is not PlacementMode.WITH_TRAINER:
            return
        if tensor_parallel_size != 1:
            raise EngineSpecError(
                f"colocate_trainer puts every engine on one GPU: tensor_parallel_size must be 1, "
                f"got {tensor_parallel_size}"
            )
        if backend != "vllm":
            return
        fraction = gpu_memory_utilization or VLLM_DEFAULT_GPU_MEMORY_UTILIZATION
        if engines * fraction >= 1:
            raise EngineSpecError(
                f"colocate_trainer: {engines} engines (spares included) x gpu_memory_utilization="
                f"{fraction:g} fill the one GPU they share with the trainer; lower "
                "gpu_memory_utilization"
            )

    def place(
        self, *, num_engines: int, tensor_parallel_size: int, name_prefix: str, timeout_s: float
    ) -> EnginePlacement:
        """Reserve the bundles of `num_engines` engines (spares included)."""
        uses_gpu = ray.cluster_resources().get("GPU", 0) > 0
        if self.mode is PlacementMode.WITH_TRAINER:
            return place_with_trainer(
                num_engines=num_engines,
                uses_gpu=uses_gpu,
                name_prefix=name_prefix,
                timeout_s=timeout_s,
            )
        if self.mode is PlacementMode.SHARED_GROUP:
            return use_shared_group(
                self.group,
                num_engines=num_engines,
                tensor_parallel_size=tensor_parallel_size,
                timeout_s=timeout_s,
            )
        return place_engines(
            num_engines=num_engines,
            tensor_parallel_size=tensor_parallel_size,
            uses_gpu=uses_gpu,
            name_prefix=name_prefix,
            timeout_s=timeout_s,
        )
