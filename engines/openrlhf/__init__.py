"""OpenRLHF compatibility: its engine-set API (`create_vllm_engines`,
`batch_vllm_engine_call`, in `vllm_engine` as in OpenRLHF, exported from
`engines`) over our engine sets, and its agent rollouts (`agent_func_path`)
run inside our engine actors by OpenRLHF's own executor (`agents`; the
executor file's check and loading in `executor`).

Nothing is imported here: the engine-set spec imports `executor`, and
`vllm_engine` imports the spec, so importing it here would go round a circle.
"""
