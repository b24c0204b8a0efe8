"""Reading the field's files: mmCIF/PDB structures (biotite), FASTA (biotite), A3M and Stockholm MSAs.

Each reader stops with `ProteinInputError` naming the file and what is wrong with it.
"""
from __future__ import annotations

import datetime
import gzip
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from apps.protein import constants as rc


class ProteinInputError(ValueError):
    """A structure, sequence or alignment file that cannot be used; the message names file and fix."""


@dataclass
class ProteinChain:
    """One chain: the full sequence, and atom37 coordinates where the structure observed them."""
    name: str
    sequence: str                # one-letter, the deposited (SEQRES) sequence when the file has it
    atom37: np.ndarray           # [L, 37, 3] float32, zeros where unobserved
    atom37_mask: np.ndarray      # [L, 37] float32
    residue_index: np.ndarray    # [L] int64, 0-based position in the sequence

    @property
    def aatype(self) -> np.ndarray:
        return np.array([rc.ONE_TO_INDEX.get(a, rc.UNK) for a in self.sequence], np.int64)

    def __len__(self) -> int:
        return len(self.sequence)


def _text(path: Path) -> str:
    if not path.is_file():
        raise ProteinInputError(f"{path}: no such file")
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt") as f:
                return f.read()
        return path.read_text()
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise ProteinInputError(f"{path}: cannot be read as text ({exc}); is it a corrupt or binary file?") from exc


def _stem(path: Path) -> str:
    name = path.name
    for ext in (".gz", ".cif", ".mmcif", ".pdb", ".ent"):
        name = name.removesuffix(ext)
    return name


def _parse_structure(path: Path, need_protein: bool = True):
    """(protein atoms of the first model, {author chain: SEQRES}, the CIF file or None, chain ids);
    no protein chain is an error when `need_protein`."""
    import biotite.structure as struc

    text = _text(path)
    is_cif = ".cif" in path.name or ".mmcif" in path.name
    cif = None
    try:
        if is_cif:
            import biotite.structure.io.pdbx as pdbx
            cif = pdbx.CIFFile.read(io.StringIO(text))
            atoms = pdbx.get_structure(cif, model=1, extra_fields=["label_seq_id", "label_entity_id"])
            seqres = _entity_sequences(cif)
        else:
            import biotite.structure.io.pdb as pdb
            atoms = pdb.PDBFile.read(io.StringIO(text)).get_structure(model=1)
            seqres = {}
    except Exception as exc:  # biotite raises many types for malformed files
        raise ProteinInputError(f"{path}: not a readable {'mmCIF' if is_cif else 'PDB'} file ({type(exc).__name__}: "
                                f"{exc}); check the file is complete and in that format") from exc
    protein = atoms[struc.filter_amino_acids(atoms) & ~atoms.hetero]
    chains = list(dict.fromkeys(protein.chain_id.tolist()))
    if not chains and need_protein:
        raise ProteinInputError(f"{path}: holds no protein chain (no standard amino-acid residues)")
    return protein, seqres, cif, chains


def read_structure(path: str | Path, chain: str | None = None) -> ProteinChain:
    """The protein chain `chain` (author chain id; default: the first protein chain) of an mmCIF
    (.cif, .cif.gz) or PDB file, first model only."""
    path = Path(path)
    protein, seqres, _, chains = _parse_structure(path)
    if chain is None:
        chain = chains[0]
    if chain not in chains:
        raise ProteinInputError(f"{path}: no protein chain {chain!r}; it has {', '.join(chains)}")
    atoms = protein[protein.chain_id == chain]
    return _chain_from_atoms(f"{_stem(path)}_{chain}", atoms, seqres.get(chain), path)


@dataclass
class StructureEntry:
    """Every protein chain of one mmCIF file, with the entry's dates (None where the file has none)."""
    path: Path
    chains: list[ProteinChain]
    release_date: datetime.date | None      # the first _pdbx_audit_revision_history.revision_date
    deposition_date: datetime.date | None   # _pdbx_database_status.recvd_initial_deposition_date


def _cif_dates(cif, key: str) -> list[datetime.date]:
    category, _, field = key.partition(".")
    block = cif.block
    if category not in block or field not in block[category]:
        return []
    out = []
    for value in block[category][field].as_array():
        try:
            out.append(datetime.date.fromisoformat(str(value).strip()))
        except ValueError:
            continue                     # '?' or '.': no date
    return out


