"""The engine actor's weight-sync methods: the session's written on
`WeightApi`, each transport's added from the registry, all with their
targets' signatures (what Ray checks a call's arguments against)."""

from __future__ import annotations

import inspect

from engines.base import RolloutEngine
from engines.weight_api import WeightApi
from engines.weight_sync.factory import transports
from engines.weight_sync.session import WeightSync
from engines.weight_sync.worker import WorkerWeights
from engines.worker_extension import WeightSyncWorkerExtension

SESSION_METHODS = {
    "weight_manifest",
    "check_weight_manifest",
    "weight_checksums",
    "read_weights",
    "weight_status",
    "init_process_group",
    "destroy_weight_group",
    "has_weight_group",
    "weight_worker_nodes",
    "begin_weight_sync",
    "begin_and_receive",
    "verify_weight_sync",
    "finish_weight_sync",
    "abort_weight_sync",
}


def test_the_session_methods_are_written_on_the_class():
    written = {n for n in WeightApi.__dict__ if not n.startswith("_")} - {
        n for t in transports() for n in t.engine_methods
    }
    assert written == SESSION_METHODS
    assert issubclass(RolloutEngine, WeightApi)


def test_every_method_keeps_its_targets_signature():
    for name in SESSION_METHODS:
        method = getattr(RolloutEngine, name)
        assert inspect.iscoroutinefunction(method), name
        assert inspect.signature(method) == inspect.signature(getattr(WeightSync, name)), name
    for transport in transports():
        for name, function in transport.engine_methods.items():
            method = getattr(RolloutEngine, name)
            assert inspect.signature(method) == inspect.signature(function), name


def test_the_worker_router_answers_every_name():
    for transport in transports():
        for name in transport.worker_methods:
            assert callable(getattr(WeightSyncWorkerExtension, name)), name
    assert inspect.signature(WeightSyncWorkerExtension.end_weight_sync) == inspect.signature(
        WorkerWeights.end_weight_sync
    )
