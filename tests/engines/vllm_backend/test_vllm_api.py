"""vLLM's outputs as ours (engines/vllm/api.py), with stand-ins for vLLM's
types: CI has no vLLM."""

from __future__ import annotations

from types import SimpleNamespace

from engines.vllm.api import padded_vocab_rows, request_output


def completion(index: int, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        index=index,
        token_ids=tuple(tokens),
        text=f"text {index}",
        finish_reason="length",
        logprobs=None,
        cumulative_logprob=-1.5,
        stop_reason=None,
    )


def test_a_final_vllm_output_becomes_ours_in_sample_order():
    final = SimpleNamespace(
        outputs=[completion(1, [7]), completion(0, [5, 6])],
        prompt_logprobs=None,
        num_cached_tokens=3,
    )
    output = request_output(final, "r-1", (1, 2), "e-0")
    assert [c.index for c in output.outputs] == [0, 1]
    assert output.outputs[0].token_ids == [5, 6] and output.outputs[0].text == "text 0"
    assert (output.request_id, output.prompt_token_ids, output.engine) == ("r-1", [1, 2], "e-0")
    assert output.num_cached_tokens == 3
    assert output.weight_versions == [output.weight_version] == [0]  # stamped by the caller


def test_vocabulary_rows_are_padded_to_a_multiple_of_64():
    assert [padded_vocab_rows(v) for v in (1, 64, 65, 259)] == [64, 64, 128, 320]
