"""N-gram speculation ("prompt lookup"): proposals copied from the sequence itself, no draft model.

The sequence's last n tokens are looked up among its earlier tokens (prompt and output); where
they occurred before, the tokens that followed that occurrence are proposed. Longer suffixes are
tried first (n from `max_n` down to `min_n`) and the latest occurrence wins. Outputs that quote
their prompt (summaries, code edits, retrieval answers) or repeat themselves get whole phrases
accepted per step; elsewhere nothing matches and the step is a plain decode.

The proposals are verified like a draft model's (`phalanx.inference.speculative`): greedy requests
keep exactly their plain greedy tokens; a sampled request sees each proposal as drawn with
probability 1 (a one-hot draft distribution), so rejection sampling accepts proposal d with
probability p(d) and otherwise draws from p without d — the output follows the target's
distribution. Constrained sequences propose only the prefix their grammar accepts.
"""
from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from phalanx.inference.sequence import Sequence
from phalanx.inference.speculative import grammar_masks


def lookup(tokens: list[int] | np.ndarray, k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the longest suffix of `tokens`
    (length max_n down to min_n) found before the end: the latest with k tokens after it, else the
    latest; [] when none occurs."""
    ids = np.asarray(tokens, dtype=np.int64)
    total = len(ids)
    if k <= 0:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        # windows starting at 0 .. total-n-1: every earlier place the suffix could sit, with at
        # least one token after it (the suffix itself, at total-n, is not a candidate)
        windows = sliding_window_view(ids[:total - 1], n)
        hits = np.flatnonzero((windows == ids[total - n:]).all(axis=1))
        if len(hits):
            # the latest occurrence with k tokens after it (a loop's latest turn, cut short by the
            # end of the sequence, would propose less), else the latest
            full = hits[hits <= total - n - k]
            start = int(full[-1] if len(full) else hits[-1]) + n
            return ids[start:start + k].tolist()
    return []


class NgramProposer:
    """The speculator's proposer for n-gram lookup (see the module docstring)."""

    def __init__(self, vocab_size: int, device: torch.device, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram speculation: prompt_lookup_min={min_n} and prompt_lookup_max={max_n} need "
                             "1 <= min <= max")
        self.vocab_size, self.device, self.min_n, self.max_n = vocab_size, device, min_n, max_n

    def propose(self, seqs: list[Sequence], row, ks: list[int], masks: list[list], consumed: list[int]):
        """(proposals per sequence, None: each drawn with probability 1). A constrained sequence
        keeps the prefix its grammar accepts: its grammar advances over it (`consumed`), and the
        mask before each kept proposal is appended to `masks[b]` (the state verification row i
        is masked with)."""
        drafts = [lookup(s.token_ids, k, self.min_n, self.max_n) for s, k in zip(seqs, ks)]
        for b, s in enumerate(seqs):
            if s.grammar is not None and s.grammar.finished:  # nothing may follow its EOS
                drafts[b] = []
        constrained = [b for b, s in enumerate(seqs) if s.grammar is not None and drafts[b]]
        for j in range(max((len(drafts[b]) for b in constrained), default=0)):
            active = [b for b in constrained if len(drafts[b]) > j]
            if not active:
                break
            now = grammar_masks(seqs, active, self.vocab_size, self.device)
            for b in active:
                token, grammar = drafts[b][j], seqs[b].grammar
                if not grammar.try_accept(token):
                    drafts[b] = drafts[b][:j]  # the grammar refuses it: propose what came before
                    continue
                masks[b].append(now[b])
                consumed[b] += 1
                if grammar.finished:  # EOS accepted: nothing may follow
                    drafts[b] = drafts[b][:j + 1]
        return drafts, None
