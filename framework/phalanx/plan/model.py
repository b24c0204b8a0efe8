"""The shape of a decoder-only transformer, read from a Hugging Face config, and its exact
parameter count.

Supported: the Llama layout (llama, mistral, qwen2, qwen3 and other configs with the same keys:
`hidden_size`, `intermediate_size`, `num_hidden_layers`, `num_attention_heads`, optional
`num_key_value_heads`, `head_dim`) and GPT-2 (`n_embd`, `n_layer`, `n_head`). The count is
checked against `sum(p.numel())` of the transformers model built on the meta device
(tests/framework/test_plan.py).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

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
}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about a model: sizes, heads, biases, tying."""
    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool = False          # q/k/v projections have biases (qwen2, attention_bias)
    o_bias: bool = False            # output projection has a bias (attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False           # per-head q/k RMSNorm (qwen3)
    gated_mlp: bool = True          # SwiGLU (gate, up, down); GPT-2: fc, proj
    norm_bias: bool = False         # LayerNorm with bias (GPT-2)
    position_table: int = 0         # learned position embeddings (GPT-2: n_positions)

    # ---- parameter counts --------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size + self.position_table * self.hidden_size

    def head_params(self) -> int:
        """The LM head's own weight (0 when tied to the embedding)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def norm_params(self) -> int:
        return self.hidden_size * (2 if self.norm_bias else 1)

    def attention_params(self) -> int:
        h, q, kv = self.hidden_size, self.q_dim, self.kv_dim
        n = h * q + 2 * h * kv + q * h
        n += (q + 2 * kv) if self.qkv_bias else 0
        n += h if self.o_bias else 0
        n += 2 * self.head_dim if self.qk_norm else 0
        return n

    def mlp_params(self) -> int:
        h, f = self.hidden_size, self.intermediate_size
        if self.gated_mlp:
            return 3 * h * f + ((2 * f + h) if self.mlp_bias else 0)
        return 2 * h * f + ((f + h) if self.mlp_bias else 0)

    def layer_params(self) -> int:
        return self.attention_params() + self.mlp_params() + 2 * self.norm_params()

    def total_params(self) -> int:
        return (self.embedding_params() + self.num_layers * self.layer_params() + self.norm_params()
                + self.head_params())

    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (the 6·N of training FLOPs): layers and
        the LM head (tied or not), not the embedding lookup."""
        return self.num_layers * self.layer_params() + self.vocab_size * self.hidden_size


def spec_from_config(config: dict[str, Any], name: str = "model") -> ModelSpec:
    """A ModelSpec from a Hugging Face config dict (config.json's content)."""
    model_type = config.get("model_type", "llama")
    get = config.get
    if model_type == "gpt2" or "n_embd" in config:
        h = int(get("n_embd", 768))
        return ModelSpec(name=name, model_type="gpt2", vocab_size=int(get("vocab_size", 50257)), hidden_size=h,
                         intermediate_size=int(get("n_inner") or 4 * h), num_layers=int(get("n_layer", 12)),
                         num_heads=int(get("n_head", 12)), num_kv_heads=int(get("n_head", 12)),
                         head_dim=h // int(get("n_head", 12)), tie_word_embeddings=True, qkv_bias=True,
                         o_bias=True, mlp_bias=True, gated_mlp=False, norm_bias=True,
                         position_table=int(get("n_positions", 1024)))
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in config]
    if missing:
        raise ValueError(f"config of {name!r} lacks {', '.join(missing)}: the planner reads decoder-only "
                         "configs in the Llama layout (llama, mistral, qwen2, qwen3) or GPT-2")
    heads = int(config["num_attention_heads"])
    head_dim = get("head_dim") or int(config["hidden_size"]) // heads
    attention_bias = bool(get("attention_bias", False))
    return ModelSpec(
        name=name, model_type=model_type, vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]), num_layers=int(config["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(get("num_key_value_heads") or heads), head_dim=int(head_dim),
        tie_word_embeddings=_tied(config),
        qkv_bias=attention_bias or model_type == "qwen2", o_bias=attention_bias,
        mlp_bias=bool(get("mlp_bias", False)), qk_norm=model_type == "qwen3")


def _tied(config: dict[str, Any]) -> bool:
    """tie_word_embeddings as transformers reads this config: the class default when absent."""
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    try:
        from transformers import AutoConfig
        return bool(AutoConfig.for_model(config.get("model_type", "llama")).tie_word_embeddings)
    except (ImportError, ValueError):
        return False


def load_spec(model: str | Path | dict | ModelSpec) -> ModelSpec:
    """`model`: a preset name, a directory holding config.json, a config.json path, a config
    dict, a transformers config object or a ModelSpec."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, dict):
        return spec_from_config(model)
    if hasattr(model, "to_dict"):  # a transformers PretrainedConfig
        return spec_from_config(model.to_dict(), getattr(model, "name_or_path", "") or "model")
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
