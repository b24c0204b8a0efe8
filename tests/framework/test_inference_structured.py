"""Structured output (issue 36): `response_format` json_object / json_schema through llguidance,
enforced per request in the batch by the sampler's mask. Engine-level checks (mixed batches,
n > 1, a rolled-back step, speculative decoding) and the official `openai` client against a
tiny server: 100 concurrent schema-constrained requests all parse and validate; tool calls
(`tools`, `tool_choice`) against a tiny model with a Qwen2.5-style chat template, a forced call
round-tripping with its tool result.

Run as a script, it measures the mask's cost per token (`mask_overhead`, below)."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
import torch

import inference_models as im
from phalanx.inference import LLM, OpenAIServer, SamplingParams
from phalanx.inference.sampler import RowContext, Sampler
from phalanx.inference.sampling_params import StructuredOutput
from serving_helpers import direct, wait_until

torch.set_num_threads(1)

# Bounded (short strings, bounded integers, enums) so that even a random model finishes it.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "member", "color", "tags"],
    "additionalProperties": False,
}
CONSTRAINED = StructuredOutput(json_schema=SCHEMA)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path, _ = im.save_model(tmp_path_factory.mktemp("structured") / "tiny-llama", "llama")
    return path


def engine(path, **kw):
    kw.setdefault("dtype", "float32")  # the HF references are fp32 (dtype="auto" is bf16 on AMX)
    kw.setdefault("num_blocks", 256)
    kw.setdefault("block_size", 8)
    kw.setdefault("max_model_len", 160)
    return LLM(str(path), **kw)


def valid(text: str) -> dict:
    doc = json.loads(text)
    jsonschema.validate(doc, SCHEMA)
    return doc


def constrained(**kw) -> SamplingParams:
    kw.setdefault("max_new_tokens", 100)
    kw.setdefault("temperature", 0)
    return SamplingParams(structured_output=CONSTRAINED, **kw)


def test_the_sampler_masks_only_the_constrained_rows(model_path):
    """Two rows of the same logits, one with a JSON-object grammar: that row picks among the
    grammar's first tokens ('{' only); the other picks its argmax, as without the grammar."""
    eng = engine(model_path)
    grammar = eng.grammar_compiler().matcher(StructuredOutput(json_object=True))
    tok = eng.tokenizer
    logits = torch.randn(2, eng.spec.vocab_size, generator=torch.Generator().manual_seed(0))
    brace = tok.convert_tokens_to_ids("{")
    logits[:, brace] = -5.0  # far from the argmax
    greedy = SamplingParams(temperature=0)
    out = Sampler()(logits, [RowContext(greedy, grammar=grammar), RowContext(greedy)])
    assert tok.decode([out.token_ids[0]]).startswith("{")
    assert out.token_ids[1] == int(logits[1].argmax())
    assert not grammar.accepting  # computing the mask did not advance the grammar


def test_constrained_and_unconstrained_requests_in_one_batch(model_path):
    """Greedy and seeded constrained requests parse and validate; the unconstrained requests of
    the same batch (greedy and seeded) equal a run without the constrained ones; n > 1 forks
    get a grammar each."""
    eng = engine(model_path)
    prompts = im.mixed_prompts(8, seed=1, low=4, high=20)
    free = [SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True),
            SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, ignore_eos=True)]
    alone = eng.generate(prompts[:2], free)
    params = free + [constrained(), constrained(temperature=1.0, seed=7), constrained(temperature=0.8, top_p=0.9,
                                                                                         seed=8, n=3)]
    params += [constrained(temperature=1.0, seed=20 + i) for i in range(3)]
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in alone]
    texts = [c.text for o in outs[2:] for c in o.outputs]
    assert len(texts) == 8
    for o in outs[2:]:
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text
            valid(c.text)
    assert eng.block_manager.all_free()


def test_json_object_and_regex(model_path):
    """JSON mode gives a JSON object (logit_bias on '"' and '}' keeps the random model's strings
    short); a regex constraint is matched in full."""
    eng = engine(model_path)
    tok = eng.tokenizer
    bias = {tok.convert_tokens_to_ids(t): 30.0 for t in ('"', "}")}
    out = eng.generate("Answer in JSON:", SamplingParams(max_new_tokens=60, temperature=0, logit_bias=bias,
                                                         structured_output={"json_object": True}))[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)
    out = eng.generate("Pick:", SamplingParams(max_new_tokens=20, temperature=1.0, seed=3,
                                               structured_output=StructuredOutput(regex=r"(yes|no)-[0-9]{2}")))[0]
    import re
    assert re.fullmatch(r"(yes|no)-[0-9]{2}", out.text), out.text


