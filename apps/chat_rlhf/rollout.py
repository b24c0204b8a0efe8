"""Rollouts on our own inference engine, colocated with training.

Each training process owns an `LLM.from_model` engine over its policy. After every optimizer step
`WeightSync` copies the new weights into the engine in memory (never through disk), from whatever
layout trains them: a DDP/ZeRO replica, FSDP2's DTensors (gathered with `full_tensor()`, a
collective every rank joins) or a tensor-parallel model. Under HybridParallelPlugin (tp_size > 1)
the engine itself runs tensor-parallel over the training layout's own tp group (`TPGroup.adopt`),
and each rank copies its training shards straight into its engine shards
(`phalanx.inference.weights.tp_shard_source`): only the token embedding, which the engine keeps
whole and the trainer splits by vocabulary, is gathered, one tensor at a time. The `n` samples
of a prompt are queued together, so with prefix caching they share the prompt's full KV blocks.

The engine returns each sampled token's log-probability under the model's *raw* distribution
(before temperature / top-k / top-p): that is what the importance ratio compares with the
trainer's forward. `LogProbGap` checks every step that the two agree: a gap that jumps means the
engine generated with stale or wrong weights, and the run stops with a message.
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from phalanx.inference import LLM, SamplingParams


class PromptTooLongError(ValueError):
    """A prompt plus max_new_tokens does not fit the engine's max_model_len."""


class StaleWeightsError(RuntimeError):
    """The engine's log-probs disagree with the trainer's: rollouts used other weights."""


