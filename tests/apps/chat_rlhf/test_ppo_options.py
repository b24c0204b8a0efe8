"""PPO's options for the reward-model run: per-prompt score baseline, critic warm-up, the frozen-trunk
cache (same updates as the full forward, and a mid-rollout resume with the cache in the buffer),
and the diagnostics (within-prompt reward spread, the critic's explained variance), on tiny models."""
from __future__ import annotations

import pytest
import torch

from apps.chat_rlhf.ppo import explained_variance, load_ppo_config, prompt_centred, train_ppo


def _cfg(model, out, *extra):
    return load_ppo_config(None, [f"model={model}", "data.num_train=8", "data.num_heldout=0",
                                  "ppo.num_generations=2", "ppo.max_new_tokens=6",
                                  "ppo.rewards=[test_ppo:length_reward]", "ppo.ppo_epochs=2",
                                  "ppo.num_mini_batches=2", "train.micro_batch_size=2", f"train.output_dir={out}",
                                  "train.lr=1e-2", "train.min_lr_ratio=1.0", "engine.max_model_len=96",
                                  "train.progress_bar=false", "train.plot=false", *extra])


def _params(module):
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def test_prompt_centred_by_hand():
    scores = torch.tensor([1.0, 3.0, 5.0, 5.0, -1.0, 2.0])  # prompt-major: 3 prompts x 2 samples
    assert prompt_centred(scores, 2).tolist() == [-1.0, 1.0, 0.0, 0.0, -1.5, 1.5]
    assert prompt_centred(scores, 3).tolist() == [-2.0, 0.0, 2.0, 3.0, -3.0, 0.0]


def test_explained_variance_by_hand():
    returns = torch.tensor([1.0, 2.0, 3.0, 4.0])

    def ev(values):
        res = returns - values
        return explained_variance(float(returns.sum()), float((returns ** 2).sum()), float(res.sum()),
                                  float((res ** 2).sum()), 4.0)
    assert ev(returns) == pytest.approx(1.0)                           # perfect critic
    assert ev(torch.zeros(4)) == pytest.approx(0.0)                    # a constant explains nothing
    assert ev(torch.tensor([1.5, 1.5, 3.5, 3.5])) == pytest.approx(0.8)  # Var(res) 0.25 / Var(ret) 1.25
    assert ev(torch.tensor([4.0, 3.0, 2.0, 1.0])) < 0                  # worse than the mean


def test_bad_option_settings():
    from phalanx.config import ConfigError
    with pytest.raises(ConfigError, match="score_baseline='group'"):
        load_ppo_config(None, ["ppo.score_baseline=group"])
    with pytest.raises(ConfigError, match="num_generations >= 2"):
        load_ppo_config(None, ["ppo.score_baseline=prompt", "ppo.num_generations=1"])
    with pytest.raises(ConfigError, match="cache_frozen_trunk needs train_layers"):
        load_ppo_config(None, ["ppo.cache_frozen_trunk=true"])
    with pytest.raises(ConfigError, match="critic_warmup_rollouts"):
        load_ppo_config(None, ["ppo.critic_warmup_rollouts=-1"])


def test_frozen_trunk_cache_gives_the_same_updates_and_resumes(tiny_chat_model, tmp_path):
    """train_layers=1 of 2 blocks: the mini-batch steps fed the cached lower-block output take the
    same losses and end at the same weights as the full forward (2 rollouts, 8 steps), and the cache
    travels in a mid-rollout checkpoint (2 steps + resume = 8 straight, bit for bit)."""
    common = ("ppo.train_layers=1", "ppo.score_baseline=prompt", "ppo.normalize_scores=true", "train.max_steps=8")
    full, full_hook = train_ppo(_cfg(tiny_chat_model, tmp_path / "full", *common))
    cached, cached_hook = train_ppo(_cfg(tiny_chat_model, tmp_path / "cached", *common, "ppo.cache_frozen_trunk=true"))
    assert cached_hook.loss.trunks is not None and full_hook.loss.trunks is None
    assert cached_hook.loss.buffer.actor_hidden is not None and cached_hook.loss.buffer.critic_hidden is not None
    assert torch.allclose(torch.tensor(cached.losses), torch.tensor(full.losses), atol=1e-5, rtol=1e-4)
    assert abs(full.losses[1]) > 1e-4  # a real policy/value loss was compared
    a, b = _params(cached_hook.model), _params(full_hook.model)
    assert torch.allclose(a, b, atol=1e-5)
    for r in cached_hook.history:
        if r["new_rollout"]:
            assert r["reward_within_std"] >= 0 and r["critic_explained_var"] <= 1.0

    first, _ = train_ppo(_cfg(tiny_chat_model, tmp_path / "resumed", *common[:-1], "train.max_steps=2",
                              "train.save_every=2", "ppo.cache_frozen_trunk=true"))
    saved = first.checkpoint_dir / "rl_state" / "buffer-rank0.safetensors"
    from safetensors import safe_open
    with safe_open(str(saved), framework="pt") as f:
        assert {"actor_hidden", "critic_hidden"} <= set(f.keys())
    second, resumed = train_ppo(_cfg(tiny_chat_model, tmp_path / "resumed", *common, "ppo.cache_frozen_trunk=true"))
    assert second.start_step == 2 and first.losses + second.losses == cached.losses
    assert torch.equal(_params(resumed.model), a)


