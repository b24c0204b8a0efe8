"""What the pipeline tests run on each rank: one spawn loops over families and layouts and
returns `phalanx.testing.Diff`s (differences from one plain process); the asserts live in
test_pipeline.py. Models have 4 decoder layers so that pp=2 with 2 stages per rank
(interleaved, zero_bubble) has a layer per stage."""
from __future__ import annotations

import torch
import torch.distributed as dist

import hybrid_models as hm
import hybrid_workers as hw
from phalanx.device import run_device, to_device
from phalanx.testing import Diff, rel_diff, update_diff

LAYERS = 4


def pipeline_step(family: str, layout: dict, ref: dict) -> dict:
    """Differences of one execute_pipeline + SGD step under `layout` from the reference (the
    weights are compared on rank 0, where `full_model_state_dict` is complete)."""
    booster, model, optimizer = hw.boost(family, layout, layers=LAYERS)
    loss = hw.train_steps(booster, model, optimizer, hm.tokens(family))[0]
    state = booster.plugin.full_model_state_dict(model)
    param = update_diff(state, ref["params"], ref["start"]) if dist.get_rank() == 0 else Diff(0.0, "not rank 0")
    # forward-only after the step, on a batch of another shape than training's (3 rows of 10)
    fresh = hm.tokens(family, seed=11)[0][:3, :10]
    ref_logits = ref["logits"][:3, :10]
    ref_eval = torch.nn.functional.cross_entropy(ref_logits[:, :-1].reshape(-1, ref_logits.shape[-1]),
                                                 fresh[:, 1:].reshape(-1)).item()
    ev = booster.execute_pipeline(iter([to_device(fresh, run_device())]), model, forward_only=True,
                                  return_outputs=True)
    # the logits live on the last stage's ranks: every rank reports its rel error (0 without
    # logits) and whether it had them; the largest and the count are reduced over the ranks
    logits = torch.tensor([0.0 if ev["outputs"] is None else rel_diff(ev["outputs"], ref_logits).value,
                           float(ev["outputs"] is not None)], device=run_device())
    dist.all_reduce(logits[:1], op=dist.ReduceOp.MAX)
    dist.all_reduce(logits[1:])
    return {"eval_loss": rel_diff(ev["loss"].item(), ref_eval), "eval_logits": Diff(logits[0].item()),
            "eval_logit_ranks": int(logits[1].item()),
            "loss": rel_diff(loss, ref["losses"][0]),
            "norm": rel_diff(optimizer.last_grad_norm, ref["norms"][0]), "ref_norm": ref["norms"][0],
            "param": param, "saved_keys": sorted(state) == sorted(ref["params"]) if dist.get_rank() == 0 else True}


def equivalence_suite(layouts: dict[str, dict], families=hm.FAMILIES) -> dict:
    """{layout name: {family: differences}} of `pipeline_step`."""
    return hw.equivalence_suite(layouts, families, step=pipeline_step, layers=LAYERS)


