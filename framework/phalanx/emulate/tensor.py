"""The emulated GPU's tensor: a CPU tensor wrapped so that it reports an accelerator device.

`EmulatedTensor` is a wrapper subclass (as torch's FakeTensor and DTensor are): the outer tensor
has device `emucuda:N`, no storage of its own, and goes through `__torch_dispatch__` for every
operation, where the CPU tensor inside (`elem`) does the work. Autograd, `nn.Parameter`,
`Module.to`, autocast and the optimizers see an accelerator tensor; the dispatch enforces what a
GPU would:

- an operation mixing a device tensor with a CPU tensor raises (a 0-dim CPU tensor is allowed, as
  CUDA allows it; copies and CPU index tensors are allowed, as on CUDA);
- device -> host transfers (`.item()`, `.cpu()`, `.tolist()`, `bool(t)`, `nonzero`, ...) are
  counted in `runtime.SYNCS`, so tests can bound them;
- random numbers come from the device's own generator, not the CPU's (as on CUDA);
- collectives (`c10d` / functional collectives) receive the CPU tensors inside, and functional
  collectives complete before they return (`collectives.py` refuses plain CPU tensors at the
  public API, as NCCL does).
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_map

from phalanx_kernels.accelerator import EMULATED_TYPE

from . import runtime

aten = torch.ops.aten

# Operations allowed to see device and CPU tensors together, as on CUDA.
_MIXING_ALLOWED = {
    aten.copy_.default, aten._to_copy.default, aten._copy_from.default, aten._copy_from_and_resize.default,
    aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default,
    aten.set_.source_Tensor, aten.lift_fresh.default, aten.lift_fresh_copy.default,
}
# Operations whose result needs the data on the host: on CUDA each one waits for the device.
_SYNCING = {
    aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default, aten.equal.default,
    aten.is_nonzero.default, aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor, aten.nonzero_static.default,
}
_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "_c10d_functional_autograd"}
# Views that only set a bit on the tensor (complex conjugate, negation; autograd's complex formulas
# call them, e.g. mul's backward multiplies by `other.conj()`). The wrapper cannot carry the bit,
# and an op dispatched from `__torch_dispatch__` computed with the inner conjugate view as if the bit
# were clear (DeepSeek-V2's complex RoPE got wrong gradients). So they are materialised: the values
# are right; a write through `conj()` no longer reaches the original (docs/testing.md: limits).
_BIT_VIEWS = {aten._conj.default, aten._neg_view.default}


class EmulatedTensor(torch.Tensor):
    """A tensor on the emulated GPU; `elem` is the CPU tensor that holds its data."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor, device: torch.device, requires_grad: bool = False):
        if isinstance(elem, EmulatedTensor):
            raise TypeError("EmulatedTensor wraps a CPU tensor, not another EmulatedTensor")
        device = torch.device(device)
        if device.index is None:
            device = torch.device(device.type, runtime.current_index())
        r = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
            layout=elem.layout, device=device, requires_grad=requires_grad)
        r.elem = elem
        runtime.MEMORY.track(r, elem)
        return r

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = EmulatedTensor(self.elem.clone(), self.device)
        if getattr(self, "_is_param", False):  # a deep-copied module keeps Parameters
            new = torch.nn.Parameter(new, requires_grad=self.requires_grad)
        else:
            new.requires_grad_(self.requires_grad)
        memo[id(self)] = new
        return new

    def __reduce_ex__(self, protocol):
        # Pickled as CUDA tensors are: the data travels, and it is rebuilt on the receiver's device.
        return _rebuild, (self.elem.detach().clone(), self.requires_grad)

    def __repr__(self, *, tensor_contents=None):
        return f"{self.elem!r} on {self.device} (emulated GPU)"

    # `t.data` and `t.data = other`: the CPU tensor inside must follow, or a parameter re-pointed
    # into a flat buffer (ZeRO, Gemini) would keep computing with its old storage.
    @property
    def data(self):
        return EmulatedTensor(self.elem, self.device)

    @data.setter
    def data(self, new):
        if not isinstance(new, EmulatedTensor):
            raise RuntimeError(f"cannot set the data of a tensor on {self.device} to a tensor on {new.device}: "
                               "move it to the device first")
        torch._C.TensorBase.data.__set__(self, new)
        self.elem = new.elem
        runtime.MEMORY.track(self, new.elem)

    # Python-level storage queries answer for the data inside, as they would on a GPU tensor.
    def data_ptr(self) -> int:
        return self.elem.data_ptr()

    def untyped_storage(self):
        return self.elem.untyped_storage()

    def tolist(self):
        runtime.SYNCS.record("tolist")
        return self.elem.tolist()

    def numpy(self, *, force: bool = False):
        raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to copy the "
                        "tensor to host memory first.")

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.is_view and torch.is_inference_mode_enabled() and not any(
                isinstance(a, torch.Tensor) and a.is_inference() for a in tree_flatten((args, kwargs))[0]):
            # A view of a normal tensor inside inference_mode is a normal tensor (CPU and CUDA
            # allow it); made inside inference mode, the inner view would be an inference tensor.
            with torch.inference_mode(False):
                return _dispatch(func, args, kwargs)
        return _dispatch(func, args, kwargs)


