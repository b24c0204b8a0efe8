"""The recipe end to end on tiny sizes: training through phalanx.train.fit, exact resume, predict
writing PDB + mmCIF that biotite reads back, and evaluate. Three 1-rank runs: ~4.5 min on the
shared 2-core machine (load average ~15), hence slow."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.framework.spawn_batch import spawn_suites

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


RESUME, DAP2, DAP4 = ("test_train_resume_predict_evaluate", "test_train_with_dap_on_two_ranks_equals_one_process",
                      "test_dap_composes_with_data_parallelism")
DAP_STEPS = [*TINY, "train.max_steps=3", "train.save_every=0", "train.eval_every=3"]
DP_STEPS = [*TINY, "train.micro_batch_size=1", "train.max_steps=2", "train.save_every=0", "train.eval_every=2"]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The training runs of every test, one spawn per world size (tests/framework/spawn_batch.py:
    rank start-up costs seconds): 1 rank runs the resume test's three runs (in order) and the DAP
    test's reference; 2 ranks the DAP run and the data-parallel reference of the 4-rank test."""
    out = tmp_path_factory.mktemp("protein_train")
    one_rank = {f"{RESUME}:straight": (_train, ([*TINY, f"train.output_dir={out / 'a'}", "train.max_steps=4"],), {}),
                f"{RESUME}:first": (_train, ([*TINY, f"train.output_dir={out / 'b'}", "train.max_steps=2"],), {}),
                f"{RESUME}:resumed": (_train, ([*TINY, f"train.output_dir={out / 'b'}", "train.max_steps=4"],), {}),
                f"{DAP2}:one": (_train, ([*DAP_STEPS, f"train.output_dir={out / 'one'}"],), {})}
    two_ranks = {f"{DAP2}:dap": (_train, ([*DAP_STEPS, "dap_size=2", f"train.output_dir={out / 'dap2'}"],), {}),
                 f"{DAP4}:ddp": (_train, ([*DP_STEPS, f"train.output_dir={out / 'ddp'}"],), {})}
    four_ranks = {f"{DAP4}:dap": (_train, ([*DP_STEPS, "dap_size=2", f"train.output_dir={out / 'dap4'}"],), {})}
    return out, {1: spawn_suites(request, 1, one_rank, timeout=1200),
                 2: spawn_suites(request, 2, two_ranks, timeout=800),
                 4: spawn_suites(request, 4, four_ranks, timeout=600)}


@pytest.mark.slow
def test_train_resume_predict_evaluate(runs, tmp_path):
    runs_dir, by_world = runs
    (full_losses, full_eval), = by_world[1].get(f"{RESUME}:straight")
    by_world[1].get(f"{RESUME}:first")
    (rest_losses, rest_eval), = by_world[1].get(f"{RESUME}:resumed")
    assert len(full_losses) == 4 and all(np.isfinite(full_losses))
    # The resumed run continues with the same crops, MSA samples, recycling draws and weights.
    assert rest_losses == pytest.approx(full_losses[2:], rel=1e-5)
    assert rest_eval["train_lddt_ca"] == pytest.approx(full_eval["train_lddt_ca"], rel=1e-4)
    evaluation = json.loads((runs_dir / "a" / "eval.json").read_text())
    assert set(evaluation["train"]) == {"1psm_A", "2q2k_A"}

    # predict from the run's checkpoint (EMA weights), then read the files back with biotite.
    import biotite.structure.io.pdb as pdb
    import biotite.structure.io.pdbx as pdbx

    from apps.protein.evaluate import score_files
    from apps.protein.predict import main as predict_main

    fasta = tmp_path / "q.fasta"
    fasta.write_text(">2q2k_A\nMGSSHHHHHHSSGLVPGSHMDKKETKHLLKIKKEDYPQIFDFLENVPRGTKTAHIREALRRYIEEIGENP\n")
    out = tmp_path / "pred"
    predict_main(["--config", "apps/protein/configs/tiny.yaml", "--checkpoint", str(runs_dir / "a"), "--fasta",
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
def test_train_with_dap_on_two_ranks_equals_one_process(runs):
    """`dap_size=2` through fit (DDPPlugin(ranks_per_replica=2)): both ranks see the same crops
    and recycling draws, split the activations, and train exactly as one process does. Tolerance:
    DAP's forward is bit-identical and its gradients differ by rounding (docs/protein.md), which
    three Adam steps may amplify slightly."""
    (one_losses, one_eval), = runs[1][1].get(f"{DAP2}:one")
    dap = runs[1][2].get(f"{DAP2}:dap")
    for losses, last_eval in dap:
        assert len(losses) == 3
        assert losses == pytest.approx(one_losses, rel=1e-4)
        assert last_eval["train_lddt_ca"] == pytest.approx(one_eval["train_lddt_ca"], rel=1e-3)


@pytest.mark.slow
def test_dap_composes_with_data_parallelism(runs):
    """4 ranks as 2 data replicas x DAP 2 train exactly like 2 plain data-parallel ranks: the same
    samples per replica, the same per-replica random streams, the gradient mean over replicas."""
    ddp = runs[1][2].get(f"{DAP4}:ddp")
    dap = runs[1][4].get(f"{DAP4}:dap")
    want_losses, want_eval = ddp[0]
    for losses, last_eval in dap:
        assert losses == pytest.approx(want_losses, rel=1e-4)
        assert last_eval["train_lddt_ca"] == pytest.approx(want_eval["train_lddt_ca"], rel=1e-3)
