"""Rank functions for the tensor-parallel inference tests (module level: ranks start fresh)."""
from __future__ import annotations

import torch

from phalanx.inference import LLM, SamplingParams


def tp_generate(cases: list[dict]) -> list[dict]:
    """Run each case on a tensor-parallel engine over every rank (TP=2 unless the case says
    "tp"); every rank returns what it got (all should agree)."""
    results = []
    for case in cases:
        eng = LLM(case["path"], tp_size=case.get("tp", 2), num_blocks=64, block_size=8, dtype="float32", draft_model=case.get("draft"),
                  num_speculative_tokens=3, prompt_lookup_max=case.get("ngram", 0))
        params = SamplingParams(max_new_tokens=case["new_tokens"], temperature=0, logprobs=1)
        outs = eng.generate(case["prompts"], params)
        result = {"tokens": [o.token_ids for o in outs], "logprobs": [o.logprobs for o in outs],
                  "accepted": eng.speculator.num_accepted if eng.speculator else None,
                  "shard": tuple(eng.runner.model.layers[0].qkv_weight.shape),
                  "kv_cache": tuple(eng.runner.kv_caches[0][0].shape)}
        if case.get("reload"):
            state = torch.load(case["reload"], weights_only=True)
            eng.load_weights(state)
            result["reloaded"] = [o.token_ids for o in eng.generate(case["prompts"], params)]
        results.append(result)
    return results
