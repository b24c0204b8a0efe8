"""Template features from structures aligned to the query (AlphaFold 2 supplement 1.2.3, 1.7.1).

A template is a protein chain of an mmCIF file (read with biotite, `io.read_structure`) and an
alignment of the query to it. Two ways to give the alignment:

- an HHsearch `.hhr` hits file (`read_hhr`): each hit `No N` / `>1abc_A ...` with its `Q <query>`
  and `T 1abc_A` alignment lines; the hit name is `<PDB id>_<author chain>` and its mmCIF is looked
  up as `<template_dir>/<id>.cif[.gz]` (lower- or upper-case id). Template residue numbers are
  1-based positions in the chain's deposited sequence (mmCIF entity_poly, pdb70's SEQRES), and the
  aligned template letters must be that sequence's (checked; a mismatch is an error naming the
  residue);
- no alignment (`align_to_chain`): the query is aligned to the chain's sequence with biotite
  (Smith-Waterman, BLOSUM62, gap open -10 / extend -1) -- what `predict --template 1abc.cif:A` does;
- a search of a directory of mmCIF files (`search_templates`, no HHsearch and no network): the
  query aligned that way to every protein chain there, the hits kept as AlphaFold keeps them
  (supplement 1.2.3: released after the cutoff date dropped, near-identical copies of the query
  dropped, tiny alignments dropped), the best `max_templates` by alignment score -- what `predict
  --template-dir DIR` without an .hhr does, and training with `data.templates_from: search`
  (each chain only sees structures released before its own; searched once per chain when the
  dataset is built, `chain_template_hits`, the hits kept without coordinates, `StoredHit`).

`template_features(length, templates)` lays each template out on the query's residues:
`template_aatype` [T, L] (20 residues, X, 21 = gap where no template residue aligns),
`template_all_atom_positions` [T, L, 37, 3] and `template_all_atom_mask` [T, L, 37],
`template_pseudo_beta` (+ `_mask`), `template_mask` [T] (1 for a template, 0 for padding), and the
torsion angles of the template's atoms in query order (`template_torsion_sin_cos`, its
pi-periodic alternative and `template_torsion_mask`: omega and phi need the previous query
residue's template atoms, as in AlphaFold). The pair features (distogram, unit vectors, masks,
residue-type one-hots) are computed inside the model (`model/template.py`).
"""
from __future__ import annotations

import collections
import datetime
import functools
import hashlib
import json
import os
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from apps.protein import constants as rc
from apps.protein.io import ProteinChain, ProteinInputError, StructureEntry, _stem, _text, read_entry, read_structure
from apps.protein.model.template import TEMPLATE_KEYS
from apps.protein.sidechains import atom37_to_atom14, pseudo_beta, true_torsions

GAP_AATYPE = 21


@dataclass
class TemplateHit:
    """One alignment of the query to a template chain: aligned strings of equal length (gaps '-'),
    each starting at a 1-based residue number of its own sequence."""
    name: str
    query_start: int
    query_aligned: str
    template_start: int
    template_aligned: str

    def pairs(self) -> list[tuple[int, int]]:
        """[(query index, template index)], 0-based, for every column where both have a residue."""
        if len(self.query_aligned) != len(self.template_aligned):
            raise ProteinInputError(f"hit {self.name}: query and template alignment rows differ in length "
                                    f"({len(self.query_aligned)} vs {len(self.template_aligned)})")
        out, q, t = [], self.query_start - 1, self.template_start - 1
        for a, b in zip(self.query_aligned, self.template_aligned, strict=True):
            if a != "-" and b != "-":
                out.append((q, t))
            q += a != "-"
            t += b != "-"
        return out


@dataclass
class Template:
    """A template chain and the query residues its residues align to."""
    chain: ProteinChain
    pairs: list[tuple[int, int]]     # (query index, template index), 0-based

    @property
    def name(self) -> str:
        return self.chain.name


_ALIGN_LINE = re.compile(r"^([QT]) (\S+)\s+(\d+) ([A-Za-z\-.]+)\s+(\d+) \((\d+)\)")
_NOT_SEQUENCE = {"ss_pred", "ss_conf", "ss_dssp", "Consensus"}


