"""Checkpoints: Hugging Face model export, sharded optimizer state, resumable training state.

Every checkpoint directory is written under a temporary name and renamed into place, and carries
a `manifest.json` of SHA-256 checksums; loading verifies it and refuses a partial or corrupt
directory. Only safetensors and JSON are read back: never pickle.
"""
from phalanx.checkpoint.atomic import CheckpointError, atomic_directory, verify_manifest, write_manifest
from phalanx.checkpoint.hf import load_hf_state_dict, save_hf_model
from phalanx.checkpoint.optimizer import Fragment, FragmentReader, OptimizerFragments, save_fragments
from phalanx.checkpoint.train_state import (TrainState, latest_checkpoint, list_checkpoints,
                                            load_rng_state, save_rng_state)

__all__ = [
    "CheckpointError", "atomic_directory", "verify_manifest", "write_manifest",
    "save_hf_model", "load_hf_state_dict",
    "Fragment", "FragmentReader", "OptimizerFragments", "save_fragments",
    "TrainState", "latest_checkpoint", "list_checkpoints", "save_rng_state", "load_rng_state",
]
