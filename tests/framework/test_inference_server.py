"""The OpenAI-compatible server (FastAPI + uvicorn) over real HTTP on 127.0.0.1 with httpx:
completions, chat with the model's template, server-sent-event streaming, n/best_of/echo, health,
models and metrics, API keys, 4xx answers to bad requests, the bounded queue (429) and a
disconnect that frees the request's KV blocks. The `openai` client's view is in
test_openai_client.py."""
from __future__ import annotations

import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

import inference_models as im
from phalanx.inference import LLM, OpenAIServer, SamplingParams
from phalanx.checkpoint.atomic import MANIFEST
from phalanx.inference.openai_protocol import supported_sampling_fields
from phalanx.inference.serve import model_dir, serve_main
from serving_helpers import direct, parse_metrics, wait_until

TIMEOUT = httpx.Timeout(60.0)
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path, _ = im.save_model(tmp_path_factory.mktemp("served") / "tiny-llama", "llama")
    return path


def make_engine(path, **kwargs) -> LLM:
    kwargs = {"num_blocks": 128, "block_size": 8, "max_model_len": 128, "dtype": "float32", **kwargs}
    return LLM(str(path), **kwargs)


@pytest.fixture(scope="module")
def setup(model_path):
    engine = make_engine(model_path)
    with OpenAIServer(engine, port=0, max_prompt_tokens=64) as server:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
            yield server, client, engine


def sse(response) -> list:
    events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_health_models_and_localhost(setup):
    server, client, _ = setup
    assert server.url.startswith("http://127.0.0.1:")
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-llama"
    assert models["data"][0]["max_model_len"] == 128


def test_completion_matches_the_engine(setup):
    server, client, engine = setup
    prompt = "Continuous batching admits"
    r = client.post("/v1/completions", json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 10,
                                             "temperature": 0, "logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    want = direct(server, prompt, SamplingParams(max_new_tokens=10, temperature=0, logprobs=2))[0]
    assert choice["text"] == want.text and choice["finish_reason"] == want.finish_reason
    assert body["usage"]["completion_tokens"] == len(want.token_ids)
    assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert len(choice["logprobs"]["token_logprobs"]) == len(want.token_ids)
    for got, ref in zip(choice["logprobs"]["token_logprobs"], want.logprobs, strict=True):
        # fp32; the engine's second run of the prompt takes its prefix from the cache (another
        # summation order than the first, full prefill): ~1e-6 apart on log-probs of magnitude ~3
        assert math.isclose(got, ref, rel_tol=0, abs_tol=1e-4)
    assert all(len(t) == 2 for t in choice["logprobs"]["top_logprobs"])
    batch = client.post("/v1/completions", json={"prompt": [prompt, [5, 6, 7]], "max_tokens": 4, "temperature": 0})
    assert [c["index"] for c in batch.json()["choices"]] == [0, 1]
    want = direct(server, [prompt, [5, 6, 7]], SamplingParams(max_new_tokens=4, temperature=0))
    assert [c["text"] for c in batch.json()["choices"]] == [w.text for w in want]


def test_chat_completion_applies_the_chat_template(setup):
    server, client, engine = setup
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[-3:] == engine.tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"][-3:]
    want = direct(server, ids, SamplingParams(max_new_tokens=8, temperature=0))[0]
    assert choice["message"] == {"role": "assistant", "content": want.text}
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_streaming_completion_and_chat(setup):
    server, client, engine = setup
    prompt = "Speculative decoding lets"
    want = direct(server, prompt, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))[0]
    with client.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                         "ignore_eos": True, "stream": True,
                                                         "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = sse(r)
    text_chunks = [c for c in chunks if c["choices"]]
    assert len(text_chunks) > 2  # it really streamed
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == want.text
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    messages = [{"role": "user", "content": "How are you today?"}]
    with client.stream("POST", "/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0,
                                                              "stream": True}) as r:
        chunks = sse(r)
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    whole = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0}).json()
    assert streamed == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_n_best_of_and_echo(setup):
    """n, best_of and echo go to the engine (its SamplingParams fields) when it has them: the
    choices equal `LLM.generate`'s completions for the same params; otherwise 400."""
    server, client, engine = setup
    have = supported_sampling_fields()
    prompt = "Paged attention stores"
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    r = client.post("/v1/completions", json={**body, "n": 3})
    if "n" not in have:
        assert r.status_code == 400 and "'n'=3 is not supported" in r.json()["error"]["message"]
        return
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    common = dict(max_new_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    want = direct(server, prompt, SamplingParams(n=3, **common))[0].outputs
    assert [c["text"] for c in choices] == [w.text for w in want]
    assert len({c["text"] for c in choices}) > 1  # sampled apart
    assert r.json()["usage"]["completion_tokens"] == 18
    assert r.json()["usage"]["prompt_tokens"] == len(engine.tokenize(prompt))
    # two prompts x n=2: prompt p's choice k has index 2p + k
    r = client.post("/v1/completions", json={**body, "prompt": [prompt, "Hello world"], "n": 2})
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]
    want2 = direct(server, [prompt, "Hello world"], SamplingParams(n=2, **common))
    assert [c["text"] for c in r.json()["choices"]] == [c.text for o in want2 for c in o.outputs]
    # best_of: the engine's pick, without logprobs in the answer unless asked
    r = client.post("/v1/completions", json={**body, "n": 1, "best_of": 3})
    (choice,) = r.json()["choices"]
    best = direct(server, prompt, SamplingParams(n=1, best_of=3, **common))[0]
    assert choice["text"] == best.text and choice["logprobs"] is None
    # streamed n=2: chunks of both choices, each choice's text whole, each finished once
    with client.stream("POST", "/v1/completions", json={**body, "n": 2, "stream": True}) as s:
        chunks = sse(s)
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == want[i].text
        assert [c["finish_reason"] for c in mine][-1] == "length"
        assert sum(c["finish_reason"] is not None for c in mine) == 1
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "n": 2,
                                                     "max_tokens": 3, "temperature": 0})
    assert [c["index"] for c in chat.json()["choices"]] == [0, 1]
    # echo: the prompt's text (and with logprobs its tokens, the first without a log-prob) first
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True})
    if "echo" not in have:
        assert r.status_code == 400 and "echo" in r.json()["error"]["message"]
        return
    greedy = direct(server, prompt, SamplingParams(max_new_tokens=4, temperature=0))[0]
    assert r.json()["choices"][0]["text"] == prompt + greedy.text
    assert r.json()["usage"]["completion_tokens"] == len(greedy.token_ids)
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True,
                                             "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(engine.tokenize(prompt)) + 4 and lp["token_logprobs"][0] is None