def read_hhr(path: str | Path) -> list[TemplateHit]:
    """The hits of an HHsearch/HHblits `.hhr` file, in file order (their alignment blocks joined)."""
    path = Path(path)
    hits: list[TemplateHit] = []
    current: dict | None = None

    def close():
        if current is not None:
            if not current["q"] or not current["t"]:
                raise ProteinInputError(f"{path}: hit {current['name']} has no 'Q <query> ...' / 'T <template> ...' "
                                        "alignment lines; is this an .hhr file?")
            hits.append(TemplateHit(current["name"], current["q_start"], "".join(current["q"]), current["t_start"],
                                    "".join(current["t"])))

    for line in _text(path).splitlines():
        if line.startswith("No "):
            close()
            current = {"name": None, "q": [], "t": [], "q_start": None, "t_start": None}
        elif current is not None and line.startswith(">") and current["name"] is None:
            current["name"] = line[1:].split()[0]
        elif current is not None and (match := _ALIGN_LINE.match(line)):
            side, name, start, seq = match.group(1), match.group(2), int(match.group(3)), match.group(4)
            if name in _NOT_SEQUENCE:
                continue
            key = side.lower()
            if current[f"{key}_start"] is None:
                current[f"{key}_start"] = start
            current[key].append(seq.upper().replace(".", "-"))
    close()
    if not hits:
        raise ProteinInputError(f"{path}: no hit ('No 1' block with a '>name' line and Q/T alignment lines): "
                                "give an HHsearch .hhr file")
    return hits


def align_to_chain(query: str, chain: ProteinChain) -> TemplateHit:
    """The query aligned to the chain's sequence (biotite: local alignment, BLOSUM62, gaps -10/-1)."""
    return _align(query, chain)[0]


def _align(query: str, chain: ProteinChain) -> tuple[TemplateHit, int]:
    """(the hit, its alignment score)."""
    from biotite.sequence import ProteinSequence
    from biotite.sequence.align import SubstitutionMatrix, align_optimal

    def seq(s):
        return ProteinSequence("".join(a if a in rc.RESTYPES else "X" for a in s))
    alignment = align_optimal(seq(query), seq(chain.sequence), SubstitutionMatrix.std_protein_matrix(),
                              gap_penalty=(-10, -1), local=True, max_number=1)[0]
    score = int(alignment.score)
    trace = alignment.trace
    q_rows, t_rows = [], []
    for qi, ti in trace:
        q_rows.append(query[qi] if qi >= 0 else "-")
        t_rows.append(chain.sequence[ti] if ti >= 0 else "-")
    first = trace[0]
    return TemplateHit(chain.name, int(first[0]) + 1, "".join(q_rows), int(first[1]) + 1, "".join(t_rows)), score


def find_structure(hit_name: str, template_dir: str | Path) -> tuple[Path, str]:
    """(mmCIF path, author chain) of a hit named `<PDB id>_<chain>` under `template_dir`."""
    if "_" not in hit_name:
        raise ProteinInputError(f"template hit {hit_name!r}: expected a name <PDB id>_<chain> (e.g. 1aki_A)")
    stem, chain = hit_name.rsplit("_", 1)
    directory = Path(template_dir)
    for name in (stem, stem.lower(), stem.upper()):
        for ext in (".cif.gz", ".cif"):
            if (directory / f"{name}{ext}").is_file():
                return directory / f"{name}{ext}", chain
    raise ProteinInputError(f"template hit {hit_name}: no {stem}.cif or {stem}.cif.gz in {directory}; download the "
                            "mmCIF there or pass --template-dir")


