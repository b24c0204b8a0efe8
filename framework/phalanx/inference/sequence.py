"""One request's state as it moves through the engine: tokens, KV blocks, progress, outputs.

`num_computed_tokens` counts the tokens whose keys and values are already in the cache; the
scheduler runs the rest (a whole prompt, a chunk of it, or the one newest token when decoding).
Preemption by recompute just frees the blocks and sets it back to 0: prompt and generated tokens
are kept, so the sequence resumes where it stopped, and with prefix caching most of its blocks are
usually found again.

A request with `best_of` > 1 starts as one sequence; when its prompt is done the engine forks it
into `best_of` samples (`index` 0 is the original) that share the prompt's full KV blocks.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from phalanx.inference.detokenize import IncrementalText
from phalanx.inference.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    index: int = 0  # which of the request's samples this is

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []  # content hash of each full block of token_ids (prefix cache)
        self.num_registered_blocks = 0  # leading blocks of block_table published to the prefix cache
        self.num_cached_prompt_tokens = 0  # prefix-cache hits at the (last) admission
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.processed_logprobs: list[float | None] = []
        self.num_pending_forks = 0  # samples still to be forked off this one when its prompt is done
        self.cumulative_logprob = 0.0  # sum of the raw log-probs of the output tokens (tracked for best_of)
        # echo with logprobs: log-prob of prompt token i + 1 given tokens 0..i, and its top tokens
        self.wants_prompt_logprobs = self.params.echo and self.params.logprobs is not None
        self.prompt_logprobs: list[float] = []
        self.prompt_top_logprobs: list[dict[int, float]] = []
        self.text = ""  # detokenized output, cut at a stop string when one matched
        self.detokenizer = IncrementalText()  # builds `text` a few tokens at a time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_preemptions = 0
        # Fault isolation: a sequence of a failed step with others in it runs alone until it
        # samples again (`Scheduler.schedule`); `error` names the cause when its own step failed.
        self.suspect = False
        self.error: str | None = None
        # Structured output: a `structured.Grammar` (set by the engine) that masks this sequence's
        # sampling and advances with each appended token.
        self.grammar = None
        # LoRA: the slot of the request's adapter in the stacked factors (0: the base model), and
        # the prefix-cache key seed of that adapter (b"": the base), set by the engine.
        self.lora_slot = 0
        self.cache_salt = b""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        """More than the newest token is missing from the cache (a prompt, or a recompute)."""
        return self.num_uncomputed_tokens > 1

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt log-probs are still being collected (every prompt position must run, no prefix cache)."""
        return self.wants_prompt_logprobs and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
