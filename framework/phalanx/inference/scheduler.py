"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step the scheduler
1. gives each running sequence its next tokens, oldest first: one token when decoding, the next
   chunk of the prompt when a prefill is not finished (prompts longer than the step's token
   budget are prefilled in chunks, so one long prompt never stalls every decode);
2. when the cache has no block for a running sequence, preempts the youngest running one: its
   blocks are freed and it goes back to the front of the queue to be recomputed later (its tokens
   are kept; with prefix caching most of its blocks are found again);
3. admits waiting requests while the token budget, `max_num_seqs` and the free blocks allow,
   taking whatever prefix the cache already holds.

A request with best_of > 1 is admitted as one sequence, with room reserved in `max_num_seqs`
for its samples; the engine forks them in after its prompt is done (`add_forked`), sharing the
prompt's blocks. So one step mixes prefills and decodes, new requests join at any step, and finished ones leave
at once. With speculative decoding, a step where every running sequence is decoding and nobody
waits becomes a speculative step: each sequence reserves slots for the proposed tokens too, as
many as its context and its request leave (`lookahead`) and the free blocks hold.

Fault isolation: when a step fails, `roll_back` puts every sequence of it back in the queue as if
never scheduled (their blocks freed, the prefixes the step published forgotten); the engine marks
them `suspect` when the step held several, and then each suspect runs alone in its own steps until
it samples a token again, so the one whose step fails on its own is found and the others go on.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from phalanx.inference.block_manager import BlockManager
from phalanx.inference.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step (== tokens already in the cache)
    num_tokens: int  # tokens of seq.token_ids computed this step
    lookahead: int = 0  # draft tokens verified after them (speculative steps)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's newest token, so a next token is sampled."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    speculative: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 num_lookahead_tokens: int = 0, max_model_len: int | None = None) -> None:
        self.blocks = block_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_lookahead_tokens = num_lookahead_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prefix_cached_tokens = 0  # prompt tokens served from the prefix cache so far

    # -- requests --------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if 1 + seq.num_pending_forks > self.max_num_seqs:
            raise ValueError(f"request {seq.request_id} asks for {1 + seq.num_pending_forks} samples (best_of/n) but "
                             f"max_num_seqs={self.max_num_seqs}; lower best_of/n or raise max_num_seqs")
        # Lookahead slots are within this: `lookahead` never reaches past prompt + max_new_tokens.
        needed = self.blocks.blocks_needed(seq.num_prompt_tokens + seq.params.max_new_tokens)
        if needed > self.blocks.num_blocks:
            raise ValueError(
                f"request {seq.request_id} needs {needed} KV blocks ({seq.num_prompt_tokens} prompt + "
                f"{seq.params.max_new_tokens} new tokens at {self.blocks.block_size} per block) but the cache "
                f"has {self.blocks.num_blocks}; raise the KV-cache budget or shorten the request")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_forked(self, child: Sequence) -> None:
        """A sample forked off a running sequence (its blocks already attached): running from now."""
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    @property
    def num_seq_slots_used(self) -> int:
        """Running sequences plus the samples they will still fork."""
        return len(self.running) + sum(s.num_pending_forks for s in self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.FINISHED

    # -- one step --------------------------------------------------------------------------------
    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.blocks.begin_step()
        suspect = next((s for s in (*self.running, *self.waiting) if s.suspect), None)
        if suspect is not None:
            self._schedule_alone(suspect, out)
            return out
        budget = self.max_num_batched_tokens
        lookahead = self._lookaheads()
        out.speculative = bool(lookahead)

        # 1. running sequences, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            extra = lookahead.get(id(seq), 0)
            while not self.blocks.ensure_slots(seq, seq.num_computed_tokens + n + extra):
                self._preempt(self.running[-1], out)  # the youngest; possibly seq itself
                if seq.status is SequenceStatus.WAITING:
                    break
            if seq.status is SequenceStatus.WAITING:
                break
            self._schedule(seq, n, out, extra)
            budget -= n
            i += 1

        # 2. admit waiting requests (not in a step that had to preempt: there is no room)
        while (self.waiting and not out.preempted and budget > 0
               and self.num_seq_slots_used + 1 + self.waiting[0].num_pending_forks <= self.max_num_seqs):
            seq = self.waiting[0]
            self.blocks.attach_cached_prefix(seq, use_cache=not seq.needs_prompt_logits)
            seq.num_cached_prompt_tokens = seq.num_computed_tokens
            n = min(seq.num_uncomputed_tokens, budget)
            # Admit only if the whole remaining prefill fits now, so admission does not cause the
            # next step's preemption.
            if not self.blocks.ensure_slots(seq, seq.num_tokens):
                self.blocks.free(seq)
                seq.num_computed_tokens = 0
                break
            self._admit(seq)
            self._schedule(seq, n, out)
            budget -= n
        return out

    def _admit(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        self.num_prefix_cached_tokens += seq.num_cached_prompt_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _schedule_alone(self, seq: Sequence, out: SchedulerOutput) -> None:
        """A step of one suspect sequence (after a failed step): its next chunk, nobody else's;
        younger running sequences are preempted if its blocks do not fit otherwise."""
        if seq.status is SequenceStatus.WAITING:
            self.blocks.attach_cached_prefix(seq, use_cache=not seq.needs_prompt_logits)
            seq.num_cached_prompt_tokens = seq.num_computed_tokens
        n = min(seq.num_uncomputed_tokens, self.max_num_batched_tokens)
        while not self.blocks.ensure_slots(seq, seq.num_computed_tokens + n):
            others = [s for s in self.running if s is not seq]
            if not others:  # Scheduler.add checked that one request fits the whole cache
                raise RuntimeError(f"request {seq.request_id} does not fit the KV cache even alone")
            self._preempt(others[-1], out)
        if seq.status is SequenceStatus.WAITING:
            self._admit(seq)
        self._schedule(seq, n, out)

    def roll_back(self, out: SchedulerOutput) -> None:
        """Undo a step that failed: forget the prefixes it published and put each of its
        sequences back at the front of the queue, in order, with its blocks freed (recomputed
        when it runs again; with prefix caching mostly found in the cache). Tokens and sampling
        state are the engine's to keep; nothing here counts as a preemption."""
        self.blocks.unpublish_step()
        for s in reversed(out.scheduled):
            seq = s.seq
            if seq in self.running:
                self.running.remove(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
            self.blocks.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def lookahead(self, seq: Sequence) -> int:
        """Draft tokens a decoding sequence may verify in one speculative step: k, bounded so
        that verification stays inside what the request can still reach (prompt +
        max_new_tokens, and max_model_len: past it the RoPE table ends). Verification runs
        positions n-1 .. n-1+lookahead, so it needs n + lookahead < that end in slots, which
        `add` checked fits the cache; the last accepted token then ends the request exactly."""
        end = seq.num_prompt_tokens + seq.params.max_new_tokens
        if self.max_model_len is not None:
            end = min(end, self.max_model_len)
        return max(0, min(self.num_lookahead_tokens, end - seq.num_tokens - 1))

    def _lookaheads(self) -> dict[int, int]:
        """Each running sequence's lookahead for a speculative step (by id), or {} for a plain
        step. Speculative only where every running sequence decodes and nobody waits; lookahead
        never preempts: after every sequence's own next slot, the free blocks are handed out
        oldest first and a sequence whose k slots do not fit gets as many as do (0 is a plain
        decode inside the speculative step). Nothing to look ahead for anyone: a plain step."""
        if self.num_lookahead_tokens == 0 or self.waiting or not self.running:
            return {}
        if any(s.in_prefill for s in self.running):
            return {}
        bs = self.blocks.block_size
        held = {id(s): max(len(s.block_table), self.blocks.blocks_needed(s.num_tokens)) for s in self.running}
        free = self.blocks.num_free_blocks - sum(held[id(s)] - len(s.block_table) for s in self.running)
        if free < 0:  # the plain step preempts
            return {}
        out = {}
        for s in self.running:
            k = min(self.lookahead(s), (held[id(s)] + free) * bs - s.num_tokens)
            free -= max(0, self.blocks.blocks_needed(s.num_tokens + k) - held[id(s)])
            out[id(s)] = k
        return out if any(out.values()) else {}

    def _schedule(self, seq: Sequence, n: int, out: SchedulerOutput, lookahead: int = 0) -> None:
        out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n, lookahead))
        seq.num_computed_tokens += n
        self.blocks.register_full_blocks(seq, seq.num_computed_tokens)
