"""What tests/framework/test_expert_parallel_plugin.py runs on each rank: two SGD steps of a tiny
random MoE under HybridParallelPlugin(ep_size=...) composed with dp, ZeRO-1/2, tp and pp, against
the same steps in one process on the whole batch (cross-entropy + transformers' own aux loss +
a z-loss by hand); then the model saved in Hugging Face layout, loaded into another layout and
compared there."""
from __future__ import annotations

import torch
import torch.distributed as dist

import moe_models
from phalanx.device import run_device, to_device
from phalanx.testing import boosted_step, rel_diff, update_diff

SMALL = dict(vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
             router_aux_loss_coef=0.5)  # large coefficients: the router losses' gradients must be right too
Z_LOSS = 0.1
LR, STEPS, ROWS = 0.1, 2, 8  # the global batch: 8 rows of 16 tokens


def build(family: str, router_losses: bool = True):
    from transformers import AutoModelForCausalLM
    width = {"intermediate_size": 16} if family == "mixtral" else {"moe_intermediate_size": 16}
    torch.manual_seed(0)
    config = moe_models.moe_config(family, **SMALL, **width, output_router_logits=router_losses)
    return AutoModelForCausalLM.from_config(config, experts_implementation="eager").float()


def batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(5, 128, (ROWS, 16), generator=gen) for _ in range(STEPS + 1)]  # the last: evaluation


def _optimizer(params, adamw: bool):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01) if adamw else torch.optim.SGD(params, lr=LR)


def reference(family: str, router_losses: bool, max_norm: float | None, adamw: bool = False) -> dict:
    """One process, the whole batch: losses, gradient norms, weights before and after the steps,
    logits of a fresh batch after them."""
    model = build(family, router_losses)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = _optimizer(model.parameters(), adamw)
    losses, norms, data = [], [], batches()
    for batch in data[:STEPS]:
        out = model(input_ids=batch, labels=batch)
        k = model.config.num_experts_per_tok  # the last step's assignments per expert, per block
        counts = [torch.bincount(torch.topk(r, k).indices.reshape(-1), minlength=4).tolist()
                  for r in out.router_logits or ()]
        loss = out.loss
        if router_losses:
            loss = loss + Z_LOSS * (torch.cat(out.router_logits).logsumexp(-1) ** 2).mean()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or float("inf")).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        logits = model(input_ids=data[-1]).logits
    return {"losses": losses, "norms": norms, "start": start, "logits": logits, "counts": counts,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _boost(family: str, layout: dict, router_losses: bool, adamw: bool = False):
    from phalanx.booster import Booster
    from phalanx.booster.plugins.hybrid import HybridParallelPlugin

    plugin = HybridParallelPlugin(**layout, router_z_loss=Z_LOSS if router_losses else 0.0)
    booster = Booster(plugin)
    model = build(family, router_losses)
    optimizer = _optimizer(model.parameters(), adamw)
    model, optimizer, *_ = booster.boost(model, optimizer)
    return booster, plugin, model, optimizer


def _train(booster, plugin, model, optimizer, data, rows: int = ROWS) -> tuple[list[float], list[float]]:
    """Boosted steps on this rank's share of each batch of `rows` rows: the global losses and grad norms."""
    per = rows // plugin.dp_size
    losses, norms = [], []
    for batch in data:
        loss = boosted_step(booster, model, optimizer,
                            to_device(batch[plugin.dp_rank * per:(plugin.dp_rank + 1) * per], run_device()))
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total, group=plugin.dp_group)  # the global batch's loss: the mean over dp
        losses.append(total.item() / plugin.dp_size)
        norms.append(optimizer.last_grad_norm)
    return losses, norms


def layout_steps(family: str, layouts: dict[str, dict], router_losses: bool = True, max_norm: float | None = None,
                 save: str | None = None) -> dict:
    """{layout name: differences to one process}; `save`: a directory where the first layout's
    model is written (booster.save_model, Hugging Face layout) after its steps."""
    ref = reference(family, router_losses, max_norm)
    out = {}
    for i, (name, layout) in enumerate(layouts.items()):
        booster, plugin, model, optimizer = _boost(family, {**layout, "max_norm": max_norm}, router_losses)
        losses, norms = _train(booster, plugin, model, optimizer, batches()[:STEPS])
        counts = plugin.step_metrics()["expert_tokens"] if plugin.pp_size == 1 else None
        if save is not None and i == 0:
            booster.save_model(model, save)
        out[name] = differences(plugin, model, losses, norms, ref,
                                local_experts=sorted({tuple(m.gate_up_proj.shape) for m in plugin.ep_plan.experts.values()}),
                                counts=None if counts is None else (counts, ref["counts"]))
    return out


