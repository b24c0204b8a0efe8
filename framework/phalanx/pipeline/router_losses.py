"""The router losses of Mixtral / Qwen-MoE under pipeline parallelism: the Switch load-balancing
loss (transformers' `load_balancing_loss_func`) and ST-MoE's z-loss, exact although every stage
holds only some of the routers.

Both are sums over every (layer, token) row of a batch: the load-balancing loss is
E · Σ_e f_e · P_e with f_e the share of top-k assignments that went to expert e (no gradient) and
P_e the mean routing probability, both over the rows of every layer; the z-loss is the mean of
logsumexp(logits)². Given f, both are linear in per-row quantities, so they split over stages:
each stage adds its routers' sums to running totals that travel to the next stage as three extra
pipeline tensors beside the hidden states (Σ softmax probabilities [E], with gradient; the top-k
assignment counts and the row count [E + 1], int64; Σ logsumexp² [1], with gradient). The last
stage sums the counts over the data(× sequence)-parallel group (the global batch), adds the losses
to the microbatch's loss, and the pipeline's own backward returns each stage's share of the
gradient to its routers: no stage waits for another inside the schedule.

Under pp the unit of the load-balancing loss is the microbatch, as in a one-process loop of
gradient accumulation (transformers' loss on each microbatch, averaged over the microbatches):
f of the whole batch would need every microbatch's forward before the first backward, which
1F1B does not wait for. The microbatch is the same rows of every data-parallel rank's batch. The
z-loss is linear in every row, so it is the whole batch's exactly (each microbatch's sum over the
batch's row count). The per-rank values are in the form world · (this rank's part) / global count,
whose mean over the data-parallel ranks is the global value and whose averaged gradient is the
global gradient (as `phalanx.shard.expert_parallel.load_balancing_loss`). The per-row sums and the
router hooks are those of the losses without pipeline parallelism (`phalanx.models.routers`:
`switch_sums`, `z_sums`, `RouterRecorder`).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from phalanx.launch import collective
from phalanx.models.routers import RouterCall, RouterRecorder, group_totals, named_expert_routers, switch_sums, z_sums


def expert_routers(module: nn.Module) -> list[nn.Module]:
    """The routers of the expert blocks under `module`, in module order."""
    return list(named_expert_routers(module).values())


class RouterLossCarry:
    """The router losses of one pipeline rank's stages (the module docstring).

    `aux_coef`: the Switch load-balancing loss's coefficient (config.router_aux_loss_coef; 0: off);
    `z_coef`: the z-loss's (HybridParallelPlugin's router_z_loss; 0: off); `deepseek`: instead of the
    Switch loss, DeepSeek's balance loss, a `phalanx.models.deepseek.BalanceLoss` holding its form
    (V2's expert-level / V3's sequence-wise scores, per sequence or over the batch, alpha), whose
    per-block pieces ride along instead. `num_layers`: decoder layers (a row each in DeepSeek's
    per-block totals). `batch_group`: the ranks whose batches make up the global batch (the data ×
    sequence-parallel group; None: this process alone).

    Carried between stages: (balance part, balance counts, Σ logsumexp², router rows):
    Switch: Σ softmax [E] and top-k counts [E]; DeepSeek over the batch: per block Σ s' [L, E] and
    counts with the block's tokens [L, E + 1]; DeepSeek per sequence: Σ over blocks and sequences of
    Σ_i f_i · P_i [1] (each sequence's own f and P: nothing to sum over ranks but the sequences)."""

    def __init__(self, num_experts: int, top_k: int, *, aux_coef: float = 0.0, z_coef: float = 0.0,
                 batch_group=None, deepseek=None, num_layers: int = 0):
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_coef, self.z_coef = aux_coef, z_coef
        self.batch_group = batch_group
        self.deepseek, self.num_layers = deepseek, num_layers
        self.enabled = True  # off while the runner evaluates (one tensor between stages, no loss)
        # stage index -> (layer id, RouterCall) of its routers in this forward
        self._recorded: dict[int, list[tuple[int, RouterCall]]] = {}
        # hooks on the routers, keyed (stage index, layer id, router of the layer)
        self._recorder = RouterRecorder(on_call=self._record)

    def attach(self, stage: nn.Module) -> None:
        """Hooks on the routers of `stage`'s layers, recording their logits while the stage runs."""
        for layer_id, layer in zip(stage.layer_ids, stage.layers):
            for j, router in enumerate(expert_routers(layer)):
                if router.num_experts != self.num_experts or router.top_k != self.top_k:
                    raise ValueError(f"router losses under pipeline parallelism: a router with {router.num_experts} "
                                     f"experts and top-{router.top_k}, others {self.num_experts} and top-{self.top_k}")
                self._recorder.add((stage.index, layer_id, j), router)
        stage.router_losses = self

    def _record(self, key: tuple[int, int, int], call: RouterCall) -> None:
        index, layer_id, _ = key
        record = self._recorded.get(index)
        if record is not None:  # only inside the stage's own forward (not a checkpoint's recomputation)
            record.append((layer_id, call))

    @contextlib.contextmanager
    def recording(self, index: int) -> Iterator[list[tuple[int, RouterCall]]]:
        """What stage `index`'s routers produce while the block runs."""
        self._recorded[index] = record = []
        try:
            yield record
        finally:
            del self._recorded[index]

    def _start(self, device) -> tuple[torch.Tensor, ...]:
        E, L = self.num_experts, self.num_layers
        if self.deepseek is None:
            part, counts = torch.zeros(E, device=device), torch.zeros(E, dtype=torch.long, device=device)
        elif self.deepseek.per_sequence:
            part, counts = torch.zeros(1, device=device), torch.zeros(1, dtype=torch.long, device=device)
        else:
            part, counts = torch.zeros(L, E, device=device), torch.zeros(L, E + 1, dtype=torch.long, device=device)
        return part, counts, torch.zeros(1, device=device), torch.zeros(1, dtype=torch.long, device=device)

    def carry(self, recorded: list[tuple], carried: tuple, device) -> tuple[torch.Tensor, ...]:
        """The running totals after this stage: `carried` (from the previous stage; empty on the
        first) plus the sums over this stage's routers (`recorded`)."""
        part, counts, z_sum, rows = carried or self._start(device)
        add_part, add_counts = torch.zeros_like(part), torch.zeros_like(counts)
        add_z, add_rows = torch.zeros_like(z_sum), torch.zeros_like(rows)
        logits = [call.logits for _, call in recorded]
        if logits:  # (a stage of dense layers only has no router)
            squares, layer_rows = z_sums(logits)
            add_z, add_rows = add_z + squares, add_rows + layer_rows.long()
            if self.deepseek is None:  # transformers' Switch loss: softmax, top-k of the probabilities
                prob_sum, assigned, _ = switch_sums(logits, self.num_experts, self.top_k)
                add_part, add_counts = add_part + prob_sum, add_counts + assigned.long()
        for layer_id, call in recorded if self.deepseek is not None else ():  # DeepSeek's per-block pieces
            piece, total = self.deepseek.block_parts(call.logits.float(), call.chosen, call.rows, None)
            if self.deepseek.per_sequence:
                add_part = add_part + piece.reshape(1)
            else:  # this block's row: Σ s' [E], and the counts with the block's tokens [E + 1]
                row = torch.nn.functional.one_hot(torch.tensor(layer_id, device=device), self.num_layers)
                add_part = add_part + row[:, None].to(piece.dtype) * piece[None, :]
                add_counts = add_counts + row[:, None] * total.round().long()[None, :]
        # (sums with gradient always make new tensors: a stage's outputs are never its inputs)
        return part + add_part, counts + add_counts, z_sum + add_z, rows + add_rows

    def loss(self, part: torch.Tensor, counts: torch.Tensor, z_sum: torch.Tensor, rows: torch.Tensor, *,
             sequences: int, microbatches: int) -> torch.Tensor:
        """The microbatch's share of the router losses on the last stage, from the totals over every
        stage (`sequences`: the microbatch's rows on this rank): the balance loss of the microbatch /
        microbatches (per sequence: its sequences' terms over the batch's sequences) and the z-loss
        of its rows over the batch's, each in the per-rank form over `batch_group`."""
        totals = torch.cat([counts.detach().reshape(-1), rows.detach().reshape(-1),
                            torch.tensor([sequences], dtype=torch.long, device=counts.device)])
        with collective("pp.router_loss_counts"):
            totals, size = group_totals(totals, self.batch_group)
        counts, rows_g, sequences_g = totals[:-2].view_as(counts), totals[-2].float(), totals[-1].float()
        out = part.new_zeros(())
        if self.deepseek is not None:
            ds = self.deepseek
            if ds.per_sequence:  # the batch's sequences: every microbatch has as many (equal splits)
                balance = part.sum() / (sequences_g.clamp(min=1) * microbatches)
            else:
                tokens = counts[:, -1].float().clamp(min=1)[:, None]
                f = counts[:, :-1].float() * self.num_experts / (self.top_k * tokens)
                balance = (f * part / tokens).sum() / microbatches
            out = out + ds.alpha * size * balance
        elif self.aux_coef:  # f_e: assignments per row, as transformers' mean of one-hots
            share = counts.float() / rows_g.clamp(min=1)
            out = out + self.aux_coef * size * self.num_experts * (share * part / rows_g.clamp(min=1)).sum() / microbatches
        if self.z_coef:  # the batch's rows: every microbatch has the same (equal splits, no padding mask)
            out = out + self.z_coef * size * z_sum.sum() / (rows_g.clamp(min=1) * microbatches)
        return out
