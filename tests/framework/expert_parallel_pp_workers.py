"""What tests/framework/test_expert_parallel_pp.py runs on each rank: two clipped SGD steps of the
tiny Mixtral under HybridParallelPlugin(pp_size=2) (with ep2 or dp2) with the router losses on
(cross-entropy + 0.5 · the load-balancing loss + 0.1 · the z-loss), against one process.

The one-process reference is transformers' own loss, arranged as a loop of gradient accumulation
over the pipeline's microbatches would see it: the cross-entropy and the z-loss of the whole batch
(both token means), and the load-balancing loss (transformers' `load_balancing_loss_func`) of each
global microbatch — the same rows of every data-parallel rank's batch — averaged over the
microbatches (phalanx.pipeline.router_losses says why the unit is the microbatch under pp)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from expert_parallel_plugin_workers import (ROWS, STEPS, Z_LOSS, _boost, _optimizer, _train, batches, build,
                                            differences)
from phalanx.device import run_device, to_device
from phalanx.testing import rel_diff


def microbatch_rows(dp: int, microbatches: int, rows: int = ROWS) -> list[list[int]]:
    """The global batch's rows of each microbatch: data rank d reads rows [d·per, (d+1)·per), the
    schedule cuts them into `microbatches` equal runs in order."""
    per = rows // dp
    size = per // microbatches
    return [[d * per + j * size + i for d in range(dp) for i in range(size)] for j in range(microbatches)]


def reference(dp: int, microbatches: int, max_norm: float | None) -> dict:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = build("mixtral")
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = _optimizer(model.parameters(), adamw=False)
    config = model.config
    losses, norms = [], []
    for batch in batches()[:STEPS]:
        out = model(input_ids=batch, labels=batch)
        cross_entropy = out.loss - config.router_aux_loss_coef * out.aux_loss  # transformers' loss adds its aux
        layers = [r.view(ROWS, -1, r.shape[-1]) for r in out.router_logits]
        aux = torch.stack([load_balancing_loss_func(tuple(r[rows].reshape(-1, r.shape[-1]) for r in layers),
                                                    config.num_local_experts, config.num_experts_per_tok)
                           for rows in microbatch_rows(dp, microbatches)]).mean()
        z = (torch.cat(out.router_logits).logsumexp(-1) ** 2).mean()
        loss = cross_entropy + config.router_aux_loss_coef * aux + Z_LOSS * z
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or float("inf")).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():  # the cross-entropy of a fresh batch after the steps (what evaluation reports)
        evaluation = model(input_ids=batches()[-1], labels=batches()[-1], output_router_logits=False).loss.item()
    return {"losses": losses, "norms": norms, "start": start, "evaluation": evaluation,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def pp_steps(layouts: dict[str, dict], max_norm: float | None = None, layers: int | None = None) -> dict:
    """{layout name: differences to one process (losses, gradient norms, on rank 0 the weights)};
    `layers`: decoder layers of the tiny Mixtral instead of 2 (this rank process's models only)."""
    if layers is not None:
        import expert_parallel_plugin_workers
        expert_parallel_plugin_workers.SMALL["num_hidden_layers"] = layers
    out = {}
    for name, layout in layouts.items():
        booster, plugin, model, optimizer = _boost("mixtral", {**layout, "max_norm": max_norm}, True)
        ref = reference(plugin.dp_size, plugin.num_microbatches, max_norm)
        losses, norms = _train(booster, plugin, model, optimizer, batches()[:STEPS])
        fresh = to_device(batches()[-1], run_device())  # evaluation: one tensor between stages, no router losses
        evaluation = booster.execute_pipeline(iter([{"input_ids": fresh, "labels": fresh}]), model, forward_only=True)
        out[name] = differences(plugin, model, losses, norms, ref,
                                evaluation=rel_diff(evaluation["loss"].item(), ref["evaluation"]))
    return out


def balancer_loads_under_pp(steps: int = 2) -> dict:
    """DeepSeek-V3 (3 layers, the first dense) under pp2 (1F1B, 2 microbatches) with
    `BiasBalancer` attached: {router: the top-k assignments it counted over `steps` steps (no
    balancer step in between), and what the steps' tokens make}. torch's shape inference at the
    first step runs every stage once more (past the first stage on uninitialised tensors); the
    runner marks it (phalanx.pipeline.in_shape_inference) and the balancer counts nothing then."""
    from deepseek_workers import ROWS as DS_ROWS, SEQ, _boost as deepseek_boost, batches as deepseek_batches, deepseek_config
    from phalanx.device import run_device, to_device
    from phalanx.models.deepseek import BiasBalancer
    from phalanx.testing import boosted_step

    booster, plugin, model, optimizer = deepseek_boost("v3", {"pp_size": 2, "num_microbatches": 2})
    balancer = BiasBalancer.attach(model, rate=0.01)
    for batch in deepseek_batches()[:steps]:
        boosted_step(booster, model, optimizer, to_device(batch, run_device()))
    k = deepseek_config(3).num_experts_per_tok
    return {"loads": {name: int(load.sum()) for name, load in balancer.loads(reduce=False).items()},
            "want": steps * DS_ROWS * SEQ * k}


DEEPSEEK_ALPHA = 0.1  # DeepSeek's balance loss coefficient (large: its gradients count)


def deepseek_reference(variant: str, per_sequence: bool, dp: int, microbatches: int) -> dict:
    """One process, DeepSeek with its balance loss (`BalanceLoss`, reduce=False) in the form asked
    for, as a loop of gradient accumulation over the global microbatches: each microbatch's
    cross-entropy + balance loss, / microbatches (with equal microbatches the cross-entropy is the
    batch's, and per sequence the balance loss too; over the batch it is each microbatch's)."""
    from deepseek_workers import LR, ROWS as DS_ROWS, batches as deepseek_batches, build as deepseek_build
    from phalanx.models.deepseek import BalanceLoss

    model = deepseek_build(variant, DEEPSEEK_ALPHA, seq_aux=per_sequence)
    balance = BalanceLoss.attach(model)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for batch in deepseek_batches()[:STEPS]:
        total = 0.0
        for rows in microbatch_rows(dp, microbatches, DS_ROWS):
            ids = batch[rows]
            loss = (model(input_ids=ids, labels=ids).loss + balance.loss(reduce=False)) / microbatches
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": norms, "start": start,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def deepseek_pp_steps(layouts: dict[str, tuple[str, bool, dict]]) -> dict:
    """{name: (variant, per_sequence, layout)} -> differences to `deepseek_reference`: two SGD
    steps under the pipeline with config.output_router_logits=True (the plugin carries DeepSeek's
    balance loss through the stages)."""
    from deepseek_workers import ROWS as DS_ROWS, _boost as deepseek_boost, batches as deepseek_batches

    out = {}
    for name, (variant, per_sequence, layout) in layouts.items():
        booster, plugin, model, optimizer = deepseek_boost(variant, layout, DEEPSEEK_ALPHA, seq_aux=per_sequence)
        ref = deepseek_reference(variant, per_sequence, plugin.dp_size, plugin.num_microbatches)
        losses, norms = _train(booster, plugin, model, optimizer, deepseek_batches()[:STEPS], rows=DS_ROWS)
        out[name] = differences(plugin, model, losses, norms, ref)
    return out
