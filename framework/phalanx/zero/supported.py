"""Which torch optimizers can run on a flat shard, and the check that refuses the others.

ZeRO hands the wrapped optimizer one flat fp32 tensor per param group holding *this rank's
slice* of every parameter, often cutting a parameter in two. That is exact only for optimizers
whose update of an element depends on that element's gradient and state alone (plus per-group
scalars such as the step count): Adam, SGD, ... Optimizers that look at a whole parameter — the
factored second moment of Adafactor, the orthogonalisation of Muon, the line search of LBFGS
(which also needs closures re-running the model), the sparse rows of SparseAdam — would silently
compute something else on a slice, so they stop here with a clear error instead.
"""
from __future__ import annotations

import torch

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.Rprop,
    torch.optim.ASGD,
)

_WHY_NOT = {
    "LBFGS": "it re-evaluates the model through closures and searches along the full parameter vector",
    "Adafactor": "it factors the second moment over the rows and columns of each whole matrix",
    "Muon": "it orthogonalises each whole weight matrix",
    "SparseAdam": "it updates sparse rows of whole embedding tables",
}


def register_elementwise_optimizer(cls: type[torch.optim.Optimizer]) -> None:
    """Declare a custom optimizer class elementwise (its update of each element uses only that
    element's gradient and state), so the ZeRO optimizer accepts it."""
    global ELEMENTWISE_OPTIMIZERS
    if cls not in ELEMENTWISE_OPTIMIZERS:
        ELEMENTWISE_OPTIMIZERS = (*ELEMENTWISE_OPTIMIZERS, cls)


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """Raise ValueError unless `optimizer` can be run on flat, rank-partitioned shards."""
    if isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        return
    name = type(optimizer).__name__
    supported = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    why = _WHY_NOT.get(name, "its state is not known to be elementwise")
    raise ValueError(
        f"the ZeRO optimizer cannot shard {name}: {why}, so running it on a slice of each parameter "
        f"would compute a different update. Supported (elementwise) optimizers: {supported}. Use one of "
        "those, a plugin that keeps whole parameters (DDPPlugin, FSDPPlugin), or declare your own "
        "elementwise optimizer with phalanx.zero.register_elementwise_optimizer(cls).")


def drop_unstepped_state(optimizer: torch.optim.Optimizer) -> None:
    """Forget state that an optimizer created eagerly before its first step (Adagrad does), and
    refuse an optimizer that has already stepped: its state belongs to the whole parameters,
    which ZeRO is about to replace by flat shards."""
    for state in optimizer.state.values():
        if not state:
            continue
        step = state.get("step", None)
        stepped = step is None or float(step) != 0.0
        if stepped:
            raise ValueError("wrap the optimizer with ZeRO before its first step: it already holds state for "
                             "the model's parameters (load a checkpoint with booster.load_optimizer instead)")
    optimizer.state.clear()