def template_from_hit(hit: TemplateHit, query: str, chain: ProteinChain, where: str = "") -> Template:
    """Check the hit's letters against the query and the chain's sequence, and keep its pairs."""
    pairs = hit.pairs()
    for q, t in pairs:
        if not 0 <= q < len(query):
            raise ProteinInputError(f"{where}hit {hit.name}: query residue {q + 1} is beyond the query's {len(query)}")
        if not 0 <= t < len(chain.sequence):
            raise ProteinInputError(f"{where}hit {hit.name}: template residue {t + 1} is beyond {chain.name}'s "
                                    f"{len(chain.sequence)}-residue sequence")
    q_letters = [a for a in hit.query_aligned if a != "-"]
    for k, a in enumerate(q_letters):
        q = hit.query_start - 1 + k
        if a not in "X" and q < len(query) and query[q] not in ("X", a):
            raise ProteinInputError(f"{where}hit {hit.name}: query residue {q + 1} is {a} in the alignment but "
                                    f"{query[q]} in the query sequence: the hits were searched with another sequence")
    t_letters = [a for a in hit.template_aligned if a != "-"]
    for k, a in enumerate(t_letters):
        t = hit.template_start - 1 + k
        if t < len(chain.sequence) and a != "X" and chain.sequence[t] not in ("X", a):
            raise ProteinInputError(f"{where}hit {hit.name}: template residue {t + 1} is {a} in the alignment but "
                                    f"{chain.sequence[t]} in {chain.name}'s mmCIF sequence: the alignment numbers "
                                    "residues of another sequence (give the template's entity_poly/SEQRES numbering)")
    return Template(chain, pairs)


def templates_from_hhr(path: str | Path, query: str, template_dir: str | Path, max_templates: int,
                       exclude: tuple[str, ...] = ()) -> list[Template]:
    """The first `max_templates` hits of an .hhr file whose mmCIF is in `template_dir` (hits named
    in `exclude`, e.g. the query's own PDB entry, skipped)."""
    out = []
    for hit in read_hhr(path):
        if len(out) == max_templates:
            break
        if hit.name.split("_")[0].lower() in {e.lower() for e in exclude}:
            continue
        file, chain_id = find_structure(hit.name, template_dir)
        chain = read_structure(file, chain_id)
        out.append(template_from_hit(hit, query, chain, f"{path}: "))
    return out


# AlphaFold's template filters (supplement 1.2.3; its TemplateHitFeaturizer): a hit that is a copy of
# the query -- more than 95% identical over more than 95% of the query -- is dropped (it would give the
# answer away), and so is one whose alignment covers under 10% of the query.
MAX_IDENTITY = 0.95
MAX_COVERAGE = 0.95
MIN_ALIGNED_SHARE = 0.10


@dataclass
class SearchHit:
    """A template chain kept by `search_templates`, with what it was ranked and filtered by."""
    template: Template
    score: int                     # the local alignment's score (BLOSUM62, gaps -10/-1): the ranking
    identity: float                # identical residues / aligned residue pairs
    coverage: float                # aligned residue pairs / query length
    release_date: datetime.date
    path: Path | None = None       # the template's mmCIF file
    alignment: TemplateHit | None = None   # the query aligned to the chain (what `template` was built from)

    @property
    def name(self) -> str:
        return self.template.name


def parse_date(value: str | datetime.date | None, what: str) -> datetime.date | None:
    """A YYYY-MM-DD date (None or '' for none); a clear error for anything else."""
    if value is None or value == "" or isinstance(value, datetime.date):
        return value or None
    try:
        return datetime.date.fromisoformat(str(value))
    except ValueError:
        raise ValueError(f"{what}={value!r}: give a date as YYYY-MM-DD (e.g. 2018-04-30)") from None


def entry_date(entry: StructureEntry) -> datetime.date | None:
    """When the entry became public: its first release (the earliest revision date), else its
    deposition date (earlier than the release, so never later than the truth)."""
    return entry.release_date or entry.deposition_date


@functools.lru_cache(maxsize=8)
def _read_directory(directory: str, listing: tuple[tuple[str, float], ...]) -> tuple[StructureEntry, ...]:
    return tuple(read_entry(Path(directory) / name) for name, _ in listing)


def template_entries(template_dir: str | Path) -> tuple[StructureEntry, ...]:
    """Every mmCIF file (`*.cif`, `*.cif.gz`) of a directory, read once per process (re-read when a
    file's modification time changes)."""
    directory = Path(template_dir)
    files = _mmcif_files(directory)
    return _read_directory(str(directory.resolve()), tuple((p.name, p.stat().st_mtime) for p in files))


