"""What the hybrid-parallel tests run on each rank (module level, so `phalanx.testing.spawn` can
start them). Every suite loops over families and layouts inside one spawn and returns
`phalanx.testing.Diff`s (measured differences from the single-process reference: rel, or update
for weights after a step); the asserts and tolerances live in the tests.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import hybrid_models as hm
from phalanx.booster.state import boosted_state
from phalanx.device import run_device, to_device
from phalanx.testing import LOW_PRECISION_RTOL, Diff, MasterWeights, check, rel_diff, update_diff

LR = 1e-2


def make_optimizer(params, kind: str = "sgd"):
    """SGD for the equivalence checks (its update is linear in the gradient, so weights compare as
    tightly as gradients); AdamW where optimizer state must move between layouts."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01, eps=1e-6)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP16_SCALE = 2.0**16  # the plugins' initial dynamic loss scale (no overflow in these runs)


def reference(family: str, steps: int = 1, kind: str = "sgd", max_norm: float | None = None,
              layers: int = 2, precision: str = "fp32") -> dict:
    """Plain torch, one process, the whole batch (bf16/fp16: the model in that dtype, fp32
    master weights, fp16 with a constant loss scale); `start` and `start_logits` are the fp32
    weights and the logits of the fresh batch before training (for update measures)."""
    model = hm.build(family, layers=layers)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        start_logits = model(input_ids=hm.tokens(family, seed=11)[0]).logits
    mp = MasterWeights(model, DTYPES[precision])
    opt = make_optimizer(mp.masters.values(), kind)
    scale = FP16_SCALE if precision == "fp16" else 1.0
    losses, grads, norms = [], {}, []
    for i, batch in enumerate(hm.tokens(family, steps=steps)):
        loss = model(input_ids=batch, labels=batch).loss
        (loss * scale).backward()
        if i == 0:
            params = dict(model.named_parameters(remove_duplicate=False))
            grads = {n: params[n].grad.detach().float() / scale for n in hm.SAMPLE_GRADS[family]}
        norms.append(mp.step(opt, scale, max_norm))
        losses.append(loss.item())
    with torch.no_grad():
        logits = model(input_ids=hm.tokens(family, seed=11)[0]).logits
    return {"losses": losses, "grads": grads, "params": mp.state(), "logits": logits, "norms": norms,
            "start": start, "start_logits": start_logits}


def boost(family: str, layout: dict, model=None, kind: str = "sgd", seed: int = 0, layers: int = 2):
    from phalanx.booster import Booster
    from phalanx.booster.plugins import Plugin
    from phalanx.booster.plugins.hybrid import HybridParallelPlugin

    booster = Booster(layout if isinstance(layout, Plugin) else HybridParallelPlugin(**layout))
    model = model if model is not None else hm.build(family, seed, layers)
    optimizer = make_optimizer(model.parameters(), kind)
    model, optimizer, *_ = booster.boost(model, optimizer)
    return booster, model, optimizer


