"""Runs an `LLM` on a background thread so many HTTP clients can share its batches.

Request threads call `submit`, which tokenises and validates under the engine lock (so a bad
request fails at once, in the caller's thread) and returns a `RequestStream`. The loop thread
steps the engine whenever it has work, and pushes each request's cumulative output onto its
stream; it sleeps on a condition when idle. With tensor parallelism it also pings the worker
ranks while idle, so their blocking broadcast never reaches the collective timeout.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

from phalanx.inference.outputs import RequestOutput
from phalanx.inference.sampling_params import SamplingParams

log = logging.getLogger(__name__)
_KEEPALIVE_S = 20.0


class RequestStream:
    """Cumulative outputs of one request, in order; the last has `finished` set."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: queue.Queue = queue.Queue()

    def put(self, item) -> None:
        self._queue.put(item)

    def __iter__(self):
        while True:
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise RuntimeError(f"the engine failed: {item}") from item
            yield item
            if item.finished:
                return

    def result(self) -> RequestOutput:
        last = None
        for last in self:
            pass
        return last


class EngineLoop:
    def __init__(self, engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._streams: dict[str, RequestStream] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="phalanx-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def tokenize(self, prompt) -> list[int]:
        return self.call(self.engine.tokenize, prompt)

    def call(self, fn, *args):
        """Run fn under the engine lock: HF fast tokenizers may not be used from two threads at
        once (they reconfigure the Rust tokenizer per call: 'Already borrowed')."""
        with self._lock:
            return fn(*args)

    def submit(self, prompt, params: SamplingParams) -> RequestStream:
        """Queue a request; raises ValueError/TypeError for a request the engine refuses."""
        with self._wake:
            if self.error is not None:
                raise RuntimeError(f"the engine stopped after an error: {self.error}")
            request_id = self.engine.add_request(prompt, params)
            stream = RequestStream(request_id)
            self._streams[request_id] = stream
            self._wake.notify()
        return stream

    def abort(self, request_id: str) -> None:
        with self._wake:
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)

    def shutdown(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        last_ping = time.monotonic()
        while True:
            with self._wake:
                while not self._stop and not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=_KEEPALIVE_S / 2)
                    if self.engine.tp.size > 1 and time.monotonic() - last_ping > _KEEPALIVE_S:
                        self.engine.runner.keepalive()
                        last_ping = time.monotonic()
                if self._stop:
                    if self.engine.tp.size > 1:
                        self.engine.runner.stop_workers()
                    return
                try:
                    outputs = self.engine.step()
                except BaseException as exc:  # noqa: BLE001 - every waiting client must hear of it
                    log.exception("engine step failed")
                    self.error = exc
                    for stream in self._streams.values():
                        stream.put(exc)
                    self._streams.clear()
                    return
                last_ping = time.monotonic()
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        stream.put(out)
                        if out.finished:
                            del self._streams[out.request_id]
