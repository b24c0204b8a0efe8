"""Helpers shared by the server tests (test_inference_server.py, test_openai_client.py)."""
from __future__ import annotations

import time


def direct(server, prompts, params):
    """The engine's own answer (`LLM.generate`), with the server's loop held between steps."""
    with server.loop.paused() as engine:
        return engine.generate(prompts, params)


def wait_until(condition, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        time.sleep(0.02)


def parse_metrics(text: str) -> dict:
    """Prometheus text format -> {'name{labels}': value}; every sample needs a TYPE line of its
    family (a histogram's _bucket/_sum/_count samples belong to the histogram)."""
    types, samples = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert kind in ("counter", "gauge", "histogram"), line
            types[name] = kind
        elif line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            base = key.split("{")[0]
            family = next((n for n in types if base == n or (types[n] == "histogram" and base in (
                n + "_bucket", n + "_sum", n + "_count"))), None)
            assert family is not None, f"sample without a TYPE line: {line}"
            assert key not in samples, f"duplicate sample {key}"
            samples[key] = float(value)
    return samples
