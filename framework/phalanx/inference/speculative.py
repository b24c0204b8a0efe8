"""Speculative decoding: a small draft model proposes k tokens, the target model checks them all
in one step, and every accepted token is a decode step saved. Without a draft model, n-gram
lookup proposes tokens copied from the sequence itself (`phalanx.inference.ngram`); steps 2-4
below are the same for both proposers.

Per sequence of n tokens (the newest, t[n-1], not yet in the target's cache):
1. the draft runs k steps: first on [t[n-2], t[n-1]] (re-running t[n-2] keeps the draft's cache
   in step with the target's whatever was accepted last time), then on each proposal;
2. the target runs once on [t[n-1], d1 … dk] and yields k + 1 next-token distributions;
3. proposals are accepted left to right. Greedy requests accept d_i while it equals the target's
   argmax; sampled requests accept with probability min(1, p(d_i) / q(d_i)) and on a rejection
   draw from the normalised residual max(p - q, 0) — the rejection-sampling rule that makes the
   output distributed exactly as the target's (Leviathan et al. 2023; Chen et al. 2023);
4. the target's token after the last accepted one (a correction, or a bonus when all k passed)
   is appended too, so each step yields between 1 and k + 1 tokens.

Both models share the block tables (each has its own cache tensors, indexed by the same slots),
so the scheduler's blocks and prefix cache serve both.

LoRA adapters: the target verifies every sequence's positions with that sequence's adapter (the
chunk's `lora_slot`, as in a plain step); the draft runs the base draft model for everyone. A
draft that ignores the adapter proposes tokens the adapted target rejects more often, which
costs acceptance, never correctness: the tokens kept are the target's (with its adapter).

Structured output: a constrained sequence drafts too. Its grammar advances over its own
proposals while the draft runs (`Grammar.try_accept`), so each proposal is drawn from the
draft's distribution masked with the grammar state after the proposals before it, and those
masks are kept: verification masks target row i with the same state (row k, after every
proposal, gets one more mask). Greedy: a proposal is accepted only when it is the masked
target's argmax, i.e. exactly the token a plain masked step would choose; sampled: rejection
sampling between the masked draft and masked target distributions, so the output follows the
masked target. When the step ends (or raises) every grammar is rolled back over its proposals
(`Grammar.rollback`); the engine then advances it over the tokens it appends, as in a plain step.
A proposal the grammar refuses (never, for tokens drawn under its mask) ends that sequence's
drafts, as does a grammar that has finished (EOS accepted).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from phalanx.inference.model_runner import Chunk, ModelRunner
from phalanx.inference.sampler import RowContext, apply_penalties, raw_logprobs, sampling_probs
from phalanx.inference.sequence import Sequence
from phalanx.inference.structured import allowed_tokens, apply_allowed


@dataclass
class Emitted:
    token_id: int
    logprob: float | None
    top_logprobs: dict[int, float] | None


def unmasked(ctx: RowContext) -> RowContext:
    """The row without its grammar: the speculator masks drafted positions itself (the grammar
    object's state is that of the sequence's end, not of the position)."""
    ctx.grammar = None
    return ctx


def grammar_masks(seqs: list[Sequence], which: list[int], vocab: int, device) -> dict[int, torch.Tensor]:
    """{b: allowed tokens [V]} of the grammars of seqs[b] for b in `which`, in their present state
    (one batched mask computation)."""
    if not which:
        return {}
    allowed = allowed_tokens([seqs[b].grammar for b in which], vocab, device)
    return {b: allowed[i] for i, b in enumerate(which)}


class DraftModelProposer:
    """Proposals of a small draft model: a second ModelRunner with its own cache over the same
    block tables (module docstring, step 1)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def propose(self, seqs: list[Sequence], row: callable, ks: list[int],
                 masks: list[list[torch.Tensor | None]], consumed: list[int]):
        """The draft's proposals: up to ks[b] tokens per sequence, with the distributions they
        were drawn from. A constrained sequence's proposals are drawn under its grammar's mask;
        its grammar advances over each (`consumed[b]`) and the masks are appended to `masks[b]`.
        `ks` is shortened where a grammar ends the drafts."""
        drafts: list[list[int]] = [[] for _ in seqs]
        draft_probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for j in range(max(ks, default=0)):
            active = [b for b, k in enumerate(ks) if k > j]
            if not active:
                break
            if j == 0:  # every sequence catches the draft's cache up; those with k = 0 want no logits
                chunks = [Chunk(s.token_ids[-2:], s.num_tokens - 2, s.block_table, 1 if ks[b] else 0)
                          for b, s in enumerate(seqs)]
            else:
                chunks = [Chunk([drafts[b][-1]], seqs[b].num_tokens - 1 + j, seqs[b].block_table) for b in active]
            logits = self.runner.execute(chunks).float()
            rows = [unmasked(row(seqs[b], j, seqs[b].token_ids + drafts[b])) for b in active]
            now = grammar_masks(seqs, [b for b in active if seqs[b].grammar is not None], logits.shape[-1],
                                logits.device)
            for b, mask in now.items():
                masks[b].append(mask)
            allowed = [now.get(b) for b in active]
            if any(r.changes_logits for r in rows):  # (the runner's logits are inference tensors)
                logits = apply_penalties(logits.clone(), rows)
            probs = sampling_probs(apply_allowed(logits, allowed), rows)
            tokens = probs.argmax(dim=-1)
            for i, b in enumerate(active):  # draws stay on the device: one sync per draft step
                if not seqs[b].params.greedy:
                    tokens[i] = torch.multinomial(probs[i], 1, generator=rows[i].generator)[0]
            for i, (b, token) in enumerate(zip(active, tokens.tolist())):
                grammar = seqs[b].grammar
                if grammar is not None:
                    if not grammar.try_accept(token):  # (never under its mask) no more drafts
                        ks[b] = j
                        masks[b].pop()
                        continue
                    consumed[b] += 1
                    if grammar.finished:  # EOS accepted: nothing may follow
                        ks[b] = j + 1
                drafts[b].append(token)
                draft_probs[b].append(probs[i])
        return drafts, draft_probs