def test_a_rolled_back_step_leaves_the_grammars_as_they_were(model_path):
    """A fault after the sampler drew (masks computed, tokens chosen, nothing appended) fails
    only its request; the constrained requests of that step retry from the same grammar state
    and finish exactly as in a run without the fault."""
    prompts = im.mixed_prompts(4, seed=4, low=6, high=20)
    params = [constrained(temperature=1.0, seed=30 + i) for i in range(3)]
    params.append(SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))
    want = [o.token_ids for o in engine(model_path).generate(prompts, params)]
    eng = engine(model_path)
    real, raised = eng.sampler, []

    def sampler(logits, rows):
        out = real(logits, rows)
        victim = [s for s in eng.scheduler.running if s.prompt_token_ids == prompts[3] and s.num_output_tokens >= 5]
        if victim and any(r.params is victim[0].params for r in rows):
            raised.append(len(rows))
            raise RuntimeError("injected fault after sampling")
        return out

    eng.sampler = sampler
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    outs = [done[i] for i in ids]
    assert raised and raised[0] == 4  # the shared step failed first
    assert outs[3].finish_reason == "error"
    assert [o.token_ids for o in outs[:3]] == want[:3]
    for o in outs[:3]:
        valid(o.text)
    assert eng.block_manager.all_free()


def speculating(eng):
    """Spy on the engine's speculator: a list that gets, per speculative step, {request id:
    (tokens drafted, tokens emitted)}."""
    spec, record = eng.speculator, []
    propose, step = spec.proposer.propose, spec.step
    drafted = {}

    def spy_propose(seqs, *args):
        drafts, probs = propose(seqs, *args)
        drafted.update({id(s): len(d) for s, d in zip(seqs, drafts, strict=True)})
        return drafts, probs

    def spy_step(seqs, *args):
        out = step(seqs, *args)
        record.append({s.request_id: (drafted[id(s)], len(e)) for s, e in zip(seqs, out, strict=True)})
        return out

    spec.proposer.propose, spec.step = spy_propose, spy_step
    return record


@pytest.mark.parametrize("draft_kind", ["same", "small", "ngram"])
def test_constrained_requests_speculate_with_their_greedy_tokens(model_path, tmp_path, draft_kind):
    """With a draft model, constrained requests draft too (the draft's proposals drawn under the
    grammar's mask, each verified position masked with its own state, the grammar rolled back
    and advanced over what was accepted): greedy constrained and unconstrained requests give the
    tokens of the engine without a draft; sampled constrained ones validate. With the target
    itself as the draft nearly every proposal is accepted, several tokens per step; a 1-layer
    random draft is rejected often, which exercises the rollback; n-gram lookup proposes tokens the
    grammar may refuse (only the accepted prefix is proposed)."""
    prompts = im.mixed_prompts(7, seed=6, low=6, high=20)
    params = [constrained(), constrained(), constrained(n=2, best_of=2, temperature=0),
              constrained(temperature=1.0, seed=3), SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True),
              constrained(temperature=0.7, top_p=0.9, seed=4),
              # penalties change the draft's fp32 logits too (an inference tensor: copied first)
              SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                             logit_bias={5: 2.0}, frequency_penalty=0.5)]
    want = engine(model_path).generate(prompts, params)
    if draft_kind == "ngram":
        eng = engine(model_path, prompt_lookup_max=3, num_speculative_tokens=3)
    else:
        draft = model_path if draft_kind == "same" else im.save_model(tmp_path / "draft", "llama", seed=0,
                                                                      num_hidden_layers=1)[0]
        eng = engine(model_path, draft_model=str(draft), num_speculative_tokens=3)
    record = speculating(eng)
    outs = eng.generate(prompts, params)
    greedy = [0, 1, 2, 4, 6]
    assert [[c.token_ids for c in outs[i].outputs] for i in greedy] == [[c.token_ids for c in want[i].outputs]
                                                                        for i in greedy]
    for i in (0, 1, 2, 3, 5):
        for c in outs[i].outputs:
            assert c.finish_reason == "stop", c.text
            valid(c.text)
    # the constrained requests speculated: drafts proposed for them, and (same draft) accepted
    constrained_ids = {outs[i].request_id for i in (0, 1, 2, 3, 5)}
    steps = [(d, e) for step in record for rid, (d, e) in step.items() if rid in constrained_ids]
    assert sum(d for d, _ in steps) > 20, steps
    # and the penalised request's speculative steps succeeded (a failing step would be retried
    # as plain steps by the fault isolation, hiding the failure behind the same tokens)
    if draft_kind != "ngram":  # (n-gram lookup reads no logits; the penalised output seldom repeats)
        assert sum(step.get(outs[6].request_id, (0, 0))[0] for step in record) >= 6, record
    if draft_kind == "ngram":  # some proposals accepted, some refused or rejected
        assert any(e >= 2 for _, e in steps) and any(e <= d for d, e in steps), steps
    elif draft_kind == "same":
        assert sum(e for _, e in steps) > 2 * len(steps), steps  # several tokens per step
    else:
        assert any(e <= d for d, e in steps), str(steps)  # rejections happened (rollback exercised)
    assert eng.block_manager.all_free()


