"""Tiny Llama / Qwen2 / Mistral / Qwen3 / GPT-2 / OPT models and a tiny BPE tokenizer, saved as Hugging Face
directories, for the inference tests. Nothing downloads.

The models use a large init range so their next-token distributions are peaked: greedy argmax
then has clear margins, and token-identity checks against `transformers` test the engine rather
than float rounding between near-tied logits.
"""
from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step.",
    "Paged attention stores keys and values in fixed-size blocks; a block table maps positions to blocks.",
    "Continuous batching admits new requests at every step and retires finished ones at once.",
    "Tensor parallel inference splits attention heads and MLP columns across ranks, then all-reduces.",
    "Speculative decoding lets a small draft model propose tokens that the large model verifies.",
    "Hello world! How are you today? I am fine, thank you. What is the weather like in Paris?",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 2024. Punctuation: , . ; : ! ? ( ) [ ] { }",
] * 20

VOCAB = 384


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def model_config(family: str = "llama", **overrides):
    from transformers import GPT2Config, LlamaConfig, MistralConfig, OPTConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa")
    if family == "gpt2":
        return GPT2Config(**{**common, **dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, n_inner=128,
                                               initializer_range=0.25), **overrides})
    if family == "opt":
        return OPTConfig(**{**common, **dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                              max_position_embeddings=256, word_embed_proj_dim=64, init_std=0.25,
                                              dropout=0.0), **overrides})
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "qwen3": Qwen3Config}[family]
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.25, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa")
    if family == "mistral":
        kwargs["sliding_window"] = 24  # shorter than the tests' sequences: the window matters
    if family == "qwen2":
        kwargs["tie_word_embeddings"] = True
    if family == "qwen3":
        kwargs["head_dim"] = 24  # not hidden / heads (16): the q/k norms and caches must use head_dim
    kwargs.update(overrides)
    return cls(**kwargs)


def make_model(family: str = "llama", seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(family, **overrides))
    if family == "qwen2":  # HF initialises biases to zero; random ones test that they are loaded
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    with torch.no_grad():  # HF initialises norm weights to one and biases to zero: random ones test loading
        for name, param in model.named_parameters():
            if ("norm" in name or "ln_" in name or "layer_norm" in name) and family in ("qwen3", "gpt2", "opt"):
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
            elif name.endswith("bias") and family in ("gpt2", "opt"):
                param.normal_(0, 0.2)
    return model.eval()


def save_model(directory: Path, family: str = "llama", seed: int = 0, tokenizer=None, **overrides):
    """Save a tiny model (and the tokenizer) as an HF directory; returns (path, model)."""
    model = make_model(family, seed, **overrides)
    directory = Path(directory)
    model.save_pretrained(directory)
    (tokenizer or make_tokenizer()).save_pretrained(directory)
    return directory, model


def mixed_prompts(count: int, seed: int = 0, low: int = 3, high: int = 40) -> list[list[int]]:
    """Token-id prompts of mixed lengths (no special tokens)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g).tolist()
    return [torch.randint(5, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt (no padding)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_greedy_batch(model, prompts: list[list[int]], max_new_tokens: int, device: str = "cpu") -> list[list[int]]:
    """transformers' greedy continuations of a left-padded batch, cut after the first EOS."""
    from phalanx.testing import left_padded

    ids, mask = left_padded(prompts)
    with torch.no_grad():
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    eos = model.generation_config.eos_token_id
    result = []
    for row in out[:, ids.shape[1]:].tolist():
        if eos in row:
            row = row[:row.index(eos) + 1]
        result.append(row)
    return result


def check_against_transformers(eng, model, prompts: list[list[int]], new_tokens: int = 16,
                               logprob_atol: float = 1e-4) -> None:
    """The engine's greedy tokens equal transformers' and its log-probs are within `logprob_atol`
    of the model's own (fp32), and every KV block is free afterwards."""
    from phalanx.inference import SamplingParams

    outs = eng.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=0, logprobs=0))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(model, prompt, new_tokens)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt + out.token_ids])).logits[0].float(), -1)
        want = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out.token_ids)]
        assert max(abs(a - b) for a, b in zip(out.logprobs, want, strict=True)) < logprob_atol
    assert eng.block_manager.all_free()


def make_adapter(directory, seed: int, base_overrides: dict | None = None, **fields):
    """A PEFT adapter (`fields`: peft.LoraConfig's) on the tiny Llama (its config changed by
    `base_overrides`) with random (non-zero) B, saved to `directory`; returns the adapter's merged
    model (peft's merge_and_unload) in fp32."""
    import peft

    torch.manual_seed(seed)
    model = peft.get_peft_model(make_model("llama", **(base_overrides or {})), peft.LoraConfig(**fields))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    model.save_pretrained(str(directory))
    return model.merge_and_unload().eval()


class FixedLogits:
    """A stand-in model runner whose every position predicts the distribution `probs` (a list)."""

    def __init__(self, probs):
        self.logits = torch.log(torch.tensor(probs))

    def execute(self, chunks):
        return self.logits.repeat(sum(c.num_logits for c in chunks), 1)


def speculative_draws(spec, tokens: list[int], params, draws: int = 4000, seed: int = 0):
    """The first and (when the first was accepted) second tokens of `draws` speculative steps of
    `spec` on a sequence of `tokens` sampled with `params`, one thread (thousands of tiny ops:
    thread wake-ups would dominate on a busy machine)."""
    from phalanx.inference.sampler import RowContext
    from phalanx.inference.sequence import Sequence

    g = torch.Generator().manual_seed(seed)
    firsts, seconds = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(draws):
            seq = Sequence("s", list(tokens), params, generator=g)
            out = spec.step([seq], lambda s, extra, history: RowContext(s.params, s.generator))[0]
            firsts.append(out[0].token_id)
            if len(out) > 1:
                seconds.append(out[1].token_id)
    finally:
        torch.set_num_threads(threads)
    return firsts, seconds


def save_looping_model(directory: Path, cycle: int = 6, seed: int = 1):
    """A tiny llama whose greedy output runs around cycles of `cycle` tokens, as small models'
    greedy output often loops (a random model's never repeats): attention and MLP outputs zeroed,
    so the last hidden state is the token's embedding, and the LM head's row of succ(x) is x's
    embedding. Saved with the tokenizer; returns (path, model, succ)."""
    model = make_model("llama")
    order = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))
    cycles = order.view(-1, cycle)
    succ = torch.empty(VOCAB, dtype=torch.long)
    succ[cycles] = cycles.roll(-1, dims=1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight[succ] = model.model.embed_tokens.weight.clone()
    directory = Path(directory)
    model.save_pretrained(directory)
    make_tokenizer().save_pretrained(directory)
    return directory, model, succ
