"""Gemini's chunks, from the model's parameter sizes in model order: parameters are laid into
chunks of one capacity in order, a chunk closes when the next parameter does not fit, a
parameter larger than the capacity gets a chunk of its own, and each chunk is its contents
rounded up to a multiple of the world size (`phalanx.gemini.chunk`, whose packing and search
this uses). With no size given, Gemini searches 8–64 MiB (1 MiB steps) for the tightest
packing; so does this."""
from __future__ import annotations

from phalanx.models import ModelSpec
from phalanx.models.heads import kv_weight_heads

SEARCH_MIB = (8, 64, 1)


def parameter_numels(spec: ModelSpec, tp: int = 1) -> list[int]:
    """Sizes of the parameter tensors in the order transformers registers them (Llama layout:
    embedding; per layer q, k, v, o (+ biases, + Qwen3's q/k norms), gate, up, down, two norms;
    final norm; LM head unless tied), split over tp where tensor parallelism splits them."""
    h, f, hd = spec.hidden_size, spec.intermediate_size // tp, spec.head_dim
    q = spec.q_dim // tp
    kv = kv_weight_heads(spec.heads, tp) * hd
    vocab = -(-spec.vocab_size // tp)
    out = [vocab * h] + ([spec.position_table * h] if spec.position_table else [])
    for i in range(spec.num_layers):
        if getattr(spec, "mla", False):  # multi-head latent attention: its projections and two norms
            from phalanx.plan.lora import attention_shapes

            out += [fan_in * fan_out for fan_in, fan_out in attention_shapes(spec, tp).values()]
            out += ([spec.q_lora_rank] if spec.q_lora_rank else []) + [spec.kv_lora_rank]
        else:
            for rows, bias in ((q, spec.qkv_bias), (kv, spec.qkv_bias), (kv, spec.qkv_bias)):
                out += [rows * h] + ([rows] if bias else [])
            out += [q * h] + ([h] if spec.o_bias else [])
            out += [hd, hd] if spec.qk_norm else []
        if spec.sparse_layers[i]:
            out += _expert_block_numels(spec)
        else:
            for size, bias in ((h * f, f), (h * f, f), (f * h, h))[: 3 if spec.gated_mlp else 2]:
                out += [size] + ([bias] if spec.mlp_bias else [])
        out += [h, h] * (2 if spec.norm_bias else 1)
    out += [h] * (2 if spec.norm_bias else 1)
    if not spec.tie_word_embeddings:
        out.append(vocab * h)
    return out


def _expert_block_numels(spec: ModelSpec) -> list[int]:
    """An expert block, whole on every tp rank: router, fused experts' gate_up and down, then the
    shared expert's gate/up/down and its sigmoid gate (Mixtral / Qwen2-MoE order; Qwen3-MoE
    registers the router after the experts, which moves one small tensor)."""
    h, e, i, s = spec.hidden_size, spec.num_experts, spec.expert_size, spec.shared_expert_size
    out = [e * h, e * 2 * i * h, e * h * i]
    out += [h * s, h * s, s * h] if s else []
    return out + ([h] if spec.shared_expert_gate else [])


def chunked_numel(numels: list[int], chunk: int, world: int) -> int:
    """Elements of all chunks together, padding (< world a chunk) included."""
    from phalanx.gemini.chunk import padding

    return sum(numels) + padding(list(numels), chunk, world)


def gemini_chunks(spec: ModelSpec, world: int, itemsize: int, chunk_mb: float | None, tp: int = 1,
                  numels: list[int] | None = None) -> tuple[int, int]:
    """(chunk size in elements, elements of all chunks with padding) for Gemini on `world` ranks;
    `numels`: the tensors that go into chunks when not every parameter does (LoRA: the adapters)."""
    from phalanx.gemini.chunk import search_chunk_size

    numels = parameter_numels(spec, tp) if numels is None else numels
    if not numels:
        return max(world, 1), 0
    if chunk_mb is not None:
        chunk = max(world, int(chunk_mb * 2**20) // itemsize)
    else:
        lo, hi, step = (x * 2**20 // itemsize for x in SEARCH_MIB)
        chunk = search_chunk_size(numels, lo, hi, step, world)
    return chunk, chunked_numel(numels, chunk, world)