def test_optional_sampling_fields_follow_sampling_params(setup):
    """presence/frequency penalties and logit_bias reach SamplingParams when it has the fields;
    otherwise they are refused with 400 naming the field."""
    _, client, _ = setup
    have = supported_sampling_fields()
    for field, value in [("presence_penalty", 0.5), ("frequency_penalty", 0.5), ("logit_bias", {"7": 5})]:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value})
        if field in have:
            assert r.status_code == 200, r.text
        else:
            assert r.status_code == 400 and field in r.json()["error"]["message"]
            assert "not supported" in r.json()["error"]["message"]
    if "logit_bias" in have:  # a +100 bias makes the token certain
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0,
                                                 "logit_bias": {"42": 100}, "ignore_eos": True,
                                                 "logprobs": 0})
        assert r.status_code == 200
        assert len(r.json()["choices"][0]["logprobs"]["tokens"]) == 3
    # neutral values are fine whatever the engine supports
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "presence_penalty": 0,
                                             "frequency_penalty": 0.0, "logit_bias": {}})
    assert r.status_code == 200, r.text


def test_concurrent_clients_share_batches_and_get_their_own_answers(setup):
    from concurrent.futures import ThreadPoolExecutor
    server, client, engine = setup
    prompts = [im.mixed_prompts(1, seed=30 + i, low=3, high=30)[0] for i in range(6)]
    want = [o.text for o in direct(server, prompts, SamplingParams(max_new_tokens=8, temperature=0))]

    def ask(prompt):
        with httpx.Client(base_url=client.base_url, timeout=TIMEOUT) as c:
            return c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0}).json()

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(ask, prompts))
    assert [g["choices"][0]["text"] for g in got] == want
    wait_until(lambda: server.loop.in_flight == 0, what="no request in flight")
    assert engine.block_manager.all_free()


