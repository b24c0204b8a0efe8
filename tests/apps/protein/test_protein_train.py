"""The recipe end to end on tiny sizes: training through phalanx.train.fit, exact resume, predict
writing PDB + mmCIF that biotite reads back, and evaluate. Three 1-rank runs: ~4.5 min on the
shared 2-core machine (load average ~15), hence slow."""
from __future__ import annotations

import json

import numpy as np
import pytest

from phalanx.testing import spawn

TINY = ["model.c_m=16", "model.c_z=8", "model.c_e=8", "model.c_s=16", "model.evoformer_blocks=1",
        "model.extra_msa_blocks=1", "model.recycles=1", "model.evoformer.heads_msa=2", "model.evoformer.c_hidden_msa=4",
        "model.evoformer.heads_pair=2", "model.evoformer.c_hidden_pair=4", "model.evoformer.c_hidden_mul=8",
        "model.evoformer.c_hidden_opm=4", "model.structure.heads=2", "model.structure.c_ipa=4",
        "model.structure.query_points=2", "model.structure.value_points=2", "model.structure.layers=2",
        "model.structure.c_resnet=8", "data.crop_size=16", "data.max_msa_clusters=4", "data.max_extra_msa=4",
        "max_train_chains=2", "eval_heldout=false", "eval_recycles=0", "train.micro_batch_size=2",
        "train.log_every=1", "train.save_every=2", "train.keep_last=0", "train.progress_bar=false", "train.plot=false"]


def _train(overrides):
    from apps.protein.config import load_recipe
    from apps.protein.train import train

    cfg = load_recipe("apps/protein/configs/tiny.yaml", overrides)
    result, _ = train(cfg)
    return result.losses, result.last_eval


@pytest.mark.slow
def test_train_resume_predict_evaluate(tmp_path):
    straight = [*TINY, f"train.output_dir={tmp_path / 'a'}", "train.max_steps=4"]
    first = [*TINY, f"train.output_dir={tmp_path / 'b'}", "train.max_steps=2"]
    resumed = [*TINY, f"train.output_dir={tmp_path / 'b'}", "train.max_steps=4"]
    (full_losses, full_eval), = spawn(_train, 1, straight, timeout=400)
    spawn(_train, 1, first, timeout=400)
    (rest_losses, rest_eval), = spawn(_train, 1, resumed, timeout=400)
    assert len(full_losses) == 4 and all(np.isfinite(full_losses))
    # The resumed run continues with the same crops, MSA samples, recycling draws and weights.
    assert rest_losses == pytest.approx(full_losses[2:], rel=1e-5)
    assert rest_eval["train_lddt_ca"] == pytest.approx(full_eval["train_lddt_ca"], rel=1e-4)
    evaluation = json.loads((tmp_path / "a" / "eval.json").read_text())
    assert set(evaluation["train"]) == {"1psm_A", "2q2k_A"}

    # predict from the run's checkpoint (EMA weights), then read the files back with biotite.
    import biotite.structure.io.pdb as pdb
    import biotite.structure.io.pdbx as pdbx

    from apps.protein.evaluate import score_files
    from apps.protein.predict import main as predict_main

    fasta = tmp_path / "q.fasta"
    fasta.write_text(">2q2k_A\nMGSSHHHHHHSSGLVPGSHMDKKETKHLLKIKKEDYPQIFDFLENVPRGTKTAHIREALRRYIEEIGENP\n")
    out = tmp_path / "pred"
    predict_main(["--config", "apps/protein/configs/tiny.yaml", "--checkpoint", str(tmp_path / "a"), "--fasta",
                  str(fasta), "--msa", "apps/protein/data/msas/2q2k_A/uniref90_hits.sto", "--out", str(out),
                  "--recycles", "0", "--reference", "apps/protein/data/structures/2q2k.cif.gz", "--chain", "A", *TINY])
    summary = json.loads((out / "2q2k_A.json").read_text())
    from_pdb = pdb.PDBFile.read(str(out / "2q2k_A.pdb")).get_structure(model=1, extra_fields=["b_factor"])
    from_cif = pdbx.get_structure(pdbx.CIFFile.read(str(out / "2q2k_A.cif")), model=1, extra_fields=["b_factor"])
    ca = from_pdb[from_pdb.atom_name == "CA"]
    assert len(ca) == 70 and np.allclose(from_pdb.coord, from_cif.coord, atol=1e-3)
    assert abs(ca.b_factor.mean() - summary["mean_plddt"]) < 0.01  # pLDDT in the B-factor column
    assert (out / "2q2k_A_confidence.png").stat().st_size > 10_000
    again = score_files(out / "2q2k_A.pdb", "apps/protein/data/structures/2q2k.cif.gz", ref_chain="A")
    assert again["residues_scored"] == 45 and again["lddt_ca"] == pytest.approx(summary["metrics"]["lddt_ca"])


@pytest.mark.slow
def test_train_with_dap_on_two_ranks_equals_one_process(tmp_path):
    """`dap_size=2` through fit (DDPPlugin(ranks_per_replica=2)): both ranks see the same crops
    and recycling draws, split the activations, and train exactly as one process does. Tolerance:
    DAP's forward is bit-identical and its gradients differ by rounding (docs/protein.md), which
    three Adam steps may amplify slightly."""
    steps = [*TINY, "train.max_steps=3", "train.save_every=0", "train.eval_every=3"]
    (one_losses, one_eval), = spawn(_train, 1, [*steps, f"train.output_dir={tmp_path / 'one'}"], timeout=400)
    dap = spawn(_train, 2, [*steps, "dap_size=2", f"train.output_dir={tmp_path / 'dap'}"], timeout=400)
    for losses, last_eval in dap:
        assert len(losses) == 3
        assert losses == pytest.approx(one_losses, rel=1e-4)
        assert last_eval["train_lddt_ca"] == pytest.approx(one_eval["train_lddt_ca"], rel=1e-3)


@pytest.mark.slow
def test_dap_composes_with_data_parallelism(tmp_path):
    """4 ranks as 2 data replicas x DAP 2 train exactly like 2 plain data-parallel ranks: the same
    samples per replica, the same per-replica random streams, the gradient mean over replicas."""
    steps = [*TINY, "train.micro_batch_size=1", "train.max_steps=2", "train.save_every=0", "train.eval_every=2"]
    ddp = spawn(_train, 2, [*steps, f"train.output_dir={tmp_path / 'ddp'}"], timeout=400)
    dap = spawn(_train, 4, [*steps, "dap_size=2", f"train.output_dir={tmp_path / 'dap'}"], timeout=600)
    want_losses, want_eval = ddp[0]
    for losses, last_eval in dap:
        assert losses == pytest.approx(want_losses, rel=1e-4)
        assert last_eval["train_lddt_ca"] == pytest.approx(want_eval["train_lddt_ca"], rel=1e-3)
