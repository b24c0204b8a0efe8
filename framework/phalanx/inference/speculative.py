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
from phalanx.inference.sampler import RowContext, apply_penalties, raw_logprobs, sampling_probs
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
        """Accept each sequence's proposals left to right, then its correction or bonus token:
        every position of every sequence at once on the device (each sampled sequence draws its k
        uniforms and its last token with its own generator), read back in one transfer."""
        n_acc, last = self._verify(seqs, drafts, draft_probs, rows, target_probs)
        host = torch.cat((n_acc, last)).tolist()
        emitted: list[list[int]] = []
        emitted_rows: list[int] = []
        base = 0
        for b, d in enumerate(drafts):
            accepted = host[b]
            out = d[:accepted] + [host[len(seqs) + b]]
            self.num_proposed += len(d)
            self.num_accepted += accepted
            emitted.append(out)
            emitted_rows.extend(range(base, base + len(out)))
            base += len(d) + 1

        flat_rows = [rows[r] for r in emitted_rows]
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
        or from p after the last proposal."""
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
                q = torch.stack([x for probs in draft_probs for x in probs])  # [D, V]
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
