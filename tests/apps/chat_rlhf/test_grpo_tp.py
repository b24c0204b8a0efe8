"""GRPO with a tensor-parallel policy (HybridParallelPlugin, tp_size=2): the rollout engine runs
tensor-parallel over the trainer's own tp group and follows its shards in memory (engine
log-probs equal the tp2 training forward's within 1e-4 after five syncs, with only the token
embedding gathered); the tp peers roll out the same prompts and seeds; the stale-weight guard
still fires; and a tp2 run gives one process's losses."""
from __future__ import annotations

import pytest

import tp_workers as w
from tests.framework.spawn_batch import spawn_suites


def _close(a, b, atol: float = 1e-5) -> bool:
    import torch
    return torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=atol)


def test_bad_hybrid_layouts_are_refused():
    from apps.chat_rlhf.grpo import rollout_tp_size
    from phalanx.config import ConfigError
    assert rollout_tp_size(w.grpo_cfg("m", "o", *w.hybrid(2)).train) == 2
    assert rollout_tp_size(w.grpo_cfg("m", "o").train) == 1
    with pytest.raises(ConfigError, match="pp_size=2.*every layer"):
        rollout_tp_size(w.grpo_cfg("m", "o", "train.plugin=hybrid",
                                   "train.plugin_options={tp_size: 2, pp_size: 2}").train)
    with pytest.raises(ConfigError, match="sequence parallelism"):
        rollout_tp_size(w.grpo_cfg("m", "o", "train.plugin=hybrid",
                                   "train.plugin_options={tp_size: 2, sequence_parallelism: split_gather}").train)


def test_local_offset_maps_engine_ranges_into_training_pieces():
    """Where the engine's range of a full weight lies in a rank's training piece (None: gather it)."""
    from phalanx.inference.weights import _local_offset
    from phalanx.shard.spec import ShardSpec
    rows = ShardSpec(0)
    assert _local_offset(rows, (8, 4), 1, 2, 0, 4, 4) == 0  # rank 1's block, as the engine cuts it
    assert _local_offset(rows, (8, 4), 1, 2, 0, 0, 4) is None  # rank 0's block is not here
    assert _local_offset(rows, (8, 4), 1, 2, 1, 0, 2) is None  # cut along another dimension
    assert _local_offset(rows, (8, 4), 1, 2, None, 0, 0) is None  # the whole tensor
    fused = ShardSpec(0, (4, 2, 2))  # q | k | v: rank 1 holds q rows 2-3, k row 5, v row 7
    assert [_local_offset(fused, (8, 3), 1, 2, 0, start, n) for start, n in ((2, 2), (5, 1), (7, 1))] == [0, 2, 3]
    vocab = ShardSpec(0, pad=True)  # 7 rows over 2 ranks: blocks of 4, the last padded
    assert _local_offset(vocab, (7, 3), 1, 2, 0, 4, 3) == 0 and _local_offset(vocab, (7, 3), 1, 2, 0, 4, 4) is None


# The rank bodies of the slow tests, one spawn per world size (tests/framework/spawn_batch.py: rank
# start-up costs seconds), each test reading its own results.
FOLLOW, TP2, DP2TP2 = "test_engine_follows_tp2_shards", "test_tp2_run_matches_one_process", "test_dp2_tp2_on_4_ranks"
TP4 = "test_tp4_replicates_the_2_kv_heads"
LORA = "test_lora_tp2_run_matches_one_process"


@pytest.fixture(scope="module")
def runs(request, tiny_chat_model, tmp_path_factory):
    model, out = str(tiny_chat_model), tmp_path_factory.mktemp("grpo_tp")
    one_rank = {f"{TP2}:one": (w.grpo_losses, (model, str(out / "one")), {}),
                f"{DP2TP2}:one": (w.grpo_losses, (model, str(out / "one-mb4"), "train.micro_batch_size=4"), {}),
                f"{TP4}:one": (w.grpo_losses, (model, str(out / "one-tp4")), {}),
                f"{LORA}:one": (w.grpo_losses, (model, str(out / "one-lora"), "lora.enabled=true"), {})}
    two_ranks = {FOLLOW: (w.follow_tp_weights, (model, str(out / "follow-tp2"), 2), {}),
                 f"{TP2}:tp2": (w.grpo_losses, (model, str(out / "tp2"), *w.hybrid(2)), {}),
                 f"{DP2TP2}:dp2": (w.grpo_losses, (model, str(out / "dp2"), *w.hybrid(1)), {}),
                 f"{LORA}:tp2": (w.grpo_losses, (model, str(out / "tp2-lora"), *w.hybrid(2), "lora.enabled=true"), {})}
    four_ranks = {f"{DP2TP2}:follow": (w.follow_tp_weights, (model, str(out / "follow-4"), 2), {}),
                  f"{DP2TP2}:many": (w.grpo_losses, (model, str(out / "many"), "train.plugin=hybrid",
                                                     "train.plugin_options={tp_size: 2, zero_stage: 2}"), {}),
                  f"{TP4}:tp4": (w.grpo_losses, (model, str(out / "tp4"), *w.hybrid(4)), {})}
    return {1: spawn_suites(request, 1, one_rank, timeout=1200),
            2: spawn_suites(request, 2, two_ranks, timeout=1800),
            4: spawn_suites(request, 4, four_ranks, timeout=1800)}


@pytest.mark.slow
def test_engine_follows_tp2_shards(runs):
    ranks = runs[2].get(FOLLOW)
    for r in ranks:
        assert r["diff"] < 1e-4, r
        assert len(r["gaps"]) == 5 and max(r["gaps"]) < 1e-4, r
        assert r["moved"] > 1e-4, r  # the five steps did change the weights the engine follows
        assert r["same_group"] and r["same_shards"], r
        assert r["gathered"] == ["model.embed_tokens.weight"], r  # everything else shard to shard
        assert "same prompts" in r["refused"], r
        assert "other weights" in r["stale"], r
    assert ranks[0]["completions"] == ranks[1]["completions"]
    assert ranks[0]["losses"] == ranks[1]["losses"]


