"""GeminiPlugin: data parallelism with parameters, gradients and optimizer states kept in chunks
that move between device and host memory (`phalanx.gemini`), sharded over the ranks.

    plugin = GeminiPlugin(placement_policy="auto", device_memory_budget="20GiB", precision="bf16")
    plugin = GeminiPlugin(host_memory_budget="64GiB", offload_to_disk="auto", disk_dir="/nvme/scratch")

Set-up order (`configure_model`): cast to the compute precision, broadcast rank 0's weights,
pack the parameters into chunks (size searched unless `chunk_size_mb` is given, within the
device budget: `phalanx.gemini.chunk_search`), place them with the policy, hook the modules,
check that the unavoidable working set fits the budget, put on disk the optimizer chunks the
host budget cannot hold (`offload_to_disk`), and only then take memory.
See docs/gemini.md for the options and the memory model.

A lazy model (`phalanx.lazy`) stays on the meta device until the chunks are filled: each rank
reads (or initialises) only the elements its shards hold, tensor by tensor, and its fp32 masters
come straight from those values (not widened from the compute dtype).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from phalanx.amp.precision import Precision
from phalanx.booster.plugins.base import Plugin, unwrap_model
from phalanx.booster.wrappers import ModelWrapper
from phalanx.checkpoint.optimizer import FragmentReader, OptimizerFragments
from phalanx.gemini.checkpoint import gemini_fragments, load_gemini_fragments
from phalanx.gemini.chunk import placeholder, search_chunk_size
from phalanx.gemini.chunk_search import search_chunk_numel
from phalanx.gemini.disk import ChunkFileStore, DiskTier
from phalanx.gemini.hooks import install_hooks
from phalanx.gemini.manager import ChunkManager
from phalanx.gemini.optimizer import GeminiOptimizer
from phalanx.gemini.placement import AutoPlacement, StaticPlacement, place_optim_on_disk
from phalanx.gemini.tiers import DISK, MemoryTiers, device_capacity, parse_bytes
from phalanx.gemini.tracer import MemoryTracer
from phalanx.layout import Layout
from phalanx.zero import comm

MiB = 2**20
SEARCH_RANGE_MB = (8.0, 64.0, 1.0)  # min, max, step of the chunk-size search, MiB of compute dtype


class GeminiPlugin(Plugin):
    """GeminiPlugin(placement_policy="auto"|"static", device_memory_budget=None, shard_param_frac=1.0,
    offload_optim_frac=0.0, offload_param_frac=0.0, precision="auto", chunk_size_mb=None, max_norm=None,
    prefetch=1, host_memory_budget=None, offload_to_disk=False, disk_dir=None, disk_prefetch=2,
    disk_drop_cache=False, ranks_per_replica=1).

    ranks_per_replica=k (`Plugin.setup`): groups of k consecutive ranks share their samples (a
    sequence-parallel group); the chunks are still sharded over, and gradients averaged over,
    every rank (`shard_rank` / `shard_size`).

    Disk tier: `offload_to_disk=True` keeps every optimizer chunk that would live on the host
    (fp32 master and Adam moments; gradients stay in memory) in a file under `disk_dir` (default:
    the system's temp directory), `"auto"` only those `host_memory_budget` cannot hold. The
    optimizer step reads `disk_prefetch` chunks ahead and writes each back after its update."""

    name = "gemini"
    full_state_on_every_rank = True

    def __init__(self, placement_policy: str = "auto", device_memory_budget: str | int | None = None,
                 shard_param_frac: float = 1.0, offload_optim_frac: float = 0.0, offload_param_frac: float = 0.0,
                 precision: str | Precision = "auto", chunk_size_mb: float | None = None, max_norm: float | None = None,
                 prefetch: int = 1, host_memory_budget: str | int | None = None,
                 offload_to_disk: bool | str = False, disk_dir: str | None = None, disk_prefetch: int = 2,
                 disk_drop_cache: bool = False, ranks_per_replica: int = 1):
        super().__init__(precision, max_norm, ranks_per_replica)
        if offload_to_disk not in (False, True, "auto"):
            raise ValueError(f"offload_to_disk={offload_to_disk!r}: use False, True (every host optimizer chunk on "
                             "disk) or 'auto' (those host_memory_budget cannot hold)")
        if offload_to_disk == "auto" and host_memory_budget is None:
            raise ValueError("offload_to_disk='auto' moves to disk what host_memory_budget cannot hold: set "
                             "host_memory_budget (e.g. '64GiB'), or offload_to_disk=True for all of it")
        if disk_dir is not None and offload_to_disk is False:
            raise ValueError(f"disk_dir={disk_dir!r} is set but offload_to_disk is False: set offload_to_disk=True "
                             "or 'auto' to use it, or drop disk_dir")
        if not (isinstance(disk_prefetch, int) and disk_prefetch >= 1):
            raise ValueError(f"disk_prefetch={disk_prefetch!r} must be an integer >= 1 (chunks read ahead)")
        parse_bytes(host_memory_budget, None, "host_memory_budget")  # fail early on a bad size
        if placement_policy not in ("auto", "static"):
            raise ValueError(f"placement_policy={placement_policy!r}: use 'auto' or 'static'")
        if placement_policy == "auto" and (offload_optim_frac or offload_param_frac):
            raise ValueError("offload_optim_frac / offload_param_frac are for placement_policy='static'; "
                             "'auto' decides placement from the traced memory")
        if not 0.0 <= shard_param_frac <= 1.0:
            raise ValueError(f"shard_param_frac={shard_param_frac} must be between 0 and 1")
        if chunk_size_mb is not None and not chunk_size_mb > 0:
            raise ValueError(f"chunk_size_mb={chunk_size_mb} must be positive (or None to search)")
        self.placement_policy = placement_policy
        self.device_memory_budget = device_memory_budget
        self.shard_param_frac = shard_param_frac
        self.offload_optim_frac = offload_optim_frac
        self.offload_param_frac = offload_param_frac
        self.chunk_size_mb = chunk_size_mb
        self.prefetch = prefetch
        self.host_memory_budget = host_memory_budget
        self.offload_to_disk = offload_to_disk
        self.disk_dir = disk_dir
        self.disk_prefetch = disk_prefetch
        self.disk_drop_cache = disk_drop_cache
        self.manager: ChunkManager | None = None
        self._chunk_size_is_smallest = False
        self.tracer = None

    def describe(self) -> str:
        budget = self.manager.tiers.budget / MiB if self.manager else float("nan")
        on_disk = sum(c.optim_tier == DISK for c in self.manager.chunks) if self.manager else 0
        disk = f", optimizer chunks on disk={on_disk} in {self.manager.disk.store.directory}" if on_disk else ""
        return (f"gemini(precision={self.precision.name}, {self.describe_data_parallel()}, "
                f"placement={self.placement_policy}, "
                f"budget={budget:.1f}MiB, chunks={len(self.manager.chunks) if self.manager else '?'}{disk})")

    def plan_layout(self, world: int) -> tuple[Layout, dict]:
        extra: dict = {"dtype": self.precision}
        if self.chunk_size_mb is not None:
            extra["gemini_chunk_mb"] = self.chunk_size_mb
        return Layout("gemini", world, offload_optim=self.offload_optim_frac > 0,
                      offload_param=self.offload_param_frac > 0), extra

    # ------------------------------------------------------------------ set-up
    def _chunk_numel(self, numels: list[int], itemsize: int, trainable: list[bool] | None = None,
                     modules: list[list[int]] | None = None, budget: int | None = None) -> int:
        """The chunk size in elements: `chunk_size_mb`, else searched for the least padding (with
        `modules` and `budget`: within what the budget allows, `phalanx.gemini.chunk_search`)."""
        self._chunk_size_is_smallest = False
        if self.chunk_size_mb is not None:
            return max(self.shard_size, int(self.chunk_size_mb * MiB) // itemsize)
        lo, hi, step = (int(x * MiB) // itemsize for x in SEARCH_RANGE_MB)
        if modules is None or budget is None:
            return search_chunk_size(numels, lo, hi, step, self.shard_size)
        size, self._chunk_size_is_smallest = search_chunk_numel(
            numels, trainable, modules, budget=budget, world=self.shard_size, shard_param_frac=self.shard_param_frac,
            itemsize=itemsize, default_range=(lo, hi, step))
        return size

    def configure_model(self, model: nn.Module) -> ModelWrapper:
        from phalanx import lazy

        if self.manager is not None:
            raise ValueError("a GeminiPlugin manages one model: build one plugin per model")
        dtype = self.precision.compute_dtype
        from phalanx.booster.lora import is_lora_model

        if lazy.is_lazy(model) and is_lora_model(model):
            raise ValueError("GeminiPlugin cannot take LoRA adapters on a lazy (meta-device) base: its chunks hold "
                             "only the adapters, and the frozen base would not be read. Call "
                             "phalanx.lazy.materialize(model) before booster.boost, or use FSDPPlugin, which reads "
                             "each rank's rows of the base (docs/lora.md)")
        source = lazy.source_for(model, device=self.device, group=self.dp_group)
        if source is not None:
            lazy.materialise_buffers(model, source)  # the parameters wait for their chunks
        model = model.to(dtype)
        if source is not None:  # real (zero-memory) placeholders before any hook is installed on them
            for p in model.parameters():
                if p.is_meta:
                    lazy.swap_in(p, placeholder(p.shape, p.dtype, self.device))
        for buf in model.buffers():
            buf.data = buf.data.to(self.device)
        with torch.no_grad():
            if self.shard_size > 1:  # every rank of the process group, not the data replicas
                seen = set()
                for t in list(model.parameters()) + list(model.buffers()):
                    if id(t) not in seen and source is None:
                        seen.add(id(t))
                        data = t.data.to(self.device)
                        comm.broadcast_from_first(data, self.dp_group, "gemini.broadcast_model")
                        t.data = data.to(t.device)
        named = _chunked_parameters(model, self.device)  # unique parameters, model order
        budget = parse_bytes(self.device_memory_budget, device_capacity(self.device))
        host_budget = parse_bytes(self.host_memory_budget, None, "host_memory_budget")
        tiers = MemoryTiers(self.device, budget, host_budget)
        index = {id(p): i for i, (_, p) in enumerate(named)}
        modules = [[index[id(p)] for p in m.parameters(recurse=False) if id(p) in index] for m in model.modules()]
        chunk_numel = self._chunk_numel([p.numel() for _, p in named], dtype.itemsize,
                                        [p.requires_grad for _, p in named], modules, budget)
        self.manager = ChunkManager(named, chunk_numel=chunk_numel, dp_size=self.shard_size, dp_rank=self.shard_rank,
                                    group=self.dp_group, tiers=tiers, shard_param_frac=self.shard_param_frac,
                                    prefetch=self.prefetch)
        self.tracer = MemoryTracer(self.manager)
        if self.placement_policy == "static":
            policy = StaticPlacement(self.offload_param_frac, self.offload_optim_frac, tracer=self.tracer)
        else:
            policy = AutoPlacement(self.tracer)
        policy.chunk_size_is_smallest = self._chunk_size_is_smallest
        self.manager.policy = policy
        table = install_hooks(self.manager, model, self.tracer)
        policy.check_fits(self.manager, table)  # before any memory is taken
        shard_tiers, optim_tiers = policy.initial_tiers(self.manager)
        optim_tiers = place_optim_on_disk(self.manager.chunks, shard_tiers, optim_tiers, host_budget=host_budget,
                                          offload_to_disk=self.offload_to_disk, disk_depth=self.disk_prefetch)
        on_disk = [c for c, t in zip(self.manager.chunks, optim_tiers) if t == DISK]
        if on_disk:
            store = ChunkFileStore(self.disk_dir, rank=self.shard_rank, drop_cache=self.disk_drop_cache)
            record = 3 * max(c.shard_numel for c in on_disk)  # fp32 master and two moments
            self.manager.disk = DiskTier(store, tiers, record, depth=self.disk_prefetch)
        self.manager.materialise(shard_tiers, optim_tiers,
                                 read=lazy.flat_reader(source) if source is not None else None)
        return self.boosted(ModelWrapper(model, model))

    def configure_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> GeminiOptimizer:
        if self.manager is None:
            raise ValueError("boost the model together with the optimizer (GeminiPlugin needs the model first)")
        return GeminiOptimizer(optimizer, self.manager, max_norm=self.max_norm, precision=self.precision)

    # ------------------------------------------------------------------ training
    @contextlib.contextmanager
    def no_sync(self, model: nn.Module | None, optimizer: GeminiOptimizer | None) -> Iterator[None]:
        """Gradient accumulation needs no special context: each micro-step's reduced gradients
        add up in the fp32 gradient shards until `step`."""
        yield

    def clip_grad_norm(self, optimizer: GeminiOptimizer, max_norm: float) -> float:
        return optimizer.clip_grad_norm(max_norm)

    # ------------------------------------------------------------------ checkpoint hooks
    def _names(self, model: nn.Module) -> dict[int, str]:
        return {id(p): n for n, p in unwrap_model(model).named_parameters()}

    def iter_full_model_state(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """Parameters from the fp32 masters, gathered one parameter at a time (each rank broadcasts
        its part straight into the tensor handed out: a save holds one tensor, not its chunk);
        buffers as they are."""
        unwrapped = unwrap_model(model)
        param_ids = {n: id(p) for n, p in unwrapped.named_parameters(remove_duplicate=False)}
        buffers = dict(unwrapped.named_buffers())
        outside = {**buffers, **dict(unwrapped.named_parameters(remove_duplicate=False))}  # LoRA's frozen base
        for name in unwrapped.state_dict().keys():
            if param_ids.get(name) in self.manager.where:
                chunk, k = self.manager.where[param_ids[name]]
                yield name, self.manager.gather_master_param(chunk, k).view(chunk.params[k].shape)
            elif name in outside:
                yield name, outside[name].detach().cpu().clone()

    def full_model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return dict(self.iter_full_model_state(model))

    def load_full_model_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        unwrapped = unwrap_model(model)
        outside = [(n, p) for n, p in unwrapped.named_parameters(remove_duplicate=False) if id(p) not in self.manager.where]
        with torch.no_grad():
            for name, tensor in list(unwrapped.named_buffers()) + outside:  # outside: LoRA's frozen base
                if name in state_dict:
                    tensor.copy_(state_dict[name].to(tensor))
        values = {id(p): state_dict[n] for n, p in unwrapped.named_parameters(remove_duplicate=False)
                  if n in state_dict and id(p) in self.manager.where}
        self.manager.load_values(values)

    def optimizer_fragments(self, optimizer: GeminiOptimizer) -> OptimizerFragments:
        return gemini_fragments(optimizer, self._names_from(optimizer))

    def load_optimizer_fragments(self, optimizer: GeminiOptimizer, reader: FragmentReader) -> None:
        load_gemini_fragments(optimizer, self._names_from(optimizer), reader)

    def _names_from(self, optimizer: GeminiOptimizer) -> dict[int, str]:
        return {id(p): n for chunk in optimizer.manager.chunks for n, p in zip(chunk.names, chunk.params)}


def _chunked_parameters(model: nn.Module, device: torch.device) -> list[tuple[str, nn.Parameter]]:
    """The (name, parameter) pairs the chunks hold: all of them, except under LoRA
    (`phalanx.booster.lora`), where only the adapters go into chunks (so only they get fp32
    masters, optimizer state and gradient reduction) and the frozen base stays whole on the
    device, as under DDP."""
    from phalanx.booster.lora import is_lora_model

    named = list(model.named_parameters())
    if not is_lora_model(model):
        return named
    for _, p in named:
        if not p.requires_grad:
            p.data = p.data.to(device)
    return [(n, p) for n, p in named if p.requires_grad]
