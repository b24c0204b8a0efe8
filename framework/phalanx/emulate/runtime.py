"""The emulated GPU's runtime: what `torch.cuda` answers on a GPU machine, answered for
`torch.emucuda` (device count, current device, memory statistics, streams and events, RNG,
properties, autocast dtypes), plus the counters tests read (device -> host syncs)."""
from __future__ import annotations

import collections
import contextlib
import os
import threading
import weakref
from dataclasses import dataclass

import torch

from phalanx_kernels.accelerator import EMULATED_TYPE

GIB = 1 << 30


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def device_count() -> int:
    """Each process sees one emulated GPU, as each rank does when a launcher sets
    CUDA_VISIBLE_DEVICES per rank. Why not one per local rank: torch's device-guard hook for a
    Python backend reports one device to the autograd engine, which then refuses a backward on
    device index 1 or higher."""
    return 1


class _State(threading.local):
    def __init__(self):
        self.device = 0


_STATE = _State()


def current_index() -> int:
    return _STATE.device


def _index(device=None) -> int:
    if device is None:
        return _STATE.device
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return device.index if device.index is not None else _STATE.device


class SyncCounter:
    """Counts device -> host transfers (each one a wait for the device on a real GPU)."""

    def __init__(self):
        self.count = 0
        self.by_op: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def record(self, op) -> None:
        with self._lock:
            self.count += 1
            self.by_op[str(op)] += 1

    def reset(self) -> None:
        with self._lock:
            self.count = 0
            self.by_op.clear()


SYNCS = SyncCounter()


class MemoryMeter:
    """Bytes of live device storage per emulated GPU, and the peak since the last reset.

    A storage is counted at its size when a device tensor first refers to it and released when the
    last such tensor is collected (storages freed by `untyped_storage().resize_(0)` while a tensor
    still holds them stay counted: see docs/testing.md)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._storages: dict[tuple[int, int], list[int]] = {}  # (device, data_ptr) -> [bytes, refs]
        self.allocated: collections.Counter = collections.Counter()
        self.peak: collections.Counter = collections.Counter()

    def track(self, wrapper: torch.Tensor, elem: torch.Tensor) -> None:
        storage = elem.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        index = wrapper.device.index or 0
        key = (index, storage.data_ptr())
        with self._lock:
            entry = self._storages.get(key)
            if entry is None:
                self._storages[key] = [nbytes, 1]
                self.allocated[index] += nbytes
                self.peak[index] = max(self.peak[index], self.allocated[index])
            else:
                entry[1] += 1
        weakref.finalize(elem, self._release, key)  # not on the wrapper: Module.to swaps wrappers

    def _release(self, key) -> None:
        with self._lock:
            entry = self._storages.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._storages[key]
                self.allocated[key[0]] -= entry[0]

    def reset_peak(self, index: int) -> None:
        with self._lock:
            self.peak[index] = self.allocated[index]


MEMORY = MemoryMeter()


def total_memory() -> int:
    """The emulated card's memory: PHALANX_EMULATE_GPU_MEMORY_GIB, 2 GiB by default. Small on
    purpose: what sizes itself by the card (the inference engine's KV cache takes 90% of what is
    free) really allocates it, in host memory."""
    return _env_int("PHALANX_EMULATE_GPU_MEMORY_GIB", 2) * GIB


@dataclass(frozen=True)
class DeviceProperties:
    name: str
    total_memory: int
    major: int
    minor: int
    multi_processor_count: int


_GENERATORS: dict[int, torch.Generator] = {}


def generator(device=None) -> torch.Generator:
    """The device's own random generator (CPU generators compute, the state is the device's)."""
    index = _index(device)
    gen = _GENERATORS.get(index)
    if gen is None:
        gen = _GENERATORS[index] = torch.Generator()
        gen.manual_seed(torch.initial_seed())
    return gen


class Event:
    """Events complete immediately: the emulated device runs each operation when it is issued."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self._time = None

    def record(self, stream=None) -> None:
        import time

        self._time = time.perf_counter()

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "Event") -> float:
        return 1000.0 * ((end._time or 0.0) - (self._time or 0.0))


