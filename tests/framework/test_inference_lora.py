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


def make_adapter(directory, seed: int, **fields):
    """A PEFT adapter on the tiny Llama with random (non-zero) B, saved to `directory`; returns
    the adapter's merged model (peft's merge_and_unload) in fp32."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(im.make_model("llama"), peft.LoraConfig(**fields))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    model.save_pretrained(str(directory))
    return model.merge_and_unload().eval()


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
        check(rel_diff(got, want), rounding_rtol(torch.float32, full.shape[1]), f"logits of {name or 'base'}")
        assert got.argmax(-1).tolist() == out.token_ids  # greedy: the merged model's choice
        if name is not None:  # the adapter matters far beyond the tolerance
            assert rel_diff(base, want).value > 1e3 * rounding_rtol(torch.float32, full.shape[1])
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


def test_lora_refuses_tensor_parallelism_and_a_plain_engine(models):
    base_dir, dirs, _ = models
    with pytest.raises(ValueError, match="tp_size=2 are not supported yet.*merge"):
        LLM(str(base_dir), enable_lora=True, tp_size=2)
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
