"""The engine's own settings (not the model's): batch limits, KV-cache geometry and budget.

One typed, keyword-only dataclass, validated when it is made, so a bad value stops before any
weights load. Memory is budgeted, not derived from lengths: the KV cache gets as many blocks as
the budget holds (free device memory on GPU, `kv_cache_memory_gib` on CPU), and sequences share
them on demand.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Settings of an `LLM` engine.

    max_num_seqs: sequences in flight at once (the decode batch).
    block_size: tokens per KV-cache block.
    tp_size: tensor-parallel ranks the model is split over (1 = no TP).
    max_num_batched_tokens: tokens one step may run (prefill chunks + decodes); longer prompts are
        prefilled in chunks over several steps.
    max_model_len: prompt + output tokens per sequence; default the model's max positions.
    kv_cache_memory_gib: KV-cache budget on CPU (per rank).
    gpu_memory_utilization: share of the GPU the engine may fill (weights + activations + cache).
    num_blocks: force the number of KV blocks (tests use it to provoke preemption).
    dtype: "auto" (the hardware's fastest: bfloat16 on CUDA with bf16 and on CPUs whose bf16 matmul
        beats fp32 (AMX), float32 elsewhere, whatever the checkpoint's dtype; the rule of
        `precision: auto`), "float32", "bfloat16" or "float16".
    enable_prefix_caching: reuse the KV blocks of identical prompt prefixes.
    num_speculative_tokens: tokens proposed per sequence and step (with a draft model or n-gram lookup).
    prompt_lookup_max / prompt_lookup_min: n-gram speculation without a draft model (0: off): the
        sequence's last n tokens, n from max down to min, are looked up among its earlier tokens
        and what followed them is proposed (`phalanx.inference.ngram`). Exclusive with a draft model.
    seed: seeds requests that bring no seed of their own (request i gets seed + i).
    compile: run the model step through torch.compile ("auto": on CUDA when a working compiler is
        found and the model is not tiny — on CPU "auto" stays eager, where compiling measured no
        faster; True: whenever the compiler works, CPU included; False: eager).
    cuda_graphs: run decode steps as captured CUDA graphs, one per batch size ("auto": on CUDA for
        dense models without tensor parallelism, LoRA adapters included; True: the same, an error where impossible;
        False: every step eager). See `phalanx.inference.cuda_graphs`.
    """

    max_num_seqs: int = 64
    block_size: int = 16
    tp_size: int = 1
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    kv_cache_memory_gib: float = 1.0
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None
    dtype: str = "auto"
    enable_prefix_caching: bool = True
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 1
    seed: int = 0
    compile: bool | str = "auto"
    cuda_graphs: bool | str = "auto"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "block_size", "tp_size", "max_num_batched_tokens", "num_speculative_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name}={value!r} must be a positive integer")
        if self.prompt_lookup_max and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"EngineConfig.prompt_lookup_min={self.prompt_lookup_min} and prompt_lookup_max="
                             f"{self.prompt_lookup_max}: n-gram speculation needs 1 <= min <= max (max 0: off)")
        if self.prompt_lookup_max < 0:
            raise ValueError(f"EngineConfig.prompt_lookup_max={self.prompt_lookup_max} must be 0 (off) or positive")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"EngineConfig.block_size={self.block_size} must be a power of two (8, 16, 32, …)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len={self.max_model_len} must be at least 2")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"EngineConfig.kv_cache_memory_gib={self.kv_cache_memory_gib} must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"EngineConfig.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"EngineConfig.num_blocks={self.num_blocks} must be at least 2")
        if self.compile not in ("auto", True, False):
            raise ValueError(f"EngineConfig.compile={self.compile!r}: choose 'auto', True or False")
        if self.cuda_graphs not in ("auto", True, False):
            raise ValueError(f"EngineConfig.cuda_graphs={self.cuda_graphs!r}: choose 'auto', True or False")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"EngineConfig.dtype={self.dtype!r}: choose auto, float32, bfloat16 or float16")
