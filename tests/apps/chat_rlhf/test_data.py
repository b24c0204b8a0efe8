"""Record formats (TRL's four kinds), every source type, and the errors malformed records raise."""
from __future__ import annotations

import gzip
import json

import pytest

from apps.chat_rlhf.data import (RecordError, collate_completions, encode_completion, is_heldout, load_records,
                                 split_hh_text)
from tests.apps.chat_rlhf.conftest import DPO_DEMO, GSM8K, HH, KTO_DEMO, REPO

U = lambda text: {"role": "user", "content": text}  # noqa: E731
A = lambda text: {"role": "assistant", "content": text}  # noqa: E731


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_shipped_files_load_in_their_kinds():
    assert len(load_records(DPO_DEMO, "preference")) == 300
    assert len(load_records(KTO_DEMO, "kto")) == 300
    gsm = load_records(GSM8K, "prompt", max_records=5)
    assert gsm[0]["prompt"][-1]["role"] == "user" and gsm[0]["ground_truth"].endswith("#### 18")
    hh = load_records(HH, "preference", max_records=50)
    assert all(r["prompt"][-1]["role"] == "user" and r["chosen"][0]["role"] == "assistant" for r in hh)
    alpaca = load_records(REPO / "apps/chat_rlhf/data/llamafactory_demo/alpaca_en_demo.jsonl", "messages", max_records=3)
    assert [m["role"] for m in alpaca[0]["messages"]] == ["user", "assistant"]


def test_preference_strings_messages_and_implicit_prompt():
    rows = [
        {"prompt": "2+2?", "chosen": "4", "rejected": "5"},
        {"prompt": [U("hi")], "chosen": [A("hello")], "rejected": [A("go away")]},
        {"chosen": [U("hi"), A("hello")], "rejected": [U("hi"), A("no")], "margin": 2},
    ]
    out = load_records(rows, "preference")
    assert out[0] == {"prompt": [U("2+2?")], "chosen": [A("4")], "rejected": [A("5")]}
    assert out[1]["rejected"] == [A("go away")]
    assert out[2] == {"prompt": [U("hi")], "chosen": [A("hello")], "rejected": [A("no")], "margin": 2.0}


def test_hh_text_becomes_turns():
    turns = split_hh_text("\n\nHuman: a?\n\nAssistant: b.\n\nHuman: c?\n\nAssistant: d")
    assert turns == [U("a?"), A("b."), U("c?"), A("d")]
    assert split_hh_text("plain text") is None


def test_prompt_and_kto_kinds():
    out = load_records([{"question": "q?", "answer": 7}, {"prompt": [U("x")]}], "prompt")
    assert out == [{"prompt": [U("q?")], "ground_truth": "7"}, {"prompt": [U("x")], "ground_truth": None}]
    kto = load_records([{"prompt": "p", "completion": "c", "label": False}], "kto")
    assert kto == [{"prompt": [U("p")], "completion": [A("c")], "label": False}]
    msgs = load_records([{"prompt": "p", "completion": "c"}], "messages")
    assert msgs == [{"messages": [U("p"), A("c")]}]