def _rebuild(elem: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    from phalanx_kernels.accelerator import emulated

    if not emulated():
        return elem.requires_grad_(requires_grad)
    return EmulatedTensor(elem, torch.device(EMULATED_TYPE, runtime.current_index()), requires_grad)


def _is_cpu_operand(t) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, EmulatedTensor) and t.device.type == "cpu" and t.dim() > 0


def _device_kwarg(kwargs: dict) -> torch.device | None:
    d = kwargs.get("device")
    return None if d is None else torch.device(d)


def device_mismatch(func, a: torch.device | str, b: torch.device | str) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}! "
        f"(in {func}; under PHALANX_EMULATE_GPU {EMULATED_TYPE}:N stands for cuda:N: a real GPU raises the same "
        "error here. Move the CPU operand to the run's device, e.g. with phalanx.device.to_device.)")


def _dispatch(func, args, kwargs):
    flat, _ = tree_flatten((args, kwargs))
    device = None
    cpu_operand = None
    for a in flat:
        if isinstance(a, EmulatedTensor):
            if device is None:
                device = a.device
            elif a.device != device and func not in _MIXING_ALLOWED:
                raise device_mismatch(func, device, a.device)
        elif cpu_operand is None and _is_cpu_operand(a):
            cpu_operand = a
    if cpu_operand is not None and func not in _MIXING_ALLOWED:
        raise device_mismatch(func, device, "cpu")

    if func is aten._to_copy.default:
        return _to_copy(args[0], kwargs)
    if func is aten.histc.default and not args[0].is_floating_point():
        # CUDA's histc counts integer tensors (transformers' grouped MoE experts take that branch on a
        # GPU), the CPU kernel refuses them: count in float32, return the input's dtype as CUDA does
        return _dispatch(func, (args[0].to(torch.float32), *args[1:]), kwargs).to(args[0].dtype)
    if func is aten.copy_.default:
        return _copy_(args[0], args[1], *args[2:], **kwargs)
    if func in _SYNCING:
        runtime.SYNCS.record(func)

    if func.namespace in _COLLECTIVE_NAMESPACES:
        return _collective(func, args, kwargs, device)

    target = device
    kw = dict(kwargs)
    requested = _device_kwarg(kw)
    if requested is not None:  # new_empty / empty_like / ... with an explicit device
        kw["device"] = torch.device("cpu")
        target = requested if requested.type == EMULATED_TYPE else None
    if "generator" in _argument_names(func) and kw.get("generator") is None and target is not None:
        kw["generator"] = runtime.generator(target)

    inputs = _Unwrapped()
    out = func(*tree_map(inputs, args), **tree_map(inputs, kw))
    if func in _BIT_VIEWS:
        out = out.resolve_conj().resolve_neg()
    if target is None:
        return out

    def wrap(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, EmulatedTensor):
            same = inputs.wrapper_of(t)
            if same is not None:
                return _refresh(same)  # in-place and out= results are their input, as on any device
            return EmulatedTensor(t, target)
        return t

    return tree_map(wrap, out)


class _Unwrapped:
    """Called on each argument of an op: the CPU tensor inside a device tensor (anything else as
    it is), remembering which device tensor it came from, so results that are inputs (in-place
    ops, out=) can be given back as the same device tensor."""

    def __init__(self):
        self._wrappers: dict[int, EmulatedTensor] = {}

    def __call__(self, t):
        if isinstance(t, EmulatedTensor):
            self._wrappers[id(t.elem)] = t
            return t.elem
        return t

    def wrapper_of(self, t: torch.Tensor) -> EmulatedTensor | None:
        wrapper = self._wrappers.get(id(t))
        return wrapper if wrapper is not None and wrapper.elem is t else None