def test_critic_warmup_leaves_the_actor_alone(tiny_chat_model, tmp_path):
    """critic_warmup_rollouts=1: the first rollout's 4 steps move the critic (backbone + value head)
    but not the actor; the second rollout's steps move the actor too."""
    from apps.chat_rlhf.models import load_policy
    from phalanx.booster.plugins.base import unwrap_model
    start = _params(load_policy(str(tiny_chat_model)))
    _, hook = train_ppo(_cfg(tiny_chat_model, tmp_path / "a", "train.max_steps=4", "ppo.critic_warmup_rollouts=1",
                             "ppo.score_baseline=prompt"))
    model = unwrap_model(hook.model)
    assert torch.equal(_params(model.actor), start)
    assert _params(model.value_head).abs().max() > 0
    assert [r["policy_trained"] for r in hook.history] == [False] * 4
    _, hook = train_ppo(_cfg(tiny_chat_model, tmp_path / "b", "train.max_steps=8", "ppo.critic_warmup_rollouts=1",
                             "ppo.score_baseline=prompt"))
    model = unwrap_model(hook.model)
    assert not torch.equal(_params(model.actor), start)
    assert [r["policy_trained"] for r in hook.history] == [False] * 4 + [True] * 4
    assert hook.history[4]["critic_explained_var"] != 0.0  # the warmed-up critic predicts something


def test_eval_trained_prompts_scores_the_prompts_the_rollouts_use(tiny_chat_model, tmp_path):
    """eval_trained_prompts: every evaluation also scores greedy answers to exactly the training
    prompts this run's rollouts take (2 rollouts x 2 prompts here), compared first vs last."""
    from apps.chat_rlhf.ppo_hook import trained_prompt_indices
    from apps.chat_rlhf.rl_eval import TRAINED_DIR, heldout_report, plot_ppo, read_heldout
    out = tmp_path / "run"
    cfg = _cfg(tiny_chat_model, out, "data.num_heldout=2", "train.max_steps=8", "train.eval_every=4",
               "eval_before=true", "eval_trained_prompts=true", "ppo.score_baseline=prompt")
    result, hook = train_ppo(cfg)
    used = sorted(i for r in hook.loss.rollout_indices for i in r)
    assert trained_prompt_indices(cfg, 8) == used and len(used) == 4
    trained = read_heldout(out, TRAINED_DIR)
    assert list(trained) == [0, 4, 8] and all(len(rows) == 4 for rows in trained.values())
    assert {"heldout_reward", "trained_reward", "trained_n"} <= set(result.last_eval)
    assert result.last_eval["trained_n"] == 4.0 and result.last_eval["heldout_n"] == 2.0
    report = heldout_report(out, TRAINED_DIR)
    assert report["score"]["n"] == 4 and (out / "trained_comparison.json").is_file()
    assert heldout_report(out)["score"]["n"] == 2
    assert plot_ppo(out).is_file()


def test_diagnose_spread_by_hand():
    """Scores [[1, 3], [5, 7]]: prompt means 2 and 6 (between variance 4), deviations +-1 (within
    variance 1), total variance 5 = 4 + 1."""
    from apps.chat_rlhf.ppo_diagnose import correlation, spread
    r = spread(torch.tensor([[1.0, 3.0], [5.0, 7.0]]))
    assert r["between_std"] == pytest.approx(2.0) and r["within_std"] == pytest.approx(1.0)
    assert r["std"] == pytest.approx(5 ** 0.5) and r["within_share"] == pytest.approx(0.2)
    assert correlation(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 2.0, 1.0])) == pytest.approx(-1.0)


def test_diagnose_best_of_k_by_hand():
    """Best of the first k samples, averaged over prompts, for k = 1, 2, 4 (3 samples: k = 1, 2)."""
    from apps.chat_rlhf.ppo_diagnose import best_of_k
    scores = torch.tensor([[1.0, 3.0, 2.0, 0.0], [4.0, 0.0, 1.0, 6.0]])
    assert best_of_k(scores) == {1: 2.5, 2: 3.5, 4: 4.5}
    assert best_of_k(scores[:, :3]) == {1: 2.5, 2: 3.5}


def test_diagnose_heldout_samples_the_heldout_prompts(tiny_chat_model, tmp_path):
    """--heldout samples the first N held-out prompts (default: training prompts), and the report
    compares the samples' mean and the best of n with the greedy answers, prompt by prompt."""
    import json

    from apps.chat_rlhf.models import load_tokenizer
    from apps.chat_rlhf.ppo import load_ppo_prompts
    from apps.chat_rlhf.ppo_diagnose import main
    overrides = [f"model={tiny_chat_model}", "data.num_train=6", "data.num_heldout=3", "ppo.max_new_tokens=4",
                 "ppo.rewards=[test_ppo:length_reward]", f"train.output_dir={tmp_path}"]
    config = "apps/chat_rlhf/configs/ppo.yaml"
    train, held, _, _ = load_ppo_prompts(load_ppo_config(config, overrides).data, load_tokenizer(str(tiny_chat_model)))
    for flag, expected in ((["--heldout"], held[:2]), ([], train[:2])):
        report = main(["--config", config, "--prompts", "2", "--samples", "2", *flag, *overrides])
        rows = [json.loads(x) for x in (tmp_path / "diagnose.jsonl").read_text().splitlines()]
        greedy = [r for r in rows if r["sample"] == "greedy"]
        assert [r["prompt_text"] for r in greedy] == [r["prompt"] for r in expected]
        assert report["split"] == ("heldout" if flag else "train") and len(rows) == 2 * 2 + 2
        vs = report["best_of_n_vs_greedy"]
        assert vs["n"] == 2 and vs["mean_diff"] == pytest.approx(report["best_of_n_mean"] - report["greedy_mean"])
        assert report["sample_mean_vs_greedy"]["mean_diff"] == pytest.approx(report["sample_mean"] -
                                                                            report["greedy_mean"])
        assert report["best_of_k_mean"][2] == pytest.approx(report["best_of_n_mean"])
    assert held[0]["prompt"] != train[0]["prompt"]
