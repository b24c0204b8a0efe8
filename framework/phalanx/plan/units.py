"""Parsing and printing sizes ("80GiB", "512MB"), rates ("200GB/s") and FLOP rates ("989TFLOPS")."""
from __future__ import annotations

import re

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str | int | float, what: str = "size") -> int:
    """'80GiB' -> 85899345920; '512MB' -> 512e6; an int is bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    m = _NUMBER.match(text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _SIZE_UNITS:
        raise ValueError(f"{what}={text!r} is not a size: write e.g. 80GiB, 512MiB, 40GB or a number of bytes")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def parse_rate(text: str | float, what: str = "bandwidth") -> float:
    """'200GB/s' or '200GB' -> bytes per second."""
    if isinstance(text, (int, float)):
        return float(text)
    return float(parse_bytes(text.replace("/s", "").replace("ps", ""), what))


def parse_flops(text: str | float, what: str = "peak") -> float:
    """'989TFLOPS', '989T', '0.1' (a bare number is TFLOP/s) -> FLOP/s."""
    if isinstance(text, (int, float)):
        return float(text) * 1e12
    cleaned = re.sub(r"flop(s|/s)?$", "", text.strip(), flags=re.IGNORECASE)
    m = _NUMBER.match(cleaned)
    scale = {"": 1e12, "t": 1e12, "g": 1e9, "p": 1e15}
    if not m or m.group(2).lower() not in scale:
        raise ValueError(f"{what}={text!r} is not a FLOP rate: write e.g. 989TFLOPS, 312T or 0.2 (TFLOP/s)")
    return float(m.group(1)) * scale[m.group(2).lower()]


def gib(n: float) -> str:
    """Bytes as GiB (or MiB below 1 GiB), 3 significant figures."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if abs(n) >= size or unit == "MiB":
            x = n / size
            return f"{x:.0f} {unit}" if abs(x) >= 100 else f"{x:.3g} {unit}"


def seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.3g} s"
    return f"{t * 1e3:.3g} ms"