@pytest.mark.parametrize("route, body, status, words", [
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/completions", {"max_tokens": 4}, 400, "'prompt' is required"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1000}, 400, "more than this server allows (128)"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "positive integer"),
    ("/v1/completions", {"prompt": [7] * 100, "max_tokens": 4}, 400, "limit of 64 prompt tokens"),
    ("/v1/completions", {"prompt": [7] * 60, "max_tokens": 80}, 400, "maximum context length is 128"),
    ("/v1/completions", {"prompt": "hi", "temperature": 5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "n": 99}, 400, "'n'=99 must be in [1, 16]"),
    ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, 400, "'best_of'=2 must be >= 'n'=3"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2, "stream": True}, 400, "cannot be streamed"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "token ids"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "does not exist"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "'messages' is required"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 80}]}, 400,
     "limit of 64 prompt tokens"),
    ("/v1/embeddings", {"input": "x"}, 404, "no route"),
    # issue 36: a parameter the engine would ignore answers 400 naming it
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     400, "'response_format' must be an object with 'type' one of text, json_object, json_schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     400, "'response_format.json_schema' must be an object with a 'schema'"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "not": {"required": ["a"]}}}}},
     400, "'response_format' cannot be used: the output constraint cannot be enforced: Unimplemented keys: [\"not\"]"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "format": "weird"}}}}, 400, "Unknown format: weird"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 2, "response_format": {"type": "json_object"}},
     400, "'min_tokens' cannot be combined with 'response_format'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tool calls need a chat template that renders tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400,
     "'tool_choice' needs 'tools'"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
     400, "messages[0].tool_calls[0] must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "1"}]}]},
     400, "messages[0].tool_calls is not supported for role 'user'"),
    ("/v1/completions", {"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "'tools' is not supported: tool calls are a /v1/chat/completions feature"),
    ("/v1/completions", {"prompt": "hi", "suffix": "end"}, 400, "'suffix' is not supported"),
    ("/v1/completions", {"prompt": "hi", "tempreture": 0.5}, 400, "'tempreture' is not supported: unknown parameter"),
    ("/v1/completions", {"prompt": "hi", "min_p": 0.1}, 400, "'min_p' is not supported"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [1, "x"]}, 400, "'stop_token_ids' must be a list"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [99999]}, 400, "outside the vocabulary"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "best_of": 2}, 400,
     "/v1/completions field"),
])
def test_bad_requests_get_4xx_with_an_openai_error(setup, route, body, status, words):
    server, client, engine = setup
    if isinstance(body, bytes):
        r = client.post(route, content=body, headers={"Content-Type": "application/json"})
    else:
        r = client.post(route, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["type"], error
    wait_until(lambda: server.loop.in_flight == 0, what="refused requests are forgotten")


def test_neutral_values_of_unsupported_parameters_pass(setup):
    """`tools: []`, `tool_choice: "none"`, `response_format: {"type": "text"}`, nulls: they ask
    for nothing, so the request runs (and answers what it answers without them)."""
    _, client, _ = setup
    messages = [{"role": "user", "content": "Hello"}]
    plain = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "temperature": 0})
    r = client.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 4, "temperature": 0, "tools": [], "tool_choice": "none",
        "response_format": {"type": "text"}, "parallel_tool_calls": False, "user": "u1", "suffix": None})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


