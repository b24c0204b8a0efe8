"""The planner's measured tests: each case's estimate against the worst rank's measured peak, and
the rank bodies that build every listed layout and measure peaks."""
from __future__ import annotations

from typing import Callable

import torch


def estimate_errors(model: dict, cases: dict, ranks: list, world: int, check: Callable | None = None) -> dict:
    """{case: estimate / measured - 1} for `cases` ({name: (make_plugin kwargs, seq, micro batch)}) of
    `model` measured on `world` ranks (`ranks`: each rank's `measure_many` results, in case order).
    Every case must have trained (3 losses, the last below the first); `check(name, estimate)` may
    assert more. Prints both sides in MiB and the phase the estimate's peak falls in."""
    from phalanx.booster.plugins import make_plugin
    from phalanx.plan import estimate_for_run

    errors, mib = {}, {}
    for i, (name, (kwargs, seq, mb)) in enumerate(cases.items()):
        kwargs = dict(kwargs)
        lora = kwargs.pop("lora", None)
        plugin = make_plugin(kwargs.pop("name"), precision="fp32", **kwargs)
        est = estimate_for_run(dict(model), plugin, seq, mb, world, loss="hf", lora=lora)
        if check is not None:
            check(name, est)
        measured = max(r[i]["anon"] for r in ranks)
        errors[name] = round(est.memory.device_total / measured - 1, 4)
        mib[name] = (round(est.memory.device_total / 2**20, 1), round(measured / 2**20, 1), est.memory.phase)
        first = ranks[0][i]["losses"]
        assert len(first) == 3 and first[-1] < first[0], (name, first)  # training ran and learned
    print("\n  estimate / measured - 1:", errors, "\n  MiB (estimate, measured, peak in):", mib)
    return errors


def build_every_layout(jobs: dict[str, tuple[dict, int, list]]) -> dict:
    """Rank body: for each job (model, seq, layouts) boost the model under each layout's
    `plugin_options()` (fp32) and train two AdamW steps: ("trained", (losses, describe())) or
    ("refused", the plugin's message, at boost or at the first forward)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from phalanx.booster import Booster
    from phalanx.booster.plugins import make_plugin
    from phalanx.device import to_device

    out = {}
    for label, (fields, seq, layouts) in jobs.items():
        config = AutoConfig.for_model(fields["model_type"], attn_implementation="sdpa",
                                      **{k: v for k, v in fields.items() if k != "model_type"})
        out[label] = {}
        for name, options, _ in layouts:
            options = dict(options)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            ids = to_device(torch.randint(0, config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1)))
            losses = []
            try:
                booster = Booster(plugin=make_plugin(options.pop("name"), precision="fp32", **options))
                model, opt, *_ = booster.boost(model, opt)
                for _ in range(2):
                    loss = model(input_ids=ids, labels=ids).loss
                    booster.backward(loss, opt)
                    opt.step()
                    opt.zero_grad()
                    losses.append(float(loss.detach()))
            except ValueError as exc:  # LayoutError is a ValueError
                out[label][name] = ("refused", str(exc))
                continue
            out[label][name] = ("trained", (losses, booster.plugin.describe()))
            del model, opt, booster
    return out


def measure(cases):
    from phalanx.plan.measure import measure_many

    return measure_many(cases)
