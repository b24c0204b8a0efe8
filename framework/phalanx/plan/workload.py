"""What is trained (batch, sequence, precision) and on what (memory, speed, links)."""
from __future__ import annotations

import dataclasses

from phalanx.amp.precision import BF16, Precision, precision_named
from phalanx.plan.lora import LoRA


@dataclasses.dataclass(frozen=True)
class Workload:
    """seq: tokens per sample; micro_batch: samples per forward on one data-parallel rank (a
    pipeline microbatch under pp); global_batch: samples per optimizer step over all ranks
    (default micro_batch × dp: no accumulation); dtype: the compute precision, a `Precision` or
    its name (bf16/fp16 keep fp32 masters; no `auto`: the planner sizes other machines); loss:
    "hf" (the model's own loss, full fp32 logits) or "fused" (phalanx.train's chunked head +
    cross-entropy: no full logits); bucket_mb: ZeRO's reduce bucket; gemini_chunk_mb:
    Gemini's chunk size (MiB of the compute dtype); lora: low-rank adapters instead of full
    fine-tuning (a `phalanx.plan.lora.LoRA`, a dict {rank, target_modules} or a recipe's `lora:`
    section; None: every parameter trains): gradients and optimizer state are the adapters', the
    frozen base is held in the compute dtype, activations are unchanged."""
    seq: int = 2048
    micro_batch: int = 1
    global_batch: int | None = None
    dtype: Precision = BF16
    loss: str = "fused"
    bucket_mb: float = 25.0
    gemini_chunk_mb: float | None = None  # None: searched as GeminiPlugin does
    lora: LoRA | None = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", precision_named(self.dtype))  # a name becomes its Precision
        object.__setattr__(self, "lora", LoRA.of(self.lora))
        if self.loss not in ("hf", "fused"):
            raise ValueError(f"loss={self.loss!r}: use 'hf' or 'fused'")
        if self.seq < 1 or self.micro_batch < 1:
            raise ValueError(f"seq={self.seq} and micro_batch={self.micro_batch} must be at least 1")

    @property
    def p(self) -> int:
        """Bytes per element of the compute dtype."""
        return self.dtype.compute_dtype.itemsize

    @property
    def mixed(self) -> bool:
        return self.dtype.mixed

    def steps_per_batch(self, dp: int) -> int:
        """Microbatches (accumulation steps, or pipeline microbatches) per optimizer step per dp rank."""
        if self.global_batch is None:
            return 1
        per_rank = self.global_batch / dp
        m = per_rank / self.micro_batch
        if m != int(m) or m < 1:
            raise ValueError(f"global batch {self.global_batch} does not split into dp={dp} ranks × micro batch "
                             f"{self.micro_batch}: make it a multiple of {dp * self.micro_batch}")
        return int(m)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """device_memory / host_memory: bytes per rank (host: this rank's share of the node's RAM);
    peak_flops: one device's dense peak in the compute dtype; efficiency: the fraction of it a
    training step reaches (MFU); bandwidth: bytes/s of one rank's link for collectives;
    host_bandwidth: device↔host copies (offload); reserve: device memory the estimate does not
    model (CUDA context, NCCL, allocator fragmentation)."""
    device_memory: int
    host_memory: int | None = None
    peak_flops: float = 989e12
    efficiency: float = 0.45
    bandwidth: float = 100e9
    host_bandwidth: float = 25e9
    reserve: int = 2 * 2**30
