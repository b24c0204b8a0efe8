"""Step 3: corpora → tokenized, packed training rows on disk (Hugging Face `datasets`).

    python -m apps.llama.prepare_data --config apps/llama/configs/tiny.yaml          # pre-training
    python -m apps.llama.prepare_data --config apps/llama/configs/tiny.yaml --sft    # chat SFT

Pre-training writes to `<work_dir>/data/`:
    train/      rows of exactly `seq_len` tokens (`input_ids`, `labels`); with
                `per_category_bins` a DatasetDict with one dataset per category
    heldout/    the held-out documents as text (`text`, `category`), for bits-per-character
    stats.json  documents, tokens and rows per category
SFT writes `train/`, `heldout/` (rows with `input_ids`, `labels`) and `stats.json` to
`<work_dir>/sft_data/`.

Rows are generated as a stream (`Dataset.from_generator`), so memory stays flat with corpus size.
"""
from __future__ import annotations

import json
import sys
import tempfile
import zlib
from collections import Counter
from pathlib import Path
from typing import Iterator

from phalanx.checkpoint import atomic_directory

from .config import RecipeConfig, parse_args
from .corpus import Document, is_heldout, read_documents
from phalanx.data.packing import ExamplePacker, SequencePacker
from .tokenizer_io import load_tokenizer

BATCH_DOCS = 256


def _features():
    from datasets import Features, Sequence, Value

    return Features({"input_ids": Sequence(Value("int32")), "labels": Sequence(Value("int32"))})


def _batched(items, size: int):
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _train_documents(cfg: RecipeConfig, category: str | None) -> Iterator[Document]:
    for source in cfg.data.sources:
        for doc in read_documents(source):
            if is_heldout(doc.text, cfg.holdout_fraction) or (category is not None and doc.category != category):
                continue
            yield doc


def packed_rows(tokenizer, docs: Iterator[Document], seq_len: int, drop_last_partial: bool,
                stats: Counter) -> Iterator[dict]:
    """Tokenize documents in batches and pack them; count tokens per category into `stats`."""
    packer = SequencePacker(seq_len, tokenizer.eos_token_id, tokenizer.pad_token_id)
    for batch in _batched(docs, BATCH_DOCS):
        encoded = tokenizer([d.text for d in batch], add_special_tokens=False)["input_ids"]
        for doc, ids in zip(batch, encoded):
            stats[f"{doc.category}/documents"] += 1
            stats[f"{doc.category}/chars"] += len(doc.text)
            stats[f"{doc.category}/tokens"] += len(ids) + 1  # + EOS
            for row in packer.add(ids):
                stats["rows"] += 1
                yield row
    for row in packer.finish(drop_last_partial):
        stats["rows"] += 1
        stats["padded_rows"] += 1
        yield row


def _quiet_datasets() -> None:
    """Our own summary line says what was written; datasets' per-file progress bars add nothing."""
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()


def _dataset(gen, fingerprint: str, cache_dir: str):
    from datasets import Dataset

    # A fresh cache_dir per run: from_generator must never hand back rows of an older run.
    return Dataset.from_generator(gen, features=_features(), cache_dir=cache_dir, fingerprint=fingerprint)


def _categories(cfg: RecipeConfig) -> list[str]:
    seen: dict[str, None] = {}
    for source in cfg.data.sources:
        for doc in read_documents(source):
            seen.setdefault(doc.category, None)
    return list(seen)


