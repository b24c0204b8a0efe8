"""Tensor-parallel inference: TP=2 over gloo gives the tokens of TP=1 (Llama; Qwen2 with tied
embeddings, q/k/v biases and a vocabulary that does not split evenly), with speculative decoding
and a weight reload on top. One spawn runs every case (starting ranks costs seconds)."""
from __future__ import annotations

import pytest
import torch

import inference_models as im
from inference_tp_workers import tp_generate
from phalanx.inference import LLM, SamplingParams
from phalanx.testing import Diff, check, rounding_rtol, spawn

# A log-prob is a logit minus the log-sum-exp over the vocabulary, so its fp32 error is absolute,
# in units of the logits' magnitude: rounding_rtol over the longest reduction (the vocabulary).
LOGPROB_RTOL = rounding_rtol(torch.float32, im.VOCAB + 1)


def _logit_scale(model, prompts) -> float:
    with torch.no_grad():
        return max(model(input_ids=torch.tensor([p])).logits.abs().max().item() for p in prompts)


def test_tp2_matches_tp1(tmp_path):
    tok = im.make_tokenizer()
    llama, llama_model = im.save_model(tmp_path / "llama", "llama", tokenizer=tok)
    qwen, qwen_model = im.save_model(tmp_path / "qwen2", "qwen2", tokenizer=tok, vocab_size=im.VOCAB + 1)
    draft, _ = im.save_model(tmp_path / "draft", "llama", num_hidden_layers=1, tokenizer=tok)
    looping, looping_model, _ = im.save_looping_model(tmp_path / "looping")
    other = im.make_model("llama", seed=21)
    torch.save(other.state_dict(), tmp_path / "other.pt")
    prompts = im.mixed_prompts(4, seed=12, low=3, high=40)
    cases = [
        {"path": str(llama), "prompts": prompts, "new_tokens": 16, "reload": str(tmp_path / "other.pt")},
        {"path": str(qwen), "prompts": prompts, "new_tokens": 16},
        {"path": str(llama), "prompts": prompts[:2], "new_tokens": 12, "draft": str(draft)},
        # n-gram proposals of mixed lengths: the driver's verification steps, batched by length
        {"path": str(looping), "prompts": prompts, "new_tokens": 16, "ngram": 2},
    ]
    scales = {str(llama): _logit_scale(llama_model, prompts), str(qwen): _logit_scale(qwen_model, prompts),
              str(looping): _logit_scale(looping_model, prompts)}
    ranks = spawn(tp_generate, 2, cases, timeout=300)
    accepted = [result.pop("accepted") for result in ranks[0]]  # (the driver's speculator counts them)
    assert all(result.pop("accepted") is None for result in ranks[1])
    assert ranks[0] == ranks[1], "TP ranks returned different outputs"
    got = ranks[0]
    params = SamplingParams(max_new_tokens=16, temperature=0, logprobs=1)
    for case, result, proposals_accepted in zip(cases, got, accepted, strict=True):
        one = LLM(case["path"], num_blocks=64, block_size=8, dtype="float32")
        want = one.generate(case["prompts"], SamplingParams(max_new_tokens=case["new_tokens"], temperature=0, logprobs=1))
        assert result["tokens"] == [o.token_ids for o in want]
        what = f"{case['path'].rsplit('/', 1)[-1]}{' with a draft' if case.get('draft') else ''}"
        if case.get("ngram"):
            assert proposals_accepted >= 20, proposals_accepted  # proposals verified by both ranks
        for i, (a, b) in enumerate(zip(result["logprobs"], [o.logprobs for o in want], strict=True)):
            worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
            check(Diff(worst / scales[case["path"]], f"prompt {i}"), LOGPROB_RTOL,
                  f"{what}: log-probs (relative to the logits' magnitude {scales[case['path']]:.3g})")
        if case.get("reload"):
            one.load_weights(other.state_dict())
            assert result["reloaded"] == [o.token_ids for o in one.generate(case["prompts"], params)]
    # each rank holds half of the heads: q 4 heads, k and v 2 heads of 16 -> (2 + 1 + 1) * 16 rows
    assert got[0]["shard"] == (64, 64)


