"""Tensor parallelism for Hugging Face models, driven by per-family shard policies.

- `policy`: the `Policy` dataclass, `register_policy`, `policy_for(model)`, `supported_families()`;
  the built-in policies are part of each family in `phalanx.models` (Llama, Mistral, Qwen2, Qwen3, GPT-2, OPT);
- `tensor_parallel`: `apply_tp(model, policy, group=...)` and the `TPPlan` it returns;
- `layers`: the column/row-parallel linears, vocabulary-parallel embedding and LM head;
- `loss`: vocabulary-parallel cross-entropy and the causal-LM loss a split model uses;
- `spec`: how one parameter is split (`ShardSpec`), `comm`: differentiable collectives;
- `state`: full (Hugging Face layout) state dicts and optimizer fragments of a split model;
- `grads`: gradient synchronisation and clipping over tensor-parallel shards.

See docs/hybrid.md.
"""
from phalanx.shard.loss import CausalLMLoss, vocab_parallel_cross_entropy
from phalanx.shard.policy import HeadCounts, Policy, policy_for, register_policy, supported_families
from phalanx.shard.spec import REPLICATED, ShardSpec
from phalanx.shard.tensor_parallel import TPPlan, apply_tp, check_heads

__all__ = ["CausalLMLoss", "vocab_parallel_cross_entropy", "HeadCounts", "Policy", "policy_for", "register_policy",
           "supported_families", "REPLICATED", "ShardSpec", "TPPlan", "apply_tp", "check_heads"]
