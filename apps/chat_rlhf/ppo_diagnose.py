"""Is there a learning signal for PPO? Sample the starting policy and look at the reward's spread.

    python -m apps.chat_rlhf.ppo_diagnose --config apps/chat_rlhf/configs/ppo.yaml [--prompts 16] [--samples 8]
        [--heldout]

Before tuning PPO on a reward model, check what the reward can teach: for the first `--prompts`
training prompts (with `--heldout`: the held-out prompts, which PPO's evaluation scores) it draws
`--samples` completions each (the config's temperature and max_new_tokens) plus the greedy
answer, scores them with the config's rewards, and prints

- the total spread of the sampled scores, split into the spread *between* prompts (of each
  prompt's mean) and *within* a prompt (around that mean): only the within-prompt part tells the
  policy which of its answers to one prompt is better; the between-prompt part is noise to the
  policy gradient until the critic has learned it (`ppo.score_baseline: prompt` removes it);
- the correlation of the score with the completion length (a reward that mostly counts tokens
  invites length hacking), and the share of samples cut at max_new_tokens;
- the greedy answers' mean score against the samples' (what the held-out evaluation measures,
  against what the rollouts see), and the best-of-n mean (the headroom sampling can find), each
  as a paired comparison with the greedy answers over the prompts (mean change, 95 % bootstrap
  interval, sign test: `ppo.paired_comparison`). A best-of-n that is not clearly above the greedy
  answers means the reward offers PPO little to climb at this sample size.

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


def best_of_k(scores: torch.Tensor) -> dict[int, float]:
    """scores [P, n]: {k: mean over prompts of the best of the first k samples} for k = 1, 2, 4, ... <= n
    (one sampling run shows how the headroom grows with the samples per prompt)."""
    out, k = {}, 1
    while k <= scores.shape[1]:
        out[k] = float(scores[:, :k].max(1).values.mean())
        k *= 2
    return out


def main(argv: list[str] | None = None) -> dict:
    from phalanx.launch import context

    from .rl_rollouts import sample_seed
    from .models import load_policy, load_tokenizer
    from .ppo import load_ppo_config, load_ppo_prompts
    from .rl_eval import paired_comparison
    from .rewards import RewardSet
    from .rollout import RolloutEngine

    def extra(parser):
        parser.add_argument("--prompts", type=int, default=16, help="prompts to sample (the first N)")
        parser.add_argument("--samples", type=int, default=8, help="completions per prompt")
        parser.add_argument("--heldout", action="store_true",
                            help="sample the first N held-out prompts (what PPO's evaluation scores) instead")

    cfg, args = parse_config_args("PPO signal check: reward spread within and between prompts", load_ppo_config,
                                  argv, example="apps/chat_rlhf/configs/ppo.yaml", extra=extra)
    context()
    s, e = cfg.ppo, cfg.engine
    tokenizer = load_tokenizer(cfg.model)
    policy = load_policy(cfg.model).eval()
    train, held, train_ids, held_ids = load_ppo_prompts(cfg.data, tokenizer)
    records, ids = (held, held_ids) if args.heldout else (train, train_ids)
    if not records:
        which = "held-out" if args.heldout else "training"
        raise SystemExit(f"ppo_diagnose: no {which} prompts in {cfg.data.source} (data.num_train="
                         f"{cfg.data.num_train}, data.num_heldout={cfg.data.num_heldout}): raise the count")
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
    best = grid.max(1).values
    report = {"split": "heldout" if args.heldout else "train", "prompts": len(ids), "samples_per_prompt": n,
              "temperature": s.temperature, "max_new_tokens": s.max_new_tokens, "sample_mean": float(scores.mean()),
              **spread(grid),
              "greedy_mean": float(greedy_scores.mean()), "best_of_n_mean": float(best.mean()),
              "best_of_k_mean": best_of_k(grid),
              "score_length_corr": correlation(scores, lengths),
              "within_prompt_score_length_corr": correlation(grid - grid.mean(1, keepdim=True),
                                                             (lengths.view(len(ids), n) -
                                                              lengths.view(len(ids), n).mean(1, keepdim=True))),
              "mean_length": float(lengths.mean()), "truncated_frac": sum(sampled.truncated) / len(sampled.truncated),
              "generate_s": t1 - t0, "score_s": t2 - t1,
              "sample_mean_vs_greedy": paired_comparison(greedy_scores.tolist(), grid.mean(1).tolist()),
              "best_of_n_vs_greedy": paired_comparison(greedy_scores.tolist(), best.tolist())}
    out = Path(cfg.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "diagnose.jsonl", "w") as f:
        for k, text in enumerate(sampled.texts):
            f.write(json.dumps({"prompt": k // n, "prompt_text": prompts[k // n], "sample": k % n,
                                "score": float(scores[k]), "length": int(lengths[k]), "text": text}) + "\n")
        for i, text in enumerate(greedy.texts):
            f.write(json.dumps({"prompt": i, "prompt_text": prompts[i], "sample": "greedy",
                                "score": float(greedy_scores[i]), "length": len(greedy.completion_ids[i]),
                                "text": text}) + "\n")
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
