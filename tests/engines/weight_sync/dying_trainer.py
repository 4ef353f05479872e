"""A trainer process that starts a bucketed sync with rolloutflow's sender
and dies part-way (after sending some buckets), as a crashed trainer would.
Run by test_sync_into_engines.py as a separate process.

    python dying_trainer.py GCS_ADDRESS NAMESPACE ENGINE_NAMES BUCKETS_BEFORE_DEATH
"""

from __future__ import annotations

import logging
import os
import sys

import ray
import torch

from engines.weight_sync import BroadcastSender, Manifest, SyncConfig
from engines.weight_sync.formats.manifest import torch_dtype

logger = logging.getLogger("dying_trainer")


def main() -> None:
    gcs_address, namespace, names, buckets = sys.argv[1:5]
    # stdout: the test reads how far we got.
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    torch.set_num_threads(1)
    ray.init(address=gcs_address, namespace=namespace, log_to_driver=False)
    engines = [ray.get_actor(name) for name in names.split(",")]
    manifest = Manifest.model_validate(ray.get(engines[0].weight_manifest.remote(), timeout=60))
    generator = torch.Generator().manual_seed(99)
    weights = [
        (p.name, torch.randn(p.shape, generator=generator).to(torch_dtype(p.dtype)))
        for p in manifest.params
    ]
    version = ray.get(engines[0].health.remote(), timeout=60)["weight_version"] + 1
    config = SyncConfig(bucket_bytes=16 * 1024, timeout_s=10.0, on_failure="restore")
    sender = BroadcastSender(config)
    sender.init(engines)
    transfer = sender.start(weights, version)
    transfer.send(int(buckets))
    logger.info("sent %d of %d buckets; dying", transfer.sent, len(transfer.plan.buckets))
    sys.stdout.flush()
    os._exit(17)


if __name__ == "__main__":
    main()