def read_entry(path: str | Path) -> StructureEntry:
    """All protein chains of an mmCIF file (first model; none for a nucleic-acid or ligand-only
    entry) and its release and deposition dates."""
    path = Path(path)
    protein, seqres, cif, chains = _parse_structure(path, need_protein=False)
    if cif is None:
        raise ProteinInputError(f"{path}: an mmCIF file is needed here (it carries the release date); got a PDB file")
    out = [_chain_from_atoms(f"{_stem(path)}_{c}", protein[protein.chain_id == c], seqres.get(c), path) for c in chains]
    released = _cif_dates(cif, "pdbx_audit_revision_history.revision_date")
    deposited = _cif_dates(cif, "pdbx_database_status.recvd_initial_deposition_date")
    return StructureEntry(path, out, min(released) if released else None, min(deposited) if deposited else None)


def _entity_sequences(cif) -> dict[str, str]:
    """{author chain id: canonical one-letter sequence} from the entity_poly category."""
    block = cif.block
    if "entity_poly" not in block:
        return {}
    poly = block["entity_poly"]
    out = {}
    for strands, seq in zip(poly["pdbx_strand_id"].as_array(), poly["pdbx_seq_one_letter_code_can"].as_array()):
        seq = "".join(str(seq).split())
        for strand in str(strands).split(","):
            out[strand.strip()] = seq
    return out


def _chain_from_atoms(name: str, atoms, seqres: str | None, path: Path) -> ProteinChain:
    import biotite.structure as struc

    starts = struc.get_residue_starts(atoms)
    use_label = seqres is not None and "label_seq_id" in atoms.get_annotation_categories()
    if use_label:
        positions = np.array([int(atoms.label_seq_id[s]) - 1 for s in starts])
        sequence = seqres
        if positions.min() < 0 or positions.max() >= len(sequence):
            raise ProteinInputError(f"{path}: chain {name} numbers residues outside its sequence of {len(sequence)}")
    else:
        positions = np.arange(len(starts))
        sequence = "".join(rc.RESTYPES[rc.THREE_TO_INDEX[rc.MODIFIED.get(atoms.res_name[s], atoms.res_name[s])]]
                           if rc.MODIFIED.get(atoms.res_name[s], atoms.res_name[s]) in rc.THREE_TO_INDEX else "X"
                           for s in starts)
    length = len(sequence)
    xyz = np.zeros((length, 37, 3), np.float32)
    mask = np.zeros((length, 37), np.float32)
    ends = list(starts[1:]) + [atoms.array_length()]
    for pos, s, e in zip(positions, starts, ends):
        resname = rc.MODIFIED.get(atoms.res_name[s], atoms.res_name[s])
        if use_label and resname in rc.THREE_TO_INDEX and rc.RESTYPES[rc.THREE_TO_INDEX[resname]] != sequence[pos] \
                and sequence[pos] != "X":
            raise ProteinInputError(f"{path}: chain {name} residue {pos + 1} is {resname} in the coordinates but "
                                    f"{sequence[pos]} in entity_poly; the file is inconsistent")
        for k in range(s, e):
            atom = "SD" if atoms.atom_name[k] == "SE" and resname == "MET" else atoms.atom_name[k]
            j = rc.ATOM37_INDEX.get(atom)
            if j is not None and mask[pos, j] == 0:
                xyz[pos, j] = atoms.coord[k]
                mask[pos, j] = 1.0
    if not np.isfinite(xyz).all():
        raise ProteinInputError(f"{path}: chain {name} has non-finite coordinates")
    return ProteinChain(name, sequence, xyz, mask, np.arange(length, dtype=np.int64))


def read_fasta(path: str | Path) -> list[tuple[str, str]]:
    """[(header, sequence)] of a FASTA file (biotite's reader), sequences upper-case."""
    from biotite.sequence.io.fasta import FastaFile

    path = Path(path)
    text = _text(path)
    try:
        fasta = FastaFile.read(io.StringIO(text))
        records = [(h, s.replace(" ", "").upper()) for h, s in fasta.items()]
    except Exception as exc:
        raise ProteinInputError(f"{path}: not a FASTA file ({exc}); records start with '>name'") from exc
    if not records:
        raise ProteinInputError(f"{path}: holds no FASTA record (a line '>name' then the sequence)")
    for header, seq in records:
        bad = sorted(set(seq) - set(rc.RESTYPES + "XBZUOJ"))
        if bad or not seq:
            raise ProteinInputError(f"{path}: record {header!r} is not a protein sequence (letters {bad})"
                                    if bad else f"{path}: record {header!r} is empty")
    return records


