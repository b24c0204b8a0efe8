"""The server as real clients see it: the official `openai` Python client (a dev-only dependency)
against `OpenAIServer` on 127.0.0.1 with a tiny random Llama. Greedy answers are checked against
the engine's own `LLM.generate` for the same prompt; the load test runs 64 concurrent streaming
clients and checks every stream is whole and correct."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
import torch

import inference_models as im
from phalanx.inference import LLM, OpenAIServer, SamplingParams
from serving_helpers import direct, parse_metrics, wait_until

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path, _ = im.save_model(tmp_path_factory.mktemp("served") / "tiny-llama", "llama")
    return path


@pytest.fixture(scope="module")
def server(model_path):
    engine = LLM(str(model_path), num_blocks=512, block_size=8, max_model_len=128, max_num_seqs=64,
                 dtype="float32")
    with OpenAIServer(engine, port=0, api_key="sk-local", max_queue=16) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="sk-local", max_retries=0, timeout=60) as c:
        yield c


def chat_ids(engine, messages) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]


def test_completion_greedy_equals_the_engine(server, client):
    prompt = "Continuous batching admits new requests"
    r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0)
    want = direct(server, prompt, SamplingParams(max_new_tokens=12, temperature=0))[0]
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == want.finish_reason
    assert r.usage.completion_tokens == len(want.token_ids) and r.usage.prompt_tokens == len(want.prompt_token_ids)


def test_chat_greedy_equals_the_engine(server, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather like?"}]
    r = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=10, temperature=0)
    want = direct(server, chat_ids(server.engine, messages), SamplingParams(max_new_tokens=10, temperature=0))[0]
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)


def test_streaming_completion_and_chat(server, client):
    prompt = "Speculative decoding lets a small draft"
    want = direct(server, prompt, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))[0]
    chunks = list(client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=16, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 2
    assert "".join(c.choices[0].text for c in text_chunks) == want.text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 16

    messages = [{"role": "user", "content": "Hello world! How are you today?"}]
    want = direct(server, chat_ids(server.engine, messages), SamplingParams(max_new_tokens=12, temperature=0))[0]
    stream = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=12, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_n_choices(server, client):
    from phalanx.inference.openai_protocol import supported_sampling_fields
    if "n" not in supported_sampling_fields():
        with pytest.raises(openai.BadRequestError, match="not supported"):
            client.completions.create(model="tiny-llama", prompt="Paged attention", max_tokens=5, n=3)
        return
    r = client.completions.create(model="tiny-llama", prompt="Paged attention", max_tokens=5, n=3, seed=3,
                                  temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    want = direct(server, "Paged attention", SamplingParams(max_new_tokens=5, temperature=1.0, seed=3, n=3))[0]
    assert [c.text for c in r.choices] == [c.text for c in want.outputs]


def test_stop_token_ids_over_http(server, client):
    """vLLM's extra parameter `stop_token_ids` (extra_body for the openai client) ends the output
    at that token: finish_reason "stop", stop_reason the id, the text of the tokens before it."""
    prompt = "Continuous batching admits new requests"
    free = direct(server, prompt, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))[0]
    stop = free.token_ids[5]
    cut = free.token_ids.index(stop)  # its first occurrence
    want = direct(server, prompt, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True,
                                                 stop_token_ids=[stop]))[0]
    assert want.token_ids == free.token_ids[:cut + 1] and want.finish_reason == "stop"
    r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [stop]})
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop and r.usage.completion_tokens == cut + 1
    with pytest.raises(openai.BadRequestError, match="'min_p' is not supported"):
        client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"min_p": 0.1})


def test_health_and_metrics_parse(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics").text
    m = parse_metrics(text)
    for name in ("phalanx_queue_length", "phalanx_requests_running", "phalanx_requests_waiting",
                 "phalanx_kv_blocks_used", "phalanx_kv_blocks_total", "phalanx_generation_tokens_per_second",
                 "phalanx_time_to_first_token_seconds_count"):
        assert name in m, name
    assert m["phalanx_kv_blocks_total"] == 512


def test_errors_reach_the_client_as_openai_exceptions(server, client):
    with pytest.raises(openai.BadRequestError, match="more than this server allows"):
        client.completions.create(model="tiny-llama", prompt="hi", max_tokens=1000)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 128"):
        client.completions.create(model="tiny-llama", prompt=[7] * 100, max_tokens=100)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi")
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_a_full_queue_is_a_rate_limit_error(server, client):
    """Capacity 64 running + 16 queued: with the engine held and 80 requests in flight, the
    client gets RateLimitError (429); its retry_after comes from the header."""
    async def scenario():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-local", max_retries=0,
                                      timeout=60) as aclient:
            with server.loop.paused():
                tasks = [asyncio.ensure_future(aclient.completions.create(model="tiny-llama", prompt="Hello",
                                                                          max_tokens=2, temperature=0))
                         for _ in range(80)]
                deadline = time.monotonic() + 30
                while server.loop.in_flight < 80 and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                assert server.loop.in_flight == 80
                with pytest.raises(openai.RateLimitError) as err:
                    await aclient.completions.create(model="tiny-llama", prompt="Hello", max_tokens=2)
                assert err.value.response.headers["retry-after"] == "1"
            return await asyncio.gather(*tasks)

    answers = asyncio.run(scenario())
    assert len(answers) == 80 and all(a.choices[0].finish_reason in ("stop", "length") for a in answers)


def test_64_concurrent_streaming_clients(server):
    """64 clients stream at once (asyncio, one connection each); every stream is well-formed:
    chunks in order, one finish_reason at the end, text equal to the engine's greedy answer for
    its prompt, usage matching. Bounded: the whole run must finish within 120 s."""
    prompts = [im.CORPUS[i % 7][: 20 + 3 * i] for i in range(64)]
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    want = direct(server, prompts, params)

    async def one(aclient, prompt):
        stream = await aclient.completions.create(model="tiny-llama", prompt=prompt, max_tokens=16, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True},
                                                  stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        return chunks

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-local", max_retries=0,
                                      timeout=120) as aclient:
            return await asyncio.wait_for(asyncio.gather(*(one(aclient, p) for p in prompts)), timeout=120)

    t0 = time.monotonic()
    results = asyncio.run(run())
    seconds = time.monotonic() - t0
    assert len(results) == 64
    for chunks, ref in zip(results, want, strict=True):
        text_chunks = [c for c in chunks if c.choices]
        finishes = [c.choices[0].finish_reason for c in text_chunks]
        assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
        assert "".join(c.choices[0].text for c in text_chunks) == ref.text
        assert len({c.id for c in chunks}) == 1  # one response id per stream
        assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    wait_until(lambda: server.loop.in_flight == 0, what="nothing in flight")
    assert server.engine.block_manager.all_free()
    print(f"64 streaming clients x 16 tokens: {seconds:.1f} s")
