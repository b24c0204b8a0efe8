"""HybridParallelPlugin on gloo ranks against one plain process: every family with a shard
policy (Llama, Mistral, Qwen2, Qwen3, GPT-2, OPT), under every layout, one step.

Layouts (2 ranks): tp2; sp2 split-gather (on the tp group); sp2 Ulysses; sp2 ring.
Layouts (4 ranks): tp2+sp2 Ulysses; tp2+sp2 ring; dp2+tp2 ZeRO-1; dp2+tp2 ZeRO-2 (+split-gather).
Checked in fp32, relative to magnitude within rounding_rtol (8·eps·√64 = 7.6e-6, 64 tokens per
batch): the loss, one column-parallel, one row-parallel and one norm gradient (after all
reductions), the global gradient norm, the full logits of a fresh batch after the step; and
every weight after one SGD step, as the update measure within the same tolerance (SGD is linear
in the gradient) plus the weights' own rounding (one SGD step moves them by 1/1000 of their
norm). After AdamW steps (checkpoints) the update measure within ADAMW_UPDATE_RTOL. Clipping
(max_norm below the norm) and activation checkpointing run in some layouts. The measures are
those of phalanx.testing; docs/hybrid.md has the measured values.
"""
from __future__ import annotations

import torch

import hybrid_models as hm
import hybrid_workers as hw
from phalanx.testing import ADAMW_UPDATE_RTOL, check, rounding_rtol, spawn

TOKENS = 4 * 16  # hm.tokens: the longest reduction behind a loss or a weight gradient
TOL = rounding_rtol(torch.float32, TOKENS)  # rel errors, and the update measure after SGD
CLIP = 0.3

TWO_RANKS = {
    "tp2": dict(tp_size=2, max_norm=CLIP),
    "sp2-split_gather": dict(tp_size=2, sequence_parallelism="split_gather", zero_stage=1),
    "sp2-ulysses": dict(sp_size=2, sequence_parallelism="ulysses", zero_stage=2, gradient_checkpointing=True),
    "sp2-ring": dict(sp_size=2, sequence_parallelism="ring", zero_stage=1, max_norm=CLIP,
                     gradient_checkpointing=True),
}
FOUR_RANKS = {
    "tp2+sp2-ulysses": dict(tp_size=2, sp_size=2, sequence_parallelism="ulysses", zero_stage=1),
    "tp2+sp2-ring": dict(tp_size=2, sp_size=2, sequence_parallelism="ring", zero_stage=2, max_norm=CLIP),
    "dp2+tp2-zero1": dict(tp_size=2, zero_stage=1, max_norm=CLIP),
    "dp2+tp2-zero2": dict(tp_size=2, zero_stage=2, sequence_parallelism="split_gather"),
}


def _check(results: dict, layouts: dict) -> None:
    assert set(results) == set(layouts)
    for layout, per_family in results.items():
        assert set(per_family) == set(hm.FAMILIES)
        for family, d in per_family.items():
            where = f"{layout}/{family}"
            check(d["loss"], TOL, f"{where}: loss")
            check(d["grad"], TOL, f"{where}: gradient")
            check(d["norm"], TOL, f"{where}: gradient norm")
            check(d["param"], TOL, f"{where}: weights after one SGD step")
            check(d["logits"], TOL, f"{where}: logits after one step")
            if layouts[layout].get("max_norm"):
                assert d["ref_norm"] > CLIP, f"{where}: the clipping case does not clip"
            if layouts[layout].get("gradient_checkpointing"):
                assert d["attention_calls"] == 2, f"{where}: attention ran {d['attention_calls']}× (no recompute?)"


def test_two_rank_layouts_match_single_process():
    _check(spawn(hw.equivalence_suite, 2, TWO_RANKS, timeout=600)[0], TWO_RANKS)


def test_four_rank_layouts_match_single_process():
    _check(spawn(hw.equivalence_suite, 4, FOUR_RANKS, timeout=900)[0], FOUR_RANKS)


