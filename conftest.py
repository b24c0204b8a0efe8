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
    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
}.items():
    os.environ.setdefault(key, value)
