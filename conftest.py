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
