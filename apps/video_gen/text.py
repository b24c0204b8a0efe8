"""The small text side: a word-level tokenizer built from the captions (Hugging Face `tokenizers`,
saved as a `PreTrainedTokenizerFast`) and a CLIP text encoder trained from scratch with the
transformer, as the diffusion recipe does; or both from a local directory."""
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

    return AutoTokenizer.from_pretrained(str(directory))


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
