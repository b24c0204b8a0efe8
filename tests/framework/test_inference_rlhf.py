"""What RLHF asks of the engine: raw vs processed log-probs, n samples sharing the prompt's KV
blocks, and in-memory weight refresh (single process here; layouts in test_inference_weight_sync)."""
import pytest
import torch

from phalanx.inference import LLM, SamplingParams
from phalanx.testing import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3, max_position_embeddings=128).eval()


def _engine(model, **kw):
    kw.setdefault("block_size", 16)
    return LLM.from_model(model, dtype="float32", max_model_len=128, kv_cache_memory_gib=0.05, **kw)


def _reference_logits(model, prompt, tokens):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return logits


def test_raw_and_processed_logprobs(model):
    prompt = list(range(3, 23))
    params = SamplingParams(max_new_tokens=6, temperature=0.7, top_k=5, top_p=0.9, logprobs=0,
                            processed_logprobs=True, seed=11, ignore_eos=True)
    out = _engine(model).generate([prompt], params)[0]
    logits = _reference_logits(model, prompt, out.token_ids)
    raw = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(out.logprobs), raw, atol=1e-4)
    # the processed distribution: temperature, then top-k, then top-p, like HF generate
    scaled = logits / 0.7
    kth = scaled.topk(5, dim=-1).values[:, -1:]
    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    sorted_l, order = scaled.sort(dim=-1)
    cum = sorted_l.softmax(-1).cumsum(-1)
    remove = cum <= 0.1
    remove[:, -1] = False
    scaled = scaled.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    processed = torch.log_softmax(scaled, -1).gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(out.processed_logprobs), processed, atol=1e-4)
    assert (torch.tensor(out.processed_logprobs) > raw).all()  # truncation + sharpening raise the chosen token's
    greedy = _engine(model).generate([prompt], SamplingParams(max_new_tokens=3, temperature=0, processed_logprobs=True))[0]
    assert greedy.processed_logprobs == [0.0, 0.0, 0.0] and greedy.logprobs is None


def test_n_samples_share_prompt_blocks_and_match_solo_runs(model):
    prompt = [(7 * i) % 120 + 3 for i in range(40)]  # 2 full blocks of 16 before the last token's block
    params = [SamplingParams(max_new_tokens=5, temperature=1.0, logprobs=0, seed=s, ignore_eos=True) for s in range(4)]
    engine = _engine(model)
    together = engine.generate([prompt] * 4, params)
    assert [o.num_cached_tokens for o in together] == [0, 32, 32, 32]
    assert engine.stats()["prefix_cached_tokens"] == 96
    assert engine.block_manager.all_free()
    for o, p in zip(together, params, strict=True):
        solo = _engine(model).generate([prompt], p)[0]
        assert o.token_ids == solo.token_ids
        assert torch.allclose(torch.tensor(o.logprobs), torch.tensor(solo.logprobs), atol=1e-5)


def test_load_weights_refreshes_logprobs(model):
    import copy
    engine = _engine(model)
    trained = copy.deepcopy(model)
    prompt = list(range(5, 25))
    params = SamplingParams(max_new_tokens=4, temperature=1.0, logprobs=0, seed=1, ignore_eos=True)
    for round_ in range(3):
        with torch.no_grad():
            for p in trained.parameters():
                p.add_(0.01 * torch.randn_like(p))
        engine.load_weights(trained.state_dict(), strict=True)
        out = engine.generate([prompt], params)[0]
        logits = _reference_logits(trained, prompt, out.token_ids)
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(out.logprobs), want, atol=1e-4), round_
