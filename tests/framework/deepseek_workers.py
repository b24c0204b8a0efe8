"""Tiny random DeepSeek-V2 / V3 configs, and what tests/framework/test_deepseek_family.py and
test_deepseek_losses.py run on each rank: two SGD steps under HybridParallelPlugin (tp2: multi-head
latent attention split by heads, dense MLPs and shared experts split; ep2: the routed experts split;
ep2 x tp2 and ep2 x pp2 on 4 ranks), optionally with DeepSeek's balance loss
(`aux_loss`: config.output_router_logits=True and aux_loss_alpha), against the same steps in one
process on the whole batch; the model saved from the layout, loaded by transformers'
`from_pretrained` and into another layout. Nothing downloads."""
from __future__ import annotations

import torch
import torch.distributed as dist

from expert_parallel_plugin_workers import compare_loaded_logits, compare_saved_state
from phalanx.device import run_device, to_device
from phalanx.testing import boosted_step, rel_diff

LR, STEPS, ROWS, SEQ = 0.1, 2, 8, 16  # the global batch: 8 rows of 16 tokens
VOCAB, EXPERTS = 128, 8


def deepseek_config(version: int, **overrides):
    """V3: q_lora_rank 24, sigmoid routing over 4 groups (top-2 groups, top-2 experts), one shared
    expert, the first layer dense. V2: V2-Lite's shape (no q_lora_rank), two shared experts, greedy
    softmax routing. Both: 3 layers, hidden 32, 4 heads (qk 8 + 4 rope, v 8), kv_lora_rank 16,
    8 routed experts of width 16."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=EXPERTS,
                  num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, qk_nope_head_dim=8,
                  qk_rope_head_dim=4, v_head_dim=8, max_position_embeddings=64, initializer_range=0.1,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  attn_implementation="sdpa")
    if version == 3:
        return DeepseekV3Config(**{**common, "q_lora_rank": 24, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
                                   "routed_scaling_factor": 2.5, "norm_topk_prob": True, **overrides})
    return DeepseekV2Config(**{**common, "q_lora_rank": None, "n_shared_experts": 2, **overrides})


# the variants the equivalence tests train: V2 with the biases and group-limited routing
VARIANTS = {
    "v3": (3, {}),
    "v2": (2, dict(attention_bias=True, mlp_bias=True, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                   routed_scaling_factor=1.5)),
}


def build(variant: str, aux_loss: float = 0.0, **extra):
    """`aux_loss`: DeepSeek's balance loss coefficient (config.aux_loss_alpha, with
    output_router_logits=True); `extra`: config overrides over the variant's."""
    from transformers import AutoModelForCausalLM

    version, overrides = VARIANTS[variant]
    if aux_loss:
        extra = {"output_router_logits": True, "aux_loss_alpha": aux_loss, **extra}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(deepseek_config(version, **{**overrides, **extra}),
                                             experts_implementation="eager").float()
    with torch.no_grad():  # V3's correction bias (zeros at init) set, so that it steers the routing
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(7)) * 0.05)
    return model


def batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(5, VOCAB, (ROWS, SEQ), generator=gen) for _ in range(STEPS + 1)]  # the last: evaluation


def _balancer(model, balance: float):
    from phalanx.models.deepseek import BiasBalancer
    return BiasBalancer.attach(model, rate=balance) if balance else None


def _biases(model) -> dict[str, torch.Tensor]:
    """{layers.<i>.mlp.gate.e_score_correction_bias: value} (names from the layer list on: a boosted
    model wraps the HF one)."""
    return {n[n.index("layers."):]: b.detach().cpu().clone() for n, b in model.named_buffers()
            if n.endswith("e_score_correction_bias")}


def _biases_of(state: dict) -> dict[str, torch.Tensor]:
    return {n[n.index("layers."):]: b.cpu() for n, b in state.items() if n.endswith("e_score_correction_bias")}


