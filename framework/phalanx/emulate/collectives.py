"""The emulated GPU's collectives: the NCCL path, carried by gloo.

A run under emulation initialises its process group with gloo serving both the CPU and the
emulated device ("cpu:gloo,emucuda:gloo"): a collective on device tensors reaches gloo through the
tensor's dispatch, which hands gloo the CPU tensors inside. What NCCL would refuse is refused
before gloo sees it: every public collective of `torch.distributed` called on a CPU tensor (0-dim
ones too, as NCCL refuses them) raises, naming the collective and the tensor. Object collectives
put their buffers on the device, as torch does for NCCL. Collectives that torch's own C++ code
issues (DDP's reducer, functional collectives) are not guarded: they come from correct code.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from phalanx_kernels.accelerator import EMULATED_TYPE

BACKEND = f"cpu:gloo,{EMULATED_TYPE}:gloo"

# Public collectives and the positions/keywords of the tensors they take.
_GUARDED = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv", "isend",
    "irecv", "all_reduce_coalesced", "all_gather_coalesced",
)

_INSTALLED = False


def _is_emulated_nccl(group) -> bool:
    try:
        group = group or c10d._get_default_group()
        return any(d.type == EMULATED_TYPE for d in group._device_types)
    except Exception:  # noqa: BLE001 - no default group: nothing to guard
        return False


def _cpu_tensors(value):
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu":
            yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _cpu_tensors(item)


def refusal(name: str, tensor: torch.Tensor) -> RuntimeError:
    return RuntimeError(
        f"torch.distributed.{name} got a CPU tensor (shape {tuple(tensor.shape)}, {tensor.dtype}) on the NCCL "
        "path: NCCL takes only GPU tensors (emulated GPU, PHALANX_EMULATE_GPU=1). Put the tensor on the run's "
        "device (phalanx.device.to_device / phalanx.launch.context().device) or use a gloo group for host data.")


def _guard(name: str, fn):
    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        group = kwargs.get("group")
        if group is None:
            group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        if _is_emulated_nccl(group):
            for value in (*args, *kwargs.values()):
                for tensor in _cpu_tensors(value):
                    raise refusal(name, tensor)
        return fn(*args, **kwargs)

    guarded.__phalanx_guarded__ = True
    return guarded


def _object_collective_device(group=None) -> str:
    """torch uses the GPU for object collectives on NCCL; the same for the emulated NCCL."""
    if _is_emulated_nccl(group):
        return EMULATED_TYPE
    return _ORIGINAL_OBJECT_DEVICE(group)


_ORIGINAL_OBJECT_DEVICE = c10d._get_object_coll_device


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    for name in _GUARDED:
        fn = getattr(c10d, name, None)
        if fn is None or getattr(fn, "__phalanx_guarded__", False):
            continue
        guarded = _guard(name, fn)
        setattr(c10d, name, guarded)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, guarded)
    c10d._get_object_coll_device = _object_collective_device
    _INSTALLED = True
