"""The small text side: a word-level tokenizer built from the captions (Hugging Face `tokenizers`,
saved as a `PreTrainedTokenizerFast`) and a CLIP text encoder trained from scratch with the
transformer, as the diffusion recipe does; or a user's text encoder and tokenizer from a local
Hugging Face directory (`model.text_encoder_dir`: T5 / UMT5 as Wan and Open-Sora use, CLIP, ...)."""
from __future__ import annotations

from pathlib import Path

import torch

SPECIAL = {"pad_token": "[PAD]", "unk_token": "[UNK]", "bos_token": "[BOS]", "eos_token": "[EOS]"}


def build_tokenizer(captions: list[str], max_length: int):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token=SPECIAL["unk_token"]))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(captions, trainers.WordLevelTrainer(special_tokens=list(SPECIAL.values())))
    bos, eos = SPECIAL["bos_token"], SPECIAL["eos_token"]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A {eos}", special_tokens=[
        (bos, tok.token_to_id(bos)), (eos, tok.token_to_id(eos))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=max_length, **SPECIAL)


def load_tokenizer(directory: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


# Encoder-only classes for a config's model_type: AutoModel would give T5's encoder-decoder.
ENCODER_FOR_TYPE = {"t5": "T5EncoderModel", "umt5": "UMT5EncoderModel", "mt5": "MT5EncoderModel",
                    "clip": "CLIPTextModel", "clip_text_model": "CLIPTextModel"}


def load_text_encoder(directory: str | Path):
    """A transformers text encoder saved with save_pretrained, offline: the class its config names when
    that is an encoder (T5EncoderModel, CLIPTextModel, ...), else the encoder for its model_type, else
    AutoModel (BERT-like encoders). Its forward(input_ids, attention_mask) gives last_hidden_state."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
    arch = (getattr(config, "architectures", None) or [""])[0]
    name = arch if arch in ENCODER_FOR_TYPE.values() or arch == "CLIPTextModelWithProjection" \
        else ENCODER_FOR_TYPE.get(config.model_type)
    cls = getattr(transformers, name) if name else transformers.AutoModel
    return cls.from_pretrained(str(directory), local_files_only=True)


def load_local_text(text_encoder_dir: str, tokenizer_dir: str | None, max_length: int):
    """(text encoder, tokenizer) from `model.text_encoder_dir` / `model.tokenizer_dir`, checked: one
    ConfigError naming the key and the fix for a directory that does not hold them. A diffusers
    pipeline directory (text_encoder/ and tokenizer/ inside) works too. The tokenizer pads and
    truncates to `max_length` (data.max_prompt_tokens)."""
    from phalanx.config import ConfigError

    from .config import resolve

    enc = resolve(text_encoder_dir)
    if not (enc / "config.json").is_file() and (enc / "text_encoder" / "config.json").is_file():
        enc, default_tok = enc / "text_encoder", enc / "tokenizer"
    else:
        default_tok = enc
    fix = ("point it at a local Hugging Face text encoder directory (T5EncoderModel, UMT5EncoderModel, CLIPTextModel "
           "... saved with save_pretrained, or a diffusers pipeline directory with text_encoder/), or set it to null "
           "to train the small CLIP from scratch")
    if not (enc / "config.json").is_file():
        raise ConfigError(f"config 'model.text_encoder_dir'={text_encoder_dir!r}: {enc} holds no config.json; {fix}")
    try:
        encoder = load_text_encoder(enc)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"config 'model.text_encoder_dir'={text_encoder_dir!r}: could not load a text encoder "
                          f"from {enc} ({exc}); {fix}") from exc
    tok_dir, key = (resolve(tokenizer_dir), "model.tokenizer_dir") if tokenizer_dir else (default_tok, "model.text_encoder_dir")
    tok_fix = f"give model.tokenizer_dir: a directory with the tokenizer saved by save_pretrained (tokenizer.json ...)"
    files = ("tokenizer.json", "tokenizer_config.json", "spiece.model", "vocab.json", "vocab.txt")
    if not any((tok_dir / name).is_file() for name in files):
        raise ConfigError(f"config '{key}'={tokenizer_dir or text_encoder_dir!r}: no tokenizer loads from {tok_dir} "
                          f"(none of {', '.join(files)}); {tok_fix}")
    try:
        tokenizer = load_tokenizer(tok_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"config '{key}'={tokenizer_dir or text_encoder_dir!r}: no tokenizer loads from {tok_dir} "
                          f"({exc}); {tok_fix}") from exc
    if tokenizer.pad_token_id is None:
        raise ConfigError(f"config '{key}'={tokenizer_dir or text_encoder_dir!r}: the tokenizer in {tok_dir} has no "
                          f"pad token (prompts are padded to data.max_prompt_tokens); {tok_fix} with a pad token")
    vocab = encoder.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise ConfigError(f"config '{key}'={tokenizer_dir or text_encoder_dir!r}: the tokenizer has {len(tokenizer)} "
                          f"tokens but the text encoder in {enc} embeds {vocab}; give the encoder's own tokenizer")
    tokenizer.model_max_length = max_length
    return encoder, tokenizer


def tokenize(tokenizer, captions: list[str]) -> torch.Tensor:
    return tokenizer(captions, padding="max_length", truncation=True, max_length=tokenizer.model_max_length,
                     return_tensors="pt").input_ids


def build_text_encoder(tokenizer, hidden: int, layers: int, heads: int, token_embedding_std: float = 1.0):
    """A CLIP text encoder from scratch. Its word embeddings start at `token_embedding_std` instead of
    CLIP's 0.02: at 0.02 the pre-LN residual stream barely tells two words apart, and a word whose
    effect on the clip is hard to learn (the motion direction) never got separated from its siblings
    (left/right/up/down encoded alike: the transformer had nothing to condition on)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
                            num_hidden_layers=layers, num_attention_heads=heads,
                            max_position_embeddings=tokenizer.model_max_length, projection_dim=hidden,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    model = CLIPTextModel(config)
    torch.nn.init.normal_(model.get_input_embeddings().weight, std=token_embedding_std)
    return model
