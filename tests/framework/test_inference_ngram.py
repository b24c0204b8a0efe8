"""N-gram speculation ("prompt lookup", `phalanx.inference.ngram`): proposals copied from the
sequence itself and verified by the target model — greedy tokens unchanged, sampled tokens still
distributed as the target's, fewer model steps where the output repeats."""
from __future__ import annotations

import pytest
import torch

import inference_models as im
from phalanx.inference import LLM, SamplingParams
from phalanx.inference.ngram import NgramProposer, lookup
from phalanx.inference.speculative import SpeculativeDecoder

GREEDY = SamplingParams(max_new_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return im.save_model(tmp_path_factory.mktemp("ngram") / "llama", "llama", tokenizer=im.make_tokenizer())


@pytest.fixture(scope="module")
def looping(tmp_path_factory):
    return im.save_looping_model(tmp_path_factory.mktemp("ngram") / "looping")


def engine(path, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_blocks", 96)
    kw.setdefault("block_size", 8)
    return LLM(str(path), **kw)


def counting_steps(eng) -> list[int]:
    """The target model's calls, counted (one per engine step that runs the model)."""
    calls, execute = [0], eng.runner.execute

    def counted(chunks, *args, **kwargs):
        calls[0] += 1
        return execute(chunks, *args, **kwargs)

    eng.runner.execute = counted
    return calls


def test_lookup_proposes_what_followed_the_longest_match():
    assert lookup([1, 2, 3, 4, 1, 2], k=3) == [3, 4, 1]  # suffix [1, 2] seen at 0
    assert lookup([7, 1, 9, 5, 1, 2, 6, 2], k=2) == [6, 2]  # only [2] matches (at 5)
    assert lookup([1, 2, 8, 3, 1, 2], k=2, max_n=2) == [8, 3]
    # the longest suffix wins over a later, shorter match: [3, 1, 2] seen at 0, [2] also at 5
    assert lookup([3, 1, 2, 4, 5, 2, 9, 3, 1, 2], k=2, max_n=3) == [4, 5]
    assert lookup([3, 1, 2, 4, 5, 2, 9, 3, 1, 2], k=2, max_n=1) == [9, 3]  # [2] last seen at 5
    # the latest occurrence with k tokens after it: a loop proposes a whole turn, not its cut end
    assert lookup([1, 2, 1, 2, 1, 2, 1], k=3, max_n=1) == [2, 1, 2]
    assert lookup([5, 6, 7], k=2) == [] and lookup([4], k=2) == [] and lookup([1, 2, 1], k=0) == []
    assert lookup([1, 2, 9, 1], k=4, min_n=2) == []  # only a 1-gram matches
    assert lookup([1, 1, 1, 1], k=3, max_n=3) == [1]  # k tokens after no occurrence: the latest's


def test_ngram_speculation_keeps_greedy_tokens_in_fewer_steps(looping):
    """A batch whose greedy outputs loop (with a forked request): the tokens of transformers' greedy
    decoding, the loops' proposals accepted once a turn has been seen, so the model runs fewer
    steps than without; every block freed."""
    path, model, succ = looping
    prompts = im.mixed_prompts(6, seed=12, low=5, high=25)
    want = im.hf_greedy_batch(model, prompts, GREEDY.max_new_tokens)
    assert all(out[i + 1] == succ[out[i]] for out in want for i in range(len(out) - 1))  # the model loops
    plain = engine(path)
    plain_steps = counting_steps(plain)
    assert [o.token_ids for o in plain.generate(prompts, GREEDY)] == want
    eng = engine(path, prompt_lookup_max=3, num_speculative_tokens=4)
    steps = counting_steps(eng)
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == want
    assert eng.speculator.num_accepted >= 50 and eng.block_manager.all_free()
    assert steps[0] <= plain_steps[0] // 2, (steps, plain_steps)
    forked = eng.generate(prompts[0], SamplingParams(n=2, max_new_tokens=24, temperature=0))[0]
    assert [o.token_ids for o in forked.outputs] == [want[0]] * 2 and eng.block_manager.all_free()


def test_ngram_speculation_of_a_random_model_keeps_its_tokens(llama):
    """Outputs that seldom repeat: few proposals, most rejected, the same greedy tokens."""
    path, model = llama
    prompts = im.mixed_prompts(5, seed=10, low=4, high=30)
    eng = engine(path, prompt_lookup_max=2, num_speculative_tokens=3)
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == im.hf_greedy_batch(model, prompts, 24)
    assert eng.speculator.num_proposed > eng.speculator.num_accepted and eng.block_manager.all_free()


def test_ngram_speculation_at_the_context_limit_and_with_the_pool_nearly_full(looping):
    """Proposals are bounded by what max_model_len and the free blocks leave (the scheduler's
    lookahead): runs to the context limit and in a nearly full pool give the plain engine's tokens."""
    path, _, _ = looping
    prompts = im.mixed_prompts(4, seed=11, low=10, high=30)
    limit = 48
    to_the_limit = [SamplingParams(max_new_tokens=limit - len(p), temperature=0, ignore_eos=True) for p in prompts]
    plain = engine(path, max_model_len=limit).generate(prompts, to_the_limit)
    spec = engine(path, max_model_len=limit, prompt_lookup_max=3, num_speculative_tokens=4)
    got = spec.generate(prompts, to_the_limit)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert all(len(p) + len(o.token_ids) == limit for p, o in zip(prompts, got, strict=True))
    assert spec.speculator.num_accepted > 20 and spec.block_manager.all_free()
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    want = engine(path, num_blocks=12).generate(prompts, params)
    tight = engine(path, num_blocks=12, prompt_lookup_max=3, num_speculative_tokens=4)
    assert [o.token_ids for o in tight.generate(prompts, params)] == [o.token_ids for o in want]
    assert tight.speculator.num_accepted > 0 and tight.block_manager.all_free()


def test_phalanx_serve_with_ngram_speculation_answers_and_counts_proposals(looping):
    """Over HTTP (`phalanx serve --prompt-lookup-max`): the completion of the plain engine, and
    /metrics counts the proposed and accepted tokens."""
    import httpx

    from phalanx.inference.serve import build_parser
    from phalanx.inference.server import OpenAIServer
    from serving_helpers import parse_metrics

    path, _, _ = looping
    args = build_parser().parse_args([str(path), "--prompt-lookup-max", "3", "--prompt-lookup-min", "2"])
    assert (args.prompt_lookup_max, args.prompt_lookup_min) == (3, 2)
    prompt = im.mixed_prompts(1, seed=5, low=10, high=11)[0]
    want = engine(path).generate(prompt, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))[0]
    eng = engine(path, prompt_lookup_max=args.prompt_lookup_max, prompt_lookup_min=args.prompt_lookup_min)
    with OpenAIServer(eng, port=0) as server:
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True})
        m = parse_metrics(httpx.get(server.url + "/metrics", timeout=60).text)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text
    assert 10 <= m["phalanx_spec_decode_accepted_tokens_total"] <= m["phalanx_spec_decode_draft_tokens_total"]


