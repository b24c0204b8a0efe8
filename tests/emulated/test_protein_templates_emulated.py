"""The protein model's templates under the emulated GPU (`PHALANX_EMULATE_GPU=1`): the template
stack runs on the device, a masked template changes nothing there, and a real one changes the
prediction (tests/apps/protein/test_protein_templates.py, run in a child process); the template
embedding cached across recycling passes gives the uncached outputs and gradients there
(test_protein_template_cache.py, in the same child); and `apps.protein.train` with templates searched
once per chain when the dataset is built, split over 2 ranks (data.templates_from: search)."""
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


# tiny.yaml shrunk for the emulator, with a small template stack and templates searched among the shipped
# structures released before each chain (data.templates_from: search)
SEARCHED_TEMPLATES = ["model.templates=true", "model.template.c_t=8", "model.template.blocks=1",
                      "model.template.heads=2", "model.template.c_hidden_mul=8", "data.max_templates=2",
                      "data.templates_from=search",
                      "model.c_m=16", "model.c_z=8", "model.c_e=8", "model.c_s=16", "model.evoformer_blocks=1",
                      "model.extra_msa_blocks=1", "model.evoformer.heads_msa=2", "model.evoformer.c_hidden_msa=4",
                      "model.evoformer.heads_pair=2", "model.evoformer.c_hidden_pair=4",
                      "model.evoformer.c_hidden_mul=8", "model.evoformer.c_hidden_opm=4", "model.structure.heads=2",
                      "model.structure.c_ipa=4", "model.structure.query_points=2", "model.structure.value_points=2",
                      "model.structure.layers=2", "model.structure.c_resnet=8", "data.crop_size=8",
                      "data.max_msa_clusters=2", "data.max_extra_msa=2", "max_train_chains=4", "eval_heldout=false",
                      "eval_recycles=0", "train.micro_batch_size=1", "train.max_steps=2", "train.eval_every=2",
                      "train.save_every=0", "train.log_every=1", "train.progress_bar=false", "train.plot=false"]


@pytest.mark.slow
def test_protein_train_with_searched_templates_two_ranks(tmp_path):
    """`phalanx run -n 2 -m apps.protein.train` with data.templates_from=search for 2 steps on 2
    emulated GPUs: the template search runs once per chain when the dataset is built, split over the
    2 ranks and gathered through the NCCL-path collectives on device tensors; rank 0's cache file
    holds every training chain's hits, equal to one CPU process's search."""
    import json

    from emulated_run import DEVICE_LINE, run_module_emulated

    from apps.protein.dataset import load_entries
    from apps.protein.data_sets import STRUCTURES, TRAIN
    from apps.protein.templates import chain_template_hits

    cache = tmp_path / "hits"
    log = run_module_emulated("apps.protein.train", "--config", "apps/protein/configs/tiny.yaml", *SEARCHED_TEMPLATES,
                              f"data.template_hits_cache={cache}", f"train.output_dir={tmp_path / 'run'}", ranks=2,
                              timeout=600)
    assert DEVICE_LINE in log and "done at step 2" in log
    assert "4 chains, 4 searched over 2 ranks" in log, log[-3000:]
    (file,) = cache.glob("template_hits-*.json")
    stored = json.loads(file.read_text())["chains"]
    chains = [chain for chain, _ in load_entries(TRAIN[:4])]
    want = chain_template_hits(chains, STRUCTURES, 2, distributed=False)
    assert {n: e["hits"] for n, e in stored.items()} == {n: [h.to_json() for h in hs] for n, hs in want.items()}
    assert sum(len(hs) for hs in want.values()) >= 4
