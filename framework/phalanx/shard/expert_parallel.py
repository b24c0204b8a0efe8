"""Expert parallelism for the Hugging Face mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE).

`apply_expert_parallel(model, ep_size)` splits the routed experts of every expert block over an
expert-parallel (EP) group of `ep_size` ranks: rank j of a group keeps experts
[j·E/ep, (j+1)·E/ep) of the fused `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I]
(the same parameter names, fewer rows). Only the `experts` module of each block is replaced; the
router (`mlp.gate`), the shared expert and the rest of the HF model run unmodified.

The replacement's forward is dropless: every (token, expert) assignment the router makes is sent
with an all-to-all of uneven splits to the rank owning the expert, computed there, and sent back
by the reverse all-to-all, where the routing weight is applied and the top-k outputs summed (as
transformers does). No capacity factor, no token dropped.

Ranks are laid out dp-major: world = dp · ep, rank = d·ep + j; the EP groups are consecutive ranks
and the data-parallel group of an expert holds the ranks with the same j. Every rank reads its own
slice of the batch. Gradients (`ExpertParallelPlan.all_reduce_gradients`, after backward):

- dense weights (attention, norms, router, shared expert, embeddings) are averaged over all ranks;
- an expert's gradient on its owner already sums the contributions of the ep ranks whose tokens it
  served (the backward all-to-all brings them), so it is summed over the dp replicas holding that
  expert and divided by the world size (not by dp): the mean over all ranks' losses, as the dense
  weights get.

`load_balancing_loss` is transformers' Switch/Mixtral auxiliary loss computed over the global batch
(token counts and row counts summed over the group) in a form whose mean over ranks equals the
one-process value and whose averaged gradient is the one-process gradient;
`ExpertParallelPlan.load_balancing_loss()` computes it from the router logits it recorded in the
last forward (hooks on the routers, so the model runs without output_router_logits);
`router_z_loss` / `ExpertParallelPlan.router_z_loss()` is ST-MoE's z-loss in the same form. See docs/moe.md.

LoRA (a `peft.PeftModel` with `target_parameters` on the fused expert tensors): the experts sit
below peft's `ParamWrapper`s, whose A and B hold every expert's adapter. Each wrapper is cut to this
rank's experts with them (`ExpertAdapterRows`: A's rows, B's columns), so its forward adds the local
experts' deltas to the local weights; the adapters count as expert tensors for the gradient
reduction (over the expert data-parallel replicas) and are gathered to full expert dims for saving.
Adapters on attention stay whole (dense). See docs/lora.md.
"""
from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.distributed as dist
from torch import nn

from phalanx.models.routers import RouterRecorder, group_totals, named_expert_routers, switch_sums, z_sums
from phalanx.shard.loss import _SumOverShards  # (same package)


@dataclasses.dataclass(frozen=True)
class ExpertGroups:
    """This rank's place in a dp × ep layout and the two process groups it needs (None: one rank)."""
    ep_size: int
    dp_size: int
    ep_rank: int
    ep_group: object
    dp_group: object


