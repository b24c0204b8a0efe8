"""phalanx.inference serves DeepSeek-V2 / V3 (multi-head latent attention, phalanx/inference/mla.py):
greedy tokens equal transformers' `generate(do_sample=False)` in fp32 and log-probs its forward's,
for V2 with group-limited softmax routing, attention and MLP biases, no q_lora_rank (V2-Lite's
shape) and for V2 with q_lora_rank and greedy routing; V3 with sigmoid scores, its correction bias
(loaded from the checkpoint) and group routing, under YaRN (mscale_all_dim: the softmax scale
changes) with interleaved RoPE, and with RoPE by halves (rope_interleave=False) and every layer an
expert block. The KV cache holds one latent per token and layer (kv_lora_rank + rope wide), and
the block budget is sized by it; a batch with preemption, a shared prefix from the prefix cache,
speculative decoding (the model as its own draft) and tensor parallelism (2 gloo ranks: heads
split, experts split by width) give the same tokens. LoRA is refused by name, before any work."""
from __future__ import annotations

import pytest
import torch

import inference_models as im
from phalanx.inference import LLM, SamplingParams
from phalanx.testing import Diff, check, rounding_rtol, spawn

NEW_TOKENS = 16
LOGPROB_ATOL = 1e-4  # fp32, as test_inference_families.py / test_inference_moe.py
LOGPROB_RTOL = rounding_rtol(torch.float32, im.VOCAB)  # TP=2 vs TP=1, in units of the logits' magnitude
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
# (version, overrides). V2's groups are ranked by their best expert: with top-2 of groups of 2,
# topk_group=2 would never change the choice (the two best experts' groups are the two best
# groups), so topk_group=1 (both experts from the best group) makes group limiting matter.
CASES = {
    "v2-groups-biases": (2, dict(topk_method="group_limited_greedy", n_group=4, topk_group=1, attention_bias=True,
                                 mlp_bias=True, routed_scaling_factor=1.5)),
    "v2-q-lora-greedy": (2, dict(q_lora_rank=48, first_k_dense_replace=2)),
    "v3-yarn": (3, dict(rope_parameters=YARN)),
    "v3-halves": (3, dict(rope_interleave=False, first_k_dense_replace=0)),
}


