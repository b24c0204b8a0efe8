"""Lazy initialisation: meta-device models materialised per rank by HybridParallelPlugin."""
from __future__ import annotations

import torch

import hybrid_models as hm
import hybrid_workers as hw
from phalanx import lazy
from phalanx.testing import check, rel_diff, rounding_rtol, spawn

TOL = rounding_rtol(torch.float32, 4 * 16)  # the same weights, the logits of 64 tokens in another layout


def test_lazy_models_materialise_only_this_ranks_pieces(tmp_path):
    for family in ("llama", "gpt2"):
        hm.build(family, seed=3).save_pretrained(tmp_path / family)
    r = spawn(hw.lazy_suite, 2, str(tmp_path), timeout=600)[0]
    assert set(r) == {"llama", "gpt2"}
    for family, d in r.items():
        check(d["logits"], TOL, f"lazy {family} under tp2: logits")  # from the checkpoint: same model
        assert d["local_fraction"] < 0.56, (family, d)   # each rank holds about half
        assert d["read_fraction"] == d["local_fraction"], (family, d)  # and read only that
        assert d["random_init"], (family, d)             # tp pieces == the whole lazy model, exactly
        assert d["finite"], (family, d)
        lo, hi = d["std_range"]
        assert 0.005 < lo and hi < 0.03, (family, d)     # initializer_range 0.02 (GPT-2 c_proj / 2)


def test_materialize_whole_model_from_checkpoint(tmp_path):
    model = hm.build("qwen3", seed=4)
    model.save_pretrained(tmp_path)
    lazy_model = lazy.from_pretrained(tmp_path)
    assert all(p.is_meta for p in lazy_model.parameters())
    lazy.materialize(lazy_model)
    ids = hm.tokens("qwen3")[0]
    with torch.no_grad():
        check(rel_diff(lazy_model(input_ids=ids).logits, model(input_ids=ids).logits), TOL, "lazy qwen3: logits")
