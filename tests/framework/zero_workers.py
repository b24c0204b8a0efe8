"""What test_zero.py runs: the single-process reference loop and the per-rank suites.

The rank functions are module-level so `phalanx.testing.spawn` can start them in fresh
processes. Each suite runs many configurations in one spawn (a spawn costs seconds, a
configuration a fraction of one) and returns plain numbers and CPU tensors; the assertions live
in test_zero.py.

Every Llama run trains `phalanx.testing.tiny_llama(seed=0)` for STEPS steps on the same global
batches, over two param groups (matrices with weight decay; norm weights without, at half the
learning rate) with a LinearLR schedule built on the original optimizer, so per-group
hyper-parameters and the scheduler are exercised too.
"""
from __future__ import annotations

import contextlib

import torch

from phalanx.device import run_device, to_device
import torch.distributed as dist
from torch import nn

from phalanx.testing import MasterWeights, tiny_llama

STEPS = 5
GLOBAL_BATCH = 8
SEQ = 16
VOCAB = 128
BUCKET_MB = 0.02  # ~5k fp32 elements: the tiny model (~27k parameters) spreads over 7 buckets
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP16_SCALE = 2.0**16  # DynamicLossScaler's initial scale; it does not change within these runs


def make_batches(steps: int = STEPS, seed: int = 1234) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g) for _ in range(steps)]


def make_optimizer(named: list[tuple[str, torch.Tensor]], kind: str = "adamw", lr_scale: float = 1.0):
    decay = [p for _, p in named if p.dim() >= 2]
    no_decay = [p for _, p in named if p.dim() < 2]
    if kind == "adamw":
        groups = [{"params": decay, "weight_decay": 0.1},
                  {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3 * lr_scale}]
        optimizer = torch.optim.AdamW(groups, lr=1e-2 * lr_scale)
    elif kind == "sgd":
        groups = [{"params": decay}, {"params": no_decay, "lr": 0.25}]
        optimizer = torch.optim.SGD(groups, lr=0.5, momentum=0.9)
    elif kind == "adagrad":  # creates its state eagerly, before the first step
        groups = [{"params": decay}, {"params": no_decay, "lr": 5e-3}]
        optimizer = torch.optim.Adagrad(groups, lr=1e-2)
    else:
        raise ValueError(kind)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=4)
    return optimizer, scheduler


def initial_params(precision: str = "fp32") -> dict[str, torch.Tensor]:
    """The starting weights as the fp32 masters see them (rounded through the model dtype)."""
    return {n: p.detach().to(DTYPES[precision]).float() for n, p in tiny_llama(seed=0).named_parameters()}


# ---------------------------------------------------------------------------- reference
def reference(precision: str = "fp32", max_norm: float | None = None, kind: str = "adamw",
              steps: int = STEPS) -> dict:
    """Plain torch on one process over the global batch: a model in `precision`, fp32 master
    copies that the optimizer updates, torch.nn.utils.clip_grad_norm_, a constant loss scale
    for fp16."""
    mp = MasterWeights(tiny_llama(seed=0), DTYPES[precision])
    optimizer, scheduler = make_optimizer(list(mp.masters.items()), kind)
    scale = FP16_SCALE if precision == "fp16" else 1.0
    losses, norms = [], []
    for batch in make_batches(steps):
        loss = mp.model(input_ids=batch, labels=batch).loss
        (loss * scale).backward()
        norms.append(mp.step(optimizer, scale, max_norm))
        scheduler.step()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": mp.state()}


# ---------------------------------------------------------------------------- one boosted run
def _local_rows(batch: torch.Tensor) -> torch.Tensor:
    return batch.chunk(dist.get_world_size())[dist.get_rank()]


def _global_mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=run_device())
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


# Deliberately broken variants of a correct run, which the fp32 comparison must reject:
BUGS = {  # name: (this rank's weight on its loss in backward, learning-rate factor)
    "rank1_gradient_dropped": (lambda rank, world: float(rank != 1), 1.0),  # half the batch ignored
    "gradients_summed": (lambda rank, world: float(world), 1.0),  # summed over ranks, not averaged
    "lr_3pct_high": (lambda rank, world: 1.0, 1.03),  # the update 3% too large
}