def differences(plugin, model, losses, norms, ref: dict, **extra) -> dict:
    """A boosted run against one process's: losses and grad norms, `extra` as given, and on rank 0 (the
    writer, which holds every tensor) the full model's weights."""
    state = plugin.full_model_state_dict(model)
    got = {"losses": rel_diff(losses, ref["losses"]), "norms": rel_diff(norms, ref["norms"]), **extra}
    if dist.get_rank() == 0:
        got.update(compare_saved_state(state, ref))
    return got


def compare_saved_state(state: dict, ref: dict) -> dict:
    """The gathered full state against one process's (`ref["state"]` after the steps, `ref["start"]`
    before): the update measure, and the names only one side has."""
    want = {k: v.detach() for k, v in ref["state"].items()}
    return {"update": update_diff({k: v.cpu().float() for k, v in state.items()}, want, ref["start"]),
            "names": sorted(set(want) ^ set(state))}


def load_elsewhere(family: str, path: str, layout: dict, router_losses: bool = True,
                   max_norm: float | None = None) -> dict:
    """The model saved by `layout_steps` loaded into `layout` (booster.load_model) and, on rank 0,
    by transformers' from_pretrained: logits of the evaluation batch against the one-process
    model after its steps (the saved model)."""
    ref = reference(family, router_losses, max_norm)
    booster, plugin, model, _ = _boost(family, layout, router_losses)
    booster.load_model(model, path)
    data = batches()[-1]
    with torch.no_grad():
        if plugin.pp_size > 1:
            raise ValueError("load_elsewhere compares logits of a pp_size=1 layout")
        # no router logits: transformers' aux loss counts with an integer histc on CUDA, which the
        # emulated GPU cannot run (and logits are all this compares)
        logits = model(input_ids=to_device(data, run_device()), output_router_logits=False).logits.cpu()
    return compare_loaded_logits(logits, data, path, ref)


def compare_loaded_logits(logits: torch.Tensor, data: torch.Tensor, path: str, ref: dict) -> dict:
    """The logits of a model loaded from `path` in some layout against one process's, and (rank 0)
    those of the same directory opened by transformers' from_pretrained."""
    from transformers import AutoModelForCausalLM

    got = {"logits": rel_diff(logits, ref["logits"])}
    if dist.get_rank() == 0:
        hf = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").float()
        with torch.no_grad():
            got["from_pretrained"] = rel_diff(hf(input_ids=data).logits, ref["logits"])
    return got


def resume_elsewhere(family: str, path: str, save_layout: dict, load_layouts: dict[str, dict]) -> dict:
    """AdamW: one step under `save_layout`, model and optimizer saved (booster.save_model /
    save_optimizer), then for each of `load_layouts` both loaded into a fresh boost and the second
    step taken there: its loss and the weights after it against two steps in one process."""
    ref = reference(family, True, None, adamw=True)
    data = batches()
    booster, plugin, model, optimizer = _boost(family, save_layout, True, adamw=True)
    _train(booster, plugin, model, optimizer, data[:1])
    booster.save_model(model, f"{path}/model")
    booster.save_optimizer(optimizer, f"{path}/optimizer")
    out = {}
    for name, layout in load_layouts.items():
        booster, plugin, model, optimizer = _boost(family, layout, True, adamw=True)
        booster.load_model(model, f"{path}/model")
        booster.load_optimizer(optimizer, f"{path}/optimizer")
        losses, _ = _train(booster, plugin, model, optimizer, data[1:2])
        state = booster.plugin.full_model_state_dict(model)
        got = {"loss": rel_diff(losses[0], ref["losses"][1])}
        if dist.get_rank() == 0:
            want = {k: v.detach() for k, v in ref["state"].items()}
            got["update"] = update_diff({k: v.cpu().float() for k, v in state.items()}, want, ref["start"])
        out[name] = got
    return out


def fit_layouts(output_root: str, runs: dict[str, tuple[str, dict]], steps: int = 3) -> dict:
    """phalanx.train.fit of the tiny Mixtral (no router losses) on ArithmeticSequences under each
    (plugin, options): the losses, and the metrics records' per-expert token counts."""
    import json
    from pathlib import Path

    from train_helpers import SEQ, ArithmeticSequences, config

    from phalanx.train import fit

    out = {}
    for name, (plugin, options) in runs.items():
        cfg = config(Path(output_root) / name, max_steps=steps, micro_batch_size=2, plugin=plugin,
                     plugin_options=options)
        model = build("mixtral", router_losses=False)  # vocabulary 128 == VOCAB
        result = fit(cfg, model, ArithmeticSequences(seq_len=SEQ))
        records = [json.loads(line) for line in Path(result.metrics_path).read_text().splitlines()]
        out[name] = {"losses": result.losses, "expert_tokens": [r.get("expert_tokens") for r in records if "loss" in r],
                     "tokens": 2 * dist.get_world_size() * SEQ}
    return out
