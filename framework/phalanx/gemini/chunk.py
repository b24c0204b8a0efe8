"""Chunks: the unit Gemini stores, moves and communicates.

Parameters are packed in model order into flat chunks of one capacity (`chunk_numel` elements),
so that communication and host<->device moves happen in a few large pieces instead of one per
tensor: a new chunk starts when the next parameter does not fit, and a parameter larger than
the capacity gets a chunk of its own. Each chunk is then only as large as its contents rounded
up to a multiple of the number of ranks it is sharded over (less than one element a rank of
padding): the capacity decides where chunks are cut, never how much memory they take. (Padding
every chunk to the capacity cost 18% of the parameters at 7.1M with 4 MiB chunks, memory on
every tier and in every collective; nothing needs it: chunks are separate allocations, and
collectives and the disk tier take any length.) `search_chunk_size` picks the capacity that packs
the parameters most tightly over a range.

Each chunk is cut into `world` equal shards (`phalanx.zero.partition.FlatLayout`, with the
padding as a last slot): rank r keeps shard r in the compute dtype (`shard`) and its fp32
master copy with the Adam moments and the fp32 gradient (`master`, `exp_avg`, `exp_avg_sq`,
`master_grad`; on the disk tier the first three are None between optimizer steps). A chunk that
is not sharded (`shard_param_frac` < 1) has world 1 and every rank keeps all of it. While a
module computes, the shards are all-gathered into `full` and the module's parameters are views
of it; afterwards they point at a one-element placeholder that keeps their shape and dtype but
no memory.

In fp32 a separate master would be a bit-for-bit duplicate of the shard, so when the shard and
the optimizer state live on the same memory tier the master IS the shard (one tensor,
`master_is_shard`; `master_shares_shard` says when that holds). Moving one of them to another
tier makes the master a real copy again; bringing them back together drops the copy (the
values are equal: every write to a master is published to its shard at once). `SHARE_FP32_MASTER`
turns this off (tests compare against the separate copies).

State machine (`ChunkState`): FREE (only the shard exists) -> COMPUTE (gathered, a module is
running) -> HOLD (gathered, nobody computing; forward is over) / HOLD_AFTER_BWD (some of its
gradients arrived) -> READY_FOR_REDUCE (all arrived: reduce-scatter, then FREE).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
from torch import nn

from phalanx.gemini.tiers import DISK, HOST
from phalanx.zero.partition import FlatLayout


SHARE_FP32_MASTER = True  # an fp32 chunk's master is its shard where both live on one tier


class ChunkState(enum.Enum):
    FREE = "free"
    COMPUTE = "compute"
    HOLD = "hold"
    HOLD_AFTER_BWD = "hold_after_bwd"
    READY_FOR_REDUCE = "ready_for_reduce"


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pack(numels: list[int], chunk_numel: int) -> list[list[int]]:
    """Indices of parameters per chunk, in order: a new chunk starts when the next parameter
    does not fit; a parameter larger than `chunk_numel` is alone in its chunk."""
    chunks: list[list[int]] = []
    used = chunk_numel  # forces a new chunk for the first parameter
    for i, n in enumerate(numels):
        if n > chunk_numel:
            chunks.append([i])
            used = chunk_numel
        elif used + n > chunk_numel:
            chunks.append([i])
            used = n
        else:
            chunks[-1].append(i)
            used += n
    return chunks


def chunk_numel_for(used: int, world: int) -> int:
    """Elements of a chunk whose parameters take `used`: a multiple of `world` (equal shards, at
    least one element each), no more."""
    return _round_up(max(used, 1), world)


def unused_capacity(numels: list[int], chunk_numel: int) -> int:
    """How loosely chunks of capacity `chunk_numel` pack `numels`: the capacity left empty in the
    chunks (a lone oversized parameter fills its own). Not memory (a chunk takes only its
    contents, `chunk_numel_for`), but the packing's evenness: the less is left empty, the fewer
    and the more even the chunks, so the fewer collectives for the same working set."""
    return sum(max(chunk_numel - sum(numels[i] for i in idx), 0) for idx in pack(numels, chunk_numel))


def padding(numels: list[int], chunk_numel: int, world: int) -> int:
    """Padding elements of the chunks `chunk_numel` packs `numels` into, sharded over `world`
    ranks (less than `world` per chunk)."""
    out = 0
    for idx in pack(numels, chunk_numel):
        used = sum(numels[i] for i in idx)
        out += chunk_numel_for(used, world) - used
    return out


def search_chunk_size(numels: list[int], lo: int, hi: int, step: int, world: int = 1) -> int:
    """The capacity in [lo, hi] (multiples of `step`, rounded to `world`) that packs the
    parameters most tightly (`unused_capacity`); ties go to the smaller capacity, which needs
    less device memory while computing."""
    if lo > hi or step <= 0:
        raise ValueError(f"chunk size search range {lo}..{hi} step {step} is empty")
    best, best_slack = None, None
    size = _round_up(lo, world)
    while size <= hi:
        slack = unused_capacity(numels, size)
        if best_slack is None or slack < best_slack:
            best, best_slack = size, slack
        size += _round_up(step, world)
    return best if best is not None else _round_up(lo, world)


_PLACEHOLDERS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-memory stand-in with the parameter's shape (a stride-0 view of one element), so
    that code reading `weight.shape`/`dtype` outside forward keeps working."""
    key = (dtype, device)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.zeros(1, dtype=dtype, device=device)
    return _PLACEHOLDERS[key].expand(shape)