def _refresh(wrapper: EmulatedTensor) -> EmulatedTensor:
    """After an in-place op that reshaped the data (`out=` resizing, `resize_`, `unsqueeze_`) the
    wrapper's sizes are stale; the result is then a new wrapper with the new sizes. Callers that
    use the returned tensor (torch's own factories: arange, cat(out=), ...) see it right; an object
    held across such a call keeps its old sizes (docs/testing.md: limits)."""
    elem = wrapper.elem
    if wrapper.shape == elem.shape and wrapper.stride() == elem.stride() \
            and wrapper.storage_offset() == elem.storage_offset():
        return wrapper
    return EmulatedTensor(elem, wrapper.device)


_ARGUMENT_NAMES: dict = {}


def _argument_names(func) -> frozenset:
    names = _ARGUMENT_NAMES.get(func)
    if names is None:
        names = _ARGUMENT_NAMES[func] = frozenset(a.name for a in func._schema.arguments)
    return names


def _to_copy(x, kwargs):
    kw = dict(kwargs)
    requested = _device_kwarg(kw)
    kw.pop("device", None)
    kw.pop("pin_memory", None)
    if not isinstance(x, EmulatedTensor):  # a CPU tensor going to the device
        return EmulatedTensor(aten._to_copy.default(x, **kw), requested)
    if requested is not None and requested.type != EMULATED_TYPE:
        runtime.SYNCS.record(aten._to_copy.default)
        return aten._to_copy.default(x.elem, **kw)
    return EmulatedTensor(aten._to_copy.default(x.elem, **kw), requested or x.device)


def _copy_(dst, src, non_blocking=False):
    if isinstance(dst, EmulatedTensor):
        dst.elem.copy_(src.elem if isinstance(src, EmulatedTensor) else src, non_blocking)
        return dst
    if isinstance(src, EmulatedTensor) and not non_blocking:
        runtime.SYNCS.record(aten.copy_.default)
    dst.copy_(src.elem, non_blocking)
    return dst


def _collective(func, args, kwargs, device):
    """Hand a collective's device tensors to gloo as the CPU tensors inside, and give back device
    tensors."""
    if func.name() == "_c10d_functional::_wrap_tensor_autograd":
        return args[0]  # the result was waited for when it was made (below)
    inputs = _Unwrapped()
    out = func(*tree_map(inputs, args), **tree_map(inputs, kwargs))
    if func.namespace == "_c10d_functional" and func.name() != "_c10d_functional::wait_tensor":
        # The emulated device is synchronous: a functional collective's result is complete when
        # it is returned (its later wait_tensor finds nothing left to wait for).
        tree_map(lambda t: torch.ops._c10d_functional.wait_tensor(t) if isinstance(t, torch.Tensor) else t, out)

    def wrap(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, EmulatedTensor):
            same = inputs.wrapper_of(t)
            if same is not None:
                return same
            return EmulatedTensor(t, device) if device is not None else t
        return t

    return tree_map(wrap, out)


