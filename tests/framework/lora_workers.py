"""Rank bodies and the one-process reference for tests/framework/test_lora.py (importable by spawned ranks).

The model: the tiny LLaMA of phalanx.testing with LoRA (r=4) on q_proj, v_proj and down_proj; B
starts at zero (peft's default), A from a fixed seed, so every run starts from the same adapters.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import plugin_cases as cases
from phalanx.testing import boosted_step, tiny_llama

TARGETS = ["q_proj", "v_proj", "down_proj"]
LORA_R, LORA_ALPHA = 4, 8
PROBE = torch.arange(2 * cases.SEQ).remainder(128).view(2, cases.SEQ)  # the batch saved models are scored on


EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # Mixtral's fused expert tensors
# DeepSeek (deepseek_workers' tiny random configs: "v3" q_lora_rank 24, sigmoid group routing, one shared
# expert; "v2" V2-Lite's q_proj, biases, group-limited greedy routing, two shared experts; 8 routed
# experts, the first layer dense): every multi-head latent attention projection, the routed experts
# and the shared experts. The shared experts go through target_parameters (their `.weight`): peft
# 0.21 rewrites any target_modules entry named gate_proj / up_proj / down_proj on a model that
# transformers 5 fused (DeepSeek, Qwen2-MoE) into the routed experts' fused tensors (its v4 -> v5
# conversion), so `shared_experts.gate_proj` would silently adapt the routed experts instead.
DEEPSEEK = {"deepseek_v3": "v3", "deepseek_v2": "v2"}
MLA_TARGETS = {"deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
               "deepseek_v2": ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]}
SHARED_EXPERT_TARGETS = [f"mlp.shared_experts.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]


MOE_FAMILIES = ("mixtral", "qwen2_moe", *DEEPSEEK)


def num_experts(family: str) -> int:
    """Routed experts per block of `base_model(family)`."""
    return 8 if family in DEEPSEEK else 4


def lora_config(family: str = "llama", random_b: bool = False):
    """LoRA on q/v/down_proj; for the mixture-of-experts models on q/v_proj and on every expert's
    weights (peft's target_parameters: per-expert A and B in one tensor each); for DeepSeek on its
    MLA projections, routed and shared experts (`MLA_TARGETS`, `SHARED_EXPERT_TARGETS`). `random_b`: B drawn
    at random too (peft's init_lora_weights=False), so a mix-up of B's expert columns shows."""
    import peft
    if family in DEEPSEEK:
        return peft.LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=MLA_TARGETS[family],
                               target_parameters=EXPERT_TARGETS + SHARED_EXPERT_TARGETS, init_lora_weights=not random_b)
    if family in MOE_FAMILIES:
        return peft.LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                               target_parameters=EXPERT_TARGETS, init_lora_weights=not random_b)
    return peft.LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=TARGETS)


def base_model(family: str = "llama"):
    """The tiny LLaMA, or a tiny Mixtral of the same widths (4 experts, top-2), or a tiny Qwen2-MoE
    (4 routed experts, top-2, and a shared expert), or a tiny DeepSeek-V3 / V2 (`DEEPSEEK`), seed 0.
    The MoE models run transformers' eager experts (its grouped kernel counts tokens with an
    integer histc on CUDA, which the emulated GPU cannot run)."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    if family in DEEPSEEK:
        import deepseek_workers

        return deepseek_workers.build(DEEPSEEK[family])  # seed 0, eager experts
    if family == "mixtral":
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(
            MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                          max_position_embeddings=64, tie_word_embeddings=False), experts_implementation="eager")
    if family == "qwen2_moe":
        import moe_models

        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(moe_models.moe_config(
            "qwen2_moe", vocab_size=128, hidden_size=32, moe_intermediate_size=64, shared_expert_intermediate_size=48,
            num_attention_heads=4, num_key_value_heads=2, initializer_range=0.02, max_position_embeddings=64),
            experts_implementation="eager")
    return tiny_llama(seed=0)


