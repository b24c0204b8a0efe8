"""Rewards for online RL: built-in verifiers, a trained reward model, or a user function.

Every reward is called with keyword arguments, TRL-style, and returns one number per completion:

    fn(prompts=list[list[message]], completions=list[str], ground_truth=list[str | None]) -> list[float]

Built-ins: `numeric` (GSM8K-style: the number after "####", else in \\boxed{}, else the last number
of the reply, compared with the ground truth numerically), `numeric_first` (the first number of
the reply: a strict "answer first" check), `exact` (whitespace- and case-insensitive string match),
`format` (the reply is <think>…</think> then <answer>…</answer>). A reward model is given as
`rm:<directory>` (a sequence-classification export, e.g. from `train_rm`); any other function as
`module:function` (importable from the working directory). `RewardSet` combines several with
weights and checks what each returns, so a broken reward stops the run with its name.
"""
from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from phalanx.device import current_device, to_device

RewardFn = Callable[..., Sequence[float]]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def first_number(text: str | None) -> float | None:
    """The first number of a text (commas and dollar signs dropped), None if it has none: what
    `numeric_first` compares with the ground truth."""
    if text is None:
        return None
    match = _NUMBER.search(str(text).replace(",", "").replace("$", ""))
    return float(match.group()) if match else None


def extract_answer(text: str) -> float | None:
    """The final numeric answer of a GSM8K-style reply (see the module docstring for the order)."""
    text = text.replace(",", "")
    for pattern in (r"####\s*(-?[\d.]+)", r"\\boxed\{([^}]*)\}", r"<answer>(.*?)</answer>"):
        found = re.findall(pattern, text, flags=re.DOTALL)
        if found:
            return first_number(found[-1])
    numbers = _NUMBER.findall(text)
    return float(numbers[-1]) if numbers else None


def _same(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and math.isclose(a, b, rel_tol=0, abs_tol=1e-6)


def _need_truth(ground_truth: Sequence[str | None], name: str) -> None:
    if any(g is None for g in ground_truth):
        raise ValueError(f"reward {name!r} needs a ground truth for every prompt: give the prompt records a "
                         "'ground_truth' or 'answer' column")


def numeric(*, completions: Sequence[str], ground_truth: Sequence[str | None], **_: Any) -> list[float]:
    _need_truth(ground_truth, "numeric")
    return [float(_same(extract_answer(c), first_number(_gsm8k_truth(g)))) for c, g in zip(completions, ground_truth)]


def numeric_first(*, completions: Sequence[str], ground_truth: Sequence[str | None], **_: Any) -> list[float]:
    _need_truth(ground_truth, "numeric_first")
    return [float(_same(first_number(c), first_number(_gsm8k_truth(g)))) for c, g in zip(completions, ground_truth)]


def exact(*, completions: Sequence[str], ground_truth: Sequence[str | None], **_: Any) -> list[float]:
    _need_truth(ground_truth, "exact")
    return [float(" ".join(c.split()).casefold() == " ".join(str(g).split()).casefold())
            for c, g in zip(completions, ground_truth)]


def format_tags(*, completions: Sequence[str], **_: Any) -> list[float]:
    return [float(bool(_FORMAT.match(c))) for c in completions]


def _gsm8k_truth(truth: str | None) -> str | None:
    """GSM8K's answer column ends in '#### 42'; a plain ground truth passes through."""
    if truth is not None and "####" in truth:
        return truth.rsplit("####", 1)[1]
    return truth


BUILTIN: dict[str, RewardFn] = {"numeric": numeric, "numeric_first": numeric_first, "exact": exact,
                                "format": format_tags}


class RewardModelScorer:
    """Scores (prompt, completion) with a sequence-classification reward model: the logit of its
    single output on the chat-formatted conversation."""

    def __init__(self, path: str | Path, *, batch_size: int = 16, device: str | torch.device | None = None) -> None:
        """`device`: where the model scores; default this process's accelerator (the run's GPU), else the CPU."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        from .models import from_pretrained, resolve_model_dir
        try:
            path = resolve_model_dir(path)  # an HF directory, a checkpoint, or train_rm's output_dir
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"reward model: {exc}; train one with `python -m apps.chat_rlhf.train_rm`") from exc
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = from_pretrained(AutoModelForSequenceClassification, path)
        device = torch.device(device) if device is not None else current_device()
        self.model = model.to(device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model {str(path)!r} has num_labels={self.model.config.num_labels}; a reward "
                             "model has one output")
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size, self.device = batch_size, device

    @torch.no_grad()
    def __call__(self, *, prompts: Sequence[list[dict]], completions: Sequence[str], **_: Any) -> list[float]:
        texts = [self.tokenizer.apply_chat_template(list(p) + [{"role": "assistant", "content": c}], tokenize=False)
                 for p, c in zip(prompts, completions)]
        scores: list[torch.Tensor] = []
        for i in range(0, len(texts), self.batch_size):
            enc = to_device(dict(self.tokenizer(texts[i:i + self.batch_size], return_tensors="pt", padding=True)),
                            self.device)
            scores.append(self.model(**enc).logits[:, 0].float())
        return torch.cat(scores).tolist() if scores else []  # one device->host copy for the whole call


def resolve_reward(spec: str) -> RewardFn:
    """A reward from its name: a built-in, `rm:<directory>`, or `module:function`."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if spec.startswith("rm:"):
        return RewardModelScorer(spec[3:])
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"reward {spec!r}: cannot import module {module_name!r} ({exc}); it must be importable "
                             "from the working directory or the Python path") from exc
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise ValueError(f"reward {spec!r}: module {module_name!r} has no function {attr!r}")
        return fn
    raise ValueError(f"unknown reward {spec!r}: choose one of {sorted(BUILTIN)}, 'rm:<reward model directory>' or "
                     "'module:function'")


