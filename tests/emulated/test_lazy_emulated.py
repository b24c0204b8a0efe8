"""Lazy (meta-device) models on the emulated GPU: LoRA on a lazy base under FSDP2 and tp2 against one
process, the adapters equal to an eager base's, and tp2 pieces of a lazy model read from its checkpoint
(tests/framework/test_lora_lazy.py and test_lazy.py in a child pytest with PHALANX_EMULATE_GPU=1). Until
2026-12-06 the emulator built `with torch.device("meta")` models on the host, so no lazy path ran
lazily under it."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from emulated_run import pytest_emulated  # noqa: E402


@pytest.mark.slow
def test_lazy_models_on_the_emulated_gpu():
    out = pytest_emulated("tests/framework/test_lora_lazy.py::test_lazy_base_takes_the_adapters_of_an_eager_one",
                          "tests/framework/test_lora_lazy.py::test_lazy_base_lora_matches_single_process[fsdp]",
                          "tests/framework/test_lora_lazy.py::test_lazy_base_lora_matches_single_process[tp2]",
                          "tests/framework/test_lazy.py::test_materialize_whole_model_from_checkpoint")
    assert "4 passed" in out and "failed" not in out, out[-3000:]
