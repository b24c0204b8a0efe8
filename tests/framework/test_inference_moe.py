"""phalanx.inference serves the mixture-of-experts families (Mixtral, Qwen2-MoE with its shared
expert and sigmoid gate, Qwen3-MoE with a dense layer among the expert layers): greedy tokens equal
transformers' `generate(do_sample=False)` and log-probs its forward's, from a saved directory
(per-expert checkpoint tensors) and from a live module (transformers' fused expert tensors); under
tensor parallelism (2 gloo ranks, each expert's width split) the tokens stay transformers'."""
from __future__ import annotations

import pytest
import torch

import inference_models as im
import moe_models
from inference_tp_workers import tp_generate
from phalanx.inference import LLM, SamplingParams
from phalanx.testing import spawn

NEW_TOKENS = 16
LOGPROB_ATOL = 1e-4  # fp32, as test_inference_families.py
# Qwen3-MoE: layer 0 dense (mlp_only_layers), layer 1 experts; Qwen2-MoE: no renormalisation
OVERRIDES = {"mixtral": {}, "qwen2_moe": {}, "qwen3_moe": dict(mlp_only_layers=[0])}


def _make(family: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_models.moe_config(family, **{**OVERRIDES[family], **overrides}))
    return model.eval()


def _save(directory, family: str, tok, **overrides):
    model = _make(family, **overrides)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return str(directory), model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root, tok = tmp_path_factory.mktemp("inference-moe"), im.make_tokenizer()
    return {family: _save(root / family, family, tok) for family in moe_models.MOE_FAMILIES}


def _check(eng: LLM, model, prompts: list[list[int]]) -> None:
    im.check_against_transformers(eng, model, prompts, NEW_TOKENS, LOGPROB_ATOL)


@pytest.mark.parametrize("family", moe_models.MOE_FAMILIES)
def test_moe_greedy_tokens_and_logprobs_match_transformers(models, family):
    path, model = models[family]
    layers = LLM(path, num_blocks=96, block_size=8, dtype="float32").runner.model.layers
    assert [layer.sparse for layer in layers] == ([False, True] if family == "qwen3_moe" else [True, True])
    _check(LLM(path, num_blocks=96, block_size=8, dtype="float32"), model, im.mixed_prompts(5, seed=2, low=3, high=60))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_engine_from_a_live_module(models, family):
    """A live transformers module holds the experts fused ([experts, 2·width, hidden]): they load,
    and the strict check counts them as the per-expert tensors of a checkpoint."""
    _, model = models[family]
    _check(LLM.from_model(model, num_blocks=64, block_size=8, dtype="float32"), model, im.mixed_prompts(2, seed=4, low=5, high=30))


def test_moe_routing_matters(models):
    """Swapping two experts' weights changes the tokens: the check above would catch a wrong
    expert order or a router read from the wrong tensor."""
    path, model = models["mixtral"]
    prompt = im.mixed_prompts(1, seed=6, low=20, high=21)[0]
    eng = LLM(path, num_blocks=64, block_size=8, dtype="float32")
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0)
    good = eng.generate(prompt, params)[0].token_ids
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for layer in range(2):
        for name in ("gate_up_proj", "down_proj"):
            t = state[f"model.layers.{layer}.mlp.experts.{name}"]
            state[f"model.layers.{layer}.mlp.experts.{name}"] = t[[1, 0, 2, 3]]
    eng.load_weights(state)
    assert eng.generate(prompt, params)[0].token_ids != good


def test_moe_checks_name_the_problem(models, tmp_path):
    """A tp that does not divide the expert width is refused by name; a checkpoint with an
    expert missing is refused as incomplete."""
    from phalanx.inference.llama import check_tp, spec_for_inference
    spec = spec_for_inference(moe_models.moe_config("qwen2_moe", moe_intermediate_size=30))
    with pytest.raises(ValueError, match=r"expert width \(moe_intermediate_size\) \(30\)"):
        check_tp(spec, 4)
    check_tp(spec, 2)
    path, model = models["qwen3_moe"]
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("layers.1.mlp.experts.down_proj")}
    eng = LLM(path, num_blocks=16, block_size=8, dtype="float32")
    with pytest.raises(ValueError, match="missing from the checkpoint.*layers.1.mlp.experts.0.down_proj"):
        eng.load_weights(state, strict=True)


@pytest.mark.slow  # two ranks, two models: ~30-60 s on 2 busy cores
def test_moe_tp2_matches_transformers(models):
    """TP=2: each rank holds half of every expert's width (gate/up by columns, down by rows; and of
    the shared expert's), the router whole; the partial sums meet in the layer's one all-reduce.
    Tokens equal transformers', log-probs the TP=1 engine's (within fp32 rounding over the
    vocabulary, in units of the logits' magnitude)."""
    from phalanx.testing import Diff, check, rounding_rtol
    prompts = im.mixed_prompts(3, seed=13, low=3, high=40)
    families = ["mixtral", "qwen2_moe"]
    cases = [{"path": models[f][0], "prompts": prompts, "new_tokens": 12} for f in families]
    ranks = spawn(tp_generate, 2, cases, timeout=300)
    assert ranks[0] == ranks[1], "TP ranks returned different outputs"
    for family, result in zip(families, ranks[0], strict=True):
        model = models[family][1]
        assert result["tokens"] == [im.hf_greedy(model, p, 12) for p in prompts], family
        one = LLM(models[family][0], num_blocks=64, block_size=8, dtype="float32")
        want = one.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0, logprobs=1))
        assert result["tokens"] == [o.token_ids for o in want], family
        with torch.no_grad():
            scale = max(model(input_ids=torch.tensor([p])).logits.abs().max().item() for p in prompts)
        for i, (a, b) in enumerate(zip(result["logprobs"], [o.logprobs for o in want], strict=True)):
            worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
            check(Diff(worst / scale, f"prompt {i}"), rounding_rtol(torch.float32, im.VOCAB),
                  f"{family}: TP=2 log-probs")
