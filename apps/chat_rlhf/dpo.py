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
from phalanx.device import run_device, to_device
from phalanx.train.config import TrainConfig

from .adapters import DisabledAdapter, LoRASettings, bind_reference, lora_hooks, prepare
from .data import PreferenceDataConfig, collate_completions, encode_completion, read_split
from .frozen_trunk import FrozenTrunk, pad_rows, split_rows, trunk_for
from .stats import wilson_interval
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
    cache_frozen_trunk: bool = True      # with train_layers: compute the frozen blocks once, run only the top N per step
    lora: LoRASettings = field(default_factory=LoRASettings)  # adapters only; reference = adapter off (adapters.py)
    activation_checkpointing: bool = False  # recompute each decoder layer in backward (any plugin)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> None:
        self.lora.validate(self.train_layers)
        if self.lora.enabled and self.reference:
            raise ConfigError(f"reference={self.reference!r} with lora.enabled: a LoRA run's reference is its own base "
                              "(the adapter switched off); leave reference empty or train without LoRA")
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
    if "hidden" in examples[0]:  # the frozen trunk's cached output (frozen_trunk.py)
        batch["hidden"] = pad_rows([e["hidden"][s] for s in range(slots) for e in examples], batch["input_ids"].shape[1])
    if "ref" in examples[0]:
        batch["ref_logps"] = torch.tensor([e["ref"][s] for s in range(slots) for e in examples], dtype=torch.float32)
    if "label" in examples[0]:
        batch["label"] = torch.tensor([e["label"] for e in examples])
    return batch


@torch.no_grad()
def score_rows(model, examples: list[dict], pad_id: int, batch_size: int, trunk: FrozenTrunk | None = None,
               capture: bool = False) -> list[list[float]]:
    """Each example's completion log-prob sums under `model` (eval mode, no gradient).

    With `trunk`: examples that carry cached trunk states ("hidden") skip the frozen blocks;
    `capture=True` runs the full forward and stores each example's trunk states instead."""
    was_training = model.training
    model.eval()
    out = []
    keys = ("rows",) if capture or trunk is None else ("rows", "hidden")
    device = next(model.parameters()).device  # score where the model lives (the run's device)
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        batch = to_device(collate_examples([{k: e[k] for k in keys if k in e} for e in chunk], pad_id), device)
        slots = len(chunk[0]["rows"])
        if capture:
            sink: list[torch.Tensor] = []
            with trunk.capturing(sink):
                logps, _ = sequence_logps(model, batch)
            rows = split_rows(sink[-1], batch["attention_mask"])
            for j, e in enumerate(chunk):
                e["hidden"] = [rows[s * len(chunk) + j].cpu() for s in range(slots)]
        else:
            logps, _ = sequence_logps(model, batch, trunk)
        out.extend(logps.view(slots, len(chunk)).t().tolist())
    model.train(was_training)
    return out


def attach_reference(model, examples: list[dict], pad_id: int, batch_size: int, trunk: FrozenTrunk | None = None,
                     store_ref: bool = True) -> None:
    """examples[i]["ref"] = reference log-probs, computed once; ranks split the work. With `trunk`
    (whose model is `model`) the same pass also stores every example's frozen-trunk states
    ("hidden"), gathered so that every rank holds all of them; `store_ref=False` keeps only those."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    share = examples[rank::world]
    mine = score_rows(model, share, pad_id, batch_size, trunk, capture=trunk is not None)
    payload = (mine, [e["hidden"] for e in share] if trunk is not None else None)
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, payload)
    else:
        gathered = [payload]
    for r, (refs, hidden) in enumerate(gathered):
        for j, ref in enumerate(refs):
            if store_ref:
                examples[r + j * world]["ref"] = ref
            if hidden is not None:
                examples[r + j * world]["hidden"] = hidden[j]


# --- loss and held-out metrics ------------------------------------------------------------------

def preference_loss(cfg: LossConfig, logps: torch.Tensor, lens: torch.Tensor, ref: torch.Tensor | None,
                    label: torch.Tensor | None, *, across_ranks: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-example losses, reward of slot 0, reward of slot 1) from slot-major log-probs.

    `across_ranks`: KTO's KL estimate is averaged over the ranks (each holds a share of the global
    batch); False when every rank holds the whole set (the held-out metrics, computed on the host)."""
    logps, lens = logps.view(2, -1), lens.view(2, -1)
    ref = ref.view(2, -1) if ref is not None else (None, None)
    if cfg.type == "kto":
        kl = kto_kl_estimate(logps[1].detach(), ref[1])
        # the same z on every rank, as one batch would give
        if across_ranks and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(kl)
            kl = kl / dist.get_world_size()
        losses, rewards = kto_losses(logps[0], ref[0], label, kl, beta=cfg.beta,
                                     desirable_weight=cfg.desirable_weight, undesirable_weight=cfg.undesirable_weight)
        return losses, rewards, torch.zeros_like(rewards)
    return dpo_losses(logps[0], logps[1], ref[0], ref[1], beta=cfg.beta, loss_type=cfg.type,
                      label_smoothing=cfg.label_smoothing, simpo_gamma=cfg.simpo_gamma,
                      chosen_len=lens[0], rejected_len=lens[1])


