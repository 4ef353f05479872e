"""The weight-sync methods of the engine actor.

The engine actor composes a `WeightSync` (`engines/weight_sync/session.py`)
as `self.weights`; Ray only calls methods defined on the actor's class, so
`with_weight_methods` gives the class one thin delegating method per name:
the session's own (`begin_weight_sync`, `finish_weight_sync`, ...) and every
registered transport's (OpenRLHF's `init_process_group`, `update_weight`,
`update_weight_cuda_ipc`; vLLM's `init_weight_transfer_engine`,
`start_weight_update`, `update_weights`, `finish_weight_update`; ours). Each
keeps its target's signature and docstring, so Ray checks the arguments on
the caller's side as for a method written out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from engines.weight_sync.protocol import transports
from engines.weight_sync.session import CORE_ENGINE_METHODS, WeightSync


def engine_methods() -> dict[str, Callable[..., Any]]:
    """Every weight method of the engine actor: name -> function taking the
    `WeightSync` first."""
    methods: dict[str, Callable[..., Any]] = {
        name: getattr(WeightSync, name) for name in CORE_ENGINE_METHODS
    }
    for transport in transports():
        for name, function in transport.engine_methods.items():
            if name in methods:
                raise TypeError(f"transport {transport.name!r} registers {name!r} twice")
            methods[name] = function
    return methods


def _delegate(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    async def method(self, *args: Any, **kwargs: Any) -> Any:
        return await function(self.weights, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


def with_weight_methods(cls: type) -> type:
    """Class decorator: the engine class answers every weight method by
    delegating to its `weights` (a `WeightSync`, made in its __init__).
    Methods the class defines itself are left alone."""
    for name, function in engine_methods().items():
        if name not in cls.__dict__:
            setattr(cls, name, _delegate(name, function))
    return cls
