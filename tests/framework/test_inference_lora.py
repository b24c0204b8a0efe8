"""LoRA adapters at serve time (`phalanx.inference.lora`): PEFT adapters made with peft on a tiny
Llama, served in one batch with the base model, against each adapter's merged model
(`merge_and_unload`) run through transformers in fp32."""
from __future__ import annotations

import copy
import shutil

import pytest
import torch

import inference_models as im
from phalanx.inference import LLM, SamplingParams
from phalanx.inference.lora import LoraError
from phalanx.testing import check, rel_diff, rounding_rtol

peft = pytest.importorskip("peft")
torch.set_num_threads(1)

ADAPTERS = {  # name -> LoraConfig fields: different targets, ranks and scalings
    "a1": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
    "a2": dict(r=8, lora_alpha=16, use_rslora=True,
               target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]),
}


make_adapter = im.make_adapter


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base_dir, base = im.save_model(root / "tiny", "llama")
    refs, dirs = {None: base}, {}
    for seed, (name, fields) in enumerate(ADAPTERS.items(), start=1):
        dirs[name] = root / name
        refs[name] = make_adapter(dirs[name], seed, **fields)
    return base_dir, dirs, refs


def lora_engine(base_dir, dirs, **kw):
    engine = LLM(str(base_dir), dtype="float32", num_blocks=256, block_size=8, max_model_len=128,
                 enable_lora=True, max_loras=2, max_lora_rank=8, **kw)
    for name, path in dirs.items():
        engine.load_lora_adapter(name, path)
    return engine


def test_a_mixed_batch_equals_each_adapters_merged_model(models):
    """Base, a1 and a2 requests in one batch (the same prompt under all three, so a prefix cache
    that ignored the adapter would hand one request another's keys): every logits row the sampler
    sees equals the merged model's at that position, greedy tokens included; one batched delta per
    adapted matmul per step, whichever adapters the step mixes."""
    base_dir, dirs, refs = models
    engine = lora_engine(base_dir, dirs)
    shared = im.mixed_prompts(1, seed=3, low=20, high=21)[0]
    prompts = [shared, shared, shared] + im.mixed_prompts(3, seed=4)
    names = [None, "a1", "a2", "a2", None, "a1"]
    params = [SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, lora_name=n) for n in names]
    rows: dict[int, list[torch.Tensor]] = {id(p): [] for p in params}
    sampler, execute, steps = engine.sampler, engine.runner.execute, []

    def spy_sampler(logits, contexts):
        for row, ctx in zip(logits, contexts, strict=True):
            rows[id(ctx.params)].append(row.detach().clone().cpu())
        return sampler(logits, contexts)

    def spy_execute(chunks):
        steps.append(len(chunks))
        return execute(chunks)

    engine.sampler, engine.runner.execute = spy_sampler, spy_execute
    stacks = [s for layer in engine.lora.layers.values() for s in layer.stacks.values()]
    before = [s.calls for s in stacks]
    outs = engine.generate(prompts, params)
    assert len(stacks) == 2 * 4  # 2 layers x (qkv, o, gate_up, down)
    assert [s.calls - b for s, b in zip(stacks, before, strict=True)] == [len(steps)] * len(stacks)
    assert engine.block_manager.all_free()
    for prompt, name, p, out in zip(prompts, names, params, outs, strict=True):
        full = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            want = refs[name](full).logits[0, len(prompt) - 1:-1]
            base = refs[None](full).logits[0, len(prompt) - 1:-1]
        got = torch.stack(rows[id(p)])
        # n: the longest reduction behind a logit (the sequence's attention or down_proj's intermediate width)
        n = max(full.shape[1], refs[None].config.intermediate_size)
        check(rel_diff(got, want), rounding_rtol(torch.float32, n), f"logits of {name or 'base'}")
        assert got.argmax(-1).tolist() == out.token_ids  # greedy: the merged model's choice
        if name is not None:  # the adapter matters far beyond the tolerance
            assert rel_diff(base, want).value > 1e3 * rounding_rtol(torch.float32, n)
    assert len({tuple(o.token_ids) for o in outs[:3]}) == 3  # one prompt, three models, three answers


