"""The paged KV cache's bookkeeping: which fixed-size blocks are free, who holds which, and which
hold a known prefix.

The cache itself is one tensor per layer of `num_blocks` blocks of `block_size` token slots; this
class never touches it, it only hands out block ids. A sequence owns a *block table*, the list of
its blocks in order, so token position p lives in slot `table[p // block_size] * block_size +
p % block_size`. Blocks are reference-counted so that sequences with an identical prompt prefix
share the same physical blocks (prefix caching):

- A block becomes shareable once it is full of final tokens. Its key is a SHA-256 chain over the
  previous block's key and its own tokens, so equal keys mean equal whole prefixes (a Python
  `hash()` could collide and silently attend to someone else's keys).
- A block whose last holder lets go keeps its key and goes to the back of the free queue: it is
  still found by later requests (cheap recompute after preemption, shared system prompts), and is
  only forgotten when the free queue hands it out again (least recently freed first).
- The block holding a sequence's last prompt token is never taken from the cache, so every
  admitted sequence runs at least one token and gets logits to sample from.

Forking (the samples of an n/best_of > 1 request): a child takes a reference on each of the
parent's *full* prompt blocks and nothing else; the parent's partly filled last block is never
shared, so no block is ever written by two sequences (no copy-on-write needed). The child
recomputes those few tail tokens (fewer than block_size) into a block of its own.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from phalanx.inference.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cached: dict[bytes, int] = {}  # prefix key -> block holding it
        self._block_key: list[bytes | None] = [None] * num_blocks
        self._published: list[int] = []  # blocks published since `begin_step` (undone if the step fails)

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (including cached ones that may still be reused)."""
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def all_free(self) -> bool:
        """True when no block is held: what must hold after every request finished or aborted."""
        return len(self._free) == self.num_blocks and not any(self.ref_counts)

    # -- prefix keys -----------------------------------------------------------------------------
    def _keys(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """The chain keys of the first `num_full_blocks` blocks of the sequence (memoised on it)."""
        keys = seq.block_hashes
        bs = self.block_size
        while len(keys) < num_full_blocks:
            i = len(keys)
            parent = keys[-1] if keys else getattr(seq, "cache_salt", b"")  # LoRA: keyed by adapter
            tokens = array("q", seq.token_ids[i * bs:(i + 1) * bs]).tobytes()
            keys.append(hashlib.sha256(parent + tokens).digest())
        return keys

    # -- allocation ------------------------------------------------------------------------------
    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def _fresh(self) -> int:
        block, _ = self._free.popitem(last=False)
        key = self._block_key[block]
        if key is not None:  # evict: the block's old contents are about to be overwritten
            if self._cached.get(key) == block:
                del self._cached[key]
            self._block_key[block] = None
        self.ref_counts[block] = 1
        return block

    def attach_cached_prefix(self, seq: Sequence, use_cache: bool = True) -> int:
        """On admission, give the sequence the cached blocks of its longest cached prefix.

        Sets `seq.block_table` and `seq.num_computed_tokens`; returns the number of tokens found.
        Only blocks strictly before the one holding the last token are considered. With
        `use_cache=False` (a request that needs logits at every prompt position) nothing is taken.
        """
        assert not seq.block_table, "sequence already holds blocks"
        hits: list[int] = []
        if self.enable_prefix_caching and use_cache:
            limit = (seq.num_tokens - 1) // self.block_size
            for key in self._keys(seq, limit)[:limit]:  # the memo may hold more (after a failed step)
                block = self._cached.get(key)
                if block is None:
                    break
                hits.append(block)
        for block in hits:
            self._take(block)
        seq.block_table = hits
        seq.num_registered_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        return seq.num_computed_tokens

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share the parent's full prompt blocks with a new sample of the same request.

        The child starts with those blocks computed; its remaining prompt tokens (the parent's
        partial last block) and its first sampled token run in its next step, into fresh blocks.
        """
        assert not child.block_table, "the child already holds blocks"
        full = min(parent.num_computed_tokens, parent.num_prompt_tokens) // self.block_size
        shared = parent.block_table[:full]
        for block in shared:
            self._take(block)
        child.block_table = list(shared)
        child.block_hashes = list(parent.block_hashes[:full])
        child.num_registered_blocks = min(parent.num_registered_blocks, full)
        child.num_computed_tokens = full * self.block_size

    def ensure_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow the block table to hold `num_tokens` positions; False (and no change) if the free
        blocks do not suffice."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        seq.block_table.extend(self._fresh() for _ in range(need))
        return True

    def register_full_blocks(self, seq: Sequence, num_final_tokens: int) -> None:
        """Publish the blocks that are full of final tokens whose keys and values are (or, by the
        end of this step, will be) in the cache, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        full = min(num_final_tokens, seq.num_tokens) // self.block_size
        if full <= seq.num_registered_blocks:
            return
        keys = self._keys(seq, full)
        for i in range(seq.num_registered_blocks, full):
            block = seq.block_table[i]
            if self._block_key[block] is None and keys[i] not in self._cached:
                self._cached[keys[i]] = block
                self._block_key[block] = keys[i]
                self._published.append(block)
        seq.num_registered_blocks = full

    def begin_step(self) -> None:
        """Start a step: blocks published from now on are published on the promise that this
        step computes their keys and values (see `unpublish_step`)."""
        self._published.clear()

    def unpublish_step(self) -> None:
        """The step failed: forget the prefixes published since `begin_step`, whose keys and
        values were never (or only partly) written, so no later request attaches them."""
        for block in self._published:
            key = self._block_key[block]
            if key is not None and self._cached.get(key) == block:
                del self._cached[key]
            self._block_key[block] = None
        self._published.clear()

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's hold on its blocks; unshared ones return to the free queue (most
        recently used last, so they are evicted last)."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None
            elif self.ref_counts[block] < 0:
                raise RuntimeError(f"block {block} was freed more often than taken (request {seq.request_id})")
        seq.block_table = []
        seq.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (after new weights are loaded, old keys/values are wrong)."""
        self._cached.clear()
        self._block_key = [None] * self.num_blocks
