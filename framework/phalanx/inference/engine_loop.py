"""Runs an `LLM` on one background thread so many HTTP clients can share its batches.

Only the loop thread touches the engine (and its tokenizer: HF fast tokenizers must not be used
from two threads at once). Request handlers hand work over through an inbox and never wait for an
engine step:

- `submit` is non-blocking. It refuses at once (`QueueFull`) when the server already holds its
  capacity of requests — `max_num_seqs` running plus `max_queue` waiting — so the backlog stays
  bounded; otherwise it returns a `RequestStream` and the loop thread tokenises, validates and
  admits the request before its next step. The stream's first item says whether it was admitted.
- `abort` is non-blocking too: the loop drops the request before its next step, which frees the
  request's KV blocks, and ends its stream.

Fault isolation: when a step fails, the engine fails only the request whose own step fails
(`LLM._step`) and reports it with `RequestOutput.error`; its stream ends with `RequestFailed`
naming the cause. Any other exception out of a step fails the requests then running (their
blocks are freed) and the loop goes on serving new ones. Only an interrupt (or, with tensor
parallelism, any step failure: the ranks' collectives cannot be resynchronised) stops the loop;
`error` is then set and /health answers 503.

A `RequestStream` bound to an asyncio event loop (pass `loop=`) is read with `async for`; without
one it is read with a plain `for` (a blocking queue), for code that is not async.
With tensor parallelism the loop also pings the worker ranks while idle, so their blocking
broadcast never reaches the collective timeout.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from phalanx.inference.openai_protocol import generated_tokens
from phalanx.inference.outputs import RequestOutput
from phalanx.inference.sampling_params import SamplingParams

log = logging.getLogger(__name__)
_KEEPALIVE_S = 20.0


class QueueFull(Exception):
    """The server holds as many requests as it may; the client should retry later."""

    def __init__(self, capacity: int) -> None:
        super().__init__(f"the server is at its capacity of {capacity} requests in flight; retry later")
        self.capacity = capacity


class Aborted(Exception):
    """The request was aborted (its client left, or the server is stopping)."""


class RequestFailed(RuntimeError):
    """The engine failed this request (an exception in a step it ran in); the message names the
    cause. The engine goes on serving the others."""


@dataclass
class _Admitted:
    num_prompt_tokens: int


class RequestStream:
    """What the engine says about one request, in order: admission (or the reason it was
    refused), then cumulative `RequestOutput`s, the last with `finished` set."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.request_id: str | None = None  # set by the engine thread on admission
        self.submitted_at = time.perf_counter()
        self.num_tokens_seen = 0  # generated tokens already counted (metrics)
        self.echo = False  # the engine echoes the prompt in front of the output (not counted)
        self.closed = False  # a final item (last output, error, abort) was put
        self._loop = loop
        self._async_queue: asyncio.Queue | None = asyncio.Queue() if loop is not None else None
        self._queue: queue.Queue | None = None if loop is not None else queue.Queue()

    # -- engine thread side -----------------------------------------------------------------------
    def put(self, item) -> None:
        if self.closed:
            return
        if isinstance(item, BaseException) or (isinstance(item, RequestOutput) and item.finished):
            self.closed = True
        if self._async_queue is not None:
            try:
                self._loop.call_soon_threadsafe(self._async_queue.put_nowait, item)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass
        else:
            self._queue.put(item)

    # -- reader side ------------------------------------------------------------------------------
    @staticmethod
    def _check(item):
        if isinstance(item, BaseException):
            raise item
        return item

    async def admitted(self) -> int:
        """Wait until the engine took the request; returns its prompt length. Raises what the
        engine raised for a refused request (ValueError/TypeError for bad input)."""
        item = self._check(await self._async_queue.get())
        assert isinstance(item, _Admitted), item
        return item.num_prompt_tokens

    async def outputs(self):
        """Cumulative outputs as they come; a slow reader skips to the newest one (each output
        holds everything before it)."""
        while True:
            item = self._check(await self._async_queue.get())
            while not self._async_queue.empty() and not (isinstance(item, RequestOutput) and item.finished):
                item = self._check(self._async_queue.get_nowait())
            if isinstance(item, _Admitted):
                continue
            yield item
            if item.finished:
                return

    async def result(self) -> RequestOutput:
        last = None
        async for last in self.outputs():
            pass
        return last

    def __iter__(self):
        """Blocking reader (a stream made without an event loop)."""
        while True:
            item = self._check(self._queue.get())
            if isinstance(item, _Admitted):
                continue
            yield item
            if item.finished:
                return

    def result_blocking(self) -> RequestOutput:
        last = None
        for last in self:
            pass
        return last