class _FixedLogits:
    """A stand-in model runner whose every position predicts the same distribution."""

    def __init__(self, probs: dict[int, float]):
        self.logits = torch.full((im.VOCAB,), float("-inf"))
        for token, p in probs.items():
            self.logits[token] = torch.tensor(p).log()

    def execute(self, chunks):
        return self.logits.repeat(sum(c.num_logits for c in chunks), 1)


def test_speculative_sampling_under_a_grammar_follows_the_masked_target():
    """Rejection sampling between the masked draft and the masked target: every emitted token
    of a constrained sampled sequence follows the target's distribution restricted to what the
    grammar allows (here '0', '1', '2' of a regex; the draft puts most of its mass on '2' and on
    letters the grammar forbids), and the grammar is back at its start state after each step."""
    from phalanx.inference.sequence import Sequence
    from phalanx.inference.speculative import DraftModelProposer, SpeculativeDecoder
    from phalanx.inference.structured import GrammarCompiler

    tok = im.make_tokenizer()
    ids = {c: tok.convert_tokens_to_ids(c) for c in "012ab"}
    target = {ids["0"]: 0.3, ids["1"]: 0.15, ids["2"]: 0.05, ids["a"]: 0.4, ids["b"]: 0.1}
    draft = {ids["0"]: 0.05, ids["1"]: 0.1, ids["2"]: 0.35, ids["a"]: 0.2, ids["b"]: 0.3}
    want = torch.tensor([0.6, 0.3, 0.1])  # the target on '0', '1', '2', renormalised
    compiler = GrammarCompiler(tok, im.VOCAB, {tok.eos_token_id})
    spec = SpeculativeDecoder(_FixedLogits(target), DraftModelProposer(_FixedLogits(draft)), num_tokens=2)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    order = [ids[c] for c in "012"]
    positions = [[], [], []]
    for _ in range(1500):
        seq = Sequence("s", [1, 2, 3], params, generator=g)
        seq.grammar = compiler.matcher(StructuredOutput(regex="[0-2]{3}"))
        out = spec.step([seq], lambda s, extra, history: RowContext(s.params, s.generator, grammar=s.grammar))[0]
        for i, e in enumerate(out):
            positions[i].append(order.index(e.token_id))  # (a forbidden token fails here)
        assert seq.grammar.matcher.validate_tokens([ids["0"]] * 4) == 3  # rolled back: 3 digits still to come
    for i, draws in enumerate(positions[:2]):
        freq = torch.bincount(torch.tensor(draws), minlength=3).float() / len(draws)
        assert torch.allclose(freq, want, atol=0.04), (i, freq)
    assert 0.2 < spec.acceptance_rate < 0.9


def test_a_speculative_step_that_fails_after_drafting_rolls_the_grammars_back(model_path, tmp_path):
    """A fault in the target's verification, after the draft advanced every constrained grammar
    over its proposals: the step is rolled back (its requests retried alone), the grammars are
    back at their state before the step, and the greedy constrained outputs equal the run
    without a draft model."""
    draft, _ = im.save_model(tmp_path / "draft", "llama", seed=0, num_hidden_layers=1)
    prompts = im.mixed_prompts(3, seed=9, low=6, high=20)
    params = [constrained(), constrained(), constrained()]
    want = [o.token_ids for o in engine(model_path).generate(prompts, params)]
    eng = engine(model_path, draft_model=str(draft), num_speculative_tokens=3)
    spec, faults = eng.speculator, []

    class Faulty:  # the target runner, failing once in a verification of drafted tokens
        def __getattr__(self, name):
            return getattr(eng.runner, name)

        def execute(self, chunks):
            if not faults and sum(c.num_logits for c in chunks) > len(chunks) and spec.num_proposed > 30:
                faults.append([len(c.token_ids) for c in chunks])
                raise RuntimeError("injected fault in verification")
            return eng.runner.execute(chunks)

    spec.target = Faulty()
    outs = eng.generate(prompts, params)
    assert faults and max(faults[0]) > 1  # it failed after drafting
    assert [o.token_ids for o in outs] == want
    for o in outs:
        valid(o.text)
    assert eng.block_manager.all_free()


