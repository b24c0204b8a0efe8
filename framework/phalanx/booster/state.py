"""What a plugin tells the rest of phalanx about a model it boosted: one typed `BoostedState`.

The plugin builds it in `configure_model` (`Plugin.boosted`); `Booster.boost` adds the boosted
optimizer. It is attached to the boosted model, to the boosted optimizer (checkpoint hooks such
as `optimizer_fragments` get only the optimizer) and, for plugins whose user model cannot score a
batch alone (`HybridParallelPlugin`), to the user's model, which is what an `eval_fn` receives.
The training loop, evaluation and the checkpoint hooks read it with `boosted_state(x)`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from phalanx.booster.plugins.base import Plugin
    from phalanx.pipeline.runtime import PipelineRunner
    from phalanx.shard.tensor_parallel import TPPlan

_ATTR = "_phalanx_boosted_state"  # a plain attribute, not a submodule: the state refers back to the model


@dataclass(eq=False)
class BoostedState:
    plugin: Plugin
    module: nn.Module  # the boosted model, as `Booster.boost` returns it
    # (this rank's data replica, number of replicas): tensor, sequence and pipeline peers are one
    # replica and must see the same batches
    data_replica: tuple[int, int] = (0, 1)
    optimizer: Any = None  # the boosted optimizer, once `Booster.boost` has wrapped one
    # id(parameter) -> name, recorded before sharding replaced the parameters (FSDP2, hybrid):
    # the user's optimizer is re-pointed at the new parameters by these names
    param_names: dict[int, str] = field(default_factory=dict)
    plan: TPPlan | None = None  # the tensor-parallel layout (hybrid)
    pipeline: PipelineRunner | None = None  # this rank's stages and their schedule (pp_size > 1)
    # first name -> this rank's copy of a parameter tied across pipeline ranks (an embedding the
    # first and the last stage both hold), ordered by name
    tied: dict[str, nn.Parameter] = field(default_factory=dict)
    tied_aliases: dict[str, str] = field(default_factory=dict)  # second name of a tied parameter -> first name

    @property
    def model_computes_loss(self) -> bool:
        """The boosted model's forward with `labels` returns the causal-LM loss (vocabulary-parallel,
        sequence-aware): score batches through it (`phalanx.train.eval_loss_sum`), not through the
        user's model, which holds only this rank's pieces."""
        return self.plugin.model_computes_causal_lm_loss

    def attach(self, *objects: Any) -> None:
        for obj in objects:
            object.__setattr__(obj, _ATTR, self)


def boosted_state(obj: Any) -> BoostedState | None:
    """The `BoostedState` of a boosted model, a boosted optimizer, or a user's model the plugin
    marked; None for anything else (a plain model, None)."""
    state = getattr(obj, _ATTR, None)
    return state if isinstance(state, BoostedState) else None


def boosted_optimizer(model: Any) -> Any:
    """The optimizer boosted together with `model`, or None."""
    state = boosted_state(model)
    return state.optimizer if state is not None else None
