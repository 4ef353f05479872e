"""The engine actor's weights outside a sync (`EngineWeights`) on a fake
engine: the manifests it accepts."""

from __future__ import annotations

import pytest
import torch
from fake_engine import run

from engines.weight_sync.errors import ManifestMismatchError
from engines.weight_sync.formats.manifest import Manifest
from engines.weight_sync.transports import checkpoint


def test_an_accepted_manifest_is_not_asked_of_the_workers_again(engine, new_weights):
    path, _ = new_weights
    manifest = checkpoint.read_manifest(path).model_dump(mode="json")
    asked = []
    check = engine.worker.weight_manifest_problems
    engine.worker.weight_manifest_problems = lambda *args: asked.append(args) or check(*args)

    async def begin_and_abort(version, manifest):
        await engine.begin_weight_sync(version, manifest)
        await engine.abort_weight_sync()

    run(begin_and_abort(1, manifest))
    run(begin_and_abort(1, manifest))
    assert len(asked) == 1  # remembered
    wrong = Manifest.of([("weight", torch.zeros(4, 3)), ("bias", torch.zeros(3))])
    with pytest.raises(ManifestMismatchError, match="'weight'"):
        run(engine.begin_weight_sync(1, wrong.model_dump(mode="json")))
    assert len(asked) == 2  # a new manifest is still checked, and still refused
