"""GRPO under data-parallel layouts: the engine follows the trained weights through DDP, ZeRO-2 and
FSDP2 (log-probs equal the trainer's within 1e-4 after five syncs), and one policy update from
fixed rollouts on 2 and 4 ranks equals the one-process update."""
from __future__ import annotations


import pytest
import torch

from tests.framework.spawn_batch import spawn_suites

pytestmark = pytest.mark.slow


def short_reward(*, completions, **_):
    return [1.0 if len(c) < 12 else 0.0 for c in completions]


def length_reward(*, completions, **_):
    return [float(len(c)) for c in completions]


def _cfg(model, out, *extra):
    from apps.chat_rlhf.grpo import load_grpo_config
    return load_grpo_config(None, [f"model={model}", "data.num_train=16", "data.num_heldout=0",
                                   "grpo.num_generations=4", "grpo.max_new_tokens=6",
                                   "grpo.rewards=[test_grpo_dist:short_reward]", "train.micro_batch_size=2",
                                   f"train.output_dir={out}", "train.lr=1e-3", "engine.max_model_len=96",
                                   "train.progress_bar=false", "train.plot=false", "train.resume=false", *extra])


def sync_under_layouts(model_dir: str, out_dir: str) -> dict:
    """On every rank: 5 GRPO steps per layout, then engine vs trainer log-probs of fresh samples."""
    import torch.distributed as dist

    from apps.chat_rlhf.grpo import build_run
    from apps.chat_rlhf.rollout import completion_batch, completion_logprobs, padded

    result = {}
    for plugin in ("ddp", "zero2", "fsdp"):
        run = build_run(_cfg(model_dir, f"{out_dir}/{plugin}", "train.max_steps=5", f"train.plugin={plugin}"))
        run.train()
        model_b = run.hook.model
        rollout = run.engine.generate(run.loss.prompt_ids[:2], 2, seeds=[1, 2, 3, 4])
        batch = completion_batch(rollout.prompt_ids, rollout.completion_ids, pad_id=run.tokenizer.pad_token_id)
        with torch.no_grad():
            logp, _ = completion_logprobs(model_b, batch)
        engine = padded(rollout.engine_logprobs, logp.shape[1])
        diff = ((logp - engine).abs() * batch["completion_mask"]).max().item()
        gaps = [r["logprob_gap"] for r in run.hook.history]
        moved = (torch.cat([p.detach().flatten() for p in run.model.parameters()]) if plugin != "fsdp" else None)
        result[plugin] = {"max_diff": diff, "gaps": gaps, "rank": dist.get_rank(),
                          "moved": None if moved is None else moved.abs().sum().item()}
    return result


# -- the rank bodies of every test, one spawn per world size ---------------------------------------
# (tests/framework/spawn_batch.py: rank start-up costs seconds); each test reads its own results.
SYNC, FIXED, SHARED = ("test_engine_follows_weights_under_ddp_zero2_fsdp", "test_fixed_rollout_update_matches_one_process",
                       "test_shared_prompt_forward_under_fsdp_matches_unshared_one_process")
FIXED_CASES = ((2, "token", "group"), (4, "sequence", "batch"))  # world size, aggregation, scale


@pytest.fixture(scope="module")
def runs(request, tiny_chat_model, tmp_path_factory):
    model, out = str(tiny_chat_model), tmp_path_factory.mktemp("grpo_dist")
    by_world: dict[int, dict] = {1: {}, 2: {}, 4: {}}
    by_world[2][SYNC] = (sync_under_layouts, (model, str(out / "sync")), {})
    for world, aggregation, scale in FIXED_CASES:
        by_world[1][f"{FIXED}:one-{world}"] = (fixed_update, (model, str(out / f"one-{world}"), 1, aggregation, scale), {})
        by_world[world][f"{FIXED}:many-{world}"] = (
            fixed_update, (model, str(out / f"many-{world}"), world, aggregation, scale), {})
    by_world[1][f"{SHARED}:one"] = (fixed_update, (model, str(out / "one-unshared"), 1, "token", "group",
                                                   "grpo.shared_prompt_forward=false"), {})
    by_world[2][f"{SHARED}:fsdp"] = (fixed_update, (model, str(out / "fsdp"), 2, "token", "group",
                                                    "grpo.shared_prompt_forward=true", "train.plugin=fsdp"), {})
    return {world: spawn_suites(request, world, suites, timeout=1800) for world, suites in by_world.items()}


