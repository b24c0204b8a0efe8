"""An OpenAI-compatible HTTP server over an `LLM`, on the standard library's ThreadingHTTPServer.

    GET  /health                  200 {"status": "ok"} (no API key needed)
    GET  /v1/models               the served model
    POST /v1/completions          prompt(s) -> text; "stream": true for server-sent events
    POST /v1/chat/completions     messages -> the model's chat template -> text; streaming too

Why the standard library: one thread per connection is plenty for a server whose throughput
is set by the engine's batching (all requests meet in the same batches on the engine thread),
and it adds no dependency. It binds 127.0.0.1 unless told otherwise; with an API key every
route but /health needs `Authorization: Bearer KEY`. Bad input — malformed JSON, unknown
fields' bad values, prompts longer than the context, max_tokens beyond the limit, a body over
the size limit — gets a 4xx with an OpenAI-style error body, before the engine sees it.
"""
from __future__ import annotations

import hmac
import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from phalanx.inference import openai_protocol as api
from phalanx.inference.engine_loop import EngineLoop

log = logging.getLogger(__name__)


class _Handler(BaseHTTPRequestHandler):
    server_version = "phalanx"
    protocol_version = "HTTP/1.0"  # one request per connection; a stream ends when the connection closes

    @property
    def app(self) -> "OpenAIServer":
        return self.server.app  # type: ignore[attr-defined]

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        log.info("%s %s", self.address_string(), format % args)

    # -- plumbing ---------------------------------------------------------------------------------
    def _send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, err: api.RequestError) -> None:
        self._send_json(err.status, err.body())

    def _authorized(self) -> bool:
        key = self.app.api_key
        if key is None:
            return True
        given = self.headers.get("Authorization", "")
        ok = given.startswith("Bearer ") and hmac.compare_digest(given[7:].strip().encode(), key.encode())
        if not ok:
            self._error(api.RequestError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                         kind="authentication_error", code="invalid_api_key"))
        return ok

    def _read_json(self) -> dict:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise api.RequestError(411, "a Content-Length header is required")
        if int(length) > self.app.max_body_bytes:
            raise api.RequestError(413, f"the request body is larger than {self.app.max_body_bytes} bytes")
        raw = self.rfile.read(int(length))
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise api.RequestError(400, f"the request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise api.RequestError(400, "the request body must be a JSON object")
        return body

    # -- routes -----------------------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/health":
            ok = self.app.loop.error is None
            self._send_json(200 if ok else 503, {"status": "ok" if ok else f"engine failed: {self.app.loop.error}"})
        elif self.path == "/v1/models":
            if self._authorized():
                self._send_json(200, api.models_response(self.app.model_name, self.app.engine.max_model_len))
        else:
            self._error(api.RequestError(404, f"no route GET {self.path}", code="not_found"))

    def do_POST(self) -> None:  # noqa: N802
        routes = {"/v1/completions": self._completions, "/v1/chat/completions": self._chat}
        route = routes.get(self.path)
        if route is None:
            self._error(api.RequestError(404, f"no route POST {self.path}", code="not_found"))
            return
        if not self._authorized():
            return
        try:
            route(self._read_json())
        except api.RequestError as err:
            self._error(err)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client left; its request was aborted in _stream
        except Exception as exc:  # noqa: BLE001 - a 500 with the reason beats a dropped connection
            log.exception("request failed")
            self._error(api.RequestError(500, f"internal error: {exc}", kind="server_error"))

    def do_PUT(self) -> None:  # noqa: N802
        self._error(api.RequestError(405, "method not allowed"))

    do_DELETE = do_PATCH = do_PUT

    # -- endpoints --------------------------------------------------------------------------------
    def _submit(self, prompts, params, param_name: str):
        app = self.app
        streams = []
        try:
            for prompt in prompts:
                try:
                    ids = app.loop.tokenize(prompt)
                except (ValueError, TypeError) as exc:
                    raise api.RequestError(400, str(exc), param=param_name) from None
                api.check_length(len(ids), params.max_new_tokens, app.engine.max_model_len, param_name)
                try:
                    streams.append(app.loop.submit(ids, params))
                except (ValueError, TypeError) as exc:
                    raise api.RequestError(400, str(exc), param=param_name) from None
        except BaseException:
            for s in streams:
                app.loop.abort(s.request_id)
            raise
        return streams

    def _completions(self, body: dict) -> None:
        app = self.app
        api.check_model(body, app.model_name)
        req = api.parse_completion(body, max_tokens_limit=app.max_tokens_limit)
        streams = self._submit(req.prompts, req.params, "prompt")
        rid = api.new_id(chat=False)
        if not req.stream:
            outs = [s.result() for s in streams]
            self._send_json(200, api.completion_response(rid, app.model_name, outs, app.engine.tokenizer))
            return
        self._stream(streams, req, lambda i, text, finish, lp: api.completion_chunk(rid, app.model_name, i, text, finish, lp),
                     rid)

    def _chat(self, body: dict) -> None:
        app = self.app
        api.check_model(body, app.model_name)
        req = api.parse_chat(body, max_tokens_limit=app.max_tokens_limit,
                             default_max_tokens=app.max_tokens_limit)
        tok = app.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise api.RequestError(400, "this model has no chat template; use /v1/completions", param="messages")
        def encode(messages):
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return tok(text, add_special_tokens=False)["input_ids"]

        try:
            ids = app.loop.call(encode, req.prompts[0])
        except Exception as exc:  # noqa: BLE001 - a template that rejects these messages
            raise api.RequestError(400, f"the chat template failed on these messages: {exc}", param="messages") from None
        if body.get("max_completion_tokens") is None and body.get("max_tokens") is None:
            # no limit asked: whatever the context leaves
            req.params.max_new_tokens = max(1, min(req.params.max_new_tokens, app.engine.max_model_len - len(ids)))
        streams = self._submit([ids], req.params, "messages")
        rid = api.new_id(chat=True)
        if not req.stream:
            self._send_json(200, api.chat_response(rid, app.model_name, streams[0].result(), tok))
            return
        first = [True]

        def chunk(i, text, finish, lp):
            delta = {"role": "assistant", "content": text} if first[0] else ({"content": text} if text or not finish else {})
            first[0] = False
            return api.chat_chunk(rid, app.model_name, delta, finish, lp)

        self._stream(streams, req, chunk, rid)

    def _stream(self, streams, req, make_chunk, rid: str) -> None:
        """Server-sent events: one `data:` line per text delta, then `data: [DONE]`."""
        app = self.app
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        tok = app.engine.tokenizer
        holdback = max((len(s) for s in req.params.stop), default=1) - 1  # a stop string may be forming
        finals = []
        pending = list(range(len(streams)))
        try:
            for i in pending:  # prompts of a batch stream one after the other (each is already running)
                sent_text, sent_tokens = 0, 0
                for out in streams[i]:
                    text = out.text
                    if not out.finished:
                        end = len(text) - holdback
                        while end > sent_text and text[end - 1] == "\ufffd":  # an unfinished UTF-8 character
                            end -= 1
                    else:
                        end = len(text)
                    delta = text[sent_text:max(end, sent_text)]
                    logprobs = None
                    if out.logprobs is not None and len(out.token_ids) > sent_tokens:
                        logprobs = (api.chat_logprobs(out, tok, sent_tokens) if req.chat
                                    else api.completion_logprobs(out, tok, sent_tokens, sent_text))
                        sent_tokens = len(out.token_ids)
                    if delta or out.finished or logprobs:
                        self._event(make_chunk(i, delta, out.finish_reason if out.finished else None, logprobs))
                    sent_text = max(end, sent_text)
                    if out.finished:
                        finals.append(out)
            if req.include_usage:
                chunk = make_chunk(0, "", None, None)
                chunk["choices"] = []
                chunk["usage"] = api.usage(finals)
                self._event(chunk)
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            for s in streams:
                app.loop.abort(s.request_id)
            raise

    def _event(self, payload: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        self.wfile.flush()


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class OpenAIServer:
    """Serve `engine` over HTTP. `port=0` picks a free port (see `.port` / `.url`)."""

    def __init__(self, engine, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                 served_model_name: str | None = None, max_tokens_limit: int | None = None,
                 max_body_bytes: int = 1 << 20) -> None:
        self.engine = engine
        self.api_key = api_key or None
        self.model_name = served_model_name or engine.model_name
        self.max_tokens_limit = min(max_tokens_limit or engine.max_model_len, engine.max_model_len)
        self.max_body_bytes = max_body_bytes
        self.loop = EngineLoop(engine)
        self.httpd = _HTTPServer((host, port), _Handler)
        self.httpd.app = self
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        host = self.httpd.server_address[0]
        return f"http://{host}:{self.port}"

    def start(self) -> "OpenAIServer":
        """Serve on a background thread (tests, notebooks)."""
        self.loop.start()
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="phalanx-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.loop.start()
        try:
            self.httpd.serve_forever()
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self.httpd.server_close()
        self.loop.shutdown()

    def __enter__(self) -> "OpenAIServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()
