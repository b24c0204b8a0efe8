"""The protein model's templates under the emulated GPU (`PHALANX_EMULATE_GPU=1`): the template
stack runs on the device, a masked template changes nothing there, and a real one changes the
prediction (tests/apps/protein/test_protein_templates.py, run in a child process); the template
embedding cached across recycling passes gives the uncached outputs and gradients there
(test_protein_template_cache.py, in the same child)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from emulated_run import pytest_emulated  # noqa: E402


@pytest.mark.slow
def test_protein_templates_emulated():
    pytest_emulated("tests/apps/protein/test_protein_templates.py::test_a_masked_template_changes_nothing",
                    "tests/apps/protein/test_protein_template_cache.py", timeout=600)
