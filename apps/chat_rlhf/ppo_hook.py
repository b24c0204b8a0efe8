"""PPO's hook: per-step metrics (rollout metrics on the steps that made one), the engine synced
when the buffer is exhausted (and before evaluation), the rollout buffer inside every checkpoint
taken in the middle of a cycle; and the evaluation of the prompts a run trains on."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from phalanx.config import ConfigError

from .ppo_buffer import RolloutBuffer
from .rl_losses import explained_variance
from .rl_rollouts import DataReplicas, rollout_prompts, rollout_tp_size
from .rl_step import RLHook
from .rollout import RolloutEngine

ROLLOUT_SUMS = ("samples", "reward_sum", "reward_sq_sum", "within_sq_sum", "completion_tokens", "truncated",
                "kl_sum", "rollout_tokens", "gap_sum", "generate_s", "score_s", "prepare_s",
                "return_sum", "return_sq_sum", "residual_sum", "residual_sq_sum", "tis_weight_sum", "tis_capped",
                "lag")
STEP_SUMS = ("tokens", "clipped_low", "clipped_high", "value_clipped", "approx_kl_sum", "ratio_dev_sum",
             "entropy_sum", "policy_loss_sum", "value_loss_sum")



class ActorSync:
    """Duck-types the part of RolloutEngine that RLHook calls, syncing only the actor's weights."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine

    def sync(self, model: nn.Module) -> float:
        return self.engine.sync(model, submodule="actor")


