"""The OpenAI HTTP API's request and response shapes, as plain functions over dicts.

Requests are validated here and turned into prompts + `SamplingParams`; anything wrong raises
`RequestError` with the HTTP status and an OpenAI-style error body, so the server maps every bad
request to a clear 4xx. Responses and streaming chunks are built here too, and tool calls are
parsed back out of the generated text. No HTTP in this module: the handlers that call it are in
`server_routes`, the server-sent events in `server_streaming` (the map of the server's modules is
in `server`'s docstring).

OpenAI fields that need a `SamplingParams` field this engine version may lack (n, best_of, echo,
presence/frequency penalties, logit_bias) are passed on only when the dataclass has the field
(`supported_sampling_fields`), else refused with 400.
"""
from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass

from phalanx.inference.outputs import RequestOutput
from phalanx.inference.sampling_params import SamplingParams, StructuredOutput


MAX_N = 16  # choices (n, best_of) one request may ask for (each sample is a sequence in the batch)

# The request fields each route honours (OpenAI's, then vLLM's extra sampling parameters). Any
# other field answers 400 naming it, never ignored, unless it is null or holds the value that
# asks for nothing (NEUTRAL): a client that sends `tools: []` or `response_format: {"type":
# "text"}` gets what it asked for.
_COMMON_FIELDS = {"model", "stream", "stream_options", "temperature", "top_p", "n", "stop", "seed", "max_tokens",
                  "presence_penalty", "frequency_penalty", "logit_bias", "user",
                  "top_k", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids", "skip_special_tokens",
                  "response_format"}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "best_of", "echo", "logprobs"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                                "parallel_tool_calls"}
NEUTRAL = {
    "response_format": [{"type": "text"}], "tools": [[]], "tool_choice": ["none"], "functions": [[]],
    "function_call": ["none"], "parallel_tool_calls": [True, False], "suffix": [""], "store": [False],
    "service_tier": ["auto", "default"], "modalities": [["text"]], "min_p": [0, 0.0], "use_beam_search": [False],
    "length_penalty": [1, 1.0], "include_stop_str_in_output": [False], "spaces_between_special_tokens": [True],
    "add_generation_prompt": [True], "echo": [False], "best_of": [1], "prompt_logprobs": [],
}
_WHY = {
    "tools": "tool calls are a /v1/chat/completions feature", "tool_choice": "tool calls are a /v1/chat/completions feature",
    "functions": "function calls are not implemented yet", "function_call": "function calls are not implemented yet",
    "best_of": "'best_of' is a /v1/completions field; chat completions do not take it",
    "echo": "'echo' is a /v1/completions field; chat completions do not take it",
}


def check_fields(body: dict, allowed: set[str]) -> None:
    """400 naming the first field this route does not honour (null and NEUTRAL values pass)."""
    for name, value in body.items():
        if name in allowed or value is None:
            continue
        if name in NEUTRAL and any(value == v and type(value) is type(v) for v in NEUTRAL[name]):
            continue
        why = _WHY.get(name, "this server does not support it" if name in NEUTRAL else "unknown parameter")
        raise RequestError(400, f"'{name}' is not supported: {why}; remove it from the request", param=name,
                           code="unsupported_parameter")


class RequestError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class ParsedRequest:
    prompts: list  # str or list[int] each
    params: SamplingParams
    stream: bool
    include_usage: bool = False
    chat: bool = False
    top_logprobs: int = 0
    n: int = 1  # choices per prompt
    echo: bool = False  # completions: the engine puts the prompt before each choice
    tools: list[dict] | None = None  # chat: the tools the template renders (None: none, or tool_choice "none")
    tool_choice: str | dict = "none"  # "auto", "required" or {"type": "function", "function": {"name": ...}}
    parallel_tool_calls: bool = True  # False: only the first tool call of an answer is returned