def deepseek_config(version: int, **overrides):
    """3 layers, hidden 64, 4 heads (qk 16 + 8 rope, v 16), kv_lora_rank 32, 8 routed experts of
    width 32 (top 2), the first layer dense. V3: q_lora_rank 48, one shared expert, 4 groups (top
    2), routed_scaling_factor 2.5, renormalised; V2: no q_lora_rank, two shared experts."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    common = dict(vocab_size=im.VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                  num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256, initializer_range=0.25,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa")
    if version == 3:
        return DeepseekV3Config(**{**common, "q_lora_rank": 48, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
                                   "routed_scaling_factor": 2.5, "norm_topk_prob": True, **overrides})
    return DeepseekV2Config(**{**common, "q_lora_rank": None, "n_shared_experts": 2, **overrides})


def make_model(case: str, seed: int = 0):
    """A random model of the case, norms, biases and V3's correction bias random too (transformers
    initialises them to ones and zeros: random ones test that they are loaded and used)."""
    from transformers import AutoModelForCausalLM

    version, overrides = CASES[case]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(deepseek_config(version, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root, tok = tmp_path_factory.mktemp("inference-deepseek"), im.make_tokenizer()
    out = {}
    for case in CASES:
        model = make_model(case)
        model.save_pretrained(root / case)
        tok.save_pretrained(root / case)
        out[case] = (str(root / case), model)
    return out


def engine(path, **kwargs) -> LLM:
    return LLM(path, **{"num_blocks": 96, "block_size": 8, "dtype": "float32", **kwargs})


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_and_logprobs_match_transformers(models, case):
    path, model = models[case]
    eng = engine(path)
    layers = eng.runner.model.layers
    assert all(layer.mla for layer in layers)
    first_dense = model.config.first_k_dense_replace
    assert [layer.sparse for layer in layers] == [i >= first_dense for i in range(3)]
    im.check_against_transformers(eng, model, im.mixed_prompts(5, seed=2, low=3, high=60), NEW_TOKENS, LOGPROB_ATOL)


def test_engine_from_a_live_module(models):
    _, model = models["v3-yarn"]
    eng = LLM.from_model(model, num_blocks=64, block_size=8, dtype="float32")
    im.check_against_transformers(eng, model, im.mixed_prompts(2, seed=4, low=5, high=30), NEW_TOKENS, LOGPROB_ATOL)


def test_v3_correction_bias_and_yarn_scale_matter(models, monkeypatch):
    """The checks above would see a correction bias left unloaded or a softmax scale without
    YaRN's mscale²: either changes the tokens."""
    from phalanx.inference import mla

    path, model = models["v3-yarn"]
    prompts = im.mixed_prompts(3, seed=6, low=10, high=30)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0)
    eng = engine(path)
    good = [o.token_ids for o in eng.generate(prompts, params)]
    assert good == [im.hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    state = {k: (torch.zeros_like(v) if k.endswith("e_score_correction_bias") else v)
             for k, v in model.state_dict().items()}
    eng.load_weights(state)
    assert [o.token_ids for o in eng.generate(prompts, params)] != good
    monkeypatch.setattr(mla, "softmax_scale", lambda spec: (spec.qk_nope_head_dim + spec.qk_rope_head_dim) ** -0.5)
    assert [o.token_ids for o in engine(path).generate(prompts, params)] != good


def test_kv_cache_holds_one_latent_per_token(models):
    """One cache tensor per layer, [blocks, block_size, 1, kv_lora_rank + rope], serving as keys and
    values; the block budget divides by its bytes. For DeepSeek-V3's own shape (transformers'
    DeepseekV3Config defaults: 61 layers, 128 heads, kv_lora_rank 512, rope 64, qk 192, v 128)
    a token costs 61·576 values, 71× less than decompressed keys and values."""
    from transformers import DeepseekV3Config

    from phalanx.inference.llama import kv_bytes_per_block
    from phalanx.models import spec_from_config

    path, _ = models["v3-yarn"]
    per_block = 3 * (32 + 8) * 8 * 4  # layers · latent · block_size · fp32
    budget_blocks = 37
    eng = engine(path, num_blocks=None, kv_cache_memory_gib=budget_blocks * per_block / 2**30)
    assert eng.runner.bytes_per_block() == per_block
    assert eng.num_blocks == budget_blocks
    for keys, values in eng.runner.kv_caches:
        assert keys is values and tuple(keys.shape) == (budget_blocks, 8, 1, 40)
    assert sum(k.numel() * k.element_size() for k, _ in eng.runner.kv_caches) == budget_blocks * per_block
    v3 = spec_from_config(DeepseekV3Config())
    latent = kv_bytes_per_block(v3, 1, 1, torch.bfloat16)
    assert latent == 61 * 576 * 2 == kv_bytes_per_block(v3, 1, 8, torch.bfloat16)  # whole on every TP rank
    decompressed = 61 * 128 * (192 + 128) * 2
    assert round(decompressed / latent, 1) == 71.1


def test_bf16_keeps_the_router_in_fp32(models):
    """As transformers keeps `mlp.gate.weight` and V3's correction bias in fp32 whatever the
    dtype, so does the engine (the routing is a discrete choice: a rounded score flips it); the
    latent cache is bf16, half the fp32 block."""
    path, model = models["v3-halves"]
    eng = engine(path, dtype="bfloat16")
    for layer in eng.runner.model.layers:
        assert layer.router_weight.dtype == layer.router_bias.dtype == torch.float32
        assert layer.kv_b_weight.dtype == torch.bfloat16
    assert eng.runner.kv_caches[0][0].dtype == torch.bfloat16 and eng.runner.bytes_per_block() == 3 * 40 * 8 * 2
    want = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(eng.runner.model.layers[1].router_bias.cpu(), want)


def test_v3_multi_token_prediction_layers_are_skipped(models):
    """DeepSeek-V3 checkpoints hold `num_nextn_predict_layers` extra layers after the decoder's
    (transformers skips them): they load as nothing; a layer past those is still refused, and
    V2 has none."""
    path, model = models["v3-yarn"]
    state = dict(model.state_dict())
    state["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    state["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(128, 32)
    eng = engine(path)
    eng.load_weights(state, strict=True)
    prompt = im.mixed_prompts(1, seed=9, low=10, high=20)[0]
    got = eng.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0))[0].token_ids
    assert got == im.hf_greedy(model, prompt, 8)
    with pytest.raises(ValueError, match="do not belong.*layers.4"):
        eng.load_weights({**state, "model.layers.4.eh_proj.weight": torch.zeros(64, 128)})
    v2_path, v2 = models["v2-groups-biases"]
    with pytest.raises(ValueError, match="do not belong.*layers.3"):
        engine(v2_path).load_weights({**v2.state_dict(), "model.layers.3.eh_proj.weight": torch.zeros(64, 128)})


def test_preemption_and_prefix_cache_give_transformers_tokens(models):
    path, model = models["v2-groups-biases"]
    prompts = im.mixed_prompts(6, seed=4, low=10, high=40)
    params = SamplingParams(max_new_tokens=20, temperature=0)
    eng = engine(path, num_blocks=12)  # 96 slots for 6 sequences of up to 59 tokens
    outs = eng.generate(prompts, params)
    assert eng.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [im.hf_greedy(model, p, 20) for p in prompts]
    assert eng.block_manager.all_free()
    system = im.mixed_prompts(1, seed=5, low=30, high=31)[0]
    shared = [system + p for p in im.mixed_prompts(3, seed=6, low=3, high=12)]
    eng = engine(path)
    outs = eng.generate(shared, params)
    assert [o.num_cached_tokens for o in outs] == [0, 24, 24]  # three full blocks of the shared prefix
    assert [o.token_ids for o in outs] == [im.hf_greedy(model, p, 20) for p in shared]
    assert eng.block_manager.all_free()