@pytest.mark.slow  # two ranks, three models: 40-80 s on 2 busy cores
def test_tp2_matches_tp1_for_qwen3_gpt2_and_opt(tmp_path):
    """The families whose weights load differently under TP (Qwen3's replicated q/k norms, GPT-2's
    fused and transposed c_attn with an odd vocabulary, OPT's biases and position table): TP=2
    gives one process's tokens and log-probs."""
    tok = im.make_tokenizer()
    made = {"qwen3": im.save_model(tmp_path / "qwen3", "qwen3", tokenizer=tok),
            "gpt2": im.save_model(tmp_path / "gpt2", "gpt2", tokenizer=tok, vocab_size=im.VOCAB + 1),
            "opt": im.save_model(tmp_path / "opt", "opt", tokenizer=tok)}
    prompts = im.mixed_prompts(3, seed=13, low=3, high=40)
    cases = [{"path": str(path), "prompts": prompts, "new_tokens": 12} for path, _ in made.values()]
    ranks = spawn(tp_generate, 2, cases, timeout=300)
    accepted = [result.pop("accepted") for result in ranks[0]]  # (the driver's speculator counts them)
    assert all(result.pop("accepted") is None for result in ranks[1])
    assert ranks[0] == ranks[1], "TP ranks returned different outputs"
    for (family, (path, model)), result in zip(made.items(), ranks[0], strict=True):
        want = LLM(str(path), num_blocks=64, block_size=8, dtype="float32").generate(
            prompts, SamplingParams(max_new_tokens=12, temperature=0, logprobs=1))
        assert result["tokens"] == [o.token_ids for o in want], family
        scale = _logit_scale(model, prompts)
        for i, (a, b) in enumerate(zip(result["logprobs"], [o.logprobs for o in want], strict=True)):
            worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
            check(Diff(worst / scale, f"prompt {i}"), rounding_rtol(torch.float32, im.VOCAB + 2),
                  f"{family}: log-probs (relative to the logits' magnitude {scale:.3g})")
    # GPT-2, 4 heads of 16: each rank's q, k and v are 2 heads -> 3 * 32 rows of the fused c_attn
    assert ranks[0][1]["shard"] == (96, 64)


@pytest.mark.slow  # 2 then 4 ranks: ~40 s on 2 busy cores
def test_replicated_kv_heads_match_transformers(tmp_path):
    """Fewer key/value heads than ranks (tp a multiple of them, the rule of phalanx.models.heads):
    each rank holds the kv head its query heads read, and its KV cache only that head. Greedy
    tokens equal transformers' at tp 2 on a 1-kv-head Llama and at tp 4 on a 2-kv-head Qwen2
    (its k/v biases are sliced by the same head)."""
    tok = im.make_tokenizer()
    llama, llama_model = im.save_model(tmp_path / "kv1", "llama", tokenizer=tok, num_key_value_heads=1)
    qwen, qwen_model = im.save_model(tmp_path / "kv2", "qwen2", tokenizer=tok)
    prompts = im.mixed_prompts(3, seed=14, low=3, high=40)
    for tp, path, model in ((2, llama, llama_model), (4, qwen, qwen_model)):
        ranks = spawn(tp_generate, tp, [{"path": str(path), "prompts": prompts, "new_tokens": 12, "tp": tp}],
                      timeout=300)
        assert all(r == ranks[0] for r in ranks), f"tp={tp}: the ranks returned different outputs"
        got = ranks[0][0]
        assert got["tokens"] == [im.hf_greedy(model, p, 12) for p in prompts], f"tp={tp}"
        # 4 heads of 16 over tp ranks, one kv head each: q (4 / tp) heads + k 1 + v 1
        assert got["shard"] == ((4 // tp + 2) * 16, 64) and got["kv_cache"][2:] == (1, 16), got
