"""An OpenAI-compatible HTTP server over an `LLM`, on FastAPI + uvicorn.

    GET  /health                  200 {"status": "ok"}; 503 once the engine loop stopped (no API key needed)
    GET  /metrics                 Prometheus text format (no API key needed)
    GET  /v1/models               the served model and its loaded LoRA adapters
    POST /v1/completions          prompt(s) -> text; "stream": true for server-sent events
    POST /v1/chat/completions     messages -> the model's chat template -> text; streaming too
    POST /v1/load_lora_adapter    {"lora_name", "lora_path"}: load a PEFT adapter (engine built with enable_lora)
    POST /v1/unload_lora_adapter  {"lora_name"}: forget it; requests choose an adapter by `model`

All requests meet in the same engine batches: one engine thread (`EngineLoop`) steps the engine,
the handlers run on uvicorn's event loop and never wait for a step. The server is split by
concern, each module with one job:

    server            builds the FastAPI app, binds the socket, runs uvicorn and the engine loop
    server_routes     the handlers: read and check a request, submit it, answer it (JSON)
    server_streaming  streamed answers: engine outputs -> server-sent events, held-back text
    server_http       what routes and streams share: error bodies, engine-error -> status,
                      watching for a client that disconnects
    openai_protocol   the OpenAI wire format without HTTP: parse and validate request bodies into
                      `SamplingParams`, shape responses and chunks, tool-call parsing
    structured        response_format / tool-call constraints compiled with llguidance
    serve             the `phalanx serve` command line

The limits:

- bounded: the server holds at most `max_num_seqs + max_queue` requests; beyond that a request is
  answered 429 with `Retry-After` instead of joining an ever longer queue;
- a client that disconnects (mid-stream or while waiting) has its requests aborted, which frees
  their KV blocks;
- prompts over `max_prompt_tokens`, `max_tokens` over its limit, malformed JSON and bodies over
  `max_body_bytes` are answered 4xx with an OpenAI-style error body before the engine sees them;
- a request that fails in an engine step is answered 500 (or an SSE error event) naming the
  cause; the engine frees its blocks and goes on serving the others;
- unsupported request fields answer 400 naming them (`openai_protocol.check_fields`);
- with an API key every /v1 route needs `Authorization: Bearer KEY`; it binds 127.0.0.1 unless
  told otherwise.
"""
from __future__ import annotations

import logging
import socket
import threading
import time

from phalanx.inference import openai_protocol as api
from phalanx.inference.engine_loop import EngineLoop
from phalanx.inference.metrics import ServerMetrics

log = logging.getLogger(__name__)


# -- the application -------------------------------------------------------------------------------
def build_app(server: OpenAIServer):
    """The FastAPI app: the routes of `phalanx.inference.server_routes.Routes` over `server` (its
    engine loop, limits and metrics)."""
    from fastapi import Depends, FastAPI
    from starlette.exceptions import HTTPException

    from phalanx.inference import server_http, server_routes

    routes = server_routes.Routes(server)
    app = FastAPI(title="phalanx", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(api.RequestError, server_http.request_error)
    app.add_exception_handler(HTTPException, server_http.http_error)
    keyed = [Depends(routes.authorized)]  # /health and /metrics need no API key
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics, methods=["GET"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"], dependencies=keyed)
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"], dependencies=keyed)
    app.add_api_route("/v1/chat/completions", routes.chat, methods=["POST"], dependencies=keyed)
    app.add_api_route("/v1/load_lora_adapter", routes.load_lora_adapter, methods=["POST"], dependencies=keyed)
    app.add_api_route("/v1/unload_lora_adapter", routes.unload_lora_adapter, methods=["POST"], dependencies=keyed)
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
