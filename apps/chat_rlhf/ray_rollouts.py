"""Decoupled rollouts on Ray (`rollout.mode: ray`): the engines run in Ray actors, apart from the trainer.

    python -m apps.chat_rlhf.grpo --config apps/chat_rlhf/configs/grpo_ray.yaml

The layout, as in ColossalChat's distributed RL, verl and OpenRLHF: `num_workers` rollout workers
(`RolloutWorker`, each a Ray actor holding one `RolloutEngine` of our inference engine) and the
trainer. The trainer is the driver process itself, holding the Booster inside `phalanx.train.fit`,
not an actor: fit keeps its checkpoints, resume, logging, evaluation and every plugin unchanged, and
the recipe's own process is the one the user started (and can debug); only generation moves out.

- **Prompts and samples** flow through Ray's object store: the driver submits each worker its
  share of a rollout's prompt groups (token ids and per-sample seeds, `sample_seed`: the same seeds
  as the colocated engine, so the samples are the same) and gets `Rollout`s back.
- **Weights** are broadcast after every update (`RayRolloutEngine.sync`, called where the colocated
  engine syncs): the trainer's state dict copied to the host once, `ray.put` once, every worker
  loads that one object into its engine. A worker runs its calls in order, so a rollout submitted
  after a sync samples with those weights.
- **Staleness** (`max_staleness: k`, `PipelinedRollouts`): when the trainer asks for rollout r, the
  rollouts up to r + k are already submitted, so generation of step s+1 overlaps training of step
  s. Rollout r + k was submitted with the weights of the update before, so the trainer is up to k
  updates ahead of the weights that sampled it (the `lag`, logged as `rollout_lag`, measured from
  the version each worker reports). The old policy of the loss is the trainer's own forward at
  rollout time, and the truncated importance weight min(pi_trainer / pi_engine, tis_cap) of every
  token corrects the sampling distribution's lag as it corrects engine rounding. The stale-weight
  guard keeps only its absolute bound (`max_logprob_gap`) on lagged rollouts. The prompts of rollout
  r are known ahead: with k > 0 they follow `rollout_prompts` (a seeded pass over the prompts, as
  `ppo_epochs` > 1 uses), not fit's sampler.

Ray is an extra (`pip install -e ".[chat,ray]"`); only this mode imports it.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Sequence

import torch
import torch.distributed as dist

from phalanx.config import ConfigError

from .rollout import PromptTooLongError, Rollout, RolloutEngine

RAY_INSTALL = 'pip install "ray==2.58.0"   (or, in a checkout: pip install -e ".[chat,ray]")'


def require_ray():
    """The `ray` module, or one error saying how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ConfigError(f"rollout.mode=ray needs Ray, which cannot be imported here ({e}). Install it: {RAY_INSTALL}"
                          " -- or use rollout.mode=colocated (no Ray needed)") from None
    return ray


def host_weights(weights) -> dict[str, torch.Tensor]:
    """A state dict (or (name, tensor) pairs, e.g. LoRA-merged) as detached host tensors, for `ray.put`."""
    items = weights.items() if isinstance(weights, Mapping) else weights
    return {name: t.detach().to("cpu", copy=True) for name, t in items}


class _PolicySnapshot:
    """What `LLM.from_model` reads of a policy: its HF config, generation config and weights."""

    def __init__(self, config, generation_config, weights: dict[str, torch.Tensor]) -> None:
        self.config, self.generation_config, self.weights = config, generation_config, weights

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.weights


