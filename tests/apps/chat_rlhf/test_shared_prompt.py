"""The shared-prompt training forward: the n samples of a prompt packed into one row that holds the
prompt once (4D mask, restarting positions) give the same log-probs, entropies and gradients as
the unshared batch (fp32, 1e-5), with uneven prompts, uneven / one-token / empty completions,
sdpa and eager attention and gradient checkpointing; the fused log-prob head equals log_softmax;
one GRPO update with it equals one without."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from apps.chat_rlhf.rollout import (completion_batch, completion_logprobs, logprob_batch, shared_prompt_batch,
                                    shared_prompt_pays, supports_shared_prompt, token_logprobs)

# two prompts of different lengths, n = 3: uneven completions, an empty one, one-token ones
PROMPTS = [[5, 6, 7, 8, 9]] * 3 + [[10, 11]] * 3
COMPLETIONS = [[12, 13, 14], [], [15], [16, 17, 18, 19, 20, 21], [22, 23], [24]]


def _policy(model_dir, impl: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation=impl)


def _logprobs_and_grads(model, batch, weights):
    model.zero_grad(set_to_none=True)
    logp, entropy = completion_logprobs(model, batch, with_entropy=True)
    (logp * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logp.detach(), entropy, grads


def _assert_same(model, weights=None):
    unshared = completion_batch(PROMPTS, COMPLETIONS, pad_id=0)
    shared = shared_prompt_batch(PROMPTS, COMPLETIONS, 3, pad_id=0)
    assert torch.equal(shared["completion_mask"], unshared["completion_mask"])
    weights = torch.randn(unshared["completion_mask"].shape, generator=torch.Generator().manual_seed(0)) \
        if weights is None else weights
    want_lp, want_h, want_g = _logprobs_and_grads(model, unshared, weights)
    got_lp, got_h, got_g = _logprobs_and_grads(model, shared, weights)
    torch.testing.assert_close(got_lp, want_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_h, want_h, atol=1e-5, rtol=0)
    assert want_lp[0, 0] != 0 and want_lp[1].abs().sum() == 0  # real values; the empty completion stays 0
    for name, g in want_g.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(got_g[name], g, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_shared_equals_unshared_logprobs_and_grads(tiny_chat_model, impl):
    torch.manual_seed(0)
    _assert_same(_policy(tiny_chat_model, impl))


def test_shared_equals_unshared_with_gradient_checkpointing(tiny_chat_model):
    model = _policy(tiny_chat_model, "sdpa")
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x; older: the old name
    if enable is not None:
        enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # checkpointing is active in training mode only (dropout is 0 in the tiny model)
    calls, mlp = [], model.model.layers[0].mlp
    forward = mlp.forward  # counted inside the checkpointed layer (the recompute skips module hooks)
    mlp.forward = lambda *args, **kwargs: (calls.append(1), forward(*args, **kwargs))[1]
    _assert_same(model)
    assert len(calls) == 4  # two forwards, each recomputed in its backward


def test_a_leaking_mask_would_be_caught(tiny_chat_model):
    """The equality above is not vacuous: letting completions see their siblings changes log-probs."""
    model = _policy(tiny_chat_model, "sdpa")
    shared = shared_prompt_batch(PROMPTS, COMPLETIONS, 3, pad_id=0)
    L = shared["input_ids"].shape[1]
    leaky = dict(shared, attention_mask=torch.ones(L, L, dtype=torch.bool).tril().expand_as(shared["attention_mask"]))
    with torch.no_grad():
        right, _ = completion_logprobs(model, shared)
        wrong, _ = completion_logprobs(model, leaky)
    assert (right - wrong).abs().max() > 1e-3


def test_packed_layout():
    b = shared_prompt_batch([[5, 6, 7], [5, 6, 7], [8], [8]], [[1, 2], [3, 4, 9], [], [2]], 2, pad_id=0)
    # row 0: prompt, c1[:-1], c2[:-1]; row 1: left pads, prompt, nothing (c1 empty, c2 one token), right pads
    assert b["input_ids"].tolist() == [[5, 6, 7, 1, 3, 4], [0, 0, 8, 0, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 3, 4], [0, 0, 0, 0, 0, 0]]
    assert int(b["logits_to_keep"]) == 4  # positions 2..5
    assert b["completion_mask"].tolist() == [[1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 0]]
    assert b["targets"].tolist() == [[1, 2, 0], [3, 4, 9], [0, 0, 0], [2, 0, 0]]
    assert b["logit_index"][:2].tolist() == [[0, 1, 0], [0, 2, 3]]  # token 0 of both reads the prompt's last
    assert b["logit_index"][3, 0] == 4  # group 1's prompt end, first of its 4 kept positions
    m = b["attention_mask"][0, 0].int()
    assert m[4].tolist() == [1, 1, 1, 0, 1, 0]  # c2's first input sees the prompt and itself, not c1
    assert m[5].tolist() == [1, 1, 1, 0, 1, 1]
    assert m[3].tolist() == [1, 1, 1, 1, 0, 0]
    pads = b["attention_mask"][1, 0].int()
    assert pads[0].tolist() == [1, 0, 0, 0, 0, 0] and pads[2].tolist() == [0, 0, 1, 0, 0, 0]


def test_bad_groups_are_refused():
    with pytest.raises(ValueError, match="same non-empty prompt"):
        shared_prompt_batch([[1, 2], [1, 3]], [[4], [5]], 2, pad_id=0)
    with pytest.raises(ValueError, match="n samples of each prompt"):
        shared_prompt_batch([[1, 2]] * 3, [[4]] * 3, 2, pad_id=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_token_logprobs_equal_log_softmax(dtype, monkeypatch):
    from apps.chat_rlhf import rl_logprobs
    monkeypatch.setattr(rl_logprobs._TokenLogProbs, "CHUNK_ELEMENTS", 3 * 11)  # several chunks of 3 rows
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(7, 11, generator=gen, dtype=torch.float64) * 3).to(dtype).requires_grad_()
    rows = torch.tensor([0, 0, 2, 3, 6, 6, 5])  # rows read twice, row 1 and 4 never
    targets = torch.tensor([1, 4, 0, 10, 3, 3, 7])
    weights = torch.randn(7, generator=gen, dtype=torch.float64)
    got, entropy = token_logprobs(logits, rows, targets, with_entropy=True)
    (got * weights.float()).sum().backward()
    ref_logits = logits.detach().double().requires_grad_()
    logp_all = torch.log_softmax(ref_logits, -1)
    want = logp_all[rows, targets]
    (want * weights).sum().backward()
    tol = 1e-6 if dtype == torch.float64 else 1e-2
    assert got.dtype == torch.float32 and not entropy.requires_grad
    torch.testing.assert_close(got.double(), want.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy.double(), -(logp_all.exp() * logp_all).sum(-1)[rows].detach(), atol=1e-5, rtol=0)
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, atol=tol, rtol=tol)
    assert logits.grad[1].abs().sum() == 0


def test_choice_of_batch(tiny_chat_model):
    # short completions after a long prompt: packing pays; long completions on a short prompt: it does not
    assert shared_prompt_pays([[1] * 100] * 8, [[2] * 16] * 8, 8, hidden_size=576)
    assert not shared_prompt_pays([[1] * 16] * 8, [[2] * 2000] * 8, 8, hidden_size=576)
    assert not shared_prompt_pays(PROMPTS, COMPLETIONS, 1, hidden_size=576)
    model = _policy(tiny_chat_model, "sdpa")
    assert "logit_index" in logprob_batch(PROMPTS, COMPLETIONS, 3, 0, model)
    assert "logit_index" not in logprob_batch(PROMPTS, COMPLETIONS, 3, 0, model, shared=False)
    assert "logit_index" not in logprob_batch(PROMPTS, COMPLETIONS, 1, 0, model)


def test_other_attention_falls_back_or_is_refused():
    fake = torch.nn.Linear(1, 1)
    fake.config = SimpleNamespace(_attn_implementation="flash_attention_2", hidden_size=8)
    assert "sdpa or eager" in supports_shared_prompt(fake)
    assert "logit_index" not in logprob_batch(PROMPTS, COMPLETIONS, 3, 0, fake)
    with pytest.raises(ValueError, match="shared_prompt_forward=false"):
        completion_logprobs(fake, shared_prompt_batch(PROMPTS, COMPLETIONS, 3, pad_id=0))
    fake.config = SimpleNamespace(_attn_implementation="sdpa", layer_types=["full_attention", "sliding_attention"])
    assert "sliding" in supports_shared_prompt(fake)


def spread_reward(*, completions, **_):
    """Rewards with spread inside every group, so every sample has an advantage."""
    return [float(len(c) % 3) for c in completions]


def grpo_update(model_dir: str, out_dir: str, shared: bool) -> tuple[torch.Tensor, list[bool]]:
    """One GRPO step from fixed rollouts, with a k3 KL term to a perturbed reference (so the
    reference's log-probs go through the same batch): (the weights after, which batches were packed)."""
    from apps.chat_rlhf import grpo
    from apps.chat_rlhf.models import load_policy, load_tokenizer
    from apps.chat_rlhf.rewards import RewardSet
    from fixed_rollouts import seeded_rollout_fn
    from phalanx.launch import context
    from phalanx.train import fit

    context()
    cfg = grpo.load_grpo_config(None, [
        f"model={model_dir}", "data.num_train=4", "data.num_heldout=0", "grpo.num_generations=4",
        "grpo.max_new_tokens=6", "grpo.rewards=[test_shared_prompt:spread_reward]", "train.micro_batch_size=4",
        f"train.output_dir={out_dir}", "train.max_steps=1", "train.lr=10.0", "train.adam_eps=10.0",
        "train.max_grad_norm=0", "train.progress_bar=false", "train.plot=false", "train.resume=false",
        f"grpo.shared_prompt_forward={shared}", "grpo.kl_coef=0.1"])
    tokenizer, model = load_tokenizer(model_dir), load_policy(model_dir)
    records, _ = grpo.load_prompt_sets(cfg.data)
    ids = grpo.encode_prompts(tokenizer, records)
    rollout_fn = seeded_rollout_fn(load_policy(model_dir).eval(), tokenizer, ids, cfg.grpo.num_generations)
    reference = load_policy(model_dir).eval().requires_grad_(False)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    loss = grpo.GRPOLoss(cfg.grpo, records, ids, RewardSet.from_specs(cfg.grpo.rewards), rollout_fn,
                         tokenizer.pad_token_id, reference=reference)
    packed, original = [], grpo.logprob_batch

    def recording(*args, **kwargs):
        batch = original(*args, **kwargs)
        packed.append("logit_index" in batch)
        return batch

    grpo.logprob_batch = recording
    try:
        fit(cfg.train, model, grpo.PromptIndices(len(records)), loss_fn=loss, hooks=[grpo.RLHook(loss, None, out_dir)])
    finally:
        grpo.logprob_batch = original
    return torch.cat([p.detach().flatten() for p in model.parameters()]), packed


def test_grpo_update_equals_unshared(tiny_chat_model, tmp_path):
    """AdamW with a large eps makes the first update proportional to the gradient."""
    from apps.chat_rlhf.models import load_policy
    from phalanx.testing import assert_update_close
    start = torch.cat([p.detach().flatten() for p in load_policy(str(tiny_chat_model)).parameters()])
    shared, packed = grpo_update(str(tiny_chat_model), str(tmp_path / "shared"), True)
    unshared, not_packed = grpo_update(str(tiny_chat_model), str(tmp_path / "unshared"), False)
    assert packed == [True] and not_packed == [False]
    assert (unshared - start).abs().max() > 1e-4
    assert_update_close(shared, unshared, start, 1e-5, "shared vs unshared prompt forward")
