"""Pipeline parallelism (HybridParallelPlugin(pp_size=2)) on gloo ranks against one plain process,
every family with a shard policy (Llama, Mistral, Qwen2, Qwen3, GPT-2 and OPT with tied heads),
4 decoder layers, one `execute_pipeline` + SGD step on the whole batch, then a forward-only
`execute_pipeline` (evaluation) on a batch of another shape.

2 ranks: pp2 under each schedule (GPipe, 1F1B, interleaved 1F1B, ZB-V zero bubble), with
clipping, ZeRO-1 and activation checkpointing in some; bf16/fp16; -100 labels; checkpoints saved under pp2 and loaded under tp2, by
`from_pretrained` and under another schedule. 4 ranks: tp2+pp2, pp2+dp2 ZeRO-1, tp2+pp2 with
split-gather sequence parallelism. Checked in fp32 with the measures of phalanx.testing, as in
test_hybrid: rel errors of the loss, the global gradient norm and the forward-only loss and
logits, and the update measure of every weight after the SGD step, within rounding_rtol
(8·eps·√64 = 7.6e-6); after AdamW steps (checkpoints) the update measure within
ADAMW_UPDATE_RTOL. docs/pipeline.md has the measured values.
"""
from __future__ import annotations

import pytest
import torch

import hybrid_models as hm
import hybrid_workers as hw
import pipeline_workers as pw
from phalanx.booster.plugins.hybrid import HybridParallelPlugin
from phalanx.mesh import LayoutError
from phalanx.pipeline import bubble_fraction, split_layers
from phalanx.testing import ADAMW_UPDATE_RTOL, check, rounding_rtol, spawn
from spawn_batch import spawn_suites

TOKENS = 4 * 16  # hm.tokens: the longest reduction behind a loss or a weight gradient
TOL = rounding_rtol(torch.float32, TOKENS)  # rel errors, and the update measure after SGD
CLIP = 0.3

TWO_RANKS = {
    "pp2-gpipe": dict(pp_size=2, pp_schedule="gpipe", num_microbatches=4),
    "pp2-1f1b": dict(pp_size=2, pp_schedule="1f1b", num_microbatches=4, max_norm=CLIP),
    "pp2-interleaved": dict(pp_size=2, pp_schedule="interleaved", num_microbatches=2, zero_stage=1,
                            gradient_checkpointing=True),
    "pp2-zero_bubble": dict(pp_size=2, pp_schedule="zero_bubble", num_microbatches=4, zero_stage=1, max_norm=CLIP),
}
FOUR_RANKS = {
    "tp2+pp2-1f1b": dict(tp_size=2, pp_size=2, pp_schedule="1f1b", num_microbatches=2, max_norm=CLIP),
    "pp2+dp2-zero1": dict(pp_size=2, pp_schedule="1f1b", num_microbatches=2, zero_stage=1, max_norm=CLIP),
    "tp2+pp2-split_gather-zb": dict(tp_size=2, pp_size=2, pp_schedule="zero_bubble", num_microbatches=2,
                                    zero_stage=1, sequence_parallelism="split_gather"),
}


def _check(results: dict, layouts: dict, families=hm.FAMILIES) -> None:
    assert set(results) == set(layouts)
    for layout, per_family in results.items():
        assert set(per_family) == set(families)
        for family, d in per_family.items():
            where = f"{layout}/{family}"
            check(d["loss"], TOL, f"{where}: loss")
            check(d["norm"], TOL, f"{where}: gradient norm")
            check(d["param"], TOL, f"{where}: weights after one SGD step")
            assert d["saved_keys"], f"{where}: the gathered state dict does not have the model's names"
            check(d["eval_loss"], TOL, f"{where}: forward-only loss")
            check(d["eval_logits"], TOL, f"{where}: forward-only logits")
            assert d["eval_logit_ranks"] >= 1, f"{where}: no rank returned the forward-only logits"
            if layouts[layout].get("max_norm"):
                assert d["ref_norm"] > CLIP, f"{where}: the clipping case does not clip"


CHECKPOINT_SAVE = dict(pp_size=2, pp_schedule="1f1b", num_microbatches=2, zero_stage=1)
CHECKPOINT_LOADS = {"pp2-zero_bubble-zero1": dict(pp_size=2, pp_schedule="zero_bubble", num_microbatches=2, zero_stage=1),
                    "pp2-gpipe": dict(pp_size=2, pp_schedule="gpipe", num_microbatches=2),
                    "tp2-zero1": dict(tp_size=2, zero_stage=1)}
PRECISION_LAYOUT = dict(pp_size=2, pp_schedule="1f1b", num_microbatches=2, zero_stage=1)


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory):
    """Every 2-rank suite of this file in one spawn (spawn_batch: rank start-up costs seconds)."""
    suites = {
        "test_pp2_every_schedule_and_family_matches_single_process": (pw.equivalence_suite, (TWO_RANKS,), {}),
        "test_checkpoint_from_pp2_loads_in_other_layouts": (
            pw.checkpoint_suite, (str(tmp_path_factory.mktemp("pp2_checkpoint")), CHECKPOINT_SAVE, CHECKPOINT_LOADS), {}),
        "test_bf16_fp16_pp2_zero1_match_the_same_recipe_on_one_process": (
            hw.precision_suite, (("llama", "gpt2"), PRECISION_LAYOUT, pw.LAYERS), {}),
        "test_ignore_index_loss_is_token_weighted": (
            pw.masked_labels_step, (dict(pp_size=2, pp_schedule="gpipe", num_microbatches=4),), {}),
        "test_impossible_layouts_stop_before_work": (pw.error_suite, (), {}),
    }
    return spawn_suites(request, 2, suites, timeout=2400)


