"""PPO, the InstructGPT stage 3: actor, critic (value head), frozen reference, reward model.

    python -m apps.chat_rlhf.ppo --config apps/chat_rlhf/configs/ppo.yaml ppo.rewards=[rm:runs/chat_rlhf/rm]

PPO as InstructGPT / ColossalChat run it, inside the one training loop (`phalanx.train.fit`):

- **Rollout** (once every K = ppo_epochs x num_mini_batches optimizer steps, on the step whose
  buffer is empty): the actor samples on its colocated engine for the step's prompts (fit's
  micro-batch: `train.micro_batch_size` prompts x `ppo.num_generations` samples per rank); the
  reward model (or any reward of `rewards.py`) scores each completion; one no-grad pass of the
  trainer gives the critic's values (and the log-probs the stale-weight guard compares with the
  engine's), one of the frozen reference its log-probs; the per-token reward is
  -kl_coef * (logp - ref_logp) plus the score on the last token; GAE gives advantages (whitened
  over the whole rollout of every rank) and returns; the adaptive KL controller takes the
  rollout's KL. All of it lands in a `RolloutBuffer`.
- **Update** (every step): step k of a cycle takes mini-batch k mod num_mini_batches of epoch
  k // num_mini_batches, in an order shuffled per epoch by a generator seeded from (seed,
  rollout step, epoch), the same on every rank; loss = clipped policy loss against the trainer's
  rollout-time log-probs + vf_coef * the value loss clipped around the rollout-time values, both
  token means over the mini-batch of all ranks.

fit's sampler still hands a batch of prompt indices every step; only the batch of a rollout step
is sampled (the other K - 1 are not used, so one pass of fit's sampler uses 1/K of the prompts,
re-shuffled every pass). The engine gets the actor's weights when the buffer is exhausted (before
the next rollout) and before a held-out evaluation, not after every step: nothing reads the engine
in between, and a sync gathers the full weights. Checkpoints carry the step, the KL controller,
the guard and, mid-cycle, each rank's buffer (safetensors), so a resumed run continues exactly.
"""
from __future__ import annotations

import copy
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.config import ConfigError, load_config, parse_config_args
from phalanx.train import TrainConfig, fit

from . import rl_losses as L
from .grpo import (DataSettings, EngineSettings, GRPOLoss, GRPOSettings, PromptIndices, RLHook, encode_prompts,
                   global_sum, heldout_eval, load_prompt_sets, plot_rl_curves, sample_seed)
from .rewards import RewardSet
from .rollout import RolloutEngine, completion_batch, completion_logprobs, padded


@dataclass
class PPOSettings:
    num_generations: int = 1
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    rewards: list[str] = field(default_factory=lambda: ["numeric"])
    reward_weights: list[float] = field(default_factory=list)
    kl_coef: float = 0.05             # initial per-token KL penalty
    kl_target: float | None = 6.0     # adaptive controller target (None: fixed)
    kl_horizon: int = 10000
    gamma: float = 1.0
    lam: float = 0.95
    clip: float = 0.2                 # policy ratio clip
    value_clip: float | None = 0.2    # value clip around the rollout's values (None: off)
    vf_coef: float = 0.1
    whiten_advantages: bool = True    # over the whole rollout (all ranks), once, at rollout time
    ppo_epochs: int = 2               # passes over each rollout
    num_mini_batches: int = 2         # optimizer steps per pass (each rank's rollout split evenly)
    max_logprob_gap: float = 0.5
    gap_jump: float = 20.0

    @property
    def steps_per_rollout(self) -> int:
        return self.ppo_epochs * self.num_mini_batches

    def validate(self) -> None:
        if self.num_generations < 1 or self.max_new_tokens < 1:
            raise ConfigError("ppo config: num_generations and max_new_tokens must be at least 1")
        if not 0 <= self.lam <= 1 or not 0 <= self.gamma <= 1:
            raise ConfigError(f"ppo config: gamma={self.gamma} and lam={self.lam} must be in [0, 1]")
        if self.vf_coef < 0 or self.kl_coef < 0:
            raise ConfigError("ppo config: vf_coef and kl_coef must be >= 0")
        if self.ppo_epochs < 1 or self.num_mini_batches < 1:
            raise ConfigError(f"ppo config: ppo_epochs={self.ppo_epochs} and num_mini_batches="
                              f"{self.num_mini_batches} must be at least 1")


