"""Vocabulary expansion for SentencePiece tokenizers (LLaMA-1/2, Mistral-v1 style).

Learn a BPE SentencePiece model on the domain corpus with the base model's text handling
(identity normalisation, dummy prefix, split digits), then append each learned piece the base
lacks to the base model's `ModelProto`.

Why the new pieces are scored below every regular base piece: SentencePiece BPE merges the
highest-scoring piece first. Putting the new pieces last means the base's own merges run first,
so text the base tokenizer already handled (English, code) is segmented as before, and the new
pieces only join up what the base would have left as single characters or byte fallbacks.
Scores are float32, so they count down from the lowest *regular* score rather than from the
-1e9 the base gives its whitespace-run pieces (below -1e9 consecutive floats collide).
"""
from __future__ import annotations

import io
import re
from pathlib import Path

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as sp_pb2

_NORMAL = sp_pb2.ModelProto.SentencePiece.NORMAL
_USER_DEFINED = sp_pb2.ModelProto.SentencePiece.USER_DEFINED


def load_proto(path: str | Path) -> sp_pb2.ModelProto:
    proto = sp_pb2.ModelProto()
    try:
        proto.ParseFromString(Path(path).read_bytes())
    except Exception as exc:  # protobuf raises DecodeError, a plain Exception subclass
        raise ValueError(f"{path} is not a SentencePiece model file ({exc}); pass a `tokenizer.model`") from exc
    if not proto.pieces:
        raise ValueError(f"{path} holds no pieces; is it a SentencePiece model?")
    return proto


def train_domain_model(texts: list[str], vocab_size: int, base: sp_pb2.ModelProto, max_piece_length: int = 8,
                       character_coverage: float = 0.9995, threads: int = 2) -> sp_pb2.ModelProto:
    """A SentencePiece BPE model of the domain texts that treats text like the base does."""
    if not texts:
        raise ValueError("the domain corpus is empty: check `tokenizer.domain_sources` in the config")
    norm = base.normalizer_spec
    buf = io.BytesIO()
    try:
        _train(texts, vocab_size, base, norm, max_piece_length, character_coverage, threads, buf)
    except RuntimeError as exc:
        found = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", str(exc))
        if not found:
            raise
        raise ValueError(
            f"tokenizer.domain_vocab_size={vocab_size} cannot hold the {found.group(2)} distinct characters that "
            f"character_coverage={character_coverage} keeps from the domain corpus: raise domain_vocab_size above "
            f"{found.group(2)} or lower tokenizer.character_coverage"
        ) from None
    domain = sp_pb2.ModelProto()
    domain.ParseFromString(buf.getvalue())
    return domain


def _train(texts, vocab_size, base, norm, max_piece_length, character_coverage, threads, buf) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=buf,
        model_type="bpe",
        vocab_size=vocab_size,
        hard_vocab_limit=False,  # a small corpus may support fewer pieces: take what it has
        character_coverage=character_coverage,
        normalization_rule_name="identity" if not norm.precompiled_charsmap else "nmt_nfkc",
        add_dummy_prefix=norm.add_dummy_prefix,
        remove_extra_whitespaces=norm.remove_extra_whitespaces,
        split_digits=base.trainer_spec.split_digits,
        split_by_whitespace=base.trainer_spec.split_by_whitespace,
        max_sentencepiece_length=max_piece_length,
        max_sentence_length=1 << 20,
        byte_fallback=False,
        unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1,
        num_threads=threads,
        minloglevel=2,
    )


def merge_pieces(base: sp_pb2.ModelProto, domain: sp_pb2.ModelProto) -> tuple[sp_pb2.ModelProto, list[str]]:
    """A copy of `base` with the domain's normal pieces it lacks appended; returns (model, added)."""
    merged = sp_pb2.ModelProto()
    merged.CopyFrom(base)
    have = {p.piece for p in base.pieces}
    regular = [p.score for p in base.pieces if p.type == _NORMAL and p.score > -1e8]
    score = (min(regular) if regular else 0.0) - 1.0
    added: list[str] = []
    for piece in domain.pieces:
        if piece.type not in (_NORMAL, _USER_DEFINED) or piece.piece in have:
            continue
        new = merged.pieces.add()
        new.piece, new.score, new.type = piece.piece, score, _NORMAL
        score -= 1.0
        have.add(piece.piece)
        added.append(piece.piece)
    merged.trainer_spec.vocab_size = len(merged.pieces)
    return merged, added


def expand_sentencepiece(base_model_file: Path, texts: list[str], domain_vocab_size: int, out_model_file: Path,
                         max_piece_length: int = 8, character_coverage: float = 0.9995) -> list[str]:
    """Write the merged `tokenizer.model`; return the added pieces."""
    base = load_proto(base_model_file)
    if base.trainer_spec.model_type != sp_pb2.TrainerSpec.BPE:
        raise ValueError(f"{base_model_file} is a {sp_pb2.TrainerSpec.ModelType.Name(base.trainer_spec.model_type)} "
                         "SentencePiece model; only BPE models (the LLaMA family) can be expanded")
    domain = train_domain_model(texts, domain_vocab_size, base, max_piece_length, character_coverage)
    merged, added = merge_pieces(base, domain)
    out_model_file.parent.mkdir(parents=True, exist_ok=True)
    out_model_file.write_bytes(merged.SerializeToString())
    return added