def test_impossible_layouts_stop_before_work():
    """Each refused layout names the numbers that do not fit; generation under tp works."""
    r = spawn(hw.error_suite, 2)[0]
    assert all(r.pop("untouched")), "a refused layout modified the model"
    assert r.pop("generate_tp2_equal"), "greedy generation under tp=2 differs from one process"
    expected = {
        "world": "tp × pp × sp = 3 × 1 × 1 = 3",
        "heads": "tp_size=2 does not divide num_attention_heads=3 (3 % 2 = 1)",
        "kv_heads": "num_key_value_heads=3",
        "mlp": "cannot split model.layers.0.mlp.gate_proj.weight of shape (63, 32)",
        "ulysses_heads": "not divisible by sp_size=2 (3 % 2 = 1)",
        "family": "supports the families deepseek_v2, deepseek_v3, gpt2, llama, mistral, mixtral, opt, qwen2, qwen2_moe, qwen3, qwen3_moe",
        "split_gather_sp": "with sp_size=1",
        "sp_without_mode": "needs sequence_parallelism='ulysses' or 'ring'",
        "seq_ring": "15 % 4 = 3",
        "seq_ulysses": "15 % 2 = 1",
        "seq_split_gather": "15 % 2 = 1",
        "padding_mask": "cannot apply a padding attention_mask",
        "generate_ulysses": "generation is not supported in this layout",
    }
    for key, text in expected.items():
        assert text in r[key], f"{key}: {r[key]}"
        assert r[key].startswith(("LayoutError", "ValueError", "RuntimeError")), r[key]


def test_checkpoints_move_between_layouts_and_plugins(tmp_path):
    """Save under tp2 ZeRO-1 (model in HF layout + optimizer fragments), load under Ulysses sp2
    ZeRO-2 and under tp2 split-gather without ZeRO: same logits, and the next AdamW step matches
    two uninterrupted single-process steps; ZeroPlugin on one rank and plain transformers load it
    too; a DDP checkpoint loads into tp2."""
    from transformers import AutoModelForCausalLM

    directory = str(tmp_path / "hybrid")
    loads = {"sp2-ulysses-zero2": dict(sp_size=2, sequence_parallelism="ulysses", zero_stage=2),
             "tp2-split_gather-zero0": dict(tp_size=2, sequence_parallelism="split_gather")}
    r = spawn(hw.checkpoint_suite, 2, directory, dict(tp_size=2, zero_stage=1), loads, timeout=600)[0]
    from_ddp = spawn(hw.checkpoint_suite, 2, str(tmp_path / "ddp"), "ddp", {"tp2-zero1": dict(tp_size=2, zero_stage=1)},
                     ("llama",), timeout=600)[0]
    assert set(r) == set(loads) and set(from_ddp) == {"tp2-zero1"}
    for where, results in (("tp2 zero1", r), ("ddp", from_ddp)):
        for layout, per_family in results.items():
            assert per_family, f"{where} -> {layout}: no family ran"
            for family, d in per_family.items():
                what = f"saved under {where}, loaded under {layout}, {family}"
                check(d["logits_vs_saved"], TOL, f"{what}: logits vs saved")
                check(d["loss"], TOL, f"{what}: second-step loss")
                check(d["param"], ADAMW_UPDATE_RTOL, f"{what}: weights after two AdamW steps")
    one_rank = spawn(hw.resume_with_plugin, 1, directory, "zero1")[0]
    assert set(one_rank) == {"llama", "gpt2"}
    for family, diff in one_rank.items():
        check(diff, TOL, f"resumed by zero1 on 1 rank, {family}: second-step loss")
    for family in ("llama", "gpt2"):
        ref = hw.reference(family, steps=1, kind="adamw")
        model = AutoModelForCausalLM.from_pretrained(f"{directory}/{family}/model")
        check(hw.logits_update_diff(hw._logits(model, family), ref), ADAMW_UPDATE_RTOL,
              f"from_pretrained {family}: logits after one AdamW step")


def test_bf16_and_fp16_match_the_same_recipe_on_one_process():
    """bf16/fp16 compute with fp32 masters under tp2 ZeRO-2 against one process doing the same:
    phalanx.testing.LOW_PRECISION_RTOL (bf16 keeps 8 mantissa bits, fp16 11)."""
    r = spawn(hw.precision_suite, 2)[0]
    hw.check_low_precision(r, expected=4)