@dataclass
class PPOConfig:
    model: str = ""                   # actor (and reference): "" SmolLM2-135M-Instruct, an HF dir or a checkpoint
    critic: str = ""                  # critic backbone: "" the actor's
    data: DataSettings = field(default_factory=lambda: DataSettings(source="arithmetic"))
    ppo: PPOSettings = field(default_factory=PPOSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    eval_before: bool = False         # score the held-out prompts once before training (a fresh run only)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(output_dir="runs/chat_rlhf/ppo", lr=1e-6,
                                                                    micro_batch_size=8, precision="auto"))


def load_ppo_config(path: str | None, overrides: list[str] | None = None) -> PPOConfig:
    cfg = load_config(PPOConfig, path, overrides)
    cfg.ppo.validate()
    cfg.train.validate()
    check_rollout_split(cfg)
    return cfg


def check_rollout_split(cfg: PPOConfig) -> None:
    """A rollout must split into equal mini-batches, one optimizer step each (the same on every rank)."""
    s, t = cfg.ppo, cfg.train
    size = t.micro_batch_size * s.num_generations
    if size % s.num_mini_batches:
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        raise ConfigError(f"ppo.num_mini_batches={s.num_mini_batches} does not divide the rollout of "
                          f"train.micro_batch_size x ppo.num_generations = {t.micro_batch_size} x "
                          f"{s.num_generations} = {size} sequences per rank: choose one of {divisors}, or change "
                          "train.micro_batch_size (prompts per rollout per rank)")
    if t.grad_accum_steps != 1:
        raise ConfigError(f"train.grad_accum_steps={t.grad_accum_steps}: a PPO optimizer step is one mini-batch of "
                          "the rollout; set grad_accum_steps=1 and size the step with ppo.num_mini_batches")


class ActorCritic(nn.Module):
    """The actor (a causal LM) and the critic (a backbone + scalar value head) as one trainable module."""

    def __init__(self, actor: nn.Module, critic_backbone: nn.Module) -> None:
        super().__init__()
        self.actor, self.critic = actor, critic_backbone
        self.value_head = nn.Linear(critic_backbone.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        self.config = actor.config  # step-FLOP estimate and the engine read the actor's

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep: int):
        logits = self.actor(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            logits_to_keep=logits_to_keep, use_cache=False).logits
        hidden = self.critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=False).last_hidden_state[:, -logits_to_keep:]
        return logits, self.value_head(hidden).squeeze(-1)


def actor_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The actor's tensors under HF names, from any wrapper (DDP `module.`, FSDP, compile)."""
    out = {}
    for name, tensor in model.state_dict().items():
        parts = name.split(".")
        if "actor" in parts:
            out[".".join(parts[parts.index("actor") + 1:])] = tensor
    return out


# -- the rollout buffer ------------------------------------------------------------------------------
TOKEN_KEYS = ("input_ids", "attention_mask", "position_ids", "completion_mask")
PER_TOKEN_KEYS = ("old_logp", "old_values", "advantages", "returns")


