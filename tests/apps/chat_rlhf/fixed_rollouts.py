"""Fixed rollouts for the multi-rank equivalence tests: the same completions on every layout, so
a policy update can be compared exactly (sampling would differ between layouts)."""
from __future__ import annotations

import random

import torch


def seeded_rollout_fn(reference, tokenizer, prompt_ids: list[list[int]], n: int):
    """A `rollout_fn(indices, step)` giving each prompt i `n` completions of 1-6 random tokens
    seeded by (i, j), with the reference model's log-probs as the engine's; a completion of 6
    tokens counts as truncated."""
    from apps.chat_rlhf.rollout import Rollout, completion_batch, completion_logprobs

    def rollout_fn(indices, step):
        prompts, comps = [], []
        for i in indices:
            for j in range(n):
                rng = random.Random(1000 * i + j)
                prompts.append(prompt_ids[i])
                comps.append([rng.randrange(3, len(tokenizer) - 1) for _ in range(rng.randint(1, 6))])
        with torch.no_grad():
            lp, _ = completion_logprobs(reference, completion_batch(prompts, comps, tokenizer.pad_token_id))
        return Rollout(prompts, comps, [lp[k, :len(c)].tolist() for k, c in enumerate(comps)],
                       tokenizer.batch_decode(comps), [len(c) == 6 for c in comps], n)
    return rollout_fn
