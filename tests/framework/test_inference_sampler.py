"""The sampler against Hugging Face's logits processors, plus seeding and log-probs."""
from __future__ import annotations

import pytest
import torch

import inference_models as im
from phalanx_kernels.accelerator import current_device, emulated, new_generator
from phalanx.inference.sampler import RowContext, Sampler, apply_penalties, draw, sampling_logits, sampling_probs
from phalanx.inference.sampling_params import SamplingParams

DEV = current_device()  # the emulated GPU under PHALANX_EMULATE_GPU=1, else the CPU


def rows(n, **kw):
    return [RowContext(SamplingParams(**kw)) for _ in range(n)]


def test_greedy_is_argmax():
    logits = torch.randn(5, 50, device=DEV)
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
    ours = sampling_logits(apply_penalties(logits.to(DEV, copy=True), ctx), ctx).cpu()
    want = RepetitionPenaltyLogitsProcessor(1.3)(history, logits.clone())
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.8)):
        want = warper(history, want)
    assert torch.equal(torch.isinf(ours), torch.isinf(want))
    finite = ~torch.isinf(want)
    assert torch.allclose(ours[finite], want[finite], atol=1e-6)


def test_rows_use_their_own_settings():
    logits = torch.randn(3, 30, device=DEV)
    ctx = [RowContext(SamplingParams(temperature=0)), RowContext(SamplingParams(top_k=1)),
           RowContext(SamplingParams(top_p=1e-6))]
    probs = sampling_probs(logits.clone(), ctx)
    for r in range(3):  # each of these leaves only the most likely token
        assert probs[r].argmax() == logits[r].argmax() and abs(probs[r].max().item() - 1) < 1e-6


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-9]], device=DEV))
    g = new_generator(DEV).manual_seed(1)
    draws = [Sampler()(logits, [RowContext(SamplingParams(), generator=g)]).token_ids[0] for _ in range(3000)]
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / 3000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.035)


def test_seeded_rows_are_independent_of_the_batch():
    logits = torch.randn(4, 100, device=DEV)

    def draw(order):
        gens = {i: new_generator(DEV).manual_seed(100 + i) for i in order}
        out = Sampler()(logits[order], [RowContext(SamplingParams(temperature=1.0), generator=gens[i]) for i in order])
        return dict(zip(order, out.token_ids, strict=True))

    assert draw([0, 1, 2, 3]) == draw([3, 1, 0, 2])


def test_banned_tokens_and_logprobs():
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]], device=DEV)
    out = Sampler()(logits, [RowContext(SamplingParams(temperature=0, logprobs=2), banned=[0])])
    assert out.token_ids == [1]
    logp = torch.log_softmax(logits, -1)[0]
    assert abs(out.logprobs[0] - logp[1].item()) < 1e-6  # the raw model's log-prob, ban or not
    assert list(out.top_logprobs[0]) == [0, 1]


def test_speculative_rejection_sampling_keeps_the_target_distribution():
    """Whatever the draft proposes, each emitted token follows the target's distribution."""
    from phalanx.inference.speculative import DraftModelProposer, SpeculativeDecoder

    target_p, draft_q = [0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]
    spec = SpeculativeDecoder(im.FixedLogits(target_p), DraftModelProposer(im.FixedLogits(draft_q)), num_tokens=2)
    firsts, seconds = im.speculative_draws(spec, [1, 2, 3], SamplingParams(temperature=1.0, max_new_tokens=8))
    for draws in (firsts, seconds):
        freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
        assert torch.allclose(freq, torch.tensor(target_p), atol=0.03), freq
    assert 0 < spec.acceptance_rate < 1


