"""The route handlers of `phalanx.inference.server`: one `Routes` object over the server's state
(engine loop, limits, metrics), its methods the handlers.

The server is split by concern: `server` builds the app and runs it; this module reads and checks
requests, submits them to the engine loop and answers them; `openai_protocol` parses the OpenAI
request bodies and shapes the responses (no HTTP in it); `server_streaming` turns engine outputs
into server-sent events; `server_http` holds the error mapping and disconnect watching the two
share. Imported by `server.build_app` only, once the server has checked that FastAPI is installed.
"""
# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations (Request)
# at run time.
import asyncio
import dataclasses
import hmac
import json

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from phalanx.inference import openai_protocol as api
from phalanx.inference.engine_loop import Aborted, QueueFull, RequestStream
from phalanx.inference.lora import LoraError
from phalanx.inference.server_http import ClientGone, engine_error, run_watching
from phalanx.inference.server_streaming import ChoiceEvents, EventStream, chat_chunker, completion_chunker


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
        return api.models_response(self.server.model_name, self.engine.max_model_len, self.engine.lora_adapters())

    # -- LoRA adapters (vLLM's routes)
    async def load_lora_adapter(self, request: Request):
        name, path = api.parse_lora_request(await self.read_json(request), load=True)
        if name == self.server.model_name:
            raise api.RequestError(400, f"'{name}' is the served model's name: give the adapter another lora_name",
                                   param="lora_name")
        await self.lora_call(self.engine.load_lora_adapter, name, path, param="lora_path")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: Request):
        name, _ = api.parse_lora_request(await self.read_json(request), load=False)
        await self.lora_call(self.engine.unload_lora_adapter, name, param="lora_name")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def lora_call(self, call, *args, param: str) -> None:
        """`call` off the event loop (it reads files and waits for the engine's step to end);
        its `LoraError` answered with its status (404: no such adapter). Refused under tensor
        parallelism: the other ranks, busy running steps, would not load the adapter."""
        if self.engine.config.tp_size > 1:
            raise api.RequestError(400, f"adapters cannot be loaded or unloaded while serving with --tp-size "
                                        f"{self.engine.config.tp_size}: give them at start (--lora NAME=PATH), "
                                        "or serve with --tp-size 1", param=param)
        try:
            await asyncio.to_thread(call, *args)
        except LoraError as exc:
            raise api.RequestError(exc.status, str(exc), param="lora_name" if exc.status == 404 else param,
                                   code="lora_adapter_not_found" if exc.status == 404 else None) from None

    def model_of(self, body: dict) -> str | None:
        """The LoRA adapter the request's `model` names (None: the base model); 404 for an unknown model."""
        return api.check_model(body, self.server.model_name, self.engine.lora_adapters())

    def with_adapter(self, adapter: str | None, params):
        """(the model name to answer with, params that run through `adapter`)."""
        if adapter is None:
            return self.server.model_name, params
        return adapter, dataclasses.replace(params, lora_name=adapter)

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

    def stream_events(self, req, streams, make_chunk, rid, model: str) -> EventStream:
        """Streaming: server-sent events of every choice as they come (`server_streaming`)."""
        return ChoiceEvents(req, streams, make_chunk, rid, model_name=model,
                            tokenizer=self.engine.tokenizer, abort=lambda: self.abort_all(streams)).response()

    # -- POST routes
    def chat_tokenizer(self, tools: bool):
        """The tokenizer, once it is known to have a chat template (and one that knows tools when
        the request sends them); 400 otherwise."""
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise api.RequestError(400, "this model has no chat template; use /v1/completions", param="messages")
        if tools and api.TOOL_CALL_OPEN not in str(tok.chat_template):
            raise api.RequestError(400, "tool calls need a chat template that renders tools and calls them in the "
                                        "Hermes / Qwen2.5 format (<tool_call>{...}</tool_call>); this model's does "
                                        "not", param="tools", code="unsupported_parameter")
        return tok

    async def completions(self, request: Request):
        server = self.server
        body = await self.read_json(request)
        adapter = self.model_of(body)
        req = api.parse_completion(body, max_tokens_limit=server.max_tokens_limit)
        model, params = self.with_adapter(adapter, req.params)
        prepare = self.limits("prompt")
        streams = self.submit([(prompt, params, prepare) for prompt in req.prompts])
        try:
            prompt_lens = await self.admit(request, streams, "prompt")
        except ClientGone:
            return Response(status_code=499)
        rid = api.new_id(chat=False)
        tok = self.engine.tokenizer
        if req.stream:
            return self.stream_events(req, streams, completion_chunker(rid, model), rid, model)

        def make(outs, usage):
            choices = [api.completion_choice(p * req.n + getattr(c, "index", 0), c, tok)
                       for p, out in enumerate(outs) for c in api.completions_of(out)]
            return api.completion_response(rid, model, choices, usage)
        return await self.respond(request, req, streams, prompt_lens, make)

    async def chat(self, request: Request):
        server = self.server
        body = await self.read_json(request)
        adapter = self.model_of(body)
        req = api.parse_chat(body, max_tokens_limit=server.max_tokens_limit,
                             default_max_tokens=server.max_tokens_limit)
        model, params = self.with_adapter(adapter, req.params)
        tok = self.chat_tokenizer(tools=req.tools is not None)
        fit = body.get("max_completion_tokens") is None and body.get("max_tokens") is None
        streams = self.submit([(_chat_encoder(tok, req.prompts[0], req.tools), params,
                                self.limits("messages", fit_max_tokens=fit))])
        try:
            prompt_lens = await self.admit(request, streams, "messages")
        except ClientGone:
            return Response(status_code=499)
        rid = api.new_id(chat=True)
        if req.stream:
            chunker = chat_chunker(rid, model, req.tools is not None, req.parallel_tool_calls)
            return self.stream_events(req, streams, chunker, rid, model)

        def make(outs, usage):
            return api.chat_response(rid, model, outs[0], tok, usage, tools=req.tools is not None,
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
