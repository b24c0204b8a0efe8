"""GRPO and its family in one trainer, with rollouts on our own engine.

    python -m apps.chat_rlhf.grpo --config apps/chat_rlhf/configs/grpo_arithmetic.yaml train.max_steps=20
    phalanx run -n 2 -m apps.chat_rlhf.grpo --config ... train.plugin=fsdp
    phalanx run -n 4 -m apps.chat_rlhf.grpo --config ... train.plugin=hybrid "train.plugin_options={tp_size: 2}"

One optimizer step (inside `phalanx.train.fit`, which brings the layout, checkpoints, resume and
logging): each rank takes its micro-batch of prompts, samples `n` completions per prompt on its
colocated engine, scores them, turns rewards into advantages, recomputes the sampled tokens'
log-probs with the trainer (the stale-weight guard compares them with the engine's), and takes
the clipped policy-gradient loss with the trainer's own log-probs as the old policy, each token
weighted by the truncated importance ratio trainer / engine (`tis_cap`); after the step `RLHook` copies
the new weights into the engine. The variants are options of `grpo:` (see `GRPOSettings`).

Under `train.plugin=hybrid` (tensor parallelism, pp_size=1) the engine runs tensor-parallel over
the trainer's tp group, the ranks of one tp group are one data replica (same prompts, same seeds,
the same rollout), and every count is summed once per replica (`DataReplicas`).
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from phalanx.config import ConfigError, load_config, parse_config_args
from phalanx.device import run_device, to_device
from phalanx.observe import MetricsWriter, get_logger
from phalanx.train import TrainConfig, fit

from . import rl_losses as L
from .rewards import RewardSet
from .rollout import LogProbGap, Rollout, RolloutEngine, completion_logprobs, logprob_batch, padded

ROLLOUT_METRICS = "rollouts.jsonl"
_NUMBER_FIRST = re.compile(r"\s*-?\d")


# -- configuration ---------------------------------------------------------------------------------
@dataclass
class DataSettings:
    source: str = "arithmetic"   # a generated task of tasks.py ("compare", "arithmetic") or prompt records (.jsonl/.parquet/dir)
    heldout: str = ""            # held-out prompt records; "" with a generated task: generated, disjoint from training
    num_train: int = 400         # generated: training problems; files: at most this many records (0: all)
    num_heldout: int = 200       # held-out problems scored by eval
    max_operand: int = 20        # generated: numbers in 1..max_operand
    seed: int = 0                # generated: generator seed
    kind: str = "prompt"         # files: "prompt" records, or "preference" pairs whose prompts are used (e.g. hh-rlhf)


@dataclass
class EngineSettings:
    max_model_len: int = 512          # prompt + completion tokens per sequence
    max_num_seqs: int = 64            # sequences decoded together
    block_size: int = 16              # KV-cache block (prompt blocks are shared by the n samples)
    kv_cache_memory_gib: float = 0.5  # KV-cache budget per rank on CPU


@dataclass
class GRPOSettings:
    num_generations: int = 8          # n samples per prompt
    max_new_tokens: int = 64
    temperature: float = 1.0          # sampling only; importance ratios use the raw distribution
    top_p: float = 1.0
    top_k: int = 0
    baseline: str = "grpo"            # grpo (group mean) | rloo (leave-one-out) | reinforce_pp (batch mean)
    scale: str = "group"              # group std (GRPO) | batch std | none (Dr. GRPO)
    aggregation: str = "token"        # token: mean over all tokens (DAPO) | sequence: mean of sequence means
    clip_low: float = 0.2             # ratio lower bound 1 - clip_low
    clip_high: float = 0.28           # ratio upper bound 1 + clip_high (clip-higher, DAPO; 0.2 = symmetric)
    dynamic_sampling: bool = False    # DAPO: groups whose rewards are all equal (no signal) are replaced by groups of
                                      # newly drawn prompts until the batch is full (at most max_refill_rounds
                                      # draws); any still without spread leave the loss
    max_refill_rounds: int = 4
    overlong_penalty: float = 0.0     # subtracted (at most) from completions near/at max_new_tokens
    overlong_buffer: int = 0          # soft zone: penalty grows over the last N tokens (0: truncated ones only)
    kl_coef: float = 0.0              # KL to the frozen initial policy in the loss (0: no reference model is built)
    kl_estimator: str = "k2"          # the KL term differentiated: k2 (unbiased gradient of KL(pi||ref)) | k3 (GRPO
                                      # paper; unbiased value, biased gradient); the logged `kl` is always k3's value
    kl_target: float | None = None    # adaptive KL controller target, per token (None: fixed kl_coef)
    kl_horizon: int = 10000           # the controller's horizon, in samples (completions)
    tis_cap: float | None = 2.0       # truncated importance sampling of the engine/trainer mismatch: each token's
                                      # gradient weighted by min(pi_trainer / pi_engine, tis_cap) (None: off)
    rewards: list[str] = field(default_factory=lambda: ["numeric"])  # built-ins, rm:<dir>, module:function
    reward_weights: list[float] = field(default_factory=list)
    max_logprob_gap: float = 0.5      # stale-weight guard: stop when mean |engine - trainer| log-prob exceeds it ...
    gap_jump: float = 20.0            # ... or jumps to this many times its running median
    shared_prompt_forward: bool = True  # training forward holds each prompt once for its n samples (exact; used
                                        # when n > 1, the attention is sdpa/eager and the estimate says it is cheaper)

    def validate(self) -> None:
        def need(ok: bool, key: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"grpo config '{key}'={getattr(self, key)!r}: {why}")
        need(self.num_generations >= 1, "num_generations", "must be at least 1")
        need(self.baseline in ("grpo", "rloo", "reinforce_pp"), "baseline", "choose grpo, rloo or reinforce_pp")
        need(self.baseline != "rloo" or self.num_generations >= 2, "baseline", "rloo needs num_generations >= 2")
        need(self.scale in ("group", "batch", "none"), "scale", "choose group, batch or none")
        need(self.aggregation in ("token", "sequence"), "aggregation", "choose token or sequence")
        need(self.max_new_tokens >= 1, "max_new_tokens", "must be at least 1")
        need(self.max_refill_rounds >= 0, "max_refill_rounds", "must be 0 or more")
        need(self.temperature > 0, "temperature", "must be > 0 (sampling; greedy rollouts have no spread)")
        need(0 <= self.clip_low < 1, "clip_low", "must be in [0, 1)")
        need(self.clip_high >= 0, "clip_high", "must be >= 0")
        need(self.kl_coef >= 0, "kl_coef", "must be >= 0")
        need(self.overlong_buffer < self.max_new_tokens, "overlong_buffer", "must be below max_new_tokens")
        need(self.max_logprob_gap > 0, "max_logprob_gap", "must be positive")
        need(self.kl_estimator in L.KL_ESTIMATORS, "kl_estimator", "choose k2 or k3")
        need(self.tis_cap is None or self.tis_cap >= 1, "tis_cap", "must be >= 1 (or null: no correction)")
        need(self.kl_horizon >= 1, "kl_horizon", "must be at least 1 (samples)")


@dataclass
class GRPOConfig:
    model: str = ""                   # policy: "" (SmolLM2-135M-Instruct), an HF directory or a checkpoint
    data: DataSettings = field(default_factory=DataSettings)
    grpo: GRPOSettings = field(default_factory=GRPOSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    train_layers: int = 0             # train only the top N blocks (+ final norm); 0: the whole model
    train: TrainConfig = field(default_factory=lambda: TrainConfig(output_dir="runs/chat_rlhf/grpo", lr=1e-6,
                                                                    micro_batch_size=4, precision="auto"))


def load_grpo_config(path: str | None, overrides: list[str] | None = None) -> GRPOConfig:
    cfg = load_config(GRPOConfig, path, overrides)
    cfg.grpo.validate()
    cfg.train.validate()
    return cfg


# -- data ------------------------------------------------------------------------------------------
def load_prompt_sets(data: DataSettings) -> tuple[list[dict], list[dict]]:
    """(train, held-out) prompt records {"prompt": messages, "ground_truth": str | None}."""
    from .tasks import TASKS, train_and_heldout
    if data.source in TASKS:
        return train_and_heldout(data.num_train, data.num_heldout, data.seed, data.max_operand, task=data.source)
    from .data import load_records

    def read(source: str, limit: int) -> list[dict]:
        if data.kind == "preference":
            return [{"prompt": r["prompt"], "ground_truth": None}
                    for r in load_records(source, "preference", max_records=limit)]
        if data.kind != "prompt":
            raise ConfigError(f"data.kind={data.kind!r}: choose prompt or preference")
        return load_records(source, "prompt", max_records=limit)

    if data.heldout:
        return read(data.source, data.num_train), read(data.heldout, data.num_heldout)
    if data.kind == "preference" and data.num_heldout:  # one file: the last num_heldout prompts are held out
        records = read(data.source, data.num_train + data.num_heldout if data.num_train else 0)
        return records[:-data.num_heldout], records[-data.num_heldout:]
    return read(data.source, data.num_train), []


def encode_prompts(tokenizer, records: Sequence[dict]) -> list[list[int]]:
    return [list(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                               return_dict=False)) for r in records]


class PromptIndices(torch.utils.data.Dataset):
    """What fit's sampler shuffles and shards: prompt indices (the rollout happens in the loss)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"index": torch.tensor(i)}


