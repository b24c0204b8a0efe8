"""PPO, the InstructGPT stage 3: actor, critic (value head), frozen reference, reward model.

    python -m apps.chat_rlhf.ppo --config apps/chat_rlhf/configs/ppo.yaml reward=[rm:runs/chat_rlhf/rm]

Each optimizer step (inside `phalanx.train.fit`): the actor samples on its colocated engine, the
reward model (or any reward of `rewards.py`) scores each completion, the per-token reward is
-kl_coef * (logp - ref_logp) plus the score on the last token, GAE over the critic's values gives
advantages (whitened) and returns, and the loss is the clipped policy loss + vf_coef * the clipped
value loss. The KL coefficient follows InstructGPT's adaptive controller. Actor and critic are one
module (`ActorCritic`), so every layout fit supports trains both; the engine gets the actor's
weights after every step. The frozen reference lives on the host (CPU) and runs under no_grad.

Limitation (see the README's "Online RL" section): one optimizer step per rollout (ppo_epochs = 1, one mini-batch), so the
ratio and value clips bound only the engine/trainer mismatch; fit has no "several optimizer steps
per batch" yet.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.config import ConfigError, load_config, parse_config_args
from phalanx.train import TrainConfig, fit

from . import rl_losses as L
from .grpo import (DataSettings, EngineSettings, GRPOLoss, PromptIndices, RLHook, encode_prompts, global_sum,
                   heldout_eval, load_prompt_sets, plot_rl_curves, sample_seed)
from .rewards import RewardSet
from .rollout import RolloutEngine, completion_batch, padded


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
    whiten_advantages: bool = True
    max_logprob_gap: float = 0.5
    gap_jump: float = 20.0

    def validate(self) -> None:
        if self.num_generations < 1 or self.max_new_tokens < 1:
            raise ConfigError("ppo config: num_generations and max_new_tokens must be at least 1")
        if not 0 <= self.lam <= 1 or not 0 <= self.gamma <= 1:
            raise ConfigError(f"ppo config: gamma={self.gamma} and lam={self.lam} must be in [0, 1]")
        if self.vf_coef < 0 or self.kl_coef < 0:
            raise ConfigError("ppo config: vf_coef and kl_coef must be >= 0")


@dataclass
class PPOConfig:
    model: str = ""                   # actor (and reference): "" SmolLM2-135M-Instruct, an HF dir or a checkpoint
    critic: str = ""                  # critic backbone: "" the actor's
    data: DataSettings = field(default_factory=lambda: DataSettings(source="arithmetic"))
    ppo: PPOSettings = field(default_factory=PPOSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(output_dir="runs/chat_rlhf/ppo", lr=1e-6,
                                                                    micro_batch_size=8, precision="auto"))


def load_ppo_config(path: str | None, overrides: list[str] | None = None) -> PPOConfig:
    cfg = load_config(PPOConfig, path, overrides)
    cfg.ppo.validate()
    cfg.train.validate()
    return cfg


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


class PPOLoss(GRPOLoss):
    """fit's loss_fn for PPO (shares rollout, scoring, guard and statistics with GRPO)."""

    def __call__(self, model: nn.Module, batch: dict) -> torch.Tensor:
        s, st = self.s, self.stats
        indices, step, rollout, scores, t0 = self.rollout_and_score(batch)
        score_s = time.perf_counter() - t0

        tb = completion_batch(rollout.prompt_ids, rollout.completion_ids, self.pad_id)
        dev = next(model.parameters()).device
        tb = {k: v.to(dev) for k, v in tb.items()}
        mask = tb["completion_mask"].float()
        T = mask.shape[1]
        logits, values = model(tb["input_ids"], tb["attention_mask"], tb["position_ids"], T + 1)
        logp_all = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        logp = logp_all.gather(-1, tb["input_ids"][:, -T:].unsqueeze(-1)).squeeze(-1) * mask
        values = values[:, :-1].float() * mask  # V at the state before each completion token
        engine_lp = padded(rollout.engine_logprobs, T).to(dev)
        tokens, gap_sum = global_sum([mask.sum().item(), ((logp.detach() - engine_lp).abs() * mask).sum().item()])
        self.guard.check(gap_sum / max(tokens, 1.0), step)

        with torch.no_grad():
            ref = self.reference(input_ids=tb["input_ids"], attention_mask=tb["attention_mask"],
                                 position_ids=tb["position_ids"], logits_to_keep=T + 1, use_cache=False).logits
            ref_lp = torch.log_softmax(ref[:, :-1].float(), -1).gather(
                -1, tb["input_ids"][:, -T:].unsqueeze(-1)).squeeze(-1) * mask
            kl = (engine_lp - ref_lp) * mask  # per-token KL sample of the sampling policy
            rewards = -self.kl.value * kl
            last = (mask.sum(1).long() - 1).clamp(min=0)
            rewards[torch.arange(len(last)), last] += scores.to(dev)
            adv, returns = L.gae(rewards, values.detach(), mask, gamma=s.gamma, lam=s.lam)
            if s.whiten_advantages:
                adv = L.whiten(adv, mask) * mask
        pg, clip = L.policy_loss(logp, engine_lp, adv, mask, clip_low=s.clip, clip_high=s.clip,
                                 token_total=max(tokens, 1.0))
        vf, _ = L.value_loss(values, values.detach(), returns, mask, clip=s.value_clip)
        world = dist.get_world_size() if dist.is_initialized() else 1
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
        lengths = torch.tensor([len(c) for c in rollout.completion_ids])
        st.add(samples=len(scores), reward_sum=float(scores.sum()), reward_sq_sum=float((scores ** 2).sum()),
               groups=len(indices), zero_spread_groups=0.0, completion_tokens=float(lengths.sum()),
               truncated=float(sum(rollout.truncated)), entropy_sum=float(entropy.sum()), kl_sum=float(kl.sum()),
               tokens=float(mask.sum()), clipped_low=float(clip["clipped_low"]),
               clipped_high=float(clip["clipped_high"]),
               gap_sum=float(((logp.detach() - engine_lp).abs() * mask).sum()), generate_s=rollout.generate_s,
               score_s=score_s)
        # value loss is a local token mean: average it over ranks like fit does; pg uses the global token count
        return pg * world + s.vf_coef * vf


