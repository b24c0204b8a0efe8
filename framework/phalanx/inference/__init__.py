"""Inference: a paged KV cache, a continuous-batching scheduler, samplers, tensor-parallel and
speculative decoding for Llama-family models, and an OpenAI-compatible HTTP server.

    from phalanx.inference import LLM, SamplingParams
    engine = LLM("path/to/hf_model", max_num_seqs=64, block_size=16, tp_size=1)
    outs = engine.generate(["Hello"], SamplingParams(max_new_tokens=32, temperature=0.7, top_p=0.9))

Imports are lazy: `import phalanx.inference` loads nothing heavy until a name is used.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "phalanx.inference.engine",
    "SamplingParams": "phalanx.inference.sampling_params",
    "StructuredOutput": "phalanx.inference.sampling_params",
    "RequestOutput": "phalanx.inference.outputs",
    "EngineConfig": "phalanx.inference.config",
    "OpenAIServer": "phalanx.inference.server",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'phalanx.inference' has no attribute {name!r}")
