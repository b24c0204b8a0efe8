"""What the engine hands back for a request."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestOutput:
    """A request's output so far (`finished` False while streaming) or in full.

    token_ids are the generated tokens (an EOS that ended the output is included, as in
    `transformers.generate`); text is their decoding, cut before a matched stop string.
    logprobs[i] is the raw-model log-probability of token_ids[i] and top_logprobs[i] maps the most
    likely token ids to theirs (only when the request asked for log-probs).
    processed_logprobs[i] is the log-probability of token_ids[i] under the distribution it was drawn
    from (after penalties, temperature, top-k/top-p; only with `processed_logprobs=True`).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None  # "stop" (EOS, stop token or stop string) or "length"
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    processed_logprobs: list[float | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else float(sum(self.logprobs))