class RewardError(RuntimeError):
    """A reward function failed or returned something that is not one finite number per completion."""


@dataclass
class RewardSet:
    """Weighted sum of rewards, each checked for shape and finiteness."""

    names: list[str]
    fns: list[RewardFn]
    weights: list[float]

    @classmethod
    def from_specs(cls, specs: Sequence[str], weights: Sequence[float] | None = None) -> "RewardSet":
        if not specs:
            raise ValueError("no reward given: set rewards to e.g. ['numeric'] or ['module:function']")
        weights = list(weights) if weights else [1.0] * len(specs)
        if len(weights) != len(specs):
            raise ValueError(f"{len(weights)} reward_weights for {len(specs)} rewards {list(specs)}")
        return cls(list(specs), [resolve_reward(s) for s in specs], [float(w) for w in weights])

    def __call__(self, prompts: Sequence[list[dict]], completions: Sequence[str],
                 ground_truth: Sequence[str | None]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Total reward [N] and each component [N] (unweighted), as float32 tensors."""
        total = torch.zeros(len(completions))
        parts: dict[str, torch.Tensor] = {}
        for name, fn, weight in zip(self.names, self.fns, self.weights):
            try:
                raw = fn(prompts=list(prompts), completions=list(completions), ground_truth=list(ground_truth))
            except Exception as exc:
                raise RewardError(f"reward {name!r} raised {type(exc).__name__}: {exc}") from exc
            values = check_rewards(raw, len(completions), name)
            parts[name] = values
            total += weight * values
        return total, parts


def check_rewards(raw: Any, expected: int, name: str) -> torch.Tensor:
    try:
        values = torch.as_tensor(raw if isinstance(raw, torch.Tensor) else list(raw), dtype=torch.float32)
    except (TypeError, ValueError) as exc:
        raise RewardError(f"reward {name!r} returned {type(raw).__name__}, not a list of numbers ({exc})") from exc
    if values.dim() != 1 or values.numel() != expected:
        raise RewardError(f"reward {name!r} returned shape {tuple(values.shape)}; it must return one number per "
                          f"completion ({expected})")
    if not torch.isfinite(values).all():
        raise RewardError(f"reward {name!r} returned non-finite values (NaN or inf) for completions "
                          f"{torch.nonzero(~torch.isfinite(values)).flatten().tolist()[:5]}")
    return values
