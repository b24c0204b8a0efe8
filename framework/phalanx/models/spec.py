"""`ModelSpec`: the one description of a decoder-only model's shape that training's shard
policies, the planner and the inference engine all read. A family's reader (`phalanx.models.<family>`)
fills it from a Hugging Face config; the parameter counts here are checked against
`sum(p.numel())` of the transformers model (tests/framework/test_model_families.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from phalanx.models.heads import HeadCounts


@dataclass(frozen=True)
class ModelSpec:
    """family: the family's name ("llama", "gpt2", ...). Sizes: vocab_size, hidden_size,
    intermediate_size (MLP width), num_layers, num_heads, num_kv_heads, head_dim.
    tie_word_embeddings: the LM head is the token embedding. norm: "rms" (RMSNorm) or "layer"
    (LayerNorm with bias), norm_eps. gated_mlp: SwiGLU-style gate/up/down (else up/down);
    activation: the HF name of the MLP activation. Biases: qkv_bias (q/k/v projections), o_bias
    (output projection), mlp_bias. qk_norm: RMSNorm over each head's q and k (Qwen3).
    positions: "rope" or "learned" (a table added to the token embeddings, whose row of position
    0 is position_offset: OPT 2); max_position_embeddings. embed_dim: token-embedding width when
    it differs from hidden_size (OPT's project_in/out). final_norm: a norm after the last layer.
    sliding_windows: per layer, a window length or None. config: the HF config it was read from
    (RoPE tables are computed from it); name: a label for reports.
    Mixture of experts (0 / empty for dense models): num_experts routed experts per sparse layer,
    experts_per_token (top-k), expert_size (each expert's SwiGLU width), shared_expert_size
    (an always-on SwiGLU beside them, 0 if none) and shared_expert_gate (its sigmoid gate, a
    [1, hidden] weight: Qwen2-MoE), norm_topk_prob (the top-k routing weights renormalised to sum
    to 1), sparse_layers (per layer: True where the MLP is the expert block; the others are dense
    MLPs of intermediate_size). shared_expert_bias: the shared expert's projections carry biases
    (DeepSeek-V2 with mlp_bias).
    Multi-head latent attention (DeepSeek-V2/V3; kv_lora_rank 0: not MLA): queries through a
    low-rank q_a_proj (hidden -> q_lora_rank), its RMSNorm and the per-head q_b_proj, or with
    q_lora_rank 0 one per-head q_proj; keys and values from kv_a_proj_with_mqa (hidden ->
    kv_lora_rank + qk_rope_head_dim, the rope part shared by every head), its RMSNorm over the
    kv_lora_rank part, and the per-head kv_b_proj (kv_lora_rank -> heads · (qk_nope_head_dim +
    v_head_dim)); o_proj reads heads · v_head_dim. head_dim is then the query/key head width
    qk_nope_head_dim + qk_rope_head_dim, num_kv_heads = num_heads; o_bias (the config's
    attention_bias) gives q_a_proj, kv_a_proj_with_mqa and o_proj biases."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    gated_mlp: bool = True
    activation: str = "silu"
    norm: str = "rms"
    positions: str = "rope"
    position_offset: int = 0
    embed_dim: int | None = None
    final_norm: bool = True
    sliding_windows: tuple = ()
    num_experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0
    shared_expert_size: int = 0
    shared_expert_gate: bool = False
    norm_topk_prob: bool = False
    sparse_layers: tuple = ()
    shared_expert_bias: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    name: str = "model"
    config: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if not self.sparse_layers:
            object.__setattr__(self, "sparse_layers", (self.num_experts > 0,) * self.num_layers)
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} must be between 1 and "
                             f"num_experts={self.num_experts}")

    # ---- derived shapes ------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return any(self.sparse_layers)

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank > 0

    @property
    def heads(self) -> HeadCounts:
        return HeadCounts(self.num_heads, self.num_kv_heads, self.head_dim)

    @property
    def rope(self) -> bool:
        return self.positions == "rope"

    @property
    def norm_bias(self) -> bool:
        return self.norm == "layer"

    @property
    def embedding_width(self) -> int:
        return self.embed_dim or self.hidden_size

    @property
    def projects_embeddings(self) -> bool:
        return self.embedding_width != self.hidden_size

    @property
    def position_table(self) -> int:
        """Rows of the learned position table (0 with RoPE)."""
        return 0 if self.rope else self.max_position_embeddings + self.position_offset

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    # ---- parameter counts ----------------------------------------------------------------------
    def projection_params(self) -> int:
        """OPT's project_in and project_out (no biases), 0 without them."""
        return 2 * self.hidden_size * self.embedding_width if self.projects_embeddings else 0

    def embedding_params(self) -> int:
        return (self.vocab_size * self.embedding_width + self.position_table * self.hidden_size
                + self.projection_params())

    def head_params(self) -> int:
        """The LM head's own weight (0 when tied to the embedding)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.embedding_width

    def norm_params(self) -> int:
        return self.hidden_size * (2 if self.norm_bias else 1)

    def final_norm_params(self) -> int:
        return self.norm_params() if self.final_norm else 0

    def attention_params(self) -> int:
        if self.mla:
            return self.mla_params()
        h, q, kv = self.hidden_size, self.q_dim, self.kv_dim
        n = h * q + 2 * h * kv + q * h
        n += (q + 2 * kv) if self.qkv_bias else 0
        n += h if self.o_bias else 0
        n += 2 * self.head_dim if self.qk_norm else 0
        return n

    def mla_params(self) -> int:
        """Multi-head latent attention: the query path (q_a_proj, its norm and q_b_proj, or one
        q_proj), kv_a_proj_with_mqa, its norm, kv_b_proj and o_proj."""
        h, heads, bias = self.hidden_size, self.num_heads, self.o_bias
        rope, rq, rkv = self.qk_rope_head_dim, self.q_lora_rank, self.kv_lora_rank
        qk = self.qk_nope_head_dim + rope
        n = (h * rq + (rq if bias else 0) + rq + rq * heads * qk) if rq else h * heads * qk
        n += h * (rkv + rope) + ((rkv + rope) if bias else 0) + rkv
        n += rkv * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return n + heads * self.v_head_dim * h + (h if bias else 0)

    def mlp_params(self) -> int:
        h, f = self.hidden_size, self.intermediate_size
        if self.gated_mlp:
            return 3 * h * f + ((2 * f + h) if self.mlp_bias else 0)
        return 2 * h * f + ((f + h) if self.mlp_bias else 0)

    def expert_params(self) -> int:
        """One routed expert: gate, up and down projections of width expert_size, no biases."""
        return 3 * self.hidden_size * self.expert_size

    def shared_expert_params(self) -> int:
        h, f = self.hidden_size, self.shared_expert_size
        n = 3 * h * f + (h if self.shared_expert_gate else 0)
        return n + ((2 * f + h) if self.shared_expert_bias and f else 0)

    def moe_params(self, active: bool = False) -> int:
        """A sparse layer's expert block: the router ([experts, hidden]), the routed experts (all
        of them, or the experts_per_token one token passes through when `active`) and the shared
        expert with its gate."""
        routed = self.experts_per_token if active else self.num_experts
        return self.num_experts * self.hidden_size + routed * self.expert_params() + self.shared_expert_params()

    def layer_params(self, i: int = 0, active: bool = False) -> int:
        """Parameters of decoder layer `i` (all of them, or those one token uses when `active`)."""
        mlp = self.moe_params(active) if self.sparse_layers[i] else self.mlp_params()
        return self.attention_params() + mlp + 2 * self.norm_params()

    def layers_params(self, active: bool = False) -> int:
        return sum(self.layer_params(i, active) for i in range(self.num_layers))

    def total_params(self) -> int:
        return self.embedding_params() + self.layers_params() + self.final_norm_params() + self.head_params()

    def active_params(self) -> int:
        """Parameters one token uses: the total less the routed experts it is not sent to (equal to
        total_params for a dense model)."""
        return (self.embedding_params() + self.layers_params(active=True) + self.final_norm_params()
                + self.head_params())

    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (the 6·N of training FLOPs): layers
        (for mixtures of experts the router, the top-k experts and the shared expert: the
        active ones), the LM head (tied or not) and OPT's projections, not the embedding lookups."""
        return self.layers_params(active=True) + self.vocab_size * self.embedding_width + self.projection_params()