def test_requests_pick_adapters_by_name_and_the_registry_refuses_by_name(models, tmp_path):
    base_dir, dirs, refs = models
    engine = lora_engine(base_dir, {"a1": dirs["a1"]})
    prompt = im.mixed_prompts(1, seed=5)[0]
    one = engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0, lora_name="a1"))[0]
    assert one.token_ids == im.hf_greedy(refs["a1"], prompt, 8)
    with pytest.raises(LoraError, match="'nope' is not loaded") as err:
        engine.add_request(prompt, SamplingParams(lora_name="nope"))
    assert err.value.status == 404
    with pytest.raises(LoraError, match="already loaded"):
        engine.load_lora_adapter("a1", dirs["a1"])
    engine.load_lora_adapter("a2", dirs["a2"])
    with pytest.raises(LoraError, match="max_loras=2"):
        engine.load_lora_adapter("a3", dirs["a1"])
    with pytest.raises(ValueError, match="max_model_len"):  # refused: holds no reference to the adapter
        engine.add_request(prompt, SamplingParams(max_new_tokens=127, lora_name="a2"))
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=2, lora_name="a2"))
    with pytest.raises(LoraError, match="in flight"):
        engine.unload_lora_adapter("a2")
    engine.abort(rid)
    engine.unload_lora_adapter("a2")
    assert list(engine.lora_adapters()) == ["a1"]
    make_adapter(tmp_path / "r16", 7, r=16, lora_alpha=16, target_modules=["q_proj"])
    with pytest.raises(LoraError, match="rank 16.*max_lora_rank=8"):
        engine.load_lora_adapter("big", tmp_path / "r16")
    make_adapter(tmp_path / "dora", 8, r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj"])
    with pytest.raises(LoraError, match="DoRA"):
        engine.load_lora_adapter("dora", tmp_path / "dora")
    make_adapter(tmp_path / "head", 9, r=4, lora_alpha=8, target_modules=["lm_head"])
    with pytest.raises(LoraError, match="lm_head"):
        engine.load_lora_adapter("head", tmp_path / "head")
    with pytest.raises(LoraError, match="no adapter_config.json"):
        engine.load_lora_adapter("none", tmp_path)


def tp_lora_generate(cases: list[dict]) -> list[dict]:
    """Rank function: a TP=2 engine with the case's adapters loaded on every rank, one mixed batch."""
    results = []
    for case in cases:
        eng = lora_engine(case["path"], case["adapters"], tp_size=2)
        params = [SamplingParams(max_new_tokens=case["new_tokens"], temperature=0, logprobs=1, lora_name=n)
                  for n in case["names"]]
        outs = eng.generate(case["prompts"], params)
        stacks = eng.lora.layers[0].stacks
        results.append({"tokens": [o.token_ids for o in outs], "logprobs": [o.logprobs for o in outs],
                        "shapes": {k: (tuple(v.a.shape), tuple(v.b.shape)) for k, v in stacks.items()}})
    return results


@pytest.mark.slow  # two ranks, two engines: ~20-60 s on 2 busy cores
def test_tensor_parallel_adapters_equal_the_merged_model(models, tmp_path):
    """TP=2 (gloo): each rank holds its part of every adapter, split as the base weight is (B by
    output rows for q/k/v/gate/up, A by input columns for o/down, the partial deltas summed in the
    layer's all-reduce); key/value heads split (2 KV heads) and replicated (1 KV head). A batch
    mixing base and adapter requests gives the merged models' greedy tokens and the TP=1 engine's
    log-probs."""
    from phalanx.testing import Diff, spawn

    base_dir, dirs, refs = models
    one_kv = {"num_key_value_heads": 1}
    mqa_dir, _ = im.save_model(tmp_path / "mqa", "llama", **one_kv)
    mqa_ref = make_adapter(tmp_path / "m1", 5, one_kv, r=4, lora_alpha=8,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"])
    prompts = im.mixed_prompts(3, seed=6, low=3, high=30)
    cases = [{"path": str(base_dir), "adapters": {k: str(v) for k, v in dirs.items()}, "prompts": prompts,
              "names": ["a1", None, "a2"], "new_tokens": 8},
             {"path": str(mqa_dir), "adapters": {"m1": str(tmp_path / "m1")}, "prompts": prompts[:2],
              "names": ["m1", "m1"], "new_tokens": 8}]
    ranks = spawn(tp_lora_generate, 2, cases, timeout=300)
    assert ranks[0] == ranks[1], "TP ranks returned different outputs"
    merged = [{n: refs[n] for n in (None, "a1", "a2")}, {"m1": mqa_ref}]
    for case, result, ref in zip(cases, ranks[0], merged, strict=True):
        for prompt, name, tokens in zip(case["prompts"], case["names"], result["tokens"], strict=True):
            assert tokens == im.hf_greedy(ref[name], prompt, case["new_tokens"]), (case["path"], name)
        one = lora_engine(case["path"], case["adapters"])
        want = one.generate(case["prompts"], [SamplingParams(max_new_tokens=case["new_tokens"], temperature=0,
                                                             logprobs=1, lora_name=n) for n in case["names"]])
        with torch.no_grad():
            scale = max(ref[n](torch.tensor([p])).logits.abs().max().item()
                        for p, n in zip(case["prompts"], case["names"], strict=True))
        for i, (a, b) in enumerate(zip(result["logprobs"], [o.logprobs for o in want], strict=True)):
            worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
            check(Diff(worst / scale, f"prompt {i}"), rounding_rtol(torch.float32, im.VOCAB), "TP=2 log-probs vs TP=1")
    # hidden 64, 4 heads of 16: o's A holds half the input columns, q/k/v's B half the heads' columns
    # (2 KV heads split: 32 + 16 + 16; 1 KV head replicated: 32 + 16 + 16 as well)
    shapes = ranks[0][0]["shapes"]
    assert shapes["o"] == ((2, 8, 32), (2, 8, 64)) and shapes["qkv"] == ((2, 24, 64), (2, 24, 64))


def test_a_draft_model_speculates_for_adapter_requests_with_their_greedy_tokens(models):
    """Speculative decoding with adapters: the draft (the base model, without adapters) proposes,
    the target verifies each sequence with its own adapter. A mixed batch of a1, a2 and the base
    (one shared prompt under all three, and others) gives the tokens of the engine without a
    draft, which are each merged model's greedy tokens; the adapter requests did speculate
    (proposals drafted for them, some accepted), and every block is freed."""
    base_dir, dirs, refs = models
    shared = im.mixed_prompts(1, seed=3, low=20, high=21)[0]
    prompts = [shared, shared, shared] + im.mixed_prompts(3, seed=8)
    names = ["a1", "a2", None, "a2", None, "a1"]
    params = [SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True, lora_name=n) for n in names]
    want = lora_engine(base_dir, dirs).generate(prompts, params)
    engine = lora_engine(base_dir, dirs, draft_model=str(base_dir), num_speculative_tokens=3)
    spec, propose, per_name = engine.speculator, engine.speculator.proposer.propose, {}

    def spy_propose(seqs, *args):
        drafts, probs = propose(seqs, *args)
        for seq, d in zip(seqs, drafts, strict=True):
            per_name[seq.params.lora_name] = per_name.get(seq.params.lora_name, 0) + len(d)
        return drafts, probs

    spec.proposer.propose = spy_propose
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        assert out.token_ids == im.hf_greedy(refs[name], prompt, 10), name
    assert len({tuple(o.token_ids) for o in outs[:3]}) == 3  # one prompt, three models, three answers
    assert all(per_name.get(n, 0) >= 6 for n in ("a1", "a2", None)), per_name
    assert 0 < spec.num_accepted < spec.num_proposed  # the base draft is right for some tokens, not all
    assert engine.block_manager.all_free()


def test_lora_refuses_a_plain_engine(models, tmp_path):
    base_dir, dirs, _ = models
    plain = LLM(str(base_dir), dtype="float32", num_blocks=32, block_size=8, max_model_len=64)
    with pytest.raises(LoraError, match="enable_lora=True"):
        plain.load_lora_adapter("a1", dirs["a1"])


def test_an_adapter_exported_by_the_booster_serves(tmp_path):
    """The LLaMA recipe's path: `enable_lora`, a training checkpoint of the PEFT model, then
    `export_from_checkpoint` writes `<output_dir>/adapter`; the engine, given the output_dir, serves it
    as the merged model."""
    from safetensors.torch import save_file

    from phalanx.booster.lora import enable_lora, export_from_checkpoint

    base_dir, _ = im.save_model(tmp_path / "base", "llama")
    torch.manual_seed(11)
    model = enable_lora(im.make_model("llama"), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                                    "down_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    (tmp_path / "ckpt").mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "ckpt" / "model.safetensors"))
    export_from_checkpoint(model, tmp_path / "ckpt", tmp_path / "run" / "adapter")
    merged = copy.deepcopy(model).merge_and_unload().eval()
    engine = lora_engine(base_dir, {"sft": tmp_path / "run"})  # the run's output_dir: its adapter/ is found
    prompts = im.mixed_prompts(2, seed=6)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0, lora_name="sft"))
    assert [o.token_ids for o in outs] == [im.hf_greedy(merged, p, 8) for p in prompts]
    assert outs[0].token_ids != engine.generate(prompts[0], SamplingParams(max_new_tokens=8, temperature=0))[0].token_ids
    # the RLHF recipe's layout: adapter/ inside each checkpoint; its output_dir names the latest complete one
    checkpoint = tmp_path / "rlhf" / "checkpoints" / "step-00000004"
    shutil.copytree(tmp_path / "run" / "adapter", checkpoint / "adapter")
    (tmp_path / "rlhf" / "checkpoints" / "step-00000009" / "adapter").mkdir(parents=True)  # no manifest: incomplete
    (checkpoint / "manifest.json").write_text("{}")
    engine.unload_lora_adapter("sft")
    engine.load_lora_adapter("grpo", tmp_path / "rlhf")
    assert engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0, lora_name="grpo"))[0].token_ids \
        == outs[0].token_ids