def lora_model(enable=None, family: str = "llama", random_b: bool = False):
    """The tiny model with adapters, the same on every rank; `enable`: Booster.enable_lora or
    (default) peft.get_peft_model."""
    import peft

    model = base_model(family)
    torch.manual_seed(1)  # the adapters' A matrices
    return (enable or peft.get_peft_model)(model, lora_config(family, random_b))


def initial_adapter_state(family: str = "llama", random_b: bool = False) -> dict[str, torch.Tensor]:
    model = lora_model(family=family, random_b=random_b)
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def single_process_reference(steps: int = cases.STEPS, family: str = "llama", random_b: bool = False):
    """Plain peft + torch on one process over whole batches: (losses, adapter state, the trained
    model)."""
    model = lora_model(family=family, random_b=random_b)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cases.LR, weight_decay=0.01)
    losses = []
    for batch in cases.make_batches(steps):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return losses, state, model


def reference_grad_norms(family: str, random_b: bool = False, steps: int = cases.STEPS) -> list[float]:
    """`single_process_reference`'s steps again: the adapters' global gradient norm before each
    step (AdamW hides a wrong gradient scale from the losses and updates; the norm shows it)."""
    model = lora_model(family=family, random_b=random_b)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cases.LR, weight_decay=0.01)
    norms = []
    for batch in cases.make_batches(steps):
        model(input_ids=batch, labels=batch).loss.backward()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in params]).item())
        opt.step()
        opt.zero_grad()
    return norms


def _state_numel(optimizer) -> int | None:
    """Elements of this rank's optimizer state (AdamW's exp_avg), local shards only (None for
    Gemini, whose state lives in its chunks)."""
    if not optimizer.optim.state:
        return None
    total = 0
    for state in optimizer.optim.state.values():
        avg = state["exp_avg"]
        total += (avg.to_local() if hasattr(avg, "to_local") else avg).numel()
    return total


def _train(booster, model, opt, steps: int) -> list[float]:
    return _train_batches(booster, model, opt, cases.make_batches(steps))


def _train_batches(booster, model, opt, batches) -> list[float]:
    """Each rank its share of each global batch; returns the global mean losses."""
    from phalanx.device import run_device, to_device

    group = getattr(booster.plugin, "dp_sp_group", None)  # hybrid: tensor-parallel peers share a batch
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    losses = []
    for batch in batches:
        loss = boosted_step(booster, model, opt, to_device(batch.chunk(world)[rank], run_device()))
        reduced = loss.detach().clone().float()
        dist.all_reduce(reduced, group=group)
        losses.append(reduced.item() / world)
    return losses


def run_lora(name: str, directory: str, steps: int = cases.STEPS, family: str = "llama", random_b: bool = False,
             **plugin_kwargs) -> dict:
    """Train the LoRA model with plugin `name` (the optimizer is built on *all* parameters: boost
    must drop the frozen ones), then save the adapter and the merged model under `directory`
    (expert adapters do not merge: the refusal's message is returned instead)."""
    from phalanx.booster import Booster
    from phalanx.booster.plugins import make_plugin

    booster = Booster(plugin=make_plugin(name, **plugin_kwargs))
    model = lora_model(booster.enable_lora, family, random_b)
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW(model.parameters(), lr=cases.LR, weight_decay=0.01)
    model, opt, *_ = booster.boost(model, opt)
    in_optimizer = sum(len(g["params"]) for g in opt.param_groups)
    zero_params = None
    from phalanx.zero.optimizer import ZeroOptimizer
    if isinstance(opt, ZeroOptimizer):  # what its flat partitions hold
        names = {id(p): n for n, p in booster.unwrap(model).named_parameters()}
        zero_params = sorted(names[id(p)] for p in opt.model_params())
    manager = getattr(booster.plugin, "manager", None)  # Gemini: what its chunks hold
    chunked = sorted(n for c in manager.chunks for n in c.names) if manager is not None else None
    losses = _train(booster, model, opt, steps)
    full = {k: v.cpu() for k, v in booster.plugin.full_model_state_dict(model).items()}
    booster.save_lora_as_pretrained(model, f"{directory}/adapter")
    merge_refused = None
    try:
        booster.save_lora_as_pretrained(model, f"{directory}/merged", merge=True)
    except ValueError as exc:
        merge_refused = str(exc)
    if any(n not in full for n in frozen_before):  # pipeline stages: the full model is gathered on the writer only
        return {"losses": losses, "complete": False, "merge_refused": merge_refused}
    frozen_moved = max((full[n].float() - v.float()).abs().max().item() for n, v in frozen_before.items())
    return {"losses": losses, "adapters": {n: full[n] for n in adapters}, "frozen_moved": frozen_moved,
            "state_numel": _state_numel(opt), "in_optimizer": in_optimizer, "zero_params": zero_params, "chunked": chunked,
            "adapter_names": sorted(adapters), "merge_refused": merge_refused}


