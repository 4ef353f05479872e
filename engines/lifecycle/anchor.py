"""The anchor of an engine started in a prepared actor
(`engines.lifecycle.prepared`): a small actor that holds the lost engine's
resources on its bundle, so Ray's accounting stays exact, and tells which
GPU Ray gave them. Started by the prepared actor itself, so Ray ends it with
that actor, however that ends."""

from __future__ import annotations

import os


class Anchor:
    """Holds its resources for as long as it lives; does nothing else."""

    def devices(self) -> str | None:
        return os.environ.get("CUDA_VISIBLE_DEVICES")
