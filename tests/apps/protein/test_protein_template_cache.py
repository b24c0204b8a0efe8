"""The template embedding cached across recycling passes (`model.template.cache`, on by default):
the template pair stack reads only the template inputs, so `AlphaFold.forward` runs it once per
forward and every pass reuses it; only the pointwise attention (which reads the pair
representation) runs every pass. Outputs and gradients must be those of the uncached model."""
from __future__ import annotations

import copy

import torch

from apps.protein.model.template import TemplateConfig
from protein_tiny import loss_and_outputs, real_batch, tiny_model

RECYCLES = 2


def _models(seed: int = 0):
    """The same weights with the cache on and off, on the run's device (the emulated GPU under
    tests/emulated)."""
    from phalanx.device import current_device

    cached = tiny_model(seed, templates=True, template=TemplateConfig(c_t=8, blocks=2, heads=2, c_hidden_mul=8))
    cached = cached.to(current_device())
    plain = copy.deepcopy(cached)
    plain.cfg.template.cache = False
    assert cached.cfg.template.cache is True and cached.cfg.template is not plain.cfg.template
    return cached, plain


def _batch(**kwargs):
    from phalanx.device import current_device, to_device

    return to_device(real_batch(crop=12, clusters=3, extra=4, **kwargs), current_device())


def _count_stack_runs(model) -> list[int]:
    calls = [0]
    model.template_embedder.pair_stack.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _loss_outputs_grads(model, batch, recycles=RECYCLES):
    from apps.protein.losses import LossWeights, alphafold_loss

    model.zero_grad(set_to_none=True)
    out = model(**batch, recycles=recycles)
    tables = {"default_frames": model.default_frames, "atom14_local": model.atom14_local}
    loss, _ = alphafold_loss(out, batch, tables, LossWeights(experimentally_resolved=0.01))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), {k: v.detach() for k, v in out.items()}, grads


def test_cached_templates_give_the_same_outputs_and_gradients_and_run_the_stack_once():
    """fp32, training mode, 2 recycles: loss, every output and every parameter gradient equal the
    uncached model's to the bit (the same operations on the same inputs); the template pair stack
    runs once per forward with the cache and once per pass (3) without; its parameters get their
    gradient (from the last pass, as without the cache)."""
    cached, plain = _models()
    cached.train()
    plain.train()
    runs_cached, runs_plain = _count_stack_runs(cached), _count_stack_runs(plain)
    batch = _batch(batch=2, templates=2)
    assert batch["template_mask"].device == next(cached.parameters()).device
    loss_c, out_c, grads_c = _loss_outputs_grads(cached, batch)
    loss_p, out_p, grads_p = _loss_outputs_grads(plain, batch)
    assert runs_cached[0] == 1 and runs_plain[0] == RECYCLES + 1
    assert torch.equal(loss_c, loss_p), (loss_c, loss_p)
    assert set(out_c) == set(out_p)
    for key in out_p:
        assert torch.equal(out_c[key], out_p[key]), f"output {key} differs with the cache"
    assert set(grads_c) == set(grads_p) and len(grads_p) == len(list(plain.parameters()))
    stack = [k for k in grads_p if k.startswith("template_embedder.pair_stack.")]
    assert stack and all(grads_p[k].abs().max() > 0 for k in stack)
    for key in grads_p:
        assert torch.equal(grads_c[key], grads_p[key]), f"gradient of {key} differs with the cache"


def test_the_cache_does_not_carry_over_to_the_next_batch():
    """Two batches with different templates through one cached model in turn (eval, no grad, and
    then a training step): each gives the uncached model's prediction of that batch, and the stack
    runs once per forward."""
    cached, plain = _models(seed=3)
    cached.eval()
    plain.eval()
    runs = _count_stack_runs(cached)
    first = _batch(batch=1, seed=0, templates=1)
    second = _batch(batch=1, seed=7, templates=1)
    assert not torch.equal(first["template_all_atom_positions"], second["template_all_atom_positions"])
    with torch.no_grad():
        for batch in (first, second, first):
            got, want = cached(**batch, recycles=RECYCLES), plain(**batch, recycles=RECYCLES)
            for key in ("pair", "atom37", "plddt"):
                assert torch.equal(got[key], want[key]), f"{key}: the cache leaked from an earlier batch"
    assert runs[0] == 3
    cached.train()
    plain.train()
    loss_c, _ = loss_and_outputs(cached, second)
    loss_p, _ = loss_and_outputs(plain, second)
    assert torch.equal(loss_c, loss_p)


def test_the_bench_times_both_settings():
    """`bench/protein.py --template-cache` (tiny sizes): both settings of both modes timed, and
    the template stack ran once per sample with the cache and once per pass without (the bench
    really switched it)."""
    import argparse
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_protein_cache",
                                                  Path(__file__).resolve().parents[3] / "bench" / "protein.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = argparse.Namespace(lengths=[8], templates=2, recycles=1, reps=1, config="apps/protein/configs/tiny.yaml")
    result = bench.template_cache(args)
    runs = {(r["cache"], r["mode"]): r["stack_runs_per_sample"] for r in result["rows"]}
    assert runs == {(True, "forward"): 1, (True, "fwd+bwd"): 1, (False, "forward"): 2, (False, "fwd+bwd"): 2}
    assert set(result["saved"]) == {"L8_forward", "L8_fwd+bwd"}
    assert all(r["time_s"] > 0 for r in result["rows"])