def test_chat_without_max_tokens_runs_to_the_context_limit_with_a_draft_model(model_path, tmp_path):
    """Issue 36: a chat request without max_tokens gets whatever the context leaves, so it runs to
    max_model_len; with a draft model verification must not look past it. Streamed and not,
    several at once (nearly full pool: 24 blocks of 8 for 3 x 48 tokens), the answers equal
    the engine's own without a draft model."""
    draft, _ = im.save_model(tmp_path / "draft", "llama", seed=0, num_hidden_layers=1)
    limit = 48
    plain = make_engine(model_path, max_model_len=limit, num_blocks=24)
    engine = make_engine(model_path, max_model_len=limit, num_blocks=24, draft_model=str(draft),
                         num_speculative_tokens=4)
    conversations = [[{"role": "user", "content": text}] for text in ("Hello world!", "What is the weather like?",
                                                                      "Paged attention")]
    want = []
    for messages in conversations:
        ids = plain.tokenizer(plain.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                  tokenize=False), add_special_tokens=False)["input_ids"]
        want.append(plain.generate(ids, SamplingParams(max_new_tokens=limit - len(ids), temperature=0,
                                                       ignore_eos=True))[0])
    with OpenAIServer(engine, port=0) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        results = [None] * 3

        def ask(i):
            body = {"messages": conversations[i], "temperature": 0, "ignore_eos": True, "stream": i == 1}
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                if i == 1:
                    results[i] = "".join(e["choices"][0]["delta"].get("content", "") for e in sse(r) if e["choices"])
                else:
                    r.read()
                    results[i] = r.json()["choices"][0]["message"]["content"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert results == [w.text for w in want]
        assert all(len(w.prompt_token_ids) + len(w.token_ids) == limit for w in want)
        assert engine.speculator.num_proposed > 0
        wait_until(lambda: server.loop.in_flight == 0, what="nothing in flight")
        assert engine.block_manager.all_free()


def test_oversized_body_and_wrong_method(setup):
    _, client, _ = setup
    r = client.post("/v1/completions", content=b" " * (2 << 20), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]
    r = client.delete("/v1/completions")
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]


def test_metrics_in_prometheus_format(setup):
    server, client, _ = setup
    before = parse_metrics(client.get("/metrics").text)
    client.post("/v1/completions", json={"prompt": "Hello world", "max_tokens": 5, "temperature": 0,
                                         "ignore_eos": True})
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = parse_metrics(r.text)
    assert m["phalanx_generation_tokens_total"] - before.get("phalanx_generation_tokens_total", 0) == 5
    assert m["phalanx_kv_blocks_total"] == 128 and m["phalanx_kv_blocks_used"] == 0  # all returned
    assert m["phalanx_requests_running"] == 0 and m["phalanx_requests_waiting"] == 0
    assert m["phalanx_queue_length"] == 0 and m["phalanx_queue_capacity"] == 64 + 256
    assert m["phalanx_generation_tokens_per_second"] > 0
    assert m['phalanx_requests_finished_total{finish_reason="length"}'] >= 1
    assert "phalanx_spec_decode_draft_tokens_total" not in m  # no speculation here (test_inference_ngram)
    buckets = [(k, v) for k, v in m.items() if k.startswith("phalanx_time_to_first_token_seconds_bucket")]
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and buckets[-1][0].endswith('le="+Inf"}')  # cumulative, +Inf last
    assert counts[-1] == m["phalanx_time_to_first_token_seconds_count"] >= 1
    assert m["phalanx_time_to_first_token_seconds_sum"] > 0


def test_api_key(model_path):
    engine = make_engine(model_path)
    with OpenAIServer(engine, port=0, api_key="sk-test") as server:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
            assert client.get("/health").status_code == 200  # probes need no key
            assert client.get("/metrics").status_code == 200
            assert client.get("/v1/models").status_code == 401
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                            headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = client.post("/v1/completions", content=b"{bad", headers={"Authorization": "Bearer nope"})
            assert r.status_code == 401  # the key is checked before the body
            ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                             headers={"Authorization": "Bearer sk-test"})
            assert ok.status_code == 200 and len(ok.json()["choices"]) == 1