@pytest.mark.slow
def test_tp2_run_matches_one_process(runs):
    """Three GRPO steps (k3 KL to the reference on, so the loss is not ~0) sampled live on the engine:
    tp2 on 2 ranks samples the same tokens as one process (exact rewards and lengths), its losses
    (~1e-3) agree within 1e-6 and its KL and trained policy (log-probs of fixed completions) within
    1e-5 (measured 3e-8, 5e-9 and 5e-7)."""
    one = runs[1].get(f"{TP2}:one")[0]
    tp2 = runs[2].get(f"{TP2}:tp2")
    assert tp2[0] == tp2[1], "the ranks of the tp group disagree"
    assert tp2[0]["indices"] == one["indices"]
    got = tp2[0]
    assert got["rewards"] == one["rewards"] and got["lengths"] == one["lengths"]
    assert max(got["gaps"]) < 1e-4
    assert _close(got["losses"], one["losses"], 1e-6), (got["losses"], one["losses"])
    assert _close(got["kl"], one["kl"]), (got["kl"], one["kl"])
    assert _close(got["after"], one["after"]), (got["after"], one["after"])
    assert not _close(one["after"], one["before"])  # the steps moved the policy


@pytest.mark.slow
def test_dp2_tp2_on_4_ranks(runs):
    """Two data replicas of a tp2 group: each replica's engine follows its shards, the replicas get
    different prompts, and the 4-rank run (ZeRO-2 over the replicas) equals one process with the
    same global batch (and so does hybrid with tp_size=1 on 2 ranks)."""
    ranks = runs[4].get(f"{DP2TP2}:follow")
    for r in ranks:
        assert r["diff"] < 1e-4 and max(r["gaps"]) < 1e-4 and len(r["gaps"]) == 5, r
        assert r["same_group"] and r["same_shards"] and r["gathered"] == ["model.embed_tokens.weight"], r
        assert "same prompts" in r["refused"] and "other weights" in r["stale"], r
    one = runs[1].get(f"{DP2TP2}:one")[0]
    many = runs[4].get(f"{DP2TP2}:many")  # ZeRO-2 over the 2 replicas
    indices = [m.pop("indices") for m in many]
    assert indices[0] == indices[1] and indices[2] == indices[3]  # a tp group is one data replica ...
    for step, (a, b) in enumerate(zip(indices[0], indices[2], strict=True)):  # ... and the replicas split the batch
        assert not set(a) & set(b) and sorted(a + b) == sorted(one["indices"][step]), (step, a, b)
    assert all(m == many[0] for m in many), "the ranks disagree"
    got = many[0]
    assert got["rewards"] == one["rewards"] and got["lengths"] == one["lengths"]
    assert _close(got["losses"], one["losses"], 1e-6), (got["losses"], one["losses"])
    assert _close(got["after"], one["after"]), (got["after"], one["after"])
    # hybrid with tp_size=1 (plain data parallelism, the engine reads the user's model whole): the same run
    dp2 = runs[2].get(f"{DP2TP2}:dp2")[0]
    assert dp2["rewards"] == one["rewards"] and max(dp2["gaps"]) < 1e-4
    assert _close(dp2["losses"], one["losses"], 1e-6) and _close(dp2["after"], one["after"])


@pytest.mark.slow
def test_tp4_replicates_the_2_kv_heads(runs):
    """tp 4 on the 2-key/value-head model (phalanx.models.heads: each pair of ranks shares one kv
    head): the trainer replicates the kv heads, and so does the rollout engine, which follows the
    trainer's shards (engine log-probs within 1e-4 of the trainer's at every step) and samples what
    one process samples; the losses and trained policy agree as at tp 2."""
    one = runs[1].get(f"{TP4}:one")[0]
    tp4 = runs[4].get(f"{TP4}:tp4")
    assert all(r == tp4[0] for r in tp4), "the ranks of the tp group disagree"
    got = tp4[0]
    assert got["indices"] == one["indices"]
    assert got["rewards"] == one["rewards"] and got["lengths"] == one["lengths"]
    assert max(got["gaps"]) < 1e-4
    assert _close(got["losses"], one["losses"], 1e-6), (got["losses"], one["losses"])
    assert _close(got["after"], one["after"]), (got["after"], one["after"])
    assert not _close(one["after"], one["before"])


@pytest.mark.slow
def test_lora_tp2_run_matches_one_process(runs):
    """LoRA GRPO under tp2: each rank merges its own shards of W + s*B*A into its engine shards (no
    gather beyond the token embedding), so the engine samples from the trained policy (gap < 1e-4
    every step) and the run equals one process with LoRA: the same tokens, losses within 1e-6, KL to
    the adapter-off reference and the trained policy within 1e-5."""
    one = runs[1].get(f"{LORA}:one")[0]
    tp2 = runs[2].get(f"{LORA}:tp2")
    assert tp2[0] == tp2[1], "the ranks of the tp group disagree"
    got = tp2[0]
    assert got["rewards"] == one["rewards"] and got["lengths"] == one["lengths"]
    assert max(got["gaps"]) < 1e-4 and max(one["gaps"]) < 1e-4
    assert _close(got["losses"], one["losses"], 1e-6), (got["losses"], one["losses"])
    assert _close(got["kl"], one["kl"]), (got["kl"], one["kl"])
    assert _close(got["after"], one["after"]), (got["after"], one["after"])
    assert not _close(one["after"], one["before"])  # the adapters moved the policy