@dataclass
class Alignment:
    """An MSA aligned to its query: `rows` of query length (gaps '-'), and per row how many
    residues were deleted (inserted relative to the query) before each column."""
    rows: list[str]
    deletions: np.ndarray  # [N, L] int32
    source: str

    @property
    def query(self) -> str:
        return self.rows[0]


def _split_insertions(aligned: str) -> tuple[str, list[int]]:
    """A3M row -> (the row on query columns, deletions before each column): lower-case letters
    and '.' are insertions relative to the query."""
    row, dels, run = [], [], 0
    for ch in aligned:
        if ch.islower() or ch == ".":
            run += ch != "."
            continue
        row.append(ch)
        dels.append(run)
        run = 0
    return "".join(row), dels


def read_a3m(path: str | Path, max_rows: int | None = None) -> Alignment:
    path = Path(path)
    rows, headers = [], []
    for line in _text(path).splitlines():
        line = line.strip()
        if not line or line.startswith("#") or line.startswith(";"):
            continue
        if line.startswith(">"):
            headers.append(line[1:])
            rows.append("")
        elif not rows:
            raise ProteinInputError(f"{path}: sequence text before the first '>' header: not an A3M file")
        else:
            rows[-1] += line
    return _alignment(path, rows, [_split_insertions(r) for r in rows], max_rows)


def read_stockholm(path: str | Path, max_rows: int | None = None) -> Alignment:
    """Stockholm: columns where the query (first sequence) has a gap become deletions."""
    path = Path(path)
    text = _text(path)
    if not text.lstrip().startswith("# STOCKHOLM"):
        raise ProteinInputError(f"{path}: does not start with '# STOCKHOLM 1.0': not a Stockholm file")
    seqs: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#") or line.startswith("//"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ProteinInputError(f"{path}: malformed alignment line {line[:60]!r} (expected 'name sequence')")
        seqs[parts[0]] = seqs.get(parts[0], "") + parts[1]
    rows = list(seqs.values())
    if not rows:
        raise ProteinInputError(f"{path}: holds no aligned sequence")
    query = rows[0]
    keep = [c not in "-." for c in query]
    parsed = []
    for r in rows:
        if len(r) != len(query):
            raise ProteinInputError(f"{path}: rows have different lengths ({len(r)} vs the query's {len(query)})")
        out, dels, run = [], [], 0
        for ch, k in zip(r, keep):
            if not k:
                run += ch not in "-."
                continue
            out.append("-" if ch == "." else ch.upper())
            dels.append(run)
            run = 0
        parsed.append(("".join(out), dels))
    return _alignment(path, rows, parsed, max_rows)


def _alignment(path: Path, raw: list[str], parsed: list[tuple[str, list[int]]], max_rows: int | None) -> Alignment:
    if not parsed:
        raise ProteinInputError(f"{path}: holds no sequence")
    length = len(parsed[0][0])
    seen, rows, dels = set(), [], []
    for i, (row, d) in enumerate(parsed):
        if len(row) != length:
            raise ProteinInputError(f"{path}: row {i + 1} covers {len(row)} query columns, the query has {length}: "
                                    "the alignment is corrupt")
        if row in seen:  # AlphaFold drops duplicate rows
            continue
        seen.add(row)
        rows.append(row)
        dels.append(d)
        if max_rows is not None and len(rows) >= max_rows:
            break
    return Alignment(rows, np.asarray(dels, np.int32), str(path))


def read_msa(path: str | Path, max_rows: int | None = None) -> Alignment:
    """An A3M (.a3m, .a3m.gz) or Stockholm (.sto) alignment."""
    name = Path(path).name
    if ".sto" in name:
        return read_stockholm(path, max_rows)
    if ".a3m" in name:
        return read_a3m(path, max_rows)
    raise ProteinInputError(f"{path}: unknown alignment format; use .a3m (A3M) or .sto (Stockholm)")


def check_msa_matches(alignment: Alignment, sequence: str, what: str = "the sequence") -> None:
    """The MSA's query row must be the sequence being predicted (gaps aside)."""
    query = alignment.query
    if len(query) != len(sequence):
        raise ProteinInputError(f"{alignment.source}: its query has {len(query)} residues but {what} has "
                                f"{len(sequence)}: the MSA belongs to another sequence (give the alignment "
                                "computed for this sequence)")
    mismatches = [i for i, (a, b) in enumerate(zip(query, sequence)) if a != "-" and a != b and b != "X"]
    if mismatches:
        i = mismatches[0]
        raise ProteinInputError(f"{alignment.source}: its query differs from {what} at {len(mismatches)} position(s), "
                                f"first at residue {i + 1} ({query[i]} vs {sequence[i]}): the MSA belongs to "
                                "another sequence")
