"""Data preparation: packing loses no token and wastes no position; per-category bins stay pure."""
from __future__ import annotations

import json

import pytest

from phalanx.data.packing import IGNORE_INDEX, ExamplePacker, SequencePacker


def test_sequence_packer_keeps_every_token_in_order():
    docs = [list(range(100, 100 + n)) for n in (3, 10, 1, 7, 25, 5)]  # 57 tokens with EOS: 7 full rows + 1
    packer = SequencePacker(seq_len=8, eos_id=2, pad_id=0)
    rows = [r for d in docs for r in packer.add(d)] + list(packer.finish())
    stream = [t for d in docs for t in (*d, 2)]
    assert all(len(r["input_ids"]) == 8 for r in rows)
    labelled = [t for r in rows for t, lab in zip(r["input_ids"], r["labels"], strict=True) if lab != IGNORE_INDEX]
    assert labelled == stream  # nothing lost, nothing reordered, EOS after every document
    # only the final row has padding, and padding is never a target
    assert all(r["labels"] == r["input_ids"] for r in rows[:-1])
    last = rows[-1]
    n_real = len(stream) % 8
    assert len(rows) == 8 and n_real == 1
    assert last["input_ids"][n_real:] == [0] * (8 - n_real) and last["labels"][n_real:] == [IGNORE_INDEX] * (8 - n_real)
    assert packer.tokens == len(stream) and packer.documents == len(docs)


def test_sequence_packer_can_drop_the_partial_row():
    packer = SequencePacker(seq_len=4, eos_id=2, pad_id=0)
    rows = list(packer.add([5, 6, 7, 8, 9])) + list(packer.finish(drop_partial=True))
    assert rows == [{"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8]}]


def test_example_packer_never_splits_an_example():
    packer = ExamplePacker(seq_len=10, pad_id=0)
    examples = [([1, 2, 3], [-100, 2, 3]), ([4, 5, 6, 7, 8], [-100, -100, 6, 7, 8]), ([9, 9, 9], [-100, 9, 9])]
    rows = [r for ids, labels in examples for r in packer.add(ids, labels)] + list(packer.finish())
    assert [r["input_ids"] for r in rows] == [[1, 2, 3, 4, 5, 6, 7, 8, 0, 0], [9, 9, 9] + [0] * 7]
    assert rows[0]["labels"] == [-100, 2, 3, -100, -100, 6, 7, 8, -100, -100]
    with pytest.raises(ValueError, match="longer than seq_len"):
        list(packer.add(list(range(11)), list(range(11))))
    unpacked = ExamplePacker(seq_len=10, pad_id=0, pack=False)
    rows = [r for ids, labels in examples for r in unpacked.add(ids, labels)] + list(unpacked.finish())
    assert len(rows) == 3


def test_prepared_pretraining_data_holds_every_token_of_every_training_document(tiny_run):
    from datasets import load_from_disk

    from apps.llama.corpus import is_heldout, read_documents
    from apps.llama.tokenizer_io import load_tokenizer

    cfg, reports = tiny_run
    tok = load_tokenizer(cfg.tokenizer_dir)
    rows = load_from_disk(str(cfg.data_dir / "train"))
    stream = []
    for source in cfg.data.sources:
        for doc in read_documents(source):
            if not is_heldout(doc.text, cfg.holdout_fraction):
                stream += tok(doc.text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    packed = [t for r in rows for t, lab in zip(r["input_ids"], r["labels"], strict=True) if lab != IGNORE_INDEX]
    assert packed == stream
    assert {len(r) for r in rows["input_ids"]} == {cfg.data.seq_len}
    padding = sum(lab == IGNORE_INDEX for r in rows["labels"] for lab in r)
    assert padding < cfg.data.seq_len  # at most the tail of the last row
    stats = json.loads((cfg.data_dir / "stats.json").read_text())
    assert stats["zh/tokens"] + stats["en/tokens"] == len(stream)
    held = load_from_disk(str(cfg.data_dir / "heldout"))
    assert set(held["category"]) == {"zh", "en"} and all(is_heldout(t, cfg.holdout_fraction) for t in held["text"])


def test_per_category_bins_keep_categories_apart(tmp_path, make_tiny_config, tiny_run):
    import shutil

    from datasets import DatasetDict, load_from_disk

    from apps.llama.prepare_data import prepare_pretrain
    from apps.llama.tokenizer_io import load_tokenizer

    base_cfg, _ = tiny_run
    cfg = make_tiny_config(tmp_path, "data.per_category_bins=true")
    shutil.copytree(base_cfg.tokenizer_dir, cfg.tokenizer_dir)
    summary = prepare_pretrain(cfg)
    bins = load_from_disk(str(cfg.data_dir / "train"))
    assert isinstance(bins, DatasetDict) and set(bins) == {"zh", "en"}
    tok = load_tokenizer(cfg.tokenizer_dir)
    for category, rows in bins.items():
        n = sum(lab != IGNORE_INDEX for r in rows["labels"] for lab in r)
        assert n == summary[f"{category}/tokens"]
    zh_text = tok.decode(bins["zh"][0]["input_ids"])
    assert sum("\u4e00" <= c <= "\u9fff" for c in zh_text) > 20
    en_text = tok.decode(bins["en"][0]["input_ids"])
    assert not any("\u4e00" <= c <= "\u9fff" for c in en_text)


def test_missing_tokenizer_or_sources_fail_before_work(tmp_path, make_tiny_config):
    from apps.llama.prepare_data import prepare_pretrain

    cfg = make_tiny_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        prepare_pretrain(cfg)
    cfg.data.sources = []
    with pytest.raises(ValueError, match="data.sources is empty"):
        prepare_pretrain(cfg)
