"""The arithmetic of online RL, as plain tensor functions (no models, no engines).

Shapes: per-token tensors are [B, T] with a 0/1 `mask` over completion tokens; rewards of the
GRPO family are [P, n] (P prompts, n samples each). Every function here has a hand-computed test.

- `group_advantages`: GRPO (group mean baseline), RLOO (leave-one-out baseline), REINFORCE++
  (batch mean baseline), each scaled by the group std, the batch std, or not at all (Dr. GRPO).
- `policy_loss`: the clipped importance-weighted objective with asymmetric bounds (clip-higher,
  DAPO), aggregated per token over the batch (DAPO) or per sequence (GRPO paper).
- `k3_kl`: Schulman's unbiased, always-positive KL estimator, exp(r) - r - 1 with r = ref - logp
  (what is logged); `kl_penalty`: the KL term to differentiate (k2, whose gradient is unbiased).
- `gae`, `value_loss`, `AdaptiveKLController`: PPO's pieces (InstructGPT); `whiten`: the one
  normaliser (advantages, scores; over every rank through `sums`).
- `overlong_shaping` (DAPO), `tis_weights` (truncated importance sampling), `prompt_centred`,
  `explained_variance`.
"""
from __future__ import annotations

import math
from typing import Callable, Literal, Sequence

import torch

Scale = Literal["group", "batch", "none"]
Baseline = Literal["grpo", "rloo", "reinforce_pp"]
Aggregation = Literal["token", "sequence"]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def local_sums(values: Sequence[float]) -> list[float]:
    """The `sums` of one process: the values themselves."""
    return [float(v) for v in values]


def whiten(x: torch.Tensor, mask: torch.Tensor | None = None, *, shift_mean: bool = True, eps: float = 1e-8,
           sums: Callable[[Sequence[float]], list[float]] = local_sums) -> torch.Tensor:
    """(x - mean) / std over the masked entries (unbiased variance, as in InstructGPT/TRL): the one
    normaliser of online RL. `sums` turns this process's sums into the run's (`global_sum`,
    `DataReplicas.sum`), so the statistics cover every rank's rollout, not one shard; mean and
    variance are two passes of float64 host sums."""
    m = torch.ones_like(x) if mask is None else mask.to(x.dtype)
    count, total = sums([float(m.sum()), float((x.double() * m).sum())])
    mean = total / max(count, 1.0)
    (sq,) = sums([float((((x.double() - mean) * m) ** 2).sum())])
    var = sq / max(count - 1.0, 1.0)
    out = (x - mean) * (var + eps) ** -0.5
    return out if shift_mean else out + mean


def whiten_over_ranks(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, sums=local_sums) -> torch.Tensor:
    """PPO's advantages: `whiten` over the masked entries of every rank's rollout, 0 off the mask."""
    return whiten(x, mask, eps=eps, sums=sums) * mask.to(x.dtype)


def standardize_over_ranks(x: torch.Tensor, eps: float = 1e-8, sums=local_sums) -> torch.Tensor:
    """PPO's `normalize_scores`: `whiten` over every value of every rank."""
    return whiten(x, eps=eps, sums=sums)


