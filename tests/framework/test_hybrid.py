"""HybridParallelPlugin on gloo ranks against one plain process: every family with a shard
policy (Llama, Mistral, Qwen2, Qwen3, GPT-2, OPT), under every layout, one step.

Layouts (2 ranks): tp2; sp2 split-gather (on the tp group); sp2 Ulysses; sp2 ring.
Layouts (4 ranks): tp2+sp2 Ulysses; tp2+sp2 ring; dp2+tp2 ZeRO-1; dp2+tp2 ZeRO-2 (+split-gather).
Checked within 1e-5 (fp32): the loss, one column-parallel, one row-parallel and one norm
gradient (after all reductions), the global gradient norm (relative), every weight after one SGD
step (linear in the gradient, so weights compare as tightly as gradients), and the full logits
of a fresh batch after the step. Clipping (max_norm below the norm) and activation checkpointing
run in some layouts. Measured differences are ~1e-8 for gradients and weights, ~1e-7 for logits.
"""
from __future__ import annotations

import hybrid_models as hm
import hybrid_workers as hw
from phalanx.testing import spawn

TOL = 1e-5
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
            assert d["loss"] <= TOL, f"{where}: loss differs by {d['loss']}"
            assert d["grad"] <= TOL, f"{where}: gradient of {d['grad_at']} differs by {d['grad']}"
            assert d["norm"] <= TOL, f"{where}: gradient norm differs by {d['norm']} (relative)"
            assert d["param"] <= TOL, f"{where}: {d['param_at']} differs by {d['param']} after one step"
            assert d["logits"] <= TOL, f"{where}: logits after one step differ by {d['logits']}"
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
        "family": "supports the families gpt2, llama, mistral, opt, qwen2, qwen3",
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
    for layout, per_family in r.items():
        for family, d in per_family.items():
            assert d["logits_vs_saved"] <= TOL, (layout, family, d)
            assert d["loss"] <= TOL, (layout, family, d)
            assert d["param"] <= TOL, (layout, family, d)
    one_rank = spawn(hw.resume_with_plugin, 1, directory, "zero1")[0]
    assert all(v <= TOL for v in one_rank.values()), one_rank
    for family in ("llama", "gpt2"):
        ref = hw.reference(family, steps=1, kind="adamw")
        model = AutoModelForCausalLM.from_pretrained(f"{directory}/{family}/model")
        assert (hw._logits(model, family) - ref["logits"]).abs().max().item() <= TOL
    from_ddp = spawn(hw.checkpoint_suite, 2, str(tmp_path / "ddp"), "ddp", {"tp2-zero1": dict(tp_size=2, zero_stage=1)},
                     ("llama",), timeout=600)[0]
    for family, d in from_ddp["tp2-zero1"].items():
        assert d["logits_vs_saved"] <= TOL and d["loss"] <= TOL and d["param"] <= TOL, (family, d)


def test_bf16_and_fp16_track_fp32():
    """Low precision: tolerances as in docs/zero.md (bf16 keeps 8 mantissa bits, fp16 11)."""
    r = spawn(hw.precision_suite, 2)[0]
    for key, d in r.items():
        precision = key.split("/")[1]
        assert d["dtype"] == {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision]
        assert d["saved_dtype"] == "torch.float32"  # the fp32 masters are what is saved
        assert d["loss_rel"] <= 1e-3, (key, d)
        assert d["update_rel"] <= (0.1 if precision == "bf16" else 3e-2), (key, d)