# -- field helpers ---------------------------------------------------------------------------------
def _number(body: dict, name: str, default, low=None, high=None, *, integer: bool = False, low_open: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise RequestError(400, f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}", param=name)
    if (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high):
        bounds = f"{'>' if low_open else '>='} {low}" if high is None else f"in {'(' if low_open else '['}{low}, {high}]"
        raise RequestError(400, f"'{name}'={value} must be {bounds}", param=name)
    return value


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(400, f"'{name}' must be true or false, got {value!r}", param=name)
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise RequestError(400, "'stop' must be a non-empty string or a list of up to 4 of them", param="stop")
    return stop


def _stop_token_ids(body: dict) -> list[int]:
    """vLLM's extra parameter: token ids that end the output besides EOS (checked against the
    vocabulary when the engine takes the request)."""
    ids = body.get("stop_token_ids")
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise RequestError(400, f"'stop_token_ids' must be a list of token ids, got {ids!r}", param="stop_token_ids")
    return ids


RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


def response_format(body: dict) -> StructuredOutput | None:
    """OpenAI's `response_format`: {"type": "text"} (no constraint), {"type": "json_object"} (JSON
    mode) or {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
    (the schema is enforced whatever `strict` says). Whether the schema's features can be enforced
    is checked when the engine takes the request (`Routes.limits`)."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise RequestError(400, f"'response_format' must be an object with 'type' one of {', '.join(RESPONSE_FORMATS)}; "
                                f"got {fmt!r}", param="response_format")
    extra = sorted(set(fmt) - {"type", "json_schema"})
    if kind != "json_schema" and fmt.get("json_schema") is not None:
        extra.append("json_schema")
    if extra:
        raise RequestError(400, f"'response_format.{extra[0]}' is not supported with type '{kind}'; remove it",
                           param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise RequestError(400, "'response_format.json_schema' must be an object with a 'schema' (a JSON schema "
                                "object), a 'name' and optionally 'strict' and 'description'", param="response_format")
    unknown = sorted(set(spec) - _JSON_SCHEMA_KEYS)
    if unknown:
        raise RequestError(400, f"'response_format.json_schema.{unknown[0]}' is not supported; remove it",
                           param="response_format")
    if not isinstance(spec.get("strict", True), (bool, type(None))):
        raise RequestError(400, "'response_format.json_schema.strict' must be true or false", param="response_format")
    return StructuredOutput(json_schema=spec["schema"])


def supported_sampling_fields() -> set[str]:
    """The fields this version of `SamplingParams` has (other OpenAI fields are refused)."""
    return {f.name for f in dataclasses.fields(SamplingParams)}


def _choices(body: dict, *, chat: bool) -> tuple[int, int]:
    """n (choices returned) and best_of (samples drawn, the n most likely returned)."""
    n = _number(body, "n", 1, 1, MAX_N, integer=True)
    best_of = n if chat else _number(body, "best_of", n, 1, MAX_N, integer=True)
    if best_of < n:
        raise RequestError(400, f"'best_of'={best_of} must be >= 'n'={n}", param="best_of")
    return n, best_of


def _optional_sampling(body: dict, *, chat: bool) -> dict:
    """OpenAI fields that map onto `SamplingParams` fields which this version may not have yet:
    passed on when it has them, refused with 400 when it does not and the field asks for something."""
    have = supported_sampling_fields()
    extra = {}
    n, best_of = _choices(body, chat=chat)
    for name, value, default in (("n", n, 1), ("best_of", best_of, n)):
        if value != default:
            if name not in have:
                raise RequestError(400, f"'{name}'={value} is not supported by this engine (only {name}={default})",
                                   param=name)
            extra[name] = value
    if not chat and _bool(body, "echo", False):
        if "echo" not in have:
            raise RequestError(400, "'echo' is not supported by this engine", param="echo")
        extra["echo"] = True
    for name in ("presence_penalty", "frequency_penalty"):
        value = float(_number(body, name, 0.0, -2.0, 2.0))
        if value != 0.0:
            if name not in have:
                raise RequestError(400, f"'{name}' is not supported by this engine; use 'repetition_penalty'",
                                   param=name)
            extra[name] = value
    bias = body.get("logit_bias")
    if bias:
        if not isinstance(bias, dict):
            raise RequestError(400, "'logit_bias' must be an object mapping token ids to biases", param="logit_bias")
        clean = {}
        for key, value in bias.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise RequestError(400, f"'logit_bias' keys must be token ids, got {key!r}", param="logit_bias") from None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise RequestError(400, f"'logit_bias'[{key!r}]={value!r} must be a number in [-100, 100]",
                                   param="logit_bias")
            clean[token] = float(value)
        if "logit_bias" not in have:
            raise RequestError(400, "'logit_bias' is not supported by this engine", param="logit_bias")
        extra["logit_bias"] = clean
    return extra


def _sampling(body: dict, max_tokens_name: str, *, default_max_tokens: int, max_tokens_limit: int,
              logprobs: int | None, chat: bool) -> SamplingParams:
    max_tokens = body.get(max_tokens_name)
    if max_tokens is None and max_tokens_name == "max_completion_tokens":
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise RequestError(400, f"'max_tokens' must be a positive integer, got {max_tokens!r}", param="max_tokens")
    if max_tokens > max_tokens_limit:
        raise RequestError(400, f"'max_tokens'={max_tokens} is more than this server allows ({max_tokens_limit})",
                           param="max_tokens", code="max_tokens_exceeded")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(400, f"'seed' must be an integer, got {seed!r}", param="seed")
    top_k = _number(body, "top_k", -1, -1, None, integer=True)
    kwargs = dict(
        max_new_tokens=max_tokens,
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=float(_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)),
        top_k=0 if top_k == -1 else top_k,
        repetition_penalty=float(_number(body, "repetition_penalty", 1.0, 0.0, None, low_open=True)),
        stop=_stop(body),
        ignore_eos=_bool(body, "ignore_eos", False),
        min_new_tokens=min(_number(body, "min_tokens", 0, 0, None, integer=True), max_tokens),
        stop_token_ids=_stop_token_ids(body),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        logprobs=logprobs, seed=seed)
    kwargs.update(_optional_sampling(body, chat=chat))
    structured = response_format(body)
    if structured is not None:
        if kwargs["min_new_tokens"]:
            raise RequestError(400, "'min_tokens' cannot be combined with 'response_format' (the format decides "
                                    "where the output ends); remove one of them", param="min_tokens")
        kwargs["structured_output"] = structured
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise RequestError(400, str(exc)) from None


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError(400, "'stream_options' must be an object", param="stream_options")
    return stream, bool(options.get("include_usage", False))


# -- requests --------------------------------------------------------------------------------------
def parse_completion(body: dict, *, max_tokens_limit: int) -> ParsedRequest:
    check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p)) for p in prompt):
        prompts = list(prompt)
    else:
        raise RequestError(400, "'prompt' is required: a string, a list of token ids, or a list of those", param="prompt")
    if any(p == "" for p in prompts):
        raise RequestError(400, "'prompt' must not be empty", param="prompt")
    logprobs = _number(body, "logprobs", None, 0, 20, integer=True)
    stream, usage = _stream_flags(body)
    n, best_of = _choices(body, chat=False)
    if stream and best_of > n:
        raise RequestError(400, "'best_of' > 'n' cannot be streamed (the best are known only at the end)",
                           param="best_of")
    params = _sampling(body, "max_tokens", default_max_tokens=16, max_tokens_limit=max_tokens_limit,
                       logprobs=logprobs, chat=False)
    return ParsedRequest(prompts, params, stream, usage, chat=False, top_logprobs=logprobs or 0, n=n,
                         echo=bool(getattr(params, "echo", False)))


def parse_chat(body: dict, *, max_tokens_limit: int, default_max_tokens: int) -> ParsedRequest:
    check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' is required: a non-empty list of {role, content}", param="messages")
    clean = [_message(i, m) for i, m in enumerate(messages)]
    want_logprobs = _bool(body, "logprobs", False)
    top = _number(body, "top_logprobs", 0, 0, 20, integer=True)
    if top and not want_logprobs:
        raise RequestError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    stream, usage = _stream_flags(body)
    n, _ = _choices(body, chat=True)
    params = _sampling(body, "max_completion_tokens", default_max_tokens=default_max_tokens,
                       max_tokens_limit=max_tokens_limit, logprobs=top if want_logprobs else None, chat=True)
    tools, choice = _tools(body)
    if tools is not None and choice != "auto":
        if params.structured_output is not None:
            raise RequestError(400, "'response_format' cannot be combined with a forced tool call ('tool_choice')",
                               param="response_format")
        params = dataclasses.replace(params, structured_output=StructuredOutput(grammar=tool_call_grammar(tools, choice)))
    return ParsedRequest([clean], params, stream, usage, chat=True, top_logprobs=top, n=n, tools=tools,
                         tool_choice=choice, parallel_tool_calls=_bool(body, "parallel_tool_calls", True))


def _message(i: int, m) -> dict:
    """One chat message, as the chat template takes it: `role` and `content` (text parts joined);
    an assistant's `tool_calls` (their JSON `arguments` decoded, as templates render them), a tool
    message's `tool_call_id`."""
    roles = ("system", "user", "assistant", "tool", "developer")
    if not isinstance(m, dict) or m.get("role") not in roles:
        raise RequestError(400, f"messages[{i}] needs a 'role' of system, user, assistant or tool", param="messages")
    allowed = {"role", "content"} | {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}.get(m["role"], set())
    extra = [k for k, v in m.items() if k not in allowed and v is not None]
    if extra:
        raise RequestError(400, f"messages[{i}].{extra[0]} is not supported for role '{m['role']}' (messages take "
                                "'role' and 'content'; assistant messages also 'tool_calls', tool messages "
                                "'tool_call_id')", param="messages", code="unsupported_parameter")
    content = m.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise RequestError(400, f"messages[{i}].content: only text parts are supported", param="messages")
        content = "".join(p["text"] for p in content)
    calls = m.get("tool_calls")
    if content is None and calls:
        content = ""
    if not isinstance(content, str):
        raise RequestError(400, f"messages[{i}].content must be a string", param="messages")
    out = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
    if calls:
        out["tool_calls"] = [_past_call(i, j, c) for j, c in enumerate(calls if isinstance(calls, list) else [None])]
    if m.get("tool_call_id") is not None:  # (templates that order results by position do not render it)
        if not isinstance(m["tool_call_id"], str):
            raise RequestError(400, f"messages[{i}].tool_call_id must be a string", param="messages")
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _past_call(i: int, j: int, call) -> dict:
    """An assistant message's tool call, its `arguments` (a JSON string in OpenAI's format)
    decoded to the object chat templates render."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
        raise RequestError(400, f"messages[{i}].tool_calls[{j}] must be {{\"id\", \"type\": \"function\", "
                                "\"function\": {\"name\": str, \"arguments\": JSON string}}", param="messages")
    try:
        arguments = json.loads(fn["arguments"])
    except json.JSONDecodeError as exc:
        raise RequestError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: {exc}",
                           param="messages") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": arguments}}


def _tools(body: dict) -> tuple[list[dict] | None, str | dict]:
    """The request's tools (None when there are none or tool_choice is "none") and its
    tool_choice: "auto" (the default with tools), "required", or a named function."""
    tools = body.get("tools") or None
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise RequestError(400, "'tool_choice' needs 'tools'", param="tool_choice")
        return None, "none"
    if not isinstance(tools, list):
        raise RequestError(400, "'tools' must be a list of {\"type\": \"function\", \"function\": {...}}",
                           param="tools")
    names = []
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(400, f"tools[{k}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                    "\"parameters\": {JSON schema}}}", param="tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise RequestError(400, f"tools[{k}].function.parameters must be a JSON schema object", param="tools")
        names.append(fn["name"])
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None, "none"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise RequestError(400, f"'tool_choice' names {name!r}, which is not among the tools {names}",
                               param="tool_choice")
    elif choice not in ("auto", "required"):
        raise RequestError(400, f"'tool_choice' must be \"none\", \"auto\", \"required\" or "
                                f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}",
                           param="tool_choice")
    return tools, choice


# -- tool calls in the Hermes / Qwen2.5 format: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def tool_call_grammar(tools: list[dict], choice: str | dict) -> str:
    """A Lark grammar (llguidance's dialect) for one tool call: of the named function, or of any
    of the tools ("required"); its arguments valid against the function's parameters schema."""
    def call_schema(fn: dict) -> dict:
        return {"type": "object", "properties": {"name": {"const": fn["name"]},
                                                 "arguments": fn.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False}
    fns = [t["function"] for t in tools]
    if isinstance(choice, dict):
        fns = [f for f in fns if f["name"] == choice["function"]["name"]]
    schema = call_schema(fns[0]) if len(fns) == 1 else {"anyOf": [call_schema(f) for f in fns]}
    schema["x-guidance"] = {"whitespace_flexible": False}
    return f'start: "{TOOL_CALL_OPEN}\\n" call "\\n{TOOL_CALL_CLOSE}"\ncall: %json {json.dumps(schema)}\n'


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """The text around the tool calls, and the calls in OpenAI's format (`arguments` a JSON
    string); a block that is not a JSON {name, arguments} object stays in the text."""
    calls, kept, at = [], [], 0
    for match in _TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        kept.append(text[at:match.start()])
        at = match.end()
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}})
    kept.append(text[at:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


def check_model(body: dict, served: str, adapters: Collection[str] = ()) -> str | None:
    """The LoRA adapter a request's `model` names (None: the base model, or no `model`); 404
    naming it when it is neither the served model nor a loaded adapter."""
    model = body.get("model")
    if model is None or model == served:
        return None
    if isinstance(model, str) and model in adapters:
        return model
    others = f" and the LoRA adapters {', '.join(repr(a) for a in sorted(adapters))}" if adapters else ""
    raise RequestError(404, f"the model '{model}' does not exist; this server serves '{served}'{others}",
                       param="model", code="model_not_found")


def parse_lora_request(body: dict, *, load: bool) -> tuple[str, str | None]:
    """(lora_name, lora_path) of vLLM's /v1/load_lora_adapter (both required) or
    /v1/unload_lora_adapter (lora_name; lora_int_id accepted and ignored) body."""
    fields = ("lora_name", "lora_path") if load else ("lora_name",)
    unknown = sorted(set(body) - set(fields) - ({"lora_int_id"} if not load else set()))
    if unknown:
        raise RequestError(400, f"unknown parameter '{unknown[0]}' (this route takes {', '.join(fields)})",
                           param=unknown[0], code="unsupported_parameter")
    for name in fields:
        if not isinstance(body.get(name), str) or not body[name]:
            raise RequestError(400, f"'{name}' is required (a non-empty string)", param=name)
    return body["lora_name"], body.get("lora_path")


def check_prompt_length(num_prompt_tokens: int, max_prompt_tokens: int, param: str = "prompt") -> None:
    if num_prompt_tokens > max_prompt_tokens:
        raise RequestError(400, f"the prompt has {num_prompt_tokens} tokens, more than this server's limit of "
                                f"{max_prompt_tokens} prompt tokens (--max-prompt-tokens); shorten it",
                           param=param, code="prompt_too_long")


def check_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int, param: str = "prompt") -> None:
    if num_prompt_tokens + max_tokens > max_model_len:
        raise RequestError(400, f"this model's maximum context length is {max_model_len} tokens, but "
                                f"{num_prompt_tokens} prompt tokens + {max_tokens} max_tokens were requested; "
                                "shorten the prompt or lower max_tokens",
                           param=param, code="context_length_exceeded")


# -- responses -------------------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI counts each prompt once, however many choices it has, and every sampled token."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completions_of(out: RequestOutput) -> list:
    """A request's completions: `out.outputs` (n of them) when the engine fills it, else the
    request's own n == 1 fields."""
    return list(getattr(out, "outputs", None) or [out])


def generated_tokens(out: RequestOutput, echo: bool) -> int:
    """Tokens generated for a request, all its completions (an echoed prompt does not count)."""
    skip = len(out.prompt_token_ids) if echo else 0
    return sum(max(0, len(c.token_ids) - skip) for c in completions_of(out))


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def completion_logprobs(out: RequestOutput, tokenizer, start: int = 0, text_offset: int = 0) -> dict | None:
    if out.logprobs is None:
        return None
    tokens = [_token_text(tokenizer, t) for t in out.token_ids[start:]]
    offsets, at = [], text_offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    tops = [{_token_text(tokenizer, k): v for k, v in d.items()} if d else None for d in out.top_logprobs[start:]]
    return {"tokens": tokens, "token_logprobs": out.logprobs[start:], "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(out: RequestOutput, tokenizer, start: int = 0) -> dict | None:
    if out.logprobs is None:
        return None
    content = []
    for tid, lp, top in zip(out.token_ids[start:], out.logprobs[start:], out.top_logprobs[start:]):
        text = _token_text(tokenizer, tid)
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": _token_text(tokenizer, k), "logprob": v,
                                          "bytes": list(_token_text(tokenizer, k).encode())} for k, v in (top or {}).items()]})
    return {"content": content}