def _mmcif_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise ProteinInputError(f"template directory {directory}: no such directory (give a folder of mmCIF files, "
                                "<pdb id>.cif or .cif.gz)")
    files = sorted(p for p in directory.iterdir() if p.name.endswith((".cif", ".cif.gz")) and p.is_file())
    if not files:
        raise ProteinInputError(f"template directory {directory}: holds no .cif or .cif.gz file")
    return files


def entry_id(name: str) -> str:
    """The PDB entry of a chain or file name: '3zee_A' -> '3zee'."""
    return name.rsplit("_", 1)[0].lower()


def search_templates(query: str, template_dir: str | Path, max_templates: int,
                     max_date: str | datetime.date | None = None, before: bool = False,
                     exclude: tuple[str, ...] = ()) -> list[SearchHit]:
    """The query aligned to every protein chain of the mmCIF files in `template_dir`, filtered as
    AlphaFold filters its hits and ranked by alignment score (ties: name), at most `max_templates`:

    - `max_date`: entries released after it are dropped (`before=True`: on or after it, which is
      how training keeps a chain from its own entry and anything later); an entry without any
      date is dropped when there is a cutoff;
    - a copy of the query (identity > 95% over > 95% of the query) is dropped, and an alignment of
      fewer than 10% of the query's residues;
    - `exclude`: PDB entries never used (e.g. the query's own);
    - chains of one entry with the same sequence count once (the first)."""
    cutoff = parse_date(max_date, "max_date")
    skip = {e.lower() for e in exclude}
    hits = []
    for entry in template_entries(template_dir):
        date = entry_date(entry)
        if cutoff is not None and (date is None or date > cutoff or (before and date == cutoff)):
            continue
        seen = set()
        for chain in entry.chains:
            if entry_id(chain.name) in skip or chain.sequence in seen:
                continue
            seen.add(chain.sequence)
            hit, score = _align(query, chain)
            pairs = hit.pairs()
            if not pairs:
                continue
            same = sum(query[q] == chain.sequence[t] for q, t in pairs)
            identity, coverage = same / len(pairs), len(pairs) / len(query)
            if coverage < MIN_ALIGNED_SHARE or (identity > MAX_IDENTITY and coverage > MAX_COVERAGE):
                continue
            hits.append(SearchHit(template_from_hit(hit, query, chain, f"{entry.path}: "), score, identity, coverage,
                                  date, entry.path, hit))
    hits.sort(key=lambda h: (-h.score, h.name))
    return hits[:max_templates]


# -------------------------------------------------------- training's search (data.templates_from: search)
# Run once per chain when the dataset is built (`chain_template_hits`), never per training item: the
# dataset keeps each chain's hits -- which chain of which file, and the alignment, no coordinates --
# and the item builder reads the hit chains (once per process, `load_templates`) and cuts features.
SEARCH_VERSION = 1   # part of the cache key: raise it when the search or its filters change
HITS_CACHE_PREFIX = "template_hits-"


@dataclass
class StoredHit:
    """One template hit as a dataset keeps it: where the template chain is and how the query aligns
    to it (no coordinates)."""
    file: str            # the template's mmCIF file
    chain_id: str        # its author chain id
    hit: TemplateHit     # the query aligned to that chain (name <entry>_<chain>, 1-based starts)
    score: int           # the alignment score it was ranked by

    @property
    def name(self) -> str:
        return self.hit.name

    def to_json(self) -> dict:
        h = self.hit
        return {"file": self.file, "chain_id": self.chain_id, "score": self.score, "name": h.name,
                "query_start": h.query_start, "query_aligned": h.query_aligned,
                "template_start": h.template_start, "template_aligned": h.template_aligned}

    @staticmethod
    def from_json(d: dict) -> "StoredHit":
        return StoredHit(d["file"], d["chain_id"], TemplateHit(d["name"], d["query_start"], d["query_aligned"],
                                                             d["template_start"], d["template_aligned"]), d["score"])


