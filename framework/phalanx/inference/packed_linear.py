"""Linear layers whose weights are packed once for the CPU's matmul library.

On CPU, `F.linear` hands oneDNN/MKL a plain [out, in] weight, and for bf16 oneDNN reorders it
into its blocked (AMX/AVX-512) layout on every call. For the small row counts of decoding (one row
per running sequence) that reorder costs as much as the product itself. Packing each weight once
after it is loaded (`torch.ops.mkldnn._reorder_linear_weight`, the op inductor's freezing pass
uses) and calling `torch.ops.mkldnn._linear_pointwise` on the packed form gives bit-identical
results, measured 1.8x faster at 32 rows on a [3072, 576] weight, and the same speed on prefill
sizes.

Only bf16 weights on a CPU with native bf16 are packed: for fp32, the packed oneDNN path rounds differently from
MKL's `F.linear` (what Hugging Face runs), and MKL's own packed op only helps at the exact row
count it was packed for. Everything else (CUDA, fp32, builds without oneDNN) runs `F.linear`.
A packed weight is a copy: whoever changes the weights in place must pack again
(`LlamaModel.pack_weights`, which the engine calls after every load).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from phalanx_kernels.capability import native_bf16

_BATCH_HINT = 32  # the row count oneDNN tunes the packed layout for; any count runs correctly


def can_pack(weight: torch.Tensor) -> bool:
    """A 2-D bf16 CPU weight on a CPU with native bf16: oneDNN's bf16 reorder refuses CPUs without
    AVX512-BW/VL/DQ or AVX-NE-CONVERT, and where bf16 is emulated packing would not pay anyway."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and native_bf16("cpu"))


def pack(weight: torch.Tensor):
    """The packed form of `weight` [out, in], or None when it cannot be packed."""
    if not can_pack(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _BATCH_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, packed=None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a 2-D x, through `packed` when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [None], "")