# -- over HTTP, with the official openai client ------------------------------------------------------
@pytest.fixture(scope="module")
def server(models):
    from phalanx.inference import OpenAIServer

    engine = lora_engine(models[0], {})  # adapters come through the load route
    with OpenAIServer(engine, port=0, api_key="sk-local", max_queue=16) as srv:
        yield srv


def test_the_openai_client_picks_adapters_by_model_and_the_routes_load_and_unload(server, models, tmp_path):
    import asyncio

    import httpx
    import openai
    from serving_helpers import direct

    _, dirs, refs = models

    def post(route, body):
        return httpx.post(server.url + route, json=body, headers={"Authorization": "Bearer sk-local"}, timeout=60)

    for name in ("a1", "a2"):
        r = post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(dirs[name])})
        assert r.status_code == 200 and name in r.text, r.text
    r = post("/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(dirs["a1"])})
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
    make_adapter(tmp_path / "r16", 7, r=16, lora_alpha=16, target_modules=["q_proj"])
    r = post("/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(tmp_path / "r16")})
    assert r.status_code == 400 and "max_lora_rank=8" in r.json()["error"]["message"], r.text
    assert post("/v1/load_lora_adapter", {"lora_name": "x"}).status_code == 400  # lora_path missing

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-local", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny", "a1", "a2"]
    prompt = "Continuous batching admits new requests"
    ids = server.engine.tokenize(prompt)
    answers = {}
    for model, adapter in (("tiny", None), ("a1", "a1"), ("a2", "a2")):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        want = direct(server, prompt, SamplingParams(max_new_tokens=8, temperature=0, lora_name=adapter))[0]
        assert r.model == model and r.choices[0].text == want.text
        assert want.token_ids == im.hf_greedy(refs[adapter], ids, 8)  # the merged model's greedy tokens
        answers[model] = want.text
    assert len(set(answers.values())) == 3

    async def mixed():  # the three models in concurrent requests: each still gets its own answer
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-local", max_retries=0) as aclient:
            rs = await asyncio.gather(*(aclient.completions.create(model=m, prompt=prompt, max_tokens=8, temperature=0)
                                        for m in ["a2", "tiny", "a1"] * 3))
        return [r.choices[0].text for r in rs]
    assert asyncio.run(mixed()) == [answers[m] for m in ["a2", "tiny", "a1"] * 3]
    chat = client.chat.completions.create(model="a1", messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
                                          temperature=0)
    assert chat.model == "a1"
    with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
        client.completions.create(model="nope", prompt=prompt, max_tokens=2)

    assert post("/v1/unload_lora_adapter", {"lora_name": "a2"}).status_code == 200
    with pytest.raises(openai.NotFoundError, match="'a2' does not exist"):
        client.completions.create(model="a2", prompt=prompt, max_tokens=2)
    r = post("/v1/unload_lora_adapter", {"lora_name": "a2"})
    assert r.status_code == 404 and "'a2' is not loaded" in r.json()["error"]["message"]
    assert [m.id for m in client.models.list().data] == ["tiny", "a1"]
    client.close()


def test_serve_reads_lora_flags():
    from phalanx.inference.serve import build_parser, lora_modules

    args = build_parser().parse_args(["base", "--lora-modules", "a=/x", "b=/y", "--lora", "c=runs/sft",
                                      "--max-lora-rank", "32"])
    assert lora_modules(args) == {"a": "/x", "b": "/y", "c": "runs/sft"} and args.max_lora_rank == 32
    with pytest.raises(ValueError, match="NAME=PATH"):
        lora_modules(build_parser().parse_args(["base", "--lora", "justapath"]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_low_rank_stack_adds_each_tokens_own_adapter(dtype):
    """One fused matmul of three pieces (q, k, v of different widths), three slots of ranks 2, 4
    and 3 (one adapting no k), tokens of every slot and of the base: `add_delta` (one x·Aᵀ for all
    pieces, the slot mask, one block-diagonal B matmul; the oneDNN-packed factors in bf16 on a CPU
    with native bf16) equals, token by token, y + B_{s,p} A_{s,p} x in each piece's columns; steps
    using fewer slots (a smaller `hi`) and an unloaded slot too."""
    from phalanx.inference.lora import LowRankStack, Piece, StepSlots
    from phalanx_kernels.accelerator import current_device

    dev = current_device()
    torch.manual_seed(0)
    pieces, fan_in = [(0, 12), (12, 4), (16, 4)], 10
    stack = LowRankStack(pieces, fan_in, slots=3, rank=4, dtype=dtype, device=dev)
    factors = {}
    for slot, r in ((1, 2), (2, 4), (3, 3)):
        for p, (_, width) in enumerate(pieces):
            if (slot, p) != (1, 1):
                a, b = torch.randn(r, fan_in).to(dtype).float(), torch.randn(width, r).to(dtype).float()
                stack.put(slot, Piece(0, "qkv", p, a.to(dev), b.to(dev)))
                factors[slot, p] = (a, b)

    def run(token_slots):
        x = torch.randn(len(token_slots), fan_in).to(dtype).float()
        y = torch.randn(len(token_slots), 20).to(dtype).float()
        want = y.clone()
        for t, s in enumerate(token_slots):
            for p, (first, width) in enumerate(pieces):
                if (s, p) in factors:
                    a, b = factors[s, p]
                    want[t, first:first + width] += b @ (a @ x[t])
        step = StepSlots()
        step.set(token_slots, dtype, dev)
        got = stack.add_delta(x.to(dev, dtype), y.to(dev, dtype), step).float().cpu()
        check(rel_diff(got, want), rounding_rtol(dtype, fan_in), f"deltas of slots {token_slots}")
        return got, y

    run([0, 1, 2, 3, 2, 0, 1, 3])
    run([2, 0, 1, 1])  # hi = 2: the first two slots' factors only (packed once more)
    run([3, 3, 0])
    stack.clear(3)
    for p in range(3):
        factors.pop((3, p))
    got, y = run([3, 1, 0])  # an unloaded slot adds nothing
    assert torch.equal(got[0], y[0].to(dtype).float())


def test_http_load_and_unload_are_refused_under_tensor_parallelism():
    """Over HTTP only rank 0 would load the adapter while the other ranks run steps: refused (400
    naming --lora at start) with tp_size > 1, before the engine is called; allowed at tp_size 1."""
    import asyncio
    import types

    from phalanx.inference import openai_protocol as api
    from phalanx.inference.server_routes import Routes

    calls = []
    engine = types.SimpleNamespace(config=types.SimpleNamespace(tp_size=2), load=lambda *a: calls.append(a))
    routes = Routes(types.SimpleNamespace(engine=engine))
    with pytest.raises(api.RequestError, match="--tp-size 2: give them at start \\(--lora NAME=PATH\\)") as err:
        asyncio.run(routes.lora_call(engine.load, "x", "/p", param="lora_path"))
    assert err.value.status == 400 and calls == []
    engine.config.tp_size = 1
    asyncio.run(routes.lora_call(engine.load, "x", "/p", param="lora_path"))
    assert calls == [("x", "/p")]