def test_speculative_decoding_with_itself_as_draft(models):
    """Verification runs k + 1 query tokens per sequence over the latent cache (a batched group
    with q > 1): the model as its own draft accepts every proposal and gives its own tokens."""
    path, model = models["v3-halves"]
    prompts = im.mixed_prompts(3, seed=8, low=5, high=30)
    eng = engine(path, draft_model=path, num_speculative_tokens=3)
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0))
    assert [o.token_ids for o in outs] == [im.hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    assert eng.stats()["spec_acceptance_rate"] == 1.0


def test_refusals_name_the_problem(models):
    from phalanx.inference.llama import spec_for_inference

    path, _ = models["v2-groups-biases"]
    with pytest.raises(ValueError, match="LoRA adapters are not served on deepseek_v2.*merge"):
        engine(path, enable_lora=True)
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        spec_for_inference(deepseek_config(3, hidden_act="gelu"))
    with pytest.raises(ValueError, match="n_group=3 must divide n_routed_experts=8"):
        spec_for_inference(deepseek_config(3, n_group=3, topk_group=1))
    with pytest.raises(ValueError, match="n_group=8 leaves 1 expert per group.*n_group <= 4"):
        spec_for_inference(deepseek_config(3, n_group=8, topk_group=2))
    with pytest.raises(ValueError, match="topk_method='noaux_tc' is not a routing"):
        spec_for_inference(deepseek_config(2, topk_method="noaux_tc"))


def test_lora_is_refused_before_the_weights_are_read(models, monkeypatch):
    """`enable_lora` on DeepSeek fails with the fix in the message before the model runner is
    built or a weight is read (from a directory and from a live module), not after loading."""
    import phalanx.inference.engine as engine_module

    def no_work(*args, **kwargs):
        raise AssertionError("the engine started work before refusing LoRA on multi-head latent attention")
    monkeypatch.setattr(engine_module, "ModelRunner", no_work)
    monkeypatch.setattr(engine_module, "load_weights", no_work)
    for case in ("v2-groups-biases", "v3-yarn"):
        path, model = models[case]
        family = model.config.model_type
        with pytest.raises(ValueError, match=f"LoRA adapters are not served on {family}.*merge=True"):
            engine(path, enable_lora=True)
        with pytest.raises(ValueError, match=f"LoRA adapters are not served on {family}.*merge_and_unload"):
            LLM.from_model(model, im.make_tokenizer(), enable_lora=True, dtype="float32")


def tp_deepseek(cases: list[dict]) -> list[dict]:
    """One rank of a TP=2 engine (inference_tp_workers.tp_generate's pattern; it reads a q/k/v
    shard that MLA layers do not have): greedy tokens and log-probs, this rank's heads of kv_b_proj,
    the latent cache's shape."""
    results = []
    for case in cases:
        eng = LLM(case["path"], tp_size=2, num_blocks=64, block_size=8, dtype="float32")
        outs = eng.generate(case["prompts"], SamplingParams(max_new_tokens=case["new_tokens"], temperature=0,
                                                            logprobs=1))
        layer = eng.runner.model.layers[-1]
        results.append({"tokens": [o.token_ids for o in outs], "logprobs": [o.logprobs for o in outs],
                        "kv_b": tuple(layer.kv_b_weight.shape), "experts": tuple(layer.experts_down.shape),
                        "kv_cache": tuple(eng.runner.kv_caches[0][0].shape)})
    return results


@pytest.mark.slow  # two ranks, two models: ~30-60 s on 2 busy cores
def test_tp2_matches_tp1_and_transformers(models):
    """TP=2: each rank holds half of the heads (q, kv_b_proj rows, o_proj columns) and half of every
    expert's width, the low-rank projections and the latent cache whole; tokens equal
    transformers', log-probs the TP=1 engine's within fp32 rounding over the vocabulary."""
    prompts = im.mixed_prompts(3, seed=13, low=3, high=40)
    names = ["v2-groups-biases", "v3-yarn"]
    ranks = spawn(tp_deepseek, 2, [{"path": models[c][0], "prompts": prompts, "new_tokens": 12} for c in names],
                  timeout=300)
    assert ranks[0] == ranks[1], "TP ranks returned different outputs"
    for case, result in zip(names, ranks[0], strict=True):
        path, model = models[case]
        assert result["kv_b"] == (2 * (16 + 16), 32) and result["experts"] == (8, 64, 16)
        assert result["kv_cache"] == (64, 8, 1, 40)
        assert result["tokens"] == [im.hf_greedy(model, p, 12) for p in prompts], case
        want = engine(path).generate(prompts, SamplingParams(max_new_tokens=12, temperature=0, logprobs=1))
        assert result["tokens"] == [o.token_ids for o in want], case
        with torch.no_grad():
            scale = max(model(input_ids=torch.tensor([p])).logits.abs().max().item() for p in prompts)
        for i, (a, b) in enumerate(zip(result["logprobs"], [o.logprobs for o in want], strict=True)):
            worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
            check(Diff(worst / scale, f"prompt {i}"), LOGPROB_RTOL, f"{case}: TP=2 log-probs")
