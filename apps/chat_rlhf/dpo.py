"""Preference optimisation: DPO (sigmoid), IPO, SimPO and KTO through `phalanx.train.fit`.

    python -m apps.chat_rlhf.dpo --config apps/chat_rlhf/configs/dpo.yaml
    python -m apps.chat_rlhf.dpo --config apps/chat_rlhf/configs/kto.yaml
    phalanx run -n 2 -m apps.chat_rlhf.dpo --config apps/chat_rlhf/configs/dpo.yaml train.plugin=zero2

The policy starts from `model` (the SFT output, or SmolLM2-135M-Instruct); the reference is
`reference` (default: the same weights). With `loss.reference: cached` the reference's log-probs of
every training and held-out completion are computed once, before training, split over the ranks,
and the reference model is freed; with `online` it stays in memory and scores each batch.
SimPO needs no reference at all.

Held-out metrics (every `train.eval_every` steps and at the end, in metrics.jsonl as eval/...):
preference accuracy (share of pairs whose implicit reward ranks chosen above rejected, ties count
half: at step 0 policy = reference and every reward is 0), mean reward margin and rewards.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from phalanx.config import ConfigError, load_config, parse_config_args
from phalanx.train.config import TrainConfig

from .data import PreferenceDataConfig, collate_completions, encode_completion, read_split
from .preference_losses import (LOSS_TYPES, REFERENCE_FREE, dpo_losses, kto_kl_estimate, kto_losses,
                                sequence_logps)


@dataclass
class LossConfig:
    type: Literal["sigmoid", "ipo", "simpo", "kto"] = "sigmoid"
    beta: float = 0.1                    # strength of the KL anchor (DPO/IPO/KTO) or reward scale (SimPO)
    label_smoothing: float = 0.0         # cDPO / SimPO: assumed share of flipped labels
    simpo_gamma: float = 0.5             # SimPO target reward margin
    desirable_weight: float = 1.0        # KTO lambda_D
    undesirable_weight: float = 1.0      # KTO lambda_U
    reference: Literal["cached", "online"] = "cached"  # reference log-probs once before training, or per batch

    def validate(self) -> None:
        if self.beta <= 0:
            raise ConfigError(f"loss.beta={self.beta}: must be positive")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"loss.label_smoothing={self.label_smoothing}: must be in [0, 0.5)")


@dataclass
class DPOConfig:
    model: str = ""                      # policy start: HF dir, checkpoint, output_dir, or "" for SmolLM2
    reference: str = ""                  # reference model (default: `model`)
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    eval_batch_size: int = 8             # held-out pairs per forward
    train_layers: int = 0                # train only the top N blocks (+ final norm); 0: the whole model
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> None:
        if self.loss.type not in LOSS_TYPES:
            raise ConfigError(f"loss.type={self.loss.type!r}: choose one of {', '.join(LOSS_TYPES)}")
        if self.train.output_dir == TrainConfig.output_dir:
            self.train.output_dir = f"runs/chat_rlhf/{self.loss.type if self.loss.type != 'sigmoid' else 'dpo'}"


def load_dpo_config(path, overrides=None) -> DPOConfig:
    return load_config(DPOConfig, path, overrides)


# --- data: each example is a few (prompt ids, completion ids) rows scored together -------------

def build_examples(records: list[dict], tokenizer, cfg: DPOConfig) -> list[dict]:
    """Pairs: rows [chosen, rejected]. KTO: rows [completion, a mismatched completion (the next
    record's), for the KL estimate], plus the label."""
    d = cfg.data

    def enc(prompt, completion):
        return encode_completion(tokenizer, prompt, completion, d.max_prompt_tokens, d.max_completion_tokens)

    if cfg.loss.type == "kto":
        return [{"rows": [enc(r["prompt"], r["completion"]),
                          enc(r["prompt"], records[(i + 1) % len(records)]["completion"])],
                 "label": r["label"]} for i, r in enumerate(records)]
    return [{"rows": [enc(r["prompt"], r["chosen"]), enc(r["prompt"], r["rejected"])]} for r in records]


def collate_examples(examples: list[dict], pad_id: int) -> dict:
    """Rows slot-major ([all chosen, all rejected]) in one left-padded batch."""
    slots = len(examples[0]["rows"])
    batch = collate_completions([e["rows"][s] for s in range(slots) for e in examples], pad_id)
    batch["slots"] = torch.tensor(slots)
    if "ref" in examples[0]:
        batch["ref_logps"] = torch.tensor([e["ref"][s] for s in range(slots) for e in examples], dtype=torch.float32)
    if "label" in examples[0]:
        batch["label"] = torch.tensor([e["label"] for e in examples])
    return batch


@torch.no_grad()
def score_rows(model, examples: list[dict], pad_id: int, batch_size: int) -> list[list[float]]:
    """Each example's completion log-prob sums under `model` (eval mode, no gradient)."""
    was_training = model.training
    model.eval()
    out = []
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        logps, _ = sequence_logps(model, collate_examples([{"rows": e["rows"]} for e in chunk], pad_id))
        out.extend(logps.view(len(chunk[0]["rows"]), len(chunk)).t().tolist())
    model.train(was_training)
    return out


def attach_reference(model, examples: list[dict], pad_id: int, batch_size: int) -> None:
    """examples[i]["ref"] = reference log-probs, computed once; ranks split the work."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = score_rows(model, examples[rank::world], pad_id, batch_size)
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    for r, part in enumerate(gathered):
        for j, ref in enumerate(part):
            examples[r + j * world]["ref"] = ref


# --- loss and held-out metrics ------------------------------------------------------------------

def preference_loss(cfg: LossConfig, logps: torch.Tensor, lens: torch.Tensor, ref: torch.Tensor | None,
                    label: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-example losses, reward of slot 0, reward of slot 1) from slot-major log-probs."""
    logps, lens = logps.view(2, -1), lens.view(2, -1)
    ref = ref.view(2, -1) if ref is not None else (None, None)
    if cfg.type == "kto":
        kl = kto_kl_estimate(logps[1].detach(), ref[1])
        if dist.is_initialized() and dist.get_world_size() > 1:  # the same z on every rank, as one batch would give
            dist.all_reduce(kl)
            kl = kl / dist.get_world_size()
        losses, rewards = kto_losses(logps[0], ref[0], label, kl, beta=cfg.beta,
                                     desirable_weight=cfg.desirable_weight, undesirable_weight=cfg.undesirable_weight)
        return losses, rewards, torch.zeros_like(rewards)
    return dpo_losses(logps[0], logps[1], ref[0], ref[1], beta=cfg.beta, loss_type=cfg.type,
                      label_smoothing=cfg.label_smoothing, simpo_gamma=cfg.simpo_gamma,
                      chosen_len=lens[0], rejected_len=lens[1])


def make_loss_fn(cfg: LossConfig, reference=None):
    def loss_fn(model, batch):
        logps, lens = sequence_logps(model, batch)
        ref = batch.get("ref_logps")
        if reference is not None:
            with torch.no_grad():
                ref, _ = sequence_logps(reference, batch)
        losses, _, _ = preference_loss(cfg, logps, lens, ref, batch.get("label"))
        return losses.mean()
    return loss_fn


def heldout_metrics(cfg: LossConfig, policy_logps: list[list[float]], examples: list[dict],
                    lens: list[list[int]]) -> dict[str, float]:
    """Held-out preference accuracy (ties half), reward margin and rewards, from log-prob lists."""
    logps = torch.tensor(policy_logps, dtype=torch.float64).t().reshape(-1)
    ref = torch.tensor([e["ref"] for e in examples], dtype=torch.float64).t().reshape(-1) \
        if cfg.type not in REFERENCE_FREE else None
    length = torch.tensor(lens, dtype=torch.float64).t().reshape(-1)
    label = torch.tensor([e["label"] for e in examples]) if cfg.type == "kto" else None
    losses, r0, r1 = preference_loss(cfg, logps, length, ref, label)
    out = {"loss": losses.mean().item()}
    if cfg.type == "kto":
        sign = torch.where(label, 1.0, -1.0).double()
        out["accuracy"] = ((sign * r0 > 0).double() + 0.5 * (r0 == 0).double()).mean().item()
        out["reward_desirable"] = r0[label].mean().item() if label.any() else float("nan")
        out["reward_undesirable"] = r0[~label].mean().item() if (~label).any() else float("nan")
        return out
    out["accuracy"] = ((r0 > r1).double() + 0.5 * (r0 == r1).double()).mean().item()
    out["margin"] = (r0 - r1).mean().item()
    out["chosen_reward"], out["rejected_reward"] = r0.mean().item(), r1.mean().item()
    return out


def make_eval_fn(cfg: LossConfig, heldout: list[dict], pad_id: int, batch_size: int):
    lens = [[len(c) for _, c in e["rows"]] for e in heldout]

    def eval_fn(model, step):
        return heldout_metrics(cfg, score_rows(model, heldout, pad_id, batch_size), heldout, lens)
    return eval_fn


def base_preference_accuracy(examples: list[dict]) -> float:
    """How often the reference itself gives the chosen completion a higher per-token log-prob
    (its own preference before any training; a baseline, not the implicit reward)."""
    wins = [(e["ref"][0] / max(len(e["rows"][0][1]), 1)) > (e["ref"][1] / max(len(e["rows"][1][1]), 1))
            for e in examples]
    return sum(wins) / len(wins)


# --- the command -------------------------------------------------------------------------------------

def train_preference(cfg: DPOConfig, log=print):
    """Run one preference-optimisation training; returns (TrainResult, before metrics)."""
    from phalanx.train import fit

    from .models import load_policy, load_tokenizer, resolve_model_dir, train_top_layers

    cfg.data.validate()
    cfg.loss.validate()
    # bad records stop here, before any model loads
    train_records, held_records = read_split(cfg.data, "kto" if cfg.loss.type == "kto" else "preference")
    policy_dir = resolve_model_dir(cfg.model)
    ref_dir = resolve_model_dir(cfg.reference) if cfg.reference else policy_dir
    tokenizer = load_tokenizer(policy_dir)
    pad = tokenizer.pad_token_id
    train_ex = build_examples(train_records, tokenizer, cfg)
    held_ex = build_examples(held_records, tokenizer, cfg)
    log(f"{cfg.loss.type}: {len(train_ex)} training and {len(held_ex)} held-out examples from {cfg.data.path}")

    policy = load_policy(policy_dir)
    reference = None
    if cfg.loss.type not in REFERENCE_FREE:
        reference = policy if ref_dir == policy_dir else load_policy(ref_dir)
        # held-out reference log-probs are always cached: evaluation reuses them every time
        attach_reference(reference, held_ex, pad, cfg.eval_batch_size)
        if cfg.loss.reference == "cached":
            attach_reference(reference, train_ex, pad, cfg.eval_batch_size)
            reference = None
        elif reference is policy:
            reference = load_policy(ref_dir)  # a frozen copy: the policy is about to change
        if reference is not None:
            reference.eval().requires_grad_(False)
    eval_fn = make_eval_fn(cfg.loss, held_ex, pad, cfg.eval_batch_size)
    before = {}
    if cfg.loss.type not in REFERENCE_FREE:
        before["base_logp_preference"] = base_preference_accuracy(held_ex) if cfg.loss.type != "kto" else None
        if ref_dir == policy_dir:  # policy = reference: no forward needed
            lens = [[len(c) for _, c in e["rows"]] for e in held_ex]
            before.update(heldout_metrics(cfg.loss, [e["ref"] for e in held_ex], held_ex, lens))
    if "accuracy" not in before:
        before.update(eval_fn(policy, 0))
    log(f"held-out before training: " + ", ".join(f"{k}={v:.4g}" for k, v in before.items() if v is not None))
    train_top_layers(policy, cfg.train_layers)
    result = fit(cfg.train, policy, train_ex, collate_fn=lambda ex: collate_examples(ex, pad),
                 loss_fn=make_loss_fn(cfg.loss, reference), eval_fn=eval_fn, tokenizer=tokenizer)
    return result, before


def main(argv: list[str] | None = None) -> None:
    from phalanx.launch import launched

    cfg, _ = parse_config_args("Preference optimisation (DPO / IPO / SimPO / KTO).", load_dpo_config, argv,
                               example="apps/chat_rlhf/configs/dpo.yaml")
    with launched(seed=cfg.train.seed) as ctx:
        log = print if ctx.is_main else (lambda *a, **k: None)
        result, before = train_preference(cfg, log)
        after = result.last_eval
        log(f"held-out preference accuracy: {before.get('accuracy', float('nan')):.3f} before -> "
            f"{after.get('accuracy', float('nan')):.3f} after {result.final_step} steps "
            f"(reward margin {after.get('margin', float('nan')):.3g}); checkpoint {result.checkpoint_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
