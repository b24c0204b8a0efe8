"""Step 2: give the base model rows for the new tokens.

    python -m apps.llama.init_model --config apps/llama/configs/tiny.yaml

Resizes the input embeddings and the LM head to the expanded vocabulary. Each new token's row
starts as the mean of the base model's rows for the pieces the *old* tokenizer splits that token
into (for a new Chinese character in a byte-level vocabulary: its UTF-8 byte tokens). A global
mean would make every new token look alike; the per-token mean keeps what the base model already
knows about the token's text, so the expanded model starts close to the base model.

The split is computed with the old tokenizer's BPE model on the token's own string (in the
tokenizer's internal alphabet: `▁` for spaces in SentencePiece, byte symbols in byte-level BPE),
which avoids any decode/re-encode whitespace quirks.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from phalanx.checkpoint import atomic_directory

from .config import RecipeConfig, parse_args
from .corpus import resolve_path
from .tokenizer_io import load_tokenizer


def check_extension(base_tok, new_tok) -> list[int]:
    """Ids of the tokens the new tokenizer adds; fails unless every base token keeps its id."""
    new_vocab = new_tok.get_vocab()
    moved = [(t, i, new_vocab.get(t)) for t, i in base_tok.get_vocab().items() if new_vocab.get(t) != i]
    if moved:
        t, old, new = moved[0]
        raise ValueError(
            f"the expanded tokenizer is not an extension of the base: token {t!r} has id {old} in the base and {new} "
            f"in the expanded one ({len(moved)} tokens differ). Re-run expand_vocab from the same base tokenizer."
        )
    base_ids = set(base_tok.get_vocab().values())
    return sorted(i for i in new_vocab.values() if i not in base_ids)


def old_piece_ids(base_tok, new_tok, new_ids: list[int]) -> dict[int, list[int]]:
    """For each new token id, the ids of the pieces the base tokenizer splits it into."""
    model = base_tok.backend_tokenizer.model
    out = {}
    for i in new_ids:
        token = new_tok.convert_ids_to_tokens(i)
        pieces = [t.id for t in model.tokenize(token)]
        if not pieces:
            raise ValueError(f"the base tokenizer cannot split new token {token!r} (id {i}) into known pieces")
        out[i] = pieces
    return out


@torch.no_grad()
def resize_with_piece_means(model, pieces: dict[int, list[int]], vocab_size: int) -> None:
    """Resize embeddings (and an untied LM head) to `vocab_size` rows; new rows = mean of piece rows."""
    emb_old = model.get_input_embeddings().weight.detach().clone()
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    head_old = None if head is None or tied else head.weight.detach().clone()
    if vocab_size > emb_old.shape[0]:
        model.resize_token_embeddings(vocab_size, mean_resizing=False)
    emb = model.get_input_embeddings().weight
    for new_id, ids in pieces.items():
        index = torch.tensor(ids)
        emb[new_id] = emb_old[index].mean(0)
        if head_old is not None:
            model.get_output_embeddings().weight[new_id] = head_old[index].mean(0)


def build_from_config(architecture: dict, tokenizer, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    reserved = {"vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"} & set(architecture)
    if reserved:
        raise ValueError(f"model.architecture sets {sorted(reserved)}; these come from the tokenizer, remove them")
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **architecture)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def load_base_model(path: str | Path):
    from transformers import AutoModelForCausalLM

    p = resolve_path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"no model at {str(p)!r} (no config.json): set model.base to a Hugging Face model directory, "
            "for SmolLM2 run `python -m phalanx.pretrained` first, or leave model.base empty to build from model.architecture"
        )
    return AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32)


def init_model(cfg: RecipeConfig) -> dict:
    base_tok = load_tokenizer(cfg.tokenizer.base)
    new_tok = load_tokenizer(cfg.tokenizer_dir)
    model = load_base_model(cfg.model.base) if cfg.model.base else build_from_config(cfg.model.architecture, base_tok, cfg.model.init_seed)
    new_ids = check_extension(base_tok, new_tok)
    pieces = old_piece_ids(base_tok, new_tok, new_ids)
    rows = max(len(new_tok), model.get_input_embeddings().weight.shape[0])
    resize_with_piece_means(model, pieces, rows)
    model.config.vocab_size = rows
    model.config.eos_token_id = new_tok.eos_token_id
    model.config.pad_token_id = new_tok.pad_token_id
    if model.generation_config is not None:
        model.generation_config.eos_token_id = new_tok.eos_token_id
        model.generation_config.pad_token_id = new_tok.pad_token_id

    out = cfg.model_init_dir
    with atomic_directory(out) as tmp:
        model.save_pretrained(str(tmp))
        new_tok.save_pretrained(str(tmp))
        report = {
            "base": cfg.model.base or "from config",
            "parameters": sum(p.numel() for p in model.parameters()),
            "vocab_before": len(base_tok), "vocab_after": rows, "new_rows": len(new_ids),
            "mean_pieces_per_new_token": round(sum(len(v) for v in pieces.values()) / max(len(pieces), 1), 2),
        }
        (tmp / "init_report.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    return report


def main(argv: list[str] | None = None) -> None:
    cfg, _ = parse_args("Resize the base model to the expanded vocabulary (new rows: mean of their old pieces).", argv)
    report = init_model(cfg)
    print(f"model {report['base']}: {report['parameters'] / 1e6:.1f} M parameters, vocabulary {report['vocab_before']} → "
          f"{report['vocab_after']} ({report['new_rows']} new rows, each the mean of "
          f"{report['mean_pieces_per_new_token']} old pieces on average); saved to {cfg.model_init_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