@dataclass(eq=False)
class Chunk:
    index: int
    params: list[nn.Parameter]
    names: list[str]
    layout: FlatLayout  # slots of the params, then one padding slot
    dtype: torch.dtype
    rank: int  # this rank's shard index (0 when not sharded)
    sharded: bool
    shard: torch.Tensor | None = None
    shard_tier: str = HOST
    home: str | None = None  # static policy: where the shard lives between uses
    optim_tier: str = HOST  # "device", "host" or "disk" (master and moments in a file: phalanx.gemini.disk)
    master: torch.Tensor | None = None
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    master_grad: torch.Tensor | None = None
    full: torch.Tensor | None = None
    grad_full: torch.Tensor | None = None
    state: ChunkState = ChunkState.FREE
    users: int = 0
    used: set[int] = field(default_factory=set)  # params used by this forward
    arrived: set[int] = field(default_factory=set)  # params whose gradient arrived this backward
    reduced: bool = False
    pending: object = None  # async gather of a prefetch: (work handles, full)
    device: torch.device = torch.device("cpu")  # the compute device (where placeholders live)

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def world(self) -> int:
        return self.layout.world_size

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel

    @property
    def full_is_shard(self) -> bool:
        return self.world == 1

    @property
    def trainable(self) -> list[int]:
        return [i for i, p in enumerate(self.params) if p.requires_grad]

    def full_bytes(self) -> int:
        return self.numel * self.params[0].element_size()

    def shard_bytes(self) -> int:
        return self.shard_numel * self.params[0].element_size()

    def optim_bytes(self) -> int:
        return 4 * 4 * self.shard_numel  # fp32 master, exp_avg, exp_avg_sq, gradient

    def master_shares_shard(self, shard_tier: str, optim_tier: str) -> bool:
        """Whether, with the shard on `shard_tier` and the optimizer state on `optim_tier`, the
        fp32 master is the shard itself (fp32 compute, one tier, not the disk)."""
        return SHARE_FP32_MASTER and self.dtype == torch.float32 and shard_tier == optim_tier != DISK

    def shared_bytes(self, shard_tier: str, optim_tier: str) -> int:
        """Bytes that `shard_bytes() + optim_bytes()` counts twice for this placement."""
        return self.shard_bytes() if self.master_shares_shard(shard_tier, optim_tier) else 0

    @property
    def master_is_shard(self) -> bool:
        return self.master is not None and self.master is self.shard

    def attach(self) -> None:
        """Point the parameters at their slices of the gathered buffer."""
        for slot, p in zip(self.layout.slots, self.params):
            p.data = self.full[slot.offset:slot.end].view(p.shape)

    def detach(self) -> None:
        for p in self.params:
            p.data = placeholder(p.shape, self.dtype, self.device)

    def owned(self):
        """(param index, start, end) of the parts of parameters this rank's shard holds, in
        parameter coordinates (padding excluded)."""
        for slot, a, b in self.layout.owned_slots(self.rank):
            if slot.index < len(self.params):
                yield slot.index, a, b


def build_layouts(numels: list[int], chunk_numel: int, dp_size: int, shard_param_frac: float
                  ) -> list[tuple[list[int], FlatLayout, bool]]:
    """Pack parameters into chunks of capacity `chunk_numel` and give each its layout (its
    contents and less than `world` elements of padding); the first `round(shard_param_frac * n)`
    chunks are sharded over `dp_size` ranks, the rest replicated."""
    groups = pack(numels, chunk_numel)
    n_sharded = round(shard_param_frac * len(groups))
    out = []
    for ci, idx in enumerate(groups):
        sharded = ci < n_sharded and dp_size > 1
        world = dp_size if sharded else 1
        used = sum(numels[i] for i in idx)
        size = chunk_numel_for(used, world)
        layout = FlatLayout.build([numels[i] for i in idx] + [size - used], world)
        out.append((idx, layout, sharded))
    return out
