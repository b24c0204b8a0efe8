"""Cutting token streams into fixed-length training rows.

Pre-training rows (`SequencePacker`): documents are concatenated, each followed by EOS, and the
stream is cut every `seq_len` tokens, so no position is padding and a long document simply
continues in the next row. Only the very last row of a stream can be short; it is padded and its
padding is not a target (label -100), so no token is lost and none is invented.

SFT rows (`ExamplePacker`): whole conversations are placed into rows greedily (a conversation is
never split across rows, since its labels only make sense with its prompt), and each row is
padded at the end.
"""
from __future__ import annotations

from typing import Iterable, Iterator

from phalanx.data.labels import IGNORE_INDEX


class SequencePacker:
    def __init__(self, seq_len: int, eos_id: int, pad_id: int):
        if seq_len < 2:
            raise ValueError(f"seq_len must be at least 2, got {seq_len}")
        self.seq_len, self.eos_id, self.pad_id = seq_len, eos_id, pad_id
        self._buffer: list[int] = []
        self.documents = 0
        self.tokens = 0  # real tokens taken in, EOS included

    def add(self, ids: Iterable[int]) -> Iterator[dict[str, list[int]]]:
        """Add one document; yield every row that is now complete."""
        before = len(self._buffer)
        self._buffer.extend(ids)
        self._buffer.append(self.eos_id)
        self.documents += 1
        self.tokens += len(self._buffer) - before
        n = self.seq_len
        full = len(self._buffer) // n
        for k in range(full):
            row = self._buffer[k * n:(k + 1) * n]
            yield {"input_ids": row, "labels": list(row)}
        if full:
            del self._buffer[:full * n]

    def finish(self, drop_partial: bool = False) -> Iterator[dict[str, list[int]]]:
        """The last, partial row (padded, padding unlabelled), unless dropped or empty."""
        rest, self._buffer = self._buffer, []
        if rest and not drop_partial:
            pad = self.seq_len - len(rest)
            yield {"input_ids": rest + [self.pad_id] * pad, "labels": rest + [IGNORE_INDEX] * pad}


class ExamplePacker:
    """Greedy first-fit-in-order packing of (input_ids, labels) examples into padded rows."""

    def __init__(self, seq_len: int, pad_id: int, pack: bool = True):
        self.seq_len, self.pad_id, self.pack = seq_len, pad_id, pack
        self._ids: list[int] = []
        self._labels: list[int] = []

    def _row(self) -> dict[str, list[int]]:
        pad = self.seq_len - len(self._ids)
        row = {"input_ids": self._ids + [self.pad_id] * pad, "labels": self._labels + [IGNORE_INDEX] * pad}
        self._ids, self._labels = [], []
        return row

    def add(self, ids: list[int], labels: list[int]) -> Iterator[dict[str, list[int]]]:
        if len(ids) > self.seq_len:
            raise ValueError(f"example of {len(ids)} tokens is longer than seq_len={self.seq_len}; truncate it first")
        if self._ids and (not self.pack or len(self._ids) + len(ids) > self.seq_len):
            yield self._row()
        self._ids.extend(ids)
        self._labels.extend(labels)

    def finish(self) -> Iterator[dict[str, list[int]]]:
        if self._ids:
            yield self._row()