def completion_choice(index: int, out, tokenizer) -> dict:
    """One choice of a completion, from a completion (or an n == 1 request output)."""
    return {"index": index, "text": out.text, "logprobs": completion_logprobs(out, tokenizer),
            "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}


def completion_response(rid: str, model: str, choices: list[dict], usage_: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage_}


def chat_message(text: str, finish_reason: str | None, tools: bool, parallel: bool = True) -> tuple[dict, str | None]:
    """The assistant message of a chat choice, and its finish_reason: with tools, the tool calls
    in the text become `tool_calls` (finish_reason "tool_calls"; only the first unless `parallel`)."""
    if not tools:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = parse_tool_calls(text)
    calls = calls if parallel else calls[:1]
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


def chat_response(rid: str, model: str, out: RequestOutput, tokenizer, usage_: dict, tools: bool = False,
                  parallel_tool_calls: bool = True) -> dict:
    choices = []
    for i, c in enumerate(completions_of(out)):
        message, finish = chat_message(c.text, c.finish_reason, tools, parallel_tool_calls)
        choices.append({"index": i, "message": message, "logprobs": chat_logprobs(c, tokenizer),
                        "finish_reason": finish})
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage_}


def completion_chunk(rid: str, model: str, index: int, text: str, finish_reason: str | None,
                     logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def chat_chunk(rid: str, model: str, index: int, delta: dict, finish_reason: str | None,
               logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, model: str, chat: bool, usage_: dict) -> dict:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [], "usage": usage_}


def models_response(model: str, max_model_len: int, adapters: dict[str, str] | None = None) -> dict:
    """The served model, then each loaded LoRA adapter (its `parent` the model, its `root` the
    directory it was loaded from, as vLLM lists them)."""
    now = int(time.time())
    data = [{"id": model, "object": "model", "created": now, "owned_by": "phalanx", "root": model, "parent": None,
             "max_model_len": max_model_len}]
    data += [{"id": name, "object": "model", "created": now, "owned_by": "phalanx", "root": path, "parent": model,
              "max_model_len": max_model_len} for name, path in (adapters or {}).items()]
    return {"object": "list", "data": data}