def prepare_pretrain(cfg: RecipeConfig) -> dict:
    from datasets import Dataset, DatasetDict

    if not cfg.data.sources:
        raise ValueError("data.sources is empty: list the corpus files to train on")
    tokenizer = load_tokenizer(cfg.tokenizer_dir)
    _quiet_datasets()
    out = cfg.data_dir
    with atomic_directory(out) as tmp:
        stats: Counter = Counter()
        seq_len, drop = cfg.data.seq_len, cfg.data.drop_last_partial
        with tempfile.TemporaryDirectory(prefix="phalanx-prep-", dir=tmp) as cache:
            if cfg.data.per_category_bins:
                bins = {}
                for category in _categories(cfg):
                    def gen(category=category):
                        yield from packed_rows(tokenizer, _train_documents(cfg, category), seq_len, drop, stats)
                    bins[category] = _dataset(gen, f"bin-{zlib.crc32(category.encode())}", cache)
                DatasetDict(bins).save_to_disk(str(tmp / "train"))
            else:
                def gen():
                    yield from packed_rows(tokenizer, _train_documents(cfg, None), seq_len, drop, stats)
                _dataset(gen, "packed", cache).save_to_disk(str(tmp / "train"))
        heldout = [d for s in cfg.data.sources for d in read_documents(s) if is_heldout(d.text, cfg.holdout_fraction)]
        Dataset.from_dict({"text": [d.text for d in heldout], "category": [d.category for d in heldout]}).save_to_disk(str(tmp / "heldout"))
        summary = {"seq_len": seq_len, "tokenizer": str(cfg.tokenizer_dir), "per_category_bins": cfg.data.per_category_bins,
                   **dict(sorted(stats.items())), "heldout_documents": len(heldout)}
        (tmp / "stats.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False), encoding="utf-8")
    return summary


def prepare_sft(cfg: RecipeConfig, tokenizer_dir: str | Path | None = None) -> dict:
    from datasets import Dataset

    from phalanx.data.chat import encode_chat, ensure_chat_template

    from .corpus import load_chat_records

    scfg = cfg.sft_data
    if not scfg.sources:
        raise ValueError("sft_data.sources is empty: list the chat/instruction files to fine-tune on")
    tokenizer = load_tokenizer(tokenizer_dir or cfg.tokenizer_dir)
    ensure_chat_template(tokenizer)
    _quiet_datasets()
    stats: Counter = Counter()
    rows: dict[str, list[dict]] = {"train": [], "heldout": []}
    packers = {split: ExamplePacker(scfg.seq_len, tokenizer.pad_token_id, scfg.pack) for split in rows}
    for source in scfg.sources:
        for messages in load_chat_records(source):
            split = "heldout" if is_heldout(json.dumps(messages, ensure_ascii=False), scfg.holdout_fraction) else "train"
            encoded = encode_chat(tokenizer, messages, scfg.seq_len)
            if encoded is None:
                stats["dropped_no_target_after_truncation"] += 1
                continue
            ids, labels = encoded
            stats[f"{split}/conversations"] += 1
            stats[f"{split}/tokens"] += len(ids)
            stats[f"{split}/target_tokens"] += sum(label >= 0 for label in labels)
            rows[split].extend(packers[split].add(ids, labels))
    out = cfg.sft_data_dir
    with atomic_directory(out) as tmp:
        for split, packer in packers.items():
            rows[split].extend(packer.finish())
            stats[f"{split}/rows"] = len(rows[split])
            data = {k: [r[k] for r in rows[split]] for k in ("input_ids", "labels")}
            Dataset.from_dict(data, features=_features()).save_to_disk(str(tmp / split))
        tokenizer.save_pretrained(str(tmp / "tokenizer"))  # with the chat template used for the labels
        summary = {"seq_len": scfg.seq_len, "packed": scfg.pack, **dict(sorted(stats.items()))}
        (tmp / "stats.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    return summary


def main(argv: list[str] | None = None) -> None:
    def extra(parser):
        parser.add_argument("--sft", action="store_true", help="prepare the chat SFT data (sft_data section) instead")
        parser.add_argument("--tokenizer", default=None, help="SFT only: tokenizer directory (default <work_dir>/tokenizer)")

    cfg, args = parse_args("Tokenize and pack corpora for pre-training, or chat data for SFT.", argv, extra)
    if args.sft:
        summary = prepare_sft(cfg, args.tokenizer)
        print(f"SFT data: {summary.get('train/conversations', 0)} train / {summary.get('heldout/conversations', 0)} held-out "
              f"conversations in {summary['train/rows']} + {summary['heldout/rows']} rows of {summary['seq_len']} tokens; "
              f"saved to {cfg.sft_data_dir}")
    else:
        summary = prepare_pretrain(cfg)
        cats = sorted({k.split('/')[0] for k in summary if k.endswith('/tokens')})
        parts = ", ".join(f"{c}: {summary[c + '/documents']:,} docs, {summary[c + '/tokens']:,} tokens" for c in cats)
        print(f"pre-training data: {summary['rows']:,} rows of {summary['seq_len']} tokens ({parts}); "
              f"{summary['heldout_documents']} held-out documents; saved to {cfg.data_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