def sample_seed(seed: int, step: int, index: int, sample: int) -> int:
    """A rollout's sampling seed from where it is in the run, so a resumed run replays it exactly."""
    digest = hashlib.sha256(f"{seed}/{step}/{index}/{sample}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


# -- the step --------------------------------------------------------------------------------------
class StepStats:
    """Per-step sums on this rank, reduced over ranks once per step (in RLHook.after_step)."""

    KEYS = ("samples", "reward_sum", "reward_sq_sum", "groups", "zero_spread_groups", "completion_tokens",
            "truncated", "entropy_sum", "kl_sum", "tokens", "clipped_low", "clipped_high", "gap_sum",
            "tis_capped", "tis_weight_sum", "refilled_groups", "generate_s", "score_s")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.values = dict.fromkeys(self.KEYS, 0.0)
        self.started: float | None = None

    def add(self, **values: float) -> None:
        for k, v in values.items():
            self.values[k] += float(v)


def global_sum(values: Sequence[float]) -> list[float]:
    """Host numbers summed over the ranks (through the run's device: NCCL takes GPU tensors only)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [float(v) for v in values]
    t = torch.tensor(list(values), dtype=torch.float64, device=run_device())
    dist.all_reduce(t)
    return t.tolist()


@dataclass(frozen=True)
class DataReplicas:
    """The run's data replicas: every rank alone (DDP, ZeRO, FSDP, Gemini), or under tensor
    parallelism each group of `tp` consecutive ranks (tp is the innermost mesh dimension), whose
    ranks are given the same prompts and hold the same rollout. Sums count each replica once."""

    tp: int = 1

    @property
    def world(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def count(self) -> int:
        return self.world // self.tp

    @property
    def rank(self) -> int:
        return (dist.get_rank() if dist.is_initialized() else 0) // self.tp

    def sum(self, values: Sequence[float]) -> list[float]:
        return [v / self.tp for v in global_sum(values)]

    def gather(self, rewards: torch.Tensor) -> tuple[torch.Tensor, int]:
        """All replicas' [P, n] rewards stacked (equal P on every rank: fit's sampler drops the
        remainder), and where this replica's rows start; batch-level baselines need the global batch.
        `rewards` must be on the run's device (the collective's)."""
        if self.world == 1:
            return rewards, 0
        parts = [torch.empty_like(rewards) for _ in range(self.world)]
        dist.all_gather(parts, rewards.contiguous())
        return torch.cat(parts[::self.tp]), self.rank * rewards.shape[0]

    def check_layout(self, model: torch.nn.Module) -> None:
        """The boosted layout is the one these replicas assume (fit shards prompts by its dp rank)."""
        from phalanx.train import data_replica
        if data_replica(model) != (self.rank, self.count):
            raise RuntimeError(f"the training layout puts this rank in data replica {data_replica(model)} (rank, "
                               f"count) but the rollouts assume {(self.rank, self.count)} (tp_size={self.tp}, tp "
                               "innermost); GRPO and PPO support tensor parallelism with pp_size=1 and sp_size=1 only")


def overlong_shaping(lengths: torch.Tensor, truncated: torch.Tensor, max_new: int, penalty: float, buffer: int
                     ) -> torch.Tensor:
    """DAPO's overlong penalty (<= 0): linear over the last `buffer` tokens, full when truncated."""
    if penalty == 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    if buffer == 0:
        return -penalty * truncated.float()
    over = (lengths.float() - (max_new - buffer)).clamp(min=0) / buffer
    return -penalty * torch.where(truncated, torch.ones_like(over), over.clamp(max=1.0))


