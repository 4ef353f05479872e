"""The trainer of the GPU weight-sync tests and benchmark: the reference
policy (training/policy.py) on a GPU, in the engines' serving dtype."""

from __future__ import annotations

import sys
from typing import Any

from policy_probes import PolicyProbes

from engines.weight_sync.formats import ipc_handles as ipc
from training.config import PolicyConfig
from training.policy import ReferencePolicy


class BF16Policy(PolicyProbes, ReferencePolicy):
    def __init__(self, config: PolicyConfig | dict):
        import torch

        super().__init__(config)
        # ReferencePolicy loads float32; bf16 engines accept weights in their
        # serving dtype only (their manifest says bf16).
        self.model.to(torch.bfloat16)

    def gpu_uuid(self) -> str:
        import torch

        return ipc.gpu_uuid(torch.cuda.current_device())

    def fp8_sequence_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """`sequence_logprobs` with the decoder's linear layers computed as
        vLLM 0.26's online FP8 computes them (`Fp8PerTensorOnlineLinearMethod`
        with CUTLASS, as on an H200): e4m3 weights with one scale per tensor
        vLLM holds (q/k/v fused into one, gate/up into one), e4m3 activations
        with one scale per token, products summed in fp32, output in bf16.
        The head and embeddings stay bf16, as vLLM leaves them."""
        linears = fp8_linears(self.model)
        try:
            for module, weight in linears.items():
                module.forward = fp8_forward(weight)
            return self.sequence_logprobs(sequences)
        finally:
            for module in linears:
                del module.forward  # back to the class's forward

    def sync_with_vllm_api(self, engines: list[Any], packed: bool = False) -> None:
        """Sync as a trainer written to vLLM 0.26's docs does (CUDA IPC
        backend, vLLM's own client and trainer code, nothing of ours)."""
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

        client = RayVLLMWeightSyncClient(list(engines))
        client.init_weight_transfer_engine({})
        client.start_weight_update()
        IPCWeightTransferEngine.trainer_send_weights(
            iter(list(self.model.named_parameters())),
            {"send_mode": "ray", "llm_handle": list(engines), "packed": packed},
        )
        client.finish_weight_update()


#: vLLM's fused linear layers: their HF parts share one FP8 weight scale.
FUSED_LINEARS = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def fp8_round(tensor: Any, scale: Any) -> Any:
    """`tensor` rounded to e4m3 at `scale` (vLLM's `scaled_fp8_quant`), in fp32."""
    import torch

    return (tensor.float() / scale).to(torch.float8_e4m3fn).float() * scale


def fp8_linears(model: Any) -> dict[Any, Any]:
    """Each decoder linear layer (not the head) -> its weight rounded to e4m3
    with the scale of the tensor vLLM fuses it into (amax / 448)."""
    import torch

    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    groups: dict[str, list[tuple[Any, Any]]] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
            parent, _, leaf = name.rpartition(".")
            groups.setdefault(f"{parent}.{FUSED_LINEARS.get(leaf, leaf)}", []).append(
                (module, module.weight.detach())
            )
    rounded = {}
    for members in groups.values():
        scale = max(float(w.abs().max()) for _, w in members) / fp8_max
        rounded.update({module: fp8_round(w, scale) for module, w in members})
    return rounded


def fp8_forward(weight: Any):
    """A linear layer's forward with per-token e4m3 activations."""
    import torch

    fp8_max = torch.finfo(torch.float8_e4m3fn).max

    def forward(x: Any) -> Any:
        scale = (x.abs().amax(dim=-1, keepdim=True).float() / fp8_max).clamp(min=1e-12)
        return (fp8_round(x, scale) @ weight.t()).to(x.dtype)

    return forward


def start_bf16_policy(pretrain: str, **options: Any):
    """BF16Policy as a Ray actor (`options`: num_gpus, scheduling_strategy, ...)."""
    import ray

    # Ray pickles classes by reference and its workers cannot import this
    # directory (tests/gpu) nor tests/: ship these modules' code by value instead.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(sys.modules[PolicyProbes.__module__])
    config = PolicyConfig(pretrain=pretrain, device="cuda", sync_timeout_s=120.0)
    return ray.remote(BF16Policy).options(max_restarts=0, **options).remote(config.model_dump())