def run_lora_ep(directory: str, family: str, random_b: bool = False, **plugin_kwargs) -> dict:
    """`run_lora` under HybridParallelPlugin(ep_size=..., **plugin_kwargs), and what the EP split
    left on this rank: its EP index, each expert adapter's local tensor before training (against
    the full initial adapters' rows of this rank's experts), the routers found, the trainable
    names, the names of the parameters the optimizer(s) hold (the experts' twin under ZeRO
    included) and the global gradient norm of every step."""
    from phalanx.booster import Booster

    captured = {}
    real_boost = Booster.boost

    def boost(self, model, optimizer=None, *args, **kwargs):  # what the split left, before any step
        out = real_boost(self, model, optimizer, *args, **kwargs)
        plan = self.plugin.ep_plan
        hf = self.unwrap(out[0])
        params = dict(hf.named_parameters())
        names = {id(p): n for n, p in params.items()}

        def model_params(optimizer):  # the model parameters it updates (ZeRO: a method; else a list)
            held = optimizer.model_params
            return list(held() if callable(held) else held)

        twin = getattr(out[1], "experts", None)  # ZeRO under EP: the experts' optimizer
        held = model_params(out[1]) + (model_params(twin) if twin is not None else [])
        norms, step = [], out[1].step

        def recording_step(*a, **k):  # the global gradient norm of every step (a gradient-scale check)
            step(*a, **k)
            norms.append(out[1].last_grad_norm)
        out[1].step = recording_step
        captured.update(grad_norms=norms, ep_rank=plan.groups.ep_rank, routers=sorted(plan.routers),
                        local_adapters={n: params[n].detach().cpu().clone() for n in plan.adapters},
                        trainable=sorted(n for n, p in params.items() if p.requires_grad),
                        in_optimizer=sorted(names[id(p)] for p in held if id(p) in names),
                        expert_adapters=sorted(plan.adapters))
        return out

    Booster.boost = boost
    try:
        got = run_lora("hybrid", directory, family=family, random_b=random_b, **plugin_kwargs)
    finally:
        Booster.boost = real_boost
    return {**got, **captured}


def ep_split_only(family: str, random_b: bool = True, **plugin_kwargs) -> dict:
    """Boost the LoRA `family` model under HybridParallelPlugin(**plugin_kwargs) (no step): this
    rank's EP index and the local tensor of every expert adapter the split cut."""
    from phalanx.booster import Booster
    from phalanx.booster.plugins import make_plugin

    booster = Booster(plugin=make_plugin("hybrid", **plugin_kwargs))
    model = lora_model(booster.enable_lora, family, random_b)
    model, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=cases.LR))
    plan = booster.plugin.ep_plan
    params = dict(booster.unwrap(model).named_parameters())
    return {"ep_rank": plan.groups.ep_rank, "local": {n: params[n].detach().cpu().clone() for n in plan.adapters}}


def lora_split_pieces(name: str, **plugin_kwargs) -> dict:
    """Boost the LoRA model under HybridParallelPlugin (`plugin_kwargs`: tp_size, ...): the local
    shapes of one column-parallel and one row-parallel adapter pair, and which adapters have
    partial gradients in the plan."""
    from phalanx.booster import Booster
    from phalanx.booster.plugins import make_plugin
    from phalanx.booster.plugins.hybrid.boost import hybrid_state

    booster = Booster(plugin=make_plugin(name, **plugin_kwargs))
    model = lora_model(booster.enable_lora)
    model, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=cases.LR))
    hf = booster.unwrap(model)
    plan = hybrid_state(model).plan
    shapes = {n: tuple(p.shape) for n, p in hf.named_parameters() if ".layers.0." in n and "lora_" in n}
    partial = sorted(n for n, p in hf.named_parameters() if "lora_" in n and plan.spec(n).partial_grad)
    return {"shapes": shapes, "partial": partial}