@dataclass
class _Submission:
    stream: RequestStream
    prompt: object  # str | list[int] | a callable returning token ids (e.g. a chat template)
    params: SamplingParams
    prepare: Callable | None  # (token ids, params) -> params, may raise; runs on the engine thread


class EngineLoop:
    """`max_queue`: requests that may wait beyond the `max_num_seqs` the engine runs at once
    (None: no bound)."""

    def __init__(self, engine, *, max_queue: int | None = None, metrics=None) -> None:
        self.engine = engine
        self.capacity = None if max_queue is None else engine.config.max_num_seqs + max_queue
        self.metrics = metrics  # a phalanx.inference.metrics.ServerMetrics, or None
        self._cv = threading.Condition()
        self._inbox: list[_Submission] = []
        self._aborts: deque[RequestStream] = deque()
        self._streams: dict[str, RequestStream] = {}
        self._in_flight = 0  # submitted and not yet finished, refused or aborted
        self._engine_lock = threading.Lock()  # held by the loop thread while it uses the engine
        self._stop = False
        self._pauses = 0  # paused() blocks in progress
        self._thread = threading.Thread(target=self._run, name="phalanx-engine", daemon=True)
        self.error: BaseException | None = None

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished, refused or aborted."""
        return self._in_flight

    @property
    def num_pending_aborts(self) -> int:
        """Aborts asked for and not yet carried out (the loop does them before its next step)."""
        return len(self._aborts)

    def gauges(self) -> dict:
        """The engine's load right now, for /metrics (len() reads; no lock needed)."""
        engine = self.engine
        return {"pending": len(self._inbox), "running": len(engine.scheduler.running),
                "waiting": len(engine.scheduler.waiting),
                "kv_blocks_used": engine.num_blocks - engine.block_manager.num_free_blocks,
                "kv_blocks_total": engine.num_blocks, "in_flight": self._in_flight, "capacity": self.capacity,
                "speculator": engine.speculator}

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    # -- request side (any thread) ----------------------------------------------------------------
    def submit(self, prompt, params: SamplingParams, *, prepare: Callable | None = None,
               loop: asyncio.AbstractEventLoop | None = None) -> RequestStream:
        """Queue a request without waiting; raises `QueueFull` when the server is at capacity and
        RuntimeError when the engine has failed."""
        return self.submit_many([(prompt, params, prepare)], loop=loop)[0]

    def submit_many(self, requests: list[tuple], *, loop=None) -> list[RequestStream]:
        """Queue several requests (prompt, params, prepare) all or none: one HTTP request with
        several prompts or n > 1 is refused whole when it does not fit."""
        with self._cv:
            if self.error is not None:
                raise RuntimeError(f"the engine stopped after an error: {self.error}")
            if self._stop:
                raise RuntimeError("the server is stopping")
            if self.capacity is not None and self._in_flight + len(requests) > self.capacity:
                raise QueueFull(self.capacity)
            streams = []
            for prompt, params, prepare in requests:
                stream = RequestStream(loop)
                self._inbox.append(_Submission(stream, prompt, params, prepare))
                streams.append(stream)
            self._in_flight += len(requests)
            self._cv.notify()
        return streams

    def abort(self, stream: RequestStream) -> None:
        """Drop a request (its client went away); does nothing once it finished."""
        if stream.closed:
            return
        with self._cv:
            self._aborts.append(stream)
            self._cv.notify()

    @contextlib.contextmanager
    def paused(self):
        """Hold the engine between steps (e.g. to load new weights); requests queue meanwhile and
        run once the block exits. Yields the engine. Calling `engine.generate` inside is only
        right while no request is in flight (it would step theirs too, and drop their outputs)."""
        with self._cv:
            self._pauses += 1
        try:
            with self._engine_lock:  # the step in progress, if any, ends first
                yield self.engine
        finally:
            with self._cv:
                self._pauses -= 1
                self._cv.notify()

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    # -- loop thread ------------------------------------------------------------------------------
    def _finish(self, stream: RequestStream, item) -> None:
        """Put a stream's final item and stop counting it."""
        if stream.closed:
            return
        stream.put(item)
        if stream.request_id is not None:
            self._streams.pop(stream.request_id, None)
        with self._cv:
            self._in_flight -= 1

    def _admit(self, sub: _Submission) -> None:
        stream = sub.stream
        if stream.closed:  # aborted before it was admitted
            return
        try:
            ids = sub.prompt() if callable(sub.prompt) else self.engine.tokenize(sub.prompt)
            params = sub.prepare(ids, sub.params) if sub.prepare is not None else sub.params
            echo = bool(getattr(params, "echo", False))
            # an echoed string prompt is given as written (its text comes back verbatim)
            request_id = self.engine.add_request(sub.prompt if echo and isinstance(sub.prompt, str) else ids, params)
        except Exception as exc:  # noqa: BLE001 - the request's own fault; tell its client
            self._finish(stream, exc)
            return
        stream.request_id = request_id
        stream.echo = echo
        self._streams[request_id] = stream
        stream.put(_Admitted(len(ids)))

    def _abort(self, stream: RequestStream) -> None:
        if stream.request_id is not None:
            self.engine.abort(stream.request_id)
        if not stream.closed:
            if self.metrics is not None:
                self.metrics.aborted()
            self._finish(stream, Aborted("the request was aborted"))

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        total = generated_tokens(out, stream.echo)
        new = total - stream.num_tokens_seen
        if self.metrics is not None:
            if new > 0 and stream.num_tokens_seen == 0:
                self.metrics.first_token(time.perf_counter() - stream.submitted_at)
            if new > 0:
                self.metrics.generated(new)
            if out.finished and out.error is None:
                self.metrics.finished(len(out.prompt_token_ids), out.finish_reason)
        stream.num_tokens_seen = total
        if out.error is not None:
            if self.metrics is not None:
                self.metrics.failed()
            self._finish(stream, RequestFailed(f"the engine failed this request: {out.error}"))
        elif out.finished:
            self._finish(stream, out)
        else:
            stream.put(out)

    def _run(self) -> None:
        last_ping = time.monotonic()
        tp = self.engine.tp.size > 1
        while True:
            with self._cv:
                while not self._stop and (self._pauses or (not self._inbox and not self._aborts
                                                          and not self.engine.has_unfinished_requests())):
                    self._cv.wait(timeout=_KEEPALIVE_S / 2)
                    if (tp and not self._pauses and time.monotonic() - last_ping > _KEEPALIVE_S
                            and self._engine_lock.acquire(blocking=False)):  # never wait on it holding _cv
                        try:
                            self.engine.runner.keepalive()
                        finally:
                            self._engine_lock.release()
                        last_ping = time.monotonic()
                stop = self._stop
                inbox, self._inbox = self._inbox, []
                aborts = list(self._aborts)
                self._aborts.clear()
            with self._engine_lock:
                if stop:
                    self._close_all(Aborted("the server is stopping"), [sub.stream for sub in inbox])
                    if tp:
                        self.engine.runner.stop_workers()
                    return
                for stream in aborts:
                    self._abort(stream)
                for sub in inbox:
                    self._admit(sub)
                if not self.engine.has_unfinished_requests():
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # noqa: BLE001 - the running requests fail; the loop goes on
                    if tp:
                        self._stop_after(exc)
                        return
                    self._fail_running(exc)
                    continue
                except BaseException as exc:  # an interrupt: every waiting client must hear of it
                    self._stop_after(exc)
                    return
                last_ping = time.monotonic()
                for out in outputs:
                    self._deliver(out)

    def _stop_after(self, exc: BaseException) -> None:
        log.error("the engine step failed; the engine loop stops", exc_info=exc)
        self.error = exc
        self._close_all(RuntimeError(f"the engine failed: {exc}"), [])

    def _fail_running(self, exc: Exception) -> None:
        """A step raised outside the engine's own isolation: fail every admitted request (its
        blocks freed) with the cause, and go on."""
        log.error("an engine step failed; failing the %d requests in flight", len(self._streams), exc_info=exc)
        failure = RequestFailed(f"the engine step failed: {type(exc).__name__}: {exc}")
        for stream in list(self._streams.values()):
            try:
                self.engine.abort(stream.request_id)
            except Exception:  # noqa: BLE001 - keep failing the others
                log.exception("abort failed")
            if self.metrics is not None:
                self.metrics.failed()
            self._finish(stream, failure)

    def _close_all(self, exc: BaseException, taken: list[RequestStream]) -> None:
        """End every request: admitted ones, those in the inbox and `taken` ones (out of the inbox,
        not yet admitted)."""
        with self._cv:
            pending, self._inbox = self._inbox, []
        for stream in [*self._streams.values(), *(s.stream for s in pending), *taken]:
            if stream.request_id is not None:
                try:
                    self.engine.abort(stream.request_id)
                except Exception:  # noqa: BLE001 - after an engine failure its state may be broken
                    log.exception("abort failed")
            self._finish(stream, exc)
