"""The LoRA adapters' engine-actor and worker methods, by the name each is
called under: a `protocol.Transport` table, registered in `factory.py`
beside the transports' (`ADAPTER_METHODS`) though the adapter is not a
transport of its own (it rides on theirs), because the engine actor and
its workers answer these names as they answer a transport's, and
`begin_and_receive` may run its receive."""

from __future__ import annotations

from engines.weight_sync.lora.engine import lora_adapters, receive_lora_adapter, release_lora_buffer
from engines.weight_sync.lora.worker import (
    worker_lora_adapters,
    worker_receive_lora,
    worker_release_buffer,
)
from engines.weight_sync.protocol import Transport

TRANSPORT = Transport(
    "lora",
    engine_methods={
        "receive_lora_adapter": receive_lora_adapter,
        "release_lora_buffer": release_lora_buffer,
        "lora_adapters": lora_adapters,
    },
    worker_methods={
        "receive_lora_adapter": worker_receive_lora,
        "release_lora_buffer": worker_release_buffer,
        "lora_adapters": worker_lora_adapters,
    },
    one_call=("receive_lora_adapter",),
)
