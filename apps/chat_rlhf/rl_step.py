"""The online-RL step GRPO and PPO share: the rollout-and-score base of their losses (with DAPO's
dynamic sampling), the per-step statistics, and `RLHook` (engine sync, metrics, RL state in every
checkpoint)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from phalanx.observe import MetricsWriter, get_logger

from . import rl_losses as L
from .rewards import RewardSet
from .rl_rollouts import DataReplicas, concat_rollouts, refill_prompts, select_groups
from .rollout import LogProbGap, Rollout, RolloutEngine

ROLLOUT_METRICS = "rollouts.jsonl"


class StepStats:
    """Per-step sums on this rank, reduced over ranks once per step (in RLHook.after_step)."""

    KEYS = ("samples", "reward_sum", "reward_sq_sum", "groups", "zero_spread_groups", "completion_tokens",
            "truncated", "entropy_sum", "kl_sum", "tokens", "clipped_low", "clipped_high", "gap_sum",
            "tis_capped", "tis_weight_sum", "refilled_groups", "generate_s", "score_s", "mb_tokens", "lag",
            "wait_s")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.values = dict.fromkeys(self.KEYS, 0.0)
        self.started: float | None = None

    def add(self, **values: float) -> None:
        for k, v in values.items():
            self.values[k] += float(v)



class RolloutLoss:
    """The part of GRPO's and PPO's loss_fn before their losses: rollout (refilled under dynamic
    sampling), scoring, the KL controller and the stale-weight guard. `settings` has
    num_generations, kl_coef, kl_target, kl_horizon, max_logprob_gap and gap_jump (and
    dynamic_sampling / max_refill_rounds to refill)."""

    def __init__(self, settings, records: Sequence[dict], prompt_ids: Sequence[list[int]],
                 rewards: RewardSet, rollout_fn: Callable[[list[int], int], Rollout], pad_id: int, *,
                 reference: torch.nn.Module | None = None, seed: int = 0) -> None:
        self.s, self.records, self.prompt_ids = settings, records, prompt_ids
        self.rewards, self.rollout_fn, self.pad_id = rewards, rollout_fn, pad_id
        self.reference, self.seed = reference, seed
        self.kl = L.AdaptiveKLController(settings.kl_coef, settings.kl_target, settings.kl_horizon)
        self.guard = LogProbGap(settings.max_logprob_gap, settings.gap_jump)
        self.stats = StepStats()
        self.step = 0  # the last completed optimizer step (RLHook keeps it)
        self.replicas = DataReplicas()  # the builders set the tensor-parallel size of the layout

    def rollout_and_score(self, batch: dict):
        """Sample `n` completions per prompt of the batch on the engine and score them:
        (prompt indices, step, rollout, scores, the time the scoring started)."""
        if self.stats.started is None:
            self.stats.started = time.perf_counter()
        indices = batch["index"].tolist()
        step = self.step + 1
        ahead = getattr(self.rollout_fn, "prompts_for", None)  # rollouts sampled ahead: their prompts are fixed
        if ahead is not None:
            indices = ahead(step, len(indices))
        t0 = time.perf_counter()
        with torch.no_grad():
            rollout = self.rollout_fn(indices, step)
        # the lag (updates between the sampling weights and these) and the time the trainer waited
        self.stats.add(lag=rollout.lag, wait_s=time.perf_counter() - t0)
        t0 = time.perf_counter()
        scores = self.score(indices, rollout)
        if getattr(self.s, "dynamic_sampling", False):
            indices, rollout, scores = self.refill(indices, step, rollout, scores)
        return indices, step, rollout, scores, t0

    def score(self, indices: list[int], rollout: Rollout) -> torch.Tensor:
        prompts = [self.records[i]["prompt"] for i in indices for _ in range(rollout.n)]
        truths = [self.records[i].get("ground_truth") for i in indices for _ in range(rollout.n)]
        scores, _ = self.rewards(prompts, rollout.texts, truths)
        return scores

    def refill(self, indices: list[int], step: int, rollout: Rollout, scores: torch.Tensor):
        """DAPO's dynamic sampling: while groups have no reward spread (every sample scored alike, so
        no learning signal), sample as many new prompts (`refill_prompts`: never one already drawn
        this step) and keep the batch's size with the groups that have spread first; after
        `max_refill_rounds` draws the groups still without spread stay (and leave the loss)."""
        n, size, drawn = rollout.n, len(indices), set(indices)
        refilled = 0
        for round_ in range(self.s.max_refill_rounds):
            zero = L.zero_spread_groups(scores.view(-1, n)).tolist()
            if not any(zero):
                break
            extra = refill_prompts(self.seed, step, round_, self.replicas.rank, len(self.records), drawn, sum(zero))
            if not extra:
                break
            drawn.update(extra)
            with torch.no_grad():
                more = self.rollout_fn(extra, step)
            more_scores = self.score(extra, more)
            indices, rollout, scores = indices + extra, concat_rollouts(rollout, more), torch.cat([scores, more_scores])
            zero = L.zero_spread_groups(scores.view(-1, n)).tolist()
            keep = sorted(range(len(indices)), key=lambda g: (zero[g], g))[:size]  # spread first, then draw order
            keep.sort()
            refilled += sum(g >= size for g in keep)
            indices, rollout = [indices[g] for g in keep], select_groups(rollout, keep)
            scores = scores.view(-1, n)[keep].reshape(-1)
        self.stats.add(refilled_groups=refilled)
        return indices, rollout, scores

class RLHook:
    """fit hook: weight sync into the engine after every step, the step's metrics (JSONL + log
    line), and the RL state (step, KL controller, guard) inside every checkpoint."""

    name = "rl_state"

    def __init__(self, loss: RolloutLoss, engine: RolloutEngine | None, output_dir: str | Path) -> None:
        self.loss, self.engine, self.output_dir = loss, engine, Path(output_dir)
        self.model = None
        self.writer: MetricsWriter | None = None
        self.log = get_logger("apps.chat_rlhf")
        self.history: list[dict] = []

    def bind(self, model) -> None:
        from .adapters import bind_reference
        self.model = model
        self.loss.replicas.check_layout(model)
        bind_reference(self.loss.reference, model)  # a LoRA run's reference: the boosted model, adapter off
        if self.engine is not None:
            self.engine.sync(model)

    def _writer(self) -> MetricsWriter:
        if self.writer is None:
            main = not dist.is_initialized() or dist.get_rank() == 0
            self.writer = MetricsWriter(self.output_dir / ROLLOUT_METRICS, enabled=main,
                                        resume_step=self.loss.step if self.loss.step else None)
        return self.writer

    def after_step(self, step: int) -> None:
        st = self.loss.stats
        elapsed = time.perf_counter() - (st.started or time.perf_counter())
        train_s = elapsed - st.values["wait_s"] - st.values["score_s"]
        sync_s = self.engine.sync(self.model) if self.engine is not None else 0.0
        replicas = self.loss.replicas
        v = dict(zip(StepStats.KEYS, replicas.sum([st.values[k] for k in StepStats.KEYS])))
        world = replicas.count
        samples, tokens, mb_tokens = max(v["samples"], 1.0), max(v["tokens"], 1.0), max(v["mb_tokens"], 1.0)
        mean = v["reward_sum"] / samples
        record = {"step": step, "new_rollout": v["samples"] > 0, "kl_coef": self.loss.kl.value,
                  # clipped tokens of the step's mini-batch (the whole rollout when on-policy)
                  "clip_frac_low": v["clipped_low"] / mb_tokens, "clip_frac_high": v["clipped_high"] / mb_tokens,
                  "time_train_s": train_s, "time_sync_s": sync_s, "time_step_s": elapsed + sync_s}
        if v["samples"] > 0:  # a step that sampled a rollout (every step when on-policy)
            record.update({
                "reward_mean": mean, "reward_std": max(v["reward_sq_sum"] / samples - mean ** 2, 0.0) ** 0.5,
                "zero_spread_frac": v["zero_spread_groups"] / max(v["groups"], 1.0),
                "refilled_groups": v["refilled_groups"],
                "completion_len": v["completion_tokens"] / samples, "clipped_len_frac": v["truncated"] / samples,
                "entropy": v["entropy_sum"] / tokens, "kl": v["kl_sum"] / tokens,
                "logprob_gap": v["gap_sum"] / tokens, "tis_weight": v["tis_weight_sum"] / tokens,
                "tis_capped_frac": v["tis_capped"] / tokens,
                "rollout_tokens_per_s": v["completion_tokens"] / max(v["generate_s"], 1e-9),
                "time_generate_s": v["generate_s"] / world, "time_score_s": v["score_s"] / world,
                "time_wait_s": v["wait_s"] / world, "rollout_lag": v["lag"] / world})
            self.loss.kl.update(record["kl"], int(v["samples"]))  # per-token KL; horizon in samples
        self.loss.step = step
        st.reset()
        self.history.append(record)
        self._writer().log(record)
        line = f"step {step} | clip {record['clip_frac_low'] + record['clip_frac_high']:.3f}"
        if v["samples"] > 0:
            line += (f" | reward {mean:.3f} | zero-spread {record['zero_spread_frac']:.2f} | len "
                     f"{record['completion_len']:.1f} | gap {record['logprob_gap']:.2e} | "
                     f"gen {record['time_generate_s']:.1f}s" + (f" | lag {record['rollout_lag']:g}" if v["lag"] else ""))
        self.log.info(line + f" | train {train_s:.1f}s sync {sync_s:.2f}s")

    def save(self, directory: Path) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            directory.mkdir(parents=True, exist_ok=True)
            state = {"step": self.loss.step, "kl": self.loss.kl.state_dict(), "guard": self.loss.guard.state_dict()}
            (directory / "state.json").write_text(json.dumps(state))

    def load(self, directory: Path) -> None:
        state = json.loads((directory / "state.json").read_text())
        self.loss.step = int(state["step"])
        self.loss.kl.load_state_dict(state["kl"])
        self.loss.guard.load_state_dict(state["guard"])
        if self.engine is not None:
            self.engine.sync(self.model)  # the checkpoint's weights, not the initial ones

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
