"""What GRPO and PPO share before the loss: prompt sets, the colocated engine and its seeded
rollouts, the run's data replicas (and their sums), dynamic sampling's refill helpers, and the
prompts and mini-batch order of a rollout reused for several optimizer steps."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from phalanx.config import ConfigError
from phalanx.device import run_device
from phalanx.train import TrainConfig

from .rollout import Rollout, RolloutEngine


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
class RolloutSettings:
    """Where rollouts run: `colocated` (an engine inside each training process, the default) or
    `ray` (engine workers as Ray actors, `ray_rollouts.py`; Ray is an extra and only this mode
    imports it)."""

    mode: str = "colocated"      # colocated | ray
    num_workers: int = 1         # ray: rollout workers (actors); a rollout's prompt groups are split over them
    worker_cpus: float = 1.0     # ray: CPUs per worker (its torch threads)
    worker_gpus: float = 0.0     # ray: GPUs per worker (0: the worker's engine runs on the CPU)
    max_staleness: int = 0       # ray: rollouts sampled ahead; generation of step s+1 overlaps training of step s,
                                 # each rollout at most this many policy versions behind (0: on-policy)
    address: str = ""            # ray: the cluster to join ("" starts a local one unless ray.init ran already)

    def validate(self) -> None:
        if self.mode not in ("colocated", "ray"):
            raise ConfigError(f"rollout.mode={self.mode!r}: choose colocated or ray")
        if self.num_workers < 1 or self.worker_cpus <= 0 or self.worker_gpus < 0 or self.max_staleness < 0:
            raise ConfigError(f"rollout: num_workers={self.num_workers} (>= 1), worker_cpus={self.worker_cpus} (> 0), "
                              f"worker_gpus={self.worker_gpus} (>= 0), max_staleness={self.max_staleness} (>= 0)")
        if self.mode == "colocated" and self.max_staleness:
            raise ConfigError(f"rollout.max_staleness={self.max_staleness} needs rollout.mode=ray: a colocated engine "
                              "shares its process with the trainer, so generation cannot overlap training")
        if self.mode == "ray":
            from .ray_rollouts import require_ray
            require_ray()

    def check_layout(self, train: TrainConfig) -> None:
        """Ray mode's trainer is one process (the driver) with a tp_size-1 layout."""
        if self.mode != "ray":
            return
        if train.plugin == "hybrid" and int(train.plugin_options.get("tp_size", 1)) > 1:
            raise ConfigError("rollout.mode=ray with train.plugin_options.tp_size > 1: Ray rollout workers run whole "
                              "engines fed full weights; use rollout.mode=colocated for a tensor-parallel trainer")



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
                   generate_s=rollout.generate_s, lag=rollout.lag)


def concat_rollouts(a: Rollout, b: Rollout) -> Rollout:
    return Rollout(*(getattr(a, f) + getattr(b, f) for f in ROLLOUT_ROWS), n=a.n, generate_s=a.generate_s + b.generate_s,
                   lag=max(a.lag, b.lag))


ROLLOUT_ROWS = ("prompt_ids", "completion_ids", "engine_logprobs", "texts", "truncated")


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


def engine_dtype(train: TrainConfig) -> str:
    """The engine's dtype: the trainer's compute dtype (`train.precision` resolved on the run's
    device: bf16 under bf16 and fp8 training, fp16 under fp16, else fp32), so rollouts and the
    trainer's forward round alike."""
    from phalanx.amp.precision import resolve_precision
    return str(resolve_precision(train.precision, run_device()).compute_dtype).removeprefix("torch.")


def build_engine(policy: torch.nn.Module, tokenizer, sampling, e: EngineSettings, *, seed: int, tp_size: int,
                 prompts: dict[str, Sequence[list[int]]], dtype: str = "float32") -> RolloutEngine:
    """The colocated engine over the (not yet boosted) `policy`, GRPO's and PPO's alike: `sampling`
    has max_new_tokens, temperature, top_p and top_k (GRPOSettings, PPOSettings); `tp_size` from
    `rollout_tp_size`; `dtype` from `engine_dtype`. Every prompt set in `prompts` ({what: token
    ids}) is checked to fit first."""
    engine = RolloutEngine.build(policy, tokenizer, max_new_tokens=sampling.max_new_tokens,
                                 max_model_len=e.max_model_len, temperature=sampling.temperature,
                                 top_p=sampling.top_p, top_k=sampling.top_k, seed=seed, max_num_seqs=e.max_num_seqs,
                                 block_size=e.block_size, kv_cache_memory_gib=e.kv_cache_memory_gib, tp_size=tp_size,
                                 dtype=dtype)
    for what, ids in prompts.items():
        engine.check_prompts(ids, what)
    return engine


