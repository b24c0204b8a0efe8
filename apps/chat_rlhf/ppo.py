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
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.config import ConfigError, load_config, parse_config_args
from phalanx.train import TrainConfig, fit

from . import rl_losses as L
from .adapters import DisabledAdapter, LoRASettings, SubmoduleLoRAExport, prepare
from .export import PolicyExport
from .ppo_buffer import (HIDDEN_KEYS, PER_TOKEN_KEYS, TOKEN_KEYS, PPODataSettings, RolloutBuffer,  # noqa: F401
                         column_window, load_ppo_prompts, trim_columns)
from .ppo_hook import (ROLLOUT_SUMS, STEP_SUMS, ActorSync, PPOHook, synced_eval,  # noqa: F401
                       trained_prompt_indices)
from .ppo_model import (ActorCritic, TrunkCache, actor_critic_outputs, actor_critic_policy,  # noqa: F401
                        actor_weights, critic_start)
from .rewards import RewardSet
from .rl_eval import (HELDOUT_DIR, TRAINED_DIR, both_evals, describe, heldout_report, heldout_scores,  # noqa: F401
                      paired_comparison, plot_ppo, plot_rl_curves)
from .rl_losses import explained_variance, prompt_centred, standardize_over_ranks  # noqa: F401  (re-exported)
from .rl_rollouts import (DataReplicas, EngineSettings, PromptIndices, RolloutSettings, build_engine,  # noqa: F401
                          engine_dtype, mini_batch_order, rollout_engine, rollout_function, rollout_prompts,
                          rollout_tp_size, seeded_rollouts)
from .rl_step import RolloutLoss
from .rollout import completion_batch, completion_logprobs, padded


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
class PPOConfig:
    model: str = ""                   # actor (and reference): "" SmolLM2-135M-Instruct, an HF dir or a checkpoint
    critic: str = ""                  # "" the reward model (backbone + score head as the value head) when
                                      # ppo.rewards has one rm:<dir>, else the actor's backbone; "policy": the
                                      # actor's backbone; a model directory: its backbone (value head zero)
    data: PPODataSettings = field(default_factory=lambda: PPODataSettings(source="arithmetic"))
    ppo: PPOSettings = field(default_factory=PPOSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)  # colocated engine, or Ray workers (ray_rollouts)
    lora: LoRASettings = field(default_factory=LoRASettings)  # adapters on actor and critic; reference = actor's off
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
    cfg.lora.validate(cfg.ppo.train_layers)
    cfg.rollout.validate()
    cfg.rollout.check_layout(cfg.train)
    if cfg.lora.enabled and cfg.train.plugin in ("fsdp", "gemini"):
        raise ConfigError(f"PPO with lora.enabled runs under ddp, zero1, zero2 or hybrid, not train.plugin="
                          f"{cfg.train.plugin!r}: the reference is the actor called with its adapter off, outside the "
                          "actor-critic's forward, which a plugin that shards the actor inside it does not gather")
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



