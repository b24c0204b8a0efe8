"""Speculative decoding: a small draft model proposes k tokens, the target model checks them all
in one step, and every accepted token is a decode step saved.

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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from phalanx.inference.model_runner import Chunk, ModelRunner
from phalanx.inference.sampler import RowContext, apply_penalties, draw, raw_logprobs, sampling_probs
from phalanx.inference.sequence import Sequence


@dataclass
class Emitted:
    token_id: int
    logprob: float | None
    top_logprobs: dict[int, float] | None


class SpeculativeDecoder:
    def __init__(self, target: ModelRunner, draft: ModelRunner, num_tokens: int) -> None:
        self.target, self.draft, self.k = target, draft, num_tokens
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
        plain decode (the draft still catches up on its last two tokens)."""
        ks = [self.k] * len(seqs) if lookahead is None else list(lookahead)
        drafts, draft_probs = self._propose(seqs, row, ks)
        chunks = [Chunk([s.token_ids[-1]] + d, s.num_tokens - 1, s.block_table, len(d) + 1)
                  for s, d in zip(seqs, drafts)]
        logits = self.target.execute(chunks).float()  # [sum(k_b + 1), V]
        rows = [row(s, i, s.token_ids + d[:i]) for s, d in zip(seqs, drafts) for i in range(len(d) + 1)]
        raw = logits
        target_probs = sampling_probs(apply_penalties(logits.clone(), rows), rows)
        return self._accept(seqs, drafts, draft_probs, rows, raw, target_probs)

    def _propose(self, seqs: list[Sequence], row: callable, ks: list[int]):
        """The draft's proposals: up to ks[b] tokens per sequence, with the distributions they
        were drawn from."""
        drafts: list[list[int]] = [[] for _ in seqs]
        draft_probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for j in range(max(ks, default=0)):
            active = [b for b, k in enumerate(ks) if k > j]
            if j == 0:  # every sequence catches the draft's cache up; those with k = 0 want no logits
                chunks = [Chunk(s.token_ids[-2:], s.num_tokens - 2, s.block_table, 1 if ks[b] else 0)
                          for b, s in enumerate(seqs)]
            else:
                chunks = [Chunk([drafts[b][-1]], seqs[b].num_tokens - 1 + j, seqs[b].block_table) for b in active]
            logits = self.draft.execute(chunks).float()
            rows = [row(seqs[b], j, seqs[b].token_ids + drafts[b]) for b in active]
            probs = sampling_probs(apply_penalties(logits, rows), rows)
            tokens = probs.argmax(dim=-1)
            for i, b in enumerate(active):  # draws stay on the device: one sync per draft step
                if not seqs[b].params.greedy:
                    tokens[i] = torch.multinomial(probs[i], 1, generator=rows[i].generator)[0]
            for i, (b, token) in enumerate(zip(active, tokens.tolist())):
                drafts[b].append(token)
                draft_probs[b].append(probs[i])
        return drafts, draft_probs

    def _accept(self, seqs, drafts, draft_probs, rows, raw, target_probs) -> list[list[Emitted]]:
        """Accept each sequence's proposals left to right, then its correction or bonus token."""
        emitted: list[list[int]] = []
        emitted_rows: list[int] = []
        # greedy rows accept by the target's argmax: read for every row in one transfer
        argmax = target_probs.argmax(dim=-1).tolist() if any(s.params.greedy for s in seqs) else None
        base = 0
        for b, s in enumerate(seqs):
            k = len(drafts[b])
            out: list[int] = []
            generator = rows[base].generator
            for i, d in enumerate(drafts[b]):
                p = target_probs[base + i]
                if s.params.greedy:
                    ok = argmax[base + i] == d
                else:
                    q = draft_probs[b][i]
                    u = torch.rand((), generator=generator, device=p.device)
                    ok = bool(u * q[d] < p[d])  # u < p/q without dividing by a zero q
                if ok:
                    out.append(d)
                    continue
                if s.params.greedy:
                    out.append(argmax[base + i])
                else:
                    residual = (p - draft_probs[b][i]).clamp_min(0)
                    out.append(draw(residual if residual.sum() > 0 else p, generator))
                break
            else:
                p = target_probs[base + k]
                out.append(argmax[base + k] if s.params.greedy else draw(p, generator))
            self.num_proposed += k
            self.num_accepted += len(out) - 1
            emitted.append(out)
            emitted_rows.extend(base + i for i in range(len(out)))
            base += k + 1

        flat_rows = [rows[r] for r in emitted_rows]
        tokens = torch.tensor([t for out in emitted for t in out], device=raw.device)
        chosen, tops = raw_logprobs(raw[emitted_rows], tokens, flat_rows)
        result: list[list[Emitted]] = []
        at = 0
        for out in emitted:
            result.append([Emitted(t, chosen[at + i], tops[at + i]) for i, t in enumerate(out)])
            at += len(out)
        return result