def test_bad_constraints_name_the_problem(model_path):
    eng = engine(model_path)
    with pytest.raises(ValueError, match=r'Unimplemented keys: \["not"\]'):
        eng.add_request("x", SamplingParams(structured_output={"json_schema": {"type": "object", "not": {}}}))
    with pytest.raises(ValueError, match="exactly one of"):
        SamplingParams(structured_output={"json_object": True, "regex": "a"})
    with pytest.raises(ValueError, match="min_new_tokens=2 cannot be combined with structured output"):
        SamplingParams(min_new_tokens=2, structured_output={"json_object": True})
    assert not eng.has_unfinished_requests()


# -- over HTTP, with the official client -------------------------------------------------------------
@pytest.fixture(scope="module")
def server(model_path):
    eng = engine(model_path, num_blocks=1024, max_num_seqs=64)
    with OpenAIServer(eng, port=0, api_key="sk-local") as srv:
        yield srv


def test_100_concurrent_schema_constrained_requests_parse_and_validate(server):
    """100 json_schema requests (chat and completions, greedy and sampled) at once, with an
    unconstrained greedy and a seeded request among them: every constrained answer parses and
    validates; the unconstrained answers equal the engine's own answer without the others."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    free_prompt = "Continuous batching admits new requests"
    free = [SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True),
            SamplingParams(max_new_tokens=16, temperature=1.0, seed=11, ignore_eos=True)]
    want = direct(server, [free_prompt] * 2, free)

    async def one(aclient, i):
        sampling = {"temperature": 0} if i % 2 else {"temperature": 1.0, "seed": i}
        if i % 3:
            r = await aclient.chat.completions.create(
                model="tiny-llama", messages=[{"role": "user", "content": f"Person {i} as JSON"}],
                max_tokens=100, response_format=fmt, **sampling)
            return r.choices[0].message.content, r.choices[0].finish_reason
        r = await aclient.completions.create(model="tiny-llama", prompt=f"Person {i}:", max_tokens=100,
                                             extra_body={"response_format": fmt}, **sampling)
        return r.choices[0].text, r.choices[0].finish_reason

    async def unconstrained(aclient, params):
        extra = {"seed": params.seed} if params.seed is not None else {}
        r = await aclient.completions.create(model="tiny-llama", prompt=free_prompt, max_tokens=16,
                                             temperature=params.temperature, extra_body={"ignore_eos": True}, **extra)
        return r.choices[0].text

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-local", max_retries=0,
                                      timeout=120) as aclient:
            jobs = [one(aclient, i) for i in range(100)] + [unconstrained(aclient, p) for p in free]
            return await asyncio.wait_for(asyncio.gather(*jobs), timeout=150)

    results = asyncio.run(run())
    for text, finish in results[:100]:
        assert finish == "stop", text
        valid(text)
    assert results[100:] == [w.text for w in want]
    wait_until(lambda: server.loop.in_flight == 0, what="nothing in flight")
    assert server.engine.block_manager.all_free()


def test_json_object_and_streaming_over_http(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-local", max_retries=0, timeout=60)
    tok = server.engine.tokenizer
    bias = {str(tok.convert_tokens_to_ids(t)): 30 for t in ('"', "}")}
    r = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "JSON please"}],
                                       max_tokens=60, temperature=0, logit_bias=bias,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=100, temperature=0, response_format=fmt, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=100, temperature=0, response_format=fmt)
    assert streamed == whole.choices[0].message.content
    valid(streamed)


def test_unsupported_schemas_are_a_bad_request_naming_the_problem(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-local", max_retries=0, timeout=60)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}],
                                       response_format=bad)
    assert "Unimplemented keys" in err.value.message and err.value.param == "response_format"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "grammar"})
    assert "text, json_object, json_schema" in err.value.message
    wait_until(lambda: server.loop.in_flight == 0, what="refused requests are forgotten")


# -- tool calls (Hermes / Qwen2.5 format) -------------------------------------------------------------
# A small chat template in the Qwen2.5 style: tools listed in the system turn, calls as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>, tool results as <tool_response>.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{{ messages[0].content if messages[0].role == 'system' else 'You are helpful.' }}\n<tools>\n"
    "{%- for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "Call a tool as <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{%- for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    tok = im.make_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    # the tiny tokenizer spends about a token per character of the tools' JSON: a longer context
    path, _ = im.save_model(tmp_path_factory.mktemp("tools") / "tiny-qwen", "llama", tokenizer=tok,
                            max_position_embeddings=1024)
    with OpenAIServer(engine(path, max_model_len=1024, num_blocks=640), port=0) as srv:
        yield srv


def test_a_forced_tool_call_round_trips(tool_server):
    """tool_choice naming a function: the answer is a call of it (finish_reason "tool_calls",
    arguments valid against its parameters); sent back with the tool's result, the conversation
    renders through the template as the engine's own prompt (usage.prompt_tokens)."""
    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model="tiny-qwen", messages=messages, tools=TOOLS, temperature=0,
                                       max_tokens=150, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER)
    history = messages + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r2 = client.chat.completions.create(model="tiny-qwen", messages=history, tools=TOOLS, temperature=0, max_tokens=8,
                                        tool_choice="none")
    tok = tool_server.engine.tokenizer
    rendered = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    text = tok.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
    assert '"arguments": {"city"' in text and "<tool_response>\nsunny, 21 C" in text
    assert r2.usage.prompt_tokens == len(tok(text, add_special_tokens=False)["input_ids"])
    assert r2.choices[0].finish_reason in ("stop", "length") and r2.choices[0].message.tool_calls is None