def reference(variant: str, balance: float = 0.0, aux_loss: float = 0.0, **extra) -> dict:
    """One process, the whole batch: losses, gradient norms, weights before / after, logits of
    a fresh batch after the steps, V3's correction biases after the balancer's updates. With
    `aux_loss`, the loss adds DeepSeek's balance loss of this process's batch (BalanceLoss,
    reduce=False: every rank computes this reference on its own)."""
    from phalanx.models.deepseek import BalanceLoss

    model = build(variant, aux_loss, **extra)
    balancer = _balancer(model, balance)
    balance_loss = BalanceLoss.attach(model) if aux_loss else None
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms, data = [], [], batches()
    for batch in data[:STEPS]:
        loss = model(input_ids=batch, labels=batch).loss
        if balance_loss is not None:
            loss = loss + balance_loss.loss(reduce=False)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())
        opt.step()
        opt.zero_grad()
        if balancer:
            balancer.step(reduce=False)  # this process's whole batch
        losses.append(loss.item())
    with torch.no_grad():
        logits = model(input_ids=data[-1]).logits
    return {"losses": losses, "norms": norms, "start": start, "logits": logits, "biases": _biases(model),
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _boost(variant: str, layout: dict, aux_loss: float = 0.0, **extra):
    from phalanx.booster import Booster
    from phalanx.booster.plugins.hybrid import HybridParallelPlugin

    plugin = HybridParallelPlugin(**layout)
    booster = Booster(plugin)
    model = build(variant, aux_loss, **extra)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, *_ = booster.boost(model, optimizer)
    return booster, plugin, model, optimizer


def layout_steps(variant: str, layouts: dict[str, dict], balance: float = 0.0, save: str | None = None,
                 aux_loss: float = 0.0, **extra) -> dict:
    """{layout name: differences to one process}. `balance`: V3's bias update rate (BiasBalancer,
    loads summed over the data-parallel group); `save`: a directory where the first layout's
    model is written after its steps (booster.save_model, Hugging Face layout); `aux_loss`:
    DeepSeek's balance loss coefficient (the plugin adds the loss); `extra`: config overrides."""
    ref = reference(variant, balance, aux_loss, **extra)
    out = {}
    for i, (name, layout) in enumerate(layouts.items()):
        booster, plugin, model, optimizer = _boost(variant, layout, aux_loss, **extra)
        balancer = _balancer(model, balance)
        per = ROWS // plugin.dp_size
        losses, norms = [], []
        for batch in batches()[:STEPS]:
            loss = boosted_step(booster, model, optimizer,
                                to_device(batch[plugin.dp_rank * per:(plugin.dp_rank + 1) * per], run_device()))
            if balancer:
                balancer.step(group=plugin.dp_group)
            total = loss.detach().reshape(1).clone()
            dist.all_reduce(total, group=plugin.dp_group)  # the global batch's loss: the mean over dp
            losses.append(total.item() / plugin.dp_size)
            norms.append(optimizer.last_grad_norm)
        state = plugin.full_model_state_dict(model)
        if save is not None and i == 0:
            booster.save_model(model, save)
        ep = getattr(plugin, "ep_plan", None)
        biases = _biases(model)  # this rank's routers (under pp: its stages', named by stage)
        got = {"losses": rel_diff(losses, ref["losses"]), "norms": rel_diff(norms, ref["norms"]),
               "local_experts": sorted({tuple(m.gate_up_proj.shape) for m in ep.experts.values()}) if ep else None,
               "biases": rel_diff(biases, ref["biases"]) if balance and plugin.pp_size == 1 else None,
               "bias_names": sorted(biases)}
        if dist.get_rank() == 0:  # the writer holds every tensor
            got.update(compare_saved_state(state, ref))
            if balance:  # every correction bias, gathered over the stages
                got["saved_biases"] = rel_diff(_biases_of(state), ref["biases"])
        out[name] = got
    return out


def load_elsewhere(variant: str, path: str, layout: dict, balance: float = 0.0) -> dict:
    """The model saved by `layout_steps` loaded into `layout` (booster.load_model) and, on rank 0,
    by transformers' from_pretrained: logits of the evaluation batch against the one-process
    model after its steps (`balance`: as the saving run; its correction biases are in the file)."""
    ref = reference(variant, balance)
    booster, plugin, model, _ = _boost(variant, layout)
    booster.load_model(model, path)
    data = batches()[-1]
    with torch.no_grad():
        logits = model(input_ids=to_device(data, run_device())).logits.cpu()
    return compare_loaded_logits(logits, data, path, ref)


# ---------------------------------------------------------------------------- DeepSeek's balance losses
LOSS_FORMS = {"v2-batch": ("v2", None), "v2-sequence": ("v2", True), "v3-sequence": ("v3", None),
              "v3-batch": ("v3", False)}  # (variant, config.seq_aux): the families' defaults and the other form


def uneven_ranks(alpha: float) -> dict:
    """2 ranks: rank 0 runs 3 padded sequences, rank 1 the 4th; each rank's BalanceLoss over the
    world (the per-rank form) and its gradients (router weights, embedding), averaged over the
    ranks, against one process on all 4 rows (reduce=False), for every form."""
    from phalanx.models.deepseek import BalanceLoss

    device = run_device()
    ids = torch.randint(5, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(4, SEQ, dtype=torch.long)
    mask[1, 10:], mask[2, 3:], mask[3, 7:] = 0, 0, 0
    rows = slice(0, 3) if dist.get_rank() == 0 else slice(3, 4)
    out = {}
    for form, (variant, seq_aux) in LOSS_FORMS.items():
        extra = {} if seq_aux is None else {"seq_aux": seq_aux}
        results = []
        for local, reduce in ((rows, True), (slice(0, 4), False)):
            model = build(variant, alpha, **extra).to(device)
            loss_fn = BalanceLoss.attach(model)
            m = to_device(mask[local], device)
            model(input_ids=to_device(ids[local], device), attention_mask=m)
            loss = loss_fn.loss(m, reduce=reduce)
            weights = {n: p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight") or "embed" in n}
            grads = dict(zip(weights, torch.autograd.grad(loss, list(weights.values())), strict=True))
            if reduce:  # what data parallelism does: the mean over ranks
                flat = torch.cat([loss.detach().reshape(1)] + [g.reshape(-1) for g in grads.values()])
                dist.all_reduce(flat)
                flat /= dist.get_world_size()
                loss = flat[0]
                grads = dict(zip(grads, flat[1:].split([g.numel() for g in grads.values()]), strict=True))
                grads = {n: g.view_as(weights[n]) for n, g in grads.items()}
            results.append((loss.detach().cpu(), {n: g.cpu() for n, g in grads.items()}))
        (got_loss, got_grads), (want_loss, want_grads) = results
        out[form] = {"loss": rel_diff(got_loss, want_loss), "grads": rel_diff(got_grads, want_grads)}
    return out


def balance_refusals() -> dict[str, str]:
    """The errors boost raises for layouts and configs that cannot add DeepSeek's balance loss."""
    from phalanx.booster import Booster
    from phalanx.booster.plugins.hybrid import HybridParallelPlugin

    cases = {"no alpha, ep2": ({"ep_size": 2}, False), "no alpha, dp2": ({}, False),
             "pp2": ({"pp_size": 2, "num_microbatches": 2}, True),
             "tp2 split-gather": ({"tp_size": 2, "sequence_parallelism": "split_gather"}, True)}
    out = {}
    for name, (layout, alpha) in cases.items():
        model = build("v3", 1e-4 if alpha else 0.0)
        model.config.output_router_logits = True
        try:
            Booster(HybridParallelPlugin(**layout)).boost(model, torch.optim.SGD(model.parameters(), lr=LR))
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    return out