def _empty_memory_format(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    elem = torch.empty(size, dtype=dtype, layout=layout, device="cpu", memory_format=memory_format)
    return EmulatedTensor(elem, torch.device(device))


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    elem = torch.empty_strided(size, stride, dtype=dtype, layout=layout, device="cpu")
    return EmulatedTensor(elem, torch.device(device))


def _copy_from(src, dst, non_blocking=False):
    """Reached with the Python key excluded (torch.tensor(data, device=...) copies that way)."""
    target = dst.elem if isinstance(dst, EmulatedTensor) else dst
    target.copy_(src.elem if isinstance(src, EmulatedTensor) else src)
    return dst


def _arange(op):
    """arange builds an empty result and resizes it inside arange.out, below the wrapper (whose
    sizes could not follow): on the emulated GPU it is computed on the CPU and wrapped instead."""
    def kernel(*args, dtype=None, layout=None, device=None, pin_memory=None):
        return EmulatedTensor(op(*args, dtype=dtype, layout=layout, device="cpu"), torch.device(device))
    return kernel


_LIBRARY: torch.library.Library | None = None


def register_factories() -> None:
    """Factories with `device="emucuda:N"` (torch.zeros, torch.randn, tensor.to(...), ...) reach
    the PrivateUse1 kernels of `empty`; everything after that goes through the wrapper."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    _LIBRARY = torch.library.Library("aten", "IMPL")
    _LIBRARY.impl("empty.memory_format", _empty_memory_format, "PrivateUse1")
    _LIBRARY.impl("empty_strided", _empty_strided, "PrivateUse1")
    _LIBRARY.impl("_copy_from", _copy_from, "PrivateUse1")
    for overload in ("default", "start", "start_step"):
        name = "arange" if overload == "default" else f"arange.{overload}"
        _LIBRARY.impl(name, _arange(getattr(aten.arange, overload)), "PrivateUse1")


_BASE_DATA = torch._C.TensorBase.data


def _get_data(self):
    return _BASE_DATA.__get__(self)


def _set_data(self, new):
    """`cpu_tensor.data = device_tensor` moves a tensor in place on a GPU (Gemini and lazy
    initialisation do it); a CPU tensor cannot take a wrapper's data, so under emulation it
    becomes a device tensor sharing the new data, keeping its identity (as Module.to does).

    On a GPU `set_data` keeps the tensor's autograd state, so what was registered on the tensor
    before the move still applies after it. `swap_tensors` swaps the C++ tensors, and with them
    the hooks registered there (`register_hook`, `register_post_accumulate_grad_hook`: the Python
    object keeps its hook dicts, the C++ side that runs them goes to the discarded object), and
    swaps `__dict__` (attributes set on the tensor). Both are carried over: Gemini registers its
    post-accumulate-grad hooks on CPU parameters before pointing them at device placeholders, and
    without this no gradient reached its chunks under emulation."""
    if isinstance(new, EmulatedTensor) and not isinstance(self, EmulatedTensor):
        replacement = EmulatedTensor(new.elem, new.device, requires_grad=self.requires_grad)
        if isinstance(self, torch.nn.Parameter):
            replacement = torch.nn.Parameter(replacement, requires_grad=self.requires_grad)
        for name, value in self.__dict__.items():
            replacement.__dict__.setdefault(name, value)
        tensor_hooks, post_accumulate_hooks = self._backward_hooks, self._post_accumulate_grad_hooks
        torch.utils.swap_tensors(self, replacement)
        # re-registers the same dicts (handles stay valid) on the C++ tensor `self` now holds
        if tensor_hooks is not None:
            self._backward_hooks = tensor_hooks
        if post_accumulate_hooks is not None:
            self._post_accumulate_grad_hooks = post_accumulate_hooks
        return
    _BASE_DATA.__set__(self, new)


_BASE_COMPATIBLE = torch._has_compatible_shallow_copy_type


def _compatible_shallow_copy_type(input: torch.Tensor, from_: torch.Tensor) -> bool:  # noqa: A002 - torch's names
    """Module.to / Module.float decide between `param.data = new` (keeping the parameter object,
    as a GPU move does) and replacing the parameter: moving to or within the emulated GPU keeps
    it, through the data setter above."""
    if isinstance(from_, EmulatedTensor) and (isinstance(input, EmulatedTensor) or input.device.type == "cpu"):
        return True
    return _BASE_COMPATIBLE(input, from_)


def patch_data_setter() -> None:
    torch.Tensor.data = property(_get_data, _set_data)
    torch._has_compatible_shallow_copy_type = _compatible_shallow_copy_type


_PINNED: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def pin_memory(self: torch.Tensor, device=None) -> torch.Tensor:
    """Page-locked host memory has no meaning without a real GPU: a copy marked as pinned."""
    if isinstance(self, EmulatedTensor):
        raise RuntimeError(f"cannot pin '{self.device}' memory: only CPU tensors can be pinned")
    if is_pinned(self):
        return self
    copy = self.clone()
    _PINNED[id(copy)] = copy
    return copy


def is_pinned(self: torch.Tensor, device=None) -> bool:
    return _PINNED.get(id(self)) is self


def _pinned_factory(factory):
    def make(*args, pin_memory: bool = False, **kwargs):
        t = factory(*args, **kwargs)
        if pin_memory:
            _PINNED[id(t)] = t
        return t
    make.__wrapped__ = factory
    return make


def patch_pinned_factories() -> None:
    """`torch.empty(..., pin_memory=True)` asks the accelerator for a page-locked allocator, which
    a Python backend cannot provide: the factories make the tensor and mark it pinned.
    `with torch.device(...)` (meta-device model building, `phalanx.lazy`) recognises the factories
    it redirects by identity, from a list it builds once: it is built here, before the wrappers
    replace them, so that it holds the functions the wrappers call."""
    from torch.utils._device import _device_constructors

    _device_constructors()
    for name in ("empty", "zeros", "ones", "full", "empty_strided", "empty_like", "zeros_like", "ones_like"):
        factory = getattr(torch, name)
        if not hasattr(factory, "__wrapped__"):
            setattr(torch, name, _pinned_factory(factory))