@dataclass
class Rollout:
    """n completions for each of P prompts, flattened prompt-major (row i*n + j is prompt i, sample j)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    engine_logprobs: list[list[float]]
    texts: list[str]
    truncated: list[bool]  # stopped by max_new_tokens rather than EOS
    n: int
    generate_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(len(c) for c in self.completion_ids)


@dataclass
class RolloutEngine:
    """An `LLM` over a live policy, sampling n completions per prompt."""

    llm: LLM
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    sync_s: float = field(default=0.0)
    gathered: list[str] = field(default_factory=list)  # weights the last tensor-parallel sync gathered

    @classmethod
    def build(cls, model: torch.nn.Module, tokenizer, *, max_new_tokens: int, max_model_len: int,
              temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
              max_num_seqs: int = 64, block_size: int = 16, kv_cache_memory_gib: float = 0.5,
              tp_size: int = 1) -> "RolloutEngine":
        """`model`: the full (not yet boosted) policy. `tp_size` > 1: the engine is split over groups of
        tp_size consecutive ranks, as the training mesh's tp dimension is; the first `sync` after
        boosting moves it onto the trainer's own tp group."""
        llm = LLM.from_model(model, tokenizer, max_num_seqs=max_num_seqs, block_size=block_size,
                             max_model_len=max_model_len, kv_cache_memory_gib=kv_cache_memory_gib,
                             dtype="float32", enable_prefix_caching=True, seed=seed, tp_size=tp_size)
        return cls(llm, max_new_tokens, temperature, top_p, top_k, seed)

    @property
    def tp_size(self) -> int:
        return self.llm.tp.size

    def check_prompts(self, prompts: Sequence[list[int]], what: str = "prompt") -> None:
        """Refuse, before any work, a prompt that cannot get max_new_tokens within max_model_len."""
        limit = self.llm.max_model_len - self.max_new_tokens
        for i, ids in enumerate(prompts):
            if len(ids) > limit:
                raise PromptTooLongError(
                    f"{what} {i} has {len(ids)} tokens; with max_new_tokens={self.max_new_tokens} the engine's "
                    f"max_model_len={self.llm.max_model_len} leaves room for {limit}: shorten or drop that "
                    "prompt, lower max_new_tokens, or raise engine.max_model_len")

    def generate(self, prompts: Sequence[list[int]], n: int, *, seeds: Sequence[int] | None = None,
                 greedy: bool = False, max_new_tokens: int | None = None) -> Rollout:
        """n samples per prompt; `seeds[i * n + j]` seeds sample j of prompt i (exact replay on resume)."""
        self.check_prompts(prompts)
        if self.tp_size > 1:
            self._check_same_requests(prompts, n, seeds, greedy, max_new_tokens)
        t0 = time.perf_counter()
        flat = [list(p) for p in prompts for _ in range(n)]
        params = [SamplingParams(max_new_tokens=max_new_tokens or self.max_new_tokens,
                                 temperature=0.0 if greedy else self.temperature, top_p=self.top_p,
                                 top_k=self.top_k, logprobs=0,
                                 seed=None if seeds is None or greedy else int(seeds[i]))
                  for i in range(len(flat))]
        outs = self.llm.generate(flat, params)
        return Rollout(prompt_ids=flat, completion_ids=[list(o.token_ids) for o in outs],
                       engine_logprobs=[list(o.logprobs) for o in outs], texts=[o.text for o in outs],
                       truncated=[o.finish_reason == "length" for o in outs], n=n,
                       generate_s=time.perf_counter() - t0)

    def _check_same_requests(self, prompts, n, seeds, greedy, max_new_tokens) -> None:
        """The ranks of a tensor-parallel engine are one data replica: the driver samples for all of
        them, so they must ask for the same prompts, seeds and lengths (else a rank would silently
        train on another rank's rollouts). One 32-byte all-gather per call."""
        digest = hashlib.sha256(repr((list(map(list, prompts)), n, None if seeds is None else list(map(int, seeds)),
                                      greedy, max_new_tokens)).encode()).digest()
        mine = torch.tensor(list(digest), dtype=torch.int32, device=self.llm.device)
        parts = [torch.empty_like(mine) for _ in range(self.tp_size)]
        torch.distributed.all_gather(parts, mine, group=self.llm.tp.group)
        if any(not torch.equal(p, parts[0]) for p in parts):
            raise RuntimeError("the tensor-parallel ranks of one rollout engine asked for different rollouts (prompts, "
                               "seeds or lengths): under tensor parallelism every rank of a tp group must be given "
                               "the same prompts (one data replica) and the same sampling seeds")

    def sync(self, model: torch.nn.Module) -> float:
        """Copy the trained weights into the engine (in memory); returns the seconds it took.

        Under HybridParallelPlugin each rank moves its own training shards into its engine shards
        over the trainer's tp group (the first sync adopts that group); otherwise the state dict
        is read whole (DDP/ZeRO replicas; FSDP2 DTensors gathered one at a time)."""
        t0 = time.perf_counter()
        with torch.no_grad():
            plan = tensor_parallel_plan(model)
            if plan is not None:
                self.load_tp_shards(model, plan)
            else:
                if self.tp_size > 1:
                    raise ValueError(f"this engine runs tensor-parallel (tp_size={self.tp_size}) but the model was not "
                                     "boosted by HybridParallelPlugin with that tp_size")
                self.llm.load_weights(_weights_of(model), strict=True)
        self.sync_s = time.perf_counter() - t0
        return self.sync_s

    def load_tp_shards(self, model: torch.nn.Module, plan) -> list[str]:
        """Shard-to-shard copy from a tensor-parallel trainer; returns the names it had to gather."""
        from phalanx.booster.plugins.base import unwrap_model
        from phalanx.inference.weights import tp_shard_source
        if plan.size != self.tp_size:
            raise ValueError(f"the policy trains with tp_size={plan.size} but the engine runs tp_size={self.tp_size}; "
                             "build the engine with the training layout's tp_size")
        if self.llm.tp.group is not plan.group:
            self.llm.tp.adopt(plan.group)
        source = tp_shard_source(unwrap_model(model), plan, self.llm.runner.model)
        self.llm.load_weights(source, strict=True)
        self.gathered = source.gathered
        return source.gathered


