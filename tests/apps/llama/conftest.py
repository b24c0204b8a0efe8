"""Shared fixtures: the tiny recipe config, shrunk further, and its steps 1–3 run once per session."""
from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "apps" / "llama" / "configs" / "tiny.yaml"
DATA = REPO / "apps" / "llama" / "data"


def tiny_config(work_dir: Path, *overrides: str):
    """tiny.yaml with small corpus slices (each step takes seconds) and everything under work_dir."""
    from apps.llama.config import load_recipe

    cfg = load_recipe(TINY, [f"work_dir={work_dir}", "data.seq_len=64", "eval.max_chars_per_category=1500",
                             "tokenizer.domain_vocab_size=5000", *overrides])
    cfg.tokenizer.domain_sources[0].max_chars = 120_000
    for source, limit in zip(cfg.data.sources, (40_000, 20_000, 10_000), strict=True):
        source.max_chars = limit
    return cfg


@pytest.fixture(scope="session")
def make_tiny_config():
    return tiny_config


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """Steps 1–3 of the tiny recipe (expand vocab, init model, prepare data) in a session tmp dir."""
    from apps.llama.expand_vocab import expand_vocab
    from apps.llama.init_model import init_model
    from apps.llama.prepare_data import prepare_pretrain, prepare_sft

    work = tmp_path_factory.mktemp("llama_tiny")
    cfg = tiny_config(work)
    cfg.sft_data.sources[0].max_examples = 40
    cfg.sft_data.sources[1].max_examples = 40
    reports = {"vocab": expand_vocab(cfg), "init": init_model(cfg), "data": prepare_pretrain(cfg),
               "sft": prepare_sft(cfg)}
    return cfg, reports


def _english_text() -> list[str]:
    from apps.llama.corpus import SourceConfig, read_documents

    source = SourceConfig(path=str(DATA / "shakespeare_4plays.txt.gz"), min_doc_chars=500, max_docs=400)
    return [d.text for d in read_documents(source)]


@pytest.fixture(scope="session")
def tiny_bpe_dir(tmp_path_factory):
    """A small byte-level BPE 'base' tokenizer trained on English only, saved as an HF directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_english_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>")
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    out = tmp_path_factory.mktemp("tiny_bpe")
    fast.save_pretrained(str(out))
    return out