def test_speculative_acceptance_of_a_whole_batch_at_once(monkeypatch):
    """Five sequences verified in one call, with outcomes that do not depend on the draws: greedy
    accepting one, rejecting one (the proposal after it would pass: acceptance stops at the first
    rejection) and correcting, greedy accepting all then the bonus, sampled accepting
    (p >= q) then rejecting (p = 0) and drawing from the residual max(p - q, 0), whose only mass is
    where p holds 10%, sampled with no proposal,
    sampled accepting then drawing a one-hot bonus. The acceptance is computed for every position
    at once: no value is read back to the host inside it (one transfer after it)."""
    from phalanx.inference.sequence import Sequence
    from phalanx.inference.speculative import SpeculativeDecoder

    def one_hot(t, high=1.0):
        row = torch.full((5,), (1 - high) / 4)
        row[t] = high
        return row

    greedy, sampled = SamplingParams(temperature=0, max_new_tokens=8), SamplingParams(temperature=1.0, max_new_tokens=8)
    seqs = [Sequence(f"s{i}", [1, 2, 3], p, generator=new_generator(DEV).manual_seed(i))
            for i, p in enumerate([greedy, sampled, sampled, greedy, sampled])]
    drafts = [[2, 1, 4], [1, 2], [], [0, 1], [3]]
    target = [one_hot(2, .6), one_hot(3, .6), one_hot(4, .6), one_hot(0, .6),  # s0: 2 accepted, 1 corrected to 3
              torch.tensor([.1, .6, .1, .1, .1]), torch.tensor([0, 0, 0, .1, .9]), one_hot(0, .5),  # s1: 1; 2 (p=0)
              one_hot(4),  # s2: no proposal, draws 4
              one_hot(0, .6), one_hot(1, .6), one_hot(2, .6),  # s3: all accepted, bonus 2
              one_hot(3), one_hot(0)]  # s4: 3 accepted (p = q = 1), bonus 0
    draft = [[one_hot(2, .4)] * 3, [torch.tensor([.2, .3, .2, .2, .1]), torch.tensor([0, 0, .1, 0, .9])], [],
             [one_hot(0, .4)] * 2,
             [one_hot(3)]]
    target_probs = torch.stack(target).to(DEV)
    draft_probs = [[q.to(DEV) for q in qs] for qs in draft]
    rows = [RowContext(s.params, s.generator) for s, d in zip(seqs, drafts) for _ in range(len(d) + 1)]
    spec = SpeculativeDecoder(None, None, num_tokens=3)
    reads = []
    for name in ("tolist", "item", "__bool__"):
        method = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _m=method, _n=name: reads.append(_n) or _m(self, *a))
    n_acc, last = spec._verify(seqs, drafts, draft_probs, rows, target_probs)
    assert reads == [], f"values read back to the host while verifying: {reads}"
    monkeypatch.undo()
    assert n_acc.tolist() == [1, 1, 0, 2, 1] and last.tolist() == [3, 3, 4, 2, 0]
    out = spec._emit(drafts, rows, target_probs.clamp_min(1e-9).log(), n_acc.tolist(), last.tolist())
    assert [[e.token_id for e in o] for o in out] == [[2, 3], [1, 3], [4], [0, 1, 2], [3, 0]]
    assert (spec.num_proposed, spec.num_accepted) == (8, 5)


def test_logit_bias_and_repetition_penalty_match_transformers_processors():
    """logit_bias is HF's SequenceBiasLogitsProcessor with one-token sequences, applied before the
    repetition penalty (HF's order), then temperature / top-k / top-p."""
    from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    torch.manual_seed(1)
    logits = torch.randn(3, 64) * 3
    history = torch.randint(0, 64, (3, 12))
    bias = {5: 4.0, 17: -2.5, 40: -100.0, int(history[0, 0]): 1.5}
    params = SamplingParams(temperature=0.8, top_k=30, top_p=0.9, repetition_penalty=1.4, logit_bias=bias)
    ctx = [RowContext(params, history=history[i].tolist()) for i in range(3)]
    ours = sampling_logits(apply_penalties(logits.to(DEV, copy=True), ctx), ctx).cpu()
    want = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(history, logits.clone())
    for proc in (RepetitionPenaltyLogitsProcessor(1.4), TemperatureLogitsWarper(0.8), TopKLogitsWarper(30),
                 TopPLogitsWarper(0.9)):
        want = proc(history, want)
    assert torch.equal(torch.isinf(ours), torch.isinf(want))
    finite = ~torch.isinf(want)
    assert torch.allclose(ours[finite], want[finite], atol=1e-6)


def test_presence_and_frequency_penalties_follow_openai_rule_by_hand():
    """logit[t] -= frequency * count(t) + presence * (count(t) > 0), counting generated tokens only
    (the prompt is not penalised)."""
    logits = torch.randn(2, 20)
    generated = [[3, 3, 3, 7, 11], []]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    ctx = [RowContext(params, generated=g, history=[1, 2, 3] + g) for g in generated]
    got = apply_penalties(logits.to(DEV, copy=True), ctx).cpu()
    want = logits.clone()
    for t, count in ((3, 3), (7, 1), (11, 1)):
        want[0, t] -= 0.25 * count + 0.5
    assert torch.equal(got, want)
    negative = apply_penalties(logits.to(DEV, copy=True), [RowContext(SamplingParams(presence_penalty=-2.0, frequency_penalty=-1),
                                                           generated=[4, 4])]).cpu()
    assert negative[0, 4] == logits[0, 4] + 2.0 + 2.0


def test_bias_changes_the_greedy_choice_but_not_the_raw_logprobs():
    logits = torch.tensor([[3.0, 2.0, 0.0]], device=DEV)
    out = Sampler()(logits, [RowContext(SamplingParams(temperature=0, logprobs=1, logit_bias={0: -5}))])
    assert out.token_ids == [1]
    assert abs(out.logprobs[0] - torch.log_softmax(logits, -1)[0, 1].item()) < 1e-6  # the model's, unbiased
    tracked = Sampler()(logits, [RowContext(SamplingParams(temperature=0), track_logprob=True)])
    assert tracked.token_ids == [0] and abs(tracked.logprobs[0] - torch.log_softmax(logits, -1)[0, 0].item()) < 1e-6