class Run:
    """A boosted tiny Llama with its optimizer and scheduler, trained step by step (`bug`: one of
    BUGS, for the tests that show a broken run is caught)."""

    def __init__(self, plugin, kind: str = "adamw", bug: str | None = None):
        from phalanx.booster import Booster

        weight, lr_scale = BUGS[bug] if bug else (lambda rank, world: 1.0, 1.0)
        self.loss_weight = weight(dist.get_rank(), dist.get_world_size())
        self.booster = Booster(plugin)
        model = tiny_llama(seed=0)
        optimizer, scheduler = make_optimizer(list(model.named_parameters()), kind, lr_scale)
        self.model, self.optimizer, _, _, self.scheduler = self.booster.boost(model, optimizer,
                                                                              lr_scheduler=scheduler)
        self.batches = [to_device(b, run_device()) for b in make_batches(STEPS)]
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.skipped: list[bool] = []

    def backward(self, step: int, accum: int = 1, no_sync: bool = True) -> float:
        total = 0.0
        for i, micro in enumerate(_local_rows(self.batches[step]).chunk(accum)):
            last = i == accum - 1
            ctx = self.booster.no_sync(self.model, self.optimizer) if no_sync and not last else contextlib.nullcontext()
            with ctx:
                loss = self.model(input_ids=micro, labels=micro).loss / accum
                self.booster.backward(loss * self.loss_weight, self.optimizer)
            total += loss.item()
        return total

    def step(self, step: int, accum: int = 1, no_sync: bool = True) -> None:
        local = self.backward(step, accum, no_sync)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        self.losses.append(_global_mean(local))
        self.norms.append(self.optimizer.last_grad_norm)
        self.skipped.append(self.optimizer.skipped)

    def train(self, steps: range | int = STEPS, **kwargs) -> "Run":
        for s in (range(steps) if isinstance(steps, int) else steps):
            self.step(s, **kwargs)
        return self

    def params(self) -> dict[str, torch.Tensor] | None:
        """Full fp32 weights through the plugin's checkpoint hook (rank 0; None elsewhere)."""
        state = self.booster.plugin.full_model_state_dict(self.model)
        names = {n for n, _ in self.model.unwrapped.named_parameters()}
        return {k: v.float() for k, v in state.items() if k in names} if dist.get_rank() == 0 else None

    def result(self) -> dict:
        return {"losses": self.losses, "norms": self.norms, "skipped": self.skipped, "params": self.params()}


def zero(stage: int, precision: str = "fp32", **kwargs):
    from phalanx.booster.plugins.zero import ZeroPlugin

    kwargs.setdefault("reduce_bucket_mb", BUCKET_MB)
    return ZeroPlugin(stage=stage, precision=precision, **kwargs)


# name: (stage, precision, plugin options, optimizer kind, train options)
CONFIGS = {
    "s1_fp32": (1, "fp32", {}, "adamw", {}),
    "s2_fp32": (2, "fp32", {}, "adamw", {}),
    "s2_fp32_no_overlap": (2, "fp32", {"overlap_communication": False}, "adamw", {}),
    "s2_fp32_one_bucket": (2, "fp32", {"reduce_bucket_mb": 25.0}, "adamw", {}),
    "s2_fp32_prefetch": (2, "fp32", {"overlap_param_gather": True}, "adamw", {}),
    # gloo's default is all_to_all: force the reduce-scatter path (NCCL's default) and the
    # all-reduce one too
    "s1_fp32_all_reduce": (1, "fp32", {"grad_collective": "all_reduce"}, "adamw", {}),
    "s2_fp32_all_reduce": (2, "fp32", {"grad_collective": "all_reduce"}, "adamw", {}),
    "s1_fp32_reduce_scatter": (1, "fp32", {"grad_collective": "reduce_scatter"}, "adamw", {}),
    "s2_fp32_reduce_scatter": (2, "fp32", {"grad_collective": "reduce_scatter"}, "adamw", {}),
    "s2_bf16_reduce_scatter": (2, "bf16", {"grad_collective": "reduce_scatter"}, "adamw", {}),
    "s2_accum_every_microstep_reduce_scatter": (2, "fp32", {"grad_collective": "reduce_scatter"}, "adamw",
                                                {"accum": 2, "no_sync": False}),
    "s1_bf16_prefetch": (1, "bf16", {"overlap_param_gather": True}, "adamw", {}),
    "s1_bf16": (1, "bf16", {}, "adamw", {}),
    "s2_bf16": (2, "bf16", {}, "adamw", {}),
    "s1_fp16": (1, "fp16", {}, "adamw", {}),
    "s2_fp16": (2, "fp16", {}, "adamw", {}),
    "s1_clip": (1, "fp32", {"max_norm": 0.5}, "adamw", {}),
    "s2_clip": (2, "fp32", {"max_norm": 0.5}, "adamw", {}),
    "s1_clip_sgd": (1, "fp32", {"max_norm": 0.5}, "sgd", {}),
    "s2_clip_sgd": (2, "fp32", {"max_norm": 0.5}, "sgd", {}),
    "s2_adagrad": (2, "fp32", {}, "adagrad", {}),
    "s1_accum": (1, "fp32", {}, "adamw", {"accum": 2}),
    "s2_accum": (2, "fp32", {}, "adamw", {"accum": 2}),
    "s1_accum_every_microstep": (1, "fp32", {}, "adamw", {"accum": 2, "no_sync": False}),
    "s2_accum_every_microstep": (2, "fp32", {}, "adamw", {"accum": 2, "no_sync": False}),
}


