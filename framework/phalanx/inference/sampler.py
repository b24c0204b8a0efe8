"""Turning a step's logits into tokens, per request: biases and penalties, temperature, top-k,
top-p, then greedy argmax or a draw from the request's own generator; log-probs on request.

Order of operations follows Hugging Face `generate` (logit bias, repetition penalty, temperature,
top-k, top-p; OpenAI's presence/frequency penalties come right after the repetition penalty), so
the same settings mean the same distribution. Rows are independent: each request draws from its own
`torch.Generator`, so a seeded request samples the same tokens whatever else is in the batch.
Log-probs are taken from the raw logits (the model's distribution), see `SamplingParams`.
A row with a grammar (structured output, `phalanx.inference.structured`) has every token its
grammar forbids set to -inf after the penalties and before temperature; other rows of the batch
are untouched.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from phalanx.inference.sampling_params import SamplingParams
from phalanx.inference.structured import apply_grammar_masks


@dataclass
class RowContext:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    generator: torch.Generator | None = None
    history: list[int] | None = None  # prompt + output so far (for the repetition penalty)
    banned: list[int] | None = None  # token ids that may not be chosen now (EOS before min_new_tokens)
    generated: list[int] | None = None  # output so far (for presence/frequency penalties)
    track_logprob: bool = False  # return the chosen token's raw log-prob even without params.logprobs (best_of)
    grammar: object | None = None  # a structured.Grammar in the state of this position: masks the row

    @property
    def wants_logprob(self) -> bool:
        return self.params.logprobs is not None or self.track_logprob

    @property
    def changes_logits(self) -> bool:
        return self.params.has_penalties or bool(self.banned) or self.grammar is not None


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]
    processed_logprobs: list[float | None] | None = None  # per row, for rows that asked for them


def apply_penalties(logits: torch.Tensor, rows: list[RowContext]) -> torch.Tensor:
    """Logit bias, repetition / presence / frequency penalties, banned tokens and grammar masks,
    in place on the rows that ask for them (float logits)."""
    for r, row in enumerate(rows):
        params = row.params
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), device=logits.device)
            logits[r, ids] += torch.tensor(list(params.logit_bias.values()), device=logits.device, dtype=logits.dtype)
        penalty = params.repetition_penalty
        if penalty != 1.0 and row.history:
            ids = torch.tensor(sorted(set(row.history)), device=logits.device)
            picked = logits[r, ids]
            logits[r, ids] = torch.where(picked < 0, picked * penalty, picked / penalty)
        if (params.presence_penalty or params.frequency_penalty) and row.generated:
            # counted on the host, where the output already is (torch.unique on a GPU waits for it)
            counted = Counter(row.generated)
            ids = torch.tensor(sorted(counted), device=logits.device)
            counts = torch.tensor([counted[t] for t in sorted(counted)], device=logits.device, dtype=logits.dtype)
            logits[r, ids] -= counts * params.frequency_penalty + params.presence_penalty
        if row.banned:
            logits[r, row.banned] = float("-inf")
    return apply_grammar_masks(logits, [row.grammar for row in rows])


def _mask_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k[r] largest logits (ties with the k-th kept, like HF)."""
    vocab = logits.shape[-1]
    k = top_k.clamp(max=vocab)
    kth = torch.sort(logits, dim=-1, descending=True).values.gather(-1, (k - 1).unsqueeze(-1))
    return logits.masked_fill(logits < kth, float("-inf"))


def _mask_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p[r]."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - top_p).unsqueeze(-1)
    remove[..., -1] = False  # always keep the most likely token
    return logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))


def sampling_logits(logits: torch.Tensor, rows: list[RowContext]) -> torch.Tensor:
    """Temperature, top-k and top-p applied to (already penalised) float logits of sampled rows;
    greedy rows come back unchanged."""
    params = [r.params for r in rows]
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                         device=logits.device, dtype=logits.dtype)
    logits = logits / temps.unsqueeze(-1)
    k_rows = [i for i, p in enumerate(params) if p.top_k > 0 and not p.greedy]
    if k_rows:
        idx = torch.tensor(k_rows, device=logits.device)
        ks = torch.tensor([params[i].top_k for i in k_rows], device=logits.device)
        logits[idx] = _mask_top_k(logits[idx], ks)
    p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0 and not p.greedy]
    if p_rows:
        idx = torch.tensor(p_rows, device=logits.device)
        ps = torch.tensor([params[i].top_p for i in p_rows], device=logits.device, dtype=logits.dtype)
        logits[idx] = _mask_top_p(logits[idx], ps)
    return logits


def sampling_probs(logits: torch.Tensor, rows: list[RowContext]) -> torch.Tensor:
    """The distribution each row samples from: a one-hot at the argmax for greedy rows.

    `logits` must already be penalised (`apply_penalties`). Speculative decoding compares these
    distributions of the draft and the target model.
    """
    probs = sampling_logits(logits, rows).softmax(dim=-1)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)
        probs[idx] = 0.0
        probs[idx, logits[idx].argmax(dim=-1)] = 1.0
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a 1-D distribution, with the request's generator (waits for the device:
    the batched sampler draws on the device instead, see `Sampler`)."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


