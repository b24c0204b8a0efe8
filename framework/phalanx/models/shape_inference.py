"""Whether the current forward is a pipeline's shape inference rather than a training step's.

torch.distributed.pipelining runs every stage once at a schedule's first step to learn activation
shapes (past the first stage on uninitialised tensors). Model code that keeps state across
forwards (phalanx.models.deepseek.BiasBalancer counts routed tokens) must not count that pass. The
flag lives here, below the pipeline, so models read it and `phalanx.pipeline.PipelineRunner` sets it.
"""
from __future__ import annotations

import contextvars
import functools

_SHAPE_INFERENCE = contextvars.ContextVar("phalanx_pipeline_shape_inference", default=False)


def in_shape_inference() -> bool:
    """Whether the current forward is a pipeline schedule's shape (metadata) inference."""
    return _SHAPE_INFERENCE.get()


def marked_shape_inference(fn):
    """`fn` with the flag set while it runs (the pipeline wraps torch's shape-inference methods)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        token = _SHAPE_INFERENCE.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _SHAPE_INFERENCE.reset(token)
    return run
