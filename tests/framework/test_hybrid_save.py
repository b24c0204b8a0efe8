"""HybridParallelPlugin's streamed save (`iter_full_model_state`): the Hugging Face export is
gathered one tensor at a time, tensors of other pipeline stages sent point to point, no pickle.

Each layout trains one AdamW step on a tiny Llama (untied, grouped KV heads) and GPT-2 (tied
embeddings, fused QKV, a vocabulary of 125 that tp=2 pads), 2 decoder layers (4 for the
interleaved schedule, two stages per rank), then `Booster.save_model` writes it
with a 4 kB max_shard_size (many files). Checked on the writer (rank 0):
- the export equals, bit for bit and dtype for dtype, the state dict the plugin gathered before it
  streamed (`hybrid_workers.legacy_full_state_dict`: whole state over tp, stages pickled to pp
  rank 0), with the tied LM head written once; `full_model_state_dict` equals it on every rank;
- the tensors come in the model's own order (interleaved stages included);
- `from_pretrained` opens the export and holds the same tensors (tied again);
- the export loaded into another layout gathers back to the same tensors;
- no object collective ran while the model was gathered (they are patched to raise on every rank);
- when the stream yields a tensor, none of the tensors it yielded before is still alive: it holds
  one tensor at a time (a stream built on a gathered dict keeps them all); and the writer, counted
  from outside (bytes handed over minus bytes in its finished files), holds at most one file or
  one tensor larger than a file, as in test_lazy_plugins.
"""
from __future__ import annotations

import pytest

import hybrid_workers as hw
from phalanx.testing import spawn

LM = dict(zero_stage=1)
TWO_RANKS = {
    "tp2-bf16": dict(save=dict(tp_size=2, precision="bf16", **LM), load_into=dict(pp_size=2, num_microbatches=2)),
    "pp2": dict(save=dict(pp_size=2, num_microbatches=2, **LM), load_into=dict(tp_size=2, zero_stage=2)),
    # two stages per rank (layers 0 and 2 on rank 0): the writer's own and received tensors interleave
    "pp2-interleaved": dict(save=dict(pp_size=2, pp_schedule="interleaved", num_microbatches=2, **LM),
                            load_into=dict(pp_size=2, num_microbatches=2), layers=4),
}
FOUR_RANKS = {
    "tp2+pp2": dict(save=dict(tp_size=2, pp_size=2, num_microbatches=2, **LM),
                    load_into=dict(tp_size=2, zero_stage=2)),
    "pp2+dp2-zero1": dict(save=dict(pp_size=2, num_microbatches=2, **LM), load_into=dict(tp_size=2, pp_size=2,
                                                                                  num_microbatches=2)),
}


def _check(results: list[dict], layouts: dict) -> None:
    for rank, per_layout in enumerate(results):
        assert set(per_layout) == set(layouts)
        for layout, per_family in per_layout.items():
            for family, r in per_family.items():
                where = f"{layout}/{family} rank {rank}"
                assert not r["new_vs_legacy"], f"{where}: full_model_state_dict differs: {r['new_vs_legacy'][:3]}"
    for layout, per_family in results[0].items():
        assert set(per_family) == {"llama", "gpt2"}
        for family, r in per_family.items():
            where = f"{layout}/{family}"
            assert not r["export_keys_missing"] and not r["export_keys_extra"], (where, r)
            assert not r["export_vs_legacy"], f"{where}: export differs from the old save: {r['export_vs_legacy'][:3]}"
            assert not r["from_pretrained_vs_export"], (where, r["from_pretrained_vs_export"][:3])
            assert r["tied_on_load"], where
            assert not r["reloaded_vs_export"], (where, r["reloaded_vs_export"][:3])
            assert r["files"] >= 5, (where, r["files"])
            stream = r["stream"]
            assert stream["count"] == r["tensors"], (where, stream, r["tensors"])  # the tied head once
            assert r["in_model_order"], (where, stream["names"])  # the same order as save_pretrained
            assert stream["alive_max"] == 0, f"{where}: the stream kept {stream['alive_max']} earlier tensors alive"
            # the writer: one file, or one tensor larger than a file (the embedding), at a time
            assert 0 < stream["held_max"] <= max(hw.SAVE_SHARD_BYTES, stream["largest"]), (where, stream)


def test_streamed_save_two_ranks(tmp_path):
    _check(spawn(hw.stream_save_suite, 2, str(tmp_path), TWO_RANKS, timeout=600), TWO_RANKS)


@pytest.mark.slow
def test_streamed_save_four_ranks(tmp_path):
    _check(spawn(hw.stream_save_suite, 4, str(tmp_path), FOUR_RANKS, timeout=900), FOUR_RANKS)


@pytest.mark.slow
def test_streamed_save_memory_four_ranks(tmp_path):
    """tp2 × pp2, a 24 MiB fp32 Llama saved in 1 MiB files: the resident memory the save adds on
    any rank at its peak stays within one file and a few of the largest tensors (the writer's
    file, the tensor in flight, its tp pieces and their concatenation), far under the model; the
    old save's gather alone added more than the whole model on the writer."""
    results = spawn(hw.save_peak_suite, 4, str(tmp_path), dict(tp_size=2, pp_size=2, num_microbatches=2,
                                                                zero_stage=1), timeout=600)
    if results[0] is None:
        pytest.skip("needs Linux's /proc peak counters and glibc's mallopt")
    mib = 2**20
    print("streamed save, MiB added per rank:", [round(r["streamed"] / mib, 1) for r in results],
          "old gather:", [round(r["legacy_gather"] / mib, 1) for r in results],
          f"(model {results[0]['model'] / mib:.1f} MiB, largest tensor {results[0]['largest'] / mib:.2f} MiB)")
    for rank, r in enumerate(results):
        bound = r["shard"] + 4 * r["largest"] + 2 * mib
        assert r["streamed"] <= bound, (rank, r["streamed"] / mib, bound / mib)
    assert results[0]["legacy_gather"] >= results[0]["model"], results[0]  # the measure sees a whole model