class Stream:
    """A stream whose work is already done when issued (ordering is trivially kept)."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = torch.device(EMULATED_TYPE, _index(device))
        self.priority = priority

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def __eq__(self, other):
        return isinstance(other, Stream) and other.device == self.device and other is self

    __hash__ = object.__hash__


_DEFAULT_STREAMS: dict[int, Stream] = {}
_CURRENT_STREAM = threading.local()


class EmulatedDeviceModule:
    """Registered as `torch.emucuda`: the functions of `torch.cuda` that phalanx and torch's own
    distributed code (FSDP2, DDP, autocast, RNG forks) call on an accelerator."""

    Stream = Stream
    Event = Event

    # availability and devices
    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def _lazy_init() -> None:
        pass

    @staticmethod
    def device_count() -> int:
        return device_count()

    @staticmethod
    def current_device() -> int:
        return _STATE.device

    @staticmethod
    def set_device(device) -> None:
        index = _index(device)
        if not 0 <= index < device_count():
            raise RuntimeError(f"invalid device ordinal {index}: {device_count()} emulated GPUs")
        _STATE.device = index

    @staticmethod
    @contextlib.contextmanager
    def device(device):
        previous = _STATE.device
        EmulatedDeviceModule.set_device(device)
        try:
            yield
        finally:
            _STATE.device = previous

    @staticmethod
    def synchronize(device=None) -> None:
        pass

    # properties
    @staticmethod
    def get_device_properties(device=None) -> DeviceProperties:
        return DeviceProperties("Emulated GPU (phalanx)", total_memory(), 9, 0, 132)

    @staticmethod
    def get_device_name(device=None) -> str:
        return "Emulated GPU (phalanx)"

    @staticmethod
    def get_device_capability(device=None) -> tuple[int, int]:
        return (9, 0)

    @staticmethod
    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return True

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    # memory
    @staticmethod
    def memory_allocated(device=None) -> int:
        return MEMORY.allocated[_index(device)]

    @staticmethod
    def max_memory_allocated(device=None) -> int:
        return MEMORY.peak[_index(device)]

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        MEMORY.reset_peak(_index(device))

    # no caching allocator: what is reserved is what is allocated
    memory_reserved, max_memory_reserved = memory_allocated, max_memory_allocated
    reset_max_memory_allocated = reset_peak_memory_stats

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def mem_get_info(device=None) -> tuple[int, int]:
        total = total_memory()
        return total - MEMORY.allocated[_index(device)], total

    @staticmethod
    def memory_stats(device=None) -> dict:
        index = _index(device)
        return {"allocated_bytes.all.current": MEMORY.allocated[index],
                "allocated_bytes.all.peak": MEMORY.peak[index]}

    # streams
    @staticmethod
    def default_stream(device=None) -> Stream:
        index = _index(device)
        if index not in _DEFAULT_STREAMS:
            _DEFAULT_STREAMS[index] = Stream(index)
        return _DEFAULT_STREAMS[index]

    @staticmethod
    def current_stream(device=None) -> Stream:
        return getattr(_CURRENT_STREAM, "stream", None) or EmulatedDeviceModule.default_stream(device)

    @staticmethod
    def set_stream(stream: Stream) -> None:
        _CURRENT_STREAM.stream = stream

    @staticmethod
    @contextlib.contextmanager
    def stream(stream: Stream | None):
        previous = getattr(_CURRENT_STREAM, "stream", None)
        if stream is not None:
            _CURRENT_STREAM.stream = stream
        try:
            yield
        finally:
            _CURRENT_STREAM.stream = previous

    # random numbers
    @staticmethod
    def manual_seed(seed: int) -> None:
        generator(None).manual_seed(int(seed))

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        for index in range(device_count()):
            generator(index).manual_seed(int(seed))

    @staticmethod
    def seed() -> None:
        generator(None).seed()

    @staticmethod
    def seed_all() -> None:
        for index in range(device_count()):
            generator(index).seed()

    @staticmethod
    def initial_seed() -> int:
        return generator(None).initial_seed()

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        return generator(device).get_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device=None) -> None:
        generator(device).set_state(state)

    @staticmethod
    def get_rng_state_all() -> list[torch.Tensor]:
        return [generator(i).get_state() for i in range(device_count())]

    @staticmethod
    def set_rng_state_all(states) -> None:
        for i, state in enumerate(states):
            generator(i).set_state(state)


def patch_accelerator_streams() -> None:
    """`torch.accelerator.current_stream()` answers with the emulated device module's own stream.

    torch's version returns a C++ `torch.Stream`, whose `wait_event` accepts only C++ events; the
    emulated device's events are Python objects (complete when issued). FSDP2 records its
    all-gather events on the device module's streams and, in `finalize_backward` after a recomputed
    forward (activation checkpointing), waits on them through `torch.accelerator.current_stream()`:
    "Event device type CPU does not match blocking stream's device type EMUCUDA" before this."""
    original = torch.accelerator.current_stream
    if getattr(original, "_phalanx_emulated", False):
        return

    def current_stream(device=None):
        if device is None or isinstance(device, int):
            accelerator = torch.accelerator.current_accelerator()
            is_emulated = accelerator is not None and accelerator.type == EMULATED_TYPE
        else:
            is_emulated = torch.device(device).type == EMULATED_TYPE
        return EmulatedDeviceModule.current_stream(device) if is_emulated else original(device)

    current_stream._phalanx_emulated = True
    torch.accelerator.current_stream = current_stream
