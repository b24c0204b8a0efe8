"""Corpus reading: formats, categories, clear errors, and a held-out split fixed by the text alone."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from apps.llama.corpus import CorpusError, SourceConfig, is_heldout, read_documents, split_documents

DATA = Path(__file__).resolve().parents[3] / "apps" / "llama" / "data"


def test_txt_documents_are_blank_line_separated_and_can_be_grouped(tmp_path):
    path = tmp_path / "poems.txt.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("静夜思\n床前明月光\n\n\n春晓\n春眠不觉晓\n\n短\n\n")
    docs = list(read_documents(SourceConfig(path=str(path), category="zh")))
    assert [d.text for d in docs] == ["静夜思\n床前明月光", "春晓\n春眠不觉晓", "短"]
    assert {d.category for d in docs} == {"zh"}
    grouped = list(read_documents(SourceConfig(path=str(path), min_doc_chars=12)))
    assert [d.text for d in grouped] == ["静夜思\n床前明月光\n\n春晓\n春眠不觉晓", "短"]


def test_jsonl_record_category_wins_over_source_category(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"text": "a", "category": "law"}) + "\n\n" + json.dumps({"text": "b"}) + "\n")
    docs = list(read_documents(SourceConfig(path=str(path), category="general")))
    assert [(d.text, d.category) for d in docs] == [("a", "law"), ("b", "general")]


def test_json_list_and_limits(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps([{"body": "x" * 10}, {"body": "y" * 10}, {"body": "z" * 10}]))
    assert len(list(read_documents(SourceConfig(path=str(path), text_field="body")))) == 3
    assert len(list(read_documents(SourceConfig(path=str(path), text_field="body", max_docs=2)))) == 2
    assert len(list(read_documents(SourceConfig(path=str(path), text_field="body", max_chars=15)))) == 2


@pytest.mark.parametrize("content, fmt, needle", [
    ('{"text": "ok"}\n{"text": broken}\n', "jsonl", ":2: not valid JSON"),
    ('{"title": "no text here"}\n', "jsonl", "no field 'text'"),
    ('{"text": 5}\n', "jsonl", "expected text"),
    ('["just a string"]', "json", "expected an object"),
])
def test_malformed_records_name_the_problem(tmp_path, content, fmt, needle):
    path = tmp_path / f"bad.{fmt}"
    path.write_text(content)
    with pytest.raises(CorpusError, match=needle.replace("(", r"\(")):
        list(read_documents(SourceConfig(path=str(path))))


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        list(read_documents(SourceConfig(path=str(tmp_path / "nope.txt"))))
    (tmp_path / "data.csv").write_text("a,b")
    with pytest.raises(CorpusError, match="format"):
        list(read_documents(SourceConfig(path=str(tmp_path / "data.csv"))))


def test_heldout_split_is_fixed_by_text_and_near_the_fraction():
    source = SourceConfig(path=str(DATA / "zh_classics.txt.gz"), category="zh", max_docs=3000)
    train, held = split_documents([source], 0.05)
    assert 0.03 < len(held) / (len(train) + len(held)) < 0.07
    # Same documents held out whatever else is read and in whatever order.
    texts = [d.text for d in held]
    assert all(is_heldout(t, 0.05) for t in texts)
    assert not any(is_heldout(d.text, 0.05) for d in train[:500])
    _, held_again = split_documents([source, SourceConfig(path=str(DATA / "shakespeare_4plays.txt.gz"), max_docs=50)], 0.05)
    assert [d.text for d in held_again if d.category == "zh"] == texts
    assert not is_heldout("anything", 0.0)
