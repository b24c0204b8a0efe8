"""Loading the recipe's models and tokenizers from local Hugging Face directories (nothing downloads).

A model path in a config may be:
- ``""`` or ``"smollm2"``: SmolLM2-135M-Instruct, converted once by `phalanx.pretrained`;
- a Hugging Face model directory (``config.json`` + weights);
- a Hub id such as ``Qwen/Qwen2.5-0.5B-Instruct``, found in the local Hugging Face cache
  (`phalanx.pretrained.hub_snapshot`; a missing one stops with the download command);
- a training checkpoint (``<output_dir>/checkpoints/step_N``, whose ``policy/`` (PPO: the actor alone,
  `export.PolicyExport`) or else ``model/`` is such a directory), or a training ``output_dir``,
  meaning its latest complete checkpoint.

The reward model is ``AutoModelForSequenceClassification`` with one label on the policy's backbone,
so any tool that opens HF classifiers opens it. Its padding token is ``<|endoftext|>`` (id 0 for
SmolLM2), not the chat end-of-turn token: transformers scores the *last non-padding* token of a row,
and a padding id that also closes every turn would move that position.
"""
from __future__ import annotations

from pathlib import Path

import torch

BASE_ALIASES = ("", "smollm2", "base")


def base_model_dir() -> Path:
    """The SmolLM2-135M-Instruct directory (converted through phalanx.pretrained on first use)."""
    from phalanx.pretrained import ensure_smollm2

    return ensure_smollm2()


def resolve_model_dir(path: str | Path | None) -> Path:
    """A directory with config.json, from any of the forms in the module docstring."""
    if path is None or str(path) in BASE_ALIASES:
        return base_model_dir()
    from phalanx.checkpoint.find import model_dir
    from phalanx.pretrained import hub_snapshot, looks_like_hub_id

    if looks_like_hub_id(str(path)):
        try:
            return hub_snapshot(str(path), required=("config.json",))
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"model {str(path)!r}: no local directory of that name, and {exc}") from None
    try:
        return model_dir(path)
    except FileNotFoundError as exc:
        from .adapters import find_adapter
        try:
            adapter = find_adapter(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"{exc}; train that stage first or fix the path") from None
        raise FileNotFoundError(f"{path} is a LoRA run with an adapter ({adapter}) but no merged policy/: merge it "
                                f"first with `python -m apps.chat_rlhf.adapters {path} --merge --out DIR` (or train "
                                "with lora.merge=true) and give DIR") from None


def from_pretrained(model_class, directory: str | Path, **kwargs):
    """`model_class.from_pretrained(directory)` without transformers' hub kernels: they would be fetched
    from the Hub on a GPU (runs stay offline) and re-kernelized on every train()/eval() switch, which
    fails outright on a device type `kernels` does not know (the emulated GPU's)."""
    kwargs.setdefault("dtype", torch.float32)
    return model_class.from_pretrained(str(directory), use_kernels=False, **kwargs)


def load_tokenizer(path: str | Path | None = None):
    """The tokenizer of a model directory, with a chat template and a padding token."""
    from transformers import AutoTokenizer

    from phalanx.data.chat import ensure_chat_template

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(path)))
    ensure_chat_template(tokenizer)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(path: str | Path | None = None, dtype: torch.dtype | None = None):
    """A causal LM (policy or reference), float32 unless `dtype` says otherwise."""
    from transformers import AutoModelForCausalLM

    return from_pretrained(AutoModelForCausalLM, resolve_model_dir(path), dtype=dtype or torch.float32)


def reward_pad_token(tokenizer) -> str:
    """A padding token that never closes a chat turn (see the module docstring)."""
    for candidate in (tokenizer.unk_token, "<|endoftext|>", tokenizer.pad_token):
        if candidate and candidate != tokenizer.eos_token and candidate in tokenizer.get_vocab():
            return candidate
    return tokenizer.pad_token


def init_reward_model(base: str | Path | None = None, dtype: torch.dtype | None = None):
    """(model, tokenizer): a one-output sequence classifier on `base`'s backbone, score head
    initialised small (N(0, 1e-3)) so every reward starts near 0."""
    from transformers import AutoModelForSequenceClassification

    directory = resolve_model_dir(base)
    tokenizer = load_tokenizer(directory)
    tokenizer.pad_token = reward_pad_token(tokenizer)
    torch.manual_seed(0)
    model = from_pretrained(AutoModelForSequenceClassification, directory, num_labels=1,
                            pad_token_id=tokenizer.pad_token_id, dtype=dtype or torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1e-3)
    return model, tokenizer


def load_reward_model(path: str | Path, dtype: torch.dtype | None = None):
    """(model, tokenizer) of a trained reward model (train_rm's output_dir, a checkpoint or a directory)."""
    from transformers import AutoModelForSequenceClassification

    directory = resolve_model_dir(path)
    model = from_pretrained(AutoModelForSequenceClassification, directory, dtype=dtype or torch.float32)
    if model.config.num_labels != 1:
        raise ValueError(f"{directory} is a classifier with {model.config.num_labels} labels; a reward model has one "
                         "(train it with python -m apps.chat_rlhf.train_rm)")
    tokenizer = load_tokenizer(directory)
    if model.config.pad_token_id is not None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(model.config.pad_token_id)
    return model, tokenizer


def train_top_layers(model, layers: int) -> None:
    """Freeze all but the top `layers` transformer blocks, the final norm and (for a reward model)
    the score head; 0 leaves everything trainable. On CPU this makes a preference step cheap:
    no backward through the frozen blocks, no optimizer state for them or the (tied) embeddings."""
    if layers <= 0:
        return
    backbone = model.base_model
    blocks = getattr(backbone, "layers", None)
    if blocks is None or not hasattr(backbone, "norm"):
        raise ValueError(f"train_layers={layers} needs a decoder with .layers and .norm (Llama family); "
                         f"{type(model).__name__} has neither: set train_layers=0")
    if layers > len(blocks):
        raise ValueError(f"train_layers={layers} but the model has {len(blocks)} blocks")
    model.requires_grad_(False)
    for block in blocks[len(blocks) - layers:]:
        block.requires_grad_(True)
    backbone.norm.requires_grad_(True)
    if hasattr(model, "score"):
        model.score.requires_grad_(True)
