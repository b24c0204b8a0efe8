"""FP8-compressed communication: gradients travel as 8-bit floats, one fp32 scale per piece.

`fp8_communication="e4m3"` (or `"e5m2"`) on DDPPlugin and ZeroPlugin sends each rank's gradient
bucket as float8 bytes instead of fp32 (a quarter of the bytes) or bf16 (a half):

- quantise: a piece `x` gets the scale `s = fmax / amax(|x|)` (fmax: the format's largest
  finite value, 448 for e4m3, 57344 for e5m2), and `round_to_fp8(x * s)` travels; the receiver
  divides by `s`. Each value keeps the format's relative precision (2^-4 for e4m3's three mantissa
  bits, 2^-3 for e5m2) down to the format's smallest normal times `amax / fmax`; smaller values
  lose digits in the subnormals (`error_bound` gives the bound the tests check).
- reduce-scatter (ZeRO): every rank cuts its bucket into the parts the ranks own, quantises each
  part with its own scale and sends part r to rank r (one all-to-all of bytes, one of scales);
  rank r dequantises the copies it receives and adds them in fp32. One quantisation per value.
- all-reduce (DDP): that reduce-scatter, then each rank quantises its summed part again and
  all-gathers the bytes (and scales). Two quantisations; 2(W-1)/W bytes per element per rank,
  against 8(W-1)/W for a ring all-reduce of fp32.

Sums are always taken in fp32 after dequantising (never in fp8). The format choice: e4m3 keeps
more digits, e5m2 more range; with one scale per part the range is rarely the limit, so e4m3 is
the default. Works on every backend whose all-to-all moves uint8 (gloo, NCCL), on the tensors'
own device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

FORMATS: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_MANTISSA_BITS = {"e4m3": 3, "e5m2": 2}
# The smallest positive subnormal of each format: below it a scaled value rounds to 0.
_SMALLEST_SUBNORMAL = {"e4m3": 2.0 ** -9, "e5m2": 2.0 ** -16}

# torch 2.13 renamed the single-tensor all-gather; older releases only have the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def check_format(fmt: str | bool | None, owner: str) -> str | None:
    """The validated format name for a plugin's `fp8_communication` value (None/False: off;
    True: e4m3)."""
    if fmt in (None, False):
        return None
    if fmt is True:
        return "e4m3"
    if fmt not in FORMATS:
        raise ValueError(f"{owner}(fp8_communication={fmt!r}): choose 'e4m3' (more digits, the default when True), "
                         "'e5m2' (more range) or False")
    return fmt


def fp8_max(fmt: str) -> float:
    return float(torch.finfo(FORMATS[fmt]).max)


def scales_for(rows: torch.Tensor, fmt: str) -> torch.Tensor:
    """One scale per row of `rows` [k, n] (fp32): fmax / amax, or 1 for an all-zero row."""
    amax = rows.abs().amax(dim=1).float() if rows.shape[1] else torch.zeros(rows.shape[0], device=rows.device)
    return torch.where(amax > 0, fp8_max(fmt) / amax.clamp(min=torch.finfo(torch.float32).tiny),
                       torch.ones_like(amax))


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """x * scale rounded to the fp8 format, as uint8 bytes (what the collectives move)."""
    return (x.float() * scale).to(FORMATS[fmt]).view(torch.uint8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values of uint8 fp8 bytes `q` quantised with `scale`."""
    return q.view(FORMATS[fmt]).float() / scale


def error_bound(x: torch.Tensor, scale: torch.Tensor | float, fmt: str) -> torch.Tensor:
    """Elementwise bound on |dequantize(quantize(x, scale)) - x|: half a unit in the last place,
    i.e. 2^-(m+1) relative for normal values, plus half the smallest subnormal (absolute, in
    x's units) for values that fall into the subnormals."""
    relative = 2.0 ** -(_MANTISSA_BITS[fmt] + 1)
    return x.abs().float() * relative + _SMALLEST_SUBNORMAL[fmt] / 2 / scale


@dataclass
class Fp8Traffic:
    """Bytes this rank sent through fp8 collectives (payload + scales), and what the same
    collectives would have sent at the tensors' own dtype (for the compression figure)."""

    sent: int = 0
    uncompressed: int = 0

    def add(self, sent: int, uncompressed: int) -> None:
        self.sent += sent
        self.uncompressed += uncompressed


