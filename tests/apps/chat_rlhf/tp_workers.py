"""Rank bodies for test_grpo_tp.py (spawned processes import them by module name)."""
from __future__ import annotations

import torch


def short_reward(*, completions, **_):
    return [1.0 if len(c) < 12 else 0.0 for c in completions]


def grpo_cfg(model: str, out: str, *extra: str):
    from apps.chat_rlhf.grpo import load_grpo_config
    return load_grpo_config(None, [f"model={model}", "data.num_train=16", "data.num_heldout=0",
                                   "grpo.num_generations=4", "grpo.max_new_tokens=6",
                                   "grpo.rewards=[tp_workers:short_reward]", "train.micro_batch_size=2",
                                   f"train.output_dir={out}", "train.lr=1e-3", "train.min_lr_ratio=1.0",
                                   "engine.max_model_len=96", "train.progress_bar=false", "train.plot=false",
                                   "train.resume=false", *extra])


def hybrid(tp: int = 2) -> list[str]:
    return ["train.plugin=hybrid", f"train.plugin_options={{tp_size: {tp}}}"]


def engine_vs_trainer(run, policy=None) -> tuple[float, list[list[int]]]:
    """Max |engine - trainer| log-prob of fresh samples (4 per rank) under the boosted model (or
    `policy`, the trained causal LM inside it, e.g. PPO's actor)."""
    from apps.chat_rlhf.rollout import completion_batch, completion_logprobs, padded
    rollout = run.engine.generate(run.loss.prompt_ids[:2], 2, seeds=[1, 2, 3, 4])
    batch = completion_batch(rollout.prompt_ids, rollout.completion_ids, pad_id=run.tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = completion_logprobs(run.hook.model if policy is None else policy, batch)
    engine = padded(rollout.engine_logprobs, logp.shape[1])
    return ((logp - engine).abs() * batch["completion_mask"]).max().item(), rollout.completion_ids


def follow_tp_weights(model_dir: str, out_dir: str, tp: int) -> dict:
    """5 GRPO steps under HybridParallelPlugin(tp_size=tp), then the engine against the trainer; the
    engine's shards against the trainer's; a request that differs between tp peers; a broken sync."""
    import torch.distributed as dist

    from apps.chat_rlhf.grpo import build_run
    from apps.chat_rlhf.models import load_policy
    from apps.chat_rlhf.rollout import StaleWeightsError, tensor_parallel_plan
    from phalanx.booster.plugins.base import unwrap_model

    rank = dist.get_rank()
    run = build_run(grpo_cfg(model_dir, f"{out_dir}/follow", "train.max_steps=5", *hybrid(tp)))
    result = run.train()
    diff, completions = engine_vs_trainer(run)
    llm = run.engine.llm
    plan_group = tensor_parallel_plan(run.hook.model).group
    # the engine's shard of layer 0: q rows and o columns are the trainer's own pieces
    hf = unwrap_model(run.hook.model)
    attn = hf.model.layers[0].self_attn
    layer = llm.runner.model.layers[0]
    q_local, o_local = attn.q_proj.weight.detach(), attn.o_proj.weight.detach()
    same_shards = (torch.equal(layer.qkv_weight[:layer.q_size], q_local) and torch.equal(layer.o_weight, o_local)
                   and tuple(q_local.shape) == (layer.q_size, hf.config.hidden_size))
    rows, tp_rank = q_local.shape[0], rank % tp
    initial = load_policy(model_dir).model.layers[0].self_attn.q_proj.weight.detach()[tp_rank * rows:
                                                                                    (tp_rank + 1) * rows]
    moved = float((q_local - initial).abs().max())
    # tp peers must roll out the same prompts: a mismatch is refused on every rank
    refused = ""
    try:
        run.engine.generate([run.loss.prompt_ids[rank]], 1, seeds=[7])
    except RuntimeError as exc:
        refused = str(exc)
    # the stale-weight guard under tensor parallelism: a sync that does nothing stops the run
    broken = build_run(grpo_cfg(model_dir, f"{out_dir}/broken", "train.max_steps=4", "train.lr=3e-2",
                                "grpo.gap_jump=5", *hybrid(tp)))
    broken.engine.sync = lambda model: 0.0
    broken.hook.engine.sync = broken.engine.sync
    stale = ""
    try:
        broken.train()
    except StaleWeightsError as exc:
        stale = str(exc)
    return {"rank": rank, "diff": diff, "gaps": [r["logprob_gap"] for r in run.hook.history],
            "losses": result.losses, "completions": completions, "gathered": run.engine.gathered,
            "same_group": llm.tp.group is plan_group, "same_shards": same_shards, "moved": moved,
            "refused": refused, "stale": stale}


def fixed_logprobs(model, run) -> list[list[float]]:
    """Log-probs of fixed completions of two prompts under `model` (any layout): a fingerprint of
    every weight, comparable across layouts."""
    from apps.chat_rlhf.rollout import completion_batch, completion_logprobs
    prompts = run.loss.prompt_ids[:2]
    batch = completion_batch(prompts, [[5, 17, 40, 33], [9, 12, 200]], pad_id=run.tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, batch)
    return logp.tolist()


def grpo_losses(model_dir: str, out_dir: str, *extra: str) -> dict:
    """Losses, per-step rollout metrics and the trained policy's fingerprint of a 3-step GRPO run."""
    from apps.chat_rlhf.grpo import build_run
    from apps.chat_rlhf.models import load_policy
    run = build_run(grpo_cfg(model_dir, out_dir, "train.max_steps=3", "train.lr=1e-2", "grpo.kl_coef=0.1", *extra))
    indices, rollout_fn = [], run.loss.rollout_fn

    def recording(batch_indices, step):
        indices.append(list(batch_indices))
        return rollout_fn(batch_indices, step)
    run.loss.rollout_fn = recording
    result = run.train()
    return {"indices": indices, "losses": result.losses, "rewards": [r["reward_mean"] for r in run.hook.history],
            "lengths": [r["completion_len"] for r in run.hook.history],
            "kl": [r["kl"] for r in run.hook.history], "gaps": [r["logprob_gap"] for r in run.hook.history],
            "before": fixed_logprobs(load_policy(model_dir), run), "after": fixed_logprobs(run.hook.model, run)}


# -- PPO under tensor parallelism -----------------------------------------------------------------
def ppo_cfg(model: str, out: str, *extra: str):
    from apps.chat_rlhf.ppo import load_ppo_config
    return load_ppo_config(None, [f"model={model}", "data.num_train=16", "data.num_heldout=0",
                                  "ppo.num_generations=2", "ppo.max_new_tokens=6", "ppo.ppo_epochs=1",
                                  "ppo.num_mini_batches=2", "ppo.rewards=[tp_workers:short_reward]",
                                  "train.micro_batch_size=2", f"train.output_dir={out}", "train.lr=1e-2",
                                  "train.min_lr_ratio=1.0", "engine.max_model_len=96", "train.progress_bar=false",
                                  "train.plot=false", "train.resume=false", "train.peak_tflops=0", *extra])


def ppo_update(model_dir: str, out_dir: str, *extra: str) -> dict:
    """One PPO update (one rollout of fixed completions, two mini-batch steps) on any layout: the
    step losses, the trained actor's log-probs and the critic's values on fixed completions
    (fingerprints of every trained weight), and, after the engine's syncs (at bind and after the
    update), the largest |engine - trainer| log-prob of live samples."""
    from types import SimpleNamespace

    from fixed_rollouts import seeded_rollout_fn

    from apps.chat_rlhf.ppo import actor_critic_outputs, build_ppo
    from apps.chat_rlhf.rollout import completion_batch
    from phalanx.booster.plugins.base import unwrap_model
    from phalanx.train import fit

    cfg = ppo_cfg(model_dir, out_dir, "train.max_steps=2", *extra)
    model, tokenizer, records, loss, hook, _, engine = build_ppo(cfg)
    loss.rollout_fn = seeded_rollout_fn(loss.reference, tokenizer, loss.prompt_ids, cfg.ppo.num_generations)
    from apps.chat_rlhf.grpo import PromptIndices
    try:
        result = fit(cfg.train, model, PromptIndices(len(records)), loss_fn=loss, tokenizer=tokenizer, hooks=[hook])
    finally:
        hook.close()
    batch = completion_batch(loss.prompt_ids[:2], [[5, 17, 40, 33], [9, 12, 200]], pad_id=tokenizer.pad_token_id)
    with torch.no_grad():
        logp, values, _ = actor_critic_outputs(hook.model, batch)
    actor = unwrap_model(hook.model).actor
    run = SimpleNamespace(engine=engine, loss=loss, tokenizer=tokenizer, hook=hook)
    gap, _ = engine_vs_trainer(run, actor)
    return {"indices": loss.rollout_indices, "losses": result.losses, "logp": logp.tolist(),
            "values": values.tolist(), "gap": gap, "engine_tp": engine.tp_size, "engine_step": hook.engine_step,
            "gathered": engine.gathered, "rollout_gap": [r["logprob_gap"] for r in hook.history if "logprob_gap" in r],
            "initial_logp": fixed_actor_logprobs(model_dir, batch)}


def fixed_actor_logprobs(model_dir: str, batch) -> list[list[float]]:
    """The initial actor's log-probs of a batch (to show the update moved the policy)."""
    from apps.chat_rlhf.models import load_policy
    from apps.chat_rlhf.rollout import completion_logprobs
    with torch.no_grad():
        logp, _ = completion_logprobs(load_policy(model_dir), batch)
    return logp.tolist()


# -- measurement: shard-to-shard sync against gathering the full state dict ------------------------
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                    tie_word_embeddings=True)


