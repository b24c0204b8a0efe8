"""The three precisions every plugin supports."""
from __future__ import annotations

import torch

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not supported; use one of {', '.join(PRECISIONS)}")
    return precision


def dtype_of(precision: str) -> torch.dtype:
    return PRECISIONS[check_precision(precision)]
