"""The disk tier: chunks' optimizer state in checksummed files on local disk, read ahead of use.

A chunk whose optimizer tier is "disk" keeps its fp32 master and Adam moments (`DISK_STATES`)
in one file (`ChunkFileStore`); its fp32 gradient and compute-dtype shard stay in memory (the
gradient is added to at every micro-step of backward). The optimizer step walks the chunks in
model order; `DiskTier.stream` reads the next `depth` disk chunks' files into host buffers on a
small thread pool while the current chunk is updated, and writes each chunk back (again on the
pool) right after its update. So the host holds at most `depth + 1` chunk records of optimizer
state, whatever the model's size. A save gathers the masters parameter by parameter: `held`
keeps the chunk it read last in one of those buffers, so each file is read once per save.

Each file is one record: a header (magic, the element count of each tensor, the payload's
length and CRC-32) and the tensors' bytes. A file is written to `NAME.tmp` and renamed over
`NAME`, so a reader never sees a half-written record; a record that does not match its header
or its checksum (a truncated or corrupted file) raises `CorruptChunkFile` naming the file. The
files are scratch state of this run, deleted when the store is closed or the process exits:
they are not fsync'd (a crash loses the run's memory anyway; checkpoints are the durable form).

The host buffers come from `MemoryTiers` (host tier), so they count against the host budget.
The kernel's page cache may keep recently written files in memory: that memory is the kernel's,
reclaimable, and not the process's (`drop_cache=True` fsyncs each file and drops its pages, so
that reads really come from the disk, for measurements).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import struct
import tempfile
import threading
import time
import weakref
import zlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator, Sequence

import torch

from phalanx.gemini.tiers import DISK, HOST, MemoryTiers

DISK_STATES = ("master", "exp_avg", "exp_avg_sq")
MAGIC = b"PHXGEMD1"
_FIXED = struct.Struct("<8sIQI")  # magic, tensor count, payload bytes, crc32 of the payload
_NUMEL = struct.Struct("<Q")


class CorruptChunkFile(RuntimeError):
    """A disk-tier chunk file is missing, truncated or does not match its checksum."""


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


class ChunkFileStore:
    """Records of flat CPU tensors in files under a directory of this process's own."""

    def __init__(self, directory: str | os.PathLike | None = None, rank: int = 0, threads: int = 2,
                 drop_cache: bool = False):
        base = os.fspath(directory) if directory is not None else tempfile.gettempdir()
        try:
            os.makedirs(base, exist_ok=True)
            self.directory = tempfile.mkdtemp(prefix=f"gemini-disk-rank{rank}-", dir=base)
        except OSError as exc:
            raise ValueError(f"GeminiPlugin: cannot create the disk tier's directory under {base!r} ({exc}); "
                             "pass disk_dir= a writable directory on a local disk") from exc
        self.drop_cache = drop_cache
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gemini-disk")
        self.stats = {"reads": 0, "writes": 0, "bytes_read": 0, "bytes_written": 0, "read_s": 0.0, "write_s": 0.0}
        self._lock = threading.Lock()
        self._cleanup = weakref.finalize(self, _remove, self.pool, self.directory)

    def close(self) -> None:
        """Stop the thread pool and delete the files."""
        self._cleanup()

    def path(self, key: str) -> str:
        return os.path.join(self.directory, key + ".chunk")

    def _count(self, kind: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.stats[kind + "s"] += 1
            self.stats["bytes_" + ("read" if kind == "read" else "written")] += nbytes
            self.stats[kind + "_s"] += seconds

    # ------------------------------------------------------------------ one record
    def write(self, key: str, tensors: Sequence[torch.Tensor]) -> None:
        """Write `tensors` (flat, contiguous, CPU) as the record `key`, atomically (tmp + rename)."""
        start = time.perf_counter()
        views = [_raw(t) for t in tensors]
        crc = 0
        for v in views:
            crc = zlib.crc32(v, crc)
        payload = sum(len(v) for v in views)
        header = _FIXED.pack(MAGIC, len(views), payload, crc) + b"".join(_NUMEL.pack(t.numel()) for t in tensors)
        path = self.path(key)
        tmp = path + ".tmp"
        with open(tmp, "wb", buffering=0) as f:
            for v in [memoryview(header)] + views:
                while len(v):
                    v = v[f.write(v):]
            if self.drop_cache:
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.replace(tmp, path)
        self._count("write", len(header) + payload, time.perf_counter() - start)

    def read_into(self, key: str, tensors: Sequence[torch.Tensor]) -> None:
        """Fill `tensors` from the record `key`, checking its header and checksum."""
        start = time.perf_counter()
        path = self.path(key)
        views = [_raw(t) for t in tensors]
        fixed_size = _FIXED.size + _NUMEL.size * len(views)
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            raise self._corrupt(path, "the file is missing") from None
        with f:
            header = f.read(fixed_size)
            if len(header) < fixed_size:
                raise self._corrupt(path, f"truncated: {len(header)} bytes, shorter than its header")
            magic, count, payload, crc = _FIXED.unpack_from(header)
            numels = [_NUMEL.unpack_from(header, _FIXED.size + i * _NUMEL.size)[0] for i in range(len(views))]
            if magic != MAGIC or count != len(views):
                raise self._corrupt(path, "the header is not a Gemini chunk record")
            if numels != [t.numel() for t in tensors] or payload != sum(len(v) for v in views):
                raise self._corrupt(path, f"the header says {numels} elements, the chunk has "
                                          f"{[t.numel() for t in tensors]}")
            got = 0
            for v in views:
                while len(v):
                    n = f.readinto(v)
                    if not n:
                        raise self._corrupt(path, f"truncated: the payload ends after {got} of {payload} bytes")
                    got += n
                    v = v[n:]
            if f.read(1):
                raise self._corrupt(path, "bytes after the end of the record")
        check = 0
        for v in (_raw(t) for t in tensors):
            check = zlib.crc32(v, check)
        if check != crc:
            raise self._corrupt(path, f"checksum mismatch (CRC-32 {check:#010x}, the header says {crc:#010x})")
        self._count("read", fixed_size + payload, time.perf_counter() - start)

    def _corrupt(self, path: str, why: str) -> CorruptChunkFile:
        return CorruptChunkFile(
            f"GeminiPlugin disk tier: chunk file {path} is unreadable ({why}). It holds optimizer state (fp32 "
            "master weights and Adam moments) that only this run wrote and has no other copy, so training cannot "
            "go on from it: resume from the last checkpoint (booster.load_checkpoint), and check the disk under "
            f"{self.directory} (full or failing, or another process writing or cleaning there; give disk_dir= a "
            "directory of its own on a local disk)")

    # ------------------------------------------------------------------ asynchronous
    def submit_read(self, key: str, tensors: Sequence[torch.Tensor]) -> Future:
        return self.pool.submit(self.read_into, key, tensors)

    def submit_write(self, key: str, tensors: Sequence[torch.Tensor]) -> Future:
        return self.pool.submit(self.write, key, tensors)


def _remove(pool: ThreadPoolExecutor, directory: str) -> None:
    pool.shutdown(wait=True)
    shutil.rmtree(directory, ignore_errors=True)


class DiskTier:
    """The chunks whose optimizer state lives on disk: their files, the host buffers they are
    read into (`depth + 1` records of the largest such chunk, from the host tier) and the
    read-ahead of the optimizer step.

    While a disk chunk's state is in memory (inside `loaded` or between `DiskStream.take` and
    `DiskStream.done`), `chunk.master`, `chunk.exp_avg` and `chunk.exp_avg_sq` are views of one
    host buffer; otherwise they are None."""

    def __init__(self, store: ChunkFileStore, tiers: MemoryTiers, record_numel: int, depth: int = 2):
        if depth < 1:
            raise ValueError(f"disk_prefetch={depth} must be at least 1 (chunks read ahead of the optimizer step)")
        self.store = store
        self.tiers = tiers
        self.depth = depth
        self.record_numel = record_numel  # elements of one buffer: 3 x the largest disk chunk's shard
        self._free = [tiers.empty(HOST, record_numel, torch.float32) for _ in range(depth + 1)]
        self._writes: deque[tuple[Future, torch.Tensor]] = deque()
        self._held: tuple[object, torch.Tensor] | None = None  # (chunk, buffer) kept by `held`
        # time the optimizer step waited: for a read to finish, for a write to free a buffer
        self.stats = {"stall_s": 0.0, "write_wait_s": 0.0}

    @staticmethod
    def key(chunk) -> str:
        return f"chunk{chunk.index:06d}"

    def buffer_bytes(self) -> int:
        return 4 * self.record_numel * (self.depth + 1)

    # ------------------------------------------------------------------ buffers
    def _acquire(self) -> torch.Tensor:
        if not self._free:
            start = time.perf_counter()
            while not self._free:
                self._reap(block=True)
            self.stats["write_wait_s"] += time.perf_counter() - start
        return self._free.pop()

    def _reap(self, block: bool) -> None:
        """Take back the buffers of finished writes (the oldest one, waiting for it, if `block`)."""
        while self._writes and (block or self._writes[0][0].done()):
            future, buf = self._writes.popleft()
            future.result()  # re-raises a failed write
            self._free.append(buf)
            block = False

    def flush(self) -> None:
        """Wait for every pending write (before anything reads a chunk file again); drop the
        state `held` keeps (whatever comes next may change the files)."""
        self.release_held()
        start = time.perf_counter()
        while self._writes:
            self._reap(block=True)
        self.stats["write_wait_s"] += time.perf_counter() - start

    def _views(self, chunk, buf: torch.Tensor) -> list[torch.Tensor]:
        n = chunk.shard_numel
        return [buf[i * n:(i + 1) * n] for i in range(len(DISK_STATES))]

    def _attach(self, chunk, views: list[torch.Tensor]) -> None:
        for name, v in zip(DISK_STATES, views, strict=True):
            setattr(chunk, name, v)

    def _detach(self, chunk) -> None:
        for name in DISK_STATES:
            setattr(chunk, name, None)

    def _write_async(self, chunk, buf: torch.Tensor) -> None:
        views = self._views(chunk, buf)
        self._writes.append((self.store.submit_write(self.key(chunk), views), buf))

    # ------------------------------------------------------------------ one chunk at a time
    def create(self, chunk) -> None:
        """Account a new disk chunk (its state is written by `loaded(chunk, read=False)`)."""
        self.tiers.bytes[DISK] += 4 * len(DISK_STATES) * chunk.shard_numel

    @contextlib.contextmanager
    def loaded(self, chunk, *, read: bool = True, write: bool = False) -> Iterator[None]:
        """Inside: the chunk's optimizer state in memory (`chunk.master` etc.); written back after
        if `write`. For checkpoints and set-up, not the training step (`stream`)."""
        self.flush()
        buf = self._acquire()
        views = self._views(chunk, buf)
        try:
            if read:
                self.store.read_into(self.key(chunk), views)
            self._attach(chunk, views)
            yield
            if write:
                self.store.write(self.key(chunk), views)
        finally:
            self._detach(chunk)
            self._free.append(buf)

    def held(self, chunk) -> list[torch.Tensor]:
        """The chunk's state (master, exp_avg, exp_avg_sq), read from its file on the first call
        and kept in one buffer until another chunk is asked for or anything else uses the files
        (every other path starts with `flush`, which lets it go). For reading only, right away: a
        save streaming a chunk's parameters one by one reads the file once instead of once per
        parameter, and holds one chunk record at a time, in a buffer of the pool (no memory more).
        Not attached to the chunk: `chunk.master` stays None."""
        if self._held is not None and self._held[0] is chunk:
            return self._views(chunk, self._held[1])
        self.flush()
        buf = self._acquire()
        views = self._views(chunk, buf)
        try:
            self.store.read_into(self.key(chunk), views)
        except BaseException:
            self._free.append(buf)
            raise
        self._held = (chunk, buf)
        return views

    def release_held(self) -> None:
        """Give the buffer `held` keeps back to the pool."""
        if self._held is not None:
            self._free.append(self._held[1])
            self._held = None

    def stream(self, chunks: Sequence) -> "DiskStream":
        return DiskStream(self, list(chunks))


class DiskStream:
    """The optimizer step's pass over the disk chunks, in model order: reads `depth` chunks
    ahead; `take(chunk)` waits for the chunk's read and attaches its state, `done(chunk)` starts
    writing it back. `finish()` waits for the writes (and takes back unused reads)."""

    def __init__(self, tier: DiskTier, chunks: list):
        self.tier = tier
        self.todo = deque(chunks)
        self.reads: deque[tuple[object, Future, torch.Tensor]] = deque()
        self.current: tuple[object, torch.Tensor] | None = None
        tier.flush()
        self._read_ahead()

    def _read_ahead(self) -> None:
        tier = self.tier
        while self.todo and len(self.reads) < tier.depth:
            tier._reap(block=False)
            if not tier._free and not tier._writes:
                return  # every buffer is a pending read or the chunk being updated
            chunk = self.todo.popleft()
            buf = tier._acquire()
            future = tier.store.submit_read(tier.key(chunk), tier._views(chunk, buf))
            self.reads.append((chunk, future, buf))

    def take(self, chunk) -> None:
        if not self.reads:
            self._read_ahead()
        if not self.reads or self.reads[0][0] is not chunk:
            raise RuntimeError(f"Gemini disk tier: chunk {chunk.index} taken out of model order")
        _, future, buf = self.reads.popleft()
        start = time.perf_counter()
        try:
            future.result()
        except BaseException:
            self.tier._free.append(buf)
            raise
        self.tier.stats["stall_s"] += time.perf_counter() - start
        self.tier._attach(chunk, self.tier._views(chunk, buf))
        self.current = (chunk, buf)
        self._read_ahead()

    def done(self, chunk) -> None:
        current, buf = self.current
        assert current is chunk
        self.tier._detach(chunk)
        self.current = None
        self.tier._write_async(chunk, buf)
        self._read_ahead()

    def finish(self) -> None:
        """Wait for the writes; reads started but not taken (a skipped step) are discarded."""
        tier = self.tier
        while self.reads:
            _, future, buf = self.reads.popleft()
            future.exception()  # wait; a corrupt file not used this step is found on its next read
            tier._free.append(buf)
        if self.current is not None:
            chunk, buf = self.current
            tier._detach(chunk)
            tier._free.append(buf)
            self.current = None
        tier.flush()
