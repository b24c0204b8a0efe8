"""PPO, the InstructGPT stage 3: actor, critic (value head), frozen reference, reward model.

    python -m apps.chat_rlhf.ppo --config apps/chat_rlhf/configs/ppo.yaml ppo.rewards=[rm:runs/chat_rlhf/rm]

PPO as InstructGPT / ColossalChat run it, inside the one training loop (`phalanx.train.fit`):

- **Rollout** (once every K = ppo_epochs x num_mini_batches optimizer steps, on the step whose
  buffer is empty): the actor samples on its colocated engine for the rollout's prompts
  (`rollout_prompts`: `train.micro_batch_size` prompts x `ppo.num_generations` samples per rank); the
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

The prompts of a rollout come from `rollout_prompts`, not from fit's batch: fit's sampler hands a
batch every step but a rollout happens once every K steps, so taking the rollout step's batch would
use 1/K of the prompts per pass. The schedule walks a seeded permutation of all prompts, one
rollout-sized slice (strided over ranks, as fit's sampler shards) per rollout, so every prompt is
used once per pass; it depends only on (seed, rollout number), so a resumed run replays it. fit's
batch only sets the rollout size (train.micro_batch_size prompts per rank). `data.max_prompt_tokens`
drops longer prompts at load time (activation memory grows with the longest prompt of a mini-batch).
Held-out evaluations keep every prompt's score (`heldout/step_N.jsonl`), and the command ends with a
paired comparison of the first and last evaluation and a plot of RM score, KL and length per step.
The engine gets the actor's weights when the buffer is exhausted (before
the next rollout) and before a held-out evaluation, not after every step: nothing reads the engine
in between, and a sync gathers the full weights. Checkpoints carry the step, the KL controller,
the guard and, mid-cycle, each rank's buffer (safetensors), so a resumed run continues exactly.

Under `train.plugin=hybrid` (tensor parallelism, pp_size=1, as GRPO) the plugin splits the actor
inside `ActorCritic` (`actor_critic_policy`), the critic and value head stay replicated, the engine
runs tensor-parallel on the same group and syncs from the actor's shards, the ranks of a tp group
share one rollout, and every global sum counts each group once (`DataReplicas`).
"""
from __future__ import annotations

import copy
import hashlib
import json
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.config import ConfigError, load_config, parse_config_args
from phalanx.train import TrainConfig, fit

from . import rl_losses as L
from .data import drop_long_prompts
from .export import PolicyExport
from .grpo import (DataReplicas, DataSettings, EngineSettings, GRPOLoss, GRPOSettings, PromptIndices, RLHook,
                   build_engine, encode_prompts, global_sum, load_prompt_sets, plot_rl_curves, rollout_tp_size,
                   seeded_rollouts, tis_weights)
from .rewards import RewardSet
from .rollout import RolloutEngine, completion_batch, completion_logprobs, padded, submodule_weights


@dataclass
class PPOSettings:
    num_generations: int = 1
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    rewards: list[str] = field(default_factory=lambda: ["numeric"])
    reward_weights: list[float] = field(default_factory=list)
    kl_coef: float = 0.05             # initial per-token KL penalty, in the reward: -kl_coef * (logp - ref_logp)
    kl_target: float | None = None    # adaptive controller target, KL per token (None: fixed kl_coef)
    kl_horizon: int = 10000           # the controller's horizon, in samples (completions)
    tis_cap: float | None = 2.0       # truncated importance sampling of the engine/trainer mismatch (None: off)
    gamma: float = 1.0
    lam: float = 0.95
    clip: float = 0.2                 # policy ratio clip
    value_clip: float | None = 0.2    # value clip around the rollout's values (None: off)
    vf_coef: float = 0.1
    whiten_advantages: bool = True    # over the whole rollout (all ranks), once, at rollout time
    normalize_scores: bool = False    # standardise the scores over the whole rollout (all ranks) before GAE
    score_baseline: str = "none"      # none | prompt: subtract the mean score of each prompt's n samples first
                                      # (the advantage then compares answers to one prompt, not prompts)
    critic_warmup_rollouts: int = 0   # the first N rollouts train only the critic (the policy loss is off)
    cache_frozen_trunk: bool = False  # with train_layers N: keep the frozen blocks' output from the rollout-time
                                      # pass, so the mini-batch steps run only the top N blocks of actor and critic
    train_layers: int = 0             # train only the top N blocks (+ final norm) of actor and critic; 0: all
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
        if self.score_baseline not in ("none", "prompt"):
            raise ConfigError(f"ppo config: score_baseline={self.score_baseline!r}: choose none or prompt")
        if self.score_baseline == "prompt" and self.num_generations < 2:
            raise ConfigError("ppo config: score_baseline=prompt needs num_generations >= 2 (a prompt's mean over "
                              "one sample is that sample's score: every advantage would be 0)")
        if self.cache_frozen_trunk and self.train_layers <= 0:
            raise ConfigError("ppo config: cache_frozen_trunk needs train_layers > 0 (frozen lower blocks to cache)")
        if self.critic_warmup_rollouts < 0:
            raise ConfigError(f"ppo config: critic_warmup_rollouts={self.critic_warmup_rollouts} must be >= 0")
        if self.tis_cap is not None and self.tis_cap < 1:
            raise ConfigError(f"ppo config: tis_cap={self.tis_cap} must be >= 1 (or null: no correction)")
        if self.kl_horizon < 1:
            raise ConfigError(f"ppo config: kl_horizon={self.kl_horizon} must be at least 1 (samples)")
        if self.ppo_epochs < 1 or self.num_mini_batches < 1:
            raise ConfigError(f"ppo config: ppo_epochs={self.ppo_epochs} and num_mini_batches="
                              f"{self.num_mini_batches} must be at least 1")