def checkpoint_suite(directory: str, save_layout: dict, load_layouts: dict, families=("llama", "gpt2")) -> dict:
    """One AdamW step under `save_layout` (pipelined), then a training checkpoint: its model
    directory opened by `from_pretrained` and loaded under tp2 gives the single-process logits
    after that step; each of `load_layouts` resumes model and optimizer state and takes the second
    step, compared with two uninterrupted single-process steps (loss; weights on rank 0)."""
    from transformers import AutoModelForCausalLM

    from phalanx.checkpoint import TrainState

    out: dict = {}
    for family in families:
        ref1 = hw.reference(family, kind="adamw", layers=LAYERS)
        ref2 = hw.reference(family, steps=2, kind="adamw", layers=LAYERS)
        batches = hm.tokens(family, steps=2)
        booster, model, optimizer = hw.boost(family, save_layout, kind="adamw", layers=LAYERS)
        hw.train_steps(booster, model, optimizer, batches[:1])
        path = f"{directory}/{family}"
        booster.save_checkpoint(path, model, optimizer, train_state=TrainState(step=1))
        fresh = hm.tokens(family, seed=11)[0]
        tp_booster, tp_model, _ = hw.boost(family, dict(tp_size=2), seed=5, layers=LAYERS)
        tp_booster.load_model(tp_model, f"{path}/model")
        plain = AutoModelForCausalLM.from_pretrained(f"{path}/model")
        with torch.no_grad():  # after one AdamW step: the logits' update measure
            out.setdefault("logits", {})[family] = {
                "tp2": hw.logits_update_diff(tp_model(input_ids=to_device(fresh, run_device())).logits.cpu(), ref1),
                "plain": hw.logits_update_diff(plain(input_ids=fresh).logits, ref1)}
        for name, layout in load_layouts.items():
            booster, model, optimizer = hw.boost(family, layout, kind="adamw", seed=99, layers=LAYERS)
            booster.load_checkpoint(path, model, optimizer)
            losses = hw.train_steps(booster, model, optimizer, batches[1:])
            state = booster.plugin.full_model_state_dict(model)
            out.setdefault(name, {})[family] = {
                "loss": rel_diff(losses[0], ref2["losses"][1]),
                "param": update_diff(state, ref2["params"], ref2["start"]) if dist.get_rank() == 0 else Diff(0.0)}
    return out


def error_suite() -> dict:
    """Layouts refused at boost or at execute_pipeline, with the model untouched where refused at boost."""
    from phalanx.booster import Booster
    from phalanx.booster.plugins.hybrid import HybridParallelPlugin

    out: dict = {}
    model = hm.build("llama", layers=LAYERS)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        Booster(HybridParallelPlugin(pp_size=2, pp_schedule="interleaved", virtual_stages=4,
                                     num_microbatches=2)).boost(model)
    except ValueError as exc:
        out["too_many_stages"] = str(exc)
    after = dict(model.named_parameters())
    out["untouched"] = set(after) == set(before) and all(torch.equal(before[n], after[n]) for n in before)
    booster, model, optimizer = hw.boost("llama", dict(pp_size=2, num_microbatches=2), layers=LAYERS)
    batch = to_device(hm.tokens("llama", batch=3)[0], run_device())
    try:
        booster.execute_pipeline(iter([batch]), model, None, optimizer)
    except ValueError as exc:
        out["batch"] = str(exc)
    try:
        model(input_ids=batch)
    except RuntimeError as exc:
        out["forward"] = str(exc)
    from phalanx.booster import unwrap_model
    from phalanx.train import eval_loss_sum

    mask = torch.ones_like(batch)
    mask[0, :2] = 0  # left padding: a pipeline evaluates without a mask, so it must refuse it
    try:
        eval_loss_sum(unwrap_model(model), {"input_ids": batch, "attention_mask": mask})
    except ValueError as exc:
        out["left_padding"] = str(exc)
    return out


def masked_labels_step(layout: dict, family: str = "llama") -> dict:
    """Labels with -100 spread unevenly over the rows (so microbatches hold different token counts):
    the pipelined loss and step must equal one process's token mean over the whole batch."""
    batch = hm.tokens(family)[0]
    labels = batch.clone()
    labels[0, 6:] = -100
    labels[1, :13] = -100
    model = hm.build(family, layers=LAYERS)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = hw.make_optimizer(model.parameters())
    loss = model(input_ids=batch, labels=labels).loss
    loss.backward()
    optimizer.step()
    ref = {n: p.detach() for n, p in model.named_parameters()}
    booster, model, optimizer = hw.boost(family, layout, layers=LAYERS)
    out = booster.execute_pipeline(iter([to_device({"input_ids": batch, "labels": labels}, run_device())]), model,
                                   None, optimizer)
    optimizer.step()
    state = booster.plugin.full_model_state_dict(model)
    return {"loss": rel_diff(out["loss"].item(), loss.item()),
            "param": update_diff(state, ref, start) if dist.get_rank() == 0 else Diff(0.0)}
