"""SFT data: chat formats, and labels that cover exactly the assistant turns."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from phalanx.data.chat import ChatFormatError, detect_format, encode_chat, ensure_chat_template, to_messages
from phalanx.data.packing import IGNORE_INDEX

REPO_TOKENIZER = Path(__file__).resolve().parents[3] / "apps/llama/data/tokenizer/llama_sentencepiece_32k.model"

CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "And times 4?"},
    {"role": "assistant", "content": "5 x 4 = 20, the final answer."},
]


def _target_runs(ids, labels):
    """Contiguous runs of labelled token ids."""
    runs, current = [], []
    for token, label in zip(ids, labels, strict=True):
        if label == IGNORE_INDEX:
            if current:
                runs.append(current)
            current = []
        else:
            assert label == token  # targets are the tokens themselves (the loss shifts them)
            current.append(token)
    if current:
        runs.append(current)
    return runs


def test_chatml_labels_cover_exactly_the_assistant_turns(tiny_bpe_dir):
    from apps.llama.tokenizer_io import load_tokenizer

    tok = load_tokenizer(tiny_bpe_dir)
    ids, labels = encode_chat(tok, CONVERSATION, max_len=512)
    runs = [tok.decode(r) for r in _target_runs(ids, labels)]
    assert runs == ["2 + 3 = 5.<|im_end|>\n", "5 x 4 = 20, the final answer.<|im_end|>\n"]
    masked = tok.decode([t for t, lab in zip(ids, labels, strict=True) if lab == IGNORE_INDEX])
    assert "What is 2 + 3?" in masked and "You answer briefly." in masked and "5 x 4" not in masked


def test_default_template_for_sentencepiece_labels_answers_and_eos(tiny_run):
    from apps.llama.tokenizer_io import load_tokenizer

    cfg, _ = tiny_run
    tok = load_tokenizer(cfg.tokenizer_dir)
    assert not tok.chat_template
    ensure_chat_template(tok)
    ids, labels = encode_chat(tok, CONVERSATION, max_len=512)
    runs = [tok.decode(r) for r in _target_runs(ids, labels)]
    assert [r.strip() for r in runs] == ["2 + 3 = 5.</s>", "5 x 4 = 20, the final answer.</s>"]
    assert ids[0] == tok.bos_token_id and labels[0] == IGNORE_INDEX


def test_prepared_sft_rows_label_only_assistant_text(tiny_run):
    from datasets import load_from_disk

    from apps.llama.tokenizer_io import load_tokenizer

    cfg, reports = tiny_run
    tok = load_tokenizer(cfg.sft_data_dir / "tokenizer")
    rows = load_from_disk(str(cfg.sft_data_dir / "train"))
    stats = reports["sft"]
    assert stats["train/conversations"] + stats["heldout/conversations"] == 80
    targets = sum(lab != IGNORE_INDEX for r in rows["labels"] for lab in r)
    assert targets == stats["train/target_tokens"] and 0 < targets < stats["train/tokens"]
    for row in rows.select(range(5)):
        for run in _target_runs(row["input_ids"], row["labels"]):
            text = tok.decode(run)
            assert "[INST]" not in text and "<<SYS>>" not in text
            assert text.endswith("</s>")


def test_record_formats():
    alpaca = {"instruction": "Translate", "input": "春风", "output": "spring wind"}
    assert detect_format(alpaca, "messages", "question", "answer") == "alpaca"
    msgs = to_messages(alpaca, "alpaca", where="x", system="Be nice.")
    assert msgs == [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Translate\n\n春风"},
                    {"role": "assistant", "content": "spring wind"}]
    qa = {"question": "1+1?", "answer": "2\n#### 2"}
    assert detect_format(qa, "messages", "question", "answer") == "qa"
    assert to_messages(qa, "qa", where="x")[1] == {"role": "assistant", "content": "2\n#### 2"}
    record = {"messages": CONVERSATION}
    assert detect_format(record, "messages", "question", "answer") == "messages"
    assert to_messages(record, "messages", where="x") == CONVERSATION


@pytest.mark.parametrize("record, fmt, needle", [
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages", "message 0 must be"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages", "no assistant turn"),
    ({"messages": "hello"}, "messages", "non-empty list"),
    ({"instruction": "x"}, "alpaca", "missing field 'output'"),
    ({"question": "x", "answer": 3}, "qa", "expected text"),
])
def test_malformed_chat_records_name_the_problem(record, fmt, needle):
    with pytest.raises(ChatFormatError, match=needle):
        to_messages(record, fmt, where="file.jsonl record 7")


def test_unknown_layout_lists_the_expected_fields():
    with pytest.raises(ChatFormatError, match="instruction"):
        detect_format({"prompt": "x", "completion": "y"}, "messages", "question", "answer")


def test_truncation_keeps_what_fits_and_drops_examples_without_targets(tiny_bpe_dir):
    from apps.llama.tokenizer_io import load_tokenizer

    tok = load_tokenizer(tiny_bpe_dir)
    long_prompt = [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "ok"}]
    assert encode_chat(tok, long_prompt, max_len=64) is None
    ids, labels = encode_chat(tok, CONVERSATION, max_len=40)
    assert len(ids) == 40 and any(lab != IGNORE_INDEX for lab in labels)


def test_sft_file_with_bad_record_fails_with_location(tmp_path, make_tiny_config):
    from apps.llama.prepare_data import prepare_sft

    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    cfg = make_tiny_config(tmp_path)
    cfg.sft_data.sources = cfg.sft_data.sources[:1]
    cfg.sft_data.sources[0].path, cfg.sft_data.sources[0].format = str(path), "auto"
    with pytest.raises(ChatFormatError, match=r"chat.jsonl record 2: message 0"):
        prepare_sft(cfg, tokenizer_dir=str(REPO_TOKENIZER))

