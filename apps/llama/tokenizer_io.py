"""Loading tokenizers from what users have: an HF tokenizer directory or a bare SentencePiece file."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from .corpus import resolve_path

# Files of an HF tokenizer directory that describe behaviour (special tokens, chat template)
# rather than the vocabulary itself; an expanded tokenizer keeps them from its base.
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json")


class TokenizerNotFound(FileNotFoundError):
    pass


def tokenizer_kind(path: str | Path) -> str:
    """'sentencepiece' for a tokenizer.model file or a directory holding one, else 'bpe' for a
    directory holding tokenizer.json."""
    p = resolve_path(path)
    if p.is_file() and p.suffix == ".model":
        return "sentencepiece"
    if p.is_dir() and (p / "tokenizer.model").is_file():
        return "sentencepiece"
    if p.is_dir() and (p / "tokenizer.json").is_file():
        return "bpe"
    raise TokenizerNotFound(
        f"no tokenizer at {str(p)!r}: expected a SentencePiece `.model` file or a Hugging Face tokenizer "
        "directory (with tokenizer.json or tokenizer.model); fix `tokenizer.base` in the config"
    )


def load_tokenizer(path: str | Path):
    """A transformers tokenizer from an HF directory or a bare SentencePiece `.model` file."""
    from transformers import AutoTokenizer, LlamaTokenizer

    p = resolve_path(path)
    tokenizer_kind(p)  # raises a clear error when nothing is there
    if p.is_file():
        with tempfile.TemporaryDirectory(prefix="phalanx-sp-") as tmp:
            shutil.copyfile(p, Path(tmp) / "tokenizer.model")
            tok = LlamaTokenizer.from_pretrained(tmp)
    else:
        tok = AutoTokenizer.from_pretrained(str(p))
    if tok.eos_token_id is None:
        raise ValueError(f"the tokenizer at {p} has no EOS token; documents are separated by EOS, so set one "
                         "(eos_token in tokenizer_config.json)")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # padding is never a training target, any id will do
    return tok


def copy_side_files(src: str | Path, dst: Path) -> None:
    src = resolve_path(src)
    if not src.is_dir():
        return
    for name in TOKENIZER_SIDE_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
