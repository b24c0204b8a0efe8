"""An OpenAI-compatible HTTP server over an `LLM`, on FastAPI + uvicorn.

    GET  /health                  200 {"status": "ok"}; 503 once the engine failed (no API key needed)
    GET  /metrics                 Prometheus text format (no API key needed)
    GET  /v1/models               the served model
    POST /v1/completions          prompt(s) -> text; "stream": true for server-sent events
    POST /v1/chat/completions     messages -> the model's chat template -> text; streaming too

All requests meet in the same engine batches: one engine thread (`EngineLoop`) steps the engine,
the handlers run on uvicorn's event loop and never wait for a step. Request validation and
response shapes live in `openai_protocol`; this module is the HTTP plumbing and the limits:

- bounded: the server holds at most `max_num_seqs + max_queue` requests; beyond that a request is
  answered 429 with `Retry-After` instead of joining an ever longer queue;
- a client that disconnects (mid-stream or while waiting) has its requests aborted, which frees
  their KV blocks;
- prompts over `max_prompt_tokens`, `max_tokens` over its limit, malformed JSON and bodies over
  `max_body_bytes` are answered 4xx with an OpenAI-style error body before the engine sees them;
- with an API key every /v1 route needs `Authorization: Bearer KEY`; it binds 127.0.0.1 unless
  told otherwise.
"""
# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations (Request)
# at run time, and they are imported inside build_app, out of reach of string annotations.
import asyncio
import dataclasses
import hmac
import json
import logging
import socket
import threading
import time

from phalanx.inference import openai_protocol as api
from phalanx.inference.engine_loop import Aborted, EngineLoop, QueueFull, RequestStream
from phalanx.inference.metrics import ServerMetrics

log = logging.getLogger(__name__)


class _ClientGone(Exception):
    """The client disconnected while its request was running."""