def _weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict to read whole: the user's model under HybridParallelPlugin(tp_size=1) (its
    wrapper's names carry the plugin's module path), the boosted model's otherwise."""
    from phalanx.booster.plugins.base import unwrap_model
    from phalanx.booster.state import boosted_state
    state = boosted_state(model)
    return unwrap_model(model).state_dict() if getattr(state, "plan", None) is not None else model.state_dict()


def tensor_parallel_plan(model: torch.nn.Module):
    """The `TPPlan` of a model boosted by HybridParallelPlugin with tp_size > 1 (None otherwise)."""
    from phalanx.booster.state import boosted_state
    state = boosted_state(model)
    if state is not None and state.pipeline is not None:
        raise ValueError("a pipeline-parallel policy (pp_size > 1) holds only its stages on each rank; the colocated "
                         "engine needs every layer: train with pp_size=1")
    plan = state.plan if state is not None else None
    return plan if plan is not None and plan.size > 1 else None


def completion_batch(prompt_ids: Sequence[list[int]], completion_ids: Sequence[list[int]], pad_id: int
                     ) -> dict[str, torch.Tensor]:
    """Prompts left-padded and completions right-padded, so every completion starts at the same
    column: input_ids, attention_mask, position_ids [B, P+T] and completion_mask [B, T]."""
    P = max(len(p) for p in prompt_ids)
    T = max(max((len(c) for c in completion_ids), default=0), 1)
    B = len(prompt_ids)
    ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + T), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        ids[i, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        ids[i, P:P + len(c)] = torch.tensor(c, dtype=torch.long)
        attn[i, P - len(p):P + len(c)] = 1
    positions = (attn.cumsum(dim=1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": attn, "position_ids": positions,
            "completion_mask": attn[:, P:].clone()}


def completion_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], *, with_entropy: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, T] of the completion tokens under `model` (raw distribution, temperature 1),
    and optionally the per-token entropy. Only the completion positions go through the LM head."""
    mask = batch["completion_mask"]
    T = mask.shape[1]
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], logits_to_keep=T + 1, use_cache=False)
    logits = out.logits[:, :-1].float()  # position P-1+t predicts completion token t
    targets = batch["input_ids"][:, -T:]
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
    return logp, entropy


def padded(rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


class LogProbGap:
    """The stale-weight guard: mean |engine - trainer| log-prob of the sampled tokens, every step.

    The gap of correct weights is rounding noise (~1e-6..1e-3 depending on dtype and kernels). The
    run stops when a step's gap exceeds `max_gap` outright, or jumps above `jump` times the running
    median of earlier steps (and above `floor`, so noise around 1e-6 does not trip it)."""

    def __init__(self, max_gap: float = 0.5, jump: float = 20.0, floor: float = 1e-2) -> None:
        self.max_gap, self.jump, self.floor = max_gap, jump, floor
        self.history: list[float] = []

    def check(self, gap: float, step: int) -> float:
        if not math.isfinite(gap):
            raise StaleWeightsError(f"step {step}: the engine/trainer log-prob gap is {gap}")
        typical = sorted(self.history)[len(self.history) // 2] if self.history else None
        if gap > self.max_gap or (typical is not None and gap > self.floor and gap > self.jump * max(typical, 1e-8)):
            raise StaleWeightsError(
                f"step {step}: mean |engine - trainer| log-prob of the sampled tokens is {gap:.3g}"
                + (f" (typical so far {typical:.3g})" if typical is not None else "")
                + f", above the guard (max_gap={self.max_gap}, jump x{self.jump}): the rollouts were generated with "
                "other weights than the ones being trained (a missed weight sync, a wrong layout gather, or a "
                "dtype mismatch between engine and trainer). Stopped before applying this step.")
        self.history.append(gap)
        self.history = self.history[-50:]
        return gap

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history = [float(x) for x in state.get("history", [])]
