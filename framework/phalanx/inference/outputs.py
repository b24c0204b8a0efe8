"""What the engine hands back for a request: one `RequestOutput` holding its completions.

A request with n > 1 has n `CompletionOutput`s in `outputs` (index 0..n-1). For the common n == 1
case the request-level fields (`text`, `token_ids`, `logprobs`, `finish_reason`, …) are those of
`outputs[0]`, so `engine.generate(prompts)[i].text` keeps working; with n > 1 they still describe
`outputs[0]` only.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One sample of a request (`finished` False while streaming).

    token_ids are the generated tokens (an EOS that ended the output is included, as in
    `transformers.generate`); text is their decoding, cut before a matched stop string. With
    `echo`, the prompt's tokens and text come first, and with logprobs the prompt's log-probs too
    (None for the first prompt token). logprobs[i] is the raw-model log-probability of
    token_ids[i]; top_logprobs[i] maps the most likely token ids to theirs (only when the request
    asked for log-probs). processed_logprobs[i] is the log-probability of the generated token i
    under the distribution it was drawn from (only with `processed_logprobs=True`; never echoed).
    cumulative_logprob: sum of the raw log-probs of the generated tokens (set when log-probs were
    computed: with `logprobs`, or with best_of > n, where it ranks the samples).
    """

    index: int
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS, stop token or stop string), "length", "abort" or "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[float | None] | None = None
    top_logprobs: list[dict[int, float] | None] | None = None
    processed_logprobs: list[float | None] | None = None
    cumulative_logprob: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None


@dataclass
class RequestOutput:
    """A request's output so far (`finished` False while streaming) or in full.

    `outputs` holds its n completions; the fields from `token_ids` to `processed_logprobs` mirror
    `outputs[0]` (the n == 1 API). `error`: the cause, when a step failed for this request (its
completions then end with finish_reason "error"). `prompt_logprobs` (with echo + logprobs): the log-prob of each
    prompt token after the first, given the ones before it.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[float | None] | None = None
    top_logprobs: list[dict[int, float] | None] | None = None
    processed_logprobs: list[float | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[dict[int, float]] | None = None
    error: str | None = None  # why the engine failed this request (finish_reason "error"), else None

    @classmethod
    def of(cls, request_id: str, prompt: str | None, prompt_token_ids: list[int], outputs: list[CompletionOutput],
           **request_fields) -> "RequestOutput":
        """A request output whose n == 1 fields are those of outputs[0]."""
        first = outputs[0]
        finished = all(o.finished for o in outputs)
        starts = [o.first_token_time for o in outputs if o.first_token_time is not None]
        ends = [o.finish_time for o in outputs if o.finish_time is not None]
        return cls(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
                   token_ids=first.token_ids, text=first.text, finished=finished,
                   finish_reason=first.finish_reason, stop_reason=first.stop_reason, logprobs=first.logprobs,
                   top_logprobs=first.top_logprobs, processed_logprobs=first.processed_logprobs,
                   first_token_time=min(starts, default=None), finish_time=max(ends) if finished and ends else None,
                   outputs=outputs,
                   **request_fields)

    @property
    def cumulative_logprob(self) -> float | None:
        if self.outputs and self.outputs[0].cumulative_logprob is not None:
            return self.outputs[0].cumulative_logprob
        return None if self.logprobs is None else float(sum(x for x in self.logprobs if x is not None))