class SpeculativeDecoder:
    """Verifies the proposals of `proposer` (a `DraftModelProposer`, or n-gram lookup's
    `phalanx.inference.ngram.NgramProposer`) with the target model, k = `num_tokens` at most."""

    def __init__(self, target: ModelRunner, proposer, num_tokens: int) -> None:
        self.target, self.proposer, self.k = target, proposer, num_tokens
        self.num_proposed = 0
        self.num_accepted = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    def step(self, seqs: list[Sequence], row: callable, lookahead: list[int] | None = None) -> list[list[Emitted]]:
        """Tokens to append to each sequence. `row(seq, extra_tokens, history)` builds the
        sampler's RowContext for the position `extra_tokens` past the sequence's end.
        `lookahead[b]` (at most k; default k for all) is how many tokens sequence b may draft:
        the scheduler bounds it by the context and the free blocks; 0 makes its verification a
        plain decode (the draft still catches up on its last two tokens). Grammars come back in
        the state they had (see the module's docstring)."""
        ks = [self.k] * len(seqs) if lookahead is None else list(lookahead)
        masks: list[list[torch.Tensor | None]] = [[] for _ in seqs]  # constrained: one per position
        consumed = [0] * len(seqs)  # proposals each grammar advanced over (rolled back below)
        try:
            drafts, draft_probs = self.proposer.propose(seqs, row, ks, masks, consumed)
            chunks = [Chunk([s.token_ids[-1]] + d, s.num_tokens - 1, s.block_table, len(d) + 1, s.lora_slot)
                      for s, d in zip(seqs, drafts)]
            logits = self.target.execute(chunks)  # [sum(k_b + 1), V], the model's dtype
            self._last_masks(seqs, masks, logits)
            rows = [unmasked(row(s, i, s.token_ids + d[:i])) for s, d in zip(seqs, drafts)
                    for i in range(len(d) + 1)]
            allowed = [masks[b][i] if seqs[b].grammar is not None else None
                       for b, d in enumerate(drafts) for i in range(len(d) + 1)]
            if all(r.params.greedy and not r.changes_logits for r in rows) and all(a is None for a in allowed):
                # plain greedy rows: the argmax of the raw logits is all verification needs (no
                # copy, no softmax: the Sampler's fast path); max(dim) gives the first maximal
                # index, as argmax, in any float dtype
                counts, last = self._greedy_verdicts(drafts, logits.max(dim=-1).indices.tolist())
            else:
                raw = logits.float()
                target_probs = sampling_probs(apply_allowed(apply_penalties(raw.clone(), rows), allowed), rows)
                n_acc, last_t = self._verify(seqs, drafts, draft_probs, rows, target_probs)
                host = torch.cat((n_acc, last_t)).tolist()  # one transfer for every sequence
                counts, last = host[:len(seqs)], host[len(seqs):]
            return self._emit(drafts, rows, logits, counts, last)
        finally:
            for s, n in zip(seqs, consumed):
                if n:
                    s.grammar.rollback(n)

    def _last_masks(self, seqs: list[Sequence], masks: list[list[torch.Tensor | None]], logits: torch.Tensor) -> None:
        """The mask after each constrained sequence's last proposal (the row of its correction or
        bonus token); none after a grammar that has finished (that row is never appended)."""
        live = [b for b, s in enumerate(seqs) if s.grammar is not None and not s.grammar.finished]
        now = grammar_masks(seqs, live, logits.shape[-1], logits.device)
        for b, s in enumerate(seqs):
            if s.grammar is not None:
                masks[b].append(now.get(b))

    @staticmethod
    def _greedy_verdicts(drafts: list[list[int]], best: list[int]) -> tuple[list[int], list[int]]:
        """(accepted proposals, the token after them) per sequence from each verified row's argmax
        `best`: proposals are accepted while each equals the argmax of the row before it."""
        counts, last, base = [], [], 0
        for d in drafts:
            accepted = 0
            while accepted < len(d) and d[accepted] == best[base + accepted]:
                accepted += 1
            counts.append(accepted)
            last.append(best[base + accepted])
            base += len(d) + 1
        return counts, last

    def _emit(self, drafts, rows, raw, counts: list[int], last: list[int]) -> list[list[Emitted]]:
        """Each sequence's accepted proposals and its correction or bonus token, with the raw
        log-probabilities of the rows that asked for them (computed only then)."""
        emitted: list[list[int]] = []
        emitted_rows: list[int] = []
        base = 0
        for d, accepted, token in zip(drafts, counts, last):
            out = d[:accepted] + [token]
            self.num_proposed += len(d)
            self.num_accepted += accepted
            emitted.append(out)
            emitted_rows.extend(range(base, base + len(out)))
            base += len(d) + 1

        flat_rows = [rows[r] for r in emitted_rows]
        chosen = tops = [None] * len(flat_rows)
        if any(r.wants_logprob for r in flat_rows):
            tokens = torch.tensor([t for out in emitted for t in out], device=raw.device)
            chosen, tops = raw_logprobs(raw[emitted_rows], tokens, flat_rows)
        result: list[list[Emitted]] = []
        at = 0
        for out in emitted:
            result.append([Emitted(t, chosen[at + i], tops[at + i]) for i, t in enumerate(out)])
            at += len(out)
        return result

    @staticmethod
    def _verify(seqs, drafts, draft_probs, rows, target_probs) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted proposals [B], the token after them [B]) as device tensors. Greedy sequences
        accept d_i while it is the target's argmax and end with the argmax; sampled ones accept
        while u_i · q(d_i) < p(d_i) (u_i < p/q without dividing by a zero q) and end with a draw
        from the residual max(p - q, 0) at the first rejection (p where the residual is all zero),
        or from p after the last proposal. `draft_probs` None: each proposal was certain (q one-hot,
        n-gram lookup)."""
        device = target_probs.device
        ks = [len(d) for d in drafts]
        num, width = len(seqs), max(ks, default=0)
        bases = [sum(k + 1 for k in ks[:b]) for b in range(num)]
        greedy = [s.params.greedy for s in seqs]
        greedy_t = torch.tensor(greedy, device=device)
        k_t = torch.tensor(ks, device=device)
        accept = torch.zeros(num, width, dtype=torch.bool, device=device)
        q = None
        if width:
            seq_of = [b for b in range(num) for _ in range(ks[b])]
            where = (torch.tensor(seq_of, device=device),
                     torch.tensor([i for k in ks for i in range(k)], device=device))
            target_rows = torch.tensor([bases[b] + i for b in range(num) for i in range(ks[b])], device=device)
            tokens = torch.tensor([t for d in drafts for t in d], device=device)
            p = target_probs[target_rows]  # [D, V]: each proposal's target distribution
            ok = p.argmax(dim=-1) == tokens
            if not all(greedy):
                q = torch.stack([x for probs in draft_probs for x in probs]) if draft_probs is not None else \
                    torch.nn.functional.one_hot(tokens, p.shape[-1]).to(p.dtype)  # [D, V] (n-gram: drawn surely)
                u = torch.cat([torch.rand(ks[b], generator=rows[bases[b]].generator, device=device)
                               if not greedy[b] else torch.zeros(ks[b], device=device) for b in range(num)])
                at = torch.arange(len(tokens), device=device)
                ok = torch.where(greedy_t[where[0]], ok, u * q[at, tokens] < p[at, tokens])
            accept[where] = ok
        n_acc = accept.long().cumprod(dim=1).sum(dim=1)  # proposals before the first rejection
        p_last = target_probs[torch.tensor(bases, device=device) + n_acc]  # [B, V]
        last = p_last.argmax(dim=-1)
        if not all(greedy):
            dist = p_last
            if q is not None:  # a rejected sequence draws from its residual
                firsts = torch.tensor([sum(ks[:b]) for b in range(num)], device=device)
                q_at = q[(firsts + n_acc.clamp(max=k_t - 1).clamp_min(0)).clamp(max=len(q) - 1)]
                residual = (p_last - q_at).clamp_min(0)
                use = (n_acc < k_t)[:, None] & (residual.sum(dim=-1, keepdim=True) > 0)
                dist = torch.where(use, residual, p_last)
            last = torch.stack([last[b] if greedy[b] else
                                torch.multinomial(dist[b], 1, generator=rows[bases[b]].generator)[0]
                                for b in range(num)])
        return n_acc, last
