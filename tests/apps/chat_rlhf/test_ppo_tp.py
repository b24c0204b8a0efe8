"""PPO with a tensor-parallel actor (HybridParallelPlugin, tp_size=2): the actor-critic's actor is
split over the tp group by a policy under `actor.` (critic and value head replicated), the rollout
engine runs tensor-parallel on the same group and follows the actor's shards; one PPO update of
fixed rollouts under tp2 gives one process's losses, actor and critic, and the engine's log-probs
equal the trainer's after its syncs."""
from __future__ import annotations

import pytest

import tp_workers as w
from tests.framework.spawn_batch import spawn_suites


def _close(a, b, atol: float = 1e-5) -> bool:
    import torch
    return torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=atol)


def test_actor_critic_policy_points_into_the_actor(tiny_chat_model):
    """The plan covers the actor's layers, embedding and head by their paths inside ActorCritic."""
    from transformers import AutoModel

    from apps.chat_rlhf.models import load_policy
    from apps.chat_rlhf.ppo import ActorCritic, actor_critic_policy
    actor = load_policy(tiny_chat_model)
    model = ActorCritic(actor, AutoModel.from_pretrained(str(tiny_chat_model)))
    policy = actor_critic_policy(actor)
    assert policy.decoder_layers(model) is actor.model.layers
    for path in (policy.embedding, policy.final_norm, policy.head):
        assert model.get_submodule(path) is actor.get_submodule(path.removeprefix("actor."))
    assert policy.q == "self_attn.q_proj"  # paths inside a layer are the family's


def test_submodule_plan_and_weights_strip_the_prefix():
    from apps.chat_rlhf.rollout import submodule_plan, submodule_weights
    from phalanx.models.llama import POLICY as LLAMA
    from phalanx.shard.policy import HeadCounts
    from phalanx.shard.spec import REPLICATED, ShardSpec
    from phalanx.shard.tensor_parallel import ParamShard, TPPlan
    heads = HeadCounts(4, 2, 8)
    plan = TPPlan(LLAMA, None, 1, 2, heads, heads, False,
                  {"actor.lm_head.weight": ParamShard(ShardSpec(0), (10, 4)),
                   "critic.norm.weight": ParamShard(REPLICATED, (4,))})
    view = submodule_plan(plan, "actor")
    assert list(view.params) == ["lm_head.weight"] and view.spec("lm_head.weight") == ShardSpec(0)
    assert (view.rank, view.size, view.group) == (1, 2, None) and list(plan.params)[1] == "critic.norm.weight"
    assert submodule_weights({"module.actor.a.b": 1, "module.critic.a": 2}, "actor") == {"a.b": 1}


def test_pipeline_layout_is_refused(tiny_chat_model, tmp_path, launched):
    from apps.chat_rlhf.ppo import build_ppo
    from phalanx.config import ConfigError
    with pytest.raises(ConfigError, match="pp_size=2"):
        build_ppo(w.ppo_cfg(str(tiny_chat_model), str(tmp_path), "train.plugin=hybrid",
                            "train.plugin_options={tp_size: 1, pp_size: 2}"))


TP2, DP2TP2 = "test_ppo_update_tp2_matches_one_process", "test_ppo_update_dp2_tp2_on_4_ranks"
TRUNK = "test_cached_trunk_under_tp2_matches_one_process"
TOP = ("ppo.train_layers=1", "ppo.cache_frozen_trunk=true")
LORA = "test_ppo_lora_update_tp2_matches_one_process"


@pytest.fixture(scope="module")
def runs(request, tiny_chat_model, tmp_path_factory):
    model, out = str(tiny_chat_model), tmp_path_factory.mktemp("ppo_tp")
    two_ranks = {f"{TP2}:tp2": (w.ppo_update, (model, str(out / "tp2"), *w.hybrid(2)), {}),
                 f"{DP2TP2}:dp2": (w.ppo_update, (model, str(out / "dp2"), *w.hybrid(1)), {}),
                 f"{TRUNK}:tp2": (w.ppo_update, (model, str(out / "trunk-tp2"), *w.hybrid(2), *TOP), {}),
                 f"{LORA}:tp2": (w.ppo_update, (model, str(out / "lora-tp2"), *w.hybrid(2), "lora.enabled=true"), {})}
    one_rank = {f"{TP2}:one": (w.ppo_update, (model, str(out / "one")), {}),
                f"{TRUNK}:one": (w.ppo_update, (model, str(out / "trunk-one"), *TOP), {}),
                f"{LORA}:one": (w.ppo_update, (model, str(out / "lora-one"), "lora.enabled=true"), {})}
    return {1: spawn_suites(request, 1, one_rank, timeout=1200),
            2: spawn_suites(request, 2, two_ranks, timeout=1800),
            4: spawn_suites(request, 4, {f"{DP2TP2}:many": (w.ppo_update, (model, str(out / "many"), *w.hybrid(2)),
                                                            {})}, timeout=1800)}


