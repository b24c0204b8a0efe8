"""Model families, each described once: how its Hugging Face config reads into a `ModelSpec`,
its tensor-parallel shard policy, its checkpoint weight names and the flags the inference engine
runs it with (docs/models.md). The lowest layer of the framework's model knowledge: it imports
torch and transformers and nothing from the rest of phalanx; `phalanx.shard`, `phalanx.plan`
and `phalanx.inference` read it.

- `ModelSpec` (spec.py): shapes, flags and exact parameter counts (total and, for mixtures of
  experts, active);
- `heads` (heads.py): the tensor-parallel head rule (split or replicated key/value heads);
- `Family` (family.py), `Policy` (policy.py), `NameTable`/`Piece` (names.py);
- one file per family: llama, mistral, qwen2, qwen3, gpt2, opt, and the mixtures of experts
  mixtral, qwen2_moe, qwen3_moe (shared parts in moe.py) and deepseek (DeepSeek-V2 and -V3:
  multi-head latent attention); `registry`: the list of them;
- `routers` (routers.py): the hooks on mixture-of-experts routers and the per-row sums of the
  router losses, shared by expert, pipeline and sequence parallelism.
"""
from phalanx.models.family import Family
from phalanx.models.heads import HeadCounts, head_problem, local_heads
from phalanx.models.llama import rope_parameters
from phalanx.models.policy import Policy
from phalanx.models.registry import FAMILIES, SUPPORTED, family_of, spec_from_config
from phalanx.models.spec import ModelSpec

__all__ = ["FAMILIES", "SUPPORTED", "Family", "HeadCounts", "ModelSpec", "Policy", "family_of", "head_problem",
           "local_heads", "rope_parameters", "spec_from_config"]