def test_a_full_queue_answers_429_with_retry_after(model_path):
    """Capacity = max_num_seqs (2) + max_queue (1): with the engine held, three requests are in
    flight; the fourth is refused at once with 429 + Retry-After; the three then finish."""
    from concurrent.futures import ThreadPoolExecutor
    engine = make_engine(model_path, max_num_seqs=2)
    with OpenAIServer(engine, port=0, max_queue=1, retry_after_s=2) as server:
        body = {"prompt": "Hello world", "max_tokens": 4, "temperature": 0}

        def ask():
            return httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)

        with ThreadPoolExecutor(3) as pool:
            with server.loop.paused():
                futures = [pool.submit(ask) for _ in range(3)]
                wait_until(lambda: server.loop.in_flight == 3, what="3 requests in flight")
                t0 = time.monotonic()
                r = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)
                assert time.monotonic() - t0 < 5  # answered at once, not queued
                assert r.status_code == 429 and r.headers["retry-after"] == "2"
                assert r.json()["error"]["code"] == "queue_full" and "capacity of 3" in r.json()["error"]["message"]
                two = httpx.post(server.url + "/v1/completions", json={**body, "prompt": ["a", "b"]}, timeout=TIMEOUT)
                assert two.status_code == 429  # all or nothing
                assert not any(f.done() for f in futures)
            answers = [f.result() for f in futures]
        assert [a.status_code for a in answers] == [200] * 3
        assert len({a.json()["choices"][0]["text"] for a in answers}) == 1
        m = parse_metrics(httpx.get(server.url + "/metrics").text)
        assert m['phalanx_requests_rejected_total{reason="queue_full"}'] == 2
        wait_until(lambda: server.loop.in_flight == 0, what="all finished")


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_that_disconnects_frees_its_blocks(model_path, route):
    """A streaming client reads two chunks and hangs up; its request is aborted before it
    finished and the block manager's free-block count returns to where it started."""
    engine = make_engine(model_path)
    free_at_start = engine.block_manager.num_free_blocks
    body = {"max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
    if route == "/v1/completions":
        body["prompt"] = "Tensor parallel inference splits attention heads"
    else:
        body["messages"] = [{"role": "user", "content": "Tensor parallel inference"}]
    with OpenAIServer(engine, port=0) as server:
        client = httpx.Client(base_url=server.url, timeout=TIMEOUT)
        with client.stream("POST", route, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]  # "data: ...", "", "data: ..."
            assert got[0].startswith("data: ")
            with server.loop.paused():  # between two steps: the request is mid-way
                assert server.loop.in_flight == 1
                assert engine.block_manager.num_free_blocks < free_at_start  # it holds blocks
                r.close()
                client.close()
                wait_until(lambda: server.loop.num_pending_aborts == 1, what="the server noticed the hang-up")
        wait_until(lambda: engine.block_manager.num_free_blocks == free_at_start, what="its blocks are free")
        assert engine.block_manager.all_free() and server.loop.in_flight == 0
        m = parse_metrics(httpx.get(server.url + "/metrics").text)
        assert m["phalanx_requests_aborted_total"] == 1
        assert not any(k.startswith("phalanx_requests_finished_total{") for k in m)  # it did not finish


def test_a_client_that_leaves_a_non_streaming_request_frees_its_blocks(model_path):
    engine = make_engine(model_path)
    free_at_start = engine.block_manager.num_free_blocks
    with OpenAIServer(engine, port=0) as server:
        with server.loop.paused():
            with pytest.raises(httpx.ReadTimeout):  # gives up while the request is running
                httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 50,
                                                                 "ignore_eos": True}, timeout=1.0)
            wait_until(lambda: server.loop.num_pending_aborts == 1, what="the server noticed the hang-up")
        wait_until(lambda: server.loop.in_flight == 0, what="the request is aborted")
        assert engine.block_manager.num_free_blocks == free_at_start
        m = parse_metrics(httpx.get(server.url + "/metrics").text)
        assert m["phalanx_requests_aborted_total"] == 1


