"""What tests/framework/test_expert_parallel_sp.py runs on each rank: HybridParallelPlugin with
expert parallelism and Ulysses / ring sequence parallelism (ep_size dividing dp × sp), two SGD
steps of the tiny Mixtral of expert_parallel_plugin_workers against one process on the whole
batch; the model saved in Hugging Face layout and loaded into a layout without sequence
parallelism and by from_pretrained."""
from __future__ import annotations

import torch.distributed as dist

from expert_parallel_plugin_workers import layout_steps, load_elsewhere


def sp_layouts(layouts: dict[str, dict], save: str | None = None, load_layout: dict | None = None) -> dict:
    """`layout_steps` of Mixtral under each layout (router losses on, clipped at 0.5 below the
    norm); with `save`, the first layout's model written there, then loaded into `load_layout`
    (the logits of a fresh batch against the one-process model after its steps)."""
    out = {"layouts": layout_steps("mixtral", layouts, max_norm=0.5, save=save)}
    if save is not None:
        dist.barrier()
        out["loaded"] = load_elsewhere("mixtral", save, load_layout or {}, max_norm=0.5)
    return out


def refusals() -> list[str]:
    """The messages of the EP × SP layouts the plugin refuses: split-gather (at construction) and
    an ep_size that does not divide dp × sp (at set-up, where the world size is known)."""
    from phalanx.booster import Booster
    from phalanx.booster.plugins.hybrid import HybridParallelPlugin
    from phalanx.mesh import LayoutError

    messages = []
    for make in (lambda: HybridParallelPlugin(ep_size=2, tp_size=2, sequence_parallelism="split_gather"),
                 lambda: Booster(HybridParallelPlugin(ep_size=4, sp_size=2, sequence_parallelism="ulysses"))):
        try:
            make()
        except LayoutError as e:
            messages.append(str(e))
        else:
            messages.append("")
    return messages


def resume_from_ep_sp(path: str) -> dict:
    """AdamW optimizer state saved under ep2 × Ulysses sp2 (ZeRO 0 and ZeRO 1), loaded under ep2
    without sp (ZeRO 0) and under ep2 × sp2 ZeRO-2: `resume_elsewhere` for each saving stage."""
    from expert_parallel_plugin_workers import resume_elsewhere

    ulysses = {"sp_size": 2, "sequence_parallelism": "ulysses"}
    loads = {"ep2 zero0": {"ep_size": 2}, "ep2 sp2 zero2": {"ep_size": 2, "zero_stage": 2, **ulysses}}
    return {f"from ep2 sp2 zero{stage}": resume_elsewhere("mixtral", f"{path}/zero{stage}",
                                                          {"ep_size": 2, "zero_stage": stage, **ulysses}, loads)
            for stage in (0, 1)}


def sp_layouts_without_ep(layouts: dict[str, dict]) -> dict:
    """Under each layout without expert parallelism (Ulysses / ring, with or without dp): two
    clipped SGD steps of the tiny Mixtral with the router losses on, whose global-batch values the
    plugin computes from hooks on the routers (transformers' own aux loss would be each sequence
    shard's), against one process: {layout: losses, gradient norms, on rank 0 the weights}."""
    from expert_parallel_plugin_workers import _boost, _train, batches, differences, reference

    ref = reference("mixtral", True, 0.5)
    out = {}
    for name, layout in layouts.items():
        booster, plugin, model, optimizer = _boost("mixtral", {**layout, "max_norm": 0.5}, True)
        losses, norms = _train(booster, plugin, model, optimizer, batches()[:2])
        out[name] = differences(plugin, model, losses, norms, ref)
    return out


def split_gather_router_loss_refusals() -> dict[str, str]:
    """The error boost raises for the tiny Mixtral's router losses under split-gather sequence
    parallelism (tp2): the load-balancing loss (config.output_router_logits) and the z-loss."""
    import torch

    from expert_parallel_plugin_workers import build
    from phalanx.booster import Booster
    from phalanx.booster.plugins.hybrid import HybridParallelPlugin

    out = {}
    for name, (router_logits, z_loss) in {"aux": (True, 0.0), "z-loss": (False, 0.1)}.items():
        model = build("mixtral", router_losses=router_logits)
        plugin = HybridParallelPlugin(tp_size=2, sequence_parallelism="split_gather", router_z_loss=z_loss)
        try:
            Booster(plugin).boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    return out
