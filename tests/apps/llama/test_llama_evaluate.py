"""Bits per character: equal to the model's summed NLL over the text's characters, batch-independent."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from apps.llama.evaluate import Chunk, bits_per_char, make_chunks


def test_chunks_depend_on_text_only_and_cover_it():
    texts = ["床前明月光，\n疑是地上霜。\n举头望明月，\n低头思故乡。\n", "x" * 25, "short"]
    chunks = make_chunks(texts, ["zh", "en", "en"], chunk_chars=10, max_chars_per_category=0)
    assert all(len(c.text) <= 10 for c in chunks)
    assert "".join(c.text for c in chunks if c.category == "zh") == texts[0]
    assert "".join(c.text for c in chunks if c.category == "en") == texts[1] + texts[2]
    assert chunks[0].text == "床前明月光，\n"  # cut after a line break when one is near
    limited = make_chunks(texts, ["zh", "en", "en"], chunk_chars=10, max_chars_per_category=12)
    assert sum(len(c.text) for c in limited if c.category == "zh") <= 12 + 10


def test_bits_per_char_matches_a_direct_computation(tiny_run):
    from transformers import AutoModelForCausalLM

    from apps.llama.tokenizer_io import load_tokenizer

    cfg, _ = tiny_run
    tok = load_tokenizer(cfg.tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(str(cfg.model_init_dir), dtype=torch.float32)
    chunks = [Chunk("春眠不觉晓，处处闻啼鸟。", "zh"), Chunk("夜来风雨声，\n花落知多少。", "zh"),
              Chunk("To be, or not to be: that is the question.", "en")]
    result = bits_per_char(model, tok, chunks, batch_size=2)

    nll = {"zh": 0.0, "en": 0.0}
    with torch.no_grad():
        for c in chunks:
            ids = torch.tensor([[tok.eos_token_id] + tok(c.text, add_special_tokens=False)["input_ids"]])
            logits = model(input_ids=ids).logits[0, :-1]
            nll[c.category] += F.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
    for cat in ("zh", "en"):
        chars = sum(len(c.text) for c in chunks if c.category == cat)
        expected = nll[cat] / math.log(2) / chars
        assert math.isclose(result[cat]["bpc"], expected, rel_tol=1e-4)
        assert math.isclose(result[cat]["char_ppl"], 2 ** expected, rel_tol=1e-3)
        assert result[cat]["chars"] == chars
    # padding and batching do not change the numbers, and a training model stays in training mode
    model.train()
    alone = bits_per_char(model, tok, chunks, batch_size=1)
    assert all(math.isclose(alone[c]["bpc"], result[c]["bpc"], rel_tol=1e-4) for c in result)
    assert model.training