# -- helpers ---------------------------------------------------------------------------------------
def _error_response(err: api.RequestError):
    from fastapi.responses import JSONResponse
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _engine_error(exc: BaseException, param: str) -> api.RequestError:
    """What a request refused by the engine thread (tokenizer, limits, add_request) answers."""
    if isinstance(exc, api.RequestError):
        return exc
    if isinstance(exc, (ValueError, TypeError)):
        return api.RequestError(400, str(exc), param=param)
    if isinstance(exc, Aborted):
        return api.RequestError(503, str(exc), kind="server_error")
    return api.RequestError(500, f"internal error: {exc}", kind="server_error")


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _run_watching(request, work, on_gone):
    """Await `work`; if the client disconnects first, call `on_gone` and raise _ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server is stopping
            on_gone()
            task.cancel()
            raise
        if not task.done():
            on_gone()
            task.cancel()
            raise _ClientGone
        return task.result()
    finally:
        watcher.cancel()


class _TextDeltas:
    """Per choice: the text not yet sent, holding back what may be the start of a stop string
    or an unfinished UTF-8 character until it is decided."""

    def __init__(self, stops: list[str]) -> None:
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.sent_text = 0
        self.sent_tokens = 0

    def next(self, out) -> str:
        text = out.text
        if out.finished:
            end = len(text)
        else:
            end = len(text) - self.holdback
            while end > self.sent_text and text[end - 1] == "\ufffd":
                end -= 1
        delta = text[self.sent_text:max(end, self.sent_text)]
        self.sent_text = max(end, self.sent_text)
        return delta


def _sse(payload) -> bytes:
    return b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"


def _event_stream_response(events, on_gone):
    """Server-sent events from the async iterator `events`; a disconnect calls `on_gone` (which
    aborts the requests, so `events` ends)."""
    from starlette.responses import StreamingResponse

    class EventStream(StreamingResponse):
        async def __call__(self, scope, receive, send) -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            watcher = asyncio.ensure_future(_until_disconnect(receive))
            watcher.add_done_callback(lambda t: t.cancelled() or on_gone())
            try:
                async for data in self.body_iterator:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # the connection broke while sending
                on_gone()
            finally:
                watcher.cancel()

    return EventStream(events, media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# -- the application -------------------------------------------------------------------------------
def build_app(server: "OpenAIServer"):
    """The FastAPI app: routes over `server` (its engine loop, limits and metrics)."""
    from fastapi import Depends, FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response
    from starlette.exceptions import HTTPException

    app = FastAPI(title="phalanx", docs_url=None, redoc_url=None, openapi_url=None)
    engine = server.engine

    @app.exception_handler(api.RequestError)
    async def request_error(request, err: api.RequestError):
        return _error_response(err)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        if exc.status_code == 404:
            err = api.RequestError(404, f"no route {request.method} {request.url.path}", code="not_found")
        elif exc.status_code == 405:
            err = api.RequestError(405, f"method {request.method} not allowed on {request.url.path}")
        else:
            err = api.RequestError(exc.status_code, str(exc.detail))
        return _error_response(err)

    def authorized(request: Request) -> None:
        if server.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not (given.startswith("Bearer ")
                and hmac.compare_digest(given[7:].strip().encode(), server.api_key.encode())):
            raise api.RequestError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                   kind="authentication_error", code="invalid_api_key")

    async def read_json(request: Request) -> dict:
        limit = server.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise api.RequestError(413, f"the request body is larger than {limit} bytes")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise api.RequestError(413, f"the request body is larger than {limit} bytes")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise api.RequestError(400, f"the request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise api.RequestError(400, "the request body must be a JSON object")
        return body

    @app.get("/health")
    async def health():
        error = server.loop.error
        if error is None:
            return {"status": "ok"}
        return JSONResponse({"status": f"engine failed: {error}"}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        text = server.metrics.render(server.loop.gauges())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return api.models_response(server.model_name, engine.max_model_len)

    def submit(jobs: list[tuple]) -> list[RequestStream]:
        try:
            return server.loop.submit_many(jobs, loop=asyncio.get_running_loop())
        except QueueFull as exc:
            server.metrics.rejected("queue_full")
            raise api.RequestError(429, str(exc), kind="rate_limit_error", code="queue_full",
                                   headers={"Retry-After": str(server.retry_after_s)}) from None
        except RuntimeError as exc:
            raise api.RequestError(503, str(exc), kind="server_error") from None

    def abort_all(streams) -> None:
        for s in streams:
            server.loop.abort(s)

    async def admit(request: Request, streams, param: str) -> list[int]:
        """Wait until the engine admitted every stream; their prompt lengths. A refusal of any
        aborts the others and answers with its reason."""
        try:
            return await _run_watching(request, asyncio.gather(*(s.admitted() for s in streams)),
                                       lambda: abort_all(streams))
        except _ClientGone:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to the status the client sees
            abort_all(streams)
            raise _engine_error(exc, param) from None

    def limits(param: str, fit_max_tokens: bool = False):
        """Checks on the engine thread once the prompt is tokenised (prompt and context limits)."""
        def prepare(ids, params):
            api.check_prompt_length(len(ids), server.max_prompt_tokens, param)
            if fit_max_tokens:  # no max_tokens asked: whatever the context leaves, up to the limit
                most = max(1, min(params.max_new_tokens, engine.max_model_len - len(ids)))
                params = dataclasses.replace(params, max_new_tokens=most,
                                             min_new_tokens=min(params.min_new_tokens, most))
            api.check_length(len(ids), params.max_new_tokens, engine.max_model_len, param)
            return params
        return prepare

    async def respond(request, req, streams, prompt_lens, make_body):
        """Non-streaming: wait for every prompt's request, then one JSON body."""
        try:
            outs = await _run_watching(request, asyncio.gather(*(s.result() for s in streams)),
                                       lambda: abort_all(streams))
        except _ClientGone:
            return Response(status_code=499)
        except Aborted as exc:
            raise api.RequestError(503, str(exc), kind="server_error") from None
        except RuntimeError as exc:
            raise api.RequestError(500, str(exc), kind="server_error") from None
        usage = api.usage(sum(prompt_lens), sum(api.generated_tokens(o, req.echo) for o in outs))
        return JSONResponse(make_body(outs, usage))

    def stream_events(req, streams, make_chunk, rid):
        """Streaming: chunks of every choice as they come (choices of several prompts and n > 1
        interleave; prompt p's choice k has index p * n + k), then the usage chunk (when asked)
        and [DONE]."""
        async def events():
            merged: asyncio.Queue = asyncio.Queue()

            async def pump(p, stream):
                try:
                    async for out in stream.outputs():
                        await merged.put((p, out))
                except Exception as exc:  # noqa: BLE001 - handed to the reader below
                    await merged.put((p, exc))

            tasks = [asyncio.ensure_future(pump(p, s)) for p, s in enumerate(streams)]
            deltas: dict[int, _TextDeltas] = {}
            done: set[int] = set()
            remaining, generated, prompt_tokens = len(streams), 0, 0
            try:
                while remaining:
                    p, item = await merged.get()
                    if isinstance(item, Aborted):
                        return  # the client left, or the server is stopping
                    if isinstance(item, BaseException):
                        yield _sse(_engine_error(item, "prompt").body())
                        return
                    for c in api.completions_of(item):
                        index = p * req.n + getattr(c, "index", 0)
                        if index in done:
                            continue
                        d = deltas.setdefault(index, _TextDeltas(req.params.stop))
                        text = d.next(c)
                        logprobs = None
                        if c.logprobs is not None and len(c.token_ids) > d.sent_tokens:
                            logprobs = (api.chat_logprobs(c, engine.tokenizer, d.sent_tokens) if req.chat
                                        else api.completion_logprobs(c, engine.tokenizer, d.sent_tokens,
                                                                     d.sent_text - len(text)))
                            d.sent_tokens = len(c.token_ids)
                        if text or c.finished or logprobs:
                            yield _sse(make_chunk(index, text, c.finish_reason if c.finished else None, logprobs))
                        if c.finished:
                            done.add(index)
                    if item.finished:
                        remaining -= 1
                        generated += api.generated_tokens(item, req.echo)
                        prompt_tokens += len(item.prompt_token_ids)
                if req.include_usage:
                    yield _sse(api.usage_chunk(rid, server.model_name, req.chat, api.usage(prompt_tokens, generated)))
                yield _sse(b"[DONE]")
            finally:
                for t in tasks:
                    t.cancel()
                abort_all(streams)  # no-op for finished ones

        return _event_stream_response(events(), lambda: abort_all(streams))

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(request: Request):
        body = await read_json(request)
        api.check_model(body, server.model_name)
        req = api.parse_completion(body, max_tokens_limit=server.max_tokens_limit)
        prepare = limits("prompt")
        streams = submit([(prompt, req.params, prepare) for prompt in req.prompts])
        try:
            prompt_lens = await admit(request, streams, "prompt")
        except _ClientGone:
            return Response(status_code=499)
        rid = api.new_id(chat=False)
        tok = engine.tokenizer
        if req.stream:
            return stream_events(req, streams, lambda i, text, finish, lp: api.completion_chunk(
                rid, server.model_name, i, text, finish, lp), rid)

        def make(outs, usage):
            choices = [api.completion_choice(p * req.n + getattr(c, "index", 0), c, tok)
                       for p, out in enumerate(outs) for c in api.completions_of(out)]
            return api.completion_response(rid, server.model_name, choices, usage)
        return await respond(request, req, streams, prompt_lens, make)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(request: Request):
        body = await read_json(request)
        api.check_model(body, server.model_name)
        req = api.parse_chat(body, max_tokens_limit=server.max_tokens_limit,
                             default_max_tokens=server.max_tokens_limit)
        tok = engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise api.RequestError(400, "this model has no chat template; use /v1/completions", param="messages")
        messages = req.prompts[0]

        def encode():  # on the engine thread, like every tokenizer call
            try:
                text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                return tok(text, add_special_tokens=False)["input_ids"]
            except Exception as exc:  # noqa: BLE001 - a template that rejects these messages
                raise api.RequestError(400, f"the chat template failed on these messages: {exc}",
                                       param="messages") from None

        fit = body.get("max_completion_tokens") is None and body.get("max_tokens") is None
        streams = submit([(encode, req.params, limits("messages", fit_max_tokens=fit))])
        try:
            prompt_lens = await admit(request, streams, "messages")
        except _ClientGone:
            return Response(status_code=499)
        rid = api.new_id(chat=True)
        if req.stream:
            started: set[int] = set()

            def chunk(i, text, finish, lp):
                if i not in started:
                    started.add(i)
                    delta = {"role": "assistant", "content": text}
                else:
                    delta = {"content": text} if text or not finish else {}
                return api.chat_chunk(rid, server.model_name, i, delta, finish, lp)
            return stream_events(req, streams, chunk, rid)

        def make(outs, usage):
            return api.chat_response(rid, server.model_name, outs[0], tok, usage)
        return await respond(request, req, streams, prompt_lens, make)

    return app


