"""The frozen-trunk cache (`train_layers` + `cache_frozen_trunk`): the same log-probs, gradients and
DPO run as the full forward, with the lower blocks not run at all."""
from __future__ import annotations

import math

import pytest
import torch

from apps.chat_rlhf.dpo import collate_examples, load_dpo_config, score_rows, train_preference
from apps.chat_rlhf.frozen_trunk import FrozenTrunk, trunk_for
from apps.chat_rlhf.models import load_policy, train_top_layers
from apps.chat_rlhf.preference_losses import sequence_logps
from tests.apps.chat_rlhf.conftest import build_tiny_chat_model, tiny_overrides


@pytest.fixture(scope="module")
def three_block_model(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny3") / "model", layers=3)


def _examples() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    def row(p, c):
        return (torch.randint(3, 300, (p,), generator=g).tolist(), torch.randint(3, 300, (c,), generator=g).tolist())
    return [{"rows": [row(p, c), row(p, c2)]} for p, c, c2 in [(5, 3, 6), (9, 2, 2), (3, 7, 4), (6, 5, 1), (4, 4, 8)]]


def _calls(blocks) -> tuple[list[int], list]:
    count = [0]
    handles = [b.mlp.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1)) for b in blocks]
    return count, handles


def test_cached_states_give_the_full_forward_and_skip_the_lower_blocks(three_block_model):
    model = load_policy(three_block_model)
    trunk = FrozenTrunk(model, train_layers=1)
    train_top_layers(model, 1)
    assert trunk.split == 2
    examples = _examples()
    # the capture pass batches 3 examples at a time; training batches below mix them differently
    full_scores = score_rows(model, examples, 0, 3, trunk, capture=True)
    assert all(len(e["hidden"]) == 2 and e["hidden"][0].shape == (sum(map(len, e["rows"][0])), 32) for e in examples)
    assert torch.allclose(torch.tensor(score_rows(model, examples, 0, 2, trunk)), torch.tensor(full_scores),
                          atol=1e-5, rtol=0)

    model.train()
    cached_batch = collate_examples(examples[1:4], 0)
    full_batch = {k: v for k, v in cached_batch.items() if k != "hidden"}
    grads, logps = {}, {}
    for name, batch in (("cached", cached_batch), ("full", full_batch)):
        model.zero_grad(set_to_none=True)
        count, handles = _calls(trunk.lower)
        lp, _ = sequence_logps(model, batch, trunk)
        (lp * torch.linspace(0.5, 1.5, len(lp))).sum().backward()
        for h in handles:
            h.remove()
        assert count[0] == (0 if name == "cached" else 2), name  # the two lower blocks ran only in the full forward
        logps[name] = lp.detach()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert torch.allclose(logps["cached"], logps["full"], atol=1e-5, rtol=0)
    assert grads["cached"].keys() == grads["full"].keys() and grads["full"]
    for n in grads["full"]:
        scale = grads["full"][n].abs().max().item()
        assert (grads["cached"][n] - grads["full"][n]).abs().max().item() <= 1e-5 * max(scale, 1.0), n


def test_cached_states_without_a_trunk_are_refused(three_block_model):
    model = load_policy(three_block_model)
    trunk = FrozenTrunk(model, train_layers=2)
    examples = _examples()[:2]
    score_rows(model, examples, 0, 2, trunk, capture=True)
    with pytest.raises(ValueError, match="FrozenTrunk"):
        sequence_logps(model, collate_examples(examples, 0))
    with pytest.raises(ValueError, match="0 < train_layers < 3"):
        FrozenTrunk(load_policy(three_block_model), train_layers=3)
    # nothing frozen below the trained blocks: no trunk, the plain forward
    assert trunk_for(model, 0) is None and trunk_for(model, 3) is None and trunk_for(model, 2, enabled=False) is None


@pytest.mark.parametrize("reference", ["cached", "online"])
def test_dpo_with_the_cached_trunk_trains_like_the_full_forward(tiny_chat_model, tmp_path, launched, reference):
    runs = {}
    for cache in (True, False):
        cfg = load_dpo_config(None, tiny_overrides(tiny_chat_model, tmp_path / f"{reference}-{cache}",
                                                   f"loss.reference={reference}", "loss.beta=0.5", "train_layers=1",
                                                   f"cache_frozen_trunk={str(cache).lower()}"))
        runs[cache] = train_preference(cfg, log=lambda *a: None)
    (cached, before_c), (full, before_f) = runs[True], runs[False]
    assert cached.losses[0] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference at step 1
    assert cached.losses == pytest.approx(full.losses, abs=1e-5)
    assert cached.losses[1] != cached.losses[0]
    assert before_c == pytest.approx(before_f)
    assert cached.last_eval["accuracy"] == pytest.approx(full.last_eval["accuracy"])
    assert cached.last_eval["margin"] == pytest.approx(full.last_eval["margin"], abs=1e-5)