def _own_release_date(name: str, template_dir: str) -> datetime.date:
    own = entry_id(name)
    dates = {entry_id(e.path.name.split(".")[0]): entry_date(e) for e in template_entries(template_dir)}
    if dates.get(own) is None:
        from apps.protein.data_sets import structure_path
        path = structure_path(own)
        if not path.is_file():
            raise ProteinInputError(f"chain {name}: its release date is unknown (no {own}.cif[.gz] with a date in "
                                    f"{template_dir} or the shipped structures), so templates cannot be searched "
                                    "before it; use data.templates_from=self or none")
        dates[own] = entry_date(read_entry(path))
    return dates[own]


def search_training_hits(name: str, sequence: str, template_dir: str | Path, max_templates: int
                         ) -> tuple[StoredHit, ...]:
    """One training or evaluation chain's search (`data.templates_from: search`): `search_templates`
    of `template_dir` restricted to entries released before the chain's own entry, and never that
    entry, so a chain sees neither itself nor a later structure."""
    own = entry_id(name)
    hits = search_templates(sequence, template_dir, max_templates, _own_release_date(name, str(template_dir)),
                            before=True, exclude=(own,))
    out = tuple(StoredHit(str(h.path), h.name[len(_stem(h.path)) + 1:], h.alignment, h.score) for h in hits)
    for stored, h in zip(out, hits, strict=True):
        _keep_chain(stored.file, stored.chain_id, h.template.chain)
    return out


def _listing(directory: Path) -> list[tuple[str, int, int]]:
    return [(p.name, st.st_size, st.st_mtime_ns) for p in _mmcif_files(directory) for st in (p.stat(),)]


def search_key(template_dir: str | Path, max_templates: int) -> str:
    """What a chain's hits depend on besides its name and sequence: the search settings and the
    contents (names, sizes, modification times) of the template folder and of the shipped structures
    (where a chain's own release date is read when the folder lacks its entry)."""
    from apps.protein.data_sets import STRUCTURES

    directory = Path(template_dir).resolve()
    settings = [SEARCH_VERSION, max_templates, MAX_IDENTITY, MAX_COVERAGE, MIN_ALIGNED_SHARE, "BLOSUM62", -10, -1]
    text = json.dumps([settings, str(directory), _listing(directory),
                       _listing(STRUCTURES) if STRUCTURES.resolve() != directory else []])
    return hashlib.sha256(text.encode()).hexdigest()


# This process's searched chains: (search key, chain name, sequence) -> hits.
_SEARCHED: dict[tuple[str, str, str], tuple[StoredHit, ...]] = {}