def sync_timing(tp: int, repeats: int = 5) -> dict:
    """Seconds per weight sync of a SmolLM2-135M-shaped policy (random weights) trained with
    HybridParallelPlugin(tp_size=tp) into its tp engine: this rank's shards straight in
    (`RolloutEngine.sync`) vs every weight gathered whole and sliced again (full state dict)."""
    import math
    import time

    from transformers import LlamaConfig, LlamaForCausalLM

    from apps.chat_rlhf.rollout import RolloutEngine
    from phalanx.booster import Booster
    from phalanx.booster.plugins.hybrid import HybridParallelPlugin

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M))
    engine = RolloutEngine.build(model, None, max_new_tokens=8, max_model_len=64, kv_cache_memory_gib=0.05,
                                 tp_size=tp)
    plugin = HybridParallelPlugin(tp_size=tp)
    model_b, *_ = Booster(plugin).boost(model)
    engine.sync(model_b)  # adopts the group; warm-up

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    shards = timed(lambda: engine.sync(model_b))
    full = timed(lambda: engine.llm.load_weights(plugin.full_model_state_dict(model_b), strict=True))
    from apps.chat_rlhf.rollout import tensor_parallel_plan
    plan = tensor_parallel_plan(model_b)
    numel = {n: math.prod(plan.full_shape(n, t)) for n, t in model.named_parameters()}
    return {"tp": tp, "shard_sync_s": shards, "full_gather_sync_s": full, "gathered": engine.gathered,
            "gathered_numel": sum(numel[n] for n in engine.gathered), "total_numel": sum(numel.values())}


if __name__ == "__main__":  # python tests/apps/chat_rlhf/tp_workers.py [tp]
    import sys

    from phalanx.testing import spawn
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    print(spawn(sync_timing, tp, tp, timeout=900)[0])