def run_config(name: str) -> dict:
    """A configuration of CONFIGS, or "bug:<name>": s2_fp32 with one of BUGS."""
    bug = name.removeprefix("bug:") if name.startswith("bug:") else None
    stage, precision, options, kind, train = CONFIGS["s2_fp32" if bug else name]
    return Run(zero(stage, precision, **options), kind, bug).train(**train).result()


# ---------------------------------------------------------------------------- focused checks
def memory_and_overlap() -> dict:
    """Optimizer-state and gradient sizes per rank at stage 1 and 2, and where reductions ran."""
    model = tiny_llama(seed=0)
    full_opt, _ = make_optimizer(list(model.named_parameters()))
    batch = make_batches(1)[0]
    model(input_ids=batch, labels=batch).loss.backward()
    full_opt.step()
    out = {"full_state_bytes": _state_bytes(full_opt.state), "numel": sum(p.numel() for p in model.parameters())}
    for stage in (1, 2):
        run = Run(zero(stage))
        run.backward(0)
        opt = run.optimizer
        info = {"grads_left_on_params": sum(p.grad is not None for p in run.model.unwrapped.parameters())}
        opt.reducer.finish()
        info["grad_shard_numel"] = sum(m.grad.numel() for m in opt.master_params())
        info["persistent_grad_numel"] = sum(t.numel() for t in opt.reducer._persistent.values())
        info["buckets"] = len(opt.reducer.buckets)
        info["shard_per_group"] = [[tuple(p.shape) for p in g["params"]] for g in opt.optim.param_groups]
        opt.step()
        opt.zero_grad()
        run.train(range(1, 3))
        info["state_bytes"] = _state_bytes(opt.state)
        info["padding"] = sum(g.layout.padded_numel - g.layout.numel for g in opt.flat_groups if g)
        info["groups"] = sum(g is not None for g in opt.flat_groups)
        info["state_keys"] = sorted({k for s in opt.state.values() for k, v in s.items() if v.dim() > 0})
        info["launched_in_backward"] = opt.reducer.stats.launched_in_backward
        info["launched_at_flush"] = opt.reducer.stats.launched_at_flush
        out[f"s{stage}"] = info
    return out


def _state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for s in state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def overflow() -> dict:
    """fp16: a loss scale that overflows on every rank, then an inf in rank 0's shard only."""
    out = {}
    run = Run(zero(2, "fp16"))
    opt = run.optimizer
    before = {k: v.clone() for k, v in run.model.unwrapped.state_dict().items()}
    opt.scaler.scale = 2.0**40
    run.step(0)
    after = run.model.unwrapped.state_dict()
    out["everywhere"] = {"skipped": run.skipped[-1], "scale": opt.scaler.scale, "no_state": len(opt.state) == 0,
                         "params_unchanged": all(torch.equal(before[k], after[k]) for k in before)}
    opt.scaler.scale = FP16_SCALE
    run.step(1)
    out["next_step_ok"] = not run.skipped[-1]
    steps_before = [float(s["step"]) for s in opt.state.values()]
    masters_before = [m.detach().clone() for m in opt.master_params()]
    run.backward(2)
    opt.reducer.finish()
    if dist.get_rank() == 0:
        opt.master_params()[0].grad[0] = float("inf")  # only rank 0's shard overflows
    opt.step()
    out["one_rank"] = {"skipped": opt.skipped, "scale": opt.scaler.scale,
                       "steps_unchanged": [float(s["step"]) for s in opt.state.values()] == steps_before,
                       "masters_unchanged": all(torch.equal(a, b) for a, b in
                                                zip(masters_before, opt.master_params(), strict=True))}
    return out


