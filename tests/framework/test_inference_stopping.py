"""Stop strings found from a tail of the output (StopChecker) cut exactly where a full decode
of every step would, including stop strings of multi-byte characters, and each step decodes
only a bounded tail."""
from __future__ import annotations

import pytest

import inference_models as im
from phalanx.inference.sampling_params import SamplingParams
from phalanx.inference.sequence import Sequence
from phalanx.inference.stopping import StopChecker

FILLER = ("Paged attention stores keys and values in fixed size pages, the scheduler admits a request "
          "when its pages fit, and preempts the newest one when they do not. ") * 4
TEXT = FILLER + "Grüße, naïve café: ünïcödé blocks; the stop lies far from the start."


class CountingTokenizer:
    """The test tokenizer, recording how many tokens each decode call was given."""

    def __init__(self, tokenizer):
        self.inner, self.decoded_lengths = tokenizer, []

    def decode(self, ids, **kwargs):
        self.decoded_lengths.append(len(ids))
        return self.inner.decode(ids, **kwargs)


def first_stop_by_full_decode(tokenizer, ids: list[int], stop: str) -> int | None:
    """The reference: decode everything after every token; the number of tokens at the stop."""
    for n in range(1, len(ids) + 1):
        if stop in tokenizer.decode(ids[:n], skip_special_tokens=True):
            return n
    return None


@pytest.mark.parametrize("stop", ["stop lies", "café", "ünïc", "blocks;"])
def test_tail_search_stops_where_a_full_decode_would(stop):
    tokenizer = im.make_tokenizer()
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    want = first_stop_by_full_decode(tokenizer, ids, stop)
    assert want is not None and want > 4 * len(stop) + 8  # the tail window is shorter than the output
    counting = CountingTokenizer(tokenizer)
    checker = StopChecker(counting, eos_token_ids=set(), max_model_len=10_000)
    seq = Sequence("r", [1], SamplingParams(max_new_tokens=len(ids) + 1, stop=[stop]))
    for n, token in enumerate(ids, start=1):
        seq.token_ids.append(token)
        if checker.check(seq):
            break
    assert n == want and seq.finish_reason == "stop" and seq.stop_reason == stop
    assert seq.text == tokenizer.decode(ids[:n], skip_special_tokens=True).split(stop)[0]
    window = 4 * len(stop) + 8
    # per step one decode of at most `window` tokens (the whole output while it is shorter);
    # the full text once more, to cut it
    assert counting.decoded_lengths == [min(k, window) for k in range(1, n + 1)] + [n]