def local_rows(booster, batch: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a global batch, on the run's device."""
    plugin = booster.plugin
    return to_device(batch.chunk(plugin.dp_size)[plugin.dp_rank], run_device())


def _dp_mean(booster, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=run_device())
    dist.all_reduce(t, group=booster.plugin.dp_group)
    return t.item() / booster.plugin.dp_size


def reduced_grads(booster, model, optimizer, names) -> dict[str, torch.Tensor]:
    """The full gradients the optimizer is about to apply (reduced over every group), for `names`.
    Runs the ZeRO reduction (or stage 0's synchronisation) without stepping."""
    from phalanx.shard.optim import HybridZeroOptimizer

    hf = model.unwrapped
    plan = boosted_state(model).plan
    params = dict(hf.named_parameters(remove_duplicate=False))
    local: dict[int, torch.Tensor] = {}
    if isinstance(optimizer, HybridZeroOptimizer):
        optimizer.reducer.finish()
        for g in optimizer.flat_groups:
            if g is None:
                continue
            shard = g.master.grad if g.master.grad is not None else torch.zeros_like(g.master)
            parts = [torch.empty_like(shard) for _ in range(optimizer.world_size)]
            dist.all_gather(parts, shard.contiguous(), group=optimizer.process_group)
            full = torch.cat(parts)
            for slot, p in zip(g.layout.slots, g.params, strict=True):
                local[id(p)] = full[slot.offset:slot.end].view(p.shape).clone()
    else:  # stage 0: synchronise now, read the gradients before clipping, then clip
        from phalanx.amp.clip import clip_grads_by_norm

        max_norm, optimizer.max_norm = optimizer.max_norm, None
        assert optimizer.unscale_and_clip()
        optimizer.max_norm = max_norm
        masters = [optimizer.master_of.get(id(p), p) for p in optimizer.model_params]
        for p, m in zip(optimizer.model_params, masters, strict=True):
            local[id(p)] = m.grad.detach().clone()
        clip_grads_by_norm([m.grad for m in masters], max_norm, optimizer.last_grad_norm)
    out = {}
    for name in names:
        g = local[id(params[name])]
        spec = plan.spec(name)
        if spec.is_sharded and plan.size > 1:
            parts = [torch.empty_like(g) for _ in range(plan.size)]
            dist.all_gather(parts, g.contiguous(), group=plan.group)
            g = spec.unshard(parts, plan.params[name].full_shape)
        out[name] = g
    return out


def finish_step(optimizer) -> None:
    """The rest of `optimizer.step()` after `reduced_grads`."""
    from phalanx.shard.optim import HybridZeroOptimizer

    if isinstance(optimizer, HybridZeroOptimizer):
        optimizer.step()
    else:
        optimizer.optim.step()
        optimizer.zero_grad()


def logits_update_diff(logits: torch.Tensor, ref: dict) -> Diff:
    """Logits after AdamW steps, as an update measure: ‖L − L_ref‖ / ‖L_ref − L_start‖ (AdamW
    turns gradient rounding into weight differences of a fraction of lr; the logits carry them)."""
    return update_diff(logits, ref["logits"], ref["start_logits"])


def one_step(family: str, layout: dict, ref: dict) -> dict:
    """Differences of one step under `layout` from the reference: loss, sampled gradients, global
    gradient norm, all weights after the step (SGD: update measure), logits of a fresh batch after
    the step (rel)."""
    booster, model, optimizer = boost(family, layout)
    calls = []
    policy = boosted_state(model).plan.policy
    policy.attention_modules(model.unwrapped)[0].register_forward_pre_hook(lambda *a: calls.append(1))
    batch = local_rows(booster, hm.tokens(family)[0])
    out = model(input_ids=batch, labels=batch)
    booster.backward(out.loss, optimizer)
    grads = reduced_grads(booster, model, optimizer, hm.SAMPLE_GRADS[family])
    finish_step(optimizer)
    optimizer.zero_grad()
    state = booster.plugin.full_model_state_dict(model)
    with torch.no_grad():
        logits = model(input_ids=to_device(hm.tokens(family, seed=11)[0], run_device())).logits
    return {"loss": rel_diff(_dp_mean(booster, out.loss.item()), ref["losses"][0]),
            "grad": rel_diff(grads, ref["grads"]), "norm": rel_diff(optimizer.last_grad_norm, ref["norms"][0]),
            "ref_norm": ref["norms"][0],
            "attention_calls": len(calls) - 1,  # the forward after the step runs it once more
            "param": update_diff(state, ref["params"], ref["start"]), "logits": rel_diff(logits, ref["logits"])}


def equivalence_suite(layouts: dict[str, dict], families=hm.FAMILIES, step=None, layers: int = 2) -> dict:
    """{layout name: {family: differences}} for one step (`step(family, layout, ref)`, default
    `one_step`) of every family under every layout, against one reference per clipping value."""
    step = step or one_step
    out: dict = {}
    for family in families:
        refs: dict = {}
        for name, layout in layouts.items():
            max_norm = layout.get("max_norm")
            if max_norm not in refs:
                refs[max_norm] = reference(family, max_norm=max_norm, layers=layers)
            out.setdefault(name, {})[family] = step(family, layout, refs[max_norm])
    return out


def train_steps(booster, model, optimizer, batches) -> list[float]:
    losses = []
    for batch in batches:
        local = local_rows(booster, batch)
        if boosted_state(model).pipeline is not None:  # pp_size > 1
            loss = booster.execute_pipeline(iter([{"input_ids": local, "labels": local}]), model, None,
                                            optimizer)["loss"]
        else:
            loss = model(input_ids=local, labels=local).loss
            booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_dp_mean(booster, loss.item()))
    return losses


