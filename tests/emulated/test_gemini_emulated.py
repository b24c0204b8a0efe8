"""GeminiPlugin's equivalence with one process on the emulated GPU (NCCL path, device tensors,
the auto policy tracing activations with the device's `memory_allocated()`): the existing
equivalence tests run in a child pytest with PHALANX_EMULATE_GPU=1, their ranks inheriting it.

Under emulation no gradient used to reach Gemini's chunks (grad_norm 0): the emulator's
`cpu_param.data = device_tensor` (a `swap_tensors`) dropped the post-accumulate-grad hooks Gemini
registers before it points the parameters at device placeholders; see
`phalanx.emulate.tensor._set_data`."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from emulated_run import pytest_emulated, run_emulated  # noqa: E402

GEMINI = "tests/framework/test_gemini.py"

# What Gemini does to a parameter, reduced: hooks and attributes set on a CPU tensor, then its
# data pointed at the device. On a GPU `set_data` keeps all of them.
MOVED_KEEPS_ITS_HOOKS = """
import torch, phalanx
from phalanx.device import run_device
fired = []
p = torch.nn.Parameter(torch.randn(3))
p.register_hook(lambda g: fired.append("tensor hook"))
p.register_post_accumulate_grad_hook(lambda t: fired.append("post-accumulate hook"))
p.tag = "kept"
p.data = torch.zeros(3, device=run_device())
(p * 2).sum().backward()
assert p.device.type != "cpu", p.device
assert fired == ["tensor hook", "post-accumulate hook"], fired
assert p.tag == "kept"
print("ok")
"""


def test_a_parameter_moved_by_its_data_keeps_its_hooks():
    assert run_emulated([sys.executable, "-c", MOVED_KEEPS_ITS_HOOKS], timeout=120).strip().endswith("ok")


@pytest.mark.slow
def test_gemini_matches_one_process_on_the_emulated_gpu():
    # 1, 2 and 4 ranks; static, static with offload, auto under a 1 MB device budget
    out = pytest_emulated(f"{GEMINI}::test_two_ranks_match_single_process",
                          f"{GEMINI}::test_one_and_four_ranks_match_single_process", timeout=600)
    assert "5 passed" in out and "failed" not in out, out[-3000:]