# -- the loss --------------------------------------------------------------------------------------
class PPOLoss(RolloutLoss):
    """fit's loss_fn for PPO: a rollout into the buffer when it is empty, then one mini-batch of it
    per optimizer step (`RolloutLoss`: rollout, scoring, KL controller and guard, as GRPO's)."""

    def __init__(self, settings: PPOSettings, records, prompt_ids, rewards: RewardSet, rollout_fn, pad_id: int, *,
                 reference: nn.Module, seed: int = 0) -> None:
        super().__init__(settings, records, prompt_ids, rewards, rollout_fn, pad_id, reference=reference, seed=seed)
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
        self.guard.check(gap_sum / max(tokens, 1.0), step, rollout.lag)

        raw_scores = scores
        if s.score_baseline == "prompt":
            scores = L.prompt_centred(scores, s.num_generations)
        if s.normalize_scores:
            scores = L.standardize_over_ranks(scores, sums=sums)
        ref_lp, _ = completion_logprobs(self.reference, tb)
        kl = (logp - ref_lp) * mask  # per-token KL sample (k1) of the policy against the reference, in the reward
        self.kl_coef_used = self.kl.value
        rewards = -self.kl.value * kl
        last = (mask.sum(1).long() - 1).clamp(min=0)
        rewards[torch.arange(B, device=dev), last] += scores.to(dev)
        adv, returns = L.gae(rewards, values, mask, gamma=s.gamma, lam=s.lam)
        residual = (returns - values) * mask  # what the critic's rollout-time values missed (explained variance)
        if s.whiten_advantages:
            adv = L.whiten_over_ranks(adv, mask, sums=sums)
        kl_total, samples = sums([float(kl.sum()), float(B)])
        self.kl.update(kl_total / max(tokens, 1.0), int(samples))  # per-token KL; the horizon counts samples
        tis = L.tis_weights(logp, engine_lp, mask, s.tis_cap) if s.tis_cap is not None else None
        lengths = torch.tensor([len(c) for c in rollout.completion_ids])
        self.rollouts += 1
        self.rollout_sums = {
            "samples": len(scores), "reward_sum": float(raw_scores.sum()),
            "reward_sq_sum": float((raw_scores ** 2).sum()),
            "within_sq_sum": float((L.prompt_centred(raw_scores, s.num_generations) ** 2).sum()),
            "return_sum": float((returns * mask).sum()), "return_sq_sum": float((returns ** 2 * mask).sum()),
            "residual_sum": float(residual.sum()), "residual_sq_sum": float((residual ** 2).sum()),
            "completion_tokens": float(lengths.sum()), "truncated": float(sum(rollout.truncated)),
            "kl_sum": float(kl.sum()), "rollout_tokens": float(mask.sum()), "gap_sum": local_gap,
            "generate_s": rollout.generate_s, "score_s": score_s, "prepare_s": time.perf_counter() - t1,
            "lag": float(rollout.lag)}
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
    reference = None
    if not cfg.lora.enabled:
        # a frozen copy of the starting actor, on the run's device: it scores the rollout's device batches
        reference = copy.deepcopy(actor).to(run_device()).eval().requires_grad_(False)
    critic, value_head = critic_start(cfg, actor, tokenizer)
    train_top_layers(actor, s.train_layers)  # the frozen bottom needs no gradients or optimizer state
    train_top_layers(critic, s.train_layers)
    model = ActorCritic(actor, critic)
    if value_head is not None:
        with torch.no_grad():
            model.value_head.weight.copy_(value_head)
    rewards = RewardSet.from_specs(s.rewards, s.reward_weights)
    from phalanx.observe import get_logger
    train_records, heldout_records, train_ids, heldout_ids = load_ppo_prompts(cfg.data, tokenizer,
                                                                              get_logger("apps.chat_rlhf"))
    engine = rollout_engine(actor, tokenizer, s, e, cfg.rollout, seed=cfg.train.seed, tp_size=tp_size,
                            prompts={"training prompt": train_ids, "held-out prompt": heldout_ids},
                            dtype=engine_dtype(cfg.train))
    if cfg.lora.enabled:  # after the engine (peft adapts the modules in place): adapters on actor and critic;
        model.actor = prepare(model.actor, cfg.lora, False, cfg.train.seed)  # the reference is the actor
        model.critic = prepare(model.critic, cfg.lora, False, cfg.train.seed + 1)  # with its adapter off
        reference = DisabledAdapter(model.actor)
    if cfg.train.plugin == "hybrid":  # the actor splits over the tp group; critic and value head stay whole
        model.split_actor_only()
    loss = PPOLoss(s, train_records, train_ids, rewards,
                   rollout_function(engine, train_ids, s.num_generations, cfg.train.seed, cfg.rollout,
                                    steps_per_rollout=s.steps_per_rollout),
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



def train_ppo(cfg: PPOConfig) -> tuple[Any, PPOHook]:
    from phalanx.checkpoint import latest_checkpoint
    model, tokenizer, records, loss, hook, eval_fn, engine = build_ppo(cfg)
    if cfg.eval_before and eval_fn is not None and latest_checkpoint(cfg.train.output_dir) is None:
        hook.heldout_before = eval_fn(None, 0)  # the engine still holds the initial actor
        hook.log.info("before training: " + ", ".join(f"{k}={v:.4g}" for k, v in hook.heldout_before.items()))
    try:
        # every checkpoint also gets policy/: the actor alone, a plain Hugging Face model directory (with
        # LoRA: adapter/, the actor's adapter in PEFT's format, and with lora.merge policy/, merged)
        if cfg.lora.enabled:
            exports = [SubmoduleLoRAExport(model.actor, tokenizer, "actor")]
            if cfg.lora.merge:
                exports.append(SubmoduleLoRAExport(model.actor, tokenizer, "actor", merge=True))
        else:
            exports = [PolicyExport(model.actor, tokenizer, submodule="actor")]
        result = fit(cfg.train, model, PromptIndices(len(records)), loss_fn=loss, eval_fn=eval_fn,
                     tokenizer=tokenizer, hooks=[hook, *exports])
    finally:
        hook.close()
        getattr(engine, "close", lambda: None)()  # Ray rollout workers (rollout.mode=ray)
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




if __name__ == "__main__":
    main()
