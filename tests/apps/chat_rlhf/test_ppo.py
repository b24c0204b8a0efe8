"""PPO on tiny models: mini-batch epochs over each rollout (one rollout per ppo_epochs x
num_mini_batches optimizer steps, ratios move off 1 after the first mini-batch), advantages whitened
over the whole rollout (by hand), resume in the middle of a rollout's mini-batches continues
exactly, 2 ranks take the same updates as one process, and the actor/critic split is right."""
from __future__ import annotations

import json

import pytest
import torch

from apps.chat_rlhf.ppo import (ActorCritic, PPOLoss, PPOSettings, actor_weights, load_ppo_config, mini_batch_order,
                                train_ppo)


def length_reward(*, completions, **_):
    return [float(len(c)) for c in completions]


@pytest.fixture(scope="module")
def tiny_rm(tiny_chat_model, tmp_path_factory):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    directory = tmp_path_factory.mktemp("tiny_rm") / "rm"
    config = AutoConfig.from_pretrained(str(tiny_chat_model), num_labels=1)
    torch.manual_seed(1)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(str(directory))
    AutoTokenizer.from_pretrained(str(tiny_chat_model)).save_pretrained(str(directory))
    return directory


def _cfg(model, rm, out, *extra):
    return load_ppo_config(None, [f"model={model}", "data.num_train=12", "data.num_heldout=4",
                                  "ppo.num_generations=2", "ppo.max_new_tokens=6", f"ppo.rewards=[rm:{rm}]",
                                  "ppo.ppo_epochs=2", "ppo.num_mini_batches=2", "ppo.kl_target=0.001",
                                  "ppo.kl_horizon=10", "train.micro_batch_size=2", f"train.output_dir={out}",
                                  "train.lr=1e-2", "train.min_lr_ratio=1.0", "engine.max_model_len=96",
                                  "train.progress_bar=false", "train.plot=false", *extra])


def _weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _rollout_records(out):
    return [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]


def test_mini_batch_epochs_and_resume_mid_rollout(tiny_chat_model, tiny_rm, tmp_path):
    """8 steps straight = 2 rollouts of 2 epochs x 2 mini-batches; then the same run stopped after
    step 2 (mid-rollout: the buffer goes into the checkpoint) and resumed continues identically."""
    full, hook = train_ppo(_cfg(tiny_chat_model, tiny_rm, tmp_path / "a", "train.max_steps=8", "train.eval_every=2",
                                "eval_before=true"))
    loss = hook.loss
    history = hook.history
    assert full.final_step == 8 and all(torch.isfinite(torch.tensor(full.losses)))
    assert loss.rollouts == 2  # exactly one rollout per ppo_epochs x num_mini_batches = 4 optimizer steps
    assert [r["new_rollout"] for r in history] == [True, False, False, False] * 2
    assert [(r["ppo_epoch"], r["mini_batch"]) for r in history] == [(0, 0), (0, 1), (1, 0), (1, 1)] * 2
    # The first mini-batch of a rollout sees the weights that sampled it; later ones do not.
    assert history[0]["ratio_dev"] < 1e-4 and history[0]["approx_kl"] < 1e-8
    assert all(r["ratio_dev"] > 1e-3 and r["approx_kl"] > 0 for i, r in enumerate(history) if i % 4)
    assert max(r["clip_frac"] for r in history) > 0  # the ratio clip does its job now
    assert max(r["value_clip_frac"] for r in history) > 0
    # The engine got the weights before the second rollout (lazy sync at the cycle's end): no gap.
    assert all(r["logprob_gap"] < 1e-4 for r in history if r["new_rollout"])
    assert history[4]["kl"] > 0 and history[-1]["kl_coef"] != 0.05  # moved off the reference; controller moved
    assert "heldout_reward" in full.last_eval and "heldout_reward" in hook.heldout_before

    first, _ = train_ppo(_cfg(tiny_chat_model, tiny_rm, tmp_path / "b", "train.max_steps=2", "train.eval_every=2"))
    assert (first.checkpoint_dir / "rl_state" / "buffer-rank0.safetensors").is_file()
    second, resumed = train_ppo(_cfg(tiny_chat_model, tiny_rm, tmp_path / "b", "train.max_steps=8",
                                     "train.eval_every=2"))
    assert second.start_step == 2 and resumed.loss.rollouts == 1
    assert first.losses + second.losses == full.losses  # bit for bit
    assert torch.equal(_weights(resumed.model), _weights(hook.model))
    assert resumed.loss.kl.value == loss.kl.value
    drop = ("time_", "rollout_tokens_per_s")
    strip = [{k: v for k, v in r.items() if not k.startswith(drop)} for r in _rollout_records(tmp_path / "b")]
    assert strip == [{k: v for k, v in r.items() if not k.startswith(drop)} for r in _rollout_records(tmp_path / "a")]


