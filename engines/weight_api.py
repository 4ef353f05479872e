"""The weight-sync methods of the engine actor, written on a class its
backends inherit (`RolloutEngine(WeightApi, ...)`).

The engine actor composes a `WeightSync` (`engines/weight_sync/session.py`)
as `self.weights`; Ray only calls methods defined on the actor's class. The
session's own methods are named below, each a `delegate` of the
`WeightSync` method of that name: the class body is where a reader (and a
type checker, through `delegate`'s typing) finds them. Only the registered
transports' methods (OpenRLHF's `init_process_group` is the session's own;
OpenRLHF's `update_weight`, `update_weight_cuda_ipc`; vLLM's
`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
`finish_weight_update`; ours) are added from the registry, so a transport
stays one module. Every method keeps its target's signature and docstring
(`functools.wraps`), so Ray checks the arguments on the caller's side as for
a method written out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

from engines.weight_sync.factory import add_transport_methods
from engines.weight_sync.session import WeightSync

P = ParamSpec("P")
R = TypeVar("R")


def delegate(
    function: Callable[Concatenate[Any, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[Any, P], Coroutine[Any, Any, R]]:
    """An engine-actor method that awaits `function(self.weights, ...)`."""

    @functools.wraps(function)
    async def method(self: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        return await function(self.weights, *args, **kwargs)

    return method


class WeightApi:
    """The weight-sync methods every engine actor answers (see
    docs/weight_sync.md); the class that inherits it sets `self.weights`."""

    weights: WeightSync

    # Inspection
    weight_manifest = delegate(WeightSync.weight_manifest)
    check_weight_manifest = delegate(WeightSync.check_weight_manifest)
    weight_checksums = delegate(WeightSync.weight_checksums)
    read_weights = delegate(WeightSync.read_weights)
    weight_status = delegate(WeightSync.weight_status)
    # The weight group (OpenRLHF's `init_process_group`)
    init_process_group = delegate(WeightSync.init_process_group)
    destroy_weight_group = delegate(WeightSync.destroy_weight_group)
    has_weight_group = delegate(WeightSync.has_weight_group)
    weight_worker_nodes = delegate(WeightSync.weight_worker_nodes)
    # The two-phase session
    begin_weight_sync = delegate(WeightSync.begin_weight_sync)
    begin_and_receive = delegate(WeightSync.begin_and_receive)
    verify_weight_sync = delegate(WeightSync.verify_weight_sync)
    finish_weight_sync = delegate(WeightSync.finish_weight_sync)
    abort_weight_sync = delegate(WeightSync.abort_weight_sync)


add_transport_methods(WeightApi, "engine_methods", delegate)
