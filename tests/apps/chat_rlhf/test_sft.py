"""SFT through the framework chat path on a tiny model."""
from __future__ import annotations

import pytest

from apps.chat_rlhf.sft import build_rows, load_sft_config, sft
from phalanx.data.labels import IGNORE_INDEX


def test_rows_label_only_assistant_tokens(tiny_chat_model):
    from apps.chat_rlhf.models import load_tokenizer

    tokenizer = load_tokenizer(tiny_chat_model)
    records = [{"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]}]
    rows, stats = build_rows(records, tokenizer, load_sft_config(None, ["data.seq_len=64"]).data)
    assert len(rows) == 1 and stats["conversations"] == 1
    labels = [t for t in rows[0]["labels"].tolist() if t != IGNORE_INDEX]
    assert tokenizer.decode(labels) == "Blue.<|im_end|>\n"


def test_sft_lowers_heldout_loss(tiny_chat_model, tmp_path, launched):
    cfg = load_sft_config(None, [f"model={tiny_chat_model}", f"train.output_dir={tmp_path}", "data.max_records=60",
                                 "data.seq_len=128", "data.heldout_fraction=0.2", "train.max_steps=10",
                                 "train.micro_batch_size=4", "train.lr=5e-3", "train.progress_bar=false",
                                 "train.plot=false", "train.peak_tflops=0"])
    result, before = sft(cfg, log=lambda *a: None)
    assert result.final_step == 10
    # measured: 5.95 -> 5.70 after 6 steps at lr 3e-3 (an untrained 2-layer model on 48 conversations)
    assert result.last_eval["loss"] < before["loss"] - 0.2, (before, result.last_eval)


def test_malformed_sft_record_stops_before_training(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'
                   '{"messages": [{"role": "user", "content": "q"}]}\n')
    cfg = load_sft_config(None, [f"data.path={bad}", f"train.output_dir={tmp_path / 'out'}", "model=/nonexistent"])
    with pytest.raises(ValueError, match="bad.jsonl line 2: field 'messages' has no assistant turn"):
        sft(cfg, log=lambda *a: None)
    assert not (tmp_path / "out").exists()
