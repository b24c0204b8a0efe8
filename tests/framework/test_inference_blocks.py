"""Block manager and scheduler of phalanx.inference, without a model: allocation, prefix sharing,
eviction, preemption, chunked prefill, admission limits, and request validation."""
from __future__ import annotations

import pytest

from phalanx.inference.block_manager import BlockManager
from phalanx.inference.config import EngineConfig
from phalanx.inference.sampling_params import SamplingParams
from phalanx.inference.scheduler import Scheduler
from phalanx.inference.sequence import Sequence, SequenceStatus


def seq(tokens, rid="r", max_new_tokens=4) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_new_tokens=max_new_tokens, temperature=0))


def test_allocate_grow_and_free_returns_every_block():
    bm = BlockManager(8, 4)
    s = seq(range(10))
    assert bm.attach_cached_prefix(s) == 0
    assert bm.ensure_slots(s, 10) and len(s.block_table) == 3 and bm.num_free_blocks == 5
    assert bm.ensure_slots(s, 12) and len(s.block_table) == 3  # still fits in block 3
    assert bm.ensure_slots(s, 13) and len(s.block_table) == 4
    assert not bm.ensure_slots(s, 4 * 9) and len(s.block_table) == 4  # refused whole, nothing taken
    bm.free(s)
    assert bm.all_free() and s.block_table == []


def test_identical_prefixes_share_blocks_with_reference_counts():
    bm = BlockManager(16, 4)
    a, b = seq(list(range(11)), "a"), seq(list(range(9)) + [99, 98], "b")
    bm.attach_cached_prefix(a)
    bm.ensure_slots(a, a.num_tokens)
    bm.register_full_blocks(a, a.num_tokens)  # blocks [0..3], [4..7] are full and final
    assert bm.attach_cached_prefix(b) == 8  # both full blocks found; the third differs
    assert b.block_table[:2] == a.block_table[:2]
    assert [bm.ref_counts[x] for x in a.block_table[:2]] == [2, 2]
    bm.ensure_slots(b, b.num_tokens)
    assert b.block_table[2] != a.block_table[2]
    bm.free(a)
    assert [bm.ref_counts[x] for x in b.block_table[:2]] == [1, 1]
    bm.free(b)
    assert bm.all_free()


def test_the_block_of_the_last_prompt_token_is_never_taken_from_the_cache():
    bm = BlockManager(16, 4)
    a = seq(range(8), "a")
    bm.attach_cached_prefix(a)
    bm.ensure_slots(a, 8)
    bm.register_full_blocks(a, 8)
    same = seq(range(8), "b")
    assert bm.attach_cached_prefix(same) == 4  # not 8: the last token must run to produce logits
    assert same.num_uncomputed_tokens == 4


def test_freed_blocks_stay_findable_until_reused_least_recent_first():
    bm = BlockManager(4, 2)
    a = seq([1, 2, 3, 4, 5], "a")
    bm.attach_cached_prefix(a)
    bm.ensure_slots(a, 5)
    bm.register_full_blocks(a, 4)
    bm.free(a)
    assert bm.all_free()
    again = seq([1, 2, 3, 4, 5], "again")
    assert bm.attach_cached_prefix(again) == 4  # found after its holder finished
    bm.free(again)
    # Allocating every block evicts the cached ones; afterwards nothing is found.
    hog = seq(range(100, 108), "hog")
    bm.attach_cached_prefix(hog)
    assert bm.ensure_slots(hog, 8)
    bm.free(hog)
    assert bm.attach_cached_prefix(seq([1, 2, 3, 4, 5], "late")) == 0


def test_reset_prefix_cache_forgets_everything():
    bm = BlockManager(8, 2)
    a = seq([1, 2, 3, 4, 5], "a")
    bm.attach_cached_prefix(a)
    bm.ensure_slots(a, 5)
    bm.register_full_blocks(a, 4)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.attach_cached_prefix(seq([1, 2, 3, 4, 5], "b")) == 0


def _scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, lookahead=0):
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget, num_lookahead_tokens=lookahead)


def _fake_decode(sched: Scheduler, out) -> None:
    """What the engine does after a step: append a token to every sequence that sampled."""
    for s in out.scheduled:
        if s.samples:
            s.seq.token_ids.append(7)


