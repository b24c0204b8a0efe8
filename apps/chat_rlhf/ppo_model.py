"""PPO's models: `ActorCritic` (the actor, a critic backbone and a value head trained as one module),
its tensor-parallel shard policy, where the critic starts, and the cache of the frozen trunk."""
from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from phalanx.config import ConfigError

from .rl_logprobs import shifted_logprobs
from .rollout import submodule_weights

HIDDEN_KEYS = ("actor_hidden", "critic_hidden")  # [B, P+T, H] frozen-trunk outputs (cache_frozen_trunk only)


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

    from phalanx.shard.lora_tp import peft_root_prefix
    from phalanx.shard.policy import policy_for, rooted_policy

    base = policy_for(actor)  # a LoRA actor keeps its Hugging Face model one level further down
    return replace_fields(rooted_policy(base, "actor." + peft_root_prefix(actor)), family=f"{base.family} actor-critic",
                          model_types=(f"{actor.config.model_type}-actor-critic",))


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
    logp, entropy = shifted_logprobs(logits, batch["input_ids"][:, -T:], mask, with_entropy=True)
    return logp, values[:, :-1].float() * mask, entropy


