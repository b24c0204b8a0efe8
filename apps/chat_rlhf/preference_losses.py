"""Preference losses and the log-probabilities they compare.

Sequence log-probabilities are *sums* over the completion tokens (the prompt is context only);
`avg` variants divide by the completion length. Each loss returns per-example losses plus the
implicit rewards it logs, so callers choose the reduction (the mean over the batch).

- DPO (sigmoid), Rafailov et al. 2023, with conservative label smoothing ε (cDPO):
  ``-(1-ε) logσ(βΔ) - ε logσ(-βΔ)``, Δ = (log π(y_w) - log π_ref(y_w)) - (log π(y_l) - log π_ref(y_l)).
- IPO, Azar et al. 2023: ``(Δ̄ - 1/(2β))²`` with Δ̄ built from per-token averages (as TRL does; the
  IPO authors confirmed the normalisation).
- SimPO, Meng et al. 2024 (reference-free): ``-(1-ε) logσ(βΔ̄ - γ) - ε logσ(-(βΔ̄ - γ))`` with Δ̄ the
  difference of per-token average log-probs of the policy.
- KTO, Ethayarajh et al. 2024: desirable ``λ_D (1 - σ(β(r - z)))``, undesirable
  ``λ_U (1 - σ(β(z - r)))`` with r = log π(y|x) - log π_ref(y|x) and z = max(0, mean KL estimate),
  the estimate from mismatched (prompt, completion) pairs, without gradient.
- Bradley–Terry reward-model loss: ``-logσ(r_w - r_l - m)`` with an optional margin m, plus TRL's
  optional centring term ``c · mean((r_w + r_l)²)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .rl_logprobs import shifted_logprobs

PAIRED_LOSSES = ("sigmoid", "ipo", "simpo")
LOSS_TYPES = PAIRED_LOSSES + ("kto",)
REFERENCE_FREE = ("simpo",)


def completion_logps(logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of log p(token) over completion tokens, completion token count) per row.

    logits: [B, K, V] for the last K positions of each row (K may be the full length);
    input_ids, completion_mask: [B, T]. Logits at position t predict token t+1."""
    k, width = logits.shape[1], input_ids.shape[1]
    first = width - k + 1  # the first token position the kept logits predict
    if first > 0 and completion_mask[:, :first].any():
        raise ValueError("completion tokens lie before the scored positions; keep more logits")
    targets, mask = input_ids[:, first:], completion_mask[:, first:]
    # the fused float32 log-probs of online RL (rl_logprobs): no full-vocabulary log-softmax
    logp, _ = shifted_logprobs(logits, targets, mask)
    mask = mask.to(logp.dtype)
    return logp.sum(-1), mask.sum(-1)


def sequence_logps(model, batch: dict, trunk=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Completion log-prob sums and lengths of every row of a left-padded batch
    ({"input_ids", "attention_mask", "completion_mask"}); only the tail that holds completions
    goes through the LM head.

    Always through the model's own forward: a boosted model's forward is what its plugin hooks
    (DDP arms its gradient all-reduce there), and the policy and the reference must take the same
    arithmetic so that their log-ratios are exactly zero at step 0. (A faster route that sent only
    the completion-predicting states through the head had to call the decoder directly, which
    skipped DDP's gradient averaging; it was removed.)

    A batch that carries "hidden" (the frozen lower blocks' cached output, see frozen_trunk.py)
    enters the same forward as `inputs_embeds` while `trunk` makes the lower blocks pass it through."""
    keep = int(batch["completion_width"]) + 1
    common = dict(attention_mask=batch["attention_mask"], position_ids=batch["position_ids"], logits_to_keep=keep,
                  use_cache=False)
    if "hidden" in batch:
        if trunk is None:
            raise ValueError("the batch carries cached trunk states ('hidden') but no FrozenTrunk was given to skip "
                             "the lower blocks with; pass the run's trunk")
        with trunk.skipping():
            out = model(inputs_embeds=trunk.as_input(batch["hidden"]), **common)
    else:
        out = model(input_ids=batch["input_ids"], **common)
    return completion_logps(out.logits, batch["input_ids"], batch["completion_mask"])


def dpo_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor | None,
               ref_rejected: torch.Tensor | None, *, beta: float, loss_type: str = "sigmoid",
               label_smoothing: float = 0.0, simpo_gamma: float = 0.5, chosen_len: torch.Tensor | None = None,
               rejected_len: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair loss, chosen reward, rejected reward) of a paired loss (see the module docstring).

    Log-probs are sums; IPO and SimPO need the completion lengths. The rewards are the implicit
    ones each method ranks by: β·log-ratio sums (DPO), per-token log-ratios (IPO), β·per-token
    policy log-probs (SimPO); they are detached."""
    if loss_type not in PAIRED_LOSSES:
        raise ValueError(f"loss_type={loss_type!r}: choose one of {', '.join(PAIRED_LOSSES)} (kto has kto_losses)")
    if loss_type in ("ipo", "simpo") and (chosen_len is None or rejected_len is None):
        raise ValueError(f"{loss_type} averages log-probs per token: pass chosen_len and rejected_len")
    if loss_type == "simpo":
        chosen = policy_chosen / chosen_len.clamp(min=1)
        rejected = policy_rejected / rejected_len.clamp(min=1)
        logits = beta * (chosen - rejected) - simpo_gamma
        losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
        return losses, (beta * chosen).detach(), (beta * rejected).detach()
    if ref_chosen is None or ref_rejected is None:
        raise ValueError(f"{loss_type} needs reference log-probs")
    chosen_ratio, rejected_ratio = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    if loss_type == "ipo":
        chosen_avg = chosen_ratio / chosen_len.clamp(min=1)
        rejected_avg = rejected_ratio / rejected_len.clamp(min=1)
        losses = (chosen_avg - rejected_avg - 1 / (2 * beta)) ** 2
        return losses, chosen_avg.detach(), rejected_avg.detach()
    logits = beta * (chosen_ratio - rejected_ratio)
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return losses, (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach()


def kto_kl_estimate(policy_kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """z: the batch mean of log π - log π_ref on mismatched pairs, at least 0, without gradient."""
    return (policy_kl_logps - ref_kl_logps).mean().clamp(min=0).detach()


def kto_losses(policy_logps: torch.Tensor, ref_logps: torch.Tensor, labels: torch.Tensor, kl: torch.Tensor, *,
               beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-example loss, implicit reward β·(log π - log π_ref)); labels: True for desirable."""
    ratio = policy_logps - ref_logps
    desirable = desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl)))
    undesirable = undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio)))
    return torch.where(labels.bool(), desirable, undesirable), (beta * ratio).detach()


def bradley_terry_losses(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
                         margin: torch.Tensor | float | None = None, center_coefficient: float = 0.0) -> torch.Tensor:
    """Per-pair reward-model loss -logσ(r_w - r_l - m) [+ c·(r_w + r_l)²]."""
    diff = chosen_rewards - rejected_rewards
    if margin is not None:
        diff = diff - margin
    losses = -F.logsigmoid(diff)
    if center_coefficient:
        losses = losses + center_coefficient * (chosen_rewards + rejected_rewards) ** 2
    return losses
