"""Incremental detokenisation (issue 36): each step decodes only a few tokens, the text equals a
full decode of the output whenever that ends in a complete character, never shows half a
character (a byte-level BPE splits "ü", "é" and CJK characters over tokens), and the engine's
outputs are unchanged."""
from __future__ import annotations

from pathlib import Path

import pytest

import inference_models as im
from phalanx.inference.detokenize import REPLACEMENT, IncrementalText

TEXT = ("Paged attention stores keys and values in fixed size pages. Grüße, naïve café: ünïcödé; "
        "春眠不觉晓，处处闻啼鸟。 The end, with 'quotes' and spaces  twice .") * 3
LLAMA_SP = Path(__file__).resolve().parents[2] / "apps/llama/data/tokenizer/llama_sentencepiece_32k.model"


def byte_level():
    return im.make_tokenizer()


def sentencepiece():
    from transformers import LlamaTokenizer

    return LlamaTokenizer(vocab_file=str(LLAMA_SP), legacy=False)


@pytest.mark.parametrize("make", [byte_level, sentencepiece], ids=["byte_level_bpe", "sentencepiece"])
def test_text_is_the_full_decode_in_whole_characters_and_each_step_decodes_a_few_tokens(make):
    tokenizer = make()
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    text, split_characters, texts = IncrementalText(), 0, []
    for n in range(1, len(ids) + 1):
        before = text.decoded_tokens
        got = text.update(tokenizer, ids[:n])
        full = tokenizer.decode(ids[:n], skip_special_tokens=True)
        assert text.decoded_tokens - before <= 16  # O(new tokens), not O(output length)
        assert REPLACEMENT not in got
        if full.endswith(REPLACEMENT):
            split_characters += 1
            assert full.startswith(got)  # what is shown is right; the half character waits
        else:
            assert got == full, n
        texts.append(got)
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # a stream only ever appends
    assert text.update(tokenizer, ids, final=True) == tokenizer.decode(ids, skip_special_tokens=True)
    assert text.decoded_tokens <= 6 * len(ids)  # linear; a full decode per step would be len(ids)**2 / 2
    if make is byte_level:
        assert split_characters > 0  # the test did meet characters split over tokens


def test_a_trailing_incomplete_character_is_kept_when_the_sequence_ends():
    tokenizer = byte_level()
    ids = tokenizer("café 春", add_special_tokens=False)["input_ids"]
    cut = next(n for n in range(1, len(ids) + 1) if tokenizer.decode(ids[:n]).endswith(REPLACEMENT))
    text = IncrementalText()
    assert REPLACEMENT not in text.update(tokenizer, ids[:cut])
    assert text.update(tokenizer, ids[:cut], final=True) == tokenizer.decode(ids[:cut])


class CountingTokenizer:
    """The test tokenizer, counting the tokens every decode is given."""

    def __init__(self, tokenizer):
        self.inner, self.decoded = tokenizer, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.inner.decode(ids, **kwargs)


def test_engine_steps_decode_a_bounded_number_of_tokens_and_the_text_is_the_full_decode():
    """64 streams of 96 tokens stepped to the end: the engine decodes O(new tokens) per step (a
    full decode per step and stream would be ~64 x 96^2 / 2 = 295k tokens), and every final text
    equals the full decode of its tokens."""
    from phalanx.inference import LLM, SamplingParams

    tokenizer = CountingTokenizer(byte_level())
    eng = LLM.from_model(im.make_model("llama", num_hidden_layers=1), tokenizer, num_blocks=1024, block_size=8,
                         max_num_seqs=64, device="cpu")
    params = SamplingParams(max_new_tokens=96, min_new_tokens=96, temperature=1.0, seed=0)
    for i, prompt in enumerate(im.mixed_prompts(64, seed=1)):
        eng.add_request(prompt, params, request_id=str(i))
    finals, steps = {}, 0
    tokenizer.decoded = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
        steps += 1
    assert len(finals) == 64
    assert tokenizer.decoded <= 6 * 64 * 96, tokenizer.decoded
    for out in finals.values():
        assert len(out.token_ids) == 96
        assert out.text == tokenizer.inner.decode(out.token_ids, skip_special_tokens=True)
