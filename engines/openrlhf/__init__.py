"""OpenRLHF compatibility: its engine-set API (`create_vllm_engines`,
`batch_vllm_engine_call`, in `vllm_engine` as in OpenRLHF) over our engine
sets, and its agent rollouts (`agent_func_path`) run inside our engine
actors by OpenRLHF's own executor (`agents`)."""

from engines.openrlhf.vllm_engine import batch_vllm_engine_call, create_vllm_engines

__all__ = ["batch_vllm_engine_call", "create_vllm_engines"]