def test_engine_follows_weights_under_ddp_zero2_fsdp(runs):
    results = runs[2].get(SYNC)
    for rank, per_plugin in enumerate(results):
        for plugin, r in per_plugin.items():
            assert r["max_diff"] < 1e-4, (plugin, rank, r)
            assert len(r["gaps"]) == 5 and max(r["gaps"]) < 1e-4, (plugin, rank, r)


# -- fixed rollouts: one update on 1, 2 and 4 ranks --------------------------------------------------
def fixed_update(model_dir: str, out_dir: str, world: int, aggregation: str, scale: str, *extra: str
                 ) -> list[float] | None:
    import torch.distributed as dist

    from apps.chat_rlhf.grpo import GRPOLoss, PromptIndices, RLHook, encode_prompts, load_prompt_sets
    from apps.chat_rlhf.models import load_policy, load_tokenizer
    from apps.chat_rlhf.rewards import RewardSet
    from fixed_rollouts import seeded_rollout_fn
    from phalanx.launch import context
    from phalanx.train import fit

    context()
    micro = 4 // world
    cfg = _cfg(model_dir, out_dir, "train.max_steps=1", f"train.micro_batch_size={micro}", "train.max_grad_norm=0",
               f"grpo.aggregation={aggregation}", f"grpo.scale={scale}", "train.lr=10.0",
               "train.adam_eps=10.0", "grpo.rewards=[test_grpo_dist:length_reward]", *extra)
    tokenizer, model = load_tokenizer(model_dir), load_policy(model_dir)
    reference = load_policy(model_dir).eval()
    records, _ = load_prompt_sets(cfg.data)
    ids = encode_prompts(tokenizer, records)
    rollout_fn = seeded_rollout_fn(reference, tokenizer, ids, cfg.grpo.num_generations)

    loss = GRPOLoss(cfg.grpo, records, ids, RewardSet.from_specs(cfg.grpo.rewards), rollout_fn, tokenizer.pad_token_id)
    fit(cfg.train, model, PromptIndices(len(records)), loss_fn=loss, hooks=[RLHook(loss, None, out_dir)])
    if "train.plugin=fsdp" in extra:  # DTensor shards: every rank joins the gather
        return torch.cat([p.detach().full_tensor().flatten() for p in model.parameters()]).tolist()
    if dist.get_rank() == 0:
        return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    return None


def test_fixed_rollout_update_matches_one_process(tiny_chat_model, runs):
    """AdamW's first step is lr * g / (|g| + eps): with eps large it is proportional to the gradient,
    so a wrong normalisation over ranks (a factor of world size) shows up in the update."""
    from apps.chat_rlhf.models import load_policy
    from phalanx.testing import assert_update_close
    start = torch.cat([p.detach().flatten() for p in load_policy(str(tiny_chat_model)).parameters()])
    for world, aggregation, scale in FIXED_CASES:
        one = torch.tensor(runs[1].get(f"{FIXED}:one-{world}")[0])
        many = torch.tensor(runs[world].get(f"{FIXED}:many-{world}")[0])
        assert (one - start).abs().max() > 1e-4
        assert_update_close(many, one, start, 1e-5, f"{world} ranks, {aggregation}/{scale}")


def test_shared_prompt_forward_under_fsdp_matches_unshared_one_process(tiny_chat_model, runs):
    """The packed shared-prompt forward (one call per micro-batch, 4D mask) under FSDP2 on 2 ranks
    gives the update of the plain unshared forward on one process."""
    from apps.chat_rlhf.models import load_policy
    from phalanx.testing import assert_update_close
    start = torch.cat([p.detach().flatten() for p in load_policy(str(tiny_chat_model)).parameters()])
    one = torch.tensor(runs[1].get(f"{SHARED}:one")[0])
    many = torch.tensor(runs[2].get(f"{SHARED}:fsdp")[0])
    assert (one - start).abs().max() > 1e-4
    assert_update_close(many, one, start, 1e-5, "fsdp2 on 2 ranks, shared prompt vs one process unshared")