def make_loss_fn(cfg: LossConfig, reference=None, trunk: FrozenTrunk | None = None):
    def loss_fn(model, batch):
        logps, lens = sequence_logps(model, batch, trunk)
        ref = batch.get("ref_logps")
        bind_reference(reference, model)  # a LoRA run's reference: this very model with the adapter off
        if reference is not None:
            with torch.no_grad():
                ref, _ = sequence_logps(reference, {k: v for k, v in batch.items() if k != "hidden"})
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
    # every rank holds all held-out log-probs: no averaging over ranks (it was a mean of equal values)
    losses, r0, r1 = preference_loss(cfg, logps, length, ref, label, across_ranks=False)
    out = {"loss": losses.mean().item()}
    if cfg.type == "kto":
        sign = torch.where(label, 1.0, -1.0).double()
        out["accuracy"] = ((sign * r0 > 0).double() + 0.5 * (r0 == 0).double()).mean().item()
        out["reward_desirable"] = r0[label].mean().item() if label.any() else float("nan")
        out["reward_undesirable"] = r0[~label].mean().item() if (~label).any() else float("nan")
        return out
    out["accuracy"] = ((r0 > r1).double() + 0.5 * (r0 == r1).double()).mean().item()
    out["pairs"] = float(len(r0))
    out["margin"] = (r0 - r1).mean().item()
    out["chosen_reward"], out["rejected_reward"] = r0.mean().item(), r1.mean().item()
    return out


def make_eval_fn(cfg: LossConfig, heldout: list[dict], pad_id: int, batch_size: int, trunk: FrozenTrunk | None = None):
    lens = [[len(c) for _, c in e["rows"]] for e in heldout]

    def eval_fn(model, step):
        return heldout_metrics(cfg, score_rows(model, heldout, pad_id, batch_size, trunk), heldout, lens)
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

    policy = load_policy(policy_dir).to(run_device())  # reference and before-training passes run there too
    trunk = trunk_for(policy, cfg.train_layers, cfg.cache_frozen_trunk)
    reference = None
    need_states = [held_ex, train_ex] if trunk is not None else []  # examples still without trunk states
    if cfg.loss.type not in REFERENCE_FREE:
        reference = policy if ref_dir == policy_dir else load_policy(ref_dir).to(run_device())
        # the frozen-trunk states ride along the reference pass when the reference is the policy itself
        capture = trunk if reference is policy else None
        # held-out reference log-probs are always cached: evaluation reuses them every time
        attach_reference(reference, held_ex, pad, cfg.eval_batch_size, capture)
        if cfg.loss.reference == "cached":
            attach_reference(reference, train_ex, pad, cfg.eval_batch_size, capture)
            reference = None
        elif reference is policy and cfg.lora.enabled:
            reference = "adapter off"  # set below, once the adapters exist: the base itself, no copy
        elif reference is policy:
            reference = load_policy(ref_dir).to(run_device())  # a frozen copy: the policy is about to change
        if capture is not None:
            need_states = [ex for ex in need_states if ex is train_ex and cfg.loss.reference != "cached"]
        if isinstance(reference, torch.nn.Module):
            reference.eval().requires_grad_(False)
    for examples in need_states:  # one extra no-grad pass over the policy
        attach_reference(policy, examples, pad, cfg.eval_batch_size, trunk, store_ref=False)
    if trunk is not None:
        log(f"frozen trunk cached: blocks 0-{trunk.split - 1} computed once, {cfg.train_layers} top blocks per step")
    eval_fn = make_eval_fn(cfg.loss, held_ex, pad, cfg.eval_batch_size, trunk)
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
    policy = prepare(policy, cfg.lora, cfg.activation_checkpointing, cfg.train.seed)
    if reference == "adapter off":
        reference = DisabledAdapter(policy)
    result = fit(cfg.train, policy, train_ex, collate_fn=lambda ex: collate_examples(ex, pad),
                 loss_fn=make_loss_fn(cfg.loss, reference, trunk), eval_fn=eval_fn, tokenizer=tokenizer,
                 hooks=lora_hooks(cfg.lora, tokenizer))
    return result, before


def main(argv: list[str] | None = None) -> None:
    from phalanx.launch import launched

    cfg, _ = parse_config_args("Preference optimisation (DPO / IPO / SimPO / KTO).", load_dpo_config, argv,
                               example="apps/chat_rlhf/configs/dpo.yaml")
    with launched(seed=cfg.train.seed) as ctx:
        log = print if ctx.is_main else (lambda *a, **k: None)
        result, before = train_preference(cfg, log)
        after = result.last_eval
        n = after.get("pairs", 0.0)
        lo, hi = wilson_interval(after.get("accuracy", 0.0) * n, n)
        log(f"held-out preference accuracy: {before.get('accuracy', float('nan')):.3f} before -> "
            f"{after.get('accuracy', float('nan')):.3f} (95% Wilson interval {lo:.3f}-{hi:.3f}, {int(n)} pairs) "
            f"after {result.final_step} steps "
            f"(reward margin {after.get('margin', float('nan')):.3g}); checkpoint {result.checkpoint_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
