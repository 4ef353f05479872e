"""What an engine set is once started: `EngineSet`, the engines' actor handles
(a plain list to callers) with their configs, names and placement, and its
warm `Spare`s and its `Prepared` actors. The set's life
(`engines.lifecycle.engine_set`), its spares (`engines.lifecycle.spares`) and
its prepared actors (`engines.lifecycle.prepared`) work on these records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engines.config import EngineConfig
from engines.lifecycle.placement import EnginePlacement


@dataclass
class Spare:
    """A warm spare engine: started on bundles reserved for it and put to
    sleep once up; `asleep` is the ref of that sleep call (it completes when
    the spare is ready and asleep, or raises if it failed to start)."""

    handle: Any
    config: EngineConfig
    asleep: Any
    started_at: float


@dataclass
class Prepared:
    """A prepared actor: imports done, no engine until it takes a lost
    engine's place (`engines.lifecycle.prepared`); `bundle` is where it sits
    (on that bundle's node, holding none of it), `up` the ref of its start,
    done once its imports are."""

    handle: Any
    name: str
    bundle: int
    up: Any


class EngineSet(list):
    """The engine handles (a plain list to callers), plus what it takes to find
    and clean them up: names, namespace and placement group; and the warm
    spares and prepared actors, outside the list."""

    def __init__(
        self,
        handles: list[Any],
        *,
        configs: list[EngineConfig],
        name_prefix: str,
        namespace: str,
        backend: str,
        placement: EnginePlacement,
    ):
        super().__init__(handles)
        self.configs = configs
        self.names = [config.name for config in configs]
        self.name_prefix = name_prefix
        self.namespace = namespace
        self.backend = backend
        self.placement = placement
        # What spares are made from: the first engine's config as created
        # (engine i samples with seed `template.seed + i`).
        self.template = configs[0] if configs else None
        self.spares: list[Spare] = []
        self.prepared: list[Prepared] = []
        # The next actor name index: spares and their successors are named
        # `<prefix>-<i>` past the engines, so sweeps by name find them too.
        self.next_index = len(handles)

    def up(self) -> list[Any]:
        """Refs done once every engine is up and every spare asleep: what
        starts on their GPU after them waits for these (their outcome does
        not matter: a failed engine frees its memory too)."""
        return [handle.ready.remote() for handle in self] + [spare.asleep for spare in self.spares]

    @property
    def api_key(self) -> str | None:
        """The bearer token of the engines' OpenAI endpoints (None when off)."""
        return self.template.api_key if self.template else None