class PPOHook(RLHook):
    """RLHook for PPO: per-step metrics (rollout metrics on the steps that made one), the engine
    synced when the buffer is exhausted (and before evaluation), and the rollout buffer inside
    every checkpoint taken in the middle of a cycle."""

    loss: PPOLoss

    def __init__(self, loss: PPOLoss, engine, output_dir) -> None:
        super().__init__(loss, engine, output_dir)
        self.engine_step = 0   # the step whose weights the engine holds
        self.heldout_before: dict | None = None

    def sync_engine(self) -> float:
        if self.engine is None or self.engine_step == self.loss.step:
            return 0.0
        seconds = self.engine.sync(self.model)
        self.engine_step = self.loss.step
        return seconds

    def after_step(self, step: int) -> None:
        loss, s = self.loss, self.loss.s
        world = loss.replicas.count
        started = loss.stats.started
        loss.step = step
        epoch, slot = loss.position(step)
        sync_s = self.sync_engine() if (step % s.steps_per_rollout == 0) else 0.0
        v = dict(zip(STEP_SUMS, loss.replicas.sum([loss.step_sums[k] for k in STEP_SUMS])))
        tokens = max(v["tokens"], 1.0)
        record: dict[str, Any] = {
            "step": step, "ppo_epoch": epoch, "mini_batch": slot, "new_rollout": bool(loss.rollout_sums),
            "policy_loss": v["policy_loss_sum"] / tokens, "value_loss": v["value_loss_sum"] / tokens,
            "clip_frac": (v["clipped_low"] + v["clipped_high"]) / tokens, "clip_frac_low": v["clipped_low"] / tokens,
            "clip_frac_high": v["clipped_high"] / tokens, "value_clip_frac": v["value_clipped"] / tokens,
            "approx_kl": v["approx_kl_sum"] / tokens, "ratio_dev": v["ratio_dev_sum"] / tokens,
            "entropy": v["entropy_sum"] / tokens, "kl_coef": loss.kl.value, "time_sync_s": sync_s,
            "policy_trained": not loss.critic_warmup(step - (step - 1) % s.steps_per_rollout)}
        if loss.rollout_sums:
            r = dict(zip(ROLLOUT_SUMS, loss.replicas.sum([loss.rollout_sums.get(k, 0.0) for k in ROLLOUT_SUMS])))
            samples = max(r["samples"], 1.0)
            mean = r["reward_sum"] / samples
            record.update({
                "reward_mean": mean, "reward_std": max(r["reward_sq_sum"] / samples - mean ** 2, 0.0) ** 0.5,
                # pooled std of the scores around their prompt's mean: the part of the reward that tells
                # one prompt's answers apart (the policy's learning signal), against reward_std's total
                "reward_within_std": (r["within_sq_sum"] / samples) ** 0.5,
                "critic_explained_var": explained_variance(r["return_sum"], r["return_sq_sum"], r["residual_sum"],
                                                           r["residual_sq_sum"], r["rollout_tokens"]),
                "completion_len": r["completion_tokens"] / samples, "clipped_len_frac": r["truncated"] / samples,
                "kl": r["kl_sum"] / max(r["rollout_tokens"], 1.0), "rollout_kl_coef": loss.kl_coef_used,
                "logprob_gap": r["gap_sum"] / max(r["rollout_tokens"], 1.0),
                "tis_weight": r["tis_weight_sum"] / max(r["rollout_tokens"], 1.0) if s.tis_cap is not None else 1.0,
                "tis_capped_frac": r["tis_capped"] / max(r["rollout_tokens"], 1.0),
                "rollout_tokens_per_s": r["completion_tokens"] / max(r["generate_s"], 1e-9),
                "time_generate_s": r["generate_s"] / world, "time_score_s": r["score_s"] / world,
                "time_prepare_s": r["prepare_s"] / world,
                "rollout_lag": r["lag"] / world})  # updates between the sampling weights and the trained ones (Ray)
        record["time_step_s"] = time.perf_counter() - (started or time.perf_counter())  # loss call to here
        loss.rollout_sums, loss.step_sums = {}, dict.fromkeys(STEP_SUMS, 0.0)
        loss.stats.reset()
        self.history.append(record)
        self._writer().log(record)
        line = (f"step {step} (epoch {epoch}, mini-batch {slot}) | clip {record['clip_frac']:.3f} | value clip "
                f"{record['value_clip_frac']:.3f} | approx_kl {record['approx_kl']:.2e}")
        if "reward_mean" in record:
            line += (f" | rollout: reward {record['reward_mean']:.3f} (within-prompt std "
                     f"{record['reward_within_std']:.3f}) | critic EV {record['critic_explained_var']:.2f} | kl "
                     f"{record['kl']:.3f} | len "
                     f"{record['completion_len']:.1f} | gap {record['logprob_gap']:.2e} | gen "
                     f"{record['time_generate_s']:.1f}s")
        self.log.info(line)

    def save(self, directory: Path) -> None:
        loss, s = self.loss, self.loss.s
        directory.mkdir(parents=True, exist_ok=True)
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        mid_cycle = loss.step % s.steps_per_rollout != 0
        if mid_cycle:
            loss.buffer.save(directory / f"buffer-rank{rank}.safetensors")
        if rank == 0:
            state = {"step": loss.step, "kl": loss.kl.state_dict(), "guard": loss.guard.state_dict(),
                     "ppo_epochs": s.ppo_epochs, "num_mini_batches": s.num_mini_batches, "world_size": world,
                     "buffer": mid_cycle}
            (directory / "state.json").write_text(json.dumps(state))

    def load(self, directory: Path) -> None:
        loss, s = self.loss, self.loss.s
        state = json.loads((directory / "state.json").read_text())
        loss.step = int(state["step"])
        loss.kl.load_state_dict(state["kl"])
        loss.guard.load_state_dict(state["guard"])
        loss.buffer = None
        if state.get("buffer"):
            rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
            saved = (state["ppo_epochs"], state["num_mini_batches"], state["world_size"])
            if saved != (s.ppo_epochs, s.num_mini_batches, world):
                raise ConfigError(
                    f"{directory.parent} was saved at step {loss.step}, in the middle of a rollout's mini-batches, with "
                    f"ppo_epochs={saved[0]}, num_mini_batches={saved[1]} on {saved[2]} rank(s); this run has "
                    f"{s.ppo_epochs}, {s.num_mini_batches} on {world}: resume with those settings, or from a "
                    "checkpoint at a rollout boundary (a step that is a multiple of ppo_epochs x num_mini_batches)")
            device = next(self.model.parameters()).device if self.model is not None else "cpu"
            loss.buffer = RolloutBuffer.load(directory / f"buffer-rank{rank}.safetensors", device)
            if loss.trunks is None:  # saved with cache_frozen_trunk, resumed without: the full forward it is
                loss.buffer.actor_hidden = loss.buffer.critic_hidden = None
        if self.engine is not None:
            self.engine.sync(self.model)  # the checkpoint's weights, not the initial ones
            self.engine_step = loss.step


def synced_eval(hook: PPOHook, evaluate):
    """eval_fn that first brings the engine up to the trained weights (it is synced lazily)."""
    def run(model=None, step: int = 0) -> dict:
        hook.sync_engine()
        return evaluate(model, step)
    return run


def trained_prompt_indices(cfg: "PPOConfig", num_prompts: int) -> list[int]:
    """The training prompts the rollouts of a `train.max_steps` run use, all ranks together, sorted."""
    world = DataReplicas(rollout_tp_size(cfg.train)).count
    rollouts = -(-cfg.train.max_steps // cfg.ppo.steps_per_rollout)
    size = cfg.train.micro_batch_size * world
    return sorted({i for r in range(rollouts) for i in rollout_prompts(cfg.train.seed, r, num_prompts, size)})