def resume_lora(name: str, directory: str, first: int = 3, steps: int = cases.STEPS) -> dict:
    """`first` steps, save_checkpoint, then a new booster and a LoRA model from another seed load
    it and train to `steps`: the losses of the resumed steps, and those of one straight run."""
    from phalanx.booster import Booster
    from phalanx.booster.plugins import make_plugin

    def boosted(seed: int):
        booster = Booster(plugin=make_plugin(name))
        model = tiny_llama(seed=seed)
        torch.manual_seed(seed + 1)
        model = booster.enable_lora(model, lora_config())
        opt = torch.optim.AdamW(model.parameters(), lr=cases.LR, weight_decay=0.01)
        return (booster, *booster.boost(model, opt)[:2])

    booster, model, opt = boosted(0)
    straight = _train(booster, model, opt, steps)
    booster, model, opt = boosted(0)
    _train(booster, model, opt, first)
    booster.save_checkpoint(directory, model, opt)
    booster, model, opt = boosted(7)  # everything must come from the checkpoint
    booster.load_checkpoint(directory, model, opt)
    resumed = _train_batches(booster, model, opt, cases.make_batches(steps)[first:])
    return {"straight": straight[first:], "resumed": resumed}


def adapters_after_unequal_seeds() -> dict[str, torch.Tensor]:
    """enable_lora on ranks whose random streams differ (as after `fit` seeds each rank for its
    dropout): the initial adapters each rank ends up with."""
    from phalanx.booster import Booster

    booster = Booster(plugin=None)
    model = tiny_llama(seed=0)
    torch.manual_seed(1 + dist.get_rank())
    model = booster.enable_lora(model, lora_config())
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def lazy_lora_model(checkpoint: str, enable=None):
    """The tiny LLaMA read lazily (meta device) from `checkpoint` (tiny_llama(seed=0) saved), with
    the adapters of `lora_model` (seed 1): only the adapters are real until the plugin boosts it."""
    from phalanx import lazy

    model = lazy.from_pretrained(checkpoint)
    torch.manual_seed(1)
    return (enable or __import__("phalanx.booster.lora", fromlist=["enable_lora"]).enable_lora)(model, lora_config())


def run_lazy_lora(name: str, checkpoint: str, steps: int = cases.STEPS, **plugin_kwargs) -> dict:
    """LoRA on a lazy base under plugin `name`: the losses, the trained adapters, how far the base
    is from the checkpoint after training, and how many base elements this rank read from it."""
    from phalanx.booster import Booster
    from phalanx.booster.plugins import make_plugin
    from phalanx.lazy import sources

    read: list = []
    init = sources.CheckpointSource.__init__

    def counting_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        read.append(self)

    sources.CheckpointSource.__init__ = counting_init
    try:
        booster = Booster(plugin=make_plugin(name, **plugin_kwargs))
        model = lazy_lora_model(checkpoint, booster.enable_lora)
        meta_before = sum(p.is_meta for p in model.parameters())
        adapters = {n for n, p in model.named_parameters() if p.requires_grad}
        opt = torch.optim.AdamW(model.parameters(), lr=cases.LR, weight_decay=0.01)
        model, opt, *_ = booster.boost(model, opt)
    finally:
        sources.CheckpointSource.__init__ = init
    losses = _train(booster, model, opt, steps)
    full = {k: v.cpu() for k, v in booster.plugin.full_model_state_dict(model).items()}
    base = {n: p for n, p in base_model().named_parameters()}
    frozen = {n: full[n] for n in full if n not in adapters}
    frozen_moved = max((v.float() - base[n.replace("base_model.model.", "").replace(".base_layer.", ".")].float())
                       .abs().max().item() for n, v in frozen.items())
    return {"losses": losses, "adapters": {n: full[n] for n in adapters}, "frozen_moved": frozen_moved,
            "elements_read": sum(s.elements_read for s in read), "meta_before": meta_before}


