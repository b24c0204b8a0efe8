"""Rollouts on our own inference engine, colocated with training.

Each training process owns an `LLM.from_model` engine over its policy. After every optimizer step
`WeightSync` copies the new weights into the engine in memory (never through disk), from whatever
layout trains them: a DDP/ZeRO replica, FSDP2's DTensors (gathered with `full_tensor()`, a
collective every rank joins) or a tensor-parallel model. Under HybridParallelPlugin (tp_size > 1)
the engine itself runs tensor-parallel over the training layout's own tp group (`TPGroup.adopt`),
and each rank copies its training shards straight into its engine shards
(`phalanx.inference.weights.tp_shard_source`): only the token embedding, which the engine keeps
whole and the trainer splits by vocabulary, is gathered, one tensor at a time. A LoRA policy's
shards are merged on each rank first (`adapters.merged_tp_shards`). The `n` samples
of a prompt are queued together, so with prefix caching they share the prompt's full KV blocks.

The engine returns each sampled token's log-probability under the model's *raw* distribution
(before temperature / top-k / top-p): that is what the importance ratio compares with the
trainer's forward. `LogProbGap` checks every step that the two agree: a gap that jumps means the
engine generated with stale or wrong weights, and the run stops with a message.

The trainer's log-probs (`completion_logprobs`) come from one forward over either the plain batch
(`completion_batch`: each sample with its own copy of the prompt) or the packed one
(`shared_prompt_batch`: each prompt once, its n completions after it under a 4D mask; exact, and
cheaper when completions are short); `logprob_batch` chooses.
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from phalanx.inference import LLM, SamplingParams

from .rl_logprobs import completion_logprobs, token_logprobs  # noqa: F401  (the trainer's side, re-exported)


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
    lag: int = 0  # weight updates the trainer is ahead of the weights that sampled it (decoupled rollouts)

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
              tp_size: int = 1, dtype: str = "float32") -> "RolloutEngine":
        """`model`: the full (not yet boosted, not yet LoRA-wrapped) policy. `tp_size` > 1: the engine
        is split over groups of tp_size consecutive ranks, as the training mesh's tp dimension is; the
        first `sync` after boosting moves it onto the trainer's own tp group. `dtype`: the trainer's
        compute dtype (`engine_dtype`)."""
        llm = LLM.from_model(model, tokenizer, max_num_seqs=max_num_seqs, block_size=block_size,
                             max_model_len=max_model_len, kv_cache_memory_gib=kv_cache_memory_gib,
                             dtype=dtype, enable_prefix_caching=True, seed=seed, tp_size=tp_size)
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

    def sync(self, model: torch.nn.Module, submodule: str = "") -> float:
        """Copy the trained weights into the engine (in memory); returns the seconds it took.
        `submodule`: the policy is that submodule of the trained model (PPO's `actor` inside its
        actor-critic wrapper); "" for the model itself.

        Under HybridParallelPlugin each rank moves its own training shards into its engine shards
        over the trainer's tp group (the first sync adopts that group); otherwise the state dict
        is read whole (DDP/ZeRO replicas; FSDP2 DTensors gathered one at a time)."""
        t0 = time.perf_counter()
        with torch.no_grad():
            plan = tensor_parallel_plan(model)
            if plan is not None:
                self.load_tp_shards(model, plan, submodule)
            else:
                if self.tp_size > 1:
                    raise ValueError(f"this engine runs tensor-parallel (tp_size={self.tp_size}) but the model was not "
                                     "boosted by HybridParallelPlugin with that tp_size")
                self.llm.load_weights(_weights_of(model, submodule), strict=True)
        self.sync_s = time.perf_counter() - t0
        return self.sync_s

    def load_tp_shards(self, model: torch.nn.Module, plan, submodule: str = "") -> list[str]:
        """Shard-to-shard copy from a tensor-parallel trainer (of `submodule` of it, if given);
        returns the names it had to gather."""
        from phalanx.booster.plugins.base import unwrap_model
        from phalanx.inference.weights import tp_shard_source
        if plan.size != self.tp_size:
            raise ValueError(f"the policy trains with tp_size={plan.size} but the engine runs tp_size={self.tp_size}; "
                             "build the engine with the training layout's tp_size")
        if self.llm.tp.group is not plan.group:
            self.llm.tp.adopt(plan.group)
        from .adapters import is_lora, merged_tp_shards
        policy = unwrap_model(model)
        if submodule:
            policy, plan = policy.get_submodule(submodule), submodule_plan(plan, submodule)
        if is_lora(policy):  # each rank merges its own shards: W_r + scaling * B_r @ A_r, base untouched
            policy, plan = merged_tp_shards(policy, plan)
        source = tp_shard_source(policy, plan, self.llm.runner.model)
        self.llm.load_weights(source, strict=True)
        self.gathered = source.gathered
        return source.gathered


def _weights_of(model: torch.nn.Module, submodule: str = ""):
    """The state dict to read whole: the user's model under HybridParallelPlugin(tp_size=1) (its
    wrapper's names carry the plugin's module path), the boosted model's otherwise; only
    `submodule`'s tensors, under their names inside it, when one is named. A LoRA model gives its
    merged weights, one tensor at a time."""
    from phalanx.booster.plugins.base import unwrap_model
    from phalanx.booster.state import boosted_state

    from .adapters import lora_part, merged_engine_weights
    if lora_part(model, submodule) is not None:  # W + scaling * B @ A per sync, into the engine's copy; the
        return merged_engine_weights(model, submodule)  # trainer's base stays as it is
    state = boosted_state(model)
    weights = unwrap_model(model).state_dict() if getattr(state, "plan", None) is not None else model.state_dict()
    return submodule_weights(weights, submodule) if submodule else weights


def submodule_weights(state: dict[str, torch.Tensor], submodule: str) -> dict[str, torch.Tensor]:
    """The tensors of `state` under the module named `submodule` (a single name, e.g. `actor`),
    renamed to their names inside it, whatever wrapper prefixes (DDP `module.`, FSDP, compile)
    come before it."""
    out = {}
    for name, tensor in state.items():
        parts = name.split(".")
        if submodule in parts:
            out[".".join(parts[parts.index(submodule) + 1:])] = tensor
    return out


def submodule_plan(plan, submodule: str):
    """The `TPPlan` of `submodule` of the planned model: its parameters' specs under their names
    inside it (same group, rank and heads), for reading that submodule's shards on their own."""
    import dataclasses
    lead = submodule + "."
    return dataclasses.replace(plan, params={name[len(lead):]: shard for name, shard in plan.params.items()
                                             if name.startswith(lead)})


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


