"""The model families added to phalanx.inference beyond Llama/Mistral/Qwen2: Qwen3 (RMSNorm of
each head's q and k), GPT-2 (learned positions, LayerNorm, GELU, fused Conv1D c_attn, tied head)
and OPT (learned positions offset by 2, LayerNorm, ReLU, optional project_in/out). Tiny random
models built with transformers: greedy tokens equal `generate(do_sample=False)` and log-probs
equal the HF forward's, from a saved directory and from a live module. Tensor parallelism for
these families is in test_inference_tp.py."""
from __future__ import annotations

import pytest
import torch

import inference_models as im
from phalanx.inference import LLM, SamplingParams
from phalanx.models import SUPPORTED

FAMILIES = ["qwen3", "gpt2", "opt"]
NEW_TOKENS = 16
# fp32 log-probs: both sides reduce over the same ~400-entry vocabulary from logits of magnitude
# ~10-30; measured differences are ~1e-6, 1e-4 leaves room for the AVX2 machines' rounding.
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("inference-families")
    tok = im.make_tokenizer()
    return {family: im.save_model(root / family, family, tokenizer=tok) for family in FAMILIES}


def _check_against_transformers(eng: LLM, model, prompts: list[list[int]]) -> None:
    im.check_against_transformers(eng, model, prompts, NEW_TOKENS, LOGPROB_ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logprobs_match_transformers(models, family):
    path, model = models[family]
    prompts = im.mixed_prompts(5, seed=2, low=3, high=60)  # one engine batch, prompts over several blocks
    _check_against_transformers(LLM(str(path), num_blocks=96, block_size=8, dtype="float32"), model, prompts)


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_engine_from_a_live_module(models, family):
    """RLHF builds the engine from the policy module: its state dict (tied head included, GPT-2's
    attention buffers if present) loads without a directory."""
    _, model = models[family]
    eng = LLM.from_model(model, num_blocks=64, block_size=8, dtype="float32")
    _check_against_transformers(eng, model, im.mixed_prompts(2, seed=4, low=5, high=30))


def test_opt_with_project_in_and_out(tmp_path):
    """OPT checkpoints whose word embeddings are narrower than the decoder (word_embed_proj_dim):
    project_in after the embedding, project_out before the tied head."""
    path, model = im.save_model(tmp_path / "opt-proj", "opt", word_embed_proj_dim=32)
    assert model.model.decoder.project_in is not None
    _check_against_transformers(LLM(str(path), num_blocks=64, block_size=8, dtype="float32"), model,
                                im.mixed_prompts(3, seed=5, low=3, high=40))


def test_opt_without_a_final_norm(tmp_path):
    """OPT checkpoints saved with _remove_final_layer_norm have no final_layer_norm tensors: the
    engine expects none and skips the norm."""
    path, model = im.save_model(tmp_path / "opt-no-norm", "opt", _remove_final_layer_norm=True)
    assert model.model.decoder.final_layer_norm is None
    _check_against_transformers(LLM(str(path), num_blocks=64, block_size=8, dtype="float32"), model,
                                im.mixed_prompts(2, seed=7, low=3, high=30))


DEEPSEEK = {"deepseek_v2", "deepseek_v3"}  # multi-head latent attention: test_inference_deepseek.py


def test_every_family_is_checked_against_transformers():
    """Greedy tokens against transformers: these families here, the mixtures of experts in
    test_inference_moe.py, DeepSeek in test_inference_deepseek.py, the others in
    test_inference_engine.py."""
    import moe_models
    assert set(FAMILIES) | {"llama", "qwen2", "mistral"} | set(moe_models.MOE_FAMILIES) | DEEPSEEK == set(SUPPORTED)


def test_learned_positions_are_read_at_the_right_offset(models):
    """Shifting OPT's position table by one row (forgetting the offset of 2, say) changes the
    tokens: the check above would catch a wrong offset."""
    path, model = models["opt"]
    prompt = im.mixed_prompts(1, seed=6, low=20, high=21)[0]
    eng = LLM(str(path), num_blocks=64, block_size=8, dtype="float32")
    good = eng.generate(prompt, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0))[0].token_ids
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["model.decoder.embed_positions.weight"] = torch.roll(state["model.decoder.embed_positions.weight"], 1, 0)
    eng.load_weights(state)
    assert eng.generate(prompt, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0))[0].token_ids != good


def test_unsupported_models_and_variants_are_refused_by_name(tmp_path):
    from transformers import GPT2Config, OPTConfig
    assert SUPPORTED == ("llama", "mistral", "qwen2", "qwen3", "gpt2", "opt", "mixtral", "qwen2_moe", "qwen3_moe",
                         "deepseek_v2", "deepseek_v3")
    OPTConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, ffn_dim=64,
              do_layer_norm_before=False).save_pretrained(tmp_path / "opt-post")
    with pytest.raises(ValueError, match="do_layer_norm_before=False"):
        LLM(str(tmp_path / "opt-post"))
    GPT2Config(n_embd=32, n_head=2, n_layer=1, scale_attn_by_inverse_layer_idx=True).save_pretrained(tmp_path / "g")
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        LLM(str(tmp_path / "g"))
    from transformers import BertConfig
    BertConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1).save_pretrained(tmp_path / "bert")
    with pytest.raises(ValueError, match="'bert' is not supported.*supported families: llama, mistral, qwen2, "
                                         "qwen3, gpt2, opt, mixtral, qwen2_moe, qwen3_moe, deepseek_v2, "
                                         "deepseek_v3"):
        LLM(str(tmp_path / "bert"))


def test_a_checkpoint_of_another_family_is_refused(models, tmp_path):
    """GPT-2 weights in an OPT-config directory: names that belong to no OPT weight are an error."""
    path, _ = models["opt"]
    _, gpt2 = models["gpt2"]
    eng = LLM(str(path), num_blocks=16, block_size=8, dtype="float32")
    with pytest.raises(ValueError, match="do not belong to a opt model"):
        eng.load_weights(gpt2.state_dict())