def rollout_engine(policy: torch.nn.Module, tokenizer, sampling, e: EngineSettings, r: RolloutSettings, *,
                   seed: int, tp_size: int, prompts: dict[str, Sequence[list[int]]], dtype: str = "float32"):
    """`build_engine`'s colocated engine, or under `rollout.mode=ray` the driver's handle on Ray
    rollout workers (`RayRolloutEngine`: the same generate / sync / check_prompts)."""
    if r.mode == "ray":
        from .ray_rollouts import RayRolloutEngine
        return RayRolloutEngine.build(policy, tokenizer, sampling, e, r, seed=seed, prompts=prompts, dtype=dtype)
    return build_engine(policy, tokenizer, sampling, e, seed=seed, tp_size=tp_size, prompts=prompts, dtype=dtype)


def rollout_function(engine, prompt_ids: Sequence[list[int]], n: int, seed: int, r: RolloutSettings, *,
                     steps_per_rollout: int = 1) -> Callable[[list[int], int], Rollout]:
    """`seeded_rollouts`, or with `rollout.max_staleness` k > 0 `PipelinedRollouts`: each rollout
    asked for while the next k are already generating on the Ray workers."""
    if r.mode == "ray" and r.max_staleness > 0:
        from .ray_rollouts import PipelinedRollouts
        return PipelinedRollouts(engine, prompt_ids, n, seed, r.max_staleness, steps_per_rollout)
    return seeded_rollouts(engine, prompt_ids, n, seed)


def seeded_rollouts(engine: RolloutEngine, prompt_ids: Sequence[list[int]], n: int, seed: int
                    ) -> Callable[[list[int], int], Rollout]:
    """`rollout_fn(indices, step)`: n samples of each prompt on the engine, each seeded by where it
    is in the run (`sample_seed`), so a resumed run and every rank of a tp group sample alike."""
    def rollout_fn(indices: list[int], step: int) -> Rollout:
        seeds = [sample_seed(seed, step, i, j) for i in indices for j in range(n)]
        return engine.generate([prompt_ids[i] for i in indices], n, seeds=seeds)
    return rollout_fn


def mini_batch_order(seed: int, rollout_step: int, epoch: int, size: int, num_mini_batches: int
                     ) -> list[torch.Tensor]:
    """Row indices of each mini-batch of one epoch: a permutation of the rollout's rows from a
    generator seeded by (seed, rollout step, epoch), so every rank and a resumed run agree."""
    digest = hashlib.sha256(f"ppo-mini-batches/{seed}/{rollout_step}/{epoch}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:7], "little"))
    return list(torch.randperm(size, generator=g).chunk(num_mini_batches))


def rollout_prompts(seed: int, rollout: int, num_prompts: int, per_rank: int, rank: int = 0, world: int = 1
                    ) -> list[int]:
    """Prompt indices of rollout number `rollout` (0-based) on `rank`: pass p over the prompts is a
    permutation seeded by (seed, p); each rollout takes its next `per_rank * world` indices, rank r
    every world-th of them from r (fit's sampler shards the same way). A pass holds
    num_prompts // (per_rank * world) rollouts; the few prompts left over wait for a later pass."""
    size = per_rank * world
    per_pass = num_prompts // size
    if per_pass < 1:
        raise ConfigError(f"{num_prompts} training prompts cannot fill one rollout of {per_rank} prompts x {world} "
                          "rank(s): lower train.micro_batch_size or raise data.num_train / data.max_prompt_tokens")
    p, slot = divmod(rollout, per_pass)
    digest = hashlib.sha256(f"ppo-prompts/{seed}/{p}".encode()).digest()
    perm = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(int.from_bytes(digest[:7], "little")))
    return perm[slot * size:(slot + 1) * size][rank::world].tolist()