class _Toy(nn.Module):
    """25 parameters elements (odd: the flat buffer needs padding on 2 and 4 ranks), 6 of them in
    a layer that never gets a gradient (its buckets are launched by the end-of-backward flush)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 1)
        self.unused = nn.Linear(2, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def toy_padded() -> dict:
    """ZeRO-2 with one-parameter buckets on a padded layout vs plain torch on one process."""
    from phalanx.booster import Booster

    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    torch.manual_seed(0)
    ref = _Toy()
    start = {k: v.clone() for k, v in ref.state_dict().items()}
    torch.manual_seed(0)
    model = _Toy()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    booster = Booster(zero(2, reduce_bucket_mb=8 / 2**20))  # 2 fp32 elements: one parameter per bucket
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0))
    for _ in range(STEPS):
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        rows = slice(dist.get_rank() * 8 // dist.get_world_size(), (dist.get_rank() + 1) * 8 // dist.get_world_size())
        xs, ys = to_device((x[rows], y[rows]), run_device())
        booster.backward(nn.functional.mse_loss(model(xs), ys), opt)
        opt.step()
        opt.zero_grad()
    return {"params": booster.plugin.full_model_state_dict(model), "ref": ref.state_dict(), "start": start,
            "padding": opt.flat_groups[0].layout.padded_numel - opt.flat_groups[0].layout.numel,
            "launched_at_flush": opt.reducer.stats.launched_at_flush}


@contextlib.contextmanager
def _counting_fused_adamw(calls: list[int]):
    """Count calls of torch's fused AdamW kernel (torch.optim looks it up on `torch` at each step)."""
    original = torch._fused_adamw_

    def counted(*args, **kwargs):
        calls.append(len(args[0]))  # tensors updated by this call
        return original(*args, **kwargs)
    torch._fused_adamw_ = counted
    try:
        yield
    finally:
        torch._fused_adamw_ = original


def fused_kernels_and_phases() -> dict:
    """Which kernel the optimizer step ran (fused AdamW over the shards unless the user chose),
    whether the user's param-group settings survive a step and reach the checkpoint unchanged,
    and the step's phase timings; FSDPPlugin's step likewise (its own DTensor parameters)."""
    from phalanx.booster.plugins.fsdp import FSDPPlugin
    from phalanx.zero.checkpoint import zero_fragments

    out = {}
    for label, options in (("default", {}), ("user_fused_false", {"fused": False}),
                           ("user_foreach_true", {"foreach": True})):
        model = tiny_llama(seed=0)
        from phalanx.booster import Booster
        booster = Booster(zero(2))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **options)
        model, optimizer, *_ = booster.boost(model, optimizer)
        batch = to_device(_local_rows(make_batches(1)[0]), run_device())
        calls: list[int] = []
        with _counting_fused_adamw(calls):
            for _ in range(2):
                booster.backward(model(input_ids=batch, labels=batch).loss, optimizer)
                optimizer.step()
                optimizer.zero_grad()
        saved = zero_fragments(optimizer).param_groups[0]
        out[label] = {"fused_calls": calls, "shard_numel": optimizer.master_params()[0].numel(),
                      "group_after": {k: optimizer.param_groups[0][k] for k in ("fused", "foreach")},
                      "saved": {k: saved[k] for k in ("fused", "foreach")},
                      "phases": dict(optimizer.step_phases)}
    fsdp_model = tiny_llama(seed=0)
    from phalanx.booster import Booster
    booster = Booster(FSDPPlugin())
    fsdp_model, fsdp_opt, *_ = booster.boost(fsdp_model, torch.optim.AdamW(fsdp_model.parameters(), lr=1e-2))
    batch = to_device(_local_rows(make_batches(1)[0]), run_device())
    calls = []
    with _counting_fused_adamw(calls):
        booster.backward(fsdp_model(input_ids=batch, labels=batch).loss, fsdp_opt)
        fsdp_opt.step()
    out["fsdp"] = {"fused_calls": calls, "params": len(fsdp_opt.params()),
                   "group_after": fsdp_opt.param_groups[0]["fused"]}
    return out