def test_every_source_type(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = [{"prompt": "p", "chosen": "c", "rejected": "r"}] * 3
    expected = load_records(rows, "preference")
    jsonl = write_jsonl(tmp_path / "a.jsonl", rows)
    gz = tmp_path / "a.jsonl.gz"
    gz.write_bytes(gzip.compress(jsonl.read_bytes()))
    js = tmp_path / "a.json"
    js.write_text(json.dumps(rows))
    parquet = tmp_path / "a.parquet"
    Dataset.from_list(rows).to_parquet(str(parquet))
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    DatasetDict({"train": Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved_dict"))
    for source in (jsonl, gz, js, parquet, tmp_path / "saved", tmp_path / "saved_dict"):
        assert load_records(source, "preference") == expected, source


@pytest.mark.parametrize("row, kind, match", [
    ({"prompt": "p", "chosen": "c"}, "preference", r"line 2: missing field 'rejected'"),
    ({"prompt": "p", "chosen": [{"role": "bot", "content": "x"}], "rejected": "r"}, "preference",
     r"line 2: field 'chosen' message 0 must be"),
    ({"prompt": [U("p"), A("x")], "chosen": "c", "rejected": "r"}, "preference", r"field 'prompt' must end with a user"),
    ({"chosen": "c", "rejected": "r"}, "preference", r"share no leading turns"),
    ({"prompt": "p", "chosen": [U("c")], "rejected": "r"}, "preference", r"field 'chosen' must hold only assistant"),
    ({"prompt": "p", "chosen": "c", "rejected": "r", "margin": "big"}, "preference", r"field 'margin' must be a number"),
    ({"text": "x"}, "prompt", r"line 2: missing field 'prompt' or 'question'"),
    ({"prompt": "p", "ground_truth": [1]}, "prompt", r"field 'ground_truth' must be text"),
    ({"prompt": "p", "completion": "c", "label": "yes"}, "kto", r"field 'label' must be true"),
    ({"messages": [U("only a question")]}, "messages", r"no assistant turn"),
    ({"messages": "hello"}, "messages", r"field 'messages' must be text or a non-empty list"),
    ({"prompt": "", "chosen": "c", "rejected": "r"}, "preference", r"field 'prompt' is empty"),
])
def test_malformed_records_name_file_line_and_field(tmp_path, row, kind, match):
    good = {"preference": {"prompt": "p", "chosen": "c", "rejected": "r"}, "prompt": {"prompt": "p"},
            "kto": {"prompt": "p", "completion": "c", "label": True}, "messages": {"messages": [U("a"), A("b")]}}[kind]
    path = write_jsonl(tmp_path / "bad.jsonl", [good, row])
    with pytest.raises(RecordError, match=match) as info:
        load_records(path, kind)
    assert str(path) in str(info.value)


def test_broken_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "p"}\n{"prompt": \n')
    with pytest.raises(RecordError, match=r"bad.jsonl line 2: not valid JSON"):
        load_records(bad, "prompt")
    with pytest.raises(RecordError, match="does not exist"):
        load_records(tmp_path / "missing.jsonl", "prompt")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(RecordError, match="unknown data file type"):
        load_records(tmp_path / "x.csv", "prompt")
    (tmp_path / "obj.json").write_text('{"prompt": "p"}')
    with pytest.raises(RecordError, match="must hold a list"):
        load_records(tmp_path / "obj.json", "prompt")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(RecordError, match="holds no records"):
        load_records(tmp_path / "empty.jsonl", "prompt")
    with pytest.raises(ValueError, match="record kind 'pairs' is unknown"):
        load_records([], "pairs")


def test_heldout_split_is_stable():
    records = load_records(DPO_DEMO, "preference")
    held = [r for r in records if is_heldout(r, 0.2)]
    assert 40 <= len(held) <= 80
    assert held == [r for r in load_records(DPO_DEMO, "preference") if is_heldout(r, 0.2)]


def test_completion_encoding_and_left_padded_batch(tiny_chat_model):
    from apps.chat_rlhf.models import load_tokenizer

    tokenizer = load_tokenizer(tiny_chat_model)
    prompt, completion = [U("What is two plus two?")], [A("Four.")]
    p, c = encode_completion(tokenizer, prompt, completion, 1000, 1000)
    full = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
    assert tokenizer.decode(p + c) == full
    assert tokenizer.decode(c) == "Four.<|im_end|>\n"
    p2, c2 = encode_completion(tokenizer, prompt, completion, 3, 2)
    assert p2 == p[-3:] and c2 == c[:2]
    batch = collate_completions([(p, c), (p2, c2)], tokenizer.pad_token_id)
    assert batch["input_ids"].shape == (2, len(p) + len(c))
    assert batch["completion_mask"][1].tolist() == [0] * (len(p) + len(c) - 2) + [1, 1]
    assert batch["position_ids"][1, -1].item() == len(p2) + len(c2) - 1
    assert int(batch["completion_width"]) == len(c)
