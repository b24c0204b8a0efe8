"""Tiny configs of every family with a shard policy, for the hybrid-parallel tests.

hidden 32, 2 layers, 4 heads; key/value heads 2 except Mistral's 1 (replicated over tp=2);
GPT-2 and OPT have vocabularies that tp=2 does not divide (padded) and tied LM heads. Dropout is
off so that runs are deterministic.
"""
from __future__ import annotations

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "opt")
VOCAB = {"gpt2": 125, "opt": 127}


def config(family: str, layers: int = 2):
    import transformers as tf

    common = dict(vocab_size=VOCAB.get(family, 128))
    if family in ("llama", "mistral", "qwen2", "qwen3"):
        cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config,
               "qwen3": tf.Qwen3Config}[family]
        extra = {"head_dim": 8} if family == "qwen3" else {}
        cfg = cls(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=1 if family == "mistral" else 2, max_position_embeddings=64,
                  tie_word_embeddings=False, **extra, **common)
    elif family == "gpt2":
        cfg = tf.GPT2Config(n_embd=32, n_layer=layers, n_head=4, n_positions=64, attn_pdrop=0.0, resid_pdrop=0.0,
                            embd_pdrop=0.0, bos_token_id=0, eos_token_id=0, **common)
    elif family == "opt":
        cfg = tf.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=layers, num_attention_heads=4,
                           max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
                           pad_token_id=1, bos_token_id=0, eos_token_id=0, **common)
    else:
        raise ValueError(family)
    cfg._attn_implementation = "sdpa"
    return cfg


def build(family: str, seed: int = 0, layers: int = 2):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config(family, layers))


# one column-parallel weight, one row-parallel weight and one norm weight per family
SAMPLE_GRADS = {
    "llama": ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
              "model.layers.0.input_layernorm.weight"),
    "gpt2": ("transformer.h.0.attn.c_attn.weight", "transformer.h.1.attn.c_proj.weight", "transformer.h.0.ln_1.weight"),
    "opt": ("model.decoder.layers.0.fc1.weight", "model.decoder.layers.1.self_attn.out_proj.weight",
            "model.decoder.layers.0.self_attn_layer_norm.weight"),
}
SAMPLE_GRADS["mistral"] = ("model.layers.0.self_attn.k_proj.weight",) + SAMPLE_GRADS["llama"][1:]  # replicated KV
SAMPLE_GRADS["qwen2"] = ("model.layers.0.self_attn.v_proj.bias",) + SAMPLE_GRADS["llama"][1:]
SAMPLE_GRADS["qwen3"] = SAMPLE_GRADS["llama"][:2] + ("model.layers.1.self_attn.q_norm.weight",)


def tokens(family: str, batch: int = 4, seq: int = 16, seed: int = 7, steps: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB.get(family, 128), (batch, seq), generator=g) for _ in range(steps)]
