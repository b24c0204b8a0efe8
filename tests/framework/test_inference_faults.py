"""Fault isolation (issue 36): an exception in an engine step fails only the request whose own
step fails; the others finish with exactly the tokens of a run without the fault, every KV block
comes back, and the server goes on serving (the official `openai` client sees a 500 / an SSE
error event naming the cause, `/health` stays 200, a metric counts the failure)."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch

import inference_models as im
from phalanx.inference import LLM, OpenAIServer, SamplingParams
from phalanx.inference.engine_loop import EngineLoop, RequestFailed
from serving_helpers import direct, parse_metrics, wait_until

torch.set_num_threads(1)
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


class Fault:
    """Make `runner.execute` raise whenever a chunk of the victim runs (the sequence whose prompt
    is `victim`, once it has `after` output tokens): a fault that follows one request, as a bad
    input or a kernel bug on one shape would."""

    def __init__(self, engine, runner, victim: list[int], after: int = 3) -> None:
        self.engine, self.victim, self.after = engine, victim, after
        self.real = runner.execute
        self.raised = 0
        runner.execute = self

    def __call__(self, chunks):
        seqs = [s for s in (*self.engine.scheduler.running, *self.engine.scheduler.waiting)
                if s.prompt_token_ids == self.victim and s.num_output_tokens >= self.after]
        if any(c.block_table is s.block_table for c in chunks for s in seqs):
            self.raised += 1
            raise RuntimeError("injected fault in the model runner")
        return self.real(chunks)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path, _ = im.save_model(tmp_path_factory.mktemp("faults") / "tiny-llama", "llama")
    return path


def engine(path, **kw):
    kw.setdefault("dtype", "float32")  # the HF references are fp32 (dtype="auto" is bf16 on AMX)
    kw.setdefault("num_blocks", 128)
    kw.setdefault("block_size", 8)
    return LLM(str(path), **kw)


def run_steps(eng, prompts, params) -> dict[str, object]:
    """add every prompt, step until done; request id -> its final output."""
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return {i: done[i] for i in ids}


def test_a_failing_request_is_isolated_and_the_others_keep_their_tokens(model_path):
    """Five requests share steps; the model runner fails whenever the victim runs. The step fails,
    is rolled back, its sequences run alone until the victim's own step fails: it alone ends with
    finish_reason 'error' naming the cause; the others equal a run without the fault."""
    prompts = im.mixed_prompts(5, seed=3, low=6, high=30)
    params = [GREEDY] * 5
    want = [o.token_ids for o in engine(model_path).generate(prompts, GREEDY)]
    eng = engine(model_path)
    fault = Fault(eng, eng.runner, prompts[2])
    outs = list(run_steps(eng, prompts, params).values())
    assert fault.raised == 2  # the shared step, then the victim's step alone
    assert outs[2].finish_reason == "error" and "injected fault in the model runner" in outs[2].error
    assert len(outs[2].token_ids) == 3  # what it had before the fault
    for i in (0, 1, 3, 4):
        assert outs[i].error is None and outs[i].token_ids == want[i]
    assert eng.block_manager.all_free()
    # the prefixes the failed step published were forgotten: the engine still answers right
    assert [o.token_ids for o in eng.generate(prompts[:2], GREEDY)] == want[:2]


def test_seeded_sampling_survives_a_fault_after_the_draws(model_path):
    """A fault raised after the sampler drew (its generators advanced): the survivors' generators
    are restored, so their seeded samples equal a run without the fault."""
    prompts = im.mixed_prompts(4, seed=4, low=6, high=20)
    params = [SamplingParams(max_new_tokens=10, temperature=1.0, seed=10 + i, ignore_eos=True) for i in range(4)]
    want = [o.token_ids for o in engine(model_path).generate(prompts, params)]
    eng = engine(model_path)
    real = eng.sampler

    def sampler(logits, rows):
        out = real(logits, rows)
        victim = [s for s in eng.scheduler.running if s.prompt_token_ids == prompts[1] and s.num_output_tokens >= 4]
        if victim and any(r.generator is victim[0].generator for r in rows):
            raise RuntimeError("injected fault after sampling")
        return out

    eng.sampler = sampler
    outs = list(run_steps(eng, prompts, params).values())
    assert outs[1].finish_reason == "error" and "after sampling" in outs[1].error
    assert [outs[i].token_ids for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]
    assert eng.block_manager.all_free()


def test_a_fault_in_a_speculative_step_is_isolated(model_path, tmp_path):
    draft, _ = im.save_model(tmp_path / "draft", "llama", seed=0, num_hidden_layers=1)
    prompts = im.mixed_prompts(4, seed=5, low=6, high=20)
    want = [o.token_ids for o in engine(model_path).generate(prompts, GREEDY)]
    eng = engine(model_path, draft_model=str(draft), num_speculative_tokens=3)
    fault = Fault(eng, eng.runner, prompts[0], after=4)
    outs = list(run_steps(eng, prompts, [GREEDY] * 4).values())
    assert fault.raised == 2 and eng.speculator.num_proposed > 0
    assert outs[0].finish_reason == "error"
    assert [o.token_ids for o in outs[1:]] == want[1:]
    assert eng.block_manager.all_free()


def test_generate_frees_the_blocks_of_every_request_when_one_fails(model_path):
    prompts = im.mixed_prompts(4, seed=6, low=6, high=30)
    eng = engine(model_path)
    want = [o.token_ids for o in eng.generate(prompts, GREEDY)]
    fault = Fault(eng, eng.runner, prompts[3])
    with pytest.raises(RuntimeError, match="injected fault in the model runner"):
        eng.generate(prompts, GREEDY)
    assert eng.block_manager.all_free() and not eng.has_unfinished_requests() and not eng._seqs
    eng.runner.execute = fault.real
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == want
    # a step that raises outside the isolation (here: the scheduler) aborts and re-raises too
    real = eng.scheduler.schedule
    calls = []

    def schedule():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected scheduler fault")
        return real()

    eng.scheduler.schedule = schedule
    with pytest.raises(RuntimeError, match="injected scheduler fault"):
        eng.generate(prompts, GREEDY)
    assert eng.block_manager.all_free() and not eng._seqs


def test_the_engine_loop_survives_a_step_that_raises(model_path):
    """An exception out of `step` itself (not isolated by the engine) fails the requests then in
    flight with the cause, frees their blocks, and the loop serves the next request."""
    eng = engine(model_path)
    prompt = im.mixed_prompts(1, seed=8)[0]
    want = eng.generate(prompt, GREEDY)[0].token_ids
    loop = EngineLoop(eng).start()
    try:
        real, calls = eng.step, []

        def step():
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected step fault")
            return real()

        eng.step = step
        streams = [loop.submit(p, GREEDY) for p in im.mixed_prompts(3, seed=7)]
        for stream in streams:
            with pytest.raises(RequestFailed, match="injected step fault"):
                stream.result_blocking()
        wait_until(lambda: loop.in_flight == 0, what="nothing in flight")
        assert eng.block_manager.all_free() and loop.error is None
        assert loop.submit(prompt, GREEDY).result_blocking().token_ids == want
    finally:
        loop.shutdown()


@pytest.fixture(scope="module")
def server(model_path):
    eng = LLM(str(model_path), num_blocks=512, block_size=8, max_model_len=128, max_num_seqs=64,
              dtype="float32")
    with OpenAIServer(eng, port=0, max_queue=16) as srv:
        yield srv


def test_one_failing_stream_among_16_through_the_openai_client(server):
    """17 clients stream at once; the model runner fails whenever the victim's sequence runs (from
    its 3rd token). The victim's client gets an error event naming the cause (the client raises
    APIError); the 16 others stream exactly the text of a run without the fault; every block comes
    back; /health stays 200; the failure is counted; a non-streaming victim gets a 500."""
    engine_ = server.engine
    prompts = [im.CORPUS[i % 7][: 20 + 3 * i] for i in range(17)]
    want = direct(server, prompts, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
    start_free = engine_.block_manager.num_free_blocks
    with server.loop.paused():
        fault = Fault(engine_, engine_.runner, engine_.tokenize(prompts[5]))

    async def one(client, prompt):
        stream = await client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts), return_exceptions=True)

    try:
        results = asyncio.run(run())
        assert fault.raised >= 2
        assert isinstance(results[5], openai.APIError) and "injected fault in the model runner" in str(results[5])
        assert [r for i, r in enumerate(results) if i != 5] == [w.text for i, w in enumerate(want) if i != 5]
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
        with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60) as client:
            with pytest.raises(openai.InternalServerError, match="injected fault in the model runner"):
                client.completions.create(model="tiny-llama", prompt=prompts[5], max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True})
            again = client.completions.create(model="tiny-llama", prompt=prompts[0], max_tokens=16, temperature=0,
                                              extra_body={"ignore_eos": True})
            assert again.choices[0].text == want[0].text
    finally:
        with server.loop.paused():
            engine_.runner.execute = fault.real
    wait_until(lambda: server.loop.in_flight == 0, what="nothing in flight")
    assert engine_.block_manager.num_free_blocks == start_free and engine_.block_manager.all_free()
    metrics = parse_metrics(httpx.get(server.url + "/metrics").text)
    assert metrics["phalanx_requests_failed_total"] == 2
