"""Vocabulary expansion, both tokenizer kinds: exact round trip, shorter domain text, base ids kept."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from apps.llama.corpus import SourceConfig, read_documents

DATA = Path(__file__).resolve().parents[3] / "apps" / "llama" / "data"

TRICKY = [
    "床前明月光，疑是地上霜。\n举头望明月，低头思故乡。",
    "Mixed 中文 and English,\ttabs,  double  spaces\n\nand blank lines.",
    "全角\u3000空格、《书名》[1]（注）…… emoji 🐉 and accents: café, naïve",
    "数字 2024 年 3.14159 and code: x = f(y) + 1",
]


def _docs(name: str, n: int, **kw) -> list[str]:
    return [d.text for d in read_documents(SourceConfig(path=str(DATA / name), max_docs=n, **kw))]


def test_sentencepiece_expansion_shortens_domain_text_and_round_trips(tiny_run):
    from apps.llama.tokenizer_io import load_tokenizer

    cfg, reports = tiny_run
    report = reports["vocab"]
    assert report["kind"] == "sentencepiece"
    assert report["added_tokens"] > 1000
    assert report["expanded_vocab"] == report["base_vocab"] + report["added_tokens"]
    zh, en = report["heldout"]["zh"], report["heldout"]["en"]
    assert zh["token_reduction"] > 0.25, zh  # classical Chinese: most characters were byte fallbacks
    assert abs(en["token_reduction"]) < 0.02, en  # English is left (almost) alone
    assert zh["roundtrip_exact"] and en["roundtrip_exact"]

    tok = load_tokenizer(cfg.tokenizer_dir)
    for text in TRICKY + _docs("zh_classics.txt.gz", 200) + _docs("en_wikipedia_leads.jsonl.gz", 50):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text


def test_sentencepiece_model_file_and_fast_tokenizer_agree(tiny_run):
    import sentencepiece as spm

    from apps.llama.tokenizer_io import load_tokenizer

    cfg, _ = tiny_run
    sp = spm.SentencePieceProcessor(model_file=str(cfg.tokenizer_dir / "tokenizer.model"))
    tok = load_tokenizer(cfg.tokenizer_dir)
    assert sp.get_piece_size() == len(tok)
    for text in _docs("zh_classics.txt.gz", 300):
        assert tok(text, add_special_tokens=False)["input_ids"] == sp.encode(text)


def test_expanded_tokenizer_keeps_every_base_id(tiny_run):
    from apps.llama.init_model import check_extension
    from apps.llama.tokenizer_io import load_tokenizer

    cfg, reports = tiny_run
    base, new = load_tokenizer(cfg.tokenizer.base), load_tokenizer(cfg.tokenizer_dir)
    new_ids = check_extension(base, new)
    assert new_ids == list(range(len(base), len(new)))


def test_sentencepiece_too_small_vocab_names_the_fix(tmp_path, make_tiny_config):
    from apps.llama.expand_vocab import expand_vocab

    cfg = make_tiny_config(tmp_path, "tokenizer.domain_vocab_size=100")
    with pytest.raises(ValueError, match="raise domain_vocab_size"):
        expand_vocab(cfg)


def test_bpe_expansion_shortens_domain_text_and_round_trips(tmp_path, tiny_bpe_dir, make_tiny_config):
    from apps.llama.expand_vocab import expand_vocab
    from apps.llama.init_model import check_extension
    from apps.llama.tokenizer_io import load_tokenizer

    cfg = make_tiny_config(tmp_path, f"tokenizer.base={tiny_bpe_dir}", "tokenizer.domain_vocab_size=3000")
    report = expand_vocab(cfg)
    assert report["kind"] == "bpe"
    zh, en = report["heldout"]["zh"], report["heldout"]["en"]
    assert zh["token_reduction"] > 0.5, zh  # bytes → characters and words
    assert abs(en["token_reduction"]) < 0.02, en
    assert zh["roundtrip_exact"] and en["roundtrip_exact"]

    base, new = load_tokenizer(tiny_bpe_dir), load_tokenizer(cfg.tokenizer_dir)
    assert check_extension(base, new) == list(range(len(base), len(new)))
    assert new.chat_template == base.chat_template  # the base's behaviour files are kept
    for text in TRICKY + _docs("zh_classics.txt.gz", 100):
        assert new.decode(new(text, add_special_tokens=False)["input_ids"]) == text
    # The learned tokens are really used on domain text, not just listed.
    used = {i for ids in new(_docs("zh_classics.txt.gz", 300), add_special_tokens=False)["input_ids"] for i in ids}
    assert len(used & set(range(len(base), len(new)))) > 0.5 * (len(new) - len(base))


def test_bpe_replayed_merges_make_every_domain_token_reachable(tiny_bpe_dir):
    from tokenizers import Tokenizer

    from apps.llama.vocab_bpe import check_byte_level_bpe, merge_bpe, train_domain_bpe

    base = Tokenizer.from_file(str(tiny_bpe_dir / "tokenizer.json"))
    spec = check_byte_level_bpe(base)
    domain_merges = train_domain_bpe(_docs("zh_classics.txt.gz", 500), base, 800)
    merged_spec, added = merge_bpe(spec, domain_merges)
    merged = Tokenizer.from_str(json.dumps(merged_spec))
    # tokenizers' own BPE (not our simulation) turns every learned token's bytes into that one token
    for left, right in domain_merges:
        pieces = [t.value for t in merged.model.tokenize(left + right)]
        assert pieces == [left + right]
    assert len(added) >= 700


def test_bpe_rejects_non_byte_level_tokenizers():
    from tokenizers import Tokenizer, models, pre_tokenizers

    from apps.llama.vocab_bpe import check_byte_level_bpe

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(ValueError, match="ByteLevel"):
        check_byte_level_bpe(tok)
    with pytest.raises(ValueError, match="not BPE"):
        check_byte_level_bpe(Tokenizer(models.WordLevel({"a": 0}, unk_token="a")))


def test_missing_base_tokenizer_is_a_clear_error(tmp_path, make_tiny_config):
    from apps.llama.expand_vocab import expand_vocab

    cfg = make_tiny_config(tmp_path, f"tokenizer.base={tmp_path / 'nowhere'}")
    with pytest.raises(FileNotFoundError, match="tokenizer.base"):
        expand_vocab(cfg)
