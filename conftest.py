"""Repository-wide pytest setup: run offline, quietly, with the checkout importable."""
import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # `apps` is run from the checkout, not installed

for key, value in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "WANDB_MODE": "offline",
    "TOKENIZERS_PARALLELISM": "false",
    # Two threads per test process, or one under pytest-xdist (`make test` runs two workers on the
    # two cores, so each keeps to one).
    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if "PYTEST_XDIST_WORKER" in os.environ else "2"),
    # phalanx.launch sets torch's thread count (cpu_count // ranks) for the rest of the process:
    # a test that launches in the pytest process would leave every later test of its worker on 2
    # threads beside the other worker (measured: one SFT test 14 s alone, 163 s after such a test)
    **({"PHALANX_THREADS": "1"} if "PYTEST_XDIST_WORKER" in os.environ else {}),
}.items():
    os.environ.setdefault(key, value)

# Triton decides between its interpreter and its compiler from TRITON_INTERPRET when its language
# module is imported, and test modules collected before tests/kernels import it (test_pipeline:
# torch.distributed.pipelining pulls in triton through torch._inductor). Set later, the kernel
# tests failed with "Cannot call @triton.jit'd outside of the scope of a kernel"; so without a
# GPU it is set here, before any test module is collected (tests/kernels/conftest.py explains how
# the kernel tests use it).
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass


import pytest  # noqa: E402


@pytest.fixture
def one_thread(monkeypatch):
    """One intra-op thread for a test that runs a recipe in the pytest process, restored afterwards:
    `phalanx.launch` gives a rank cpu_count // ranks threads (2 on CI's 2 cores) unless
    PHALANX_THREADS says otherwise, and keeps them after the run; beside the other pytest worker
    those 2 threads wait on each other (docs/testing.md, "Suite time"). Under xdist the env above
    already pins PHALANX_THREADS; this also covers a plain `pytest FILE`."""
    import torch

    threads = torch.get_num_threads()
    monkeypatch.setenv("PHALANX_THREADS", "1")
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
