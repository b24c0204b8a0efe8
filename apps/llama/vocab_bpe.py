"""Vocabulary expansion for Hugging Face byte-level BPE tokenizers (GPT-2, SmolLM2, LLaMA-3 style).

Learn a byte-level BPE on the domain corpus with the base tokenizer's own pre-tokenizer, then
append its merges to the base model's merges.

Why merges are replayed rather than copied: a BPE applies merges in rank order, and appended
merges rank after all of the base's. A domain merge learned as (b2, b3) never fires if the base
already joined (b1, b2) first, so copying the domain merges verbatim leaves many new tokens
unreachable. Instead each domain token is segmented with the merges collected so far; if it
does not come out whole, merges are added that join exactly the pieces it comes out as (left to
right). Every learned token is then reachable, and base merges keep their priority: new merges
only join what the base left apart, so text outside the domain segments as before except where a
learned token occurs in it (SmolLM2 on held-out English: the same number of tokens).
"""
from __future__ import annotations

import json
from typing import Iterable

from tokenizers import Tokenizer, models, pre_tokenizers, trainers


def check_byte_level_bpe(tokenizer: Tokenizer) -> dict:
    """The tokenizer's JSON, after checking it is a byte-level BPE (the kind this module can extend)."""
    spec = json.loads(tokenizer.to_str())
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        raise ValueError(f"the base tokenizer's model is {model.get('type')!r}, not BPE; only BPE tokenizers can be "
                         "expanded with kind=bpe (for SentencePiece models use kind=sentencepiece)")

    def has_byte_level(node) -> bool:
        if not node:
            return False
        if node.get("type") == "ByteLevel":
            return True
        return any(has_byte_level(n) for n in node.get("pretokenizers", []))

    if not has_byte_level(spec.get("pre_tokenizer")):
        raise ValueError("the base BPE tokenizer has no ByteLevel pre-tokenizer; kind=bpe supports byte-level BPE "
                         "tokenizers (GPT-2, SmolLM2, LLaMA-3 families)")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise ValueError("BPE tokenizers with a subword prefix/suffix are not supported by kind=bpe")
    return spec


def train_domain_bpe(texts: Iterable[str], base: Tokenizer, num_merges: int, min_frequency: int = 2) -> list[tuple[str, str]]:
    """Merges of a byte-level BPE learned on the domain texts with the base's normaliser and
    pre-tokenizer (so the learned tokens fall inside the same pre-token boundaries)."""
    domain = Tokenizer(models.BPE())
    domain.normalizer = base.normalizer
    domain.pre_tokenizer = base.pre_tokenizer
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + num_merges, min_frequency=min_frequency,
                                  initial_alphabet=alphabet, show_progress=False, special_tokens=[])
    domain.train_from_iterator(texts, trainer=trainer)
    merges = json.loads(domain.to_str())["model"]["merges"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


def bpe_segment(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """Apply BPE merges (lowest rank first) to one pre-tokenized word of byte-level symbols."""
    parts = list(word)
    while len(parts) > 1:
        best, best_rank = -1, None
        for i in range(len(parts) - 1):
            r = ranks.get((parts[i], parts[i + 1]))
            if r is not None and (best_rank is None or r < best_rank):
                best, best_rank = i, r
        if best < 0:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return parts


def merge_bpe(base_spec: dict, domain_merges: list[tuple[str, str]]) -> tuple[dict, list[str]]:
    """A copy of the base tokenizer JSON extended with the domain merges; returns (spec, added tokens)."""
    spec = json.loads(json.dumps(base_spec))
    model = spec["model"]
    vocab: dict[str, int] = model["vocab"]
    raw_merges = model["merges"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in raw_merges]
    ranks = {pair: i for i, pair in enumerate(merges)}
    used_ids = set(vocab.values()) | {t["id"] for t in spec.get("added_tokens", [])}
    next_id = max(used_ids) + 1
    added: list[str] = []

    def add_merge(left: str, right: str) -> str:
        nonlocal next_id
        ranks[(left, right)] = len(merges)
        merges.append((left, right))
        token = left + right
        if token not in vocab:
            vocab[token] = next_id
            next_id += 1
            added.append(token)
        return token

    for left, right in domain_merges:
        target = left + right
        pieces = bpe_segment(target, ranks)
        # Join what the current merges leave apart, left to right, until the target is one token.
        while len(pieces) > 1:
            pieces = [add_merge(pieces[0], pieces[1])] + pieces[2:]
    model["merges"] = [[a, b] for a, b in merges]
    return spec, added