def shared_prompt_batch(prompt_ids: Sequence[list[int]], completion_ids: Sequence[list[int]], n: int, pad_id: int
                        ) -> dict[str, torch.Tensor]:
    """The n completions of each prompt packed into one row that holds the prompt once.

    `prompt_ids` / `completion_ids` are flattened prompt-major as in `Rollout` (row g*n + j is
    sample j of prompt g; the n prompts of a group must be equal). Row g is
    [left pads, prompt, c_1[:-1], ..., c_n[:-1], right pads]: a completion's last token is only a
    target, and its first is predicted by the prompt's last position, which the n samples share.
    A 4D mask [G, 1, L, L] lets each completion see the prompt and itself causally (never a
    sibling); its positions restart after the prompt. Causal attention makes every hidden state
    the one the unshared batch computes, so log-probs and gradients are the same up to rounding.

    Besides input_ids / attention_mask / position_ids: completion_mask [B, T] as `completion_batch`
    gives it, targets [B, T], and logit_index [B, T]: where token t of sample b reads its logits in
    the flattened [G * K, V] logits of the last K = logits_to_keep positions."""
    B = len(completion_ids)
    if n < 1 or B % n or len(prompt_ids) != B:
        raise ValueError(f"shared_prompt_batch needs n samples of each prompt: got {len(prompt_ids)} prompts, "
                         f"{B} completions, n={n}")
    G = B // n
    for g in range(G):
        if not prompt_ids[g * n] or any(list(prompt_ids[g * n + j]) != list(prompt_ids[g * n]) for j in range(1, n)):
            raise ValueError(f"shared_prompt_batch: rows {g * n}..{g * n + n - 1} must hold the same non-empty prompt "
                             "(the rollout is prompt-major, n samples per prompt); use completion_batch otherwise")
    P = max(len(prompt_ids[g * n]) for g in range(G))
    T = max(max((len(c) for c in completion_ids), default=0), 1)
    L = max(P + sum(max(len(c) - 1, 0) for c in completion_ids[g * n:(g + 1) * n]) for g in range(G))
    K = L - P + 1  # logits from the prompt's last position onwards
    ids = torch.full((G, L), pad_id, dtype=torch.long)
    segment = torch.full((G, L), -1, dtype=torch.long)  # -1 pad, 0 prompt, j + 1 completion j
    positions = torch.zeros((G, L), dtype=torch.long)
    targets = torch.full((B, T), pad_id, dtype=torch.long)
    index = torch.zeros((B, T), dtype=torch.long)
    cmask = torch.zeros((B, T), dtype=torch.long)
    for g in range(G):
        p = prompt_ids[g * n]
        ids[g, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        segment[g, P - len(p):P] = 0
        positions[g, P - len(p):P] = torch.arange(len(p))
        start = P
        for j in range(n):
            b, c = g * n + j, completion_ids[g * n + j]
            if not c:
                continue
            inputs = len(c) - 1
            ids[g, start:start + inputs] = torch.tensor(c[:-1], dtype=torch.long)
            segment[g, start:start + inputs] = j + 1
            positions[g, start:start + inputs] = len(p) + torch.arange(inputs)
            targets[b, :len(c)] = torch.tensor(c, dtype=torch.long)
            # token 0 reads the prompt's last position (P - 1, kept index 0); token t the position of c[t - 1]
            reads = torch.cat([torch.zeros(1, dtype=torch.long), start - P + 1 + torch.arange(inputs)])
            index[b, :len(c)] = g * K + reads
            cmask[b, :len(c)] = 1
            start += inputs
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    q, k = segment.unsqueeze(2), segment.unsqueeze(1)
    allowed = causal & (k >= 0) & ((k == 0) | (k == q))
    allowed |= torch.eye(L, dtype=torch.bool)  # padding attends to itself: no empty softmax row
    return {"input_ids": ids, "attention_mask": allowed.unsqueeze(1), "position_ids": positions,
            "completion_mask": cmask, "targets": targets, "logit_index": index, "logits_to_keep": torch.tensor(K)}


def shared_prompt_pays(prompt_ids: Sequence[list[int]], completion_ids: Sequence[list[int]], n: int,
                       hidden_size: int) -> bool:
    """Whether the packed batch costs less than the unshared one, by a per-layer estimate: a token
    costs ~12 h^2 multiply-adds in the projections and MLP, a (query, key) pair ~2 h in attention, and
    the packed row's mask is dense (L^2 pairs). Sharing wins for short completions (the prompt
    dominates); n long completions in one row can cost more in attention than the prompts save."""
    if n < 2 or len(completion_ids) % n:
        return False
    P = max(len(p) for p in prompt_ids)
    T = max(max((len(c) for c in completion_ids), default=0), 1)
    G = len(completion_ids) // n
    L = max(P + sum(max(len(c) - 1, 0) for c in completion_ids[g * n:(g + 1) * n]) for g in range(G))
    cost = lambda rows, length: rows * (6 * hidden_size * length + length * length)
    return cost(G, L) < cost(len(completion_ids), P + T)


def supports_shared_prompt(model: torch.nn.Module) -> str | None:
    """None if `model` takes the packed batch exactly, else why not: the custom 4D mask is read by
    transformers' sdpa and eager attention, and must not meet sliding-window layers (the mask
    replaces theirs)."""
    from phalanx.booster.plugins.base import unwrap_model
    config = getattr(unwrap_model(model), "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return f"attention implementation {impl!r} (the shared-prompt mask needs sdpa or eager)"
    layer_types = getattr(config, "layer_types", None) or ()
    if "sliding_attention" in layer_types or getattr(config, "use_sliding_window", False):
        return "sliding-window attention layers"
    return None


def logprob_batch(prompt_ids: Sequence[list[int]], completion_ids: Sequence[list[int]], n: int, pad_id: int,
                  model: torch.nn.Module | None = None, *, shared: bool = True) -> dict[str, torch.Tensor]:
    """The batch `completion_logprobs` reads for a prompt-major rollout with n samples per prompt:
    packed (`shared_prompt_batch`) when `shared`, the model takes it and it is cheaper, else
    `completion_batch`. Both give the same [B, T] log-probs and completion_mask."""
    if shared and n > 1 and model is not None and supports_shared_prompt(model) is None:
        from phalanx.booster.plugins.base import unwrap_model
        hidden = int(getattr(unwrap_model(model).config, "hidden_size", 0) or 0)
        if shared_prompt_pays(prompt_ids, completion_ids, n, hidden):
            return shared_prompt_batch(prompt_ids, completion_ids, n, pad_id)
    return completion_batch(prompt_ids, completion_ids, pad_id)


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

    def check(self, gap: float, step: int, lag: int = 0) -> float:
        """`lag` > 0: the rollout was sampled on purpose by weights `lag` updates old (decoupled
        rollouts, `max_staleness`), so the gap holds the policy's own change, not only rounding: only
        `max_gap` applies, and the gap stays out of the running median of rounding noise."""
        if not math.isfinite(gap):
            raise StaleWeightsError(f"step {step}: the engine/trainer log-prob gap is {gap}")
        typical = sorted(self.history)[len(self.history) // 2] if self.history and not lag else None
        if gap > self.max_gap or (typical is not None and gap > self.floor and gap > self.jump * max(typical, 1e-8)):
            raise StaleWeightsError(
                f"step {step}: mean |engine - trainer| log-prob of the sampled tokens is {gap:.3g}"
                + (f" (typical so far {typical:.3g})" if typical is not None else "")
                + f", above the guard (max_gap={self.max_gap}, jump x{self.jump}): the rollouts were generated with "
                "other weights than the ones being trained (a missed weight sync, a wrong layout gather, or a "
                "dtype mismatch between engine and trainer). Stopped before applying this step."
                + (f" The rollout is {lag} update(s) behind by design (rollout.max_staleness): a gap above "
                   "max_gap from that lag needs a lower learning rate, a lower max_staleness, or a higher "
                   "grpo.max_logprob_gap." if lag else ""))
        if lag:
            return gap
        self.history.append(gap)
        self.history = self.history[-50:]
        return gap

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history = [float(x) for x in state.get("history", [])]
