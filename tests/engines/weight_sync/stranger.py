"""A process that is not part of the run, reaching a weight group's
rendezvous port: it reads every key it can list, then claims `rank` with the
group layout a trainer without a secret uses (OpenRLHF's helper) and waits
for a broadcast of `numel` floats.

    stranger.py HOST PORT GROUP_NAME WORLD_SIZE RANK NUMEL TIMEOUT_S

Prints `connected` once its store client is up, then what it read, then
`joined <sum>` if it received a broadcast, or `refused: <error>`.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
from torch.distributed import BroadcastOptions, PrefixStore, ProcessGroupGloo, TCPStore


def main() -> None:
    host, port, name, world, rank, numel, timeout_s = sys.argv[1:]
    timeout = timedelta(seconds=float(timeout_s))
    store = TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
    print("connected", flush=True)
    keys = store.list_keys()
    values = [store.get(k) for k in keys]
    print(f"read {len(keys)} keys, {sum(len(v) for v in values)} bytes", flush=True)
    try:
        layout = PrefixStore("cpu/", PrefixStore(f"{name}/", PrefixStore(name, store)))
        group = ProcessGroupGloo(layout, int(rank), int(world), timeout)
        tensor = torch.zeros(int(numel))
        options = BroadcastOptions()
        options.rootRank, options.rootTensor, options.timeout = 0, 0, timeout
        group.broadcast([tensor], options).wait(timeout)
    except Exception as exc:  # noqa: BLE001 - the outcome is the output
        print(f"refused: {str(exc).splitlines()[0]}", flush=True)
        return
    print(f"joined {tensor.sum().item()}", flush=True)


if __name__ == "__main__":
    main()