def test_pp2_every_schedule_and_family_matches_single_process(two_ranks):
    _check(two_ranks.get("test_pp2_every_schedule_and_family_matches_single_process")[0], TWO_RANKS)


def test_four_rank_layouts_match_single_process():
    _check(spawn(pw.equivalence_suite, 4, FOUR_RANKS, timeout=900)[0], FOUR_RANKS)


def test_checkpoint_from_pp2_loads_in_other_layouts(two_ranks):
    """One HF directory from pp2 (ZeRO-1): from_pretrained and tp2 reproduce the logits; model and
    AdamW state resume under another schedule (ZB-V: both ends of the tied embedding on one rank),
    under pp2 without ZeRO, and under tp2."""
    results = two_ranks.get("test_checkpoint_from_pp2_loads_in_other_layouts")[0]
    assert set(results) == {"logits", *CHECKPOINT_LOADS}
    for where, per_family in results.items():
        assert set(per_family) == {"llama", "gpt2"}, where
        for family, d in per_family.items():
            assert d, (where, family)
            for key, diff in d.items():  # the loss is a rel error, logits and weights follow AdamW
                tol = TOL if key == "loss" else ADAMW_UPDATE_RTOL
                check(diff, tol, f"{family}: saved under pp2, {where}/{key}")


def test_bf16_fp16_pp2_zero1_match_the_same_recipe_on_one_process(two_ranks):
    """Low precision through the pipeline, checked as in test_hybrid; fp16 scales each
    microbatch's loss by the ZeRO optimizer's loss scale."""
    r = two_ranks.get("test_bf16_fp16_pp2_zero1_match_the_same_recipe_on_one_process")[0]
    hw.check_low_precision(r, expected=4)


def test_ignore_index_loss_is_token_weighted(two_ranks):
    r = two_ranks.get("test_ignore_index_loss_is_token_weighted")[0]
    check(r["loss"], TOL, "-100 labels: loss")
    check(r["param"], TOL, "-100 labels: weights after one SGD step")


def test_impossible_layouts_stop_before_work(two_ranks):
    r = two_ranks.get("test_impossible_layouts_stop_before_work")[0]
    assert r.pop("untouched"), "a refused layout modified the model"
    expected = {
        "too_many_stages": "pp_size × virtual stages = 2 × 4 = 8 pipeline stages but the model has only 4",
        "batch": "3 % 2 = 1",
        "forward": "booster.execute_pipeline",
        "left_padding": "padding must be at the end of rows",
    }
    for key, text in expected.items():
        assert text in r[key], f"{key}: {r[key]!r} does not say {text!r}"


@pytest.mark.parametrize("kwargs, text", [
    (dict(pp_size=2, pp_schedule="1f1b", num_microbatches=1), "num_microbatches=1 < pp_size=2"),
    (dict(pp_size=4, pp_schedule="zero_bubble", num_microbatches=2), "num_microbatches=2 < pp_size=4"),
    (dict(pp_size=2, pp_schedule="interleaved", num_microbatches=3), "3 % 2 = 1"),
    (dict(pp_size=2, pp_schedule="bubbly"), "choose one of gpipe, 1f1b, interleaved, zero_bubble"),
    (dict(pp_size=2, pp_schedule="1f1b", num_microbatches=2, virtual_stages=2), "use pp_schedule='interleaved'"),
    (dict(pp_size=2, num_microbatches=2, sp_size=2, sequence_parallelism="ulysses"), "use 'split_gather'"),
])
def test_plugin_refuses_schedule_layouts(kwargs, text):
    with pytest.raises(LayoutError) as info:
        HybridParallelPlugin(**kwargs)
    assert text in str(info.value)


def test_stage_split_and_bubble_theory():
    even = split_layers(8, "1f1b", 4, 1)
    assert [len(r) for r in even.layers] == [2, 2, 2, 2]
    uneven = split_layers(6, "1f1b", 4, 1)
    assert [len(r) for r in uneven.layers] == [1, 2, 2, 1]  # the middle stages hold no embedding/head
    assert [list(r) for r in split_layers(4, "1f1b", 2, 1, [1, 3]).layers] == [[0], [1, 2, 3]]
    zb = split_layers(8, "zero_bubble", 2, 2)
    assert zb.stages_of(0) == [0, 3] and zb.stages_of(1) == [1, 2]
    inter = split_layers(8, "interleaved", 2, 2)
    assert inter.stages_of(0) == [0, 2] and inter.rank_of(3) == 1
    with pytest.raises(LayoutError, match="6 % 4 = 2"):
        split_layers(6, "interleaved", 2, 2)
    with pytest.raises(LayoutError, match="sum to"):
        split_layers(4, "1f1b", 2, 1, [1, 2])
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("interleaved", 2, 4, 2) == pytest.approx(1 / 9)
