"""Shared fixtures: a tiny Llama chat model (BPE tokenizer trained on the shipped data, ChatML
template) saved as a Hugging Face directory, so tests run in seconds and need no download."""
from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
DATA = REPO / "apps" / "chat_rlhf" / "data"
DPO_DEMO = DATA / "llamafactory_demo" / "dpo_en_demo.jsonl"
KTO_DEMO = DATA / "llamafactory_demo" / "kto_en_demo.jsonl"
HH = DATA / "hh_rlhf_harmless" / "harmless-base_test.jsonl.gz"
GSM8K = DATA / "gsm8k" / "test.jsonl"

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def build_tiny_chat_model(directory: Path, vocab_size: int = 384, hidden: int = 32, layers: int = 2) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from apps.chat_rlhf.data import load_records

    texts = [m["content"] for r in load_records(DPO_DEMO, "preference", max_records=60)
             for m in r["prompt"] + r["chosen"] + r["rejected"]]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<|endoftext|>", bos_token="<|im_start|>",
                                        eos_token="<|im_end|>", pad_token="<|im_end|>")
    tokenizer.chat_template = CHATML
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat") / "model")


@pytest.fixture
def launched():
    """A one-process group, as `python -m apps.chat_rlhf.<command>` has (fit needs one)."""
    import phalanx

    phalanx.launch(seed=0)
    try:
        yield
    finally:
        phalanx.shutdown()


def tiny_overrides(model: Path, out: Path, *extra: str) -> list[str]:
    """Small, fast settings for the preference commands on the tiny model."""
    return [f"model={model}", f"train.output_dir={out}", "data.max_records=40", "data.max_prompt_tokens=24",
            "data.max_completion_tokens=12", "train.max_steps=2", "train.micro_batch_size=4", "train.lr=1e-3",
            "train.progress_bar=false", "train.plot=false", "train.peak_tflops=0", *extra]