@dataclass
class PPODataSettings(DataSettings):
    max_prompt_tokens: int = 0        # drop prompts longer than this many tokens at load time (0: keep all)


@dataclass
class PPOConfig:
    model: str = ""                   # actor (and reference): "" SmolLM2-135M-Instruct, an HF dir or a checkpoint
    critic: str = ""                  # "" the reward model (backbone + score head as the value head) when
                                      # ppo.rewards has one rm:<dir>, else the actor's backbone; "policy": the
                                      # actor's backbone; a model directory: its backbone (value head zero)
    data: PPODataSettings = field(default_factory=lambda: PPODataSettings(source="arithmetic"))
    ppo: PPOSettings = field(default_factory=PPOSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    eval_before: bool = False         # score the held-out prompts once before training (a fresh run only)
    eval_trained_prompts: bool = False  # every evaluation also scores greedy answers to the training prompts this
                                        # run's rollouts use (`trained/step_N.jsonl`): does the policy learn what
                                        # it is trained on, whether or not it carries over to held-out prompts?
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

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep: int, actor_hidden=None,
                critic_hidden=None, use_cache: bool = False):
        """actor_hidden / critic_hidden: the frozen trunk's cached output, fed as inputs_embeds (the
        caller makes the lower blocks pass it through, `FrozenTrunk.skipping`). use_cache: accepted
        (HybridParallelPlugin's wrapper passes it) and ignored: training keeps no KV cache."""
        def inputs(hidden):
            return {"input_ids": input_ids} if hidden is None else {"inputs_embeds": hidden}
        logits = self.actor(**inputs(actor_hidden), attention_mask=attention_mask, position_ids=position_ids,
                            logits_to_keep=logits_to_keep, use_cache=False).logits
        hidden = self.critic(**inputs(critic_hidden), attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=False).last_hidden_state[:, -logits_to_keep:]
        return logits, self.value_head(hidden).squeeze(-1)

    def split_actor_only(self) -> None:
        """Make HybridParallelPlugin split this wrapper by `actor_critic_policy`: the policy is
        registered for a model type of its own, which the wrapper's config (a copy of the actor's)
        names. The plugin picks a policy by `config.model_type`; passing it as a plugin option
        instead would put an object in train.plugin_options, which checkpoints save as JSON. The
        copy's to_dict still names the actor's family (transformers writes the class's model_type)."""
        from phalanx.shard.policy import register_policy
        policy = register_policy(actor_critic_policy(self.actor))
        self.config = copy.copy(self.actor.config)
        self.config.model_type = policy.model_types[0]


def actor_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The actor's tensors under HF names, from any wrapper (DDP `module.`, FSDP, compile)."""
    return submodule_weights(model.state_dict(), "actor")


def actor_critic_policy(actor: nn.Module):
    """The shard policy of `ActorCritic` for HybridParallelPlugin: the actor's family policy with
    its paths under `actor.`, so the actor's decoder layers, embedding and LM head are split over
    the tp group; the critic backbone and the value head stay replicated (every tp rank computes
    them whole, on the same batch, so their gradients agree without communication)."""
    from dataclasses import replace as replace_fields

    from phalanx.shard.policy import policy_for

    base = policy_for(actor)

    def under(path):
        return f"actor.{path}" if path else path
    return replace_fields(base, family=f"{base.family} actor-critic",
                          model_types=(f"{actor.config.model_type}-actor-critic",), layers=under(base.layers),
                          embedding=under(base.embedding), final_norm=under(base.final_norm), head=under(base.head),
                          position_embeddings=tuple(map(under, base.position_embeddings)),
                          input_extras=tuple(map(under, base.input_extras)),
                          output_extras=tuple(map(under, base.output_extras)))


