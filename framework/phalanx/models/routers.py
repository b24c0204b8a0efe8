"""What the router losses of the mixture-of-experts families share, written once: the hooks that
record what every router (`mlp.gate`, transformers' own module) produced, and the per-row sums the
losses are made of.

- `RouterRecorder`: forward hooks on routers, by name (or any key: the pipeline's carry keys them
  by stage and layer); each forward's `RouterCall` (logits, top-k choices, the rows' shape) is kept
  by key, or handed to a callback instead.
- `switch_sums` / `z_sums`: the sums over every (layer, token) row of transformers' Switch
  load-balancing loss (Σ softmax probabilities with gradient, top-k assignment counts, row count)
  and of ST-MoE's z-loss (Σ logsumexp²), padding rows left out; `group_totals` sums the counts over
  the ranks whose batches make up the global batch.

Users: `phalanx.shard.expert_parallel` (`load_balancing_loss`, `router_z_loss`, `ExpertParallelPlan`,
`RouterLogits`), `phalanx.pipeline.router_losses` (`RouterLossCarry`) and `phalanx.models.deepseek`
(`BiasBalancer`, `BalanceLoss`). See docs/moe.md.
"""
from __future__ import annotations

from typing import Callable, Hashable, NamedTuple

import torch
import torch.distributed as dist
from torch import nn


def named_expert_routers(module: nn.Module) -> dict[str, nn.Module]:
    """{name: router} of the expert blocks under `module` (each block's `gate`: transformers' own
    router module, with top_k and num_experts), in module order."""
    return {f"{name}.gate" if name else "gate": m.gate for name, m in module.named_modules()
            if hasattr(m, "experts") and hasattr(getattr(m, "gate", None), "top_k")
            and hasattr(m.gate, "num_experts")}


class RouterCall(NamedTuple):
    """What one router produced in one forward."""
    logits: torch.Tensor  # [rows, experts]
    chosen: torch.Tensor | None  # [rows, k]: its top-k experts (transformers' third output), when it returns them
    rows: tuple[int, ...]  # the shape of the rows it routed: (batch, sequence), or (tokens,)


def router_call(args: tuple, output) -> RouterCall:
    """The `RouterCall` of a router's forward hook (its positional inputs and its output)."""
    logits = output[0] if isinstance(output, tuple) else output
    chosen = output[2] if isinstance(output, tuple) and len(output) > 2 else None
    rows = tuple(args[0].shape[:-1]) if args else (logits.shape[0],)
    return RouterCall(logits, chosen, rows)


class RouterRecorder:
    """Forward hooks on `routers` ({key: router}): `calls[key]` is the `RouterCall` of the key's last
    forward; with `on_call`, each call goes to `on_call(key, call)` instead of being kept. `add`
    hooks one more router."""

    def __init__(self, routers: dict[Hashable, nn.Module] | None = None,
                 on_call: Callable[[Hashable, RouterCall], None] | None = None):
        self.routers: dict[Hashable, nn.Module] = {}
        self.calls: dict[Hashable, RouterCall] = {}
        self.on_call = on_call
        for key, router in (routers or {}).items():
            self.add(key, router)

    def add(self, key: Hashable, router: nn.Module) -> None:
        self.routers[key] = router

        def hook(module, args, output):
            call = router_call(args, output)
            if self.on_call is None:
                self.calls[key] = call
            else:
                self.on_call(key, call)
        router.register_forward_hook(hook)

    def logits(self) -> dict[Hashable, torch.Tensor]:
        """{key: the logits of its last forward}, for the routers that ran."""
        return {key: call.logits for key, call in self.calls.items()}

    def last_logits(self, message: str) -> list[torch.Tensor]:
        """Every router's logits of its last forward, in router order; RuntimeError(`message`) when
        there is no router or one has not run."""
        if not self.routers or len(self.calls) != len(self.routers):
            raise RuntimeError(message)
        return [self.calls[key].logits for key in self.routers]


def _layers(router_logits) -> list[torch.Tensor]:
    return list(router_logits) if isinstance(router_logits, (tuple, list)) else [router_logits]


def row_mask(attention_mask: torch.Tensor | None, layers: int, device) -> torch.Tensor | None:
    """The weight (0/1, float32) of every (layer, token) row of `layers` layers' logits concatenated,
    from the [batch, sequence] padding mask; None: every row counts."""
    if attention_mask is None:
        return None
    return attention_mask.reshape(-1).to(device, torch.float32).repeat(layers)


def switch_sums(router_logits, num_experts: int, top_k: int, attention_mask=None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The local sums of the Switch load-balancing loss (transformers' `load_balancing_loss_func`)
    over every (layer, token) row of `router_logits` (a tensor [rows, E] or a list of one per
    layer), padding rows left out: (Σ softmax probabilities [E] in float32, with gradient; the
    top-k assignments per expert [E]; the row count [1]), the last two float32 without gradient."""
    layers = _layers(router_logits)
    logits = torch.cat([layer.float() for layer in layers])
    probs = torch.softmax(logits, dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices
    mask = row_mask(attention_mask, len(layers), logits.device)
    weights = torch.ones(chosen.numel(), device=logits.device) if mask is None else mask.repeat_interleave(top_k)
    counts = torch.zeros(num_experts, device=logits.device).scatter_add_(0, chosen.reshape(-1), weights)
    if mask is None:
        return probs.sum(0), counts, torch.tensor([float(logits.shape[0])], device=logits.device)
    return (probs * mask[:, None]).sum(0), counts, mask.sum().reshape(1)


def z_sums(router_logits, attention_mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The local sums of ST-MoE's router z-loss over every (layer, token) row, padding rows left
    out: (Σ logsumexp(logits)² [1] in float32, with gradient; the row count [1], float32)."""
    layers = _layers(router_logits)
    logits = torch.cat([layer.float() for layer in layers])
    squares = torch.logsumexp(logits, dim=-1) ** 2
    mask = row_mask(attention_mask, len(layers), logits.device)
    if mask is None:
        return squares.sum().reshape(1), torch.tensor([float(logits.shape[0])], device=logits.device)
    return (squares * mask).sum().reshape(1), mask.sum().reshape(1)


def group_totals(totals: torch.Tensor, group=None) -> tuple[torch.Tensor, int]:
    """(`totals` summed over the ranks of `group` (None: the world), the group's size) when
    distributed over more than one rank; else (`totals`, 1). In place: pass a tensor of your own."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return totals, 1
    dist.all_reduce(totals, group=group)
    return totals, dist.get_world_size(group)
