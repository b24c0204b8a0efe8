"""Tiny random DeepSeek-V2 / V3 configs, and what tests/framework/test_deepseek_family.py runs on each
rank: two SGD steps under HybridParallelPlugin (tp2: multi-head latent attention split by heads,
dense MLPs and shared experts split; ep2: the routed experts split) against the same steps in
one process on the whole batch; the model saved from the layout, loaded by transformers'
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


def build(variant: str):
    from transformers import AutoModelForCausalLM

    version, overrides = VARIANTS[variant]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(deepseek_config(version, **overrides),
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


def reference(variant: str, balance: float = 0.0) -> dict:
    """One process, the whole batch: losses, gradient norms, weights before / after, logits of
    a fresh batch after the steps, V3's correction biases after the balancer's updates."""
    model = build(variant)
    balancer = _balancer(model, balance)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms, data = [], [], batches()
    for batch in data[:STEPS]:
        loss = model(input_ids=batch, labels=batch).loss
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


def _boost(variant: str, layout: dict):
    from phalanx.booster import Booster
    from phalanx.booster.plugins.hybrid import HybridParallelPlugin

    plugin = HybridParallelPlugin(**layout)
    booster = Booster(plugin)
    model = build(variant)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, *_ = booster.boost(model, optimizer)
    return booster, plugin, model, optimizer


def layout_steps(variant: str, layouts: dict[str, dict], balance: float = 0.0, save: str | None = None) -> dict:
    """{layout name: differences to one process}. `balance`: V3's bias update rate (BiasBalancer,
    loads summed over the data-parallel group); `save`: a directory where the first layout's
    model is written after its steps (booster.save_model, Hugging Face layout)."""
    ref = reference(variant, balance)
    out = {}
    for i, (name, layout) in enumerate(layouts.items()):
        booster, plugin, model, optimizer = _boost(variant, layout)
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
        got = {"losses": rel_diff(losses, ref["losses"]), "norms": rel_diff(norms, ref["norms"]),
               "local_experts": sorted({tuple(m.gate_up_proj.shape) for m in ep.experts.values()}) if ep else None,
               "biases": rel_diff(_biases(model), ref["biases"]) if balance else None}
        if dist.get_rank() == 0:  # the writer holds every tensor
            got.update(compare_saved_state(state, ref))
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


def router_loss_refusal() -> str:
    """ep2 with config.output_router_logits=True on DeepSeek-V3: the error boost raises."""
    from phalanx.booster import Booster
    from phalanx.booster.plugins.hybrid import HybridParallelPlugin

    model = build("v3")
    model.config.output_router_logits = True
    try:
        Booster(HybridParallelPlugin(ep_size=2)).boost(model, torch.optim.SGD(model.parameters(), lr=LR))
    except ValueError as exc:
        return str(exc)
    return "no error"
