"""What tests/framework/test_expert_parallel.py runs on each rank: one SGD step of a tiny random
Mixtral / Qwen2-MoE / Qwen3-MoE with its experts split by phalanx.shard.expert_parallel (every rank
reads its own rows of the batch), against the same step on the whole batch in one process;
returns the differences and the per-expert token counts of both."""
from __future__ import annotations

import torch
import torch.distributed as dist

import moe_models
from phalanx.device import run_device, to_device
from phalanx.testing import rel_diff, update_diff

SMALL = dict(vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
             router_aux_loss_coef=0.5)  # a large coefficient: the aux loss's gradient must be right too
Z_LOSS = 0.1  # the router z-loss's coefficient in the step (large for the same reason)


def build(family: str, width: int = 16):
    from transformers import AutoModelForCausalLM
    width = {"intermediate_size": width} if family == "mixtral" else {"moe_intermediate_size": width}
    torch.manual_seed(0)
    config = moe_models.moe_config(family, **SMALL, **width)
    # eager: HF's per-expert loop on every device (on CUDA it would pick grouped_mm, whose histc the
    # emulated GPU cannot run on integers)
    return AutoModelForCausalLM.from_config(config, experts_implementation="eager").float()


def _reference(family: str, batch: torch.Tensor) -> dict:
    """One process, the whole batch: loss (cross-entropy + coef · HF's own aux loss), the router
    z-loss by hand, weights before and after one SGD step on loss + Z_LOSS · z-loss, and the
    assignments per expert of each block. On the CPU: HF's load_balancing_loss_func counts with an
    integer histc on CUDA, which the emulated GPU cannot run."""
    model = build(family)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = model(input_ids=batch, labels=batch, output_router_logits=True)
    z_loss = (torch.cat(out.router_logits).logsumexp(-1) ** 2).mean()  # ST-MoE's z-loss, by hand
    (out.loss + Z_LOSS * z_loss).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    k, experts = model.config.num_experts_per_tok, out.router_logits[0].shape[-1]
    counts = [torch.bincount(torch.topk(logits, k).indices.reshape(-1), minlength=experts).cpu()
              for logits in out.router_logits]
    return {"loss": out.loss.item(), "z_loss": z_loss.item(), "start": start,
            "state": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "counts": counts}


def ep_step(layouts: list[tuple[str, int]]) -> dict:
    """{(family, ep_size): differences}; the batch has two rows per rank."""
    return {(family, ep): _step(family, ep) for family, ep in layouts}