@dataclass
class _LogprobTensors:
    """Raw log-probs of the rows that asked for them, still on the device."""

    want: list[int]  # rows with log-probs, in order
    picked: torch.Tensor | None = None  # [W] log-prob of each chosen token
    top_v: torch.Tensor | None = None  # [W, n_top]
    top_i: torch.Tensor | None = None  # [W, n_top]


def _logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, rows: list[RowContext]) -> _LogprobTensors:
    want = [i for i, r in enumerate(rows) if r.wants_logprob]
    if not want:
        return _LogprobTensors(want)
    idx = torch.tensor(want, device=logits.device)
    logp = torch.log_softmax(logits[idx].float(), dim=-1)
    picked = logp.gather(-1, token_ids[idx].unsqueeze(-1)).squeeze(-1)
    n_top = max(rows[i].params.logprobs or 0 for i in want)
    top_v, top_i = (logp.topk(n_top, dim=-1) if n_top else (None, None))
    return _LogprobTensors(want, picked, top_v, top_i)


def _to_host(parts: list[torch.Tensor | None]) -> list[list[float]]:
    """Bring every tensor in `parts` to the host in one transfer (one device -> host sync): they
    travel as float64, which holds token ids (< 2**53) and fp32 log-probs exactly."""
    present = [t.reshape(-1) for t in parts if t is not None]
    if not present:
        return [[] for _ in parts]
    flat = torch.cat([t.to(torch.float64) for t in present]).tolist()
    out, at = [], 0
    for t in parts:
        n = 0 if t is None else t.numel()
        out.append(flat[at:at + n])
        at += n
    return out


def _unpack_logprobs(lp: _LogprobTensors, picked: list[float], top_v: list[float], top_i: list[float],
                     rows: list[RowContext]) -> tuple[list[float | None], list[dict[int, float] | None]]:
    chosen: list[float | None] = [None] * len(rows)
    tops: list[dict[int, float] | None] = [None] * len(rows)
    n_top = 0 if lp.top_v is None else lp.top_v.shape[-1]
    for j, i in enumerate(lp.want):
        chosen[i] = picked[j]
        n = rows[i].params.logprobs
        if n:
            ids = top_i[j * n_top:j * n_top + n]
            tops[i] = dict(zip((int(t) for t in ids), top_v[j * n_top:j * n_top + n]))
    return chosen, tops


def raw_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, rows: list[RowContext]
                 ) -> tuple[list[float | None], list[dict[int, float] | None]]:
    """Log-probabilities under the model's raw distribution for rows that asked for them (one
    device -> host transfer for all rows)."""
    lp = _logprob_tensors(logits, token_ids, rows)
    if not lp.want:
        return [None] * len(rows), [None] * len(rows)
    picked, top_v, top_i = _to_host([lp.picked, lp.top_v, lp.top_i])
    return _unpack_logprobs(lp, picked, top_v, top_i, rows)


class Sampler:
    """Picks one token per row of logits [R, V].

    Everything stays on the logits' device until the end of the call, which brings the tokens and
    the log-probs to the host in one transfer: one device -> host sync per call (per engine step)
    however many rows sample, draw with their own generator or ask for log-probs.
    """

    def __call__(self, logits: torch.Tensor, rows: list[RowContext]) -> SampleOutput:
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(rows)} requests")
        needs_penalty = any(r.changes_logits for r in rows)
        wants_processed = any(r.params.processed_logprobs for r in rows)
        if not needs_penalty and not wants_processed and all(r.params.greedy and not r.wants_logprob
                                                             for r in rows):
            # max(dim) returns the first maximal index like argmax, and measured ~3x faster on CPU
            tokens = logits.float().max(dim=-1).indices.tolist()
            return SampleOutput(tokens, [None] * len(rows), [None] * len(rows))
        raw = logits.float()
        work = apply_penalties(raw.clone(), rows) if needs_penalty else raw
        tokens = work.max(dim=-1).indices
        processed_rows = [i for i, r in enumerate(rows) if r.params.processed_logprobs]
        processed_t = None
        if not all(r.params.greedy for r in rows):
            sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
            idx = torch.tensor(sampled, device=logits.device)
            probs = sampling_logits(work[idx], [rows[i] for i in sampled]).softmax(dim=-1)
            # one draw per row with the row's own generator, left on the device
            drawn = torch.cat([torch.multinomial(probs[j], 1, generator=rows[i].generator)
                               for j, i in enumerate(sampled)])
            tokens[idx] = drawn
            at = {i: j for j, i in enumerate(sampled)}
            wanted = [at[i] for i in processed_rows if i in at]
            if wanted:
                w = torch.tensor(wanted, device=logits.device)
                processed_t = torch.log(probs[w, drawn[w]])
        lp = _logprob_tensors(raw, tokens, rows)
        token_list, picked, top_v, top_i, processed_list = _to_host(
            [tokens, lp.picked, lp.top_v, lp.top_i, processed_t])
        chosen, tops = _unpack_logprobs(lp, picked, top_v, top_i, rows)
        processed: list[float | None] = [0.0 if r.params.processed_logprobs else None for r in rows]
        sampled_processed = [i for i in processed_rows if not rows[i].params.greedy]
        for i, value in zip(sampled_processed, processed_list):
            processed[i] = value
        return SampleOutput([int(t) for t in token_list], chosen, tops, processed if wants_processed else None)