def test_resume_mid_rollout_with_other_split_is_refused(tiny_chat_model, tiny_rm, tmp_path):
    from phalanx.config import ConfigError
    train_ppo(_cfg(tiny_chat_model, tiny_rm, tmp_path, "train.max_steps=1", "data.num_heldout=0"))
    with pytest.raises(ConfigError, match="middle of a rollout"):
        train_ppo(_cfg(tiny_chat_model, tiny_rm, tmp_path, "train.max_steps=2", "data.num_heldout=0",
                       "ppo.ppo_epochs=1"))


class _FixedScores:
    """A RewardSet stand-in: fixed scores per sample."""

    def __init__(self, scores):
        self.scores = torch.tensor(scores)

    def __call__(self, prompts, completions, truths):
        return self.scores[:len(completions)].clone(), {}


def test_advantages_whitened_over_the_whole_rollout(tiny_chat_model):
    """Zero-initialised value head (V = 0), no KL penalty, gamma 1, lambda 0.95: the GAE advantage of
    token t of a sequence of length n with score R is 0.95^(n-1-t) R. Lengths 2, 1, 3, scores
    1, 3, -2 give [0.95, 1], [3], [-1.805, -1.9, -2]; whitened over all six tokens (mean -0.12583,
    unbiased std 2.08209)."""
    from transformers import AutoModel, AutoModelForCausalLM

    from apps.chat_rlhf.rollout import Rollout, completion_batch, completion_logprobs

    actor = AutoModelForCausalLM.from_pretrained(str(tiny_chat_model))
    model = ActorCritic(actor, AutoModel.from_pretrained(str(tiny_chat_model)))
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_chat_model)).eval()
    prompts = [[1, 5, 6], [1, 7], [1, 8, 9, 10]]
    completions = [[20, 21], [22], [23, 24, 25]]

    def rollout_fn(indices, step):
        with torch.no_grad():
            lp, _ = completion_logprobs(reference, completion_batch(prompts, completions, 0))
        return Rollout(prompts, completions, [lp[k, :len(c)].tolist() for k, c in enumerate(completions)],
                       ["a", "b", "c"], [False] * 3, 1)

    s = PPOSettings(kl_coef=0.0, kl_target=None, gamma=1.0, lam=0.95, num_mini_batches=3, ppo_epochs=1)
    records = [{"prompt": [{"role": "user", "content": "x"}], "ground_truth": None}] * 3
    loss = PPOLoss(s, records, prompts, _FixedScores([1.0, 3.0, -2.0]), rollout_fn, 0, reference=reference)
    buffer = loss.make_rollout(model, {"index": torch.tensor([0, 1, 2])})
    raw = torch.tensor([[0.95, 1.0, 0.0], [3.0, 0.0, 0.0], [-1.805, -1.9, -2.0]])
    mask = buffer.completion_mask.bool()
    assert torch.allclose(buffer.returns, raw, atol=1e-6)  # returns = advantages + V, V = 0
    mean, std = -0.125833, 2.082091
    assert torch.allclose(buffer.advantages, ((raw - mean) / std) * mask, atol=1e-5)
    assert float(buffer.advantages[mask].mean()) == pytest.approx(0.0, abs=1e-6)
    # A one-sequence mini-batch keeps the rollout's normalisation (not re-whitened per mini-batch).
    mb = buffer.rows(torch.tensor([1]))
    assert mb["input_ids"].shape == (1, 3) and mb["advantages"].tolist() == [[pytest.approx((3 - mean) / std, abs=1e-5)]]
    assert torch.allclose(buffer.old_values, torch.zeros(3, 3))


def test_mini_batch_order_is_a_seeded_permutation():
    a = mini_batch_order(0, 5, 0, 8, 2)
    assert [len(c) for c in a] == [4, 4] and sorted(torch.cat(a).tolist()) == list(range(8))
    # every rank, and a resume
    assert all(torch.equal(x, y) for x, y in zip(a, mini_batch_order(0, 5, 0, 8, 2), strict=True))
    others = [torch.cat(mini_batch_order(0, 5, 1, 8, 2)), torch.cat(mini_batch_order(0, 9, 0, 8, 2)),
              torch.cat(mini_batch_order(1, 5, 0, 8, 2))]
    assert all(not torch.equal(torch.cat(a), o) for o in others)  # a new order per epoch, rollout and seed


def test_actor_weights_strip_wrappers(tiny_chat_model):
    from transformers import AutoModel, AutoModelForCausalLM
    model = ActorCritic(AutoModelForCausalLM.from_pretrained(str(tiny_chat_model)),
                        AutoModel.from_pretrained(str(tiny_chat_model)))
    names = set(actor_weights(model))
    assert names == set(model.actor.state_dict())
    wrapped = torch.nn.Module()
    wrapped.module = model
    assert set(actor_weights(wrapped)) == names