def reduce_scatter_fp8(flat: torch.Tensor, sizes: Sequence[int], group: dist.ProcessGroup | None, fmt: str,
                       traffic: Fp8Traffic | None = None) -> torch.Tensor:
    """The fp32 sum over the group of this rank's part of `flat` (cut into consecutive parts of
    `sizes`, one per rank, uneven or empty allowed), each rank's copy travelling as fp8 with its
    own scale. Collective; returns a new fp32 tensor of sizes[rank] values."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(sizes) != world or sum(sizes) != flat.numel():
        raise ValueError(f"reduce_scatter_fp8: {len(sizes)} parts summing to {sum(sizes)} for {world} ranks and "
                         f"{flat.numel()} values")
    parts = flat.reshape(-1).split(list(sizes))
    scales = torch.stack([scales_for(p.reshape(1, -1), fmt)[0] for p in parts])  # [world] fp32
    send = torch.cat([quantize(p, s, fmt) for p, s in zip(parts, scales)])
    own = sizes[rank]
    received = torch.empty(own * world, dtype=torch.uint8, device=flat.device)
    dist.all_to_all_single(received, send, output_split_sizes=[own] * world, input_split_sizes=list(sizes),
                           group=group)
    received_scales = torch.empty_like(scales)
    dist.all_to_all_single(received_scales, scales, group=group)
    if traffic is not None:
        others = flat.numel() - own
        traffic.add(others + 4 * (world - 1), others * flat.element_size())
    copies = received.view(world, own)
    return dequantize(copies, received_scales[:, None], fmt).sum(dim=0)


def all_reduce_fp8(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, fmt: str = "e4m3",
                   average: bool = False, traffic: Fp8Traffic | None = None) -> torch.Tensor:
    """Sum (or average) `tensor` over the group in place, through fp8: `reduce_scatter_fp8` over
    equal parts, then an all-gather of each rank's quantised sum. Collective; returns `tensor`."""
    world = dist.get_world_size(group)
    if world == 1:
        return tensor
    flat = tensor.reshape(-1)
    n = flat.numel()
    chunk = math.ceil(n / world)
    padded = torch.zeros(chunk * world, dtype=flat.dtype, device=flat.device)
    padded[:n] = flat
    mine = reduce_scatter_fp8(padded, [chunk] * world, group, fmt, traffic)
    if average:
        mine /= world
    scale = scales_for(mine.reshape(1, -1), fmt)
    gathered = torch.empty(chunk * world, dtype=torch.uint8, device=flat.device)
    _all_gather_single(gathered, quantize(mine, scale, fmt), group=group)
    all_scales = torch.empty(world, dtype=torch.float32, device=flat.device)
    _all_gather_single(all_scales, scale, group=group)
    if traffic is not None:
        traffic.add(chunk * (world - 1) + 4 * (world - 1), chunk * (world - 1) * flat.element_size())
    values = dequantize(gathered.view(world, chunk), all_scales[:, None], fmt).reshape(-1)[:n]
    flat.copy_(values.to(flat.dtype))
    if tensor.data_ptr() != flat.data_ptr():  # a non-contiguous tensor: reshape copied
        tensor.copy_(flat.view_as(tensor))
    return tensor


@dataclass
class DDPHookState:
    """State of `ddp_fp8_hook`: the group, the format and the bytes counted."""

    group: dist.ProcessGroup | None
    fmt: str
    traffic: Fp8Traffic


def ddp_fp8_hook(state: DDPHookState, bucket):  # noqa: ANN001 - DDP checks the annotations as objects,
    # and `from __future__ import annotations` turns them into strings: none on bucket or the result
    """A DistributedDataParallel communication hook: the bucket's gradients averaged over the
    group through `all_reduce_fp8`. It runs when DDP hands over the bucket (synchronously: the
    quantise/dequantise steps sit between the two collectives) and returns a completed future
    (`torch.futures.Future` of the bucket's `dist.GradBucket.buffer()`)."""
    buffer = bucket.buffer()
    all_reduce_fp8(buffer, state.group, state.fmt, average=True, traffic=state.traffic)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future
