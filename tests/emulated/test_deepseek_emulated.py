"""DeepSeek-V3 on the emulated GPU: tp2 (multi-head latent attention split by heads) and ep2 with the
correction-bias balancer, the HF-layout save loaded under tp2 and by from_pretrained
(tests/framework/test_deepseek_family.py), and DeepSeek's balance losses: the loss against the
formula by hand, ep2 / dp2 with the loss against one process, ranks of uneven batches, the
refusals (tests/framework/test_deepseek_losses.py); DeepSeek-V2 tp2 and its batch loss with ep2 / dp2
(its complex-number RoPE got wrong gradients on emulated tensors until the emulator materialised
conjugate views); run in a child pytest with PHALANX_EMULATE_GPU=1, its ranks inheriting it."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from emulated_run import pytest_emulated  # noqa: E402

FILE = "tests/framework/test_deepseek_family.py"
LOSSES = "tests/framework/test_deepseek_losses.py"


NODES = {
    "v3": [f"{FILE}::test_tp2_equals_one_process[v3]", f"{FILE}::test_ep2_v3_equals_one_process_and_saves_hf_layout",
           f"{FILE}::test_bias_balancer_moves_the_correction_bias_against_the_load"],
    "balance-losses": [f"{LOSSES}::test_balance_loss_equals_the_formula_by_hand[v3-sequence]",
                       f"{LOSSES}::test_balance_loss_equals_the_formula_by_hand[v3-batch]",
                       f"{LOSSES}::test_ep2_and_dp2_with_the_balance_loss_equal_one_process[v3]",
                       f"{LOSSES}::test_uneven_ranks_give_the_global_loss",
                       f"{LOSSES}::test_layouts_without_the_loss_are_refused"],
    "v2": [f"{FILE}::test_tp2_equals_one_process[v2]", f"{LOSSES}::test_balance_loss_equals_the_formula_by_hand[v2-batch]",
           f"{LOSSES}::test_ep2_and_dp2_with_the_balance_loss_equal_one_process[v2]"],
}


@pytest.mark.slow
@pytest.mark.parametrize("group", list(NODES))
def test_deepseek_on_the_emulated_gpu(group):
    out = pytest_emulated(*NODES[group])
    assert f"{len(NODES[group])} passed" in out and "failed" not in out, out[-3000:]