@pytest.mark.slow
def test_ppo_update_tp2_matches_one_process(runs):
    """One PPO update (a rollout of fixed completions, two mini-batch steps, lr 1e-2) under tp2 on
    2 ranks: the same prompts, losses, trained actor (log-probs of fixed completions) and critic
    (values) as one process within 1e-5; the tp engine follows the actor's shards (only the token
    embedding gathered) and, synced after the update, its log-probs equal the trainer's within 1e-4."""
    one = runs[1].get(f"{TP2}:one")[0]
    tp2 = runs[2].get(f"{TP2}:tp2")
    assert tp2[0]["losses"] == tp2[1]["losses"] and tp2[0]["logp"] == tp2[1]["logp"], "the tp ranks disagree"
    got = tp2[0]
    assert got["engine_tp"] == 2 and one["engine_tp"] == 1
    assert got["indices"] == one["indices"]
    assert len(got["losses"]) == 2 and _close(got["losses"], one["losses"]), (got["losses"], one["losses"])
    assert _close(got["logp"], one["logp"]), (got["logp"], one["logp"])
    assert _close(got["values"], one["values"]), (got["values"], one["values"])
    assert not _close(one["logp"], one["initial_logp"])  # the update moved the actor
    assert got["engine_step"] == 2, got["engine_step"]  # synced after the update's last step
    assert got["gathered"] == ["model.embed_tokens.weight"], got["gathered"]  # everything else shard to shard
    for r in (*tp2, one):
        assert r["gap"] < 1e-4, r["gap"]
        assert max(r["rollout_gap"]) < 1e-4, r["rollout_gap"]


@pytest.mark.slow
def test_ppo_update_dp2_tp2_on_4_ranks(runs):
    """Two data replicas of a tp2 group (4 ranks) make the same update as two plain data-parallel
    ranks (hybrid, tp_size=1, whose engine reads the actor's weights whole): per-replica rollouts
    and mini-batches are the same, so the losses, actor and critic agree within 1e-5, and each
    replica's tp engine follows its shards."""
    dp2 = runs[2].get(f"{DP2TP2}:dp2")
    many = runs[4].get(f"{DP2TP2}:many")
    assert many[0]["indices"] == many[1]["indices"] == dp2[0]["indices"]  # a tp group is one data replica
    assert many[2]["indices"] == many[3]["indices"] == dp2[1]["indices"] != dp2[0]["indices"]
    for got, ref in ((many[0], dp2[0]), (many[2], dp2[1])):
        assert _close(got["losses"], ref["losses"]), (got["losses"], ref["losses"])
        assert _close(got["logp"], ref["logp"]) and _close(got["values"], ref["values"])
    for r in (*many, *dp2):
        assert r["gap"] < 1e-4 and max(r["rollout_gap"]) < 1e-4, r
    assert [r["engine_tp"] for r in many] == [2] * 4 and dp2[0]["engine_tp"] == 1


@pytest.mark.slow
def test_cached_trunk_under_tp2_matches_one_process(runs):
    """ppo.train_layers=1 with cache_frozen_trunk (the mini-batch steps run only the top block of
    the tp actor and the replicated critic, fed the rollout pass's frozen-trunk output) under tp2
    gives one process's update."""
    one = runs[1].get(f"{TRUNK}:one")[0]
    got = runs[2].get(f"{TRUNK}:tp2")[0]
    assert _close(got["losses"], one["losses"]), (got["losses"], one["losses"])
    assert _close(got["logp"], one["logp"]) and _close(got["values"], one["values"])
    assert not _close(one["logp"], one["initial_logp"]) and got["gap"] < 1e-4


@pytest.mark.slow
def test_ppo_lora_update_tp2_matches_one_process(runs):
    """LoRA PPO with a tp2 actor (adapters split with their base, the reference the actor with its
    adapter off): one process's losses, actor and critic within 1e-5, and the tp engine, fed each
    rank's merged shards, samples from the trained actor (gap < 1e-4 after the update's sync)."""
    one = runs[1].get(f"{LORA}:one")[0]
    tp2 = runs[2].get(f"{LORA}:tp2")
    assert tp2[0]["losses"] == tp2[1]["losses"] and tp2[0]["logp"] == tp2[1]["logp"], "the tp ranks disagree"
    got = tp2[0]
    assert got["engine_tp"] == 2 and got["indices"] == one["indices"]
    assert _close(got["losses"], one["losses"]), (got["losses"], one["losses"])
    assert _close(got["logp"], one["logp"]) and _close(got["values"], one["values"])
    assert not _close(one["logp"], one["initial_logp"])  # the adapters moved the actor
    assert got["gathered"] == ["model.embed_tokens.weight"], got["gathered"]
    for r in (*tp2, one):
        assert r["gap"] < 1e-4 and max(r["rollout_gap"]) < 1e-4, r
