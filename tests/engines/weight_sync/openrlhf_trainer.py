"""An outside trainer that speaks only torch.distributed (gloo) and
OpenRLHF's engine-actor methods: no rolloutflow import. Run by
test_sync_into_engines.py as a separate process.

It builds its weight group with OpenRLHF's helper (copied below from
openrlhf/utils/distributed_util.py: torch.distributed pieces under a
`PrefixStore(group_name)`), then runs OpenRLHF's broadcast loop: per
parameter, `update_weight.remote(...)` on every engine, `broadcast` from rank
0, wait; `empty_cache=True` on the last one.

    python openrlhf_trainer.py GCS_ADDRESS NAMESPACE ENGINE_NAMES MODEL_DIR OUT [--die-after K]

Writes the weights it sent to OUT (torch.save). With --die-after K it exits
abruptly after announcing parameter K+1, while the engines wait for its bytes.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from datetime import timedelta

import ray
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.distributed_c10d import (
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)


def init_process_group(backend, init_method, timeout, world_size, rank, group_name):
    """OpenRLHF's helper: a process group that is not the default group."""
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], backend, store, group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("gcs_address")
    parser.add_argument("namespace")
    parser.add_argument("engine_names")
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("--die-after", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    ray.init(address=args.gcs_address, namespace=args.namespace, log_to_driver=False)
    engines = [ray.get_actor(name) for name in args.engine_names.split(",")]

    # "Training": the checkpoint's weights plus seeded noise.
    weights = load_file(os.path.join(args.model_dir, "model.safetensors"))
    generator = torch.Generator().manual_seed(1234)
    params = []
    for name in sorted(weights):
        tensor = weights[name]
        params.append((name, tensor + 0.01 * torch.randn(tensor.shape, generator=generator)))
    torch.save(dict(params), args.out)

    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    address = ray.util.get_node_ip_address()
    world_size = len(engines) + 1
    refs = [
        engine.init_process_group.remote(
            address, port, i + 1, world_size, "openrlhf", backend="gloo", use_ray=False
        )
        for i, engine in enumerate(engines)
    ]
    group = init_process_group(
        "gloo", f"tcp://{address}:{port}", timedelta(seconds=30), world_size, 0, "openrlhf"
    )
    ray.get(refs, timeout=60)

    for count, (name, param) in enumerate(params, start=1):
        refs = [
            engine.update_weight.remote(
                name, dtype=param.dtype, shape=param.shape, empty_cache=count == len(params)
            )
            for engine in engines
        ]
        if args.die_after is not None and count > args.die_after:
            # Give Ray time to deliver the calls, so the engines are inside the
            # collective, waiting for this parameter's bytes, when we die.
            time.sleep(2)
            os._exit(17)
        dist.broadcast(param.data, 0, group=group)
        ray.get(refs, timeout=60)
    ray.get([engine.reset_prefix_cache.remote() for engine in engines], timeout=60)


if __name__ == "__main__":
    main()