# -- the rollout buffer ------------------------------------------------------------------------------
TOKEN_KEYS = ("input_ids", "attention_mask", "position_ids", "completion_mask")
PER_TOKEN_KEYS = ("old_logp", "old_values", "advantages", "returns")
OPTIONAL_KEYS = ("tis",)  # [B, T] truncated importance weights trainer / engine (ppo.tis_cap; None: off)
HIDDEN_KEYS = ("actor_hidden", "critic_hidden")  # [B, P+T, H] frozen-trunk outputs (cache_frozen_trunk only)
WIDE_KEYS = ("input_ids", "attention_mask", "position_ids") + HIDDEN_KEYS  # prompt + completion columns


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
    actor_hidden: torch.Tensor | None = None
    critic_hidden: torch.Tensor | None = None
    tis: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def keys(self) -> tuple[str, ...]:
        return TOKEN_KEYS + PER_TOKEN_KEYS + tuple(k for k in HIDDEN_KEYS + OPTIONAL_KEYS
                                                   if getattr(self, k) is not None)

    def rows(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows `index`, without the columns that are padding in all of them."""
        return trim_columns({k: getattr(self, k)[index] for k in self.keys()})

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file
        save_file({k: getattr(self, k).contiguous().cpu() for k in self.keys()}, str(path),
                  metadata={"step": str(self.step)})

    @classmethod
    def load(cls, path: Path, device: torch.device | str = "cpu") -> "RolloutBuffer":
        from safetensors import safe_open
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            step = int(f.metadata()["step"])
            tensors = {k: f.get_tensor(k) for k in TOKEN_KEYS + PER_TOKEN_KEYS + HIDDEN_KEYS + OPTIONAL_KEYS
                       if k in f.keys()}
        return cls(step=step, **tensors)


def column_window(batch: dict[str, torch.Tensor]) -> tuple[int, int, int]:
    """(start, stop, kept completion columns): the prompt + completion columns some row uses."""
    T = batch["completion_mask"].shape[1]
    P = batch["input_ids"].shape[1] - T
    keep_t = max(int(batch["completion_mask"].sum(1).max()), 1)
    return P - int(batch["attention_mask"][:, :P].sum(1).max()), P + keep_t, keep_t


def trim_columns(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the leading prompt columns and trailing completion columns that no row uses (a
    mini-batch of short sequences should not pay for the rollout's longest one)."""
    start, stop, keep_t = column_window(batch)
    return {k: v[:, start:stop] if k in WIDE_KEYS else v[:, :keep_t] for k, v in batch.items()}


def mini_batch_order(seed: int, rollout_step: int, epoch: int, size: int, num_mini_batches: int
                     ) -> list[torch.Tensor]:
    """Row indices of each mini-batch of one epoch: a permutation of the rollout's rows from a
    generator seeded by (seed, rollout step, epoch), so every rank and a resumed run agree."""
    digest = hashlib.sha256(f"ppo-mini-batches/{seed}/{rollout_step}/{epoch}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:7], "little"))
    return list(torch.randperm(size, generator=g).chunk(num_mini_batches))


def rollout_prompts(seed: int, rollout: int, num_prompts: int, per_rank: int, rank: int = 0, world: int = 1
                    ) -> list[int]:
    """Prompt indices of rollout number `rollout` (0-based) on `rank`: pass p over the prompts is a
    permutation seeded by (seed, p); each rollout takes its next `per_rank * world` indices, rank r
    every world-th of them from r (fit's sampler shards the same way). A pass holds
    num_prompts // (per_rank * world) rollouts; the few prompts left over wait for a later pass."""
    size = per_rank * world
    per_pass = num_prompts // size
    if per_pass < 1:
        raise ConfigError(f"{num_prompts} training prompts cannot fill one rollout of {per_rank} prompts x {world} "
                          "rank(s): lower train.micro_batch_size or raise data.num_train / data.max_prompt_tokens")
    p, slot = divmod(rollout, per_pass)
    digest = hashlib.sha256(f"ppo-prompts/{seed}/{p}".encode()).digest()
    perm = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(int.from_bytes(digest[:7], "little")))
    return perm[slot * size:(slot + 1) * size][rank::world].tolist()


def standardize_over_ranks(x: torch.Tensor, eps: float = 1e-8, sums=global_sum) -> torch.Tensor:
    """x minus the mean, over the (unbiased) std, both over every rank's values (`sums`: how per-rank
    sums become global ones; `DataReplicas.sum` counts each tensor-parallel group once)."""
    n, total, sq = sums([float(x.numel()), float(x.sum()), float((x.double() ** 2).sum())])
    mean = total / max(n, 1.0)
    var = max(sq - n * mean * mean, 0.0) / max(n - 1.0, 1.0)
    return (x - mean) * (var + eps) ** -0.5


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


def whiten_over_ranks(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, sums=global_sum) -> torch.Tensor:
    """`rl_losses.whiten` with the mean and (unbiased) variance of the masked entries of every
    rank's rollout, so the advantages are normalised over the whole rollout, not per shard
    (`sums` as in `standardize_over_ranks`)."""
    m = mask.to(x.dtype)
    count, total = sums([float(m.sum()), float((x * m).sum())])
    mean = total / max(count, 1.0)
    (sq,) = sums([float((((x - mean) * m) ** 2).sum())])
    var = sq / max(count - 1.0, 1.0)
    return (x - mean) * (var + eps) ** -0.5 * m


class TrunkCache:
    """`ppo.cache_frozen_trunk`: the frozen lower blocks of actor and critic (`train_layers` N). The
    rollout-time no-grad pass runs them anyway; their output there is kept in the buffer, and every
    mini-batch step of the rollout feeds it back (`inputs_embeds`, lower blocks passing it through),
    so a step runs the top N blocks of each model instead of all of them. Exact up to the rounding
    of another batch shape: the lower blocks never change, and a row's valid positions do not
    depend on its padding. Build it after the reference copy and the engine (it patches the lower
    blocks' forward on this instance)."""

    def __init__(self, actor: nn.Module, critic: nn.Module, train_layers: int) -> None:
        from .frozen_trunk import FrozenTrunk
        self.actor, self.critic = FrozenTrunk(actor, train_layers), FrozenTrunk(critic, train_layers)

    @contextmanager
    def capturing(self, actor_sink: list, critic_sink: list):
        with self.actor.capturing(actor_sink), self.critic.capturing(critic_sink):
            yield

    @contextmanager
    def skipping(self):
        with self.actor.skipping(), self.critic.skipping():
            yield


def actor_critic_outputs(model: nn.Module, batch: dict[str, torch.Tensor], trunks: TrunkCache | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probs, values, entropy) [B, T] of the completion tokens: values are the critic's
    estimates at the state before each token; everything masked to the completion. A batch with
    the frozen trunk's cached outputs (HIDDEN_KEYS) runs only the blocks above it (`trunks`)."""
    mask = batch["completion_mask"].float()
    T = mask.shape[1]
    cached = {k: batch[k] for k in HIDDEN_KEYS if k in batch}
    if cached and trunks is None:
        raise ValueError("a batch with cached frozen-trunk outputs needs the TrunkCache that skips the lower blocks")
    with trunks.skipping() if cached else nullcontext():
        logits, values = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               position_ids=batch["position_ids"], logits_to_keep=T + 1, **cached)
    logp_all = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    logp = logp_all.gather(-1, batch["input_ids"][:, -T:].unsqueeze(-1)).squeeze(-1) * mask
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
    return logp, values[:, :-1].float() * mask, entropy