def _read_hits_cache(file: Path, key: str, wanted: dict[str, str]) -> dict[str, tuple[StoredHit, ...]]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
        if data.get("key") != key:
            return {}
        return {name: tuple(StoredHit.from_json(h) for h in entry["hits"]) for name, entry in data["chains"].items()
                if wanted.get(name) == entry["sequence"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        warnings.warn(f"template hits cache {file} unreadable ({exc}); searching again and rewriting it")
        return {}


def _write_hits_cache(file: Path, key: str, template_dir: str, hits: dict[str, tuple[StoredHit, ...]],
                      sequences: dict[str, str]) -> None:
    """Merge `hits` into the cache file (atomically: a reader sees the old file or the new one)."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(file.read_text()) if file.is_file() else {}
        chains = old.get("chains", {}) if old.get("key") == key else {}
    except (OSError, ValueError):
        chains = {}
    chains.update({name: {"sequence": sequences[name], "hits": [h.to_json() for h in hs]} for name, hs in hits.items()})
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"key": key, "template_dir": template_dir, "version": SEARCH_VERSION,
                                   "chains": chains}))
        os.replace(tmp, file)
    except OSError as exc:               # a read-only place: the run goes on without the cache
        warnings.warn(f"template hits cache {file} not written ({exc}); set data.template_hits_cache to a writable "
                      "folder, or '' for none")
        tmp.unlink(missing_ok=True)


def chain_template_hits(chains: list[ProteinChain], template_dir: str | Path, max_templates: int,
                        cache_dir: str | Path | None = None, distributed: bool = True
                        ) -> dict[str, tuple[StoredHit, ...]]:
    """Every chain's template hits (`search_training_hits`), keyed by chain name: searched once per
    chain and process, or read from `<cache_dir>/template_hits-<key>.json` (keyed by the chain's
    name and sequence, the folder's contents and the search settings: `search_key`).

    Under torch.distributed (`distributed`, every rank calls this with the same chains) rank 0's
    known hits (this process's and the cache file's) are broadcast, the rest are searched split over
    the ranks (chain k on rank k mod world) and gathered, so every rank ends with the same hits
    whichever rank searched them; rank 0 writes the cache file."""
    import torch.distributed as dist

    if not chains:
        return {}
    directory = str(Path(template_dir).resolve())
    key = search_key(directory, max_templates)
    wanted: dict[str, str] = {}
    for chain in chains:
        if wanted.setdefault(chain.name, chain.sequence) != chain.sequence:
            raise ProteinInputError(f"two chains named {chain.name} with different sequences: the template hits are "
                                    "kept by chain name, so give each chain its own name")
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed and dist.is_available() \
        and dist.is_initialized() else (1, 0)
    known = {name: _SEARCHED[key, name, seq] for name, seq in wanted.items() if (key, name, seq) in _SEARCHED}
    file = Path(cache_dir) / f"{HITS_CACHE_PREFIX}{key[:20]}.json" if cache_dir else None
    remembered = len(known)
    if rank == 0 and file is not None and len(known) < len(wanted):
        known = _read_hits_cache(file, key, wanted) | known
    from_file = len(known) - remembered
    if world > 1:
        from phalanx.json_collectives import all_gather_json, broadcast_json

        shared = broadcast_json({n: [h.to_json() for h in hs] for n, hs in known.items()} if rank == 0 else None)
        known = {n: tuple(StoredHit.from_json(h) for h in hs) for n, hs in shared.items()}
    missing = [name for name in wanted if name not in known]
    started = time.perf_counter()
    found = {name: search_training_hits(name, wanted[name], directory, max_templates) for name in missing[rank::world]}
    if world > 1:
        parts = all_gather_json({n: [h.to_json() for h in hs] for n, hs in found.items()})
        found = {n: tuple(StoredHit.from_json(h) for h in hs) for part in parts for n, hs in part.items()}
    if rank == 0 and file is not None and found:
        _write_hits_cache(file, key, directory, found, wanted)
    if rank == 0 and (found or from_file):
        print(f"template search of {directory}: {len(wanted)} chains, {len(found)} searched"
              f"{f' over {world} ranks' if world > 1 else ''} in {time.perf_counter() - started:.1f} s"
              + (f", {from_file} read from {file}" if from_file else ""), flush=True)
    hits = known | found
    for name, seq in wanted.items():
        _SEARCHED[key, name, seq] = hits[name]
    return {name: hits[name] for name in wanted}


# The hit chains this process has read (file, chain id) -> chain, the least recently used dropped past
# MAX_TEMPLATE_CHAINS: filled by the search and by `preload_templates` when a dataset is built, so the
# data-loader workers forked from that process find them instead of reading the mmCIF files again.
_TEMPLATE_CHAINS: collections.OrderedDict[tuple[str, str], ProteinChain] = collections.OrderedDict()
MAX_TEMPLATE_CHAINS = 4096


def _keep_chain(file: str, chain_id: str, chain: ProteinChain) -> ProteinChain:
    _TEMPLATE_CHAINS[file, chain_id] = chain
    _TEMPLATE_CHAINS.move_to_end((file, chain_id))
    while len(_TEMPLATE_CHAINS) > MAX_TEMPLATE_CHAINS:
        _TEMPLATE_CHAINS.popitem(last=False)
    return chain


def _template_chain(file: str, chain_id: str) -> ProteinChain:
    chain = _TEMPLATE_CHAINS.get((file, chain_id))
    return _keep_chain(file, chain_id, chain if chain is not None else read_structure(file, chain_id))


def preload_templates(hits: dict[str, tuple[StoredHit, ...]]) -> None:
    """Every hit chain of `hits` in this process (each file read once, and not at all for a chain the
    search already read), so items cut template features without reading files."""
    need: dict[str, set[str]] = {}
    for stored in hits.values():
        for h in stored:
            if (h.file, h.chain_id) not in _TEMPLATE_CHAINS:
                need.setdefault(h.file, set()).add(h.chain_id)
    for file, chain_ids in need.items():
        entry = read_entry(file)
        for chain in entry.chains:
            chain_id = chain.name[len(_stem(entry.path)) + 1:]
            if chain_id in chain_ids:
                _keep_chain(file, chain_id, chain)


def load_templates(hits: tuple[StoredHit, ...] | list[StoredHit], query: str) -> list[Template]:
    """The templates of stored hits: each hit chain taken from this process's record (read from its
    file the first time) and the alignment checked against the query and the chain (a stale or
    misattributed hit is an error)."""
    return [template_from_hit(h.hit, query, _template_chain(h.file, h.chain_id), f"{h.file}: ") for h in hits]


def training_templates(chain: ProteinChain, template_dir: str | Path, max_templates: int) -> list[Template]:
    """A training or evaluation chain's templates (`search_training_hits`), searched once per chain
    and process (datasets search all their chains when built: `chain_template_hits`)."""
    hits = chain_template_hits([chain], template_dir, max_templates, distributed=False)[chain.name]
    return load_templates(hits, chain.sequence)


def self_template(chain: ProteinChain) -> Template:
    """The chain as its own template (every residue aligned to itself): for tests and for
    exercising the path; a model trained with it learns to copy."""
    return Template(chain, [(i, i) for i in range(len(chain.sequence))])


def template_features(length: int, templates: list[Template], max_templates: int) -> dict[str, torch.Tensor]:
    """The template inputs of a query of `length` residues, [max_templates, length, ...] (absent
    templates zero, `template_mask` 0)."""
    if max_templates < 1:
        raise ValueError(f"max_templates={max_templates}: template features need room for at least one template "
                         "(data.max_templates)")
    templates = templates[:max_templates]
    t_count = max_templates
    aatype = np.full((t_count, length), GAP_AATYPE, np.int64)
    xyz = np.zeros((t_count, length, 37, 3), np.float32)
    mask = np.zeros((t_count, length, 37), np.float32)
    present = np.zeros(t_count, np.float32)
    for k, template in enumerate(templates):
        if not template.pairs:
            continue
        q, t = np.array(template.pairs).T
        aatype[k, q] = template.chain.aatype[t]
        xyz[k, q] = template.chain.atom37[t]
        mask[k, q] = template.chain.atom37_mask[t]
        present[k] = 1.0
    aatype_t, xyz_t, mask_t = torch.as_tensor(aatype), torch.as_tensor(xyz), torch.as_tensor(mask)
    pb, pb_mask = pseudo_beta(xyz_t, aatype_t, mask_t)
    as_residue = aatype_t.clamp(max=rc.UNK)                 # a gap has no atoms: treat as X for the tables
    sin_cos, alt, tmask = [], [], []
    for k in range(t_count):
        atom14, mask14 = atom37_to_atom14(xyz_t[k], mask_t[k], as_residue[k])
        a, b, c = true_torsions(atom14, mask14, as_residue[k])
        sin_cos.append(a)
        alt.append(b)
        tmask.append(c)
    out = {"template_aatype": aatype_t, "template_all_atom_positions": xyz_t, "template_all_atom_mask": mask_t,
           "template_mask": torch.as_tensor(present), "template_pseudo_beta": pb, "template_pseudo_beta_mask": pb_mask,
           "template_torsion_sin_cos": torch.stack(sin_cos), "template_alt_torsion_sin_cos": torch.stack(alt),
           "template_torsion_mask": torch.stack(tmask)}
    assert set(out) == set(TEMPLATE_KEYS)
    return out