def test_phalanx_serve_command_help():
    out = subprocess.run([sys.executable, "-m", "phalanx.cli", "serve", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "--api-key" in out.stdout and "127.0.0.1" in out.stdout
    assert "--max-queue" in out.stdout and "--max-prompt-tokens" in out.stdout


class ServeCommand:
    """`phalanx serve ARGS` in a subprocess, with every wait bounded: `start` returns the URL it
    prints; `stop` sends SIGINT (Ctrl-C) and returns (exit status, seconds to exit, all output)."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PHALANX_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "phalanx.cli", "serve", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def start(self, timeout: float = 180.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                raise AssertionError("phalanx serve exited before serving:\n" + "".join(self.lines)[-3000:])
            self.lines.append(line)
            if " on http://" in line:
                return line.split(" on ")[1].split("/v1")[0]
        raise AssertionError(f"phalanx serve printed no URL within {timeout:.0f} s:\n" + "".join(self.lines)[-3000:])

    def stop(self, timeout: float = 60.0) -> tuple[int, float, str]:
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # torchrun's ranks too
            code = self.proc.wait(timeout=30)
        seconds = time.monotonic() - t0
        while (line := self._queue.get(timeout=10)) is not None:
            self.lines.append(line)
        return code, seconds, "".join(self.lines)


@pytest.mark.slow
def test_phalanx_serve_command_serves(tmp_path):
    """The real command in a subprocess: it prints its URL, answers, and stops on SIGINT."""
    path, _ = im.save_model(tmp_path / "m", "llama")
    server = ServeCommand(str(path), "--port", "0", "--kv-cache-gib", "0.01", "--max-queue", "8")
    try:
        url = server.start()
        assert url.startswith("http://127.0.0.1:")
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    finally:
        code, seconds, output = server.stop()
    assert code == 0 and "Traceback" not in output, f"{seconds:.1f} s\n" + output[-6000:]
    assert seconds < 20


def _checkpoint(step_dir, inner: dict[str, int], complete: bool = True):
    """A training checkpoint directory with a tiny model (seed per inner dir) in each of `inner`."""
    for name, seed in inner.items():
        im.save_model(step_dir / name, "llama", seed=seed)
    if complete:
        (step_dir / MANIFEST).write_text("{}")
    return step_dir


def test_serve_finds_the_model_in_a_checkpoint_or_output_dir(tmp_path):
    """`phalanx serve` takes an HF directory as it is; in a checkpoint `policy/` (the PPO export)
    before `model/`; in an output_dir the latest complete checkpoint, skipping an unfinished one."""
    plain, _ = im.save_model(tmp_path / "plain", "llama")
    assert model_dir(plain) == plain
    both = _checkpoint(tmp_path / "both", {"model": 1, "policy": 2})
    assert model_dir(both) == both / "policy"
    only_model = _checkpoint(tmp_path / "only_model", {"model": 1})
    assert model_dir(only_model) == only_model / "model"
    out = tmp_path / "out"
    _checkpoint(out / "checkpoints" / "step-00000002", {"model": 1, "policy": 2})
    _checkpoint(out / "checkpoints" / "step-00000010", {"model": 1})
    _checkpoint(out / "checkpoints" / "step-00000011", {"policy": 2}, complete=False)  # still being written
    assert model_dir(out) == out / "checkpoints" / "step-00000010" / "model"


def test_serve_names_what_it_looked_for_when_there_is_no_model(tmp_path, capsys):
    empty = tmp_path / "run"
    (empty / "checkpoints" / "step-00000005" / "optimizer").mkdir(parents=True)
    (empty / "checkpoints" / "step-00000005" / MANIFEST).write_text("{}")
    with pytest.raises(FileNotFoundError) as info:
        model_dir(empty)
    message = str(info.value)
    for looked in (empty / "config.json", empty / "policy" / "config.json", empty / "model" / "config.json",
                   empty / "checkpoints" / "step-00000005" / "policy" / "config.json",
                   empty / "checkpoints" / "step-00000005" / "model" / "config.json"):
        assert str(looked) in message
    assert "output_dir" in message and "checkpoint" in message
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(FileNotFoundError, match="complete checkpoint"):
        model_dir(bare)
    assert serve_main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "missing" in err and "is not a directory" in err and "Hugging Face model directory" in err
    assert serve_main([str(bare)]) == 2
    assert "no model in" in capsys.readouterr().err


@pytest.mark.slow
def test_phalanx_serve_an_output_dir_serves_its_latest_policy(tmp_path):
    """The real command on a training output_dir: it says which model it serves (the latest
    checkpoint's policy/, not its model/), names it after the output_dir, and answers as that
    model's engine does."""
    out = tmp_path / "ppo-run"
    _checkpoint(out / "checkpoints" / "step-00000001", {"policy": 1})
    latest = _checkpoint(out / "checkpoints" / "step-00000004", {"model": 1, "policy": 2})
    prompt = "Serve the trained policy"
    want = make_engine(latest / "policy").generate([prompt], SamplingParams(max_new_tokens=6, temperature=0))[0]
    server = ServeCommand(str(out), "--port", "0", "--kv-cache-gib", "0.01", "--max-queue", "8", "--dtype", "float32")
    try:
        url = server.start()
        models = httpx.get(url + "/v1/models", timeout=TIMEOUT).json()
        r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0},
                       timeout=TIMEOUT)
    finally:
        code, _, output = server.stop()
    assert code == 0 and "Traceback" not in output, output[-6000:]
    assert f"serving the model in {latest / 'policy'}" in output
    assert models["data"][0]["id"] == "ppo-run"
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text


def test_phalanx_serve_tp2_answers_like_the_tp1_engine_and_stops_cleanly(tmp_path):
    """`phalanx serve --tp-size 2` starts torchrun with 2 ranks (rank 0 serves, rank 1 runs its
    shard); greedy completions equal the one-process engine's tokens; Ctrl-C stops every rank
    without a traceback, well before torchrun's 30 s kill deadline."""
    from phalanx.inference.openai_protocol import completion_logprobs

    path, _ = im.save_model(tmp_path / "m", "llama")
    prompts = ["Tensor parallel inference splits", im.mixed_prompts(1, seed=5, low=20, high=21)[0]]
    engine = LLM(str(path), num_blocks=64, block_size=8, max_model_len=128, dtype="float32")
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    want = engine.generate(prompts, params)
    server = ServeCommand(str(path), "--tp-size", "2", "--port", "0", "--kv-cache-gib", "0.01",
                          "--max-model-len", "128", "--block-size", "8", "--dtype", "float32")
    try:
        url = server.start()
        assert url.startswith("http://127.0.0.1:")
        r = httpx.post(url + "/v1/completions", json={"prompt": prompts, "max_tokens": 12, "temperature": 0,
                                                      "ignore_eos": True, "logprobs": 1}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
    finally:
        code, seconds, output = server.stop()
    assert "Sending process" in output and output.count("closing signal SIGINT") == 2  # torchrun ran 2 ranks
    assert len(choices) == len(want)
    for choice, ref in zip(choices, want, strict=True):
        assert choice["logprobs"]["tokens"] == completion_logprobs(ref, engine.tokenizer)["tokens"]
        assert choice["text"] == ref.text and len(ref.token_ids) == 12
    assert code == 128 + signal.SIGINT and "Traceback" not in output, output[-3000:]
    assert seconds < 20


@pytest.mark.slow  # torchrun + 2 ranks + the merged model's reference: ~30-60 s on 2 busy cores
def test_phalanx_serve_tp2_serves_a_lora_adapter_by_name(tmp_path):
    """`phalanx serve --tp-size 2 --lora sql=DIR`: both ranks load their part of the adapter at
    start; through the official `openai` client a request whose `model` is "sql" gets the merged
    model's (peft's merge_and_unload) greedy tokens, one naming the base model the base model's;
    Ctrl-C stops every rank without a traceback."""
    import openai
    pytest.importorskip("peft")
    from transformers import AutoTokenizer

    path, base = im.save_model(tmp_path / "m", "llama")
    merged = im.make_adapter(tmp_path / "sql", 3, r=4, lora_alpha=8,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
    prompt = "Tensor parallel adapters split"
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    ids = tokenizer(prompt)["input_ids"]
    want = {"sql": im.hf_greedy(merged, ids, 10), "m": im.hf_greedy(base.eval(), ids, 10)}
    assert want["sql"] != want["m"]
    server = ServeCommand(str(path), "--tp-size", "2", "--port", "0", "--kv-cache-gib", "0.01",
                          "--max-model-len", "128", "--block-size", "8", "--dtype", "float32",
                          "--lora", f"sql={tmp_path / 'sql'}", "--max-lora-rank", "8")
    got = {}
    try:
        url = server.start()
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        models = [m.id for m in client.models.list().data]
        for model in ("sql", "m"):
            r = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
            got[model] = (r.model, r.choices[0].text, r.usage.completion_tokens)
    finally:
        code, seconds, output = server.stop()
    assert models == ["m", "sql"], models
    for model in ("sql", "m"):
        assert got[model] == (model, tokenizer.decode(want[model]), 10), (model, got[model])
    assert output.count("closing signal SIGINT") == 2  # torchrun ran 2 ranks and passed Ctrl-C on
    assert code == 128 + signal.SIGINT and "Traceback" not in output, output[-3000:]
    assert seconds < 20