def expert_groups(ep_size: int) -> ExpertGroups:
    """The EP groups (consecutive ranks) and the expert data-parallel groups (same EP index);
    every rank calls this (each group is created on all ranks)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide the world size {world}: choose ep_size in "
                         f"{[d for d in range(1, world + 1) if world % d == 0]}")
    if world == 1:
        return ExpertGroups(1, 1, 0, None, None)
    rank, dp = dist.get_rank(), world // ep_size
    ep_group = dp_group = None
    for d in range(dp):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(d * ep_size, (d + 1) * ep_size)))
        ep_group = group if rank // ep_size == d else ep_group
    for j in range(ep_size):
        group = dist.new_group(list(range(j, world, ep_size)))
        dp_group = group if rank % ep_size == j else dp_group
    return ExpertGroups(ep_size, dp, rank % ep_size, ep_group, dp_group)


def expert_groups_over(blocks: list[list[int]], ep_size: int) -> ExpertGroups:
    """The EP and expert data-parallel groups carved out of data-parallel groups (`blocks`: the
    global ranks of every data-parallel group, the same list on every rank; HybridParallelPlugin
    passes one per pipeline × tensor coordinate): EP groups are runs of `ep_size` consecutive
    members, an expert's replicas the members with the same index mod `ep_size`. Every rank
    creates every group, in the same order."""
    dp = len(blocks[0])
    if ep_size < 1 or dp % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide the data-parallel size {dp}: choose ep_size in "
                         f"{[d for d in range(1, dp + 1) if dp % d == 0]}")
    rank = dist.get_rank()
    ep_group = dp_group = None
    ep_rank = 0
    for block in blocks:
        for d in range(0, dp, ep_size):
            members = block[d:d + ep_size]
            group = dist.new_group(members)
            if rank in members:
                ep_group, ep_rank = group, members.index(rank)
        for j in range(ep_size):
            members = block[j::ep_size]
            group = dist.new_group(members)
            dp_group = group if rank in members else dp_group
    return ExpertGroups(ep_size, dp // ep_size, ep_rank, ep_group, dp_group)


@dataclasses.dataclass
class ExchangeTimer:
    """Wall seconds and calls of the token all-to-alls (dispatch, combine and their backward), when
    `enabled` (bench/moe_ep.py). Each is timed to its return: on gloo a blocking exchange, so the
    time includes waiting for the slowest peer; on NCCL only the launch (synchronise to time it)."""
    enabled: bool = False
    seconds: float = 0.0
    calls: int = 0


EXCHANGE_TIMER = ExchangeTimer()


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        start = time.perf_counter()
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                               group=group)
        if EXCHANGE_TIMER.enabled:
            EXCHANGE_TIMER.seconds += time.perf_counter() - start
            EXCHANGE_TIMER.calls += 1
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(g, in_splits, out_splits, ctx.group), None, None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return x if group is None else _AllToAll.apply(x, out_splits, in_splits, group)


class ExpertParallelExperts(nn.Module):
    """The experts of one block with only this rank's E/ep of them; a drop-in for the HF
    `experts` module: forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])."""

    def __init__(self, experts: nn.Module, groups: ExpertGroups):
        super().__init__()
        total = experts.gate_up_proj.shape[0]
        if total % groups.ep_size:
            raise ValueError(f"ep_size={groups.ep_size} must divide the number of experts {total}: "
                             f"choose an ep_size that divides {total}")
        self.num_experts, self.groups = total, groups
        self.local = total // groups.ep_size
        first = groups.ep_rank * self.local
        # (requires_grad kept: under LoRA the base experts stay frozen)
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[first:first + self.local].clone(),
                                         requires_grad=experts.gate_up_proj.requires_grad)
        self.down_proj = nn.Parameter(experts.down_proj.detach()[first:first + self.local].clone(),
                                      requires_grad=experts.down_proj.requires_grad)
        self.act_fn = experts.act_fn
        self.routed = None  # this rank's assignments per expert in the last forward, [E]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        ep, group = self.groups.ep_size, self.groups.ep_group
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert (so by owner rank)
        token = order // k
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.routed = counts.detach()
        received = counts.view(ep, self.local)
        if group is not None:  # [source rank, local expert] counts of the assignments coming here
            received = torch.empty_like(received)
            dist.all_to_all_single(received, counts.view(ep, self.local).contiguous(), group=group)
        send, recv = counts.view(ep, self.local).sum(1).tolist(), received.sum(1).tolist()
        x = _exchange(hidden_states[token], recv, send, group)
        y = self._compute(x, received)
        y = _exchange(y, send, recv, group)
        weighted = (y * top_k_weights.reshape(-1)[order, None]).to(hidden_states.dtype)
        # back to [token, k] order and summed over k: a gather keeps only its int64 index for
        # backward (index_add_ kept its whole [tokens·k, hidden] input, to know its shape)
        return weighted[_inverse(order)].view(*hidden_states.shape[:-1], k, hidden_states.shape[-1]).sum(-2)

    def grouped(self) -> bool:
        """Whether the experts run as two grouped matmuls (`torch.nn.functional.grouped_mm`, one call
        each for gate_up and down over all local experts) rather than a loop over experts: where
        torch has it, the weight rows are 16-byte aligned (its CPU and CUDA kernels require it) and,
        on CUDA, the card is sm80 or newer."""
        up = self.gate_up_proj
        size = up.element_size()
        aligned = (up.shape[-1] * size) % 16 == 0 and (self.down_proj.shape[-1] * size) % 16 == 0
        card = up.device.type != "cuda" or torch.cuda.get_device_capability(up.device) >= (8, 0)
        return hasattr(nn.functional, "grouped_mm") and aligned and card

    def _compute(self, x: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        """Rows arrive grouped by source rank, then local expert: regroup by expert, run each
        expert's SwiGLU on its rows, and put the rows back in arrival order."""
        local_ids = torch.arange(self.local, device=x.device).repeat(received.shape[0])
        row_expert = torch.repeat_interleave(local_ids, received.reshape(-1))
        by_expert = torch.argsort(row_expert, stable=True)
        rows, per_expert = x[by_expert], received.sum(0)
        if self.grouped() and rows.shape[0]:  # (grouped_mm's CPU backward refuses zero rows)
            offs = torch.cumsum(per_expert, 0).to(torch.int32)
            gate, up = nn.functional.grouped_mm(rows, self.gate_up_proj.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
            y = nn.functional.grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(-2, -1), offs=offs)
        else:
            outs = []
            for e, chunk in enumerate(rows.split(per_expert.tolist())):
                gate, up = nn.functional.linear(chunk, self.gate_up_proj[e]).chunk(2, dim=-1)
                outs.append(nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e]))
            y = torch.cat(outs)
        return y[_inverse(by_expert)]  # arrival order again (a gather: no [rows, hidden] copy kept for backward)


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes `permutation` (x[permutation][_inverse(permutation)] == x)."""
    inverse = torch.empty_like(permutation)
    return inverse.scatter_(0, permutation, torch.arange(permutation.numel(), device=permutation.device))


def _is_expert_block(module: nn.Module) -> bool:
    params = dict(module.named_parameters(recurse=False))
    up, down = params.get("gate_up_proj"), params.get("down_proj")
    return up is not None and down is not None and up.dim() == 3 and down.dim() == 3


class ExpertParallelPlan:
    """What `apply_expert_parallel` did: the groups, the replaced modules by name, and the
    gradient reduction / full state dict / token counts that go with them."""

    def __init__(self, groups: ExpertGroups, experts: dict[str, ExpertParallelExperts], routers: dict[str, nn.Module],
                 adapters: dict[str, ExpertAdapterRows] | None = None, adapter_params: list[torch.Tensor] = ()):
        self.groups, self.experts, self.routers = groups, experts, routers
        self.adapters = adapters or {}  # LoRA on the experts (peft target_parameters): name -> its rows
        self._expert_params = {id(p) for m in experts.values() for p in m.parameters()}
        self._expert_params |= {id(p) for p in adapter_params}
        # the ranks whose batches make up the global batch (None: the world); HybridParallelPlugin
        # sets its data × sequence-parallel group (tensor-parallel peers see the same tokens)
        self.batch_group = None
        # under Ulysses/ring sequence parallelism, the ranks holding shards of the same rows (a
        # subgroup of batch_group): the router losses' values are summed over them (None: no sp)
        self.sequence_group = None
        self._recorder = RouterRecorder(routers)  # the last forward's router logits, by expert block

    @property
    def router_logits(self) -> dict[str, torch.Tensor]:
        """{expert block: its router's logits in the last forward}."""
        return self._recorder.logits()

    def load_balancing_loss(self, attention_mask=None, group=None) -> torch.Tensor:
        """The global-batch auxiliary loss (`load_balancing_loss`) of the last forward's routers;
        add `model.config.router_aux_loss_coef` times it to the cross-entropy (HF's loss with
        output_router_logits=True, over every rank's batch). No need for output_router_logits."""
        logits = self._recorder.last_logits("load_balancing_loss(): run a forward first (the routers record "
                                            "their logits)")
        return _switch_loss(self.routers, logits, attention_mask, group or self.batch_group, self.sequence_group)

    def router_z_loss(self, attention_mask=None, group=None) -> torch.Tensor:
        """ST-MoE's router z-loss (`router_z_loss`) of the last forward's routers, over every rank's
        batch; add a coefficient (ST-MoE: 1e-3) times it to the loss."""
        logits = self._recorder.last_logits("router_z_loss(): run a forward first (the routers record their logits)")
        return router_z_loss(logits, attention_mask, group or self.batch_group, self.sequence_group)

    def is_expert(self, param: torch.Tensor) -> bool:
        return id(param) in self._expert_params

    def all_reduce_gradients(self, model: nn.Module) -> None:
        """Dense gradients: mean over all ranks; expert gradients: summed over the dp replicas of the
        expert, divided by the world size (module docstring). A missing gradient counts as zero."""
        if self.groups.ep_group is None and self.groups.dp_group is None:
            return
        world = dist.get_world_size()
        params = [p for p in model.parameters() if p.requires_grad]
        for expert, group in ((False, None), (True, self.groups.dp_group)):
            chosen = [p for p in params if self.is_expert(p) == expert]
            if not chosen:
                continue
            for p in chosen:
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad
            flat = torch.cat([p.grad.reshape(-1) for p in chosen])
            if group is not None or not expert:
                dist.all_reduce(flat, group=group)
            flat /= world
            for p, g in zip(chosen, flat.split([p.numel() for p in chosen])):
                p.grad.copy_(g.view_as(p.grad))

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's state dict in Hugging Face layout (every expert), on every rank."""
        state = {k: v.detach() for k, v in model.state_dict().items()}
        if self.groups.ep_group is None:
            return state
        for name, module in self.experts.items():
            for field in ("gate_up_proj", "down_proj"):
                local = getattr(module, field).detach().contiguous()
                parts = [torch.empty_like(local) for _ in range(self.groups.ep_size)]
                dist.all_gather(parts, local, group=self.groups.ep_group)
                state[f"{name}.{field}"] = torch.cat(parts)
        for name in self.adapters:
            state[name] = self.gather_full(name, state[name])
        return state

    # ------------------------------------------------------------------ by parameter name
    # (names relative to the model passed to `apply_expert_parallel`, as in its state dict)
    def expert_param_names(self) -> set[str]:
        """The expert tensors split over the EP group: the fused expert weights and, under LoRA, the
        expert adapters' A and B."""
        fused = {f"{name}.{field}" for name in self.experts for field in ("gate_up_proj", "down_proj")}
        return fused | set(self.adapters)

    def full_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The Hugging Face shape of `name` (every expert's rows) from this rank's shape."""
        if name in self.adapters:
            return self.adapters[name].full_shape(tuple(shape), self.groups.ep_size)
        if name not in self.expert_param_names():
            return tuple(shape)
        return (shape[0] * self.groups.ep_size, *shape[1:])

    def gather_full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """An expert tensor's rows of every EP rank, in expert order (a collective over the EP
        group); any other tensor as it is."""
        if name not in self.expert_param_names() or self.groups.ep_group is None:
            return local
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.groups.ep_size)]
        dist.all_gather(parts, local, group=self.groups.ep_group)
        if name in self.adapters:
            return self.adapters[name].join(parts)
        return torch.cat(parts)

    def local_rows(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a Hugging Face-layout tensor (every expert)."""
        if name in self.adapters:
            return self.adapters[name].local(full, self.groups.ep_rank, self.groups.ep_size)
        if name not in self.expert_param_names():
            return full
        local = full.shape[0] // self.groups.ep_size
        return full[self.groups.ep_rank * local:(self.groups.ep_rank + 1) * local]

    def row_offset(self, name: str) -> int:
        """Where this rank's rows of expert tensor `name` start in the flattened full tensor."""
        if name in self.adapters:
            return self.adapters[name].offset(self.groups.ep_rank, self.groups.ep_size)
        module, _, field = name.rpartition(".")
        return self.groups.ep_rank * getattr(self.experts[module], field).numel()

    def token_counts(self) -> dict[str, torch.Tensor]:
        """{expert block: assignments each expert received in the last forward, summed over all
        ranks ([E], int64)}: the per-expert load to log."""
        counts = {}
        for name, module in self.experts.items():
            if module.routed is None:
                raise RuntimeError("token_counts(): run a forward first")
            total = module.routed.clone()
            if dist.is_initialized() and dist.get_world_size(self.batch_group) > 1:
                dist.all_reduce(total, group=self.batch_group)
            counts[name] = total
        return counts


@dataclasses.dataclass(frozen=True)
class ExpertAdapterRows:
    """Where each expert's part of a LoRA expert adapter lies (peft's `target_parameters` on a fused
    expert tensor, `ParamWrapper`): A [r·E, in] holds expert e's r rows at [e·r, (e+1)·r) (expert
    major, like the experts themselves); B [out, r·E] viewed as [out, r, E] holds expert e's columns
    at [:, :, e] (expert minor). A rank keeps its local experts' rows of A and columns of B, in
    the same layouts with E/ep experts, so peft's forward runs unchanged on the local experts."""
    kind: str   # "A" or "B"
    rank: int   # r, the adapter's rank per expert
    local_shape: tuple[int, ...] = ()  # of this rank's part

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    def local(self, full: torch.Tensor, ep_rank: int, ep_size: int) -> torch.Tensor:
        if self.kind == "A":
            local = full.shape[0] // ep_size
            return full[ep_rank * local:(ep_rank + 1) * local]
        experts = full.shape[1] // self.rank
        local = experts // ep_size
        rows = full.reshape(full.shape[0], self.rank, experts)[:, :, ep_rank * local:(ep_rank + 1) * local]
        return rows.reshape(full.shape[0], self.rank * local)

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every EP rank's local one, in EP-rank order."""
        if self.kind == "A":
            return torch.cat(parts)
        out = parts[0].shape[0]
        joined = torch.cat([p.view(out, self.rank, -1) for p in parts], dim=2)
        return joined.reshape(out, -1)

    def full_shape(self, shape: tuple[int, ...], ep_size: int) -> tuple[int, ...]:
        return (shape[0] * ep_size, shape[1]) if self.kind == "A" else (shape[0], shape[1] * ep_size)

    def offset(self, ep_rank: int, ep_size: int) -> int:
        """Where this rank's part starts in the flattened full tensor. A's part is one range; B's is
        not (its experts are its innermost dimension): its optimizer state is joined over the EP
        group instead (`phalanx.shard.expert_state`)."""
        if self.kind == "B" and ep_size > 1:
            raise ValueError("a LoRA expert adapter's B is not one range of its full tensor: join it over the EP group")
        return ep_rank * self.local_numel


def _is_param_adapter(module: nn.Module) -> bool:
    """peft's LoRA wrapper of a parameter (`ParamWrapper`, from `target_parameters`), by its
    attributes (peft is optional: not imported here)."""
    return all(hasattr(module, a) for a in ("parameter_name", "lora_A", "lora_B", "num_experts", "base_layer"))


def _split_expert_adapters(model: nn.Module, name: str, groups: ExpertGroups, total: int
                           ) -> tuple[dict[str, ExpertAdapterRows], list[nn.Parameter]]:
    """Cut the LoRA adapters that wrap the experts module at `name` (peft nests one `ParamWrapper`
    per adapted parameter, each the `base_layer` of the one above) to this rank's experts: each
    wrapper's A rows and B columns of its local experts (`ExpertAdapterRows`), and its expert count
    set to the local one, so its forward adds the local experts' deltas to the local weights."""
    rows, params = {}, []
    path = name
    local = total // groups.ep_size
    while path.endswith(".base_layer"):
        path = path.removesuffix(".base_layer")
        wrapper = model.get_submodule(path)
        if not _is_param_adapter(wrapper):
            continue
        if wrapper.num_experts != total:
            raise ValueError(f"{path}: a LoRA adapter on {wrapper.parameter_name} with {wrapper.num_experts} experts, "
                             f"the experts module has {total}")
        for adapter in list(wrapper.lora_A.keys()):
            r = wrapper.r[adapter]
            for kind, linear in (("A", wrapper.lora_A[adapter]), ("B", wrapper.lora_B[adapter])):
                if getattr(linear, "bias", None) is not None:
                    raise ValueError(f"{path}: LoRA expert adapters with a bias are not split by expert "
                                     "parallelism: use lora_bias=False")
                w = linear.weight
                piece = ExpertAdapterRows(kind, r).local(w.detach(), groups.ep_rank, groups.ep_size).clone()
                layout = ExpertAdapterRows(kind, r, tuple(piece.shape))
                linear.weight = nn.Parameter(piece, requires_grad=w.requires_grad)
                if kind == "A":
                    linear.out_features = piece.shape[0]
                else:
                    linear.in_features = piece.shape[1]
                rows[f"{path}.lora_{kind}.{adapter}.weight"] = layout
                params.append(linear.weight)
        wrapper.num_experts = local
    return rows, params


def apply_expert_parallel(model: nn.Module, ep_size: int, groups: ExpertGroups | None = None) -> ExpertParallelPlan:
    """Replace every HF fused-experts module of `model` by an `ExpertParallelExperts` holding this
    rank's experts; the rest of the model is untouched. Call on every rank, with the same
    weights (same seed or checkpoint), before building the optimizer. `groups`: the EP layout
    (default: `expert_groups(ep_size)` over the world; HybridParallelPlugin passes its own)."""
    groups = groups or expert_groups(ep_size)
    targets = [(name, m) for name, m in model.named_modules() if _is_expert_block(m)]
    if not targets:
        raise ValueError(f"{type(model).__name__} has no fused expert module (experts.gate_up_proj [E, 2I, H]): "
                         "expert parallelism needs a mixture-of-experts model (Mixtral, Qwen2-MoE, Qwen3-MoE)")
    replaced, routers, adapters, adapter_params = {}, {}, {}, []
    for name, module in targets:
        if any(n.endswith("_bias") for n, _ in module.named_parameters()):
            raise ValueError(f"{name}: experts with biases are not supported by expert parallelism yet")
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        replaced[name] = ExpertParallelExperts(module, groups)
        setattr(parent, child, replaced[name])
        # under LoRA the experts sit below peft's wrappers (`experts.base_layer...`): the MoE block
        # (and its router) is above them
        rows, params = _split_expert_adapters(model, name, groups, replaced[name].num_experts)
        adapters.update(rows)
        adapter_params += params
        block = name
        while block.endswith(".base_layer"):
            block = block.removesuffix(".base_layer")
        router = getattr(model.get_submodule(block.rpartition(".")[0]), "gate", None)
        if router is not None and hasattr(router, "top_k") and hasattr(router, "num_experts"):
            routers[name] = router
    return ExpertParallelPlan(groups, replaced, routers if len(routers) == len(replaced) else {}, adapters,
                              adapter_params)


class RouterLogits:
    """Hooks on every router (`mlp.gate` of an expert block: transformers' own module, with top_k and
    num_experts) of a model without expert parallelism: the logits each produced in the last forward,
    and from them the router losses over the global batch (`load_balancing_loss`, `router_z_loss`:
    `batch_group` the ranks whose batches make it up, `sequence_group` those holding sequence shards of
    the same rows under Ulysses/ring), as `ExpertParallelPlan` computes them with EP.
    HybridParallelPlugin uses it without EP: transformers' own aux loss would be the rank's (or, under
    sequence parallelism, the shard's) and differs, the loss not being linear in the batch."""

    def __init__(self, routers: dict[str, nn.Module], batch_group=None, sequence_group=None):
        if not routers:
            raise ValueError("RouterLogits: no expert block with a router (mlp.gate with top_k and num_experts)")
        self.routers, self.batch_group, self.sequence_group = routers, batch_group, sequence_group
        self._recorder = RouterRecorder(routers)

    @classmethod
    def attach(cls, model: nn.Module, batch_group=None, sequence_group=None) -> "RouterLogits":
        return cls(named_expert_routers(model), batch_group, sequence_group)

    @property
    def logits(self) -> dict[str, torch.Tensor]:
        """{router: its logits in the last forward}."""
        return self._recorder.logits()

    def _recorded(self) -> list[torch.Tensor]:
        return self._recorder.last_logits("RouterLogits: run a forward through every router first")

    def load_balancing_loss(self, attention_mask=None) -> torch.Tensor:
        return _switch_loss(self.routers, self._recorded(), attention_mask, self.batch_group, self.sequence_group)

    def router_z_loss(self, attention_mask=None) -> torch.Tensor:
        return router_z_loss(self._recorded(), attention_mask, self.batch_group, self.sequence_group)


def _switch_loss(routers: dict[str, nn.Module], logits: list[torch.Tensor], attention_mask, group,
                 sequence_group) -> torch.Tensor:
    """`load_balancing_loss` of `routers`' recorded logits (their expert count and top-k)."""
    router = next(iter(routers.values()))
    return load_balancing_loss(logits, router.num_experts, router.top_k, attention_mask, group, sequence_group)


def load_balancing_loss(router_logits, num_experts: int, top_k: int, attention_mask=None,
                        group=None, sequence_group=None) -> torch.Tensor:
    """transformers' auxiliary load-balancing loss (`load_balancing_loss_func`) over the batch of
    every rank in `group` (None: the world; one process: exactly HF's value). Returned per rank as
    world · E · Σ_e f_e · P_e,local, with f_e (the global share of assignments, no gradient) and
    P_e (routing probability summed over rows) divided by the global row count: its mean over
    ranks is the global loss and its averaged gradient the global gradient. `sequence_group`: the
    ranks of `group` that hold sequence shards of the same rows (`over_sequence_shards`). The sums
    are `phalanx.models.routers.switch_sums`."""
    prob_sum, counts, rows = switch_sums(router_logits, num_experts, top_k, attention_mask)
    totals, size = group_totals(torch.cat([counts, rows]), group)
    counts, rows = totals[:-1], totals[-1:]
    return over_sequence_shards(size * num_experts * torch.sum((counts / rows) * (prob_sum / rows)), sequence_group)


def router_z_loss(router_logits, attention_mask=None, group=None, sequence_group=None) -> torch.Tensor:
    """The router z-loss of ST-MoE (Zoph et al. 2022): the mean over every (layer, token) row of
    logsumexp(logits)², padding rows left out, over the batch of every rank in `group` (None: the
    world). Returned per rank as world · Σ_local / N_global: the mean over ranks is the global value
    (`sequence_group`: see `over_sequence_shards`). The sums are `phalanx.models.routers.z_sums`."""
    squares, rows = z_sums(router_logits, attention_mask)
    rows, size = group_totals(rows, group)
    return over_sequence_shards(size * squares[0] / rows[0], sequence_group)


def over_sequence_shards(loss: torch.Tensor, sequence_group=None) -> torch.Tensor:
    """A router loss in the per-rank form over dp × sp ranks (the mean over them is the global
    value) whose value is made that of the rank's rows: under Ulysses/ring sequence parallelism the
    s ranks of `sequence_group` route shards of the same rows, and each returns the sum of their
    losses / s (the same value on each: the per-rank form over dp alone, as the cross-entropy
    `phalanx.shard.loss.CausalLMLoss` is summed over the shards) while its gradient stays its own
    shard's, so averaging gradients over dp × sp gives the global gradient. None or one rank: `loss`."""
    if sequence_group is None or dist.get_world_size(sequence_group) == 1:
        return loss
    size = dist.get_world_size(sequence_group)
    return _SumOverShards.apply(loss / size, sequence_group, float(size))
