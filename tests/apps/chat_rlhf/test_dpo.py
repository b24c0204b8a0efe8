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


def training_pair_metrics(cfg, model_dir, reference_dir) -> dict:
    """The loss's implicit-reward metrics of the policy in `model_dir` on the run's training pairs."""
    from apps.chat_rlhf.data import read_split
    from apps.chat_rlhf.dpo import attach_reference, build_examples, make_eval_fn
    from apps.chat_rlhf.models import load_policy, load_tokenizer
    from apps.chat_rlhf.preference_losses import REFERENCE_FREE
    tokenizer = load_tokenizer(model_dir)
    train, _ = read_split(cfg.data, "kto" if cfg.loss.type == "kto" else "preference")
    examples = build_examples(train, tokenizer, cfg)
    with torch.no_grad():
        if cfg.loss.type not in REFERENCE_FREE:
            attach_reference(load_policy(reference_dir).eval(), examples, tokenizer.pad_token_id, 8)
        out = make_eval_fn(cfg.loss, examples, tokenizer.pad_token_id, 8)(load_policy(model_dir).eval(), 0)
    if cfg.loss.type == "kto":  # desirable completions' implicit reward over undesirable ones'
        out["margin"] = out["reward_desirable"] - out["reward_undesirable"]
    return out


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo", "kto"])
def test_every_loss_raises_the_margin_on_its_training_pairs(tiny_chat_model, tmp_path, launched, loss_type):
    """Six steps of each loss separate its own training pairs: the implicit-reward margin (chosen
    over rejected; KTO: desirable over undesirable) rises above where it started (0 with a
    reference, the base model's length-normalised log-prob gap for SimPO) and the preference
    accuracy on them goes from a coin flip to nearly all pairs. A wrong sign, a lost gradient or a reference that moves
    with the policy fails this."""
    extra = [f"loss.type={loss_type}", "train_layers=1", "train.max_steps=6", "train.lr=1e-2",
             "train.min_lr_ratio=1.0", "data.max_records=24"]
    if loss_type == "kto":
        extra.append(f"data.path={KTO_DEMO}")
    cfg = load_dpo_config(None, tiny_overrides(tiny_chat_model, tmp_path, *extra))
    result, before = train_preference(cfg, log=lambda *a: None)
    if loss_type == "simpo":  # reference-free: the before metrics come from a policy forward
        assert "base_logp_preference" not in before
    start = training_pair_metrics(cfg, tiny_chat_model, tiny_chat_model)
    end = training_pair_metrics(cfg, result.checkpoint_dir / "model", tiny_chat_model)
    if loss_type != "simpo":
        assert start["margin"] == pytest.approx(0.0, abs=1e-6)  # policy = reference
    # measured: accuracy 0.45-0.5 -> 0.97-1.0; margin +0.012 (SimPO) to +0.19 (KTO)
    assert start["accuracy"] <= 0.55 and end["accuracy"] >= 0.85, (start, end)
    assert end["margin"] > start["margin"] + 0.005, (start, end)


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
