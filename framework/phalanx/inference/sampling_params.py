"""What a request asks of the sampler and the stopping rules, validated up front.

Field names follow OpenAI's completions API where one exists (`n`, `best_of`, `presence_penalty`,
`frequency_penalty`, `logit_bias`, `echo`, `logprobs`, `seed`, `stop`); `max_new_tokens` is
OpenAI's `max_tokens`. OpenAI's chat form `logprobs: true, top_logprobs: N` is `logprobs=N` here
(`logprobs: true` alone is `logprobs=0`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range is [-100, 100]


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output, enforced token by token (`phalanx.inference.structured`):
    exactly one of
    json_schema: the output is a JSON document valid against this schema (a dict);
    json_object: the output is a JSON object, any keys (OpenAI's JSON mode);
    regex: the output matches this regular expression in full;
    grammar: the output is a sentence of this Lark grammar (llguidance's dialect, which can embed
    JSON schemas with `%json {...}`).
    The output ends once the constraint is complete (the model may then only choose EOS).
    """

    json_schema: dict | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json_schema", "regex", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise ValueError(f"a StructuredOutput takes exactly one of json_schema, json_object, regex or grammar, "
                             f"got {given or 'none'}")
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise ValueError(f"json_schema must be a JSON schema object (a dict), got {type(self.json_schema).__name__}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object={self.json_object!r} must be True or False")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")

    def key(self) -> str:
        """A stable text naming the constraint (compiled grammars are cached by it)."""
        import json
        if self.json_schema is not None:
            return "json_schema:" + json.dumps(self.json_schema, sort_keys=True)
        if self.json_object:
            return "json_object"
        return f"regex:{self.regex}" if self.regex is not None else f"grammar:{self.grammar}"


def _check_logit_bias(bias) -> dict[int, float]:
    """{token id: bias}; keys may be ints or decimal strings (as JSON objects carry them)."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias={bias!r} must be a dict mapping token ids to biases")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.strip().isdigit():
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, int) or key < 0:
            raise ValueError(f"logit_bias key {key!r} must be a non-negative token id")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or abs(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias[{key}]={value!r} must be a number in [-100, 100]")
        out[key] = float(value)
    return out


@dataclass(kw_only=True)
class SamplingParams:
    """How to pick tokens and when to stop, per request.

    temperature 0 means greedy (argmax); top_k 0 or -1 and top_p 1.0 disable those filters.
    repetition_penalty follows the CTRL/Hugging Face rule: a logit of a token already in the prompt
    or output is divided by the penalty when positive and multiplied when negative.
    presence_penalty / frequency_penalty follow OpenAI: over the *generated* tokens only,
    logit[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0); each in [-2, 2].
    logit_bias: {token id: bias in [-100, 100]} added to the logits (-100 bans a token in practice).
    Order on the logits: logit_bias, repetition, presence/frequency, EOS ban before
    min_new_tokens, then temperature, top-k, top-p (Hugging Face's processor order).
    n: completions returned per request; best_of (default n): completions sampled, of which the n
    with the highest cumulative log-probability (raw model distribution) are returned. All samples
    of a request share the prompt's KV blocks (the prompt is prefilled once, then forked).
    echo: put the prompt in front of each completion's text, token_ids and (with logprobs) its
    log-probs (the first prompt token has None: nothing predicts it).
    stop: strings that end the output (the text is cut before them); stop_token_ids: extra end
    tokens besides the model's EOS; ignore_eos keeps going past EOS (benchmarks).
    logprobs: None for none; 0 for the log-probability of each chosen token; N > 0 also returns the
    N most likely tokens per step (OpenAI chat's top_logprobs=N). Log-probs are of the model's raw
    distribution (before temperature, top-k/top-p, penalties and biases), which is what RLHF's
    importance ratios compare against.
    processed_logprobs: also return the log-probability of each chosen token under the distribution
    it was actually drawn from (after penalties, temperature, top-k and top-p; 0.0 for greedy).
    seed: a per-request generator, so the same request samples the same tokens in any batch
    (sample j > 0 of an n > 1 request draws from a generator seeded from (seed, j)).
    structured_output: a `StructuredOutput` (or a dict of its fields) the output must satisfy:
    tokens that would break it are masked out after the penalties and before temperature (so
    greedy, sampling, top-k/top-p all pick among allowed tokens only). Not with min_new_tokens
    (the constraint decides where the output ends).
    lora_name: run the request through this loaded LoRA adapter (`LLM.load_lora_adapter`); None: the
    base model. Requests with different adapters share one batch (`phalanx.inference.lora`).
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    n: int = 1
    best_of: int | None = None
    echo: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_new_tokens: int = 0
    logprobs: int | None = None
    processed_logprobs: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None
    lora_name: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_output, dict):
            self.structured_output = StructuredOutput(**self.structured_output)
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise ValueError(f"structured_output must be a StructuredOutput or a dict of its fields, "
                             f"got {type(self.structured_output).__name__}")
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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name}={value!r} must be a number in [-2, 2] (0 disables it)")
        self.logit_bias = _check_logit_bias(self.logit_bias)
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n!r} must be a positive integer")
        if self.best_of is None:
            self.best_of = self.n
        if isinstance(self.best_of, bool) or not isinstance(self.best_of, int) or self.best_of < self.n:
            raise ValueError(f"best_of={self.best_of!r} must be an integer >= n={self.n}")
        if not isinstance(self.echo, bool):
            raise ValueError(f"echo={self.echo!r} must be True or False")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be non-negative token ids")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs={self.logprobs!r} must be None or an integer in [0, {MAX_LOGPROBS}] "
                             "(OpenAI chat's logprobs=true, top_logprobs=N is logprobs=N)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed={self.seed!r} must be an integer")
        if self.lora_name is not None and (not isinstance(self.lora_name, str) or not self.lora_name):
            raise ValueError(f"lora_name={self.lora_name!r} must be None or a loaded adapter's name")
        if self.structured_output is not None and self.min_new_tokens:
            raise ValueError(f"min_new_tokens={self.min_new_tokens} cannot be combined with structured output "
                             "(the constraint decides where the output ends); drop one of them")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def num_samples(self) -> int:
        """Sequences sampled for the request (best_of, which is n unless set higher)."""
        return self.best_of

    @property
    def has_penalties(self) -> bool:
        """Whether the logits are changed before temperature (penalties or biases)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))