def _logits(model, family: str) -> torch.Tensor:
    """The logits of the fresh batch, on the CPU (the batch goes to the model's device: a boosted
    model's on a rank, a plain one's in the parent)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        return model(input_ids=hm.tokens(family, seed=11)[0].to(device)).logits.cpu()


def checkpoint_suite(directory: str, save_layout, load_layouts: dict, families=("llama", "gpt2")) -> dict:
    """Train one AdamW step under `save_layout` (a HybridParallelPlugin layout, or "ddp"), save a
    training checkpoint, load it under each of `load_layouts` into a model with other weights, and
    compare logits and one more step with two uninterrupted single-process steps."""
    from phalanx.booster.plugins import DDPPlugin
    from phalanx.checkpoint import TrainState

    out = {}
    for family in families:
        ref = reference(family, steps=2, kind="adamw")
        batches = hm.tokens(family, steps=2)
        path = f"{directory}/{family}"
        layout = DDPPlugin() if save_layout == "ddp" else save_layout
        booster, model, optimizer = boost(family, layout, kind="adamw")
        train_steps(booster, model, optimizer, batches[:1])
        booster.save_checkpoint(path, model, optimizer, train_state=TrainState(step=1))
        saved_logits = _logits(model, family)
        for name, load in load_layouts.items():
            booster, model, optimizer = boost(family, load, kind="adamw", seed=99)
            state = booster.load_checkpoint(path, model, optimizer)
            assert state.step == 1
            logits = _logits(model, family)
            losses = train_steps(booster, model, optimizer, batches[1:])
            params = booster.plugin.full_model_state_dict(model)
            out.setdefault(name, {})[family] = {
                "logits_vs_saved": rel_diff(logits, saved_logits),  # the same weights
                "loss": rel_diff(losses[0], ref["losses"][1]),
                "param": update_diff(params, ref["params"], ref["start"]),  # the two AdamW steps
            }
    return out


def resume_with_plugin(directory: str, plugin_name: str, families=("llama", "gpt2")) -> dict:
    """Load a hybrid checkpoint with another plugin (any world size) and take the second step."""
    from phalanx.booster.plugins import make_plugin

    out = {}
    for family in families:
        ref = reference(family, steps=2, kind="adamw")
        booster, model, optimizer = boost(family, make_plugin(plugin_name), kind="adamw", seed=99)
        booster.load_checkpoint(f"{directory}/{family}", model, optimizer)
        losses = train_steps(booster, model, optimizer, hm.tokens(family, steps=2)[1:])
        out[family] = rel_diff(losses[0], ref["losses"][1])
    return out


def lazy_suite(directory: str, families=("llama", "gpt2")) -> dict:
    """Lazy models under tp=2: from a saved checkpoint (only this rank's slices read) and from
    random initialisation (equal to the same lazy model materialised whole)."""
    from transformers import AutoModelForCausalLM

    from phalanx import lazy
    from phalanx.device import run_device
    from phalanx.shard import apply_tp, policy_for
    from phalanx.shard.state import full_state_dict

    out = {}
    for family in families:
        path = f"{directory}/{family}"
        eager = AutoModelForCausalLM.from_pretrained(path)
        want = _logits(eager, family)
        full_numel = sum(p.numel() for p in eager.parameters())
        # boosted from the checkpoint: logits and the size of what each rank holds
        booster, model, optimizer = boost(family, dict(tp_size=2, zero_stage=1), model=lazy.from_pretrained(path))
        local_numel = sum(p.numel() for p in model.unwrapped.parameters())
        result = {"logits": rel_diff(_logits(model, family), want), "local_fraction": local_numel / full_numel}
        # what apply_tp reads through the lazy source
        meta = lazy.from_pretrained(path)
        source = lazy.source_for(meta)
        apply_tp(meta, policy_for(meta), group=booster.plugin.tp_group, source=source)
        result["read_fraction"] = source.elements_read / full_numel
        # random initialisation: tp=2 pieces put together == one whole lazy materialisation (both on
        # the run's device: the gather is a collective, and the device draws its own random numbers)
        device = run_device()
        torch.manual_seed(5)
        split = lazy.from_config(hm.config(family))
        plan = apply_tp(split, policy_for(split), group=booster.plugin.tp_group,
                        source=lazy.source_for(split, device=device))
        lazy.materialise_buffers(split, lazy.source_for(split, device=device))
        gathered = full_state_dict(split, plan)
        torch.manual_seed(5)
        whole = lazy.materialize(lazy.from_config(hm.config(family)), device=device)
        whole_params = dict(whole.named_parameters())
        result["random_init"] = all(torch.equal(gathered[n].cpu(), p.cpu()) for n, p in whole_params.items())
        result["finite"] = all(bool(torch.isfinite(v).all()) for v in gathered.values())
        stds = [p.std().item() for n, p in whole.named_parameters() if p.dim() == 2]
        result["std_range"] = (min(stds), max(stds))
        out[family] = result
    return out


def _error(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def error_suite() -> dict:
    """Layouts that cannot work, on 2 ranks: each must stop with a clear message before any work
    (the returned flags say the model was not modified)."""
    import transformers as tf

    from phalanx.booster import Booster
    from phalanx.booster.plugins.hybrid import HybridParallelPlugin

    def boost_cfg(cfg, **layout):
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(cfg)
        before = [type(m) for m in model.modules()]
        try:
            boost("llama", layout, model=model)
        finally:
            untouched.append(before == [type(m) for m in model.modules()])

    def run(*args, **layout):
        booster, model, _ = boost("llama", layout)
        batch = torch.randint(0, 100, (2, 15))
        model(input_ids=batch, labels=batch)

    untouched: list[bool] = []
    out = {
        "world": _error(lambda: Booster(HybridParallelPlugin(tp_size=3))),
        "heads": _error(lambda: boost_cfg(tf.LlamaConfig(hidden_size=24, intermediate_size=48, num_hidden_layers=1,
                                                        num_attention_heads=3, num_key_value_heads=3, vocab_size=64),
                                          tp_size=2)),
        "kv_heads": _error(lambda: boost_cfg(tf.LlamaConfig(hidden_size=48, intermediate_size=48, num_hidden_layers=1,
                                                           num_attention_heads=6, num_key_value_heads=3, vocab_size=64),
                                             tp_size=2)),
        "mlp": _error(lambda: boost_cfg(tf.LlamaConfig(hidden_size=32, intermediate_size=63, num_hidden_layers=1,
                                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64),
                                        tp_size=2)),
        "ulysses_heads": _error(lambda: boost_cfg(tf.LlamaConfig(hidden_size=24, intermediate_size=48,
                                                                num_hidden_layers=1, num_attention_heads=3,
                                                                num_key_value_heads=3, vocab_size=64),
                                                  sp_size=2, sequence_parallelism="ulysses")),
        "family": _error(lambda: boost_cfg(tf.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                        intermediate_size=64, vocab_size=64, is_decoder=True),
                                           tp_size=2)),
        "split_gather_sp": _error(lambda: HybridParallelPlugin(sp_size=2, sequence_parallelism="split_gather")),
        "sp_without_mode": _error(lambda: HybridParallelPlugin(sp_size=2)),
        "seq_ring": _error(lambda: run(sp_size=2, sequence_parallelism="ring")),
        "seq_ulysses": _error(lambda: run(sp_size=2, sequence_parallelism="ulysses")),
        "seq_split_gather": _error(lambda: run(tp_size=2, sequence_parallelism="split_gather")),
        "padding_mask": _error(lambda: boost("llama", dict(sp_size=2, sequence_parallelism="ring"))[1](
            input_ids=torch.zeros(1, 8, dtype=torch.long), attention_mask=torch.tensor([[0] * 2 + [1] * 6]))),
    }
    out["untouched"] = untouched
    # generation: works under tensor parallelism (the LM head gathers the logits), refused clearly
    # under Ulysses/ring (each rank must run on its cut of the sequence)
    prompt = hm.tokens("llama", batch=2, seq=6)[0]
    want = hm.build("llama").generate(input_ids=prompt, max_new_tokens=5, do_sample=False)
    _, tp_model, _ = boost("llama", dict(tp_size=2))
    out["generate_tp2_equal"] = bool(torch.equal(tp_model.generate(input_ids=prompt, max_new_tokens=5,
                                                                   do_sample=False), want))
    _, sp_model, _ = boost("llama", dict(sp_size=2, sequence_parallelism="ulysses"))
    out["generate_ulysses"] = _error(lambda: sp_model.generate(input_ids=prompt, max_new_tokens=2, do_sample=False))
    return out


def check_low_precision(results: dict, expected: int) -> None:
    """Assert on `precision_suite`'s results: `expected` runs, compute and saved dtypes, losses and
    update within phalanx.testing.LOW_PRECISION_RTOL of the same recipe on one process."""
    assert len(results) == expected, sorted(results)
    for key, d in results.items():
        precision = key.split("/")[1]
        assert d["dtype"] == str(DTYPES[precision]), (key, d)
        assert d["saved_dtype"] == "torch.float32", (key, d)  # the fp32 masters are what is saved
        loss_tol, _, update_tol = LOW_PRECISION_RTOL[DTYPES[precision]]
        check(d["loss"], loss_tol, f"{key}: losses")
        check(d["update"], update_tol, f"{key}: weights")


def precision_suite(families=("llama", "gpt2"), layout: dict | None = None, layers: int = 2) -> dict:
    """bf16 and fp16 under `layout` (default tp=2 with ZeRO-2), two AdamW steps, against the same
    recipe on one process (`reference(precision=...)`): the losses, the update measure, the compute
    dtype and the dtype of the saved weights (compared on rank 0, where a pipelined model's state
    dict is complete)."""
    layout = layout or dict(tp_size=2, zero_stage=2)
    out = {}
    for family in families:
        for precision in ("bf16", "fp16"):
            ref = reference(family, steps=2, kind="adamw", layers=layers, precision=precision)
            booster, model, optimizer = boost(family, dict(layout, precision=precision), kind="adamw",
                                              layers=layers)
            losses = train_steps(booster, model, optimizer, hm.tokens(family, steps=2))
            state = booster.plugin.full_model_state_dict(model)
            if not all(n in state for n in ref["start"]):  # another pipeline rank's part: rank 0 has all
                continue
            out[f"{family}/{precision}"] = {
                "loss": rel_diff(losses, ref["losses"]),
                "update": update_diff(state, ref["params"], ref["start"]),
                "dtype": str(next(model.unwrapped.parameters()).dtype),
                "saved_dtype": str(state[next(iter(ref["start"]))].dtype),
            }
    return out


# ---------------------------------------------------------------------- the streamed save


def legacy_full_state_dict(booster, model) -> dict[str, torch.Tensor]:
    """The hybrid save before it streamed, kept as the reference the streamed export must equal bit
    for bit: the whole state gathered over tp on every rank (fp32 masters where the optimizer keeps
    them), with pp each stage's dict pickled to pipeline rank 0 (`gather_object`)."""
    from phalanx.booster.plugins.hybrid.boost import hybrid_state
    from phalanx.shard.optim import HybridZeroOptimizer
    from phalanx.shard.state import full_state_dict

    plugin = booster.plugin
    boosted = hybrid_state(model)
    hf = model.unwrapped
    optimizer = boosted.optimizer
    by_id = {}
    if isinstance(optimizer, HybridZeroOptimizer):
        by_id = optimizer.full_master_weights()
    elif optimizer is not None:
        by_id = {pid: m.detach() for pid, m in optimizer.master_of.items()}
    masters = {n: by_id[id(p)] for n, p in hf.named_parameters(remove_duplicate=False) if id(p) in by_id}
    state = full_state_dict(hf, boosted.plan, masters)
    if plugin.pp_size == 1:
        return state
    state = {boosted.tied_aliases.get(n, n): t for n, t in state.items()}
    if plugin.dp_rank or plugin.sp_rank or plugin.tp_rank:
        return state
    parts = [None] * plugin.pp_size if plugin.pp_rank == 0 else None
    dist.gather_object(state, parts, dst=dist.get_global_rank(plugin.pp_group, 0), group=plugin.pp_group)
    return {k: v for part in parts for k, v in part.items()} if parts else state


class ObjectCollectivesRefused(RuntimeError):
    pass


def _refuse_object_collectives():
    """Patch every torch.distributed call that pickles (the *_object* collectives and the helper
    they share) to raise; returns the undo function."""
    import torch.distributed.distributed_c10d as c10d

    names = ("gather_object", "all_gather_object", "broadcast_object_list", "scatter_object_list",
             "send_object_list", "recv_object_list")
    saved = [(mod, n, getattr(mod, n)) for mod in (dist, c10d) for n in names + ("_object_to_tensor",)
             if hasattr(mod, n)]

    def refuse(*args, **kwargs):
        raise ObjectCollectivesRefused("a pickled object crossed ranks during the model save")

    for mod, n, _ in saved:
        setattr(mod, n, refuse)

    def undo():
        for mod, n, original in saved:
            setattr(mod, n, original)
    return undo


def _bytes_in_files(pattern) -> int:
    """Tensor bytes in the writer's finished files (named *.safetensors.part until the end)."""
    from safetensors.torch import load_file

    return sum(t.numel() * t.element_size() for part in pattern() for t in load_file(part).values())


def watched_stream(stream, seen: dict, parts=None):
    """Walk the plugin's stream with object collectives refused while it computes each tensor, and
    count how many of the tensors it yielded earlier are still alive when it yields the next (the
    writer keeps only its own detached copies, so a stream that holds one tensor at a time leaves
    none alive; one that built a dict first leaves them all). With `parts` (the writer's finished
    files), also what the writer holds, counted from outside: bytes handed over minus bytes in
    its files."""
    import weakref

    refs = []
    handed = 0
    while True:
        undo = _refuse_object_collectives()
        try:
            item = next(stream)
        except StopIteration:
            return
        finally:
            undo()
        seen["alive_max"] = max(seen.get("alive_max", 0), sum(r() is not None for r in refs))
        seen["count"] = seen.get("count", 0) + 1
        seen.setdefault("names", []).append(item[0])
        seen["largest"] = max(seen.get("largest", 0), item[1].numel() * item[1].element_size())
        refs.append(weakref.ref(item[1]))
        if parts is not None:
            seen["held_max"] = max(seen.get("held_max", 0), handed - _bytes_in_files(parts))
            handed += item[1].numel() * item[1].element_size()
        yield item
        del item


def _differences(got: dict, want: dict, keys) -> list[str]:
    """Names whose tensors are not bit-identical (value and dtype), or missing."""
    return [k for k in keys if k not in got or k not in want or got[k].dtype != want[k].dtype
            or not torch.equal(got[k], want[k])]


SAVE_SHARD_BYTES = 4000  # the streamed-save tests' max_shard_size: many files for the tiny models


def stream_save_suite(directory: str, layouts: dict, families=("llama", "gpt2")) -> dict:
    """For each save layout and family: one AdamW step, the legacy gathered state dict, then
    `Booster.save_model` streamed with no pickle allowed while the model is gathered and the
    stream watched on the writer; the export against the legacy dict (bit for bit), the new
    `full_model_state_dict` against it on every rank, `from_pretrained` of the export, and the
    export loaded into another layout (`layouts[name]["load_into"]`) and gathered back; models of
    `layouts[name].get("layers", 2)` decoder layers."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from phalanx.checkpoint.hf import _alias_names, load_hf_state_dict

    rank = dist.get_rank()
    out: dict = {}
    for name, spec in layouts.items():
        save_layout, load_layout = dict(spec["save"]), dict(spec["load_into"])
        layers = spec.get("layers", 2)
        for family in families:
            booster, model, optimizer = boost(family, save_layout, kind="adamw", layers=layers)
            train_steps(booster, model, optimizer, hm.tokens(family, steps=1))
            legacy = legacy_full_state_dict(booster, model)
            new = booster.plugin.full_model_state_dict(model)
            plugin = booster.plugin
            seen: dict = {}
            original = plugin.iter_full_model_state
            # every rank: no pickle while the stream computes a tensor; the writer also watches it
            parent = Path(directory) / name
            parts = (lambda: parent.glob(f"{family}.tmp-*/*.safetensors.part")) if rank == 0 else None
            plugin.iter_full_model_state = lambda m: watched_stream(original(m), seen, parts)
            path = f"{directory}/{name}/{family}"
            booster.save_model(model, path, max_shard_size=SAVE_SHARD_BYTES)
            plugin.iter_full_model_state = original
            r = {"new_vs_legacy": _differences(new, legacy, set(new) | set(legacy))}
            if rank == 0:
                export = load_hf_state_dict(path)
                reference = hm.build(family, layers=layers)
                aliases = _alias_names(reference)
                want_keys = set(reference.state_dict()) - aliases
                r["tensors"] = len(want_keys)
                r["in_model_order"] = seen["names"] == [k for k in reference.state_dict() if k not in aliases]
                r["export_keys_missing"] = sorted(want_keys - set(export))
                r["export_keys_extra"] = sorted(set(export) - want_keys)
                r["export_vs_legacy"] = _differences(export, legacy, sorted(export))
                r["stream"] = seen
                r["files"] = len(list(Path(path).glob("*.safetensors")))
                loaded = AutoModelForCausalLM.from_pretrained(path)
                loaded_state = loaded.state_dict()
                r["from_pretrained_vs_export"] = _differences(loaded_state, export, sorted(export))
                tied = getattr(reference.config, "tie_word_embeddings", False)
                r["tied_on_load"] = (not tied) or loaded.get_output_embeddings().weight is \
                    loaded.get_input_embeddings().weight
            # any layout loads any other: the export into another layout, gathered back
            booster2, model2, _ = boost(family, load_layout, kind="adamw", seed=99, layers=layers)
            booster2.load_model(model2, path)
            back = booster2.plugin.full_model_state_dict(model2)
            if rank == 0:
                r["reloaded_vs_export"] = _differences(back, export, sorted(export))
            out.setdefault(name, {})[family] = r
            dist.barrier()
    return out


def mid_sized_llama(hidden: int = 256, layers: int = 8, vocab: int = 1024):
    """The memory tests' Llama of many mid-sized tensors (defaults: 6.3M parameters, 24.1 MiB in
    fp32, the largest tensors 1 MiB), seeded alike on every rank, and its tensors' fp32 bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=688, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    return model, [p.numel() * 4 for p in model.parameters()]


def save_peak_suite(directory: str, layout: dict, hidden: int = 256, layers: int = 8, vocab: int = 1024,
                    shard_bytes: int = 2**20) -> dict:
    """The resident memory the hybrid save adds at its peak on each rank (`peak_memory`: the
    kernel's high-water mark, so no transient is missed), for a Llama of many mid-sized tensors
    (8 layers of hidden 256: 6.3M parameters, 24.1 MiB in fp32, the largest tensors 1 MiB):
    `Booster.save_model` streamed with 1 MiB files, and the gather the old save began with
    (`legacy_full_state_dict`, before any file was written). None where it cannot be measured."""
    import peak_memory

    if not peak_memory.available():
        return None
    model, sizes = mid_sized_llama(hidden, layers, vocab)
    booster, model, _ = boost("llama", layout, model=model, kind="adamw")
    out = {"model": sum(sizes), "largest": max(sizes), "shard": shard_bytes}
    dist.barrier()
    out["streamed"] = peak_memory.peak_added(
        lambda: booster.save_model(model, f"{directory}/streamed", max_shard_size=shard_bytes))
    dist.barrier()
    out["legacy_gather"] = peak_memory.peak_added(lambda: legacy_full_state_dict(booster, model))
    return out
