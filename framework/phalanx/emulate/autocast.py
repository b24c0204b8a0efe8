"""`torch.autocast("emucuda", dtype=...)` behaving as CUDA's autocast.

torch registers autocast kernels for the real CUDA key only; for the emulated GPU (PrivateUse1)
we register, like CUDA's autocast, three lists above autograd (so the casts are part of the graph):
matmuls and convolutions run in the autocast dtype, numerically sensitive ops (norms, softmax,
exp/log, losses) in fp32, and concatenations at the widest input dtype. Every other op passes
through. The lists are CUDA's (aten/src/ATen/autocast_mode.cpp), trimmed to the ops models use.
"""
from __future__ import annotations

import torch

_KEY = torch._C.DispatchKey.AutocastPrivateUse1
_EXCLUDE = torch._C.DispatchKeySet(_KEY)

LOWER_PRECISION = [
    "mm", "bmm", "addmm", "addbmm", "baddbmm", "matmul", "linear", "mv", "addmv", "addr", "einsum",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input",
    "convolution", "_convolution", "prelu", "scaled_dot_product_attention", "chain_matmul", "linalg_multi_dot",
]
FP32 = [
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "rms_norm",
]
# Run in fp32 unless the caller passed an explicit dtype.
FP32_UNLESS_DTYPE = ["softmax.int", "log_softmax.int", "cumsum", "cumprod", "prod", "sum", "linalg_vector_norm"]
PROMOTE = ["cat", "stack", "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "index_put", "scatter_add",
           "tensordot"]

_LIBRARIES: list[torch.library.Library] = []


def _cast(x, dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64 and x.dtype != dtype:
        return x.to(dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(t, dtype) for t in x)
    return x


def _lower_precision(op):
    def kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype("emucuda")
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return op(*_cast(args, dtype), **{k: _cast(v, dtype) for k, v in kwargs.items()})
    return kernel


def _fp32(op):
    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return op(*_cast(args, torch.float32), **{k: _cast(v, torch.float32) for k, v in kwargs.items()})
    return kernel


def _fp32_unless_dtype(op):
    names = [a.name for a in op._schema.arguments]
    position = names.index("dtype") if "dtype" in names else None

    def kernel(*args, **kwargs):
        explicit = kwargs.get("dtype") is not None or (position is not None and len(args) > position
                                                        and args[position] is not None)
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            if explicit:
                return op(*args, **kwargs)
            return op(*_cast(args, torch.float32), **kwargs)
    return kernel


def _promote(op):
    def kernel(*args, **kwargs):
        tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
                   if isinstance(t, torch.Tensor) and t.is_floating_point()]
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            if tensors:
                widest = tensors[0].dtype
                for t in tensors[1:]:
                    widest = torch.promote_types(widest, t.dtype)
                args = _cast(args, widest)
            return op(*args, **kwargs)
    return kernel


def _overloads(name: str):
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        return []
    names = [overload] if overload else [o for o in packet.overloads() if o != "out" and not o.endswith("_out")]
    return [(f"{base}.{o}" if o != "default" else base, getattr(packet, o)) for o in names if hasattr(packet, o)]


def register() -> None:
    if _LIBRARIES:
        return
    lib = torch.library.Library("aten", "IMPL")
    for names, make in ((LOWER_PRECISION, _lower_precision), (FP32, _fp32),
                        (FP32_UNLESS_DTYPE, _fp32_unless_dtype), (PROMOTE, _promote)):
        for name in names:
            for qualified, op in _overloads(name):
                if op._schema.is_mutable:
                    continue
                try:
                    lib.impl(qualified, make(op), "AutocastPrivateUse1")
                except RuntimeError:
                    pass  # an overload that has no autocast-relevant kernel (already registered, ...)
    everything = torch.library.Library("_", "IMPL")
    everything.fallback(torch.library.fallthrough_kernel, dispatch_key="AutocastPrivateUse1")
    _LIBRARIES.extend([lib, everything])
