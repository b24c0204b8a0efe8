"""apply_to(model): a patched HF Llama / Mistral / Qwen2 / Qwen3 gives the unpatched model's loss
and gradients, on the torch references (CPU) and on the Triton kernels (interpreter or GPU)."""
from __future__ import annotations

import copy

import pytest
import torch

import phalanx_kernels
from phalanx_kernels import apply_to, hf
from kernel_checks import assert_close

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def tiny_model(family: str, dtype=torch.float32, seed: int = 0):
    import transformers
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    extra = {"head_dim": 8} if family == "qwen3" else {}
    torch.manual_seed(seed)
    return model_cls(config_cls(**TINY, **extra)).to(dtype)


def loss_and_grads(model, input_ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _compare(model, patched, input_ids, tol):
    want_loss, want = loss_and_grads(model, input_ids)
    got_loss, got = loss_and_grads(patched, input_ids)
    assert_close(got_loss, want_loss, tol, "loss")
    for name in want:
        assert_close(got[name], want[name], tol, name)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_patched_matches_unpatched_on_reference(family):
    model = tiny_model(family)
    patched = apply_to(copy.deepcopy(model))
    layers = TINY["num_hidden_layers"]
    norms = 2 * layers + 1 + (2 * layers if family == "qwen3" else 0)  # qwen3 adds q/k norms
    assert hf.patched_counts(patched) == {"rms_norm": norms, "swiglu": layers, "rope": layers}
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 9))
    _compare(model, patched, input_ids, 1e-6)


def test_activation_checkpointing_recomputes_through_in_place_rope():
    model = tiny_model("mistral")
    patched = apply_to(copy.deepcopy(model))
    patched.train()
    patched.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert patched.is_activation_checkpointing
    _compare(model, patched, torch.randint(0, TINY["vocab_size"], (2, 8)), 1e-6)


def test_patched_model_routes_through_the_kernels(monkeypatch):
    calls = {"rms_norm": 0, "swiglu": 0, "apply_rope": 0}
    for name in calls:
        real = getattr(hf, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(hf, name, counting)
    model = apply_to(tiny_model("llama"))
    other = tiny_model("llama")  # same family, not patched: must keep HF's own functions
    ids = torch.randint(0, TINY["vocab_size"], (1, 5))
    other(input_ids=ids)
    assert calls == {"rms_norm": 0, "swiglu": 0, "apply_rope": 0}
    model(input_ids=ids)
    assert calls == {"rms_norm": 5, "swiglu": 2, "apply_rope": 2}


def test_bf16_and_generation_match():
    model = tiny_model("llama", torch.bfloat16)
    patched = apply_to(copy.deepcopy(model))
    ids = torch.randint(0, TINY["vocab_size"], (2, 7))
    with torch.no_grad():
        assert torch.equal(patched(input_ids=ids).logits, model(input_ids=ids).logits)
        greedy = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(patched.generate(ids, **greedy), model.generate(ids, **greedy))


def test_apply_to_is_idempotent_and_rejects_other_models():
    model = apply_to(apply_to(tiny_model("qwen2")))
    ids = torch.randint(0, TINY["vocab_size"], (1, 4))
    assert torch.equal(model(input_ids=ids).logits, tiny_model("qwen2")(input_ids=ids).logits)
    with pytest.raises(ValueError, match="model_type"):
        apply_to(torch.nn.Linear(2, 2))


def test_patched_matches_unpatched_on_triton(triton_backend, device):
    model = tiny_model("llama").to(device)
    patched = apply_to(copy.deepcopy(model))
    ids = torch.randint(0, TINY["vocab_size"], (2, 6), device=device)
    with phalanx_kernels.use_backend("torch"):
        want_loss, want = loss_and_grads(model, ids)
    got_loss, got = loss_and_grads(patched, ids)
    assert_close(got_loss, want_loss, 1e-5, "loss")
    for name in want:
        assert_close(got[name], want[name], 1e-4, name)