def test_required_auto_and_none(tool_server):
    """required: a call of one of the tools; auto: the model's text, with calls parsed out when it
    writes them (a random model writes none); none: the tools are not rendered (the answer equals
    a request without tools)."""
    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "What now?"}]
    r = client.chat.completions.create(model="tiny-qwen", messages=messages, tools=TOOLS, tool_choice="required",
                                       temperature=1.0, seed=4, max_tokens=150)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time") and r.choices[0].finish_reason == "tool_calls"
    assert isinstance(json.loads(call.function.arguments), dict)
    auto = client.chat.completions.create(model="tiny-qwen", messages=messages, tools=TOOLS, temperature=0, max_tokens=8)
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].message.content
    plain = client.chat.completions.create(model="tiny-qwen", messages=messages, temperature=0, max_tokens=8)
    none = client.chat.completions.create(model="tiny-qwen", messages=messages, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=8)
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]
    with pytest.raises(openai.BadRequestError, match="'tools' cannot be used: .*Unimplemented keys") as err:
        client.chat.completions.create(model="tiny-qwen", messages=messages, tools=bad, tool_choice="required")
    assert err.value.param == "tools"
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model="tiny-qwen", messages=messages, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    forced = dict(model="tiny-qwen", messages=messages, tools=TOOLS, temperature=0, max_tokens=150,
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    whole = client.chat.completions.create(**forced).choices[0]
    chunks = [c for c in client.chat.completions.create(**forced, stream=True) if c.choices]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].index == 0 and calls[0].function.name == "get_time"
    assert calls[0].function.arguments == whole.message.tool_calls[0].function.arguments


def test_tool_calls_are_parsed_from_the_text():
    from phalanx.inference.openai_protocol import chat_message, parse_tool_calls
    text = 'Let me check.<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check." and len(calls) == 1
    assert calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    message, finish = chat_message(text, "stop", tools=True)
    assert finish == "tool_calls" and message["tool_calls"][0]["function"]["name"] == "get_time"
    assert chat_message(text, "stop", tools=False) == ({"role": "assistant", "content": text}, "stop")
    two = text + '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call> ok'
    content, calls = parse_tool_calls(two)
    assert content == "Let me check. ok" and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert len(chat_message(two, "stop", tools=True, parallel=False)[0]["tool_calls"]) == 1


