"""Streamed answers (`"stream": true`) of `phalanx.inference.server`: server-sent events.

One `EventStream` per request: the chunks of every choice as the engine produces them (the
choices of several prompts and of n > 1 interleave; prompt p's choice k has index p * n + k),
then the usage chunk when `stream_options.include_usage` asked for it, then `data: [DONE]`. Text
is sent as it is decided (`TextDeltas`): what may be the start of a stop string or of an unfinished
UTF-8 character waits for the next step. A request that fails in an engine step ends its stream
with an error event naming the cause; a client that disconnects has its requests aborted, which
frees their KV blocks.

Imported through `server_routes` only, once `server.OpenAIServer` has checked that FastAPI is
installed.
"""
from __future__ import annotations

import asyncio
import json
from typing import Callable

from starlette.responses import StreamingResponse

from phalanx.inference import openai_protocol as api
from phalanx.inference.engine_loop import Aborted
from phalanx.inference.server_http import engine_error, until_disconnect


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
    """One server-sent event: a JSON payload, or bytes as they are (`b"[DONE]"`)."""
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


class ChoiceEvents:
    """The events of one streamed request: its prompts' outputs merged as they arrive, each
    turned into a chunk per choice by `make_chunk(index, text, finish_reason, logprobs)`."""

    def __init__(self, req, streams, make_chunk: Callable, rid: str, *, model_name: str, tokenizer,
                 abort: Callable[[], None]) -> None:
        self.req, self.streams, self.make_chunk, self.rid = req, streams, make_chunk, rid
        self.model_name, self.tokenizer, self.abort = model_name, tokenizer, abort
        self.deltas: dict[int, TextDeltas] = {}
        self.done: set[int] = set()

    def response(self) -> EventStream:
        return EventStream(self.events(), self.abort)

    async def events(self):
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(p, stream):
            try:
                async for out in stream.outputs():
                    await merged.put((p, out))
            except Exception as exc:  # noqa: BLE001 - handed to the reader below
                await merged.put((p, exc))

        tasks = [asyncio.ensure_future(pump(p, s)) for p, s in enumerate(self.streams)]
        remaining, generated, prompt_tokens = len(self.streams), 0, 0
        try:
            while remaining:
                p, item = await merged.get()
                if isinstance(item, Aborted):
                    return  # the client left, or the server is stopping
                if isinstance(item, BaseException):
                    yield sse(engine_error(item, "prompt").body())
                    return
                for event in self.of_output(p, item):
                    yield event
                if item.finished:
                    remaining -= 1
                    generated += api.generated_tokens(item, self.req.echo)
                    prompt_tokens += len(item.prompt_token_ids)
            if self.req.include_usage:
                usage = api.usage(prompt_tokens, generated)
                yield sse(api.usage_chunk(self.rid, self.model_name, self.req.chat, usage))
            yield sse(b"[DONE]")
        finally:
            for t in tasks:
                t.cancel()
            self.abort()  # no-op for finished ones

    def of_output(self, p: int, item) -> list[bytes]:
        """The events one output of prompt `p` adds: a chunk per choice with new text, logprobs
        or its finish."""
        req, tok = self.req, self.tokenizer
        events = []
        for c in api.completions_of(item):
            index = p * req.n + getattr(c, "index", 0)
            if index in self.done:
                continue
            d = self.deltas.setdefault(index, TextDeltas(req.params.stop, whole=req.tools is not None))
            text = d.next(c)
            logprobs = None
            if c.logprobs is not None and len(c.token_ids) > d.sent_tokens:
                logprobs = (api.chat_logprobs(c, tok, d.sent_tokens) if req.chat
                            else api.completion_logprobs(c, tok, d.sent_tokens, d.sent_text - len(text)))
                d.sent_tokens = len(c.token_ids)
            if text or c.finished or logprobs:
                events.append(sse(self.make_chunk(index, text, c.finish_reason if c.finished else None, logprobs)))
            if c.finished:
                self.done.add(index)
        return events


def completion_chunker(rid: str, model_name: str) -> Callable:
    """make_chunk for a streamed completion."""
    def chunk(i, text, finish, lp):
        return api.completion_chunk(rid, model_name, i, text, finish, lp)
    return chunk


def chat_chunker(rid: str, model_name: str, tools: bool = False, parallel_tool_calls: bool = True) -> Callable:
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
