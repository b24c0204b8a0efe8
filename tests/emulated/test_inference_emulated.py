"""The inference engine, its sampler, tensor parallelism and `phalanx serve` under the emulated GPU
(`PHALANX_EMULATE_GPU=1`): the engine runs on `cuda:0` (emulated), with the Triton kernels through
the interpreter, the NCCL-path backend for TP=2, and device checks enforced. The existing tests run
unchanged in one child pytest; the sampler's sync bound (one device -> host sync per step, not one
per sampled row) runs only there, since it counts syncs on the emulated device."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from emulated_run import pytest_emulated  # noqa: E402

ENGINE = "tests/framework/test_inference_engine.py::"
SAMPLER = "tests/framework/test_inference_sampler.py::"
NODE_IDS = [
    # greedy tokens == transformers' generate (llama through the Triton decode kernel, mistral's window)
    ENGINE + "test_greedy_tokens_match_transformers_for_a_mixed_length_batch[llama]",
    ENGINE + "test_greedy_tokens_match_transformers_for_a_mixed_length_batch[mistral]",
    ENGINE + "test_preemption_recomputes_to_the_same_tokens_and_leaks_no_block",
    ENGINE + "test_chunked_prefill_and_prefix_cache_give_the_same_tokens",
    ENGINE + "test_logprobs_match_the_model_and_seeded_sampling_repeats",
    ENGINE + "test_speculative_decoding_keeps_greedy_tokens",
    SAMPLER + "test_temperature_top_k_top_p_match_transformers_warpers",
    SAMPLER + "test_seeded_rows_are_independent_of_the_batch",
    SAMPLER + "test_banned_tokens_and_logprobs",
    SAMPLER + "test_presence_and_frequency_penalties_follow_openai_rule_by_hand",
    SAMPLER + "test_a_batch_of_sampled_rows_syncs_with_the_host_once",
    SAMPLER + "test_speculative_acceptance_of_a_whole_batch_at_once",
    "tests/framework/test_inference_tp.py::test_tp2_matches_tp1",
    "tests/framework/test_inference_server.py::test_completion_matches_the_engine",
    "tests/framework/test_openai_client.py::test_completion_greedy_equals_the_engine",
    # structured output: the grammar mask made on the host, applied to the device's logits
    "tests/framework/test_inference_structured.py::test_constrained_and_unconstrained_requests_in_one_batch",
    "tests/framework/test_inference_structured.py::test_json_object_and_streaming_over_http",
    # speculative decoding for constrained requests: drafted positions masked on the device, rollback
    "tests/framework/test_inference_structured.py::test_constrained_requests_speculate_with_their_greedy_tokens[small]",
    # n-gram speculation: proposals from the sequence verified on the device
    "tests/framework/test_inference_ngram.py::test_ngram_speculation_keeps_greedy_tokens_in_fewer_steps",
    # LoRA: base and two adapters in one batch, the batched low-rank deltas on the device
    "tests/framework/test_inference_lora.py::test_a_mixed_batch_equals_each_adapters_merged_model",
    "tests/framework/test_inference_lora.py::test_the_fused_low_rank_stack_adds_each_tokens_own_adapter",
    "tests/framework/test_inference_lora.py::test_tensor_parallel_adapters_equal_the_merged_model",
    "tests/framework/test_inference_lora.py::test_a_draft_model_speculates_for_adapter_requests_with_their_greedy_tokens",
    # the one decoder definition, run with the compiled step's pieces (spies: nothing compiles)
    "tests/framework/test_inference_speed_paths.py::test_compiled_step_runs_the_one_decoder_with_its_pieces",
    # captured decode steps' buffers, padding and scratch block on the device (replayed eagerly: no graphs here)
    "tests/framework/test_inference_cuda_graphs.py::test_captured_decode_steps_give_the_tokens_of_the_normal_path[llama]",
    "tests/framework/test_inference_cuda_graphs.py::test_a_narrow_step_after_a_wide_one_writes_only_its_own_slots",
    "tests/framework/test_inference_cuda_graphs.py::test_lora_adapters_in_captured_steps_give_each_merged_models_tokens",
]


TRITON = NODE_IDS[0]  # greedy llama: the engine's attention / norm / MLP through Triton's interpreter


@pytest.mark.slow
def test_engine_runs_its_triton_kernels_on_the_emulated_gpu():
    out = pytest_emulated(TRITON, PHALANX_EMULATE_TRITON="1")
    assert "1 passed" in out, out[-3000:]


@pytest.mark.slow
def test_inference_under_the_emulated_gpu():
    # the kernels' references here (the emulator's default): through the interpreter this took 13 minutes
    out = pytest_emulated(*NODE_IDS[1:])
    assert " passed" in out and "skipped" not in out, out[-3000:]
