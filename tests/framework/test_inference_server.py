"""The OpenAI-compatible server, over real HTTP on 127.0.0.1 with httpx: completions, chat with
the model's template, server-sent-event streaming, models/health, API keys, and 4xx answers to
bad requests."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

import inference_models as im
from phalanx.inference import LLM, OpenAIServer, SamplingParams

TIMEOUT = httpx.Timeout(60.0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path, _ = im.save_model(tmp_path_factory.mktemp("served") / "tiny-llama", "llama")
    engine = LLM(str(path), num_blocks=128, block_size=8, max_model_len=128)
    with OpenAIServer(engine, port=0) as server:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
            yield server, client, engine


def sse(response) -> list:
    events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_health_and_models(setup):
    server, client, _ = setup
    assert server.url.startswith("http://127.0.0.1:")
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-llama"
    assert models["data"][0]["max_model_len"] == 128


def test_completion_matches_the_engine(setup):
    _, client, engine = setup
    prompt = "Continuous batching admits"
    r = client.post("/v1/completions", json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 10,
                                             "temperature": 0, "logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    direct = engine.generate(prompt, SamplingParams(max_new_tokens=10, temperature=0))[0]
    assert choice["text"] == direct.text and choice["finish_reason"] == direct.finish_reason
    assert body["usage"]["completion_tokens"] == len(direct.token_ids)
    assert body["usage"]["prompt_tokens"] == len(direct.prompt_token_ids)
    assert len(choice["logprobs"]["token_logprobs"]) == len(direct.token_ids)
    assert all(len(t) == 2 for t in choice["logprobs"]["top_logprobs"])
    batch = client.post("/v1/completions", json={"prompt": [prompt, [5, 6, 7]], "max_tokens": 4, "temperature": 0})
    assert [c["index"] for c in batch.json()["choices"]] == [0, 1]
    assert batch.json()["choices"][0]["text"] == engine.generate(prompt, SamplingParams(max_new_tokens=4, temperature=0))[0].text


def test_chat_completion_applies_the_chat_template(setup):
    _, client, engine = setup
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = engine.tokenizer(ids, add_special_tokens=False)["input_ids"]
    assert ids[-3:] == engine.tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"][-3:]
    direct = engine.generate(ids, SamplingParams(max_new_tokens=8, temperature=0))[0]
    assert choice["message"] == {"role": "assistant", "content": direct.text}
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_streaming_completion_and_chat(setup):
    _, client, engine = setup
    prompt = "Speculative decoding lets"
    direct = engine.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))[0]
    with client.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                         "ignore_eos": True, "stream": True,
                                                         "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = sse(r)
    text_chunks = [c for c in chunks if c["choices"]]
    assert len(text_chunks) > 2  # it really streamed
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == direct.text
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    messages = [{"role": "user", "content": "How are you today?"}]
    with client.stream("POST", "/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0,
                                                              "stream": True}) as r:
        chunks = sse(r)
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    whole = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0}).json()
    assert streamed == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_concurrent_clients_share_batches_and_get_their_own_answers(setup):
    from concurrent.futures import ThreadPoolExecutor
    _, client, engine = setup
    prompts = [im.mixed_prompts(1, seed=30 + i, low=3, high=30)[0] for i in range(6)]
    want = [o.text for o in engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0))]

    def ask(prompt):
        with httpx.Client(base_url=client.base_url, timeout=TIMEOUT) as c:
            return c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0}).json()

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(ask, prompts))
    assert [g["choices"][0]["text"] for g in got] == want
    assert engine.block_manager.all_free()


@pytest.mark.parametrize("route, body, status, words", [
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/completions", {"max_tokens": 4}, 400, "'prompt' is required"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1000}, 400, "more than this server allows"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "positive integer"),
    ("/v1/completions", {"prompt": [7] * 120, "max_tokens": 20}, 400, "maximum context length is 128"),
    ("/v1/completions", {"prompt": "hi", "temperature": 5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n=1"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "does not exist"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "'messages' is required"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/embeddings", {"input": "x"}, 404, "no route"),
])
def test_bad_requests_get_4xx_with_an_openai_error(setup, route, body, status, words):
    _, client, _ = setup
    if isinstance(body, bytes):
        r = client.post(route, content=body, headers={"Content-Type": "application/json"})
    else:
        r = client.post(route, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["type"]


def test_oversized_body_is_refused(setup):
    _, client, _ = setup
    r = client.post("/v1/completions", content=b" " * (2 << 20), headers={"Content-Type": "application/json"})
    assert r.status_code == 413


def test_api_key(setup):
    _, _, engine = setup
    with OpenAIServer(engine, port=0, api_key="sk-test") as server:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
            assert client.get("/health").status_code == 200  # probes need no key
            assert client.get("/v1/models").status_code == 401
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                            headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                             headers={"Authorization": "Bearer sk-test"})
            assert ok.status_code == 200 and len(ok.json()["choices"]) == 1


def test_phalanx_serve_command_help():
    out = subprocess.run([sys.executable, "-m", "phalanx.cli", "serve", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "--api-key" in out.stdout and "127.0.0.1" in out.stdout


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
    server = ServeCommand(str(path), "--port", "0", "--kv-cache-gib", "0.01")
    try:
        url = server.start()
        assert url.startswith("http://127.0.0.1:")
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    finally:
        code, _, output = server.stop()
    assert code == 0 and "Traceback" not in output, output[-3000:]


def test_phalanx_serve_tp2_answers_like_the_tp1_engine_and_stops_cleanly(tmp_path):
    """`phalanx serve --tp-size 2` starts torchrun with 2 ranks (rank 0 serves, rank 1 runs its
    shard); greedy completions equal the one-process engine's tokens; Ctrl-C stops every rank
    without a traceback, well before torchrun's 30 s kill deadline."""
    from phalanx.inference.openai_protocol import completion_logprobs

    path, _ = im.save_model(tmp_path / "m", "llama")
    prompts = ["Tensor parallel inference splits", im.mixed_prompts(1, seed=5, low=20, high=21)[0]]
    engine = LLM(str(path), num_blocks=64, block_size=8, max_model_len=128)
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    want = engine.generate(prompts, params)
    server = ServeCommand(str(path), "--tp-size", "2", "--port", "0", "--kv-cache-gib", "0.01",
                          "--max-model-len", "128", "--block-size", "8")
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
    for choice, direct in zip(choices, want, strict=True):
        assert choice["logprobs"]["tokens"] == completion_logprobs(direct, engine.tokenizer)["tokens"]
        assert choice["text"] == direct.text and len(direct.token_ids) == 12
    assert code == 128 + signal.SIGINT and "Traceback" not in output, output[-3000:]
    assert seconds < 20
