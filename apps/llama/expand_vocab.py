"""Step 1: learn new tokens from the domain corpus and merge them into the base tokenizer.

    python -m apps.llama.expand_vocab --config apps/llama/configs/tiny.yaml

Writes a Hugging Face tokenizer directory to `<work_dir>/tokenizer` (plus `tokenizer.model` for
SentencePiece bases) and `expansion_report.json`: how many tokens were added and how many fewer
tokens the held-out part of each corpus takes, measured per character so tokenizers compare.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from phalanx.checkpoint import atomic_directory

from .config import RecipeConfig, parse_args
from .corpus import domain_text, read_documents, is_heldout, resolve_path
from .tokenizer_io import copy_side_files, load_tokenizer, tokenizer_kind


def _expand_sentencepiece(cfg: RecipeConfig, texts: list[str], out: Path) -> list[str]:
    from transformers import LlamaTokenizer

    from .vocab_sp import expand_sentencepiece

    base = resolve_path(cfg.tokenizer.base)
    model_file = base if base.is_file() else base / "tokenizer.model"
    added = expand_sentencepiece(model_file, texts, cfg.tokenizer.domain_vocab_size, out / "tokenizer.model",
                                 max_piece_length=cfg.tokenizer.max_piece_length,
                                 character_coverage=cfg.tokenizer.character_coverage)
    copy_side_files(base, out)
    # transformers converts tokenizer.model into a fast tokenizer; saving writes tokenizer.json
    # next to it so later loads are quick and need no sentencepiece.
    LlamaTokenizer.from_pretrained(str(out)).save_pretrained(str(out))
    return added


def _expand_bpe(cfg: RecipeConfig, texts: list[str], out: Path) -> list[str]:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from .vocab_bpe import check_byte_level_bpe, merge_bpe, train_domain_bpe

    base_dir = resolve_path(cfg.tokenizer.base)
    base = Tokenizer.from_file(str(base_dir / "tokenizer.json"))
    spec = check_byte_level_bpe(base)
    merges = train_domain_bpe(texts, base, cfg.tokenizer.domain_vocab_size)
    merged, added = merge_bpe(spec, merges)
    copy_side_files(base_dir, out)
    (out / "tokenizer.json").write_text(json.dumps(merged, ensure_ascii=False), encoding="utf-8")
    AutoTokenizer.from_pretrained(str(out)).save_pretrained(str(out))
    return added


def token_counts(tokenizer, texts: list[str]) -> int:
    if not texts:
        return 0
    enc = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return sum(len(ids) for ids in enc)


def compression_report(base_tok, new_tok, docs_by_category: dict[str, list[str]]) -> dict:
    """Per category: characters, tokens before/after, characters per token, reduction, and
    whether decode(encode(text)) gives the text back exactly with the new tokenizer."""
    report = {}
    for category, texts in docs_by_category.items():
        chars = sum(len(t) for t in texts)
        before, after = token_counts(base_tok, texts), token_counts(new_tok, texts)
        roundtrip = all(new_tok.decode(new_tok(t, add_special_tokens=False)["input_ids"]) == t for t in texts)
        report[category] = {
            "documents": len(texts), "chars": chars, "tokens_base": before, "tokens_expanded": after,
            "chars_per_token_base": round(chars / max(before, 1), 4),
            "chars_per_token_expanded": round(chars / max(after, 1), 4),
            "token_reduction": round(1 - after / max(before, 1), 4),
            "roundtrip_exact": roundtrip,
        }
    return report


def heldout_by_category(cfg: RecipeConfig, max_chars: int = 200_000) -> dict[str, list[str]]:
    """Held-out documents of the domain corpus and of the training mixture, by category."""
    out: dict[str, list[str]] = {}
    sizes: dict[str, int] = {}
    seen = set()
    for source in [*cfg.tokenizer.domain_sources, *cfg.data.sources]:
        key = (source.path, source.category)
        if key in seen:
            continue
        seen.add(key)
        for doc in read_documents(source):
            if not is_heldout(doc.text, cfg.holdout_fraction) or sizes.get(doc.category, 0) >= max_chars:
                continue
            out.setdefault(doc.category, []).append(doc.text)
            sizes[doc.category] = sizes.get(doc.category, 0) + len(doc.text)
    return out


def expand_vocab(cfg: RecipeConfig) -> dict:
    """Run step 1; return the report (also written to `<tokenizer_dir>/expansion_report.json`)."""
    tcfg = cfg.tokenizer
    kind = tokenizer_kind(tcfg.base) if tcfg.kind == "auto" else tcfg.kind
    if not tcfg.domain_sources:
        raise ValueError("tokenizer.domain_sources is empty: list the domain corpus files to learn new tokens from")
    start = time.perf_counter()
    texts = domain_text(tcfg.domain_sources, cfg.holdout_fraction, tcfg.max_training_chars)
    out = cfg.tokenizer_dir
    with atomic_directory(out) as tmp:
        added = (_expand_sentencepiece if kind == "sentencepiece" else _expand_bpe)(cfg, texts, tmp)
        base_tok, new_tok = load_tokenizer(tcfg.base), load_tokenizer(tmp)
        report = {
            "kind": kind,
            "base": str(tcfg.base),
            "base_vocab": len(base_tok),
            "expanded_vocab": len(new_tok),
            "added_tokens": len(added),
            "domain_training_chars": sum(len(t) for t in texts),
            "seconds": round(time.perf_counter() - start, 1),
            "heldout": compression_report(base_tok, new_tok, heldout_by_category(cfg)),
            "sample_new_tokens": [new_tok.convert_tokens_to_string([t]) if kind == "bpe" else t for t in added[:40]],
        }
        (tmp / "expansion_report.json").write_text(json.dumps(report, ensure_ascii=False, indent=2), encoding="utf-8")
    return report


def format_report(report: dict) -> str:
    lines = [f"{report['kind']} tokenizer: {report['base_vocab']} → {report['expanded_vocab']} tokens "
             f"(+{report['added_tokens']} learned from {report['domain_training_chars']:,} domain characters)"]
    for category, r in report["heldout"].items():
        lines.append(f"  held-out {category:>10}: {r['chars']:>8,} chars  {r['tokens_base']:>8,} → {r['tokens_expanded']:>8,} tokens  "
                     f"({r['chars_per_token_base']:.2f} → {r['chars_per_token_expanded']:.2f} chars/token, "
                     f"{100 * r['token_reduction']:.1f}% fewer)  round-trip exact: {r['roundtrip_exact']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    cfg, _ = parse_args("Expand a tokenizer's vocabulary with tokens learned from a domain corpus.", argv)
    report = expand_vocab(cfg)
    print(format_report(report))
    print(f"saved to {cfg.tokenizer_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
