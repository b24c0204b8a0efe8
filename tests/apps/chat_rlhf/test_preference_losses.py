"""Preference losses against hand-computed values, and against TRL's trainers on the same batch."""
from __future__ import annotations

import math

import pytest
import torch

from apps.chat_rlhf.preference_losses import (bradley_terry_losses, completion_logps, dpo_losses, kto_kl_estimate,
                                              kto_losses)


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


T = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731


def test_dpo_sigmoid_by_hand():
    # policy chosen/rejected -10, -14; reference -11, -12: delta = (1) - (-2) = 3
    losses, rc, rr = dpo_losses(T(-10.0), T(-14.0), T(-11.0), T(-12.0), beta=0.5)
    assert losses.item() == pytest.approx(-logsig(1.5), abs=1e-12)
    assert (rc.item(), rr.item()) == pytest.approx((0.5, -1.0))
    smoothed, _, _ = dpo_losses(T(-10.0), T(-14.0), T(-11.0), T(-12.0), beta=0.5, label_smoothing=0.1)
    assert smoothed.item() == pytest.approx(-0.9 * logsig(1.5) - 0.1 * logsig(-1.5), abs=1e-12)


def test_ipo_by_hand():
    # per-token log-ratios: chosen 4/4 = 1, rejected -3/3 = -1; (2 - 1/(2*0.25))^2 = 0
    losses, _, _ = dpo_losses(T(-6.0), T(-9.0), T(-10.0), T(-6.0), beta=0.25, loss_type="ipo",
                              chosen_len=T(4.0), rejected_len=T(3.0))
    assert losses.item() == pytest.approx(0.0, abs=1e-12)
    losses, _, _ = dpo_losses(T(-6.0), T(-9.0), T(-10.0), T(-6.0), beta=1.0, loss_type="ipo",
                              chosen_len=T(4.0), rejected_len=T(3.0))
    assert losses.item() == pytest.approx((2 - 0.5) ** 2)
    with pytest.raises(ValueError, match="chosen_len"):
        dpo_losses(T(-6.0), T(-9.0), T(-10.0), T(-6.0), beta=1.0, loss_type="ipo")


def test_simpo_by_hand_needs_no_reference():
    # averages -8/4 = -2 and -9/3 = -3; beta 2, gamma 0.5: logit 2*1 - 0.5 = 1.5
    losses, rc, rr = dpo_losses(T(-8.0), T(-9.0), None, None, beta=2.0, loss_type="simpo", simpo_gamma=0.5,
                                chosen_len=T(4.0), rejected_len=T(3.0), label_smoothing=0.2)
    assert losses.item() == pytest.approx(-0.8 * logsig(1.5) - 0.2 * logsig(-1.5), abs=1e-12)
    assert (rc.item(), rr.item()) == pytest.approx((-4.0, -6.0))


def test_kto_by_hand():
    kl = kto_kl_estimate(T(-5.0, -7.0), T(-6.0, -5.0))  # mean(1, -2) = -0.5 -> clamped to 0
    assert kl.item() == 0.0
    kl = kto_kl_estimate(T(-5.0, -4.0), T(-6.0, -5.0))
    assert kl.item() == pytest.approx(1.0)
    losses, rewards = kto_losses(T(-3.0, -3.0), T(-5.0, -5.0), torch.tensor([True, False]), kl, beta=0.5,
                                 desirable_weight=1.0, undesirable_weight=2.0)
    # ratio 2, z 1: desirable 1 - sig(0.5 * 1), undesirable 2 * (1 - sig(0.5 * -1))
    assert losses.tolist() == pytest.approx([1 - sig(0.5), 2 * (1 - sig(-0.5))])
    assert rewards.tolist() == pytest.approx([1.0, 1.0])


def test_bradley_terry_by_hand():
    losses = bradley_terry_losses(T(1.0, 0.0), T(-1.0, 0.5), margin=T(0.5, 0.0), center_coefficient=0.1)
    assert losses.tolist() == pytest.approx([-logsig(1.5) + 0.1 * 0.0, -logsig(-0.5) + 0.1 * 0.25])


