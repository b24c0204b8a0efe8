"""What a request asks of the sampler and the stopping rules, validated up front."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class SamplingParams:
    """How to pick tokens and when to stop, per request.

    temperature 0 means greedy (argmax); top_k 0 or -1 and top_p 1.0 disable those filters.
    repetition_penalty follows the CTRL/Hugging Face rule: a logit of a token already in the prompt
    or output is divided by the penalty when positive and multiplied when negative.
    stop: strings that end the output (the text is cut before them); stop_token_ids: extra end
    tokens besides the model's EOS; ignore_eos keeps going past EOS (benchmarks).
    logprobs: None for none; 0 for the log-probability of each chosen token; N > 0 also returns the
    N most likely tokens per step. Log-probs are of the model's raw distribution (before
    temperature, top-k/top-p and penalties), which is what RLHF's importance ratios compare against.
    processed_logprobs: also return the log-probability of each chosen token under the distribution
    it was actually drawn from (after penalties, temperature, top-k and top-p; 0.0 for greedy).
    seed: a per-request generator, so the same request samples the same tokens in any batch.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_new_tokens: int = 0
    logprobs: int | None = None
    processed_logprobs: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be a positive integer")
        if not isinstance(self.min_new_tokens, int) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens={self.min_new_tokens!r} must be between 0 and max_new_tokens")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= -1 (0 or -1 disable it)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0 (1.0 disables it)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be non-negative token ids")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs={self.logprobs!r} must be None or an integer in [0, 20]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an integer")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0
