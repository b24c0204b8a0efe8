"""The families the framework knows, and reading any supported Hugging Face config into a
`ModelSpec`. Adding a family: one file in this package that builds a `Family`, listed here
(docs/models.md)."""
from __future__ import annotations

from typing import Any

from phalanx.models import deepseek, gpt2, llama, mistral, mixtral, opt, qwen2, qwen2_moe, qwen3, qwen3_moe
from phalanx.models.family import Family
from phalanx.models.spec import ModelSpec

FAMILIES: dict[str, Family] = {f.name: f for f in (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY,
                                                   gpt2.FAMILY, opt.FAMILY, mixtral.FAMILY, qwen2_moe.FAMILY,
                                                   qwen3_moe.FAMILY, deepseek.FAMILY_V2, deepseek.FAMILY_V3)}
SUPPORTED = tuple(FAMILIES)
_BY_MODEL_TYPE = {t: f for f in FAMILIES.values() for t in f.model_types}


def family_of(config: Any) -> Family:
    """The family of an HF config (object or dict) or of a model_type string."""
    if isinstance(config, str):
        model_type = config
    elif isinstance(config, dict):
        model_type = config.get("model_type") or ("gpt2" if "n_embd" in config else "llama")
    else:
        model_type = getattr(config, "model_type", None)
    if model_type not in _BY_MODEL_TYPE:
        raise ValueError(f"model type {model_type!r} is not supported; supported families: {', '.join(SUPPORTED)}")
    return _BY_MODEL_TYPE[model_type]


def spec_from_config(config: Any, name: str | None = None) -> ModelSpec:
    """A ModelSpec from an HF config object or a config dict (config.json's content; absent
    keys take the transformers class defaults, as `from_pretrained` would)."""
    family = family_of(config)
    if isinstance(config, dict):
        missing = [k for k in family.required if not any(a in config for a in k.split("|"))]
        if missing:
            raise ValueError(f"config of {name or 'model'!r} lacks {', '.join(missing)}: a {family.name} config "
                             f"names {', '.join(family.required)} (a|b: either name)")
        from transformers import AutoConfig
        config = AutoConfig.for_model(family.model_types[0], **{k: v for k, v in config.items() if k != "model_type"})
    tied = getattr(config, "tie_word_embeddings", None)
    return ModelSpec(family=family.name, vocab_size=config.vocab_size,
                     tie_word_embeddings=bool(family.tied_default if tied is None else tied),
                     name=name or getattr(config, "name_or_path", "") or "model", config=config,
                     **family.read(config))