def test_scheduler_mixes_prefill_and_decode_and_admits_every_step():
    sched = _scheduler()
    a = seq(range(5), "a")
    sched.add(a)
    out = sched.schedule()
    assert [(x.seq.request_id, x.num_tokens) for x in out.scheduled] == [("a", 5)]
    _fake_decode(sched, out)
    b = seq(range(20, 26), "b")
    sched.add(b)  # arrives mid-run
    out = sched.schedule()
    assert [(x.seq.request_id, x.start, x.num_tokens) for x in out.scheduled] == [("a", 5, 1), ("b", 0, 6)]
    assert all(x.samples for x in out.scheduled)


def test_long_prompts_prefill_in_chunks_within_the_token_budget():
    sched = _scheduler(budget=8)
    a = seq(range(20), "a")
    sched.add(a)
    chunks = []
    while True:
        out = sched.schedule()
        chunks.append((out.scheduled[0].start, out.scheduled[0].num_tokens, out.scheduled[0].samples))
        if out.scheduled[0].samples:
            break
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]


def test_preemption_takes_the_youngest_and_requeues_it_first():
    sched = _scheduler(num_blocks=6, block_size=4, budget=64)
    a, b = seq(range(8), "a", 16), seq(range(30, 38), "b", 16)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert len(out.scheduled) == 2 and sched.blocks.num_free_blocks == 2
    preempted = []
    for _ in range(12):
        _fake_decode(sched, out)
        out = sched.schedule()
        preempted += [s.request_id for s in out.preempted]
        if preempted:
            break
    assert preempted == ["b"]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert sched.waiting[0] is b and b.num_tokens > 8  # it keeps its generated tokens
    assert [s.seq.request_id for s in out.scheduled] == ["a"]
    sched.finish(a)
    out = sched.schedule()  # b is readmitted and recomputed: prompt + generated tokens
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [("b", b.num_tokens - b.num_cached_prompt_tokens)]
    sched.finish(b)
    assert sched.blocks.all_free() and not sched.has_unfinished()


def test_max_num_seqs_caps_the_running_batch():
    sched = _scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add(seq(range(i * 10, i * 10 + 3), f"r{i}"))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.waiting) == 2


def test_speculative_steps_reserve_lookahead_slots_only_when_all_decode():
    sched = _scheduler(lookahead=3)
    a = seq(range(4), "a")
    sched.add(a)
    out = sched.schedule()
    assert not out.speculative  # a prefill step
    _fake_decode(sched, out)
    out = sched.schedule()
    assert out.speculative and len(a.block_table) * 4 >= a.num_tokens + 3


def test_lookahead_stays_inside_the_request_the_context_and_the_free_blocks():
    """Issue 36: a sequence looks ahead at most k, never past prompt + max_new_tokens or
    max_model_len (verification positions n-1 .. n-1+k), and only into blocks that are free once
    every sequence has its own next slot: lookahead never preempts."""
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64, num_lookahead_tokens=4,
                      max_model_len=12)
    near_end, short, free = seq(range(9), "a", 3), seq(range(4), "b", 2), seq(range(3), "c", 8)
    for s in (near_end, short, free):
        s.token_ids.append(7)  # one token generated: decoding
        sched.add(s)
    assert [sched.lookahead(s) for s in (near_end, short, free)] == [1, 0, 4]
    near_end.token_ids.append(7)  # 11 tokens of max_model_len 12: nothing left to look ahead for
    assert sched.lookahead(near_end) == 0
    # a nearly full pool of 3 blocks of 4 slots: after each sequence's own next slot (a: 5 tokens
    # in 2 blocks, b: 4 tokens in 1) none is free; a looks ahead into the 3 slots left in its
    # second block, b (its block full) not at all, and nobody is preempted
    tight = Scheduler(BlockManager(3, 4), max_num_seqs=8, max_num_batched_tokens=64, num_lookahead_tokens=4)
    a, b = seq(range(4), "a", 8), seq(range(3), "b", 5)
    tight.add(a)
    tight.add(b)
    _fake_decode(tight, tight.schedule())  # prefills, one token sampled each
    out = tight.schedule()
    assert out.speculative and [s.lookahead for s in out.scheduled] == [3, 0] and not out.preempted
    assert len(a.block_table) == 2 and len(b.block_table) == 1 and tight.blocks.num_free_blocks == 0