def group_advantages(rewards: torch.Tensor, *, baseline: Baseline = "grpo", scale: Scale = "group",
                     eps: float = 1e-4) -> torch.Tensor:
    """Sequence-level advantages [P, n] from rewards [P, n].

    baseline grpo: r - mean of the group; rloo: r - mean of the *other* n-1 samples (unbiased);
    reinforce_pp: r - mean of the whole batch. scale group: divide by the group's std (GRPO);
    batch: by the batch's std (REINFORCE++ and Lite-PPO); none: no division (Dr. GRPO, which
    removes the question-difficulty bias). Stds are unbiased; eps keeps zero-spread groups finite.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [prompts, samples], got shape {tuple(rewards.shape)}")
    r = rewards.double()
    n = r.shape[1]
    if baseline == "grpo":
        adv = r - r.mean(dim=1, keepdim=True)
    elif baseline == "rloo":
        if n < 2:
            raise ValueError("the RLOO baseline needs at least 2 samples per prompt (n >= 2)")
        adv = (r - r.mean(dim=1, keepdim=True)) * n / (n - 1)  # r - (sum - r) / (n - 1)
    elif baseline == "reinforce_pp":
        adv = r - r.mean()
    else:
        raise ValueError(f"baseline={baseline!r}: choose grpo, rloo or reinforce_pp")
    if scale == "group":
        std = r.std(dim=1, keepdim=True) if n > 1 else torch.zeros_like(r[:, :1])
        adv = adv / (std + eps)
    elif scale == "batch":
        adv = adv / (r.std() + eps) if r.numel() > 1 else adv
    elif scale != "none":
        raise ValueError(f"scale={scale!r}: choose group, batch or none")
    return adv.to(rewards.dtype)


def zero_spread_groups(rewards: torch.Tensor) -> torch.Tensor:
    """[P] bool: groups whose samples all got the same reward (no learning signal under GRPO)."""
    return (rewards.max(dim=1).values - rewards.min(dim=1).values) == 0


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate exp(ref - logp) - (ref - logp) - 1 (>= 0, unbiased under pi)."""
    r = ref_logp - logp
    return torch.exp(r) - r - 1