class RolloutWorker:
    """A Ray actor (wrapped by `ray.remote` at run time): one `RolloutEngine` and the version of the
    weights it holds (0: the initial policy, v: the v-th broadcast)."""

    def __init__(self, config, generation_config, weights: dict[str, torch.Tensor], tokenizer,
                 engine_kwargs: dict, threads: int) -> None:
        torch.set_num_threads(max(1, threads))
        self.engine = RolloutEngine.build(_PolicySnapshot(config, generation_config, weights), tokenizer,
                                          **engine_kwargs)
        self.version = 0

    def check_prompts(self, prompts: dict[str, Sequence[list[int]]]) -> str | None:
        try:
            for what, ids in prompts.items():
                self.engine.check_prompts(ids, what)
        except PromptTooLongError as e:
            return str(e)
        return None

    def load(self, weights: dict[str, torch.Tensor], version: int) -> int:
        self.engine.llm.load_weights(weights, strict=True)
        self.version = version
        return version

    def generate(self, prompts: list[list[int]], n: int, seeds: list[int] | None, greedy: bool,
                 max_new_tokens: int | None) -> tuple[Rollout, int]:
        return self.engine.generate(prompts, n, seeds=seeds, greedy=greedy, max_new_tokens=max_new_tokens), self.version


class RayRolloutEngine:
    """The driver's handle on the rollout workers, with the `RolloutEngine` calls the recipes make:
    `generate` (the prompt groups split over the workers), `sync` (broadcast), `check_prompts`."""

    tp_size = 1

    def __init__(self, ray, workers: list, max_new_tokens: int, owns_ray: bool) -> None:
        self.ray, self.workers, self.max_new_tokens, self.owns_ray = ray, workers, max_new_tokens, owns_ray
        self.version = 0   # weight broadcasts so far (the workers start at version 0)
        self.sync_s = 0.0
        self.put_s = 0.0   # of sync_s: host copy and ray.put

    @classmethod
    def build(cls, policy: torch.nn.Module, tokenizer, sampling, e, r, *, seed: int,
              prompts: dict[str, Sequence[list[int]]], dtype: str = "float32") -> "RayRolloutEngine":
        """`num_workers` actors, each with an engine over `policy`'s weights (sent once through the
        object store); every prompt set in `prompts` is checked to fit before training starts."""
        ray = require_ray()
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise ConfigError(f"rollout.mode=ray with {dist.get_world_size()} training processes: the Ray mode's "
                              "trainer is the driver process alone (its rollout workers scale out instead); run it "
                              "without phalanx run -n, or use rollout.mode=colocated for data-parallel trainers")
        owns = not ray.is_initialized()
        if owns:
            ray.init(address=r.address or None, include_dashboard=False, log_to_driver=True)
        kwargs = dict(max_new_tokens=sampling.max_new_tokens, max_model_len=e.max_model_len,
                      temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=seed,
                      max_num_seqs=e.max_num_seqs, block_size=e.block_size, kv_cache_memory_gib=e.kv_cache_memory_gib,
                      tp_size=1, dtype=dtype)
        weights = ray.put(host_weights(policy.state_dict()))
        actor = ray.remote(RolloutWorker).options(num_cpus=r.worker_cpus, num_gpus=r.worker_gpus)
        workers = [actor.remote(policy.config, getattr(policy, "generation_config", None), weights, tokenizer, kwargs,
                                int(r.worker_cpus)) for _ in range(r.num_workers)]
        engine = cls(ray, workers, sampling.max_new_tokens, owns)
        problem = ray.get(workers[0].check_prompts.remote(dict(prompts)))
        if problem is not None:
            engine.close()
            raise PromptTooLongError(problem)
        return engine

    def check_prompts(self, prompts: Sequence[list[int]], what: str = "prompt") -> None:
        problem = self.ray.get(self.workers[0].check_prompts.remote({what: [list(p) for p in prompts]}))
        if problem is not None:
            raise PromptTooLongError(problem)

    def submit(self, prompts: Sequence[list[int]], n: int, *, seeds: Sequence[int] | None = None,
               greedy: bool = False, max_new_tokens: int | None = None) -> list:
        """Futures of the rollout, one per worker that got prompt groups (contiguous shares)."""
        G, W = len(prompts), len(self.workers)
        bounds = [G * w // W for w in range(W + 1)]
        futures = []
        for w, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            if b > a:
                futures.append(self.workers[w].generate.remote(
                    [list(p) for p in prompts[a:b]], n, None if seeds is None else [int(x) for x in seeds[a * n:b * n]],
                    greedy, max_new_tokens))
        return futures

    def collect(self, futures: list) -> Rollout:
        """The rollout of `submit`'s futures, in prompt order; `lag` = broadcasts since the oldest
        weights that sampled it; `generate_s` = the slowest worker's engine time."""
        from .rl_rollouts import concat_rollouts
        parts = self.ray.get(futures)
        rollout = parts[0][0]
        for part, _ in parts[1:]:
            rollout = concat_rollouts(rollout, part)
        rollout.generate_s = max(p.generate_s for p, _ in parts)
        rollout.lag = self.version - min(v for _, v in parts)
        return rollout

    def generate(self, prompts: Sequence[list[int]], n: int, *, seeds: Sequence[int] | None = None,
                 greedy: bool = False, max_new_tokens: int | None = None) -> Rollout:
        return self.collect(self.submit(prompts, n, seeds=seeds, greedy=greedy, max_new_tokens=max_new_tokens))

    def sync(self, model: torch.nn.Module, submodule: str = "") -> float:
        """Broadcast the trained weights: one host copy, one `ray.put`, every worker loads it (queued
        after the rollouts already submitted to it). Returns the driver's seconds."""
        from .rollout import _weights_of
        t0 = time.perf_counter()
        with torch.no_grad():
            ref = self.ray.put(host_weights(_weights_of(model, submodule)))
        self.put_s = time.perf_counter() - t0
        self.version += 1
        for w in self.workers:
            w.load.remote(ref, self.version)
        self.sync_s = time.perf_counter() - t0
        return self.sync_s

    def close(self) -> None:
        """Stop the workers (and the local Ray instance, if this engine started it)."""
        for w in self.workers:
            self.ray.kill(w)
        self.workers = []
        if self.owns_ray and self.ray.is_initialized():
            self.ray.shutdown()


class PipelinedRollouts:
    """`rollout_fn(indices, step)` with generation running ahead: asked for rollout r (the rollout of
    optimizer step r * steps_per_rollout + 1), it first submits every rollout up to r + k not yet
    submitted, then waits for r. The prompts of rollout r are `prompts_for` its step (the loss takes
    them from here); any other request (dynamic sampling's refills) is sampled at once, lag 0."""

    def __init__(self, engine: RayRolloutEngine, prompt_ids: Sequence[list[int]], n: int, seed: int,
                 max_staleness: int, steps_per_rollout: int = 1) -> None:
        self.engine, self.prompt_ids, self.n, self.seed = engine, prompt_ids, n, seed
        self.k, self.K = max_staleness, steps_per_rollout
        self.pending: dict[int, tuple[list[int], list]] = {}
        self.wait_s = 0.0  # the last rollout's wait (what the overlap did not hide)

    def prompts_for(self, step: int, per_rank: int) -> list[int]:
        from .rl_rollouts import rollout_prompts
        return rollout_prompts(self.seed, (step - 1) // self.K, len(self.prompt_ids), per_rank)

    def _seeds(self, indices: list[int], step: int) -> list[int]:
        from .rl_rollouts import sample_seed
        return [sample_seed(self.seed, step, i, j) for i in indices for j in range(self.n)]

    def _submit(self, r: int, per_rank: int) -> None:
        step = r * self.K + 1
        indices = self.prompts_for(step, per_rank)
        self.pending[r] = (indices, self.engine.submit([self.prompt_ids[i] for i in indices], self.n,
                                                       seeds=self._seeds(indices, step)))

    def __call__(self, indices: list[int], step: int) -> Rollout:
        r, offset = divmod(step - 1, self.K)
        indices = list(indices)
        if offset or indices != self.prompts_for(step, len(indices)):
            return self.engine.generate([self.prompt_ids[i] for i in indices], self.n, seeds=self._seeds(indices, step))
        for old in [j for j in self.pending if j < r]:  # a resumed or restarted schedule: drop what it skipped
            del self.pending[old]
        for j in range(r, r + self.k + 1):
            if j not in self.pending:
                self._submit(j, len(indices))
        t0 = time.perf_counter()
        _, futures = self.pending.pop(r)
        rollout = self.engine.collect(futures)
        self.wait_s = time.perf_counter() - t0
        return rollout

