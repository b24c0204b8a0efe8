"""Rank code for test_forward_guard.py (spawned: must be importable)."""
import torch

from phalanx.booster import Booster
from phalanx.booster.plugins import make_plugin
from phalanx.testing import tiny_llama


def backward_paths(plugin: str = "ddp") -> dict[str, str]:
    """What a backward does after a forward past the wrapper, then after one through it."""
    return {path: backward_through(path, plugin) for path in ("decoder", "boosted")}


def backward_through(path: str, plugin: str = "ddp") -> str:
    model = tiny_llama(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    booster = Booster(plugin=make_plugin(plugin))
    model, optimizer, *_ = booster.boost(model, optimizer)
    rank = torch.distributed.get_rank()
    ids = torch.arange(8).view(1, 8) + rank  # different data per rank: gradients differ before the all-reduce
    if path == "boosted":
        loss = model(input_ids=ids, labels=ids).loss
    else:  # the hidden states from the decoder, past DDP's forward, as the DPO bug did
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state
        loss = model.get_output_embeddings()(hidden).logsumexp(-1).mean()
    try:
        booster.backward(loss, optimizer)
    except RuntimeError as e:
        return str(e)
    optimizer.step()
    return "ok"