KL_ESTIMATORS = ("k2", "k3")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k2") -> torch.Tensor:
    """The per-token KL term to *differentiate* (a loss), for tokens sampled from the current policy.

    k2 = (logp - ref)^2 / 2: its gradient (logp - ref) * grad logp is, in expectation over the
    sampled token, exactly the gradient of KL(pi || ref) at that position: the unbiased choice.
    k3 (`k3_kl`, what GRPO's paper adds to the loss): an unbiased estimate of the KL's *value*, but
    its gradient (1 - ref / pi) * grad logp averages to the gradient of the reverse direction,
    KL(ref || pi); kept for comparison with runs that used it."""
    if estimator == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    if estimator == "k3":
        return k3_kl(logp, ref_logp)
    raise ValueError(f"KL estimator {estimator!r}: choose one of {', '.join(KL_ESTIMATORS)}")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: Aggregation, *, token_total: float | None = None,
              seq_total: float | None = None) -> torch.Tensor:
    """Reduce [B, T] to a scalar: token = sum over all tokens / number of tokens (DAPO: long answers
    weigh by length); sequence = mean over sequences of each sequence's token mean (GRPO paper).
    `token_total` / `seq_total` replace the local counts with global ones (data-parallel ranks)."""
    mask = mask.to(per_token.dtype)
    if how == "token":
        return (per_token * mask).sum() / (token_total if token_total is not None else mask.sum().clamp(min=1))
    if how == "sequence":
        per_seq = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_seq.sum() / (seq_total if seq_total is not None else max(per_token.shape[0], 1))
    raise ValueError(f"aggregation={how!r}: choose token or sequence")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                clip_low: float = 0.2, clip_high: float = 0.2, aggregation: Aggregation = "token",
                token_total: float | None = None, seq_total: float | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A) per token.

    advantages: [B] (one per sequence) or [B, T]. Returns (loss, stats) where stats hold the
    per-token masked *sums* clipped_low / clipped_high (ratio cut at the lower / upper bound and the
    bound active) and the token count, so callers can reduce them over ranks."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    ratio = torch.exp(logp - old_logp)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    loss = aggregate(per_token, mask, aggregation, token_total=token_total, seq_total=seq_total)
    m = mask.to(logp.dtype)
    with torch.no_grad():
        low = ((ratio < 1.0 - clip_low) & (advantages < 0)).to(m.dtype)
        high = ((ratio > 1.0 + clip_high) & (advantages > 0)).to(m.dtype)
        stats = {"clipped_low": (low * m).sum(), "clipped_high": (high * m).sum(), "tokens": m.sum()}
    return loss, stats


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0, lam: float = 0.95
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each completion: (advantages, returns), both [B, T].

    delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}; V beyond a sequence's
    last completion token is 0 (the episode ends there). Masked positions get 0."""
    mask = mask.to(values.dtype)
    values = values * mask
    B, T = rewards.shape
    adv = torch.zeros_like(values)
    last = torch.zeros(B, dtype=values.dtype, device=values.device)
    for t in reversed(range(T)):
        next_v = values[:, t + 1] if t + 1 < T else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        last = (delta + gamma * lam * last) * mask[:, t]
        adv[:, t] = last
    return adv, (adv + values) * mask


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
               clip: float | None = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """0.5 * max((V - R)^2, (clip(V, V_old +- clip) - R)^2), token mean; returns (loss, clip fraction)."""
    err = (values - returns) ** 2
    if clip is None:
        return 0.5 * masked_mean(err, mask), torch.zeros(())
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    err_clipped = (clipped - returns) ** 2
    return 0.5 * masked_mean(torch.maximum(err, err_clipped), mask), masked_mean((err_clipped > err).float(), mask)


class AdaptiveKLController:
    """InstructGPT's proportional controller: coef *= 1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon,
    with n the samples (completions) the KL was measured on and the horizon in samples, as in
    InstructGPT and TRL; the callers pass the KL as a per-token mean, so the target is per token.
    The factor never falls below 0 (a horizon shorter than 5 updates' samples would flip the sign).
    With target None the coefficient stays fixed."""

    def __init__(self, init_coef: float, target: float | None = 6.0, horizon: int = 10000) -> None:
        if init_coef < 0:
            raise ValueError(f"the KL coefficient must be >= 0, got {init_coef}")
        if horizon < 1:
            raise ValueError(f"the KL horizon must be >= 1, got {horizon}")
        self.value, self.target, self.horizon = float(init_coef), target, horizon

    def update(self, current_kl: float, n_samples: int) -> float:
        if self.target is not None and math.isfinite(current_kl):
            error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
            self.value *= max(1.0 + error * n_samples / self.horizon, 0.0)
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.target, self.horizon = float(state["value"]), state["target"], int(state["horizon"])


# -- shaping, importance weights and PPO's score statistics -----------------------------------------
def overlong_shaping(lengths: torch.Tensor, truncated: torch.Tensor, max_new: int, penalty: float, buffer: int
                     ) -> torch.Tensor:
    """DAPO's overlong penalty (<= 0): linear over the last `buffer` tokens, full when truncated."""
    if penalty == 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    if buffer == 0:
        return -penalty * truncated.float()
    over = (lengths.float() - (max_new - buffer)).clamp(min=0) / buffer
    return -penalty * torch.where(truncated, torch.ones_like(over), over.clamp(max=1.0))


def tis_weights(trainer_lp: torch.Tensor, engine_lp: torch.Tensor, mask: torch.Tensor, cap: float | None
                ) -> torch.Tensor:
    """[B, T] truncated importance weights min(pi_trainer / pi_engine, cap) of the sampled tokens
    (1 off the mask, and everywhere with cap None): the engine samples from its own rounding of
    the policy (another kernel, another dtype, or weights a step behind), the gradient wants the
    trainer's distribution; the cap bounds the variance (Yao et al., 2025, "truncated importance
    sampling"). No gradient flows through them."""
    if cap is None:
        return torch.ones_like(trainer_lp)
    w = torch.exp((trainer_lp - engine_lp) * mask).clamp(max=cap)
    return torch.where(mask > 0, w, torch.ones_like(w)).detach()


def prompt_centred(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Each score minus the mean score of its prompt's n samples (rows are prompt-major: i*n + j).
    A rank holds whole prompts, so no communication is needed. What is left is the signal the
    policy can act on: which answer to this prompt the reward prefers; the spread between prompts
    (most of an RM score's variance) is noise to the policy gradient until the critic learns it."""
    g = scores.reshape(-1, n)
    return (g - g.mean(dim=1, keepdim=True)).reshape(-1)


def explained_variance(ret_sum: float, ret_sq: float, res_sum: float, res_sq: float, n: float) -> float:
    """1 - Var(returns - values) / Var(returns) over a rollout's tokens, from global sums: 1 when the
    critic predicts the returns, 0 when it does no better than their mean, negative when worse."""
    n = max(n, 1.0)
    var_ret = ret_sq / n - (ret_sum / n) ** 2
    var_res = res_sq / n - (res_sum / n) ** 2
    return 1.0 - var_res / var_ret if var_ret > 1e-12 else 0.0