@dataclass
class RolloutBuffer:
    """This rank's rollout, with everything PPO's mini-batch epochs reuse, computed once at rollout
    time: the token batch ([B, P+T] prompts left-padded, completions right-padded, `completion_mask`
    [B, T]) and per-token [B, T] old_logp (the trainer's, from the weights that sampled), old_values
    (the critic's), advantages (GAE, whitened) and returns. `step`: the optimizer step that made it.

    old_logp is the trainer's forward, not the engine's log-probs: the two agree to the guard's gap
    in fp32, but under bf16 training the trainer rounds differently from the fp32 engine, and the
    ratio of the first mini-batch must be 1 for the clip to measure the policy's change only."""

    step: int
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    completion_mask: torch.Tensor
    old_logp: torch.Tensor
    old_values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows `index`, without the columns that are padding in all of them."""
        return trim_columns({k: getattr(self, k)[index] for k in TOKEN_KEYS + PER_TOKEN_KEYS})

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file
        save_file({k: getattr(self, k).contiguous().cpu() for k in TOKEN_KEYS + PER_TOKEN_KEYS}, str(path),
                  metadata={"step": str(self.step)})

    @classmethod
    def load(cls, path: Path, device: torch.device | str = "cpu") -> "RolloutBuffer":
        from safetensors import safe_open
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            step = int(f.metadata()["step"])
            tensors = {k: f.get_tensor(k) for k in TOKEN_KEYS + PER_TOKEN_KEYS}
        return cls(step=step, **tensors)


def trim_columns(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the leading prompt columns and trailing completion columns that no row uses (a
    mini-batch of short sequences should not pay for the rollout's longest one)."""
    T = batch["completion_mask"].shape[1]
    P = batch["input_ids"].shape[1] - T
    keep_t = max(int(batch["completion_mask"].sum(1).max()), 1)
    start = P - int(batch["attention_mask"][:, :P].sum(1).max())
    out = {}
    for k, v in batch.items():
        out[k] = v[:, start:P + keep_t] if k in ("input_ids", "attention_mask", "position_ids") else v[:, :keep_t]
    return out