def test_verification_chunks_of_mixed_lengths_run_batched_with_the_models_logits(llama):
    """N-gram proposals differ in length per sequence: chunks of 1, 3 and 5 tokens over cached
    prompts run as batched groups, one set per length (no per-sequence prefill segment), and each
    row's logits are transformers' at that position."""
    from phalanx.inference.model_runner import Chunk

    path, model = llama
    runner = engine(path).runner
    prompts = im.mixed_prompts(5, seed=3, low=12, high=30)
    extra = [[5], [6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17]]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]  # 64 slots each
    for prompt, table in zip(prompts, tables):
        runner.execute([Chunk(prompt, 0, table, 0)])  # the prompt's keys and values into the cache
    chunks = [Chunk(e, len(p), t, len(e)) for p, e, t in zip(prompts, extra, tables)]
    _, _, batch, _ = runner._unpack(runner.pack(chunks))
    assert batch.prefills == [] and sorted(g.q_len * g.num_seqs for g in batch.groups) == [2, 5, 6]
    got = runner.execute(chunks)
    with torch.no_grad():  # row i of a chunk: HF's logits at position start + i
        want = torch.cat([model(torch.tensor([p + e])).logits[0, len(p):] for p, e in zip(prompts, extra)])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_serve_reads_vllms_speculative_config(capsys):
    """`phalanx serve --speculative-config JSON` (vLLM's flag) sets n-gram lookup or a draft model;
    what it cannot honour is refused by name before anything loads."""
    import re

    from phalanx.inference.serve import apply_speculative_config, build_parser, serve_main

    def read(*flags):
        args = build_parser().parse_args(["MODEL", *flags])
        apply_speculative_config(args)
        return args.prompt_lookup_max, args.prompt_lookup_min, args.num_speculative_tokens, args.draft_model

    assert read("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}') \
        == (2, 1, 3, None)
    assert read("--speculative-config", '{"method": "ngram"}') == (3, 1, 4, None)
    assert read("--speculative-config", '{"model": "DRAFT", "num_speculative_tokens": 5}') == (0, 1, 5, "DRAFT")
    assert read() == (0, 1, 4, None)
    for config, words in [('{"method": "eagle", "model": "x"}', "method 'eagle'"),
                          ('{"method": "ngram", "typo": 1}', "['typo'] not supported"),
                          ('{"method": "ngram", "model": "x"}', "method 'ngram' with keys"),
                          ("[1]", "a JSON object"), ("{", "is not JSON")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            read("--speculative-config", config)
    with pytest.raises(ValueError, match="give speculative decoding once"):
        read("--prompt-lookup-max", "2", "--speculative-config", '{"method": "ngram"}')
    assert serve_main(["MODEL", "--speculative-config", '{"method": "medusa"}']) == 2
    assert "method 'medusa'" in capsys.readouterr().err


def test_ngram_proposals_keep_the_target_distribution_when_sampling():
    """A proposal is certain (q one-hot): accepted with probability p(d), else the token is drawn
    from p without d. Both emitted positions follow the target's distribution, whatever was proposed."""
    target_p = [0.5, 0.3, 0.15, 0.05]
    spec = SpeculativeDecoder(im.FixedLogits(target_p), NgramProposer(4, torch.device("cpu"), 1, 2), num_tokens=2)
    # [3, 1] occurred before: proposes [0, 0]
    firsts, seconds = im.speculative_draws(spec, [3, 1, 0, 0, 3, 1], SamplingParams(temperature=1.0, max_new_tokens=8))
    for draws in (firsts, seconds):
        freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
        assert torch.allclose(freq, torch.tensor(target_p), atol=0.03), freq
    assert spec.acceptance_rate == pytest.approx((0.5 + 0.5 * 0.5) / 2, abs=0.02)  # p(0), then p(0) again


def test_ngram_settings_are_checked(llama, tmp_path):
    path, _ = llama
    with pytest.raises(ValueError, match="prompt_lookup_min=3 and prompt_lookup_max=2"):
        engine(path, prompt_lookup_max=2, prompt_lookup_min=3)
    with pytest.raises(ValueError, match="prompt_lookup_max=-1"):
        engine(path, prompt_lookup_max=-1)
    draft, _ = im.save_model(tmp_path / "draft", "llama", num_hidden_layers=1)
    with pytest.raises(ValueError, match="draft model or n-gram lookup.*not both"):
        engine(path, draft_model=str(draft), prompt_lookup_max=2)
