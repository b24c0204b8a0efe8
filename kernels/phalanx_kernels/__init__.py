"""Phalanx kernels: Triton kernels for training and inference, each with a torch reference.

Every kernel `<name>` dispatches to `<name>_triton` on CUDA tensors when Triton is installed and
to `<name>_reference` everywhere else; `set_backend` / `use_backend` override that (tests run the
Triton kernels on CPU under TRITON_INTERPRET=1). Importing this package imports neither triton
nor transformers and changes no environment variable.
"""
from .cross_entropy import fused_linear_cross_entropy
from .dispatch import get_backend, set_backend, use_backend
from .attention import flash_attention
from .hf import apply_to
from .layernorm import layer_norm
from .paged_attention import paged_decode_attention
from .rmsnorm import rms_norm
from .rope import apply_rope, rope_and_cache_write
from .softmax import masked_softmax
from .glu import swiglu

__all__ = [
    "apply_rope", "apply_to", "flash_attention", "fused_linear_cross_entropy", "get_backend",
    "layer_norm", "masked_softmax", "paged_decode_attention", "rms_norm", "rope_and_cache_write",
    "set_backend", "swiglu", "use_backend",
]
