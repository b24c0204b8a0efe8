"""This rank's pieces of Gemini's fp32 master weights, parameter by parameter, for code that
follows the weights between steps (`phalanx.train.EMA`).

Outside forward a Gemini parameter is a one-element placeholder; its value lives in the chunks:
each rank holds a contiguous shard of every sharded chunk (so a piece, possibly empty, of each of
its parameters) and the whole of every replicated chunk. `LocalMasters` hands out those pieces
as views of the fp32 masters, gathers full tensors from per-piece values (a collective), cuts a
full tensor down to this rank's piece, and writes values into the weights (masters and the
compute-dtype shards the next forward gathers).
"""
from __future__ import annotations

import torch

from phalanx.gemini.tiers import DISK
from phalanx.zero import comm


class LocalMasters:
    def __init__(self, manager, names: list[str]):
        self.manager = manager
        self.names = list(names)
        where = {n: (chunk, k) for chunk in manager.chunks for k, n in enumerate(chunk.names)}
        missing = [n for n in self.names if n not in where]
        if missing:
            raise ValueError(f"parameters {missing[:3]} are not in the Gemini chunks of this model")
        self._where = [where[n] for n in self.names]
        # per name: (start, end) in this rank's shard and (a, b) in the flattened parameter
        self._ranges: list[tuple[int, int, int, int]] = []
        for chunk, k in self._where:
            part = next(((a, b) for i, a, b in chunk.owned() if i == k), None)
            if part is None:
                self._ranges.append((0, 0, 0, 0))
                continue
            a, b = part
            start = chunk.layout.to_shard(chunk.rank, chunk.layout.slots[k].offset + a)
            self._ranges.append((start, start + (b - a), a, b))
        self._chunks = list(dict.fromkeys(chunk for chunk, _ in self._where))  # model order, no repeats

    def pieces(self) -> list[torch.Tensor]:
        """Views of this rank's part of each parameter's fp32 master (empty where it owns none).
        Taken afresh on every call: a placement policy may move the masters between tiers. For
        chunks on the disk tier they are copies read from the files: change weights with `write`."""
        masters = {}
        for chunk in self._chunks:
            if chunk.optim_tier == DISK:
                with self.manager.optim_state(chunk):
                    masters[id(chunk)] = chunk.master.clone()
            else:
                masters[id(chunk)] = chunk.master
        return [masters[id(chunk)][s:e] for (chunk, _), (s, e, _, _) in zip(self._where, self._ranges, strict=True)]

    def piece_of(self, index: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full value of parameter `index`."""
        _, _, a, b = self._ranges[index]
        return full.reshape(-1)[a:b]

    def gather(self, values: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """{name: full tensor} from per-piece `values` (like `pieces()`). A collective."""
        out: dict[str, torch.Tensor] = {}
        for chunk in self._chunks:
            device = chunk.master.device if chunk.master is not None else self.manager.tiers.device  # None: on disk
            shard = torch.zeros(chunk.shard_numel, dtype=torch.float32, device=device)
            mine = [i for i, (c, _) in enumerate(self._where) if c is chunk]
            for i in mine:
                s, e, _, _ = self._ranges[i]
                shard[s:e].copy_(values[i])
            if chunk.sharded:
                full = torch.empty(chunk.numel, dtype=torch.float32, device=shard.device)
                comm.wait(comm.all_gather_into(full, shard, self.manager.group, "gemini.gather_local"),
                          "gemini.gather_local")
            else:
                full = shard
            for i in mine:
                k = self._where[i][1]
                slot, param = chunk.layout.slots[k], chunk.params[k]
                out[self.names[i]] = full[slot.offset:slot.end].view(param.shape).clone()
        return out

    @torch.no_grad()
    def write(self, values: list[torch.Tensor]) -> None:
        """Set the masters' pieces to `values` and refresh the compute-dtype shards from them."""
        if len(values) != len(self.names):
            raise ValueError(f"{len(values)} values for {len(self.names)} parameters")
        for chunk in self._chunks:
            with self.manager.optim_state(chunk, write=True):
                for i, (c, _) in enumerate(self._where):
                    if c is chunk:
                        s, e, _, _ = self._ranges[i]
                        chunk.master[s:e].copy_(values[i])
                self.manager.publish(chunk)