def resume_lora_ep(directory: str, family: str, save_layout: tuple[str, dict],
                   load_layouts: dict[str, tuple[str, dict]], first: int = 3, steps: int = cases.STEPS) -> dict:
    """LoRA with B drawn at random: `first` AdamW steps under `save_layout` (plugin name, options),
    save_checkpoint (model and optimizer, expert adapters in full coordinates), then for each of
    `load_layouts` a new booster and adapters from another seed load it and train to `steps`: the
    resumed steps' losses and the full adapters at the end (every tensor on every rank)."""
    from phalanx.booster import Booster
    from phalanx.booster.plugins import make_plugin

    def boosted(layout, seed: int):
        name, options = layout
        booster = Booster(plugin=make_plugin(name, **options))
        model = base_model(family)
        torch.manual_seed(seed)
        model = booster.enable_lora(model, lora_config(family, random_b=True))
        opt = torch.optim.AdamW(model.parameters(), lr=cases.LR, weight_decay=0.01)
        return (booster, *booster.boost(model, opt)[:2])

    booster, model, opt = boosted(save_layout, 1)
    _train(booster, model, opt, first)
    booster.save_checkpoint(directory, model, opt)
    out = {}
    for name, layout in load_layouts.items():
        booster, model, opt = boosted(layout, 7)  # everything must come from the checkpoint
        adapters = {n for n, p in booster.unwrap(model).named_parameters() if p.requires_grad}
        booster.load_checkpoint(directory, model, opt)
        losses = _train_batches(booster, model, opt, cases.make_batches(steps)[first:])
        full = booster.plugin.full_model_state_dict(model)
        out[name] = {"losses": losses, "adapters": {n: full[n].cpu() for n in adapters if n in full}}
    return out


FP16_LR = 0.5
FP16_PROBED = "base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.default.weight"  # an expert adapter


def fp16_overflow_runs(layouts: dict[str, tuple[str, dict]], overflow_step: int = 1, overflow_rank: int = 1,
                       steps: int = 4) -> dict:
    """fp16 LoRA Mixtral under each (plugin, options): in step `overflow_step` rank `overflow_rank`
    alone gets a non-finite gradient in one expert adapter (FP16_PROBED; under EP an adapter of that
    rank's experts only). Per layout: the losses, whether each step was skipped (the dense and, under
    EP with ZeRO, the experts' optimizer), the loss scale after each step, and the full adapters
    (SGD, FP16_LR)."""
    from phalanx.booster import Booster
    from phalanx.booster.plugins import make_plugin

    out = {}
    for name, (plugin, options) in layouts.items():
        booster = Booster(plugin=make_plugin(plugin, precision="fp16", **options))
        model = lora_model(booster.enable_lora, "mixtral")
        # SGD: an update proportional to the unscaled gradient (AdamW's would hide a wrong scale)
        opt = torch.optim.SGD(model.parameters(), lr=FP16_LR)
        model, opt, *_ = booster.boost(model, opt)
        params = dict(booster.unwrap(model).named_parameters())
        adapters = [n for n, p in params.items() if p.requires_grad]
        step = {"now": 0}

        def poison(g):
            return g * float("inf") if step["now"] == overflow_step and dist.get_rank() == overflow_rank else g
        params[FP16_PROBED].register_hook(poison)
        losses, skipped, scales = [], [], []
        for i, batch in enumerate(cases.make_batches(steps)):
            step["now"] = i
            losses += _train_batches(booster, model, opt, [batch])
            twin = getattr(opt, "experts", None)
            skipped.append((bool(opt.skipped), None if twin is None else bool(twin.skipped)))
            scales.append(opt.scaler.scale)
        full = booster.plugin.full_model_state_dict(model)
        out[name] = {"losses": losses, "skipped": skipped, "scales": scales,
                     "adapters": {n: full[n].float().cpu() for n in adapters}}
    return out
