"""Reward model end to end on a tiny model: training, the export, scoring, padding."""
from __future__ import annotations

import math

import pytest
import torch

from apps.chat_rlhf.train_rm import load_rm_config, score_conversations, train_reward_model
from tests.apps.chat_rlhf.conftest import tiny_overrides


def test_reward_model_trains_exports_and_scores(tiny_chat_model, tmp_path, launched):
    from transformers import AutoModelForSequenceClassification

    from apps.chat_rlhf.models import load_reward_model, resolve_model_dir

    cfg = load_rm_config(None, tiny_overrides(tiny_chat_model, tmp_path / "rm", "train.max_steps=3",
                                              "train.eval_every=1", "loss.margin=0.1"))
    result, before = train_reward_model(cfg, log=lambda *a: None)
    assert set(before) >= {"accuracy", "reward_gap"} and all(math.isfinite(x) for x in result.losses)
    assert (tmp_path / "rm" / "rm_curves.png").is_file()
    # the output_dir resolves to the latest checkpoint's model/, a plain HF classifier
    directory = resolve_model_dir(tmp_path / "rm")
    plain = AutoModelForSequenceClassification.from_pretrained(str(directory))
    assert plain.config.num_labels == 1
    model, tokenizer = load_reward_model(tmp_path / "rm")
    assert tokenizer.pad_token_id == model.config.pad_token_id != tokenizer.eos_token_id
    prompts = [[{"role": "user", "content": "Say hi."}]] * 2
    completions = [[{"role": "assistant", "content": "Hi!"}],
                   [{"role": "assistant", "content": "Hello there, how are you doing today?"}]]
    batched = score_conversations(model, tokenizer, prompts, completions)
    alone = torch.cat([score_conversations(model, tokenizer, [p], [c])
                       for p, c in zip(prompts, completions, strict=True)])
    assert batched.tolist() == pytest.approx(alone.tolist(), abs=1e-5)  # padding does not move the score
    with torch.no_grad():  # and plain transformers gives the same reward
        ids = tokenizer.apply_chat_template(prompts[0] + completions[0], tokenize=False)
        enc = tokenizer(ids, add_special_tokens=False, return_tensors="pt")
        assert plain(**enc).logits[0, 0].item() == pytest.approx(alone[0].item(), abs=1e-5)


def test_reward_model_rejects_a_multi_label_classifier(tiny_chat_model, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from apps.chat_rlhf.models import load_reward_model

    model = AutoModelForSequenceClassification.from_pretrained(str(tiny_chat_model), num_labels=3)
    model.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="3 labels"):
        load_reward_model(tmp_path)
