"""Reading the shipped files, and the feature pipeline: shapes, masks, crops, the MSA check."""
from __future__ import annotations

import gzip

import numpy as np
import pytest
import torch

from apps.protein import constants as rc
from apps.protein.data_sets import DATA, msa_path, structure_path
from apps.protein.features import FeatureConfig, crop_window, make_features, observed_span
from apps.protein.io import (ProteinInputError, check_msa_matches, read_fasta, read_msa, read_structure)


@pytest.fixture(scope="module")
def chain():
    return read_structure(structure_path("2q2k"), "A")


def test_structure_reads_full_sequence_and_observed_atoms(chain):
    assert chain.sequence == "MGSSHHHHHHSSGLVPGSHMDKKETKHLLKIKKEDYPQIFDFLENVPRGTKTAHIREALRRYIEEIGENP"
    assert chain.atom37.shape == (70, 37, 3) and chain.atom37_mask.shape == (70, 37)
    ca = chain.atom37_mask[:, rc.ATOM37_INDEX["CA"]]
    assert ca.sum() == 45 and observed_span(chain) == (int(np.nonzero(ca)[0][0]), int(np.nonzero(ca)[0][-1]) + 1)
    # Atoms a residue type lacks are never marked present.
    allowed = rc.TABLES["atom37_mask"][chain.aatype]
    assert (chain.atom37_mask <= allowed).all()
    # Bonded backbone atoms sit ~1.46 A apart (N-CA).
    seen = ca > 0
    n_ca = np.linalg.norm(chain.atom37[seen, 0] - chain.atom37[seen, 1], axis=-1)
    assert np.allclose(n_ca, 1.46, atol=0.08)


def test_fasta_and_msas_match_their_sequence(chain):
    (header, seq), = read_fasta(DATA / "msas" / "short.fasta")
    assert header == "query" and len(seq) == 73
    sto = read_msa(msa_path("2q2k_A/uniref90_hits.sto"))
    a3m = read_msa(msa_path("2q2k_A/bfd_uniclust_hits.a3m"))
    for alignment in (sto, a3m):
        check_msa_matches(alignment, chain.sequence)
        assert alignment.deletions.shape == (len(alignment.rows), 70)
        assert all(len(r) == 70 for r in alignment.rows)
    # The Stockholm file has query gaps (insertions in other rows): they became deletion counts.
    assert sto.deletions.sum() > 0
    big = read_msa(DATA / "msas" / "1a00_A_uniref90.a3m.gz")
    assert len(big.query) == 141 and len(big.rows) > 1000


def test_msa_of_another_sequence_is_refused(chain):
    big = read_msa(DATA / "msas" / "1a00_A_uniref90.a3m.gz", max_rows=5)
    with pytest.raises(ProteinInputError, match="1a00_A_uniref90.a3m.gz.*another sequence"):
        check_msa_matches(big, chain.sequence)
    sto = read_msa(msa_path("2q2k_A/uniref90_hits.sto"))
    with pytest.raises(ProteinInputError, match="differs .* at 1 position"):
        check_msa_matches(sto, "A" + chain.sequence[1:])


def test_corrupt_files_name_the_file(tmp_path):
    bad = tmp_path / "broken.cif"
    bad.write_text("data_x\nloop_\n_atom_site.id\n_atom_site.Cartn_x\n1\n")
    with pytest.raises(ProteinInputError, match="broken.cif"):
        read_structure(bad)
    truncated = tmp_path / "cut.cif.gz"
    truncated.write_bytes(gzip.compress(b"data_x\n" * 100)[:40])
    with pytest.raises(ProteinInputError, match="cut.cif.gz"):
        read_structure(truncated)
    not_a3m = tmp_path / "x.a3m"
    not_a3m.write_text("ACDE\n>q\nACDE\n")
    with pytest.raises(ProteinInputError, match="x.a3m.*before the first"):
        read_msa(not_a3m)
    ragged = tmp_path / "r.a3m"
    ragged.write_text(">q\nACDE\n>h\nAC\n")
    with pytest.raises(ProteinInputError, match="r.a3m: row 2 covers 2"):
        read_msa(ragged)
    with pytest.raises(ProteinInputError, match="no protein chain 'Z'"):
        read_structure(structure_path("2q2k"), "Z")


def test_features_shapes_masks_and_crop(chain):
    sto = read_msa(msa_path("2q2k_A/uniref90_hits.sto"))
    cfg = FeatureConfig(crop_size=32, max_msa_clusters=4, max_extra_msa=6)
    rng = np.random.default_rng(0)
    window = crop_window(chain, 32, rng)
    start, end = observed_span(chain)
    assert start <= window[0] and window[1] <= end and window[1] - window[0] == 32
    f = make_features(chain, sto, cfg, rng, window)
    assert f["target_feat"].shape == (32, 22) and f["msa_feat"].shape == (4, 32, 49)
    assert f["extra_msa_feat"].shape == (6, 32, 25) and f["atom14_gt_positions"].shape == (32, 14, 3)
    # The query is the first cluster centre; its residues match aatype where not masked out.
    query = f["msa_feat"][0, :, :23].argmax(-1)
    unmasked = f["bert_mask"][0] == 0
    assert torch.equal(query[unmasked], f["aatype"][unmasked])
    assert torch.equal(f["true_msa"][0], f["aatype"])
    # Cluster profiles are distributions; ground truth frames are rotations where the backbone exists.
    assert torch.allclose(f["msa_feat"][..., 25:48].sum(-1), torch.ones(4, 32), atol=1e-5)
    rot = f["backbone_rot"][f["backbone_mask"] > 0]
    assert torch.allclose(rot @ rot.transpose(-1, -2), torch.eye(3).expand_as(rot), atol=1e-5)
    # A short chain is padded: masks are zero past its end.
    short = make_features(chain, None, FeatureConfig(crop_size=64, max_msa_clusters=2, max_extra_msa=2),
                          rng, (start, start + 20))
    assert short["seq_mask"].sum() == 20 and short["seq_mask"][20:].sum() == 0
    assert short["msa_mask"][1:].sum() == 0  # single-sequence MSA: one row


def test_fixed_training_crops_are_the_evaluated_crops():
    """data.random_crop=false: every training item of a chain is its fixed evaluation crop (same
    residues and coordinates; only the MSA sampling and masking are fresh)."""
    from apps.protein.dataset import CropDataset, fixed_crops, load_entries

    chains = load_entries([("2q2k", "A", "2q2k_A/uniref90_hits.sto")])
    cfg = FeatureConfig(crop_size=16, max_msa_clusters=4, max_extra_msa=4, random_crop=False)
    (_, evaluated), = fixed_crops(chains, cfg)
    data = CropDataset(chains, cfg)
    for _ in range(3):
        item = data[0]
        for key in ("aatype", "residue_index", "all_atom_positions", "backbone_trans"):
            torch.testing.assert_close(item[key], evaluated[key])
    randomised = CropDataset(chains, FeatureConfig(crop_size=16, max_msa_clusters=4, max_extra_msa=4))
    torch.manual_seed(0)
    starts = {int(randomised[0]["residue_index"][0]) for _ in range(6)}
    assert len(starts) > 1, "random crops should move"
