"""The sampler against Hugging Face's logits processors, plus seeding and log-probs."""
from __future__ import annotations

import torch

from phalanx.inference.sampler import RowContext, Sampler, apply_penalties, sampling_logits, sampling_probs
from phalanx.inference.sampling_params import SamplingParams


def rows(n, **kw):
    return [RowContext(SamplingParams(**kw)) for _ in range(n)]


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    out = Sampler()(logits, rows(5, temperature=0))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_temperature_top_k_top_p_match_transformers_warpers():
    from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    torch.manual_seed(0)
    logits = torch.randn(4, 64) * 3
    history = torch.randint(0, 64, (4, 10))
    params = dict(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.3)
    ctx = [RowContext(SamplingParams(**params), history=history[i].tolist()) for i in range(4)]
    ours = sampling_logits(apply_penalties(logits.clone(), ctx), ctx)
    want = RepetitionPenaltyLogitsProcessor(1.3)(history, logits.clone())
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.8)):
        want = warper(history, want)
    assert torch.equal(torch.isinf(ours), torch.isinf(want))
    finite = ~torch.isinf(want)
    assert torch.allclose(ours[finite], want[finite], atol=1e-6)


def test_rows_use_their_own_settings():
    logits = torch.randn(3, 30)
    ctx = [RowContext(SamplingParams(temperature=0)), RowContext(SamplingParams(top_k=1)),
           RowContext(SamplingParams(top_p=1e-6))]
    probs = sampling_probs(logits.clone(), ctx)
    for r in range(3):  # each of these leaves only the most likely token
        assert probs[r].argmax() == logits[r].argmax() and abs(probs[r].max().item() - 1) < 1e-6


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-9]]))
    g = torch.Generator().manual_seed(1)
    draws = [Sampler()(logits, [RowContext(SamplingParams(), generator=g)]).token_ids[0] for _ in range(3000)]
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / 3000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.035)


def test_seeded_rows_are_independent_of_the_batch():
    logits = torch.randn(4, 100)

    def draw(order):
        gens = {i: torch.Generator().manual_seed(100 + i) for i in order}
        out = Sampler()(logits[order], [RowContext(SamplingParams(temperature=1.0), generator=gens[i]) for i in order])
        return dict(zip(order, out.token_ids))

    assert draw([0, 1, 2, 3]) == draw([3, 1, 0, 2])


def test_banned_tokens_and_logprobs():
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]])
    out = Sampler()(logits, [RowContext(SamplingParams(temperature=0, logprobs=2), banned=[0])])
    assert out.token_ids == [1]
    logp = torch.log_softmax(logits, -1)[0]
    assert abs(out.logprobs[0] - logp[1].item()) < 1e-6  # the raw model's log-prob, ban or not
    assert list(out.top_logprobs[0]) == [0, 1]


class _FixedLogits:
    """A stand-in model runner whose every position predicts the same distribution."""

    def __init__(self, probs):
        self.logits = torch.log(torch.tensor(probs))

    def execute(self, chunks):
        return self.logits.repeat(sum(c.num_logits for c in chunks), 1)


def test_speculative_rejection_sampling_keeps_the_target_distribution():
    """Whatever the draft proposes, each emitted token follows the target's distribution."""
    from phalanx.inference.sequence import Sequence
    from phalanx.inference.speculative import SpeculativeDecoder

    target_p, draft_q = [0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]
    spec = SpeculativeDecoder(_FixedLogits(target_p), _FixedLogits(draft_q), num_tokens=2)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    firsts, seconds = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny ops: thread wake-ups would dominate on a busy machine
    try:
        for _ in range(4000):
            seq = Sequence("s", [1, 2, 3], params, generator=g)
            out = spec.step([seq], lambda s, extra, history: RowContext(s.params, s.generator))[0]
            firsts.append(out[0].token_id)
            if len(out) > 1:
                seconds.append(out[1].token_id)
    finally:
        torch.set_num_threads(threads)
    for draws in (firsts, seconds):
        freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
        assert torch.allclose(freq, torch.tensor(target_p), atol=0.03), freq
    assert 0 < spec.acceptance_rate < 1