def tis_weights(trainer_lp: torch.Tensor, engine_lp: torch.Tensor, mask: torch.Tensor, cap: float | None
                ) -> torch.Tensor:
    """[B, T] truncated importance weights min(pi_trainer / pi_engine, cap) of the sampled tokens
    (1 off the mask, and everywhere with cap None): the engine samples from its own rounding of
    the policy (another kernel, another dtype, or weights a step behind), the gradient wants the
    trainer's distribution; the cap bounds the variance (Yao et al., 2025, "truncated importance
    sampling"). No gradient flows through them."""
    if cap is None:
        return torch.ones_like(trainer_lp)
    w = torch.exp((trainer_lp - engine_lp) * mask).clamp(max=cap)
    return torch.where(mask > 0, w, torch.ones_like(w)).detach()


def refill_prompts(seed: int, step: int, round_: int, replica: int, num_prompts: int, exclude: set[int], k: int
                   ) -> list[int]:
    """Up to k prompt indices for dynamic sampling's refill `round_` of `step` on data replica
    `replica`, none in `exclude`: a permutation seeded by all four, so a resumed run draws the same."""
    digest = hashlib.sha256(f"grpo-refill/{seed}/{step}/{replica}/{round_}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:7], "little"))
    return [i for i in torch.randperm(num_prompts, generator=g).tolist() if i not in exclude][:k]


def select_groups(rollout: Rollout, groups: Sequence[int]) -> Rollout:
    """The rollout's prompt groups `groups` (each its n rows), in that order."""
    rows = [g * rollout.n + j for g in groups for j in range(rollout.n)]
    return Rollout(*([getattr(rollout, f)[r] for r in rows] for f in ROLLOUT_ROWS), n=rollout.n,
                   generate_s=rollout.generate_s)


def concat_rollouts(a: Rollout, b: Rollout) -> Rollout:
    return Rollout(*(getattr(a, f) + getattr(b, f) for f in ROLLOUT_ROWS), n=a.n, generate_s=a.generate_s + b.generate_s)


ROLLOUT_ROWS = ("prompt_ids", "completion_ids", "engine_logprobs", "texts", "truncated")


class GRPOLoss:
    """fit's loss_fn: rollout (refilled under dynamic sampling), score, advantages, guard, clipped policy
    loss with truncated importance weights (+ an optional KL term, `kl_estimator`)."""

    def __init__(self, settings: GRPOSettings, records: Sequence[dict], prompt_ids: Sequence[list[int]],
                 rewards: RewardSet, rollout_fn: Callable[[list[int], int], Rollout], pad_id: int, *,
                 reference: torch.nn.Module | None = None, seed: int = 0) -> None:
        self.s, self.records, self.prompt_ids = settings, records, prompt_ids
        self.rewards, self.rollout_fn, self.pad_id = rewards, rollout_fn, pad_id
        self.reference, self.seed = reference, seed
        self.kl = L.AdaptiveKLController(settings.kl_coef, settings.kl_target, settings.kl_horizon)
        self.guard = LogProbGap(settings.max_logprob_gap, settings.gap_jump)
        self.stats = StepStats()
        self.step = 0  # the last completed optimizer step (RLHook keeps it)
        self.replicas = DataReplicas()  # build_run sets the tensor-parallel size of the layout

    def rollout_and_score(self, batch: dict):
        """Sample `n` completions per prompt of the batch on the engine and score them:
        (prompt indices, step, rollout, scores, the time the scoring started)."""
        if self.stats.started is None:
            self.stats.started = time.perf_counter()
        indices = batch["index"].tolist()
        step = self.step + 1
        with torch.no_grad():
            rollout = self.rollout_fn(indices, step)
        t0 = time.perf_counter()
        scores = self.score(indices, rollout)
        if getattr(self.s, "dynamic_sampling", False):  # GRPO's option (PPOLoss shares this method)
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

    def __call__(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        s, st = self.s, self.stats
        indices, step, rollout, scores, t0 = self.rollout_and_score(batch)
        n = rollout.n
        dev = next(model.parameters()).device  # the run's device: advantages, masks and the loss live there
        lengths = torch.tensor([len(c) for c in rollout.completion_ids])
        truncated = torch.tensor(rollout.truncated)
        scores = scores + overlong_shaping(lengths, truncated, s.max_new_tokens, s.overlong_penalty, s.overlong_buffer)
        grouped = scores.view(len(indices), n).to(dev)  # rewards are computed on the host
        replicas = self.replicas
        everyone, start = replicas.gather(grouped)
        adv = L.group_advantages(everyone, baseline=s.baseline, scale=s.scale)[start:start + len(indices)].reshape(-1)
        zero = L.zero_spread_groups(grouped)
        keep_seq = (~zero).repeat_interleave(n) if s.dynamic_sampling else \
            torch.ones(len(scores), dtype=torch.bool, device=dev)
        score_s = time.perf_counter() - t0

        tb = to_device(logprob_batch(rollout.prompt_ids, rollout.completion_ids, n, self.pad_id, model,
                                     shared=s.shared_prompt_forward), dev)
        mask = tb["completion_mask"] * keep_seq.unsqueeze(1)
        logp, entropy = completion_logprobs(model, tb, with_entropy=True)
        engine_lp = padded(rollout.engine_logprobs, logp.shape[1]).to(dev)
        raw_mask = tb["completion_mask"].float()
        local_gap = float(((logp.detach() - engine_lp).abs() * raw_mask).sum())
        tokens, kept_tokens, kept_seqs, gap_sum = replicas.sum([raw_mask.sum().item(), mask.sum().item(),
                                                                float(keep_seq.sum()), local_gap])
        self.guard.check(gap_sum / max(tokens, 1.0), step)

        # The old policy is the trainer's own forward at rollout time (these very weights: one update
        # per rollout), so the ratio starts at 1 whatever the engine's rounding; what the engine's
        # sampling distribution differs by is corrected by truncated importance sampling.
        tis = tis_weights(logp.detach(), engine_lp, raw_mask, s.tis_cap)
        loss, clip = L.policy_loss(logp, logp.detach(), adv.float().unsqueeze(1) * tis, mask, clip_low=s.clip_low,
                                   clip_high=s.clip_high, aggregation=s.aggregation,
                                   token_total=max(kept_tokens, 1.0), seq_total=max(kept_seqs, 1.0))
        kl_sum = 0.0
        if self.reference is not None:
            with torch.no_grad():
                ref_lp, _ = completion_logprobs(self.reference, tb)
            penalty = L.kl_penalty(logp, ref_lp, s.kl_estimator)
            loss = loss + self.kl.value * L.aggregate(penalty, mask, s.aggregation,
                                                       token_total=max(kept_tokens, 1.0), seq_total=max(kept_seqs, 1.0))
            kl_sum = float((L.k3_kl(logp.detach(), ref_lp) * raw_mask).sum())
        # fit averages gradients over data-parallel replicas; the totals above are global, so scale back up.
        st.add(samples=len(scores), reward_sum=float(scores.sum()), reward_sq_sum=float((scores ** 2).sum()),
               groups=len(indices), zero_spread_groups=float(zero.sum()), completion_tokens=float(lengths.sum()),
               truncated=float(truncated.sum()), entropy_sum=float(entropy.sum()), kl_sum=kl_sum,
               tokens=float(raw_mask.sum()), clipped_low=float(clip["clipped_low"]),
               clipped_high=float(clip["clipped_high"]), gap_sum=local_gap,
               tis_capped=float(((tis >= s.tis_cap) * raw_mask).sum()) if s.tis_cap is not None else 0.0,
               tis_weight_sum=float((tis * raw_mask).sum()), generate_s=rollout.generate_s, score_s=score_s)
        return loss * replicas.count


class RLHook:
    """fit hook: weight sync into the engine after every step, the step's metrics (JSONL + log
    line), and the RL state (step, KL controller, guard) inside every checkpoint."""

    name = "rl_state"

    def __init__(self, loss: GRPOLoss, engine: RolloutEngine | None, output_dir: str | Path) -> None:
        self.loss, self.engine, self.output_dir = loss, engine, Path(output_dir)
        self.model = None
        self.writer: MetricsWriter | None = None
        self.log = get_logger("apps.chat_rlhf")
        self.history: list[dict] = []

    def bind(self, model) -> None:
        self.model = model
        self.loss.replicas.check_layout(model)
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
        train_s = elapsed - st.values["generate_s"] - st.values["score_s"]
        sync_s = self.engine.sync(self.model) if self.engine is not None else 0.0
        replicas = self.loss.replicas
        v = dict(zip(StepStats.KEYS, replicas.sum([st.values[k] for k in StepStats.KEYS])))
        world = replicas.count
        samples, tokens = max(v["samples"], 1.0), max(v["tokens"], 1.0)
        mean = v["reward_sum"] / samples
        record = {
            "step": step, "reward_mean": mean, "reward_std": max(v["reward_sq_sum"] / samples - mean ** 2, 0.0) ** 0.5,
            "zero_spread_frac": v["zero_spread_groups"] / max(v["groups"], 1.0),
            "refilled_groups": v["refilled_groups"],
            "completion_len": v["completion_tokens"] / samples, "clipped_len_frac": v["truncated"] / samples,
            "entropy": v["entropy_sum"] / tokens, "kl": v["kl_sum"] / tokens, "kl_coef": self.loss.kl.value,
            "clip_frac_low": v["clipped_low"] / tokens, "clip_frac_high": v["clipped_high"] / tokens,
            "logprob_gap": v["gap_sum"] / tokens, "tis_weight": v["tis_weight_sum"] / tokens,
            "tis_capped_frac": v["tis_capped"] / tokens,
            "rollout_tokens_per_s": v["completion_tokens"] / max(v["generate_s"], 1e-9),
            "time_generate_s": v["generate_s"] / world, "time_score_s": v["score_s"] / world,
            "time_train_s": train_s, "time_sync_s": sync_s,
        }
        self.loss.kl.update(record["kl"], int(v["samples"]))  # per-token KL; horizon in samples
        self.loss.step = step
        st.reset()
        self.history.append(record)
        self._writer().log(record)
        self.log.info(f"step {step} | reward {mean:.3f} | zero-spread {record['zero_spread_frac']:.2f} | len "
                      f"{record['completion_len']:.1f} | gap {record['logprob_gap']:.2e} | "
                      f"gen {record['time_generate_s']:.1f}s "
                      f"train {train_s:.1f}s sync {sync_s:.2f}s")

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


# -- evaluation ------------------------------------------------------------------------------------
def heldout_eval(engine: RolloutEngine, records: Sequence[dict], prompt_ids: Sequence[list[int]], rewards: RewardSet
                 ) -> Callable[[Any, int], dict]:
    """eval_fn: greedy answers from the engine (which holds the latest weights), scored by the rewards;
    each data replica (a rank, or a tensor-parallel group) scores its share, counts are summed.
    `heldout_number_first` is the share of replies that open with a number (the answer format the
    demo teaches), whatever the number."""
    replicas = DataReplicas(engine.tp_size)

    def run(model=None, step: int = 0) -> dict:
        mine = list(range(replicas.rank, len(records), replicas.count))
        correct = total = number_first = 0.0
        if mine:
            out = engine.generate([prompt_ids[i] for i in mine], 1, greedy=True)
            scores, _ = rewards([records[i]["prompt"] for i in mine], out.texts,
                                [records[i].get("ground_truth") for i in mine])
            correct, total = float(scores.sum()), float(len(mine))
            number_first = float(sum(bool(_NUMBER_FIRST.match(t)) for t in out.texts))
        correct, total, number_first = replicas.sum([correct, total, number_first])
        return {"heldout_reward": correct / max(total, 1.0), "heldout_n": total,
                "heldout_number_first": number_first / max(total, 1.0)}
    return run


def plot_rl_curves(output_dir: str | Path, keys: Sequence[str] = ("reward_mean", "kl", "logprob_gap")) -> Path | None:
    """loss (from fit's metrics.jsonl) and the rollout metrics against step, one panel each."""
    from phalanx.observe import read_metrics
    output_dir = Path(output_dir)
    rl = read_metrics(output_dir / ROLLOUT_METRICS) if (output_dir / ROLLOUT_METRICS).exists() else []
    fit_m = read_metrics(output_dir / "metrics.jsonl") if (output_dir / "metrics.jsonl").exists() else []
    series = {"loss": [(r["step"], r["loss"]) for r in fit_m if isinstance(r.get("loss"), (int, float))]}
    for key in keys:
        series[key] = [(r["step"], r[key]) for r in rl if isinstance(r.get(key), (int, float))]
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(series), figsize=(4 * len(series), 3.2), dpi=110)
    for ax, (key, pts) in zip(axes if len(series) > 1 else [axes], series.items()):
        ax.plot(*zip(*pts), linewidth=1.2)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = output_dir / "rl_curves.png"
    fig.savefig(path)
    plt.close(fig)
    return path


# -- wiring ----------------------------------------------------------------------------------------
@dataclass
class GRPORun:
    """Everything a GRPO run is made of, built before training (so every input error comes first)."""

    cfg: GRPOConfig
    model: torch.nn.Module
    tokenizer: Any
    engine: RolloutEngine
    loss: GRPOLoss
    hook: RLHook
    train_records: list[dict]
    heldout_records: list[dict]
    heldout_ids: list[list[int]]
    rewards: RewardSet

    def evaluate(self) -> dict:
        return heldout_eval(self.engine, self.heldout_records, self.heldout_ids, self.rewards)()

    def train(self):
        eval_fn = heldout_eval(self.engine, self.heldout_records, self.heldout_ids, self.rewards) \
            if self.heldout_records else None
        try:
            return fit(self.cfg.train, self.model, PromptIndices(len(self.train_records)), loss_fn=self.loss,
                       eval_fn=eval_fn, tokenizer=self.tokenizer, hooks=[self.hook])
        finally:
            self.hook.close()


def rollout_tp_size(train: TrainConfig) -> int:
    """The engine's tensor-parallel size: the policy's under `plugin=hybrid`, else 1. Refuses the
    hybrid layouts a colocated engine cannot follow, before any work."""
    if train.plugin != "hybrid":
        return 1
    opts = train.plugin_options
    tp, pp, sp = (int(opts.get(k, 1)) for k in ("tp_size", "pp_size", "sp_size"))
    if pp > 1:
        raise ConfigError(f"train.plugin_options.pp_size={pp}: online RL rolls out on an engine colocated with the "
                          "policy, which needs every layer on each rank of its tensor-parallel group, while a pipeline "
                          "rank holds only its stages (and the rollout loss calls the model directly, not through "
                          "execute_pipeline); use pp_size=1 with tp_size and data parallelism")
    if sp > 1 or opts.get("sequence_parallelism"):
        raise ConfigError(f"train.plugin_options sp_size={sp}, sequence_parallelism="
                          f"{opts.get('sequence_parallelism')!r}: online RL's completion batches are short and of any "
                          "length; sequence parallelism is not wired for online RL: use tp_size (and dp) only")
    return tp


def build_engine(policy: torch.nn.Module, tokenizer, sampling, e: EngineSettings, *, seed: int, tp_size: int,
                 prompts: dict[str, Sequence[list[int]]]) -> RolloutEngine:
    """The colocated engine over the (not yet boosted) `policy`, GRPO's and PPO's alike: `sampling`
    has max_new_tokens, temperature, top_p and top_k (GRPOSettings, PPOSettings); `tp_size` from
    `rollout_tp_size`. Every prompt set in `prompts` ({what: token ids}) is checked to fit first."""
    engine = RolloutEngine.build(policy, tokenizer, max_new_tokens=sampling.max_new_tokens,
                                 max_model_len=e.max_model_len, temperature=sampling.temperature,
                                 top_p=sampling.top_p, top_k=sampling.top_k, seed=seed, max_num_seqs=e.max_num_seqs,
                                 block_size=e.block_size, kv_cache_memory_gib=e.kv_cache_memory_gib, tp_size=tp_size)
    for what, ids in prompts.items():
        engine.check_prompts(ids, what)
    return engine


def seeded_rollouts(engine: RolloutEngine, prompt_ids: Sequence[list[int]], n: int, seed: int
                    ) -> Callable[[list[int], int], Rollout]:
    """`rollout_fn(indices, step)`: n samples of each prompt on the engine, each seeded by where it
    is in the run (`sample_seed`), so a resumed run and every rank of a tp group sample alike."""
    def rollout_fn(indices: list[int], step: int) -> Rollout:
        seeds = [sample_seed(seed, step, i, j) for i in indices for j in range(n)]
        return engine.generate([prompt_ids[i] for i in indices], n, seeds=seeds)
    return rollout_fn


def build_run(cfg: GRPOConfig, *, model=None, tokenizer=None) -> GRPORun:
    from .models import load_policy, load_tokenizer, train_top_layers
    from phalanx.launch import context
    context()
    tp_size = rollout_tp_size(cfg.train)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model)
    model = model if model is not None else load_policy(cfg.model)
    train_top_layers(model, cfg.train_layers)
    s, e = cfg.grpo, cfg.engine
    rewards = RewardSet.from_specs(s.rewards, s.reward_weights)
    train_records, heldout_records = load_prompt_sets(cfg.data)
    if not train_records:
        raise ValueError(f"no training prompts in {cfg.data.source!r}")
    train_ids, heldout_ids = encode_prompts(tokenizer, train_records), encode_prompts(tokenizer, heldout_records)
    engine = build_engine(model, tokenizer, s, e, seed=cfg.train.seed, tp_size=tp_size,
                          prompts={"training prompt": train_ids, "held-out prompt": heldout_ids})
    reference = None
    if s.kl_coef > 0:
        import copy
        # a frozen copy of the starting policy, on the run's device: it scores the device batches of the step
        reference = copy.deepcopy(model).to(run_device()).eval().requires_grad_(False)
    rollout_fn = seeded_rollouts(engine, train_ids, s.num_generations, cfg.train.seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    loss = GRPOLoss(s, train_records, train_ids, rewards, rollout_fn, pad, reference=reference, seed=cfg.train.seed)
    loss.replicas = DataReplicas(tp_size)
    hook = RLHook(loss, engine, cfg.train.output_dir)
    return GRPORun(cfg, model, tokenizer, engine, loss, hook, train_records, heldout_records, heldout_ids, rewards)


def main(argv: list[str] | None = None) -> None:
    cfg, _ = parse_config_args("GRPO-family training with rollouts on the Phalanx engine", load_grpo_config, argv,
                               example="apps/chat_rlhf/configs/grpo_arithmetic.yaml")
    run = build_run(cfg)
    result = run.train()
    png = plot_rl_curves(cfg.train.output_dir) if (not dist.is_initialized() or dist.get_rank() == 0) else None
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"done: step {result.final_step}, held-out {result.last_eval}, curves {png}")


if __name__ == "__main__":
    main()
