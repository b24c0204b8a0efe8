"""DPO family end to end on a tiny model: cached vs on-the-fly reference, every loss type, checks."""
from __future__ import annotations

import math

import pytest
import torch

from apps.chat_rlhf.dpo import load_dpo_config, train_preference
from phalanx.config import ConfigError
from tests.apps.chat_rlhf.conftest import KTO_DEMO, tiny_overrides


def test_cached_reference_equals_online_and_first_loss_is_log2(tiny_chat_model, tmp_path, launched):
    results = {}
    for mode in ("cached", "online"):
        cfg = load_dpo_config(None, tiny_overrides(tiny_chat_model, tmp_path / mode, f"loss.reference={mode}",
                                                   "loss.beta=0.5"))
        result, before = train_preference(cfg, log=lambda *a: None)
        results[mode] = (result, before)
    cached, online = results["cached"][0], results["online"][0]
    # policy = reference at step 1, so every log-ratio is 0 and the loss is -log sigmoid(0)
    assert cached.losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert online.losses == pytest.approx(cached.losses, abs=1e-5)
    assert cached.last_eval["accuracy"] == pytest.approx(online.last_eval["accuracy"])
    before = results["cached"][1]
    assert before["accuracy"] == 0.5 and before["margin"] == 0.0  # all ties before training
    assert 0.0 <= before["base_logp_preference"] <= 1.0
    assert cached.losses[1] != cached.losses[0]  # the first step changed the policy
    assert (cached.checkpoint_dir / "model" / "config.json").is_file()


@pytest.mark.parametrize("loss_type", ["ipo", "simpo", "kto"])
def test_other_losses_train(tiny_chat_model, tmp_path, launched, loss_type):
    extra = [f"loss.type={loss_type}", "train_layers=1"]
    if loss_type == "kto":
        extra.append(f"data.path={KTO_DEMO}")
    cfg = load_dpo_config(None, tiny_overrides(tiny_chat_model, tmp_path, *extra))
    result, before = train_preference(cfg, log=lambda *a: None)
    assert result.final_step == 2 and all(math.isfinite(x) for x in result.losses)
    assert 0.0 <= result.last_eval["accuracy"] <= 1.0
    if loss_type == "simpo":  # reference-free: the before metrics come from a policy forward
        assert "base_logp_preference" not in before
        assert result.last_eval["chosen_reward"] < 0


def test_left_padded_rows_score_like_single_rows(tiny_chat_model):
    from apps.chat_rlhf.data import collate_completions
    from apps.chat_rlhf.models import load_policy
    from apps.chat_rlhf.preference_losses import sequence_logps

    model = load_policy(tiny_chat_model).eval()
    rows = [([5, 6, 7, 8, 9], [10, 11, 12]), ([20, 21], [30, 31, 32, 33, 34, 35])]
    with torch.no_grad():
        together, lens = sequence_logps(model, collate_completions(rows, 0))
        alone = [sequence_logps(model, collate_completions([r], 0))[0].item() for r in rows]
    assert together.tolist() == pytest.approx(alone, abs=1e-5)
    assert lens.tolist() == [3, 6]


def test_train_layers_freezes_the_rest(tiny_chat_model):
    from apps.chat_rlhf.models import load_policy, train_top_layers

    model = load_policy(tiny_chat_model)
    train_top_layers(model, 1)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("model.layers.1.", "model.norm")) for n in trainable)
    with pytest.raises(ValueError, match="has 2 blocks"):
        train_top_layers(model, 3)


@pytest.mark.parametrize("override, match", [
    ("loss.type=orpo", "loss.type"), ("loss.beta=0", "loss.beta"), ("loss.label_smoothing=0.5", "label_smoothing"),
    ("data.heldout_fraction=0", "heldout_fraction"),
])
def test_bad_settings_stop_before_loading_a_model(tmp_path, override, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        cfg = load_dpo_config(None, [f"train.output_dir={tmp_path}", "model=/nonexistent", override])
        train_preference(cfg, log=lambda *a: None)


def test_evaluate_and_chat_commands(tiny_chat_model, tmp_path, capsys):
    """evaluate scores a policy and a reward model and samples through phalanx.inference; chat answers."""
    import json

    from apps.chat_rlhf import chat, evaluate
    from apps.chat_rlhf.models import init_reward_model
    from tests.apps.chat_rlhf.conftest import REPO

    rm, rm_tok = init_reward_model(tiny_chat_model)
    rm.save_pretrained(str(tmp_path / "rm"))
    rm_tok.save_pretrained(str(tmp_path / "rm"))
    out = tmp_path / "eval.json"
    evaluate.main(["--config", str(REPO / "apps/chat_rlhf/configs/dpo.yaml"), "--model", str(tiny_chat_model),
                   "--reward-model", str(tmp_path / "rm"), "--samples", "2", "--max-new-tokens", "4",
                   "--json", str(out), "data.max_records=30", "data.max_heldout=4", "data.max_prompt_tokens=24",
                   "data.max_completion_tokens=8", f"reference={tiny_chat_model}"])
    result = json.loads(out.read_text())
    assert result["policy_heldout"]["accuracy"] == 0.5  # the policy is its own reference
    assert 0 <= result["reward_model_heldout"]["accuracy"] <= 1
    assert len(result["samples"]) == 2 and all(isinstance(s["reward"], float) for s in result["samples"])
    capsys.readouterr()
    chat.main(["--model", str(tiny_chat_model), "--prompt", "Hello?", "--max-new-tokens", "4", "--temperature", "0"])
    assert capsys.readouterr().out.startswith("user: Hello?\nassistant:")
