"""ZeRO's flat buffer is built without holding the model twice.

`FlatParamGroup` copies the parameters into one flat buffer and points each parameter at its
view. Counted by the kernel's high-water mark of this process's resident memory (reset through
/proc/self/clear_refs just before the build, so a transient of any length is caught:
`peak_memory`): the build adds at most one parameter in flight plus, for a bf16 model, this
rank's fp32 master shard (1/4 of the model here; an fp32 model's master is its own slice of the
buffer), where a buffer made resident before the copies (torch.zeros) added a whole second model.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import peak_memory
from phalanx.testing import spawn
from phalanx.zero.flat_group import FlatParamGroup

WORLD = 4  # the layout's ranks: this process builds rank 0's group (no communication in the build)


def measure_build(dtype: torch.dtype) -> dict | None:
    """In a fresh process (glibc told to give freed memory back, which `follow_live_memory` sets
    for the whole process): the resident memory the build adds at its peak and what it built."""
    if not peak_memory.available():
        return None
    torch.manual_seed(0)
    # 16 parameters of 4 MiB (64 MiB) plus a small odd one (padding at the end of the buffer)
    params = [nn.Parameter(torch.randn(1024, 1024, dtype=dtype)) for _ in range(16)] + [nn.Parameter(torch.randn(7, dtype=dtype))]
    want = [p.detach().clone() for p in params]
    built = []
    added = peak_memory.peak_added(lambda: built.append(FlatParamGroup(params, rank=0, world_size=WORLD,
                                                                       process_group=None)))
    group = built[0]
    views = all(p.data.data_ptr() == group.flat[slot.offset:].data_ptr()
                for p, slot in zip(params, group.layout.slots, strict=True))
    return {"added": added, "model": sum(w.numel() * w.element_size() for w in want),
            "largest": max(w.numel() * w.element_size() for w in want),
            "master_bytes": 0 if group.master_is_view else group.layout.shard_numel * 4,
            "master_in_buffer": group.master.data_ptr() == group.flat.data_ptr(),
            "equal": all(torch.equal(p.detach(), w) for p, w in zip(params, want, strict=True)), "views": views,
            "padding": group.layout.padded_numel - group.layout.numel,
            "padding_zero": not group.flat[group.layout.numel:].any(),
            "master": torch.equal(group.master.detach().to(dtype), group.flat[:group.layout.shard_numel])}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flat_buffer_build_peaks_at_one_model(dtype):
    r = spawn(measure_build, 1, dtype)[0]
    if r is None:
        pytest.skip("needs Linux's /proc peak counters and glibc's mallopt")
    # the fp32 master shard (bf16: 1/4 of the model in fp32; fp32: none, the master is the
    # buffer's own slice), at most one parameter in flight and allocator slack; a second model
    # (the old peak) would be 64 / 32 MiB more
    assert r["added"] <= r["master_bytes"] + r["largest"] + 2 * 2**20, (r["added"] / r["model"], r)
    if dtype == torch.bfloat16:
        assert r["added"] >= 0.9 * r["master_bytes"]  # the measure sees the shard it must see
    else:
        assert r["master_in_buffer"], "an fp32 model's master must be its own slice of the flat buffer"
    assert r["equal"] and r["views"], "each parameter must be a view of the buffer with its own values"
    assert r["padding"] > 0 and r["padding_zero"]
    assert r["master"]