def test_a_failed_step_rolls_back_and_forgets_what_it_published():
    """roll_back puts the step's sequences back at the front of the queue in order, frees their
    blocks, and unpublishes the prefixes the step promised; a suspect then runs alone. A
    sequence re-admitted after a failed step still runs its last token (the prefix memo of the
    failed step is longer than what may be taken from the cache)."""
    sched = _scheduler(num_blocks=16, block_size=4)
    a, b, c = seq(range(8), "a", 8), seq(range(8), "b", 8), seq(range(20, 27), "c", 8)
    sched.add(a)
    out = sched.schedule()
    _fake_decode(sched, out)  # a: 8 prompt tokens computed and published, 1 sampled
    sched.add(b)
    sched.add(c)
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["a", "b", "c"] and b.num_cached_prompt_tokens == 4
    published_now = sched.blocks._published[:]  # c's first block (a's blocks were published before)
    assert published_now and all(sched.blocks._block_key[x] is not None for x in published_now)
    sched.roll_back(out)
    assert [s.request_id for s in sched.waiting] == ["a", "b", "c"] and not sched.running
    assert all(s.num_computed_tokens == 0 and not s.block_table for s in (a, b, c))
    assert all(sched.blocks._block_key[x] is None for x in published_now)
    assert sched.blocks.all_free() and sched.num_preemptions == 0
    c.suspect = True
    out = sched.schedule()  # the suspect alone
    assert [s.seq.request_id for s in out.scheduled] == ["c"] and c.num_cached_prompt_tokens == 0
    c.suspect = False  # (the engine clears it once the suspect sampled)
    # b (a's prompt, both of its blocks computed in the failed step: its prefix memo has two keys)
    # is re-admitted with a's first block only: the block of its last token is never taken
    out = sched.schedule()
    run = {s.seq.request_id: s.num_tokens for s in out.scheduled}
    assert run["b"] == 4 and b.num_cached_prompt_tokens == 4 and len(b.block_hashes) == 2


def test_a_fork_shares_only_the_full_prompt_blocks():
    """The samples of one request: the child takes a reference on the parent's full prompt blocks;
    the parent's partly filled last block stays the parent's alone (nobody writes a shared block),
    and the child recomputes those tail tokens into a block of its own."""
    bm = BlockManager(16, 4)
    parent = seq(range(10))
    bm.attach_cached_prefix(parent)
    assert bm.ensure_slots(parent, 10)
    parent.num_computed_tokens = 10
    child = Sequence("r", list(range(10)), parent.params, index=1)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table[:2] and child.num_computed_tokens == 8
    assert [bm.ref_counts[b] for b in parent.block_table] == [2, 2, 1]
    assert bm.num_free_blocks == 16 - 3
    child.token_ids.append(99)  # its first sampled token; tokens 8..10 run in its next step
    assert child.num_uncomputed_tokens == 3 and bm.ensure_slots(child, 11)
    assert len(child.block_table) == 3 and child.block_table[2] != parent.block_table[2]
    bm.free(parent)
    assert [bm.ref_counts[b] for b in child.block_table] == [1, 1, 1]
    bm.free(child)
    assert bm.all_free()


def test_admission_reserves_room_for_the_samples_a_request_will_fork():
    sched = _scheduler(max_num_seqs=4)
    a, b = seq(range(3), "a"), seq(range(10, 13), "b")
    a.num_pending_forks, b.num_pending_forks = 2, 1  # n=3 and n=2
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["a"] and sched.num_seq_slots_used == 3
    big = seq(range(3), "big")
    big.num_pending_forks = 4
    with pytest.raises(ValueError, match="asks for 5 samples"):
        sched.add(big)


def test_a_request_larger_than_the_whole_cache_is_refused():
    sched = _scheduler(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="needs 5 KV blocks"):
        sched.add(seq(range(10), "big", max_new_tokens=10))


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(logprobs=50), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(n=2, best_of=1), "best_of"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
])
def test_sampling_params_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_engine_config_rejects_bad_values():
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=12)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int8")