def _step(family: str, ep_size: int) -> dict:
    from phalanx.shard.expert_parallel import apply_expert_parallel

    world, rank = dist.get_world_size(), dist.get_rank()
    batch = torch.randint(5, 128, (2 * world, 16), generator=torch.Generator().manual_seed(1))
    ref = _reference(family, batch)
    model = build(family).to(run_device())
    plan = apply_expert_parallel(model, ep_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    local = to_device(batch[2 * rank:2 * rank + 2], run_device())
    loss = model(input_ids=local, labels=local).loss + model.config.router_aux_loss_coef * plan.load_balancing_loss()
    z_loss = plan.router_z_loss()
    (loss + Z_LOSS * z_loss).backward()
    z_loss = z_loss.detach()
    dist.all_reduce(z_loss)
    plan.all_reduce_gradients(model)
    optimizer.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    counts = [c.cpu() for c in plan.token_counts().values()]
    state = {k: v.cpu() for k, v in plan.full_state_dict(model).items()}
    local_experts = {tuple(m.gate_up_proj.shape) for m in plan.experts.values()}
    return {"loss": rel_diff(mean.item() / world, ref["loss"]),
            "z_loss": rel_diff(z_loss.item() / world, ref["z_loss"]),
            "update": update_diff(state, ref["state"], ref["start"]),
            "counts": (counts, ref["counts"]), "local_experts": local_experts,
            "names": sorted(set(state) ^ set(ref["state"]))}


def skewed_dispatch() -> dict:
    """Every rank routes all its tokens to experts 0 and 1 (both on EP rank 0), so rank 1 receives
    no rows: the experts' output and the gradients of the inputs, routing weights and experts
    equal HF's experts module run on every rank's tokens in one process."""
    from phalanx.shard.expert_parallel import ExpertParallelExperts, expert_groups

    world, rank, device = dist.get_world_size(), dist.get_rank(), run_device()
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(world, 6, 32, generator=gen)
    weights = torch.rand(world, 6, 2, generator=gen)
    index = torch.tensor([0, 1]).repeat(world, 6, 1)
    probe = torch.randn(world, 6, 32, generator=gen)
    hf = build("mixtral").model.layers[0].mlp.experts
    ep = ExpertParallelExperts(hf, expert_groups(world)).to(device)
    leaves = [t.clone().reshape(world * 6, -1).requires_grad_() for t in (hidden, weights)]
    (hf(leaves[0], index.reshape(world * 6, 2), leaves[1]) * probe.reshape(world * 6, 32)).sum().backward()
    mine = [to_device(t[rank], device).requires_grad_() for t in (hidden, weights)]
    out = ep(mine[0], to_device(index[rank], device), mine[1])
    (out * to_device(probe[rank], device)).sum().backward()
    first = rank * ep.local
    want_up = hf.gate_up_proj.grad[first:first + ep.local] if hf.gate_up_proj.grad is not None else \
        torch.zeros_like(ep.gate_up_proj)
    rows = slice(6 * rank, 6 * rank + 6)
    return {"hidden_grad": rel_diff(mine[0].grad.cpu(), leaves[0].grad[rows]),
            "weights_grad": rel_diff(mine[1].grad.cpu(), leaves[1].grad[rows]),
            "up_grad": (ep.gate_up_proj.grad.cpu(), want_up)}


def balance_losses() -> dict:
    """Router logits of 2 layers on each rank with padding masks of different sizes: the mean over
    ranks of `load_balancing_loss` / `router_z_loss` equals transformers' aux loss / the z-loss by
    hand on every rank's rows in one process, and each rank's logits gradient is world × the
    one-process gradient of its rows (the data-parallel mean then gives the global gradient)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from phalanx.shard.expert_parallel import load_balancing_loss, router_z_loss

    world, rank, device = dist.get_world_size(), dist.get_rank(), run_device()
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(world, 2, 2, 6, 4, generator=gen)  # rank, layer, batch, seq, experts
    mask = torch.ones(world, 2, 6)
    mask[0, 0, :1] = 0
    mask[1, :, :4] = 0  # rank 1 keeps 4 of 12 rows, rank 0 11
    full = [logits[:, layer].reshape(-1, 4).clone().requires_grad_() for layer in range(2)]
    want_aux = load_balancing_loss_func(tuple(full), 4, 2, mask.reshape(world * 2, 6))
    keep = mask.reshape(-1).bool()
    want_z = sum((layer[keep].logsumexp(-1) ** 2).sum() for layer in full) / (2 * keep.sum())
    out = {}
    for name, fn, want in (("aux", load_balancing_loss, want_aux), ("z", router_z_loss, want_z)):
        mine = [to_device(logits[rank, layer].reshape(-1, 4), device).requires_grad_() for layer in range(2)]
        args = (mine, 4, 2, to_device(mask[rank], device)) if name == "aux" else (mine, to_device(mask[rank], device))
        value = fn(*args)
        value.backward()
        total = value.detach().clone()
        dist.all_reduce(total)
        grads = torch.autograd.grad(want, full)
        rows = slice(12 * rank, 12 * rank + 12)
        out[name] = {"value": rel_diff(total.item() / world, want.item()),
                     "grad": rel_diff([m.grad.cpu() / world for m in mine], [g[rows] for g in grads])}
    return out