class ActorSync:
    """Duck-types the part of RolloutEngine that RLHook calls, syncing only the actor's weights."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine

    def sync(self, model: nn.Module) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            self.engine.llm.load_weights(actor_weights(model), strict=True)
        return time.perf_counter() - t0


def build_ppo(cfg: PPOConfig):
    from transformers import AutoModel

    from phalanx.launch import context

    from .models import load_policy, load_tokenizer, resolve_model_dir
    context()
    if cfg.train.plugin == "hybrid":
        raise ConfigError("train.plugin=hybrid: online RL here trains with data-parallel layouts (ddp, zero1, zero2, "
                          "fsdp, gemini); tensor/pipeline-parallel training of the policy is not wired yet")
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

    settings = _as_grpo_view(s)
    loss = PPOLoss(settings, train_records, train_ids, rewards, rollout_fn,
                   tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0, reference=reference,
                   seed=cfg.train.seed)
    loss.s = s
    loss.kl = L.AdaptiveKLController(s.kl_coef, s.kl_target, s.kl_horizon)
    hook = RLHook(loss, ActorSync(engine), cfg.train.output_dir)
    eval_fn = heldout_eval(engine, heldout_records, heldout_ids, rewards) if heldout_records else None
    return model, tokenizer, train_records, loss, hook, eval_fn, engine


def _as_grpo_view(s: PPOSettings):
    from .grpo import GRPOSettings
    return GRPOSettings(num_generations=s.num_generations, max_new_tokens=s.max_new_tokens,
                        max_logprob_gap=s.max_logprob_gap, gap_jump=s.gap_jump)


def train_ppo(cfg: PPOConfig) -> tuple[Any, RLHook]:
    model, tokenizer, records, loss, hook, eval_fn, _ = build_ppo(cfg)
    try:
        result = fit(cfg.train, model, PromptIndices(len(records)), loss_fn=loss, eval_fn=eval_fn,
                     tokenizer=tokenizer, hooks=[hook])
    finally:
        hook.close()
    return result, hook


def main(argv: list[str] | None = None) -> None:
    cfg, _ = parse_config_args("PPO (actor, critic, reference, reward model) with rollouts on the Phalanx engine",
                               load_ppo_config, argv, example="apps/chat_rlhf/configs/ppo.yaml")
    result, _ = train_ppo(cfg)
    if not dist.is_initialized() or dist.get_rank() == 0:
        png = plot_rl_curves(cfg.train.output_dir, keys=("reward_mean", "kl", "kl_coef"))
        print(f"done: step {result.final_step}, held-out {result.last_eval}, curves {png}")


if __name__ == "__main__":
    main()
