"""LoRA adapter-only sync. The trainer sends an adapter's tensors
(peft names, e.g. `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`)
with its rank, alpha and target modules; the engines serve the base model
plus that adapter, through vLLM's runtime LoRA support (`engines/vllm/adapters.py`)
or peft on the CPU backend (`engines/hf/adapters.py`).

Each adapter version is a weight version. An engine keeps the adapters of
the last `keep` versions (`max_staleness + 1` under `in_flight`), so a
request runs to its end on the adapter of the version it was admitted
under; older ones are removed, each once no request runs on it.

How the tensors travel (`via`): `cuda_ipc` (colocated: one packed buffer of
the trainer's, mapped by the engines once and read again at every sync),
`checkpoint` (a peft adapter directory), `inline` (the adapter in the call
itself, as safetensors bytes: an adapter is megabytes, and the broadcast's
group is not worth it). No file round-trip on `cuda_ipc` and `inline`: the
engines build the adapter from the tensors they received.

A trainer written to vLLM's native API may send an adapter's tensors too
(`compat/vllm_native.py` hands them to `engine.load_adapter` /
`worker.worker_load`).

Not a transport: a layer over three of them. The adapter's shape, files
and the store each backend implements: `formats/adapter.py`. Trainer:
`sender.py` (`LoraSender`, chosen by `factory.new_sender` for a trainer of
an adapter). Engine actor: `engine.py` (`receive_lora_adapter`,
`release_lora_buffer`, `lora_adapters`, and the versions an engine keeps).
Worker: `worker.py` (the same names, into the worker's `AdapterStore`).
Their method table: `methods.py`, registered in `factory.py`.
"""
