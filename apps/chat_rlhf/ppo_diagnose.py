"""Is there a learning signal for PPO? Sample the starting policy and look at the reward's spread.

    python -m apps.chat_rlhf.ppo_diagnose --config apps/chat_rlhf/configs/ppo.yaml [--prompts 16] [--samples 8]

Before tuning PPO on a reward model, check what the reward can teach: for `--prompts` training
prompts it draws `--samples` completions each (the config's temperature and max_new_tokens) plus
the greedy answer, scores them with the config's rewards, and prints

- the total spread of the sampled scores, split into the spread *between* prompts (of each
  prompt's mean) and *within* a prompt (around that mean): only the within-prompt part tells the
  policy which of its answers to one prompt is better; the between-prompt part is noise to the
  policy gradient until the critic has learned it (`ppo.score_baseline: prompt` removes it);
- the correlation of the score with the completion length (a reward that mostly counts tokens
  invites length hacking), and the share of samples cut at max_new_tokens;
- the greedy answers' mean score against the samples' (what the held-out evaluation measures,
  against what the rollouts see), and the best-of-n mean (the headroom sampling can find).

Writes the per-sample rows to `<train.output_dir>/diagnose.jsonl`.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from phalanx.config import parse_config_args


def spread(scores: torch.Tensor) -> dict[str, float]:
    """scores [P, n]: total, between-prompt and (pooled) within-prompt standard deviations (population,
    so total² = between² + within²) and the within share of the variance."""
    s = scores.double()
    total = float(s.var(unbiased=False))
    between = float(s.mean(1).var(unbiased=False))
    within = float(((s - s.mean(1, keepdim=True)) ** 2).mean())
    return {"std": total ** 0.5, "between_std": between ** 0.5, "within_std": within ** 0.5,
            "within_share": within / total if total > 0 else 0.0}


def correlation(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denom = float((x.norm() * y.norm()))
    return float((x * y).sum()) / denom if denom > 0 else 0.0


def main(argv: list[str] | None = None) -> None:
    from phalanx.launch import context

    from .grpo import sample_seed
    from .models import load_policy, load_tokenizer
    from .ppo import load_ppo_config, load_ppo_prompts
    from .rewards import RewardSet
    from .rollout import RolloutEngine

    def extra(parser):
        parser.add_argument("--prompts", type=int, default=16, help="training prompts to sample (the first N)")
        parser.add_argument("--samples", type=int, default=8, help="completions per prompt")

    cfg, args = parse_config_args("PPO signal check: reward spread within and between prompts", load_ppo_config,
                                  argv, example="apps/chat_rlhf/configs/ppo.yaml", extra=extra)
    context()
    s, e = cfg.ppo, cfg.engine
    tokenizer = load_tokenizer(cfg.model)
    policy = load_policy(cfg.model).eval()
    records, _, ids, _ = load_ppo_prompts(cfg.data, tokenizer)
    records, ids = records[:args.prompts], ids[:args.prompts]
    engine = RolloutEngine.build(policy, tokenizer, max_new_tokens=s.max_new_tokens, max_model_len=e.max_model_len,
                                 temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=cfg.train.seed,
                                 max_num_seqs=e.max_num_seqs, block_size=e.block_size,
                                 kv_cache_memory_gib=e.kv_cache_memory_gib)
    rewards = RewardSet.from_specs(s.rewards, s.reward_weights)
    n = args.samples
    t0 = time.perf_counter()
    seeds = [sample_seed(cfg.train.seed, 0, i, j) for i in range(len(ids)) for j in range(n)]
    sampled = engine.generate(ids, n, seeds=seeds)
    greedy = engine.generate(ids, 1, greedy=True)
    t1 = time.perf_counter()
    prompts = [r["prompt"] for r in records]
    scores, _ = rewards([p for p in prompts for _ in range(n)], sampled.texts, [None] * len(sampled.texts))
    greedy_scores, _ = rewards(prompts, greedy.texts, [None] * len(prompts))
    t2 = time.perf_counter()
    grid = scores.view(len(ids), n)
    lengths = torch.tensor([len(c) for c in sampled.completion_ids], dtype=torch.float64)
    report = {"prompts": len(ids), "samples_per_prompt": n, "temperature": s.temperature,
              "max_new_tokens": s.max_new_tokens, "sample_mean": float(scores.mean()), **spread(grid),
              "greedy_mean": float(greedy_scores.mean()), "best_of_n_mean": float(grid.max(1).values.mean()),
              "score_length_corr": correlation(scores, lengths),
              "within_prompt_score_length_corr": correlation(grid - grid.mean(1, keepdim=True),
                                                             (lengths.view(len(ids), n) -
                                                              lengths.view(len(ids), n).mean(1, keepdim=True))),
              "mean_length": float(lengths.mean()), "truncated_frac": sum(sampled.truncated) / len(sampled.truncated),
              "generate_s": t1 - t0, "score_s": t2 - t1}
    out = Path(cfg.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "diagnose.jsonl", "w") as f:
        for k, text in enumerate(sampled.texts):
            f.write(json.dumps({"prompt": k // n, "sample": k % n, "score": float(scores[k]),
                                "length": int(lengths[k]), "text": text}) + "\n")
        for i, text in enumerate(greedy.texts):
            f.write(json.dumps({"prompt": i, "sample": "greedy", "score": float(greedy_scores[i]),
                                "length": len(greedy.completion_ids[i]), "text": text}) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