def mini_batch_order(seed: int, rollout_step: int, epoch: int, size: int, num_mini_batches: int
                     ) -> list[torch.Tensor]:
    """Row indices of each mini-batch of one epoch: a permutation of the rollout's rows from a
    generator seeded by (seed, rollout step, epoch), so every rank and a resumed run agree."""
    digest = hashlib.sha256(f"ppo-mini-batches/{seed}/{rollout_step}/{epoch}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:7], "little"))
    return list(torch.randperm(size, generator=g).chunk(num_mini_batches))


def whiten_over_ranks(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """`rl_losses.whiten` with the mean and (unbiased) variance of the masked entries of every
    rank's rollout, so the advantages are normalised over the whole rollout, not per shard."""
    m = mask.to(x.dtype)
    count, total = global_sum([float(m.sum()), float((x * m).sum())])
    mean = total / max(count, 1.0)
    (sq,) = global_sum([float((((x - mean) * m) ** 2).sum())])
    var = sq / max(count - 1.0, 1.0)
    return (x - mean) * (var + eps) ** -0.5 * m


def actor_critic_outputs(model: nn.Module, batch: dict[str, torch.Tensor]
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probs, values, entropy) [B, T] of the completion tokens: values are the critic's
    estimates at the state before each token; everything masked to the completion."""
    mask = batch["completion_mask"].float()
    T = mask.shape[1]
    logits, values = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"], T + 1)
    logp_all = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    logp = logp_all.gather(-1, batch["input_ids"][:, -T:].unsqueeze(-1)).squeeze(-1) * mask
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
    return logp, values[:, :-1].float() * mask, entropy


# -- the loss --------------------------------------------------------------------------------------
ROLLOUT_SUMS = ("samples", "reward_sum", "reward_sq_sum", "completion_tokens", "truncated", "kl_sum",
                "rollout_tokens", "gap_sum", "generate_s", "score_s", "prepare_s")
STEP_SUMS = ("tokens", "clipped_low", "clipped_high", "value_clipped", "approx_kl_sum", "ratio_dev_sum",
             "entropy_sum", "policy_loss_sum", "value_loss_sum")


class PPOLoss(GRPOLoss):
    """fit's loss_fn for PPO: a rollout into the buffer when it is empty, then one mini-batch of it
    per optimizer step (shares rollout, scoring and the stale-weight guard with GRPO)."""

    def __init__(self, settings: PPOSettings, records, prompt_ids, rewards: RewardSet, rollout_fn, pad_id: int, *,
                 reference: nn.Module, seed: int = 0) -> None:
        super().__init__(_as_grpo_view(settings), records, prompt_ids, rewards, rollout_fn, pad_id,
                         reference=reference, seed=seed)
        self.s = settings
        self.kl = L.AdaptiveKLController(settings.kl_coef, settings.kl_target, settings.kl_horizon)
        self.buffer: RolloutBuffer | None = None
        self.rollouts = 0                          # rollouts generated by this process (tests count them)
        self.rollout_sums: dict[str, float] = {}   # the rollout of this step, if it made one
        self.step_sums: dict[str, float] = dict.fromkeys(STEP_SUMS, 0.0)
        self.kl_coef_used = self.kl.value

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, mini-batch) of optimizer step `step` (1-based) within its rollout's cycle."""
        return divmod((step - 1) % self.s.steps_per_rollout, self.s.num_mini_batches)

    def __call__(self, model: nn.Module, batch: dict) -> torch.Tensor:
        if self.stats.started is None:
            self.stats.started = time.perf_counter()
        step = self.step + 1
        epoch, slot = self.position(step)
        if epoch == 0 and slot == 0:
            self.buffer = self.make_rollout(model, batch)
        elif self.buffer is None or self.buffer.step != step - (step - 1) % self.s.steps_per_rollout:
            raise RuntimeError(f"step {step} is mini-batch {slot} of epoch {epoch} of a rollout, but the rollout "
                               "buffer of that cycle is missing (a checkpoint without it?)")
        order = mini_batch_order(self.seed, self.buffer.step, epoch, len(self.buffer), self.s.num_mini_batches)
        return self.mini_batch_loss(model, self.buffer.rows(order[slot].to(self.buffer.input_ids.device)))

    @torch.no_grad()
    def make_rollout(self, model: nn.Module, batch: dict) -> RolloutBuffer:
        s = self.s
        indices, step, rollout, scores, t0 = self.rollout_and_score(batch)
        score_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        dev = next(model.parameters()).device
        tb = {k: v.to(dev) for k, v in completion_batch(rollout.prompt_ids, rollout.completion_ids,
                                                       self.pad_id).items()}
        mask = tb["completion_mask"].float()
        B, T = mask.shape
        # The trainer's log-probs (for the guard) and the critic's values, in mini-batch-sized chunks.
        logp, values = torch.zeros(B, T, device=dev), torch.zeros(B, T, device=dev)
        for rows in torch.arange(B, device=dev).chunk(s.num_mini_batches):
            part = trim_columns({k: v[rows] for k, v in tb.items()})
            lp, v, _ = actor_critic_outputs(model, part)
            width = lp.shape[1]
            logp[rows, :width], values[rows, :width] = lp, v
        engine_lp = padded(rollout.engine_logprobs, T).to(dev) * mask
        local_gap = float(((logp - engine_lp).abs() * mask).sum())
        tokens, gap_sum = global_sum([float(mask.sum()), local_gap])
        self.guard.check(gap_sum / max(tokens, 1.0), step)

        ref_lp, _ = completion_logprobs(self.reference, tb)
        kl = (engine_lp - ref_lp) * mask  # per-token KL sample of the sampling policy against the reference
        self.kl_coef_used = self.kl.value
        rewards = -self.kl.value * kl
        last = (mask.sum(1).long() - 1).clamp(min=0)
        rewards[torch.arange(B, device=dev), last] += scores.to(dev)
        adv, returns = L.gae(rewards, values, mask, gamma=s.gamma, lam=s.lam)
        if s.whiten_advantages:
            adv = whiten_over_ranks(adv, mask)
        (kl_total,) = global_sum([float(kl.sum())])
        self.kl.update(kl_total / max(tokens, 1.0), 1)  # once per rollout, with the rollout's mean KL
        lengths = torch.tensor([len(c) for c in rollout.completion_ids])
        self.rollouts += 1
        self.rollout_sums = {
            "samples": len(scores), "reward_sum": float(scores.sum()), "reward_sq_sum": float((scores ** 2).sum()),
            "completion_tokens": float(lengths.sum()), "truncated": float(sum(rollout.truncated)),
            "kl_sum": float(kl.sum()), "rollout_tokens": float(mask.sum()), "gap_sum": local_gap,
            "generate_s": rollout.generate_s, "score_s": score_s, "prepare_s": time.perf_counter() - t1}
        return RolloutBuffer(step=step, **{k: tb[k] for k in TOKEN_KEYS}, old_logp=logp, old_values=values,
                             advantages=adv, returns=returns)

    def mini_batch_loss(self, model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        s = self.s
        mask = mb["completion_mask"].float()
        logp, values, entropy = actor_critic_outputs(model, mb)
        local = float(mask.sum())
        (tokens,) = global_sum([local])
        tokens = max(tokens, 1.0)
        pg, clip = L.policy_loss(logp, mb["old_logp"], mb["advantages"], mask, clip_low=s.clip, clip_high=s.clip,
                                 token_total=tokens)
        vf_local, value_clip_frac = L.value_loss(values, mb["old_values"], mb["returns"], mask, clip=s.value_clip)
        vf = vf_local * (local / tokens)  # a token mean over every rank's mini-batch, like the policy loss
        with torch.no_grad():
            ratio = torch.exp(logp - mb["old_logp"])
            sums = {"tokens": local, "clipped_low": float(clip["clipped_low"]), "clipped_high": float(clip["clipped_high"]),
                    "value_clipped": float(value_clip_frac) * local,
                    "approx_kl_sum": float((L.k3_kl(mb["old_logp"], logp) * mask).sum()),
                    "ratio_dev_sum": float(((ratio - 1).abs() * mask).sum()), "entropy_sum": float(entropy.sum()),
                    "policy_loss_sum": float(pg) * tokens, "value_loss_sum": float(vf) * tokens}
        for k, v in sums.items():
            self.step_sums[k] += v
        # fit averages gradients over data-parallel ranks; both terms are global means, so scale back up.
        world = dist.get_world_size() if dist.is_initialized() else 1
        return (pg + s.vf_coef * vf) * world


def _as_grpo_view(s: PPOSettings) -> GRPOSettings:
    return GRPOSettings(num_generations=s.num_generations, max_new_tokens=s.max_new_tokens,
                        max_logprob_gap=s.max_logprob_gap, gap_jump=s.gap_jump)


# -- the hook: metrics, engine sync, checkpoint state -----------------------------------------------
class ActorSync:
    """Duck-types the part of RolloutEngine that RLHook calls, syncing only the actor's weights."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine

    def sync(self, model: nn.Module) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            self.engine.llm.load_weights(actor_weights(model), strict=True)
        return time.perf_counter() - t0


class PPOHook(RLHook):
    """RLHook for PPO: per-step metrics (rollout metrics on the steps that made one), the engine
    synced when the buffer is exhausted (and before evaluation), and the rollout buffer inside
    every checkpoint taken in the middle of a cycle."""

    loss: PPOLoss

    def __init__(self, loss: PPOLoss, engine, output_dir) -> None:
        super().__init__(loss, engine, output_dir)
        self.engine_step = 0   # the step whose weights the engine holds
        self.heldout_before: dict | None = None

    def sync_engine(self) -> float:
        if self.engine is None or self.engine_step == self.loss.step:
            return 0.0
        seconds = self.engine.sync(self.model)
        self.engine_step = self.loss.step
        return seconds

    def after_step(self, step: int) -> None:
        loss, s = self.loss, self.loss.s
        world = dist.get_world_size() if dist.is_initialized() else 1
        started = loss.stats.started
        loss.step = step
        epoch, slot = loss.position(step)
        sync_s = self.sync_engine() if (step % s.steps_per_rollout == 0) else 0.0
        v = dict(zip(STEP_SUMS, global_sum([loss.step_sums[k] for k in STEP_SUMS])))
        tokens = max(v["tokens"], 1.0)
        record: dict[str, Any] = {
            "step": step, "ppo_epoch": epoch, "mini_batch": slot, "new_rollout": bool(loss.rollout_sums),
            "policy_loss": v["policy_loss_sum"] / tokens, "value_loss": v["value_loss_sum"] / tokens,
            "clip_frac": (v["clipped_low"] + v["clipped_high"]) / tokens, "clip_frac_low": v["clipped_low"] / tokens,
            "clip_frac_high": v["clipped_high"] / tokens, "value_clip_frac": v["value_clipped"] / tokens,
            "approx_kl": v["approx_kl_sum"] / tokens, "ratio_dev": v["ratio_dev_sum"] / tokens,
            "entropy": v["entropy_sum"] / tokens, "kl_coef": loss.kl.value, "time_sync_s": sync_s}
        if loss.rollout_sums:
            r = dict(zip(ROLLOUT_SUMS, global_sum([loss.rollout_sums[k] for k in ROLLOUT_SUMS])))
            samples = max(r["samples"], 1.0)
            mean = r["reward_sum"] / samples
            record.update({
                "reward_mean": mean, "reward_std": max(r["reward_sq_sum"] / samples - mean ** 2, 0.0) ** 0.5,
                "completion_len": r["completion_tokens"] / samples, "clipped_len_frac": r["truncated"] / samples,
                "kl": r["kl_sum"] / max(r["rollout_tokens"], 1.0), "rollout_kl_coef": loss.kl_coef_used,
                "logprob_gap": r["gap_sum"] / max(r["rollout_tokens"], 1.0),
                "rollout_tokens_per_s": r["completion_tokens"] / max(r["generate_s"], 1e-9),
                "time_generate_s": r["generate_s"] / world, "time_score_s": r["score_s"] / world,
                "time_prepare_s": r["prepare_s"] / world})
        record["time_step_s"] = time.perf_counter() - (started or time.perf_counter())  # loss call to here
        loss.rollout_sums, loss.step_sums = {}, dict.fromkeys(STEP_SUMS, 0.0)
        loss.stats.reset()
        self.history.append(record)
        self._writer().log(record)
        line = (f"step {step} (epoch {epoch}, mini-batch {slot}) | clip {record['clip_frac']:.3f} | value clip "
                f"{record['value_clip_frac']:.3f} | approx_kl {record['approx_kl']:.2e}")
        if "reward_mean" in record:
            line += (f" | rollout: reward {record['reward_mean']:.3f} | kl {record['kl']:.3f} | len "
                     f"{record['completion_len']:.1f} | gap {record['logprob_gap']:.2e} | gen "
                     f"{record['time_generate_s']:.1f}s")
        self.log.info(line)

    def save(self, directory: Path) -> None:
        loss, s = self.loss, self.loss.s
        directory.mkdir(parents=True, exist_ok=True)
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        mid_cycle = loss.step % s.steps_per_rollout != 0
        if mid_cycle:
            loss.buffer.save(directory / f"buffer-rank{rank}.safetensors")
        if rank == 0:
            state = {"step": loss.step, "kl": loss.kl.state_dict(), "guard": loss.guard.state_dict(),
                     "ppo_epochs": s.ppo_epochs, "num_mini_batches": s.num_mini_batches, "world_size": world,
                     "buffer": mid_cycle}
            (directory / "state.json").write_text(json.dumps(state))

    def load(self, directory: Path) -> None:
        loss, s = self.loss, self.loss.s
        state = json.loads((directory / "state.json").read_text())
        loss.step = int(state["step"])
        loss.kl.load_state_dict(state["kl"])
        loss.guard.load_state_dict(state["guard"])
        loss.buffer = None
        if state.get("buffer"):
            rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
            saved = (state["ppo_epochs"], state["num_mini_batches"], state["world_size"])
            if saved != (s.ppo_epochs, s.num_mini_batches, world):
                raise ConfigError(
                    f"{directory.parent} was saved at step {loss.step}, in the middle of a rollout's mini-batches, with "
                    f"ppo_epochs={saved[0]}, num_mini_batches={saved[1]} on {saved[2]} rank(s); this run has "
                    f"{s.ppo_epochs}, {s.num_mini_batches} on {world}: resume with those settings, or from a "
                    "checkpoint at a rollout boundary (a step that is a multiple of ppo_epochs x num_mini_batches)")
            device = next(self.model.parameters()).device if self.model is not None else "cpu"
            loss.buffer = RolloutBuffer.load(directory / f"buffer-rank{rank}.safetensors", device)
        if self.engine is not None:
            self.engine.sync(self.model)  # the checkpoint's weights, not the initial ones
            self.engine_step = loss.step


def synced_eval(hook: PPOHook, evaluate):
    """eval_fn that first brings the engine up to the trained weights (it is synced lazily)."""
    def run(model=None, step: int = 0) -> dict:
        hook.sync_engine()
        return evaluate(model, step)
    return run


# -- wiring ----------------------------------------------------------------------------------------
def build_ppo(cfg: PPOConfig):
    from transformers import AutoModel

    from phalanx.launch import context

    from .models import load_policy, load_tokenizer, resolve_model_dir
    context()
    if cfg.train.plugin == "hybrid":
        raise ConfigError("train.plugin=hybrid: online RL here trains with data-parallel layouts (ddp, zero1, zero2, "
                          "fsdp, gemini); tensor/pipeline-parallel training of the policy is not wired yet")
    check_rollout_split(cfg)
    s, e = cfg.ppo, cfg.engine
    tokenizer = load_tokenizer(cfg.model)
    actor = load_policy(cfg.model)
    reference = copy.deepcopy(actor).eval().requires_grad_(False)
    critic = AutoModel.from_pretrained(str(resolve_model_dir(cfg.critic or cfg.model)), dtype=torch.float32)
    model = ActorCritic(actor, critic)
    rewards = RewardSet.from_specs(s.rewards, s.reward_weights)
    train_records, heldout_records = load_prompt_sets(cfg.data)
    train_ids, heldout_ids = encode_prompts(tokenizer, train_records), encode_prompts(tokenizer, heldout_records)
    engine = RolloutEngine.build(actor, tokenizer, max_new_tokens=s.max_new_tokens, max_model_len=e.max_model_len,
                                 temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=cfg.train.seed,
                                 max_num_seqs=e.max_num_seqs, block_size=e.block_size,
                                 kv_cache_memory_gib=e.kv_cache_memory_gib)
    engine.check_prompts(train_ids, "training prompt")
    engine.check_prompts(heldout_ids, "held-out prompt")

    def rollout_fn(indices, step):
        seeds = [sample_seed(cfg.train.seed, step, i, j) for i in indices for j in range(s.num_generations)]
        return engine.generate([train_ids[i] for i in indices], s.num_generations, seeds=seeds)

    loss = PPOLoss(s, train_records, train_ids, rewards, rollout_fn,
                   tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0, reference=reference,
                   seed=cfg.train.seed)
    hook = PPOHook(loss, ActorSync(engine), cfg.train.output_dir)
    eval_fn = synced_eval(hook, heldout_eval(engine, heldout_records, heldout_ids, rewards)) if heldout_records \
        else None
    return model, tokenizer, train_records, loss, hook, eval_fn, engine


def train_ppo(cfg: PPOConfig) -> tuple[Any, PPOHook]:
    from phalanx.checkpoint import latest_checkpoint
    model, tokenizer, records, loss, hook, eval_fn, _ = build_ppo(cfg)
    if cfg.eval_before and eval_fn is not None and latest_checkpoint(cfg.train.output_dir) is None:
        hook.heldout_before = eval_fn(None, 0)  # the engine still holds the initial actor
        hook.log.info("before training: " + ", ".join(f"{k}={v:.4g}" for k, v in hook.heldout_before.items()))
    try:
        result = fit(cfg.train, model, PromptIndices(len(records)), loss_fn=loss, eval_fn=eval_fn,
                     tokenizer=tokenizer, hooks=[hook])
    finally:
        hook.close()
    return result, hook


def main(argv: list[str] | None = None) -> None:
    cfg, _ = parse_config_args("PPO (actor, critic, reference, reward model) with rollouts on the Phalanx engine",
                               load_ppo_config, argv, example="apps/chat_rlhf/configs/ppo.yaml")
    result, hook = train_ppo(cfg)
    if not dist.is_initialized() or dist.get_rank() == 0:
        png = plot_rl_curves(cfg.train.output_dir, keys=("reward_mean", "kl", "approx_kl", "clip_frac"))
        before = f"held-out before {hook.heldout_before}, " if hook.heldout_before else ""
        print(f"done: step {result.final_step}, {before}held-out {result.last_eval}, curves {png}")


if __name__ == "__main__":
    main()
