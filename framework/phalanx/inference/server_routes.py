"""The route handlers of `phalanx.inference.server`: one `Routes` object over the server's state
(engine loop, limits, metrics), its methods the handlers, and the HTTP helpers they share.

Imported by `server.build_app` only, once the server has checked that FastAPI is installed.
"""
# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations (Request)
# at run time.
import asyncio
import dataclasses
import hmac
import json

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException
from starlette.responses import StreamingResponse

from phalanx.inference import openai_protocol as api
from phalanx.inference.engine_loop import Aborted, QueueFull, RequestFailed, RequestStream


class ClientGone(Exception):
    """The client disconnected while its request was running."""


# -- helpers ---------------------------------------------------------------------------------------
def error_response(err: api.RequestError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def engine_error(exc: BaseException, param: str) -> api.RequestError:
    """What a request refused by the engine thread (tokenizer, limits, add_request) answers."""
    if isinstance(exc, api.RequestError):
        return exc
    if isinstance(exc, (ValueError, TypeError)):
        return api.RequestError(400, str(exc), param=param)
    if isinstance(exc, Aborted):
        return api.RequestError(503, str(exc), kind="server_error")
    if isinstance(exc, RequestFailed):  # an error in an engine step; the server goes on
        return api.RequestError(500, str(exc), kind="server_error", code="engine_error")
    return api.RequestError(500, f"internal error: {exc}", kind="server_error")


async def until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def run_watching(request, work, on_gone):
    """Await `work`; if the client disconnects first, call `on_gone` and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnect(request.receive))
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
            raise ClientGone
        return task.result()
    finally:
        watcher.cancel()


class TextDeltas:
    """Per choice: the text not yet sent, holding back what may be the start of a stop string
    or an unfinished UTF-8 character until it is decided (`whole`: everything until the end, for
    answers whose tool calls are parsed out of the finished text)."""

    def __init__(self, stops: list[str], whole: bool = False) -> None:
        self.holdback = 1 << 62 if whole else max((len(s) for s in stops), default=1) - 1
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


def sse(payload) -> bytes:
    return b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"


class EventStream(StreamingResponse):
    """Server-sent events from an async iterator; a disconnect calls `on_gone` (which aborts the
    requests, so the iterator ends)."""

    def __init__(self, events, on_gone) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_gone = on_gone

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        watcher = asyncio.ensure_future(until_disconnect(receive))
        watcher.add_done_callback(lambda t: t.cancelled() or self.on_gone())
        try:
            async for data in self.body_iterator:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the connection broke while sending
            self.on_gone()
        finally:
            watcher.cancel()


async def request_error(request, err: api.RequestError):
    return error_response(err)


async def http_error(request, exc: HTTPException):
    if exc.status_code == 404:
        err = api.RequestError(404, f"no route {request.method} {request.url.path}", code="not_found")
    elif exc.status_code == 405:
        err = api.RequestError(405, f"method {request.method} not allowed on {request.url.path}")
    else:
        err = api.RequestError(exc.status_code, str(exc.detail))
    return error_response(err)


# -- the handlers ----------------------------------------------------------------------------------
class Routes:
    """The handlers over `server` (an `OpenAIServer`: engine, engine loop, limits, metrics)."""

    def __init__(self, server) -> None:
        self.server = server
        self.engine = server.engine

    # -- checks on every request
    def authorized(self, request: Request) -> None:
        key = self.server.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not (given.startswith("Bearer ") and hmac.compare_digest(given[7:].strip().encode(), key.encode())):
            raise api.RequestError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                   kind="authentication_error", code="invalid_api_key")

    async def read_json(self, request: Request) -> dict:
        limit = self.server.max_body_bytes
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

    # -- GET routes
    async def health(self):
        error = self.server.loop.error
        if error is None:
            return {"status": "ok"}
        return JSONResponse({"status": f"engine failed: {error}"}, status_code=503)

    async def metrics(self):
        text = self.server.metrics.render(self.server.loop.gauges())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self):
        return api.models_response(self.server.model_name, self.engine.max_model_len)

    # -- requests in the engine
    def submit(self, jobs: list[tuple]) -> list[RequestStream]:
        server = self.server
        try:
            return server.loop.submit_many(jobs, loop=asyncio.get_running_loop())
        except QueueFull as exc:
            server.metrics.rejected("queue_full")
            raise api.RequestError(429, str(exc), kind="rate_limit_error", code="queue_full",
                                   headers={"Retry-After": str(server.retry_after_s)}) from None
        except RuntimeError as exc:
            raise api.RequestError(503, str(exc), kind="server_error") from None

    def abort_all(self, streams) -> None:
        for s in streams:
            self.server.loop.abort(s)

    async def admit(self, request: Request, streams, param: str) -> list[int]:
        """Wait until the engine admitted every stream; their prompt lengths. A refusal of any
        aborts the others and answers with its reason."""
        try:
            return await run_watching(request, asyncio.gather(*(s.admitted() for s in streams)),
                                      lambda: self.abort_all(streams))
        except ClientGone:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to the status the client sees
            self.abort_all(streams)
            raise engine_error(exc, param) from None

    def limits(self, param: str, fit_max_tokens: bool = False):
        """Checks on the engine thread once the prompt is tokenised (prompt and context limits)."""
        max_prompt_tokens, max_model_len = self.server.max_prompt_tokens, self.engine.max_model_len

        def prepare(ids, params):
            api.check_prompt_length(len(ids), max_prompt_tokens, param)
            if params.structured_output is not None:
                self.check_structured(params.structured_output)
            if fit_max_tokens:  # no max_tokens asked: whatever the context leaves, up to the limit
                most = max(1, min(params.max_new_tokens, max_model_len - len(ids)))
                params = dataclasses.replace(params, max_new_tokens=most,
                                             min_new_tokens=min(params.min_new_tokens, most))
            api.check_length(len(ids), params.max_new_tokens, max_model_len, param)
            return params
        return prepare

    def check_structured(self, spec) -> None:
        """400 naming what of a response_format (or of a forced tool call's parameters: the only
        Lark grammars the HTTP routes make) cannot be enforced (compiled once, then cached)."""
        try:
            self.engine.grammar_compiler().check(spec)
        except (ValueError, ImportError) as exc:
            param = "tools" if spec.grammar is not None else "response_format"
            raise api.RequestError(400, f"'{param}' cannot be used: {exc}", param=param,
                                   code=f"unsupported_{param}") from None

    # -- answers
    async def respond(self, request, req, streams, prompt_lens, make_body):
        """Non-streaming: wait for every prompt's request, then one JSON body."""
        try:
            outs = await run_watching(request, asyncio.gather(*(s.result() for s in streams)),
                                      lambda: self.abort_all(streams))
        except ClientGone:
            return Response(status_code=499)
        except (Aborted, RuntimeError) as exc:  # one prompt failed: the request's others end too
            self.abort_all(streams)
            raise engine_error(exc, "prompt") from None
        usage = api.usage(sum(prompt_lens), sum(api.generated_tokens(o, req.echo) for o in outs))
        return JSONResponse(make_body(outs, usage))

    def stream_events(self, req, streams, make_chunk, rid) -> EventStream:
        """Streaming: chunks of every choice as they come (choices of several prompts and n > 1
        interleave; prompt p's choice k has index p * n + k), then the usage chunk (when asked)
        and [DONE]."""
        return EventStream(self._events(req, streams, make_chunk, rid), lambda: self.abort_all(streams))

    async def _events(self, req, streams, make_chunk, rid):
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(p, stream):
            try:
                async for out in stream.outputs():
                    await merged.put((p, out))
            except Exception as exc:  # noqa: BLE001 - handed to the reader below
                await merged.put((p, exc))

        tasks = [asyncio.ensure_future(pump(p, s)) for p, s in enumerate(streams)]
        deltas: dict[int, TextDeltas] = {}
        done: set[int] = set()
        remaining, generated, prompt_tokens = len(streams), 0, 0
        try:
            while remaining:
                p, item = await merged.get()
                if isinstance(item, Aborted):
                    return  # the client left, or the server is stopping
                if isinstance(item, BaseException):
                    yield sse(engine_error(item, "prompt").body())
                    return
                for event in self._choice_events(req, p, item, deltas, done, make_chunk):
                    yield event
                if item.finished:
                    remaining -= 1
                    generated += api.generated_tokens(item, req.echo)
                    prompt_tokens += len(item.prompt_token_ids)
            if req.include_usage:
                yield sse(api.usage_chunk(rid, self.server.model_name, req.chat, api.usage(prompt_tokens, generated)))
            yield sse(b"[DONE]")
        finally:
            for t in tasks:
                t.cancel()
            self.abort_all(streams)  # no-op for finished ones

    def _choice_events(self, req, p, item, deltas: dict, done: set, make_chunk) -> list[bytes]:
        """The events one output of prompt `p` adds: a chunk per choice with new text, logprobs
        or its finish."""
        tok = self.engine.tokenizer
        events = []
        for c in api.completions_of(item):
            index = p * req.n + getattr(c, "index", 0)
            if index in done:
                continue
            d = deltas.setdefault(index, TextDeltas(req.params.stop, whole=req.tools is not None))
            text = d.next(c)
            logprobs = None
            if c.logprobs is not None and len(c.token_ids) > d.sent_tokens:
                logprobs = (api.chat_logprobs(c, tok, d.sent_tokens) if req.chat
                            else api.completion_logprobs(c, tok, d.sent_tokens, d.sent_text - len(text)))
                d.sent_tokens = len(c.token_ids)
            if text or c.finished or logprobs:
                events.append(sse(make_chunk(index, text, c.finish_reason if c.finished else None, logprobs)))
            if c.finished:
                done.add(index)
        return events

    # -- POST routes
    async def completions(self, request: Request):
        server = self.server
        body = await self.read_json(request)
        api.check_model(body, server.model_name)
        req = api.parse_completion(body, max_tokens_limit=server.max_tokens_limit)
        prepare = self.limits("prompt")
        streams = self.submit([(prompt, req.params, prepare) for prompt in req.prompts])
        try:
            prompt_lens = await self.admit(request, streams, "prompt")
        except ClientGone:
            return Response(status_code=499)
        rid = api.new_id(chat=False)
        tok = self.engine.tokenizer
        if req.stream:
            return self.stream_events(req, streams, lambda i, text, finish, lp: api.completion_chunk(
                rid, server.model_name, i, text, finish, lp), rid)

        def make(outs, usage):
            choices = [api.completion_choice(p * req.n + getattr(c, "index", 0), c, tok)
                       for p, out in enumerate(outs) for c in api.completions_of(out)]
            return api.completion_response(rid, server.model_name, choices, usage)
        return await self.respond(request, req, streams, prompt_lens, make)

    async def chat(self, request: Request):
        server = self.server
        body = await self.read_json(request)
        api.check_model(body, server.model_name)
        req = api.parse_chat(body, max_tokens_limit=server.max_tokens_limit,
                             default_max_tokens=server.max_tokens_limit)
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise api.RequestError(400, "this model has no chat template; use /v1/completions", param="messages")
        if req.tools is not None and api.TOOL_CALL_OPEN not in str(tok.chat_template):
            raise api.RequestError(400, "tool calls need a chat template that renders tools and calls them in the "
                                        "Hermes / Qwen2.5 format (<tool_call>{...}</tool_call>); this model's does "
                                        "not", param="tools", code="unsupported_parameter")
        fit = body.get("max_completion_tokens") is None and body.get("max_tokens") is None
        streams = self.submit([(_chat_encoder(tok, req.prompts[0], req.tools), req.params,
                                self.limits("messages", fit_max_tokens=fit))])
        try:
            prompt_lens = await self.admit(request, streams, "messages")
        except ClientGone:
            return Response(status_code=499)
        rid = api.new_id(chat=True)
        if req.stream:
            chunker = _chat_chunker(rid, server.model_name, req.tools is not None, req.parallel_tool_calls)
            return self.stream_events(req, streams, chunker, rid)

        def make(outs, usage):
            return api.chat_response(rid, server.model_name, outs[0], tok, usage, tools=req.tools is not None,
                                     parallel_tool_calls=req.parallel_tool_calls)
        return await self.respond(request, req, streams, prompt_lens, make)


def _chat_encoder(tok, messages, tools=None):
    """The chat prompt's token ids, computed on the engine thread like every tokenizer call."""
    def encode():
        try:
            extra = {"tools": tools} if tools is not None else {}
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
            return tok(text, add_special_tokens=False)["input_ids"]
        except Exception as exc:  # noqa: BLE001 - a template that rejects these messages
            raise api.RequestError(400, f"the chat template failed on these messages: {exc}",
                                   param="messages") from None
    return encode


def _chat_chunker(rid: str, model_name: str, tools: bool = False, parallel_tool_calls: bool = True):
    """make_chunk for a streamed chat answer: a choice's first chunk carries the role. With tools
    the text comes whole in the last chunk, its tool calls parsed out into `tool_calls` deltas."""
    started: set[int] = set()

    def chunk(i, text, finish, lp):
        if tools and finish:
            message, finish = api.chat_message(text, finish, True, parallel_tool_calls)
            delta = {"content": message["content"]} if i in started else {"role": "assistant",
                                                                           "content": message["content"]}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            started.add(i)
            return api.chat_chunk(rid, model_name, i, delta, finish, lp)
        if i not in started:
            started.add(i)
            delta = {"role": "assistant", "content": text}
        else:
            delta = {"content": text} if text or not finish else {}
        return api.chat_chunk(rid, model_name, i, delta, finish, lp)
    return chunk