# -- the loss --------------------------------------------------------------------------------------
ROLLOUT_SUMS = ("samples", "reward_sum", "reward_sq_sum", "within_sq_sum", "completion_tokens", "truncated",
                "kl_sum", "rollout_tokens", "gap_sum", "generate_s", "score_s", "prepare_s",
                "return_sum", "return_sq_sum", "residual_sum", "residual_sq_sum", "tis_weight_sum", "tis_capped")
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
        self.rollout_indices: list[list[int]] = []  # the prompts of each rollout of this process
        self.rollout_sums: dict[str, float] = {}   # the rollout of this step, if it made one
        self.step_sums: dict[str, float] = dict.fromkeys(STEP_SUMS, 0.0)
        self.kl_coef_used = self.kl.value
        self.trunks: TrunkCache | None = None      # set by build_ppo with ppo.cache_frozen_trunk

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, mini-batch) of optimizer step `step` (1-based) within its rollout's cycle."""
        return divmod((step - 1) % self.s.steps_per_rollout, self.s.num_mini_batches)

    def __call__(self, model: nn.Module, batch: dict) -> torch.Tensor:
        if self.stats.started is None:
            self.stats.started = time.perf_counter()
        step = self.step + 1
        epoch, slot = self.position(step)
        if epoch == 0 and slot == 0:
            indices = rollout_prompts(self.seed, (step - 1) // self.s.steps_per_rollout, len(self.records),
                                      len(batch["index"]), self.replicas.rank, self.replicas.count)
            self.rollout_indices.append(indices)
            self.buffer = self.make_rollout(model, {"index": torch.tensor(indices)})
        elif self.buffer is None or self.buffer.step != step - (step - 1) % self.s.steps_per_rollout:
            raise RuntimeError(f"step {step} is mini-batch {slot} of epoch {epoch} of a rollout, but the rollout "
                               "buffer of that cycle is missing (a checkpoint without it?)")
        order = mini_batch_order(self.seed, self.buffer.step, epoch, len(self.buffer), self.s.num_mini_batches)
        return self.mini_batch_loss(model, self.buffer.rows(order[slot].to(self.buffer.input_ids.device)),
                                    train_policy=not self.critic_warmup(self.buffer.step))

    def critic_warmup(self, rollout_step: int) -> bool:
        """Whether the rollout made at optimizer step `rollout_step` is one of the critic's warm-up
        rollouts (policy loss off: the critic learns the returns before the actor moves)."""
        return (rollout_step - 1) // self.s.steps_per_rollout < self.s.critic_warmup_rollouts

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
        hidden: dict[str, torch.Tensor] = {}  # the frozen trunk's outputs, [B, P+T, H] (cache_frozen_trunk)
        for rows in torch.arange(B, device=dev).chunk(s.num_mini_batches):
            part = {k: v[rows] for k, v in tb.items()}
            start, stop, _ = column_window(part)
            sinks: tuple[list, list] = ([], [])
            with self.trunks.capturing(*sinks) if self.trunks is not None else nullcontext():
                lp, v, _ = actor_critic_outputs(model, trim_columns(part))
            width = lp.shape[1]
            logp[rows, :width], values[rows, :width] = lp, v
            for key, sink in zip(HIDDEN_KEYS, sinks if self.trunks is not None else ()):
                if key not in hidden:
                    hidden[key] = sink[0].new_zeros(B, tb["input_ids"].shape[1], sink[0].shape[-1])
                hidden[key][rows, start:stop] = sink[0]
        engine_lp = padded(rollout.engine_logprobs, T).to(dev) * mask
        local_gap = float(((logp - engine_lp).abs() * mask).sum())
        sums = self.replicas.sum  # every data replica once (a tp group holds one rollout on each rank)
        tokens, gap_sum = sums([float(mask.sum()), local_gap])
        self.guard.check(gap_sum / max(tokens, 1.0), step)

        raw_scores = scores
        if s.score_baseline == "prompt":
            scores = prompt_centred(scores, s.num_generations)
        if s.normalize_scores:
            scores = standardize_over_ranks(scores, sums=sums)
        ref_lp, _ = completion_logprobs(self.reference, tb)
        kl = (logp - ref_lp) * mask  # per-token KL sample (k1) of the policy against the reference, in the reward
        self.kl_coef_used = self.kl.value
        rewards = -self.kl.value * kl
        last = (mask.sum(1).long() - 1).clamp(min=0)
        rewards[torch.arange(B, device=dev), last] += scores.to(dev)
        adv, returns = L.gae(rewards, values, mask, gamma=s.gamma, lam=s.lam)
        residual = (returns - values) * mask  # what the critic's rollout-time values missed (explained variance)
        if s.whiten_advantages:
            adv = whiten_over_ranks(adv, mask, sums=sums)
        kl_total, samples = sums([float(kl.sum()), float(B)])
        self.kl.update(kl_total / max(tokens, 1.0), int(samples))  # per-token KL; the horizon counts samples
        tis = tis_weights(logp, engine_lp, mask, s.tis_cap) if s.tis_cap is not None else None
        lengths = torch.tensor([len(c) for c in rollout.completion_ids])
        self.rollouts += 1
        self.rollout_sums = {
            "samples": len(scores), "reward_sum": float(raw_scores.sum()),
            "reward_sq_sum": float((raw_scores ** 2).sum()),
            "within_sq_sum": float((prompt_centred(raw_scores, s.num_generations) ** 2).sum()),
            "return_sum": float((returns * mask).sum()), "return_sq_sum": float((returns ** 2 * mask).sum()),
            "residual_sum": float(residual.sum()), "residual_sq_sum": float((residual ** 2).sum()),
            "completion_tokens": float(lengths.sum()), "truncated": float(sum(rollout.truncated)),
            "kl_sum": float(kl.sum()), "rollout_tokens": float(mask.sum()), "gap_sum": local_gap,
            "generate_s": rollout.generate_s, "score_s": score_s, "prepare_s": time.perf_counter() - t1}
        if tis is not None:
            self.rollout_sums.update(tis_weight_sum=float((tis * mask).sum()),
                                     tis_capped=float(((tis >= s.tis_cap) * mask).sum()))
        return RolloutBuffer(step=step, **{k: tb[k] for k in TOKEN_KEYS}, old_logp=logp, old_values=values,
                             advantages=adv, returns=returns, tis=tis, **hidden)

    def mini_batch_loss(self, model: nn.Module, mb: dict[str, torch.Tensor], train_policy: bool = True
                        ) -> torch.Tensor:
        s = self.s
        mask = mb["completion_mask"].float()
        logp, values, entropy = actor_critic_outputs(model, mb, self.trunks)
        local = float(mask.sum())
        (tokens,) = self.replicas.sum([local])
        tokens = max(tokens, 1.0)
        adv = mb["advantages"] * mb["tis"] if "tis" in mb else mb["advantages"]  # the engine's sampling corrected
        pg, clip = L.policy_loss(logp, mb["old_logp"], adv, mask, clip_low=s.clip, clip_high=s.clip,
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
        # fit averages gradients over data-parallel replicas; both terms are global means, so scale back up.
        world = self.replicas.count
        # In a critic warm-up the policy term stays in the graph with weight 0: every rank's actor then
        # gets (zero) gradients, and AdamW (no weight decay on a zero moment) leaves the actor as it is.
        return (pg * (1.0 if train_policy else 0.0) + s.vf_coef * vf) * world


def _as_grpo_view(s: PPOSettings) -> GRPOSettings:
    return GRPOSettings(num_generations=s.num_generations, max_new_tokens=s.max_new_tokens,
                        max_logprob_gap=s.max_logprob_gap, gap_jump=s.gap_jump)


# -- the hook: metrics, engine sync, checkpoint state -----------------------------------------------
class ActorSync:
    """Duck-types the part of RolloutEngine that RLHook calls, syncing only the actor's weights."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine

    def sync(self, model: nn.Module) -> float:
        return self.engine.sync(model, submodule="actor")


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
        world = loss.replicas.count
        started = loss.stats.started
        loss.step = step
        epoch, slot = loss.position(step)
        sync_s = self.sync_engine() if (step % s.steps_per_rollout == 0) else 0.0
        v = dict(zip(STEP_SUMS, loss.replicas.sum([loss.step_sums[k] for k in STEP_SUMS])))
        tokens = max(v["tokens"], 1.0)
        record: dict[str, Any] = {
            "step": step, "ppo_epoch": epoch, "mini_batch": slot, "new_rollout": bool(loss.rollout_sums),
            "policy_loss": v["policy_loss_sum"] / tokens, "value_loss": v["value_loss_sum"] / tokens,
            "clip_frac": (v["clipped_low"] + v["clipped_high"]) / tokens, "clip_frac_low": v["clipped_low"] / tokens,
            "clip_frac_high": v["clipped_high"] / tokens, "value_clip_frac": v["value_clipped"] / tokens,
            "approx_kl": v["approx_kl_sum"] / tokens, "ratio_dev": v["ratio_dev_sum"] / tokens,
            "entropy": v["entropy_sum"] / tokens, "kl_coef": loss.kl.value, "time_sync_s": sync_s,
            "policy_trained": not loss.critic_warmup(step - (step - 1) % s.steps_per_rollout)}
        if loss.rollout_sums:
            r = dict(zip(ROLLOUT_SUMS, loss.replicas.sum([loss.rollout_sums.get(k, 0.0) for k in ROLLOUT_SUMS])))
            samples = max(r["samples"], 1.0)
            mean = r["reward_sum"] / samples
            record.update({
                "reward_mean": mean, "reward_std": max(r["reward_sq_sum"] / samples - mean ** 2, 0.0) ** 0.5,
                # pooled std of the scores around their prompt's mean: the part of the reward that tells
                # one prompt's answers apart (the policy's learning signal), against reward_std's total
                "reward_within_std": (r["within_sq_sum"] / samples) ** 0.5,
                "critic_explained_var": explained_variance(r["return_sum"], r["return_sq_sum"], r["residual_sum"],
                                                           r["residual_sq_sum"], r["rollout_tokens"]),
                "completion_len": r["completion_tokens"] / samples, "clipped_len_frac": r["truncated"] / samples,
                "kl": r["kl_sum"] / max(r["rollout_tokens"], 1.0), "rollout_kl_coef": loss.kl_coef_used,
                "logprob_gap": r["gap_sum"] / max(r["rollout_tokens"], 1.0),
                "tis_weight": r["tis_weight_sum"] / max(r["rollout_tokens"], 1.0) if s.tis_cap is not None else 1.0,
                "tis_capped_frac": r["tis_capped"] / max(r["rollout_tokens"], 1.0),
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
            line += (f" | rollout: reward {record['reward_mean']:.3f} (within-prompt std "
                     f"{record['reward_within_std']:.3f}) | critic EV {record['critic_explained_var']:.2f} | kl "
                     f"{record['kl']:.3f} | len "
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
            if loss.trunks is None:  # saved with cache_frozen_trunk, resumed without: the full forward it is
                loss.buffer.actor_hidden = loss.buffer.critic_hidden = None
        if self.engine is not None:
            self.engine.sync(self.model)  # the checkpoint's weights, not the initial ones
            self.engine_step = loss.step


def synced_eval(hook: PPOHook, evaluate):
    """eval_fn that first brings the engine up to the trained weights (it is synced lazily)."""
    def run(model=None, step: int = 0) -> dict:
        hook.sync_engine()
        return evaluate(model, step)
    return run


# -- prompts, held-out scores, the report ---------------------------------------------------------
def load_ppo_prompts(data: PPODataSettings, tokenizer, log=None
                     ) -> tuple[list[dict], list[dict], list[list[int]], list[list[int]]]:
    """(train records, held-out records, their token ids). With data.max_prompt_tokens the longer
    prompts are dropped first and num_train / num_heldout then count the prompts that remain (a
    one-file preference source still holds out the last num_heldout of the first num_train +
    num_heldout)."""
    from .tasks import TASKS
    if not data.max_prompt_tokens:
        train, held = load_prompt_sets(data)
        return train, held, encode_prompts(tokenizer, train), encode_prompts(tokenizer, held)
    one_file_split = data.source not in TASKS and not data.heldout and data.kind == "preference" and data.num_heldout
    train, held = load_prompt_sets(data if data.source in TASKS else replace(data, num_train=0, num_heldout=0))
    train, train_ids, dropped_train = drop_long_prompts(train, encode_prompts(tokenizer, train), data.max_prompt_tokens)
    held, held_ids, dropped_held = drop_long_prompts(held, encode_prompts(tokenizer, held), data.max_prompt_tokens)
    read = len(train) + dropped_train + len(held) + dropped_held
    if one_file_split:
        n = data.num_train + data.num_heldout if data.num_train else len(train)
        train, train_ids = train[:n], train_ids[:n]
        if len(train) <= data.num_heldout:
            raise ConfigError(f"data.max_prompt_tokens={data.max_prompt_tokens} leaves {len(train)} prompts of "
                              f"{data.source}, not more than data.num_heldout={data.num_heldout}: raise "
                              "max_prompt_tokens or lower num_heldout")
        train, held, train_ids, held_ids = (train[:-data.num_heldout], train[-data.num_heldout:],
                                            train_ids[:-data.num_heldout], train_ids[-data.num_heldout:])
    elif data.source not in TASKS:
        if data.num_train:
            train, train_ids = train[:data.num_train], train_ids[:data.num_train]
        if data.num_heldout:
            held, held_ids = held[:data.num_heldout], held_ids[:data.num_heldout]
    if not train:
        raise ConfigError(f"data.max_prompt_tokens={data.max_prompt_tokens} drops every training prompt of "
                          f"{data.source}: raise it")
    if log is not None:
        log.info(f"data.max_prompt_tokens={data.max_prompt_tokens}: dropped {dropped_train + dropped_held} of {read} "
                 f"prompts read; {len(train)} training and {len(held)} held-out prompts remain")
    return train, held, train_ids, held_ids


HELDOUT_DIR = "heldout"


TRAINED_DIR = "trained"


def heldout_scores(engine, records: list[dict], prompt_ids: list[list[int]], rewards: RewardSet, output_dir,
                   subdir: str = HELDOUT_DIR, prefix: str = "heldout") -> Any:
    """eval_fn: greedy answers from the engine (which holds the latest weights) scored by the
    rewards, each rank its share; rank 0 writes every prompt's score, length and text to
    `heldout/step_N.jsonl` (for the paired comparison) and the means come back."""
    from .grpo import DataReplicas
    replicas = DataReplicas(engine.tp_size)
    directory = Path(output_dir) / subdir

    def run(model=None, step: int = 0) -> dict:
        mine = list(range(replicas.rank, len(records), replicas.count))
        rows = []
        if mine:
            out = engine.generate([prompt_ids[i] for i in mine], 1, greedy=True)
            scores, _ = rewards([records[i]["prompt"] for i in mine], out.texts,
                                [records[i].get("ground_truth") for i in mine])
            rows = [{"index": i, "score": float(sc), "length": len(c), "text": t}
                    for i, sc, c, t in zip(mine, scores.tolist(), out.completion_ids, out.texts)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, rows)
            rows = {r["index"]: r for part in gathered for r in part}.values()  # tp groups repeat theirs
        rows = sorted(rows, key=lambda r: r["index"])
        if not dist.is_initialized() or dist.get_rank() == 0:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / f"step_{step}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        n = max(len(rows), 1)
        return {f"{prefix}_reward": sum(r["score"] for r in rows) / n, f"{prefix}_n": float(len(rows)),
                f"{prefix}_len": sum(r["length"] for r in rows) / n}
    return run


def trained_prompt_indices(cfg: "PPOConfig", num_prompts: int) -> list[int]:
    """The training prompts the rollouts of a `train.max_steps` run use, all ranks together, sorted."""
    world = DataReplicas(rollout_tp_size(cfg.train)).count
    rollouts = -(-cfg.train.max_steps // cfg.ppo.steps_per_rollout)
    size = cfg.train.micro_batch_size * world
    return sorted({i for r in range(rollouts) for i in rollout_prompts(cfg.train.seed, r, num_prompts, size)})


def both_evals(heldout, trained):
    """eval_fn scoring the held-out prompts, then (if given) the trained ones; one dict of metrics."""
    def run(model=None, step: int = 0) -> dict:
        out = heldout(model, step) if heldout is not None else {}
        return {**out, **trained(model, step)} if trained is not None else out
    return run


def read_heldout(output_dir, subdir: str = HELDOUT_DIR) -> dict[int, list[dict]]:
    """{step: rows} of every held-out evaluation that `heldout_scores` wrote."""
    directory = Path(output_dir) / subdir
    out = {}
    for path in directory.glob("step_*.jsonl") if directory.is_dir() else []:
        out[int(path.stem.removeprefix("step_"))] = [json.loads(x) for x in path.read_text().splitlines()]
    return dict(sorted(out.items()))


def paired_comparison(before: list[float], after: list[float], resamples: int = 10000, seed: int = 0) -> dict:
    """Mean change of paired scores (after - before, prompt by prompt) with a 95% percentile
    bootstrap interval over prompts, and a two-sided exact sign test (ties dropped)."""
    import math
    if len(before) != len(after) or not before:
        raise ValueError(f"paired comparison needs equal, non-empty lists (got {len(before)} and {len(after)})")
    d = torch.tensor(after, dtype=torch.float64) - torch.tensor(before, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    means = d[torch.randint(len(d), (resamples, len(d)), generator=g)].mean(1)
    wins, losses = int((d > 0).sum()), int((d < 0).sum())
    k, n = min(wins, losses), wins + losses
    p_sign = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0
    return {"n": len(d), "mean_before": sum(before) / len(d), "mean_after": sum(after) / len(d),
            "mean_diff": float(d.mean()), "ci95": [float(means.quantile(0.025)), float(means.quantile(0.975))],
            "wins": wins, "losses": losses, "ties": len(d) - n, "sign_test_p": p_sign}


def heldout_report(output_dir, subdir: str = HELDOUT_DIR) -> dict | None:
    """The paired comparison (score and completion length) of the first and the last held-out
    evaluation of a run, written to `heldout_comparison.json` (`trained_comparison.json` for the
    trained prompts' evaluations); None with fewer than two."""
    evals = read_heldout(output_dir, subdir)
    if len(evals) < 2:
        return None
    (first, a), (last, b) = next(iter(evals.items())), list(evals.items())[-1]
    if [r["index"] for r in a] != [r["index"] for r in b]:
        return None
    report = {"from_step": first, "to_step": last,
              "score": paired_comparison([r["score"] for r in a], [r["score"] for r in b]),
              "length": paired_comparison([float(r["length"]) for r in a], [float(r["length"]) for r in b])}
    (Path(output_dir) / f"{subdir}_comparison.json").write_text(json.dumps(report, indent=1))
    return report


def plot_ppo(output_dir) -> Path | None:
    """`ppo_curves.png`: reward-model score (rollout samples; greedy answers to the held-out and,
    with eval_trained_prompts, the trained-on prompts), KL to the reference per token, and
    completion length, against the step."""
    from phalanx.observe import read_metrics

    from .grpo import ROLLOUT_METRICS
    output_dir = Path(output_dir)
    rl = read_metrics(output_dir / ROLLOUT_METRICS) if (output_dir / ROLLOUT_METRICS).exists() else []
    rl = [r for r in rl if "reward_mean" in r]
    evals = read_heldout(output_dir)
    if not rl and not evals:
        return None
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4), dpi=110)
    trained = read_heldout(output_dir, TRAINED_DIR)
    for ax, key, held_key, title in ((axes[0], "reward_mean", "score", "reward-model score"),
                                     (axes[1], "kl", None, "KL to reference (per token)"),
                                     (axes[2], "completion_len", "length", "completion length (tokens)")):
        if rl:
            ax.plot([r["step"] for r in rl], [r[key] for r in rl], linewidth=1, alpha=0.6, label="rollout samples")
        for runs, label in ((evals, "held-out, greedy"), (trained, "trained-on prompts, greedy")):
            if held_key and runs:
                ax.plot(list(runs), [sum(r[held_key] for r in rows) / max(len(rows), 1) for rows in runs.values()],
                        "o-", linewidth=1.5, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = output_dir / "ppo_curves.png"
    fig.savefig(path)
    plt.close(fig)
    return path


# -- wiring ----------------------------------------------------------------------------------------
def build_ppo(cfg: PPOConfig):
    from phalanx.device import run_device
    from phalanx.launch import context

    from .models import load_policy, load_tokenizer, train_top_layers
    context()
    tp_size = rollout_tp_size(cfg.train)  # refuses pp / sp layouts
    check_rollout_split(cfg)
    s, e = cfg.ppo, cfg.engine
    tokenizer = load_tokenizer(cfg.model)
    actor = load_policy(cfg.model)
    # a frozen copy of the starting actor, on the run's device: it scores the rollout's device batches
    reference = copy.deepcopy(actor).to(run_device()).eval().requires_grad_(False)
    critic, value_head = critic_start(cfg, actor, tokenizer)
    train_top_layers(actor, s.train_layers)  # the frozen bottom needs no gradients or optimizer state
    train_top_layers(critic, s.train_layers)
    model = ActorCritic(actor, critic)
    if value_head is not None:
        with torch.no_grad():
            model.value_head.weight.copy_(value_head)
    if cfg.train.plugin == "hybrid":  # the actor splits over the tp group; critic and value head stay whole
        model.split_actor_only()
    rewards = RewardSet.from_specs(s.rewards, s.reward_weights)
    from phalanx.observe import get_logger
    train_records, heldout_records, train_ids, heldout_ids = load_ppo_prompts(cfg.data, tokenizer,
                                                                              get_logger("apps.chat_rlhf"))
    engine = build_engine(actor, tokenizer, s, e, seed=cfg.train.seed, tp_size=tp_size,
                          prompts={"training prompt": train_ids, "held-out prompt": heldout_ids})
    loss = PPOLoss(s, train_records, train_ids, rewards, seeded_rollouts(engine, train_ids, s.num_generations,
                                                                         cfg.train.seed),
                   tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0, reference=reference,
                   seed=cfg.train.seed)
    loss.replicas = DataReplicas(tp_size)
    if s.cache_frozen_trunk:  # after the reference copy and the engine: it patches this actor's blocks
        loss.trunks = TrunkCache(actor, critic, s.train_layers)
    hook = PPOHook(loss, ActorSync(engine), cfg.train.output_dir)
    heldout = heldout_scores(engine, heldout_records, heldout_ids, rewards, cfg.train.output_dir) \
        if heldout_records else None
    trained = None
    if cfg.eval_trained_prompts:
        picked = trained_prompt_indices(cfg, len(train_records))
        trained = heldout_scores(engine, [train_records[i] for i in picked], [train_ids[i] for i in picked], rewards,
                                 cfg.train.output_dir, subdir=TRAINED_DIR, prefix="trained")
    eval_fn = synced_eval(hook, both_evals(heldout, trained)) if heldout is not None or trained is not None else None
    return model, tokenizer, train_records, loss, hook, eval_fn, engine


def critic_start(cfg: PPOConfig, actor: nn.Module, tokenizer) -> tuple[nn.Module, torch.Tensor | None]:
    """(critic backbone, value-head weight or None) as `cfg.critic` says. From a reward model (the
    default when `ppo.rewards` names one, as InstructGPT and ColossalChat start PPO): its backbone,
    and its score head as the value head, so V(state) starts as the RM's estimate of the final
    score rather than 0 everywhere. The critic reads the actor's token ids: the vocabularies must match."""
    from transformers import AutoModel

    from .models import from_pretrained, load_reward_model, resolve_model_dir
    rms = [spec[3:] for spec in cfg.ppo.rewards if spec.startswith("rm:")]
    if cfg.critic == "" and len(rms) == 1:
        rm, rm_tokenizer = load_reward_model(rms[0])
        if rm_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ConfigError(f"critic='' starts the critic from the reward model {rms[0]}, but its tokenizer differs "
                              "from the policy's (the critic reads the policy's tokens): set critic=policy (the "
                              "actor's backbone) or critic=<a model directory with the policy's tokenizer>")
        return rm.base_model, rm.score.weight.detach().clone()
    source = cfg.model if cfg.critic in ("", "policy") else cfg.critic
    return from_pretrained(AutoModel, resolve_model_dir(source)), None


def train_ppo(cfg: PPOConfig) -> tuple[Any, PPOHook]:
    from phalanx.checkpoint import latest_checkpoint
    model, tokenizer, records, loss, hook, eval_fn, _ = build_ppo(cfg)
    if cfg.eval_before and eval_fn is not None and latest_checkpoint(cfg.train.output_dir) is None:
        hook.heldout_before = eval_fn(None, 0)  # the engine still holds the initial actor
        hook.log.info("before training: " + ", ".join(f"{k}={v:.4g}" for k, v in hook.heldout_before.items()))
    try:
        # every checkpoint also gets policy/: the actor alone, a plain Hugging Face model directory
        export = PolicyExport(model.actor, tokenizer, submodule="actor")
        result = fit(cfg.train, model, PromptIndices(len(records)), loss_fn=loss, eval_fn=eval_fn,
                     tokenizer=tokenizer, hooks=[hook, export])
    finally:
        hook.close()
    return result, hook


def main(argv: list[str] | None = None) -> None:
    cfg, _ = parse_config_args("PPO (actor, critic, reference, reward model) with rollouts on the Phalanx engine",
                               load_ppo_config, argv, example="apps/chat_rlhf/configs/ppo.yaml")
    result, hook = train_ppo(cfg)
    if not dist.is_initialized() or dist.get_rank() == 0:
        png = plot_rl_curves(cfg.train.output_dir, keys=("reward_mean", "kl", "approx_kl", "clip_frac"))
        ppo_png = plot_ppo(cfg.train.output_dir)
        before = f"held-out before {hook.heldout_before}, " if hook.heldout_before else ""
        print(f"done: step {result.final_step}, {before}held-out {result.last_eval}, curves {png} {ppo_png}")
        for subdir, what in ((HELDOUT_DIR, "held-out"), (TRAINED_DIR, "trained-on")):
            if (report := heldout_report(cfg.train.output_dir, subdir)) is not None:
                print(f"{what} prompts, step {report['from_step']} -> {report['to_step']}: " + describe(report))


def describe(report: dict) -> str:
    """One line for a paired comparison of `heldout_report`."""
    sc, ln = report["score"], report["length"]
    return (f"{sc['n']} prompts, paired: score {sc['mean_before']:.4f} -> {sc['mean_after']:.4f}, change "
            f"{sc['mean_diff']:+.4f} (95% bootstrap {sc['ci95'][0]:+.4f} .. {sc['ci95'][1]:+.4f}), up {sc['wins']} / "
            f"down {sc['losses']} / same {sc['ties']}, sign test p={sc['sign_test_p']:.3g}; length "
            f"{ln['mean_before']:.1f} -> {ln['mean_after']:.1f} tokens")


if __name__ == "__main__":
    main()