# -- the mask's cost per token (run by hand on a quiet machine; not a test) ------------------------
def mask_overhead(model: str, num_requests: int = 32, new_tokens: int = 64, max_model_len: int | None = None) -> None:
    """Prints ms per generated token unconstrained and under a JSON schema (whose string cannot
    close within `new_tokens`, so both runs generate the same tokens in the same batches), twice
    each, then the cost of one step's masks alone."""
    import time
    from phalanx.inference.structured import apply_grammar_masks
    eng = LLM(model, max_num_seqs=num_requests, max_model_len=max_model_len)
    prompts = [f"Write record {i} as JSON:" for i in range(num_requests)]
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 4000}}, "required": ["text"]}
    plain = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    masked = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True,
                            structured_output={"json_schema": schema})
    eng.generate(prompts[:2], [plain, masked])  # warm up, compile the schema
    for name, params in (("unconstrained", plain), ("json_schema", masked)) * 2:
        start = time.perf_counter()
        outs = eng.generate(prompts, params)
        seconds = time.perf_counter() - start
        n = sum(len(o.token_ids) for o in outs)
        print(f"{name:14s} {n} tokens in {seconds:.3f} s: {1e3 * seconds / n:.3f} ms/token")
    grammars = [eng.grammar_compiler().matcher(masked.structured_output) for _ in range(num_requests)]
    logits = torch.randn(num_requests, eng.spec.vocab_size, device=eng.device)
    for _ in range(3):
        apply_grammar_masks(logits, grammars)
    start = time.perf_counter()
    for _ in range(50):
        apply_grammar_masks(logits, grammars)
    step = (time.perf_counter() - start) / 50
    print(f"masks of {num_requests} rows (vocab {eng.spec.vocab_size}): {1e3 * step:.3f} ms/step, "
          f"{1e6 * step / num_requests:.1f} us/token")


def speculative_acceptance(model: str, draft_layers: int, k: int = 4) -> None:
    """Schema-constrained and unconstrained greedy requests (8 chat prompts) on `model`, without
    a draft and with a self-speculative draft (the model's first `draft_layers` layers and its
    head): prints whether the tokens are identical, the acceptance rate and the tokens per
    sequence per speculative step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
              "age": {"type": "integer", "minimum": 0, "maximum": 120}, "city": {"type": "string", "maxLength": 20},
              "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
              "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
    tok = AutoTokenizer.from_pretrained(model)
    people = ["a retired sailor from Lisbon", "a young chess player in Oslo", "a baker in Lyon", "a nurse in Toronto",
              "a student in Kyoto", "a painter in Mexico City", "a farmer in Kenya", "a pilot in Dubai"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Describe {p} as JSON with name, age, city, "
                                         "hobbies."}], tokenize=False, add_generation_prompt=True) for p in people]
    draft = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    draft.model.layers = draft.model.layers[:draft_layers]
    draft.config.num_hidden_layers = draft_layers
    kw = dict(dtype="float32", max_model_len=512, num_blocks=512, block_size=16)
    plain, spec = LLM(model, **kw), LLM(model, draft_model=draft, num_speculative_tokens=k, **kw)
    record = speculating(spec)
    for name, params in (("json_schema", SamplingParams(max_new_tokens=80, temperature=0,
                                                        structured_output={"json_schema": schema})),
                         ("unconstrained", SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True))):
        want = plain.generate(prompts, params)
        record.clear()
        before = (spec.speculator.num_proposed, spec.speculator.num_accepted)
        got = spec.generate(prompts, params)
        proposed, accepted = (spec.speculator.num_proposed - before[0], spec.speculator.num_accepted - before[1])
        per_step = [e for step in record for _, e in step.values()]
        same = sum(a.token_ids == b.token_ids for a, b in zip(want, got, strict=True))
        print(f"{name:14s} draft = {draft_layers} layers, k={k}: identical {same}/{len(prompts)}, acceptance "
              f"{accepted / max(proposed, 1):.2f}, {sum(per_step) / max(len(per_step), 1):.2f} tokens per sequence "
              f"per speculative step")


if __name__ == "__main__":  # python tests/framework/test_inference_structured.py [MODEL_DIR] [THREADS] [--draft-layers N]
    import os
    import sys
    args = [a for a in sys.argv[1:] if not a.startswith("--draft-layers")]
    layers = [int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--draft-layers=")]
    torch.set_num_threads(int(args[1]) if len(args) > 1 else 1)
    model_dir = os.path.expanduser(args[0] if args else "~/.cache/phalanx/smollm2-135m-instruct")
    if layers:
        speculative_acceptance(model_dir, layers[0])
    else:
        mask_overhead(model_dir)
