"""GeminiPlugin on a real CUDA device: the budget holds for `torch.cuda.max_memory_allocated()`.

Run on a GPU machine with `pytest -m gpu tests/framework/test_gemini_gpu.py`; record the figures
it prints in docs/gemini.md.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

BUDGET = 2 * 2**30
LLAMA = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512)


def _train_under_budget(policy: str) -> dict:
    import torch.distributed as dist

    from phalanx.booster import Booster
    from phalanx.booster.plugins.gemini import GeminiPlugin
    from phalanx.testing import tiny_llama

    model = tiny_llama(seed=0, **LLAMA)  # ~0.7B parameters: ~11 GiB for fp32 DDP states, > 5× the budget
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    kwargs = dict(offload_param_frac=1.0, offload_optim_frac=1.0) if policy == "static" else {}
    plugin = GeminiPlugin(placement_policy=policy, device_memory_budget=BUDGET, precision="bf16",
                          chunk_size_mb=64, **kwargs)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, opt)
    torch.cuda.reset_peak_memory_stats()
    batch = torch.randint(0, LLAMA["vocab_size"], (1, 256), device="cuda")
    losses = []
    for _ in range(3):
        loss = model(input_ids=batch, labels=batch).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    dist.barrier()
    return {"params": n_params, "max_allocated": torch.cuda.max_memory_allocated(), "losses": losses,
            "accounted_peak": plugin.manager.tiers.peak_device}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["static", "auto"])
def test_real_device_memory_stays_under_the_budget(policy):
    from phalanx.testing import spawn

    out = spawn(_train_under_budget, 1, policy, timeout=900)[0]
    print(f"gemini {policy}: {out}")
    assert 16 * out["params"] > 5 * BUDGET
    assert out["max_allocated"] <= BUDGET
    assert all(torch.isfinite(torch.tensor(out["losses"])))
