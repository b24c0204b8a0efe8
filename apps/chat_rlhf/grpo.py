"""GRPO and its family in one trainer, with rollouts on our own engine.

    python -m apps.chat_rlhf.grpo --config apps/chat_rlhf/configs/grpo_arithmetic.yaml train.max_steps=20
    phalanx run -n 2 -m apps.chat_rlhf.grpo --config ... train.plugin=fsdp
    phalanx run -n 4 -m apps.chat_rlhf.grpo --config ... train.plugin=hybrid "train.plugin_options={tp_size: 2}"

One optimizer step (inside `phalanx.train.fit`, which brings the layout, checkpoints, resume and
logging): each rank takes its micro-batch of prompts, samples `n` completions per prompt on its
colocated engine, scores them, turns rewards into advantages, recomputes the sampled tokens'
log-probs with the trainer (the stale-weight guard compares them with the engine's), and takes
the clipped policy-gradient loss with the trainer's own log-probs as the old policy, each token
weighted by the truncated importance ratio trainer / engine (`tis_cap`); after the step `RLHook` copies
the new weights into the engine. The variants are options of `grpo:` (see `GRPOSettings`); with
`ppo_epochs` x `mini_batches` > 1 a rollout serves that many optimizer steps, one mini-batch each
(`GRPOLoss.cycle_step`). What GRPO shares with PPO lives in `rl_rollouts`, `rl_step`, `rl_losses`,
`rl_logprobs` and `rl_eval`.

Under `train.plugin=hybrid` (tensor parallelism, pp_size=1) the engine runs tensor-parallel over
the trainer's tp group, the ranks of one tp group are one data replica (same prompts, same seeds,
the same rollout), and every count is summed once per replica (`DataReplicas`).

With `rollout.mode: ray` the engines run in Ray actors apart from the trainer (this process), weights
are broadcast after each update, and `rollout.max_staleness: k` overlaps generation of the next
rollouts with training, the lag corrected by the same importance weights (`ray_rollouts`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from phalanx.config import ConfigError, load_config, parse_config_args
from phalanx.device import run_device, to_device
from phalanx.train import TrainConfig, fit

from . import rl_losses as L
from .adapters import DisabledAdapter, LoRASettings, lora_hooks, prepare
from .rewards import RewardSet
from .rl_eval import heldout_scores, plot_rl_curves
from .rl_logprobs import completion_logprobs
from .rl_losses import overlong_shaping, tis_weights  # noqa: F401  (re-exported)
from .rl_rollouts import (DataReplicas, DataSettings, EngineSettings, PromptIndices, RolloutSettings,  # noqa: F401
                          build_engine, encode_prompts, engine_dtype, load_prompt_sets, mini_batch_order, refill_prompts,
                          rollout_engine, rollout_function, rollout_prompts, rollout_tp_size, sample_seed,
                          seeded_rollouts)
from .rl_step import ROLLOUT_METRICS, RLHook, RolloutLoss  # noqa: F401
from .rollout import RolloutEngine, completion_batch, logprob_batch, padded


# -- configuration ---------------------------------------------------------------------------------
@dataclass
class GRPOSettings:
    num_generations: int = 8          # n samples per prompt
    max_new_tokens: int = 64
    temperature: float = 1.0          # sampling only; importance ratios use the raw distribution
    top_p: float = 1.0
    top_k: int = 0
    baseline: str = "grpo"            # grpo (group mean) | rloo (leave-one-out) | reinforce_pp (batch mean)
    scale: str = "group"              # group std (GRPO) | batch std | none (Dr. GRPO)
    aggregation: str = "token"        # token: mean over all tokens (DAPO) | sequence: mean of sequence means
    clip_low: float = 0.2             # ratio lower bound 1 - clip_low
    clip_high: float = 0.28           # ratio upper bound 1 + clip_high (clip-higher, DAPO; 0.2 = symmetric)
    dynamic_sampling: bool = False    # DAPO: groups whose rewards are all equal (no signal) are replaced by groups of
                                      # newly drawn prompts until the batch is full (at most max_refill_rounds
                                      # draws); any still without spread leave the loss
    max_refill_rounds: int = 4
    overlong_penalty: float = 0.0     # subtracted (at most) from completions near/at max_new_tokens
    overlong_buffer: int = 0          # soft zone: penalty grows over the last N tokens (0: truncated ones only)
    kl_coef: float = 0.0              # KL to the frozen initial policy in the loss (0: no reference model is built)
    kl_estimator: str = "k2"          # the KL term differentiated: k2 (unbiased gradient of KL(pi||ref)) | k3 (GRPO
                                      # paper; unbiased value, biased gradient); the logged `kl` is always k3's value
    kl_target: float | None = None    # adaptive KL controller target, per token (None: fixed kl_coef)
    kl_horizon: int = 10000           # the controller's horizon, in samples (completions)
    tis_cap: float | None = 2.0       # truncated importance sampling of the engine/trainer mismatch: each token's
                                      # gradient weighted by min(pi_trainer / pi_engine, tis_cap) (None: off)
    rewards: list[str] = field(default_factory=lambda: ["numeric"])  # built-ins, rm:<dir>, module:function
    reward_weights: list[float] = field(default_factory=list)
    max_logprob_gap: float = 0.5      # stale-weight guard: stop when mean |engine - trainer| log-prob exceeds it ...
    gap_jump: float = 20.0            # ... or jumps to this many times its running median
    ppo_epochs: int = 1               # passes over each rollout ...
    mini_batches: int = 1             # ... of this many optimizer steps each (1 x 1: on-policy, one step per rollout)
    shared_prompt_forward: bool = True  # training forward holds each prompt once for its n samples (exact; used
                                        # when n > 1, the attention is sdpa/eager and the estimate says it is cheaper)

    def validate(self) -> None:
        def need(ok: bool, key: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"grpo config '{key}'={getattr(self, key)!r}: {why}")
        need(self.num_generations >= 1, "num_generations", "must be at least 1")
        need(self.baseline in ("grpo", "rloo", "reinforce_pp"), "baseline", "choose grpo, rloo or reinforce_pp")
        need(self.baseline != "rloo" or self.num_generations >= 2, "baseline", "rloo needs num_generations >= 2")
        need(self.scale in ("group", "batch", "none"), "scale", "choose group, batch or none")
        need(self.aggregation in ("token", "sequence"), "aggregation", "choose token or sequence")
        need(self.max_new_tokens >= 1, "max_new_tokens", "must be at least 1")
        need(self.max_refill_rounds >= 0, "max_refill_rounds", "must be 0 or more")
        need(self.temperature > 0, "temperature", "must be > 0 (sampling; greedy rollouts have no spread)")
        need(0 <= self.clip_low < 1, "clip_low", "must be in [0, 1)")
        need(self.clip_high >= 0, "clip_high", "must be >= 0")
        need(self.kl_coef >= 0, "kl_coef", "must be >= 0")
        need(self.overlong_buffer < self.max_new_tokens, "overlong_buffer", "must be below max_new_tokens")
        need(self.max_logprob_gap > 0, "max_logprob_gap", "must be positive")
        need(self.kl_estimator in L.KL_ESTIMATORS, "kl_estimator", "choose k2 or k3")
        need(self.tis_cap is None or self.tis_cap >= 1, "tis_cap", "must be >= 1 (or null: no correction)")
        need(self.kl_horizon >= 1, "kl_horizon", "must be at least 1 (samples)")
        need(self.ppo_epochs >= 1, "ppo_epochs", "must be at least 1")
        need(self.mini_batches >= 1, "mini_batches", "must be at least 1")

    @property
    def steps_per_rollout(self) -> int:
        return self.ppo_epochs * self.mini_batches


@dataclass
class GRPOConfig:
    model: str = ""                   # policy: "" (SmolLM2-135M-Instruct), an HF directory or a checkpoint
    data: DataSettings = field(default_factory=DataSettings)
    grpo: GRPOSettings = field(default_factory=GRPOSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)  # colocated engine, or Ray workers (ray_rollouts)
    train_layers: int = 0             # train only the top N blocks (+ final norm); 0: the whole model
    lora: LoRASettings = field(default_factory=LoRASettings)  # adapters only; reference = adapter off (adapters.py)
    activation_checkpointing: bool = False  # recompute each decoder layer in backward (any plugin)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(output_dir="runs/chat_rlhf/grpo", lr=1e-6,
                                                                    micro_batch_size=4, precision="auto"))


def load_grpo_config(path: str | None, overrides: list[str] | None = None) -> GRPOConfig:
    cfg = load_config(GRPOConfig, path, overrides)
    cfg.grpo.validate()
    cfg.train.validate()
    cfg.lora.validate(cfg.train_layers)
    cfg.rollout.validate()
    cfg.rollout.check_layout(cfg.train)
    s, t = cfg.grpo, cfg.train
    size = t.micro_batch_size * s.num_generations
    if s.steps_per_rollout > 1 and size % s.mini_batches:
        raise ConfigError(f"grpo.mini_batches={s.mini_batches} does not divide the rollout of train.micro_batch_size x "
                          f"grpo.num_generations = {size} sequences per rank: choose one of "
                          f"{[d for d in range(1, size + 1) if size % d == 0]}")
    if s.steps_per_rollout > 1 and t.grad_accum_steps != 1:
        raise ConfigError(f"train.grad_accum_steps={t.grad_accum_steps}: with grpo.ppo_epochs x grpo.mini_batches > 1 "
                          "an optimizer step is one mini-batch of the rollout; set grad_accum_steps=1")
    return cfg



class GRPOLoss(RolloutLoss):
    """fit's loss_fn: rollout (refilled under dynamic sampling), score, advantages, guard, clipped policy
    loss with truncated importance weights (+ an optional KL term, `kl_estimator`). With
    `ppo_epochs` x `mini_batches` > 1 each rollout is reused for that many optimizer steps
    (`cycle_step`), as PPO does; with 1 (the default) every step samples anew (`on_policy_step`)."""

    buffer: dict | None = None  # the rollout of the current cycle (ppo_epochs x mini_batches > 1)

    def __call__(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        if self.s.steps_per_rollout == 1:
            return self.on_policy_step(model, batch)
        return self.cycle_step(model, batch)

    def advantages(self, indices: list[int], rollout, scores: torch.Tensor, dev):
        """(scores after overlong shaping, [B] advantages, [P] zero-spread groups, [B] kept sequences,
        lengths, truncated): group advantages over the global batch."""
        s, n = self.s, rollout.n
        lengths = torch.tensor([len(c) for c in rollout.completion_ids])
        truncated = torch.tensor(rollout.truncated)
        scores = scores + L.overlong_shaping(lengths, truncated, s.max_new_tokens, s.overlong_penalty, s.overlong_buffer)
        grouped = scores.view(len(indices), n).to(dev)  # rewards are computed on the host
        everyone, start = self.replicas.gather(grouped)
        adv = L.group_advantages(everyone, baseline=s.baseline, scale=s.scale)[start:start + len(indices)].reshape(-1)
        zero = L.zero_spread_groups(grouped)
        keep_seq = (~zero).repeat_interleave(n) if s.dynamic_sampling else \
            torch.ones(len(scores), dtype=torch.bool, device=dev)
        return scores, adv, zero, keep_seq, lengths, truncated

    def on_policy_step(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        s, st = self.s, self.stats
        indices, step, rollout, scores, t0 = self.rollout_and_score(batch)
        n, replicas = rollout.n, self.replicas
        dev = next(model.parameters()).device  # the run's device: advantages, masks and the loss live there
        scores, adv, zero, keep_seq, lengths, truncated = self.advantages(indices, rollout, scores, dev)
        score_s = time.perf_counter() - t0

        tb = to_device(logprob_batch(rollout.prompt_ids, rollout.completion_ids, n, self.pad_id, model,
                                     shared=s.shared_prompt_forward), dev)
        mask = tb["completion_mask"] * keep_seq.unsqueeze(1)
        logp, entropy = completion_logprobs(model, tb, with_entropy=True)
        engine_lp = padded(rollout.engine_logprobs, logp.shape[1]).to(dev)
        raw_mask = tb["completion_mask"].float()
        local_gap = float(((logp.detach() - engine_lp).abs() * raw_mask).sum())
        tokens, kept_tokens, kept_seqs, gap_sum = replicas.sum([raw_mask.sum().item(), mask.sum().item(),
                                                                float(keep_seq.sum()), local_gap])
        self.guard.check(gap_sum / max(tokens, 1.0), step, rollout.lag)

        # The old policy is the trainer's own forward at rollout time (these very weights: one update
        # per rollout), so the ratio starts at 1 whatever the engine's rounding; what the engine's
        # sampling distribution differs by (rounding, or a Ray rollout's lag) is corrected by truncated
        # importance sampling.
        tis = L.tis_weights(logp.detach(), engine_lp, raw_mask, s.tis_cap)
        loss, clip = L.policy_loss(logp, logp.detach(), adv.float().unsqueeze(1) * tis, mask, clip_low=s.clip_low,
                                   clip_high=s.clip_high, aggregation=s.aggregation,
                                   token_total=max(kept_tokens, 1.0), seq_total=max(kept_seqs, 1.0))
        kl_sum = 0.0
        if self.reference is not None:
            with torch.no_grad():
                ref_lp, _ = completion_logprobs(self.reference, tb)
            penalty = L.kl_penalty(logp, ref_lp, s.kl_estimator)
            loss = loss + self.kl.value * L.aggregate(penalty, mask, s.aggregation,
                                                       token_total=max(kept_tokens, 1.0), seq_total=max(kept_seqs, 1.0))
            kl_sum = float((L.k3_kl(logp.detach(), ref_lp) * raw_mask).sum())
        # fit averages gradients over data-parallel replicas; the totals above are global, so scale back up.
        st.add(samples=len(scores), reward_sum=float(scores.sum()), reward_sq_sum=float((scores ** 2).sum()),
               groups=len(indices), zero_spread_groups=float(zero.sum()), completion_tokens=float(lengths.sum()),
               truncated=float(truncated.sum()), entropy_sum=float(entropy.sum()), kl_sum=kl_sum,
               tokens=float(raw_mask.sum()), mb_tokens=float(raw_mask.sum()), clipped_low=float(clip["clipped_low"]),
               clipped_high=float(clip["clipped_high"]), gap_sum=local_gap,
               tis_capped=float(((tis >= s.tis_cap) * raw_mask).sum()) if s.tis_cap is not None else 0.0,
               tis_weight_sum=float((tis * raw_mask).sum()), generate_s=rollout.generate_s, score_s=score_s)
        return loss * replicas.count

    def cycle_step(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        """Step k of a cycle of K = ppo_epochs x mini_batches: the first samples a rollout (its prompts
        from `rollout_prompts`, so each pass over the prompts uses all of them), every step takes
        mini-batch k mod mini_batches of epoch k // mini_batches in a seeded order (`mini_batch_order`)."""
        s, step = self.s, self.step + 1
        if self.stats.started is None:
            self.stats.started = time.perf_counter()
        epoch, slot = divmod((step - 1) % s.steps_per_rollout, s.mini_batches)
        if epoch == 0 and slot == 0:
            indices = rollout_prompts(self.seed, (step - 1) // s.steps_per_rollout, len(self.records),
                                      len(batch["index"]), self.replicas.rank, self.replicas.count)
            self.buffer = self.make_buffer(model, {"index": torch.tensor(indices)})
        elif self.buffer is None or self.buffer["step"] != step - (step - 1) % s.steps_per_rollout:
            raise RuntimeError(f"step {step} is mini-batch {slot} of epoch {epoch} of a GRPO rollout, but that rollout "
                               "is not in memory: resume from a checkpoint at a multiple of grpo.ppo_epochs x "
                               "grpo.mini_batches steps (set train.save_every to such a multiple)")
        rows = self.buffer["rows"]
        order = mini_batch_order(self.seed, self.buffer["step"], epoch, len(rows["adv"]), s.mini_batches)
        index = order[slot].to(rows["adv"].device)
        return self.mini_batch_loss(model, {k: v[index] for k, v in rows.items()})

    @torch.no_grad()
    def make_buffer(self, model: torch.nn.Module, batch: dict) -> dict:
        """The cycle's rollout: token batch (unshared, so rows can be split), advantages, the trainer's
        rollout-time log-probs (the old policy), truncated importance weights, reference log-probs."""
        s, st, replicas = self.s, self.stats, self.replicas
        indices, step, rollout, scores, t0 = self.rollout_and_score(batch)
        dev = next(model.parameters()).device
        scores, adv, zero, keep_seq, lengths, truncated = self.advantages(indices, rollout, scores, dev)
        score_s = time.perf_counter() - t0
        tb = to_device(completion_batch(rollout.prompt_ids, rollout.completion_ids, self.pad_id), dev)
        old_logp, entropy = completion_logprobs(model, tb, with_entropy=True)
        raw_mask = tb["completion_mask"].float()
        engine_lp = padded(rollout.engine_logprobs, old_logp.shape[1]).to(dev)
        local_gap = float(((old_logp - engine_lp).abs() * raw_mask).sum())
        tokens, gap_sum = replicas.sum([float(raw_mask.sum()), local_gap])
        self.guard.check(gap_sum / max(tokens, 1.0), step, rollout.lag)
        tis = L.tis_weights(old_logp, engine_lp, raw_mask, s.tis_cap)
        rows = {**tb, "old_logp": old_logp, "adv": adv.float(), "tis": tis, "keep": keep_seq}
        kl_sum = 0.0
        if self.reference is not None:
            rows["ref_logp"], _ = completion_logprobs(self.reference, tb)
            kl_sum = float((L.k3_kl(old_logp, rows["ref_logp"]) * raw_mask).sum())
        st.add(samples=len(scores), reward_sum=float(scores.sum()), reward_sq_sum=float((scores ** 2).sum()),
               groups=len(indices), zero_spread_groups=float(zero.sum()), completion_tokens=float(lengths.sum()),
               truncated=float(truncated.sum()), entropy_sum=float(entropy.sum()), kl_sum=kl_sum,
               tokens=float(raw_mask.sum()), gap_sum=local_gap,
               tis_capped=float(((tis >= s.tis_cap) * raw_mask).sum()) if s.tis_cap is not None else 0.0,
               tis_weight_sum=float((tis * raw_mask).sum()), generate_s=rollout.generate_s, score_s=score_s)
        return {"step": step, "rows": rows}

    def mini_batch_loss(self, model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        """The clipped loss of one mini-batch against the rollout-time log-probs; token and sequence
        totals are the mini-batch's over every replica."""
        s = self.s
        raw_mask = mb["completion_mask"].float()
        mask = raw_mask * mb["keep"].unsqueeze(1)
        logp, _ = completion_logprobs(model, {k: mb[k] for k in ("input_ids", "attention_mask", "position_ids",
                                                                  "completion_mask")})
        kept_tokens, kept_seqs = self.replicas.sum([float(mask.sum()), float(mb["keep"].sum())])
        totals = dict(token_total=max(kept_tokens, 1.0), seq_total=max(kept_seqs, 1.0))
        loss, clip = L.policy_loss(logp, mb["old_logp"], mb["adv"].unsqueeze(1) * mb["tis"], mask,
                                   clip_low=s.clip_low, clip_high=s.clip_high, aggregation=s.aggregation, **totals)
        if "ref_logp" in mb:
            penalty = L.kl_penalty(logp, mb["ref_logp"], s.kl_estimator)
            loss = loss + self.kl.value * L.aggregate(penalty, mask, s.aggregation, **totals)
        self.stats.add(mb_tokens=float(raw_mask.sum()), clipped_low=float(clip["clipped_low"]),
                       clipped_high=float(clip["clipped_high"]))
        return loss * self.replicas.count



# -- wiring ----------------------------------------------------------------------------------------
@dataclass
class GRPORun:
    """Everything a GRPO run is made of, built before training (so every input error comes first)."""

    cfg: GRPOConfig
    model: torch.nn.Module
    tokenizer: Any
    engine: RolloutEngine
    loss: GRPOLoss
    hook: RLHook
    train_records: list[dict]
    heldout_records: list[dict]
    heldout_ids: list[list[int]]
    rewards: RewardSet

    def evaluate(self) -> dict:
        return heldout_scores(self.engine, self.heldout_records, self.heldout_ids, self.rewards)()

    def train(self):
        eval_fn = heldout_scores(self.engine, self.heldout_records, self.heldout_ids, self.rewards) \
            if self.heldout_records else None
        try:
            return fit(self.cfg.train, self.model, PromptIndices(len(self.train_records)), loss_fn=self.loss,
                       eval_fn=eval_fn, tokenizer=self.tokenizer,
                       hooks=[self.hook, *lora_hooks(self.cfg.lora, self.tokenizer)])
        finally:
            self.hook.close()

    def close(self) -> None:
        """Stop the Ray rollout workers (rollout.mode=ray); nothing to do for a colocated engine."""
        getattr(self.engine, "close", lambda: None)()



def build_run(cfg: GRPOConfig, *, model=None, tokenizer=None) -> GRPORun:
    from .models import load_policy, load_tokenizer, train_top_layers
    from phalanx.launch import context
    context()
    tp_size = rollout_tp_size(cfg.train)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model)
    model = model if model is not None else load_policy(cfg.model)
    train_top_layers(model, cfg.train_layers)
    s, e = cfg.grpo, cfg.engine
    rewards = RewardSet.from_specs(s.rewards, s.reward_weights)
    train_records, heldout_records = load_prompt_sets(cfg.data)
    if not train_records:
        raise ValueError(f"no training prompts in {cfg.data.source!r}")
    train_ids, heldout_ids = encode_prompts(tokenizer, train_records), encode_prompts(tokenizer, heldout_records)
    engine = rollout_engine(model, tokenizer, s, e, cfg.rollout, seed=cfg.train.seed, tp_size=tp_size,
                            prompts={"training prompt": train_ids, "held-out prompt": heldout_ids},
                            dtype=engine_dtype(cfg.train))
    model = prepare(model, cfg.lora, cfg.activation_checkpointing, cfg.train.seed)  # after the engine: it holds the plain policy
    reference = None
    if s.kl_coef > 0 and cfg.lora.enabled:
        reference = DisabledAdapter(model)  # the base itself, adapter off: no second copy
    elif s.kl_coef > 0:
        import copy
        # a frozen copy of the starting policy, on the run's device: it scores the device batches of the step
        reference = copy.deepcopy(model).to(run_device()).eval().requires_grad_(False)
    rollout_fn = rollout_function(engine, train_ids, s.num_generations, cfg.train.seed, cfg.rollout,
                                  steps_per_rollout=s.steps_per_rollout)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    loss = GRPOLoss(s, train_records, train_ids, rewards, rollout_fn, pad, reference=reference, seed=cfg.train.seed)
    loss.replicas = DataReplicas(tp_size)
    hook = RLHook(loss, engine, cfg.train.output_dir)
    return GRPORun(cfg, model, tokenizer, engine, loss, hook, train_records, heldout_records, heldout_ids, rewards)


def main(argv: list[str] | None = None) -> None:
    cfg, _ = parse_config_args("GRPO-family training with rollouts on the Phalanx engine", load_grpo_config, argv,
                               example="apps/chat_rlhf/configs/grpo_arithmetic.yaml")
    run = build_run(cfg)
    try:
        result = run.train()
    finally:
        run.close()
    png = plot_rl_curves(cfg.train.output_dir) if (not dist.is_initialized() or dist.get_rank() == 0) else None
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"done: step {result.final_step}, held-out {result.last_eval}, curves {png}")


if __name__ == "__main__":
    main()