def test_completion_logps_by_hand():
    vocab = 3
    logits = torch.zeros(1, 4, vocab)
    logits[0, 1, 2] = math.log(2.0)  # p(token 2 | first two tokens) = 2/4
    ids = torch.tensor([[0, 1, 2, 1]])
    mask = torch.tensor([[0, 0, 1, 1]])
    total, count = completion_logps(logits, ids, mask)
    assert total.item() == pytest.approx(math.log(0.5) + math.log(1 / 3), abs=1e-6)
    assert count.item() == 2
    # only the last 3 positions kept: the same tokens are scored
    total_tail, _ = completion_logps(logits[:, 1:], ids, mask)
    assert total_tail.item() == pytest.approx(total.item())
    with pytest.raises(ValueError, match="keep more logits"):
        completion_logps(logits[:, 2:], ids, mask)


# --- against TRL (dev-only dependency) ---------------------------------------------------------

def _trl_rows(batch: dict) -> list[tuple[list[int], list[int]]]:
    """TRL's right-padded rows as (prompt ids, completion ids)."""
    rows = []
    for ids, att, comp in zip(batch["input_ids"], batch["attention_mask"], batch["completion_mask"], strict=True):
        ids, comp = ids[att.bool()].tolist(), comp[att.bool()].tolist()
        start = comp.index(1)
        rows.append((ids[:start], ids[start:]))
    return rows


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_loss_equals_trl(tiny_chat_model, tmp_path, loss_type):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from apps.chat_rlhf.data import collate_completions, load_records
    from apps.chat_rlhf.models import load_policy, load_tokenizer
    from apps.chat_rlhf.preference_losses import sequence_logps
    from tests.apps.chat_rlhf.conftest import DPO_DEMO

    records = load_records(DPO_DEMO, "preference", max_records=4)
    tokenizer = load_tokenizer(tiny_chat_model)
    policy, reference = load_policy(tiny_chat_model), load_policy(tiny_chat_model)
    torch.manual_seed(1)
    with torch.no_grad():  # make policy and reference differ
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    args = DPOConfig(output_dir=str(tmp_path), beta=0.2, loss_type=[loss_type], report_to=[],
                     per_device_train_batch_size=4, max_length=96, use_cpu=True)
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(records),
                         processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    trl_loss = trainer.compute_loss(policy, dict(batch)).item()

    ours = collate_completions(_trl_rows(batch), tokenizer.pad_token_id)
    logps, lens = sequence_logps(policy, ours)
    with torch.no_grad():
        ref, _ = sequence_logps(reference, ours)
    c, r = logps.chunk(2)
    (rc, rr), (lc, lr) = ref.chunk(2), lens.chunk(2)
    losses, _, _ = dpo_losses(c, r, rc, rr, beta=0.2, loss_type=loss_type, chosen_len=lc, rejected_len=lr)
    # Sums over <= 96 tokens in fp32, padded on different sides (TRL right, ours left): the
    # rounding of the two layouts stays well inside 1e-5 at this length.
    assert losses.mean().item() == pytest.approx(trl_loss, abs=1e-5)


def test_reward_loss_equals_trl(tiny_chat_model, tmp_path):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    from apps.chat_rlhf.data import load_records
    from apps.chat_rlhf.models import init_reward_model
    from apps.chat_rlhf.train_rm import RMLossConfig, make_loss_fn
    from tests.apps.chat_rlhf.conftest import DPO_DEMO

    records = load_records(DPO_DEMO, "preference", max_records=4)
    for i, r in enumerate(records):
        r["margin"] = 0.25 * i
    model, tokenizer = init_reward_model(tiny_chat_model)
    torch.manual_seed(2)
    with torch.no_grad():
        model.score.weight.normal_(0, 0.5)  # rewards far from 0, so the loss is not near log 2 by accident
    args = RewardConfig(output_dir=str(tmp_path), report_to=[], per_device_train_batch_size=4, max_length=1024,
                        center_rewards_coefficient=0.01, use_cpu=True)
    trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(records),
                            processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    assert "margin" in batch
    trl_loss = trainer.compute_loss(model, dict(batch)).item()
    ours = make_loss_fn(RMLossConfig(center_coefficient=0.01))(model, dict(batch)).item()
    assert ours == pytest.approx(trl_loss, abs=1e-5)
