"""`execute_pipeline` under HybridParallelPlugin(pp_size>1): one batch through the schedule."""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from phalanx.booster.state import BoostedState, boosted_state
from phalanx.pipeline import batch_tensors
from phalanx.shard.grads import flat_all_reduce
from phalanx.shard.optim import HybridZeroOptimizer


class HybridPipelineStep:
    """The pipeline step of HybridParallelPlugin (plugin.py), whose groups and `no_sync` it uses."""

    def execute_pipeline(self, data_iter: Iterator, model: nn.Module, criterion=None, optimizer=None, *,
                         return_outputs: bool = False, loss_weight: float = 1.0, forward_only: bool = False) -> dict:
        """One batch through the schedule (see `Booster.execute_pipeline`); `loss_weight` multiplies
        the gradients, not the returned loss (phalanx.train's token weighting). Microbatches accumulate
        locally; then the tied embedding copies and the tensor-parallel partial gradients are
        summed and ZeRO reduces once, as after one ordinary backward. `forward_only`: the loss
        (and logits) of the batch without a backward, for evaluation."""
        state = boosted_state(model)
        if state is None or state.pipeline is None:
            raise ValueError("execute_pipeline needs a model boosted with HybridParallelPlugin(pp_size>1); "
                             "with pp_size=1 call the model and booster.backward")
        runner = state.pipeline
        input_ids, labels = batch_tensors(next(data_iter))
        if forward_only:
            return runner.evaluate(input_ids, labels, criterion=criterion, return_outputs=return_outputs)
        optimizer = optimizer or state.optimizer
        scaler = getattr(optimizer, "scaler", None)
        scale = (scaler.scale if scaler is not None and scaler.enabled else 1.0) * loss_weight
        with self.no_sync(model, optimizer):
            out = runner.run(input_ids, labels, criterion=criterion, return_outputs=return_outputs, loss_scale=scale)
        self._finish_pipeline_grads(state, optimizer)
        return out

    def _finish_pipeline_grads(self, state: BoostedState, optimizer) -> None:
        def grads(params):
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            return [p.grad for p in params]

        flat_all_reduce(grads(list(state.tied.values())), self.tie_group, name="pp.tied_grads")
        if isinstance(optimizer, HybridZeroOptimizer):  # stage 0 sums partial gradients at step
            flat_all_reduce(grads(optimizer.partial.params), self.tp_group, name="tp.partial_grad")
            flush = getattr(optimizer, "flush", None) or optimizer.reducer.flush  # ExpertZeroOptimizer: both
            flush()
