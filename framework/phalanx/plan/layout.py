"""Parallel layouts the planner considers, and the list of them for a world size."""
from __future__ import annotations

import dataclasses
from typing import Iterator

from phalanx.layout import Layout as _BaseLayout  # the value lives below booster and plan
from phalanx.models import ModelSpec, head_problem

PLUGINS = ("ddp", "zero", "fsdp", "gemini", "hybrid")


@dataclasses.dataclass(frozen=True)
class Layout(_BaseLayout):
    """`phalanx.layout.Layout` with expert parallelism: ep, the hybrid plugin's `ep_size` (the
    routed experts of a mixture of experts split over groups of ep data(× sequence)-parallel ranks;
    ep divides dp × sp, docs/moe.md). ep = 1 is the base layout unchanged."""
    ep: int = 1

    @classmethod
    def of(cls, layout: _BaseLayout, ep: int | None = None) -> "Layout":
        """The planner's Layout of a plugin's (`Plugin.plan_layout`), with `ep` if given."""
        fields = {f.name: getattr(layout, f.name) for f in dataclasses.fields(_BaseLayout)}
        return cls(**fields, ep=ep if ep is not None else getattr(layout, "ep", 1))

    @property
    def expert_shard_group(self) -> int:
        """Ranks an expert's optimizer state is sharded over: its replicas, dp × sp / ep."""
        return max(1, self.shard_group // self.ep)

    def name(self) -> str:
        text = super().name()
        if self.ep > 1:
            head, _, rest = text.partition(" ")  # "hybrid tp2+pp2 …" → "hybrid tp2+pp2+ep4 …"
            dims, _, rest = rest.partition(" ")
            dims = f"ep{self.ep}" if dims == "dp" else f"{dims}+ep{self.ep}"
            text = " ".join(x for x in (head, dims, rest) if x)
        return text

    def plugin_options(self) -> dict:
        out = super().plugin_options()
        if self.ep > 1:
            out["ep_size"] = self.ep
        return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def structural_problem(layout: _BaseLayout, spec: ModelSpec, seq: int) -> str | None:
    """Why the layout cannot be built for this model at all (heads, layers, sequence, experts), or None."""
    t, p, s = layout.tp, layout.pp, layout.sp
    if layout.world % (t * p * s):
        return f"tp×pp×sp = {t * p * s} does not divide the world size {layout.world}"
    heads = head_problem(spec.heads, t)
    if heads:
        return heads
    if p > spec.num_layers:
        return f"pp={p} stages but the model has {spec.num_layers} layers"
    if p > 1 and layout.sp_mode in ("ulysses", "ring"):
        return f"sequence_parallelism={layout.sp_mode!r} is not combined with pp={p} (HybridParallelPlugin): use pp=1"
    if layout.sp_mode == "ulysses":
        if seq % s:
            return f"sequence {seq} does not divide by sp={s}"
        if (spec.num_heads // t) % s:
            return (f"Ulysses needs the {spec.num_heads // t} heads per tp rank divisible by sp={s}: "
                    f"use ring attention (it splits the sequence only) or another sp")
    if layout.sp_mode == "ring":
        if seq % (2 * s):
            return (f"sequence {seq} does not divide into 2 × sp = {2 * s} chunks (ring attention's zigzag "
                    f"layout, two chunks per rank): use a sequence that is a multiple of {2 * s}")
        dropout = float(getattr(getattr(spec, "config", None), "attention_dropout", 0.0) or 0.0)
        if dropout > 0:
            return (f"ring attention has no attention dropout (the config's attention_dropout is {dropout}): "
                    f"set it to 0, or use Ulysses")
    if layout.sp_mode in ("ulysses", "ring"):
        window = min((w for w in getattr(spec, "sliding_windows", ()) if w is not None), default=None)
        if window is not None and seq > window:
            return (f"sequence {seq} exceeds the sliding window {window}: {layout.sp_mode} attention computes full "
                    f"causal attention (HybridParallelPlugin refuses it); use sequences of at most {window} or no "
                    f"sequence parallelism")
    if layout.sp_mode == "split_gather" and seq % t:
        return f"sequence {seq} does not divide by tp={t} (split-gather)"
    if layout.plugin == "hybrid" and (s > 1 or layout.sp_mode) and _deepseek_balance(spec):
        return ("sequence parallelism with DeepSeek's balance loss (config.output_router_logits=True) is refused by "
                "HybridParallelPlugin (every router must see whole sequences): set config.output_router_logits=False, "
                "or no sequence parallelism")
    if layout.plugin == "hybrid" and layout.sp_mode == "split_gather" and _switch_router_loss(spec):
        return ("split-gather sequence parallelism with the router load-balancing loss (config.output_router_logits="
                "True) is refused by HybridParallelPlugin (each tensor-parallel rank routes its own tokens): use "
                "Ulysses, or set config.output_router_logits=False")
    ep = getattr(layout, "ep", 1)
    if ep > 1:  # HybridParallelPlugin's own checks (docs/moe.md)
        if layout.plugin != "hybrid":
            return f"ep={ep}: expert parallelism is the hybrid plugin's (ep_size); {layout.plugin} has none"
        if not spec.is_moe:
            return f"ep={ep}: {spec.name} has no experts to split"
        if layout.sp_mode == "split_gather":
            return f"ep={ep} is not combined with split-gather sequence parallelism (HybridParallelPlugin): use Ulysses"
        data = layout.dp * s  # Ulysses/ring: the experts split over dp x sp (each rank routes its own tokens)
        if data % ep:
            what = f"data x sequence-parallel size {data}" if s > 1 else f"data-parallel size {data}"
            return f"ep={ep} must divide the {what}: choose ep in {_divisors(data)}"
        if spec.num_experts % ep:
            return f"ep={ep} must divide the {spec.num_experts} experts: choose ep in {_divisors(spec.num_experts)}"
    return None


def _switch_router_loss(spec: ModelSpec) -> bool:
    """Whether the config asks for Mixtral / Qwen-MoE's load-balancing loss (output_router_logits on
    a non-DeepSeek MoE), which HybridParallelPlugin does not combine with split-gather."""
    config = getattr(spec, "config", None)
    return spec.is_moe and bool(getattr(config, "output_router_logits", False)) and not _deepseek_balance(spec)


def _deepseek_balance(spec: ModelSpec) -> bool:
    """Whether the config asks for DeepSeek's balance loss, which HybridParallelPlugin trains only
    without sequence parallelism (`phalanx.models.deepseek.balance_settings`)."""
    config = getattr(spec, "config", None)
    return (getattr(config, "model_type", None) in ("deepseek_v2", "deepseek_v3")
            and bool(getattr(config, "output_router_logits", False)))


def _expert_sizes(world: int, spec: ModelSpec) -> list[int]:
    """ep sizes worth trying for a mixture of experts: the divisors > 1 of the experts (each also
    dividing the data-parallel size of the layout: checked per layout)."""
    return [e for e in _divisors(spec.num_experts) if 1 < e <= world] if spec.is_moe else []


def candidate_layouts(world: int, spec: ModelSpec, seq: int, *, max_tp: int = 8) -> Iterator[Layout]:
    """Every layout worth estimating for `world` ranks: the plain plugins, and hybrid with each
    tp (≤ max_tp, dividing the heads) × pp × sp (Ulysses or ring attention, each with every sp > 1
    and no pp; `structural_problem` says which the model and sequence allow), with and without
    activation checkpointing; for a mixture of experts also hybrid with each ep dividing the experts
    and dp × sp (the ranks that route different tokens: under Ulysses or ring each sequence shard
    routes its own), with tp, with pp (no sp) or with sp (no pp): what HybridParallelPlugin builds
    (never split-gather)."""
    eps = _expert_sizes(world, spec)
    for ckpt in (False, True):
        yield Layout("ddp", world, checkpointing=ckpt)
        for stage in (1, 2):
            for off in (False, True):
                yield Layout("zero", world, zero_stage=stage, offload_optim=off, checkpointing=ckpt)
        yield Layout("fsdp", world, checkpointing=ckpt)
        for off_o, off_p in ((False, False), (True, False), (True, True)):
            yield Layout("gemini", world, offload_optim=off_o, offload_param=off_p, checkpointing=ckpt)
        for t in _divisors(world):
            if t > max_tp:
                continue
            for p in _divisors(world // t):
                for s in _divisors(world // (t * p)):
                    if s > 1 and p > 1:
                        continue  # Ulysses/ring do not compose with pp
                    dp = world // (t * p * s)
                    ep_choices = [1] + [e for e in eps if (dp * s) % e == 0]
                    modes = ["ulysses", "ring"] if s > 1 else ([None, "split_gather"] if t > 1 else [None])
                    for ep in ep_choices:
                        if t == p == s == ep == 1:
                            continue  # plain data parallel: the zero/ddp rows above
                        for mode in modes if ep == 1 else [m for m in modes if m != "split_gather"]:
                            for stage in (1, 2) if p == 1 else (1,):
                                yield Layout("hybrid", world, zero_stage=stage, tp=t, pp=p, sp=s, sp_mode=mode,
                                             checkpointing=ckpt, ep=ep)