# -- the server ------------------------------------------------------------------------------------
class OpenAIServer:
    """Serve `engine` over HTTP. `port=0` picks a free port (see `.port` / `.url`).

    max_queue: requests that may wait beyond the engine's `max_num_seqs` running ones; more are
    answered 429 with `Retry-After: retry_after_s`. max_prompt_tokens: the longest prompt
    (default: the context length less one). max_tokens_limit: the largest `max_tokens`.
    """

    def __init__(self, engine, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                 served_model_name: str | None = None, max_tokens_limit: int | None = None,
                 max_prompt_tokens: int | None = None, max_queue: int | None = 256,
                 max_body_bytes: int = 1 << 20, retry_after_s: int = 1) -> None:
        try:
            import fastapi  # noqa: F401 - checked here for one clear message
            import uvicorn
        except ImportError as exc:
            raise ImportError(f"the OpenAI-compatible server needs FastAPI and uvicorn ({exc}); "
                              "install them with: pip install 'phalanx[serve]'") from exc
        if max_queue is not None and max_queue < 0:
            raise ValueError(f"max_queue={max_queue} must be >= 0 (None: unbounded)")
        self.engine = engine
        self.api_key = api_key or None
        self.model_name = served_model_name or engine.model_name
        self.max_tokens_limit = min(max_tokens_limit or engine.max_model_len, engine.max_model_len)
        self.max_prompt_tokens = min(max_prompt_tokens or engine.max_model_len - 1, engine.max_model_len - 1)
        self.max_body_bytes = max_body_bytes
        self.retry_after_s = retry_after_s
        self.metrics = ServerMetrics()
        self.loop = EngineLoop(engine, max_queue=max_queue, metrics=self.metrics)
        self.app = build_app(self)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self._socket.listen(2048)
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=10, timeout_keep_alive=30)
        self._uvicorn = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def host(self) -> str:
        return self._socket.getsockname()[0]

    @property
    def port(self) -> int:
        return self._socket.getsockname()[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "OpenAIServer":
        """Serve on a background thread (tests, notebooks, `serve_forever`)."""
        try:
            self.loop.start()
            self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self._socket]},
                                            name="phalanx-http", daemon=True)
            self._thread.start()
            deadline = time.monotonic() + timeout
            while not self._uvicorn.started:
                if not self._thread.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError("the HTTP server did not start (see the log above)")
                time.sleep(0.01)
        except BaseException:  # KeyboardInterrupt included: nothing may be left running
            self.shutdown()
            raise
        return self

    def serve_forever(self, stop: threading.Event | None = None) -> None:
        """Serve until `stop` is set (`phalanx serve` sets it from its SIGINT/SIGTERM handler) or a
        KeyboardInterrupt arrives. The wait is on the event, not on the HTTP thread: Python 3.11's
        `Thread.join` interrupted by a KeyboardInterrupt can mark the still-running thread as
        finished (its `_wait_for_tstate_lock` releases the running thread's own lock), and then
        `shutdown` did not wait for uvicorn, which was still running into the interpreter's exit."""
        stop = stop or threading.Event()
        try:
            self.start()
            while not stop.wait(timeout=0.5) and self._thread.is_alive():
                pass
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Stop accepting, end every request in flight (their clients get an error or a cut
        stream), stop the engine loop."""
        self._uvicorn.should_exit = True
        self.loop.shutdown()
        if self._thread is not None:
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                log.warning("the HTTP server thread did not stop within 30 s")
            self._thread = None
        self._socket.close()

    def __enter__(self) -> "OpenAIServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()
