"""The model the planner plans for: a preset name, a directory or config.json, a config dict or
object, read into the framework's one `ModelSpec` (`phalanx.models`: every family there, with
its exact parameter count, checked against transformers in tests/framework/test_model_families.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from phalanx.models import ModelSpec, spec_from_config

__all__ = ["PRESETS", "ModelSpec", "load_spec", "spec_from_config"]

# Small built-in configs (the fields the planner reads), for planning without a checkpoint on disk.
PRESETS: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         tie_word_embeddings=True),
    "llama2-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      tie_word_embeddings=False),
    "llama2-13b": dict(model_type="llama", vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                       num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                       tie_word_embeddings=False),
    "llama2-70b": dict(model_type="llama", vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       tie_word_embeddings=False),
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      tie_word_embeddings=False),
    # mixtures of experts: memory counts every expert, compute the active ones (docs/plan.md)
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          norm_topk_prob=True, tie_word_embeddings=False),
    # multi-head latent attention: the KV cache holds the 512 + 64 latent per layer, not 16 heads' keys and values
    "deepseek-v2-lite": dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                             num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
                             kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                             n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408,
                             n_shared_experts=2, first_k_dense_replace=1, tie_word_embeddings=False),
}


def load_spec(model: str | Path | dict | ModelSpec) -> ModelSpec:
    """`model`: a preset name, a directory holding config.json, a config.json path, a config
    dict, a transformers config object or a ModelSpec."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, dict):
        return spec_from_config(model)
    if hasattr(model, "to_dict"):  # a transformers PretrainedConfig
        return spec_from_config(model, getattr(model, "name_or_path", "") or "model")
    text = str(model)
    if text.lower() in PRESETS:
        return spec_from_config(PRESETS[text.lower()], text.lower())
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--model {text!r}: not a preset ({', '.join(PRESETS)}), nor a directory with "
                         "config.json, nor a config.json file")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    return spec_from_config(config, path.parent.name if path.name == "config.json" else path.stem)