def test_stop_strings_are_found_across_token_boundaries_and_held_back_while_streaming():
    from phalanx.inference.sequence import Sequence
    from phalanx.inference.stopping import StopChecker, streamable_prefix

    pieces = {10: "Hel", 11: "lo wo", 12: "rld!", 13: " And", 14: "\xe9"}

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(pieces[i] for i in ids)

    checker = StopChecker(Tok(), eos_token_ids={2}, max_model_len=100)
    s = Sequence("r", [1], SamplingParams(stop=["world", "xyz"], max_new_tokens=10))
    texts = []
    for token in (10, 11, 12, 13):
        s.token_ids.append(token)
        done = checker.check(s)
        texts.append(checker.decode(s))
        if done:
            break
    assert done and s.stop_reason == "world" and s.text == "Hello " and s.num_output_tokens == 3
    # while streaming, "Hello wo" may still become "Hello world": only "Hello " may be sent
    assert streamable_prefix(texts[1], ["world", "xyz"]) == len("Hello ")
    assert streamable_prefix("Hello x", ["world", "xyz"]) == len("Hello ")
    assert streamable_prefix("Hello there", ["world"]) == len("Hello there")
    assert streamable_prefix("caf\ufffd", []) == 3  # an unfinished UTF-8 character waits too


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "n=0"),
    (dict(n=2, best_of=1), "best_of"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty="1"), "frequency_penalty"),
    (dict(logit_bias={"x": 1}), "logit_bias key"),
    (dict(logit_bias={3: 101}), r"logit_bias\[3\]"),
    (dict(logit_bias=[1, 2]), "must be a dict"),
    (dict(echo=1), "echo"),
    (dict(logprobs=True), "logprobs"),
])
def test_openai_sampling_fields_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_openai_sampling_field_defaults_and_json_keys():
    p = SamplingParams(n=3, logit_bias={"50": -100, 7: 2})
    assert p.best_of == 3 and p.logit_bias == {50: -100.0, 7: 2.0} and p.has_penalties
    assert not SamplingParams().has_penalties and SamplingParams().best_of == 1


@pytest.mark.skipif(not emulated(), reason="counts device -> host syncs on the emulated GPU (PHALANX_EMULATE_GPU=1; "
                                           "tests/emulated/test_inference_emulated.py runs it)")
def test_a_batch_of_sampled_rows_syncs_with_the_host_once():
    """However many rows draw with their own generator, ask for penalties, log-probs or processed
    log-probs, the sampler brings its results to the host in one device -> host sync (it used to
    wait once per sampled row), and draws the tokens a row-by-row draw with the same seeds gives."""
    from phalanx.emulate import SYNCS

    torch.manual_seed(3)
    logits = torch.randn(8, 64, device=DEV) * 3
    settings = [dict(temperature=0.9, top_k=20, logprobs=3), dict(temperature=0.7, top_p=0.8, processed_logprobs=True),
                dict(temperature=1.1, presence_penalty=0.5, frequency_penalty=0.3, logprobs=1),
                dict(temperature=0.8, repetition_penalty=1.3, logit_bias={5: 3.0}), dict(temperature=0, logprobs=2),
                dict(temperature=1.0, processed_logprobs=True, logprobs=0), dict(temperature=0),
                dict(temperature=0.6, top_k=5, top_p=0.9)]

    def ctx(seed):
        return [RowContext(SamplingParams(**kw), generator=None if kw["temperature"] == 0 else
                           new_generator(DEV).manual_seed(seed + i), history=[1, 3, 3, 5], generated=[3, 3, 5],
                           banned=[7] if i == 2 else None) for i, kw in enumerate(settings)]

    rows = ctx(10)
    SYNCS.reset()
    out = Sampler()(logits, rows)
    assert SYNCS.count == 1, f"{SYNCS.count} device -> host syncs for one step of 8 rows: {dict(SYNCS.by_op)}"
    SYNCS.reset()
    Sampler()(logits, [RowContext(SamplingParams(temperature=0)) for _ in range(8)])  # the greedy fast path
    assert SYNCS.count == 1, dict(SYNCS.by_op)

    # the same tokens and log-probs as a row-by-row reference with the same seeds
    ref_rows = ctx(10)
    work = apply_penalties(logits.float().clone(), ref_rows)
    probs = sampling_probs(work.clone(), ref_rows)
    logp = torch.log_softmax(logits.float(), -1).cpu()
    for i, r in enumerate(ref_rows):
        want = int(work[i].argmax()) if r.params.greedy else draw(probs[i], r.generator)
        assert out.token_ids[i] == want, i
        if r.wants_logprob:
            assert out.logprobs[i] == pytest.approx(float(logp[i, want]), abs=1e-6)
        if r.params.logprobs:
            top = logp[i].topk(r.params.logprobs)
            assert list(out.top_logprobs[i]) == top.indices.tolist()
        if r.params.processed_logprobs:
            assert out.processed_logprobs[i] == pytest.approx(float(torch.log(probs[i, want])), abs=1e-5)
