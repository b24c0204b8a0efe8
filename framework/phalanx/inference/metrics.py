"""The server's numbers for `GET /metrics`, in Prometheus' text exposition format (version 0.0.4).

A handful of counters, gauges and one histogram do not need the prometheus-client package: the
format is `# HELP`, `# TYPE`, then `name{label="value"} number` lines. Counters are updated by the
engine thread (`ServerMetrics` methods, under a lock); gauges are read from the engine loop at
scrape time.
"""
from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque

# Time to first token: from 10 ms (a warm GPU) to a minute (a long queue on a CPU).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0)
RATE_WINDOW_S = 10.0


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


def _labels(labels: dict | None) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                     for k, v in labels.items())
    return "{" + inner + "}"


class Histogram:
    """Cumulative buckets as Prometheus wants them (`le` upper bounds, then +Inf, sum, count)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative; last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += n
            out.append(f'{name}_bucket{{le="{_number(bound)}"}} {running}')
        out.append(f"{name}_sum {_number(self.sum)}")
        out.append(f"{name}_count {self.count}")
        return out


class ServerMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self.finished_by_reason: dict[str, int] = {}
        self.aborted_requests = 0
        self.failed_requests = 0
        self.rejected_by_reason: dict[str, int] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) within the rate window

    # -- updates ----------------------------------------------------------------------------------
    def generated(self, num_tokens: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.generation_tokens += num_tokens
            self._recent.append((now, num_tokens))
            self._trim(now)

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def finished(self, num_prompt_tokens: int, reason: str | None) -> None:
        with self._lock:
            self.prompt_tokens += num_prompt_tokens
            key = reason or "unknown"
            self.finished_by_reason[key] = self.finished_by_reason.get(key, 0) + 1

    def aborted(self) -> None:
        with self._lock:
            self.aborted_requests += 1

    def failed(self) -> None:
        with self._lock:
            self.failed_requests += 1

    def rejected(self, reason: str) -> None:
        with self._lock:
            self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + 1

    def _trim(self, now: float) -> None:
        while self._recent and now - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()

    def tokens_per_second(self) -> float:
        """Generated tokens per second over the last `RATE_WINDOW_S` seconds."""
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    # -- exposition -------------------------------------------------------------------------------
    def render(self, gauges: dict) -> str:
        """The text format, with the engine loop's `gauges()` of this moment."""
        lines: list[str] = []

        def metric(name, kind, help_text, samples):
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{_labels(labels)} {_number(value)}")

        metric("phalanx_queue_length", "gauge", "Requests accepted and not yet running (server inbox + engine queue).",
               [(None, gauges["pending"] + gauges["waiting"])])
        capacity = gauges["capacity"]
        if capacity is not None:
            metric("phalanx_queue_capacity", "gauge", "Requests the server holds at most (running + queued); "
                   "more are answered 429.", [(None, capacity)])
        metric("phalanx_requests_in_flight", "gauge", "Requests accepted and not finished.", [(None, gauges["in_flight"])])
        metric("phalanx_requests_running", "gauge", "Requests in the engine's running batch.", [(None, gauges["running"])])
        metric("phalanx_requests_waiting", "gauge", "Requests in the engine's waiting queue.", [(None, gauges["waiting"])])
        metric("phalanx_kv_blocks_used", "gauge", "KV-cache blocks held by requests.", [(None, gauges["kv_blocks_used"])])
        metric("phalanx_kv_blocks_total", "gauge", "KV-cache blocks in all.", [(None, gauges["kv_blocks_total"])])
        speculator = gauges.get("speculator")
        if speculator is not None:  # (the engine thread's ints: read whole under the GIL)
            metric("phalanx_spec_decode_draft_tokens_total", "counter",
                   "Tokens proposed for verification (draft model or n-gram lookup).", [(None, speculator.num_proposed)])
            metric("phalanx_spec_decode_accepted_tokens_total", "counter",
                   "Proposed tokens the target model accepted.", [(None, speculator.num_accepted)])
        rate = self.tokens_per_second()
        with self._lock:
            metric("phalanx_generation_tokens_per_second", "gauge",
                   f"Generated tokens per second over the last {RATE_WINDOW_S:g} s.", [(None, rate)])
            metric("phalanx_generation_tokens_total", "counter", "Generated tokens.", [(None, self.generation_tokens)])
            metric("phalanx_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                   [(None, self.prompt_tokens)])
            metric("phalanx_requests_finished_total", "counter", "Requests finished, by finish reason.",
                   [({"finish_reason": k}, v) for k, v in sorted(self.finished_by_reason.items())])
            metric("phalanx_requests_aborted_total", "counter", "Requests aborted (client disconnected).",
                   [(None, self.aborted_requests)])
            metric("phalanx_requests_failed_total", "counter",
                   "Requests failed by an error in an engine step (the engine went on serving).",
                   [(None, self.failed_requests)])
            metric("phalanx_requests_rejected_total", "counter", "Requests refused before running, by reason.",
                   [({"reason": k}, v) for k, v in sorted(self.rejected_by_reason.items())])
            name = "phalanx_time_to_first_token_seconds"
            lines.append(f"# HELP {name} Seconds from a request's arrival to its first generated token.")
            lines.append(f"# TYPE {name} histogram")
            lines.extend(self.ttft.lines(name))
        return "\n".join(lines) + "\n"
