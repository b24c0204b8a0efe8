"""`apply_to(model)`: switch a Hugging Face Llama / Mistral / Qwen2 / Qwen3 model to these kernels.

What is patched, per module instance (no HF source is copied, no class is changed):
- every `*RMSNorm` module's forward -> `rms_norm`
- every gated `*MLP` with a SiLU activation -> `down_proj(swiglu(gate_proj(x), up_proj(x)))`
- every `*Attention` module: its calls to the modeling module's `apply_rotary_pos_emb` go to
  the in-place `apply_rope`.

RoPE is a module-level function in HF, called by name from the attention forward. apply_to
replaces that function, once per modeling module, with a switch that runs `apply_rope` only while
a patched attention module is running (a context variable set by the patched instance's forward)
and HF's own function otherwise; other models of the same family in the process are unaffected.

Each kernel dispatches as usual, so on CPU the patched model runs the torch references, which
compute what HF computes. Call it on the plain HF model, before any parallel wrapping.
"""
from __future__ import annotations

import contextvars
import functools
import logging
import sys
import types
import weakref

import torch

from .rmsnorm import rms_norm
from .rope import apply_rope
from .glu import swiglu

log = logging.getLogger("phalanx_kernels")

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
_SILU = ("silu", "swish")
_rope_on = contextvars.ContextVar("phalanx_kernels_rope_on", default=False)
# model apply_to patched -> how many modules of each kind it patched (weak keys: goes with the model)
_PATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SWITCHES: weakref.WeakSet = weakref.WeakSet()  # the RoPE switches `_rope_switch` made


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _swiglu_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _rope_switch(original):
    """The replacement for a modeling module's apply_rotary_pos_emb (see module doc)."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if not _rope_on.get():
            return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        if unsqueeze_dim == 1:  # q, k [B, H, T, D]
            return apply_rope(q, k, cos, sin)
        q, k = apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [B, T, H, D] layout
        return q.transpose(1, 2), k.transpose(1, 2)

    _SWITCHES.add(apply_rotary_pos_emb)
    return apply_rotary_pos_emb


def _attention_forward(self, *args, **kwargs):
    """A patched attention instance's forward: its class's forward, with RoPE switched on.

    Bound with MethodType rather than closing over the old bound method, so deepcopy and
    pickling rebind it to the copy."""
    token = _rope_on.set(True)
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _rope_on.reset(token)


def _family_module(module: torch.nn.Module, family: str):
    """The HF modeling module that defines this module's class, if it belongs to `family`."""
    name = type(module).__module__
    return sys.modules.get(name) if name.startswith(f"transformers.models.{family}.") else None


def apply_to(model: torch.nn.Module) -> torch.nn.Module:
    """Patch RMSNorm, the SwiGLU MLP and RoPE of a HF Llama/Mistral/Qwen2/Qwen3 model in place."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in SUPPORTED:
        raise ValueError(f"phalanx_kernels.apply_to supports model_type in {SUPPORTED}; got {family!r}")
    if _PATCHED.get(model):
        return model
    counts = {"rms_norm": 0, "swiglu": 0, "rope": 0}
    for module in model.modules():
        modeling = _family_module(module, family)
        if modeling is None:
            continue
        cls = type(module).__name__
        if cls.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_rms_norm_forward, module)
            counts["rms_norm"] += 1
        elif (cls.endswith("MLP") and all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj"))
              and getattr(module.config, "hidden_act", None) in _SILU):
            module.forward = types.MethodType(_swiglu_mlp_forward, module)
            counts["swiglu"] += 1
        elif cls.endswith("Attention") and callable(getattr(modeling, "apply_rotary_pos_emb", None)):
            if modeling.apply_rotary_pos_emb not in _SWITCHES:
                modeling.apply_rotary_pos_emb = _rope_switch(modeling.apply_rotary_pos_emb)
            module.forward = types.MethodType(_attention_forward, module)
            counts["rope"] += 1
    _PATCHED[model] = counts
    log.info("phalanx_kernels.apply_to(%s): %d RMSNorm, %d SwiGLU MLP, %d attention (RoPE) patched",
             family, counts["rms_norm"], counts["swiglu"], counts["rope"])
    return model


def patched_counts(model: torch.nn.Module) -> dict[str, int] | None:
    """{"rms_norm", "swiglu", "rope": modules patched} for a model `apply_to` patched, else None.
    (A copy of a patched model runs the kernels too, but is not listed here.)"""
    return _PATCHED.get(model)