def prefetch_consistency() -> dict:
    """overlap_param_gather: `step` returns with the publication in flight (chunks pending), and
    `wait_for_params` makes every parameter equal its (gathered) fp32 master exactly."""
    run = Run(zero(2, overlap_param_gather=True))
    run.train(2)
    opt = run.optimizer
    pending_after_step = len(opt.prefetch._pending)
    opt.wait_for_params()
    masters = opt.full_master_weights()
    params = list(run.model.unwrapped.parameters())
    return {"pending_after_step": pending_after_step, "chunks": len(opt.prefetch.chunks),
            "params_equal_masters": all(torch.equal(p.detach().cpu(), masters[id(p)].cpu()) for p in params),
            "hooked_modules": len(opt.prefetch._handles)}


# ---------------------------------------------------------------------------- checkpoints
SAVE_AT = 3


def train_and_save(directory: str) -> dict:
    """ZeRO-2: train SAVE_AT steps, save a checkpoint, continue to STEPS (the uninterrupted run)."""
    run = Run(zero(2)).train(SAVE_AT)
    run.booster.save_checkpoint(directory, run.model, run.optimizer, run.scheduler)
    at_save = run.params()
    run.train(range(SAVE_AT, STEPS))
    return {**run.result(), "params_at_save": at_save}


def _resume(plugin, directory: str) -> Run:
    run = Run(plugin)
    run.booster.load_checkpoint(directory, run.model, run.optimizer, run.scheduler)
    return run


# ---------------------------------------------------------------------------- suites (one spawn each)
def two_rank_suite(configs: list[str], zero_dir: str) -> dict:
    out = {name: run_config(name) for name in configs}
    out["memory"] = memory_and_overlap()
    out["overflow"] = overflow()
    out["toy"] = toy_padded()
    out["kernels"] = fused_kernels_and_phases()
    out["prefetch"] = prefetch_consistency()
    out["saved"] = train_and_save(zero_dir)
    return out


def one_rank_suite(zero_dir: str, ddp_dir: str) -> dict:
    """The 2-rank ZeRO checkpoint into DDP (re-saved as a DDP checkpoint) and into ZeRO-1/2."""
    from phalanx.booster.plugins.ddp import DDPPlugin

    ddp = _resume(DDPPlugin(), zero_dir)
    ddp.booster.save_checkpoint(ddp_dir, ddp.model, ddp.optimizer, ddp.scheduler)
    out = {"ddp": ddp.train(range(SAVE_AT, STEPS)).result()}
    for stage in (1, 2):
        out[f"zero{stage}"] = _resume(zero(stage), zero_dir).train(range(SAVE_AT, STEPS)).result()
    return out


def four_rank_suite(configs: list[str], zero_dir: str, ddp_dir: str) -> dict:
    """Equivalence configurations, then resuming from the 2-rank ZeRO checkpoint and from the
    1-rank DDP checkpoint."""
    out = {name: run_config(name) for name in configs}
    out["toy"] = toy_padded()
    out["resume_zero2"] = _resume(zero(2), zero_dir).train(range(SAVE_AT, STEPS)).result()
    out["resume_from_ddp"] = _resume(zero(1), ddp_dir).train(range(SAVE_AT, STEPS)).result()
    return out


# ---------------------------------------------------------------------------- the gloo exchange
EXCHANGE_SIZES = {2: [[10, 0], [0, 10], [3, 7], [6, 6]], 4: [[4, 0, 0, 6], [0, 5, 5, 0], [2, 3, 4, 5], [0, 0, 8, 0]]}


def own_part_exchange_suite() -> dict:
    """Per split (rank r's part of a tensor that every rank holds a different copy of): whether the
    copies `OwnPartExchange` leaves on this rank sum to the reduce-scatter's result, and whether
    this rank's own part stayed out of the exchange (it must exactly when it lies at an end)."""
    from phalanx.zero.comm import OwnPartExchange

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for sizes in EXCHANGE_SIZES[world]:
        base = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(1))
        mine = base * (rank + 1)
        lo = sum(sizes[:rank])
        exchange = OwnPartExchange(mine, sizes, rank, None, "test.exchange")
        exchange.wait()
        copies = exchange.copies()
        want = base[lo:lo + sizes[rank]] * sum(range(1, world + 1))
        got = torch.stack(copies).sum(0)
        out[str(sizes)] = {"equal": torch.allclose(got, want, rtol=1e-6, atol=1e-6),
                           "copies": len(copies) if sizes[rank] else 0,
                           "kept_out": exchange.own is not None,
                           "at_an_end": sizes[rank] > 0 and (lo == 0 or lo + sizes[rank] == sum(sizes)),
                           "received": exchange.received.numel()}
    return out