def test_bad_ppo_settings():
    from phalanx.config import ConfigError
    with pytest.raises(ConfigError, match="lam"):
        load_ppo_config(None, ["ppo.lam=1.5"])
    with pytest.raises(ConfigError, match=r"num_mini_batches=3 does not divide .* 8 x 1 = 8 sequences"):
        load_ppo_config(None, ["ppo.num_mini_batches=3"])
    with pytest.raises(ConfigError, match="grad_accum_steps"):
        load_ppo_config(None, ["train.grad_accum_steps=2"])
    with pytest.raises(ConfigError, match="ppo_epochs=0"):
        load_ppo_config(None, ["ppo.ppo_epochs=0"])


# -- fixed rollouts: the mini-batch updates on 2 ranks equal one process ------------------------------
def fixed_rollout_updates(model_dir: str, out_dir: str, world: int) -> list[float] | None:
    """One rollout of 4 prompts x 2 fixed samples (on `world` ranks), then its 2 epochs x 2
    mini-batches. The mini-batch order is sequential (reversed on odd epochs): with fit's strided
    sampler, mini-batch j of one process is then exactly the union of the ranks' mini-batches j."""
    import torch.distributed as dist
    from transformers import AutoModel

    import apps.chat_rlhf.ppo as ppo
    from apps.chat_rlhf.grpo import PromptIndices, encode_prompts, load_prompt_sets
    from apps.chat_rlhf.models import load_policy, load_tokenizer
    from apps.chat_rlhf.rewards import RewardSet
    from fixed_rollouts import seeded_rollout_fn
    from phalanx.train import fit

    def in_order(seed, step, epoch, size, m):
        chunks = list(torch.arange(size).chunk(m))
        return chunks[::-1] if epoch % 2 else chunks

    ppo.mini_batch_order = in_order
    cfg = load_ppo_config(None, [f"model={model_dir}", "data.num_train=16", "data.num_heldout=0",
                                 "ppo.num_generations=2", "ppo.max_new_tokens=6",
                                 "ppo.rewards=[test_ppo:length_reward]", "ppo.kl_coef=0.05",
                                 "ppo.ppo_epochs=2", "ppo.num_mini_batches=2", "ppo.value_clip=0.05",
                                 f"train.micro_batch_size={4 // world}", "train.max_steps=4",
                                 f"train.output_dir={out_dir}", "train.lr=0.3", "train.adam_eps=10.0",
                                 "train.max_grad_norm=0", "train.min_lr_ratio=1.0", "train.progress_bar=false",
                                 "train.plot=false", "train.resume=false"])
    tokenizer = load_tokenizer(model_dir)
    model = ActorCritic(load_policy(model_dir), AutoModel.from_pretrained(model_dir))
    with torch.no_grad():  # a non-zero value head, so values, the value clip and the critic's gradients matter
        model.value_head.weight.copy_(torch.linspace(-0.5, 0.5, model.value_head.weight.numel()).view(1, -1))
    reference = load_policy(model_dir).eval()
    records, _ = load_prompt_sets(cfg.data)
    ids = encode_prompts(tokenizer, records)
    rollout_fn = seeded_rollout_fn(reference, tokenizer, ids, cfg.ppo.num_generations)

    loss = ppo.PPOLoss(cfg.ppo, records, ids, RewardSet.from_specs(cfg.ppo.rewards), rollout_fn,
                       tokenizer.pad_token_id, reference=reference, seed=cfg.train.seed)
    hook = ppo.PPOHook(loss, None, out_dir)
    fit(cfg.train, model, PromptIndices(len(records)), loss_fn=loss, hooks=[hook])
    hook.close()
    assert loss.rollouts == 1 and hook.history[-1]["approx_kl"] > 0
    if dist.get_rank() == 0:
        return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    return None


@pytest.mark.slow
def test_fixed_rollout_mini_batch_updates_match_one_process(tiny_chat_model, tmp_path):
    """AdamW with a large eps steps proportionally to the gradient, so a wrong normalisation over
    ranks (whitening per shard, a local token mean, a factor of world size) shows in the update."""
    from transformers import AutoModel

    from apps.chat_rlhf.models import load_policy
    from phalanx.testing import assert_update_close, spawn
    start_model = ActorCritic(load_policy(str(tiny_chat_model)), AutoModel.from_pretrained(str(tiny_chat_model)))
    with torch.no_grad():
        start_model.value_head.weight.copy_(torch.linspace(-0.5, 0.5, start_model.value_head.weight.numel()).view(1, -1))
    start = _weights(start_model)
    one = torch.tensor(spawn(fixed_rollout_updates, 1, str(tiny_chat_model), str(tmp_path / "one"), 1, timeout=600)[0])
    two = torch.tensor(spawn(fixed_rollout_updates, 2, str(tiny_chat_model), str(tmp_path / "two"), 2, timeout=900)[0])
    assert (one - start).abs().max() > 1e-4
    assert_update_close(two, one, start, 1e-5, "2 ranks vs 1 process, 2 epochs x 2 mini-batches")
