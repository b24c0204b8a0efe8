"""Reading text corpora into documents, and the fixed held-out split.

A corpus is a file (optionally gzip-compressed) in one of three layouts:

- `txt`: documents separated by a blank line (the Chinese classics: one poem per paragraph).
  Consecutive paragraphs can be grouped until a document reaches `min_doc_chars`, for texts such
  as plays where one paragraph is a single speech.
- `jsonl`: one JSON object per line, the text under `text_field`.
- `json`: a JSON list of such objects.

Each document carries a `category` (for per-category statistics, bins and evaluation): a record's
own `category` field wins over the source's `category`.

The held-out split is a pure function of the document's text (a CRC32 of it), so it is the same
whatever the order of files, the number of workers or the tokenizer: every tokenizer and every run
is evaluated on exactly the same characters.
"""
from __future__ import annotations

import gzip
import io
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

REPO_ROOT = Path(__file__).resolve().parents[2]


class CorpusError(ValueError):
    """A corpus file is missing or malformed; the message names the file, the line and the fix."""


@dataclass
class SourceConfig:
    """One corpus file and how to read it."""

    path: str
    category: str = "default"
    format: Literal["auto", "txt", "jsonl", "json"] = "auto"
    text_field: str = "text"
    min_doc_chars: int = 0  # txt only: join paragraphs until a document has this many characters
    max_docs: int = 0  # 0 reads all documents; otherwise the first max_docs
    max_chars: int = 0  # 0 reads all documents; otherwise stop once this many characters are read


@dataclass(frozen=True)
class Document:
    text: str
    category: str


def resolve_path(path: str | Path) -> Path:
    """A path as given, else relative to the repository root (configs name `apps/llama/data/...`,
    which then also works when the command runs from another directory)."""
    p = Path(path).expanduser()
    if p.exists() or p.is_absolute():
        return p
    alt = REPO_ROOT / p
    return alt if alt.exists() else p


def _open_text(path: Path) -> io.TextIOBase:
    if not path.is_file():
        raise CorpusError(f"corpus file {str(path)!r} does not exist; fix the `path` of this source in the config")
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")


def detect_format(path: Path) -> str:
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    for suffix, fmt in ((".jsonl", "jsonl"), (".json", "json"), (".txt", "txt")):
        if name.endswith(suffix):
            return fmt
    raise CorpusError(f"cannot tell the format of {str(path)!r} from its name; set `format: txt|jsonl|json` in its source")


def read_records(path: str | Path, fmt: str = "auto") -> Iterator[tuple[int, dict]]:
    """(line or index, record) for each JSON record of a jsonl/json file, with clear errors."""
    path = resolve_path(path)
    fmt = detect_format(path) if fmt == "auto" else fmt
    with _open_text(path) as f:
        if fmt == "jsonl":
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise CorpusError(f"{path}:{lineno}: not valid JSON ({exc.msg}); each line must be one JSON object") from exc
                if not isinstance(record, dict):
                    raise CorpusError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
                yield lineno, record
        elif fmt == "json":
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise CorpusError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc
            if not isinstance(data, list):
                raise CorpusError(f"{path}: a .json corpus must hold a list of objects; use .jsonl for one object per line")
            for index, record in enumerate(data):
                if not isinstance(record, dict):
                    raise CorpusError(f"{path}: item {index} is a {type(record).__name__}, expected an object")
                yield index, record
        else:
            raise CorpusError(f"{path}: format {fmt!r} holds no JSON records; use jsonl or json")


def _txt_documents(path: Path, min_doc_chars: int) -> Iterator[str]:
    with _open_text(path) as f:
        paragraphs = (p.strip("\n") for p in f.read().split("\n\n"))
        pending: list[str] = []
        size = 0
        for para in paragraphs:
            if not para.strip():
                continue
            pending.append(para)
            size += len(para)
            if size >= min_doc_chars:
                yield "\n\n".join(pending)
                pending, size = [], 0
        if pending:
            yield "\n\n".join(pending)


def read_documents(source: SourceConfig) -> Iterator[Document]:
    """The documents of one source, in file order."""
    path = resolve_path(source.path)
    fmt = detect_format(path) if source.format == "auto" else source.format
    count = chars = 0
    if fmt == "txt":
        texts = ((t, source.category) for t in _txt_documents(path, source.min_doc_chars))
    else:
        texts = _json_texts(path, fmt, source)
    for text, category in texts:
        if (source.max_docs and count >= source.max_docs) or (source.max_chars and chars >= source.max_chars):
            return
        count += 1
        chars += len(text)
        yield Document(text, category)


def _json_texts(path: Path, fmt: str, source: SourceConfig) -> Iterator[tuple[str, str]]:
    for where, record in read_records(path, fmt):
        if source.text_field not in record:
            raise CorpusError(
                f"{path} record {where}: no field {source.text_field!r} (fields: {', '.join(sorted(record))}); "
                f"set `text_field` of this source to the field that holds the text"
            )
        text = record[source.text_field]
        if not isinstance(text, str):
            raise CorpusError(f"{path} record {where}: field {source.text_field!r} is a {type(text).__name__}, expected text")
        category = record.get("category", source.category)
        if text.strip():
            yield text, str(category)


def is_heldout(text: str, fraction: float) -> bool:
    """True for a fixed `fraction` of documents, chosen by a hash of the text alone."""
    if fraction <= 0:
        return False
    return zlib.crc32(text.encode("utf-8")) % 1_000_000 < fraction * 1_000_000


def split_documents(sources: list[SourceConfig], holdout_fraction: float) -> tuple[list[Document], list[Document]]:
    """All documents of all sources, split into (train, held-out)."""
    train, heldout = [], []
    for source in sources:
        for doc in read_documents(source):
            (heldout if is_heldout(doc.text, holdout_fraction) else train).append(doc)
    return train, heldout


def domain_text(sources: list[SourceConfig], holdout_fraction: float, max_chars: int = 0) -> list[str]:
    """Training-side documents of the domain corpus (for learning the vocabulary): the held-out
    split is excluded so that the compression measured on it is honest."""
    out, total = [], 0
    for source in sources:
        for doc in read_documents(source):
            if is_heldout(doc.text, holdout_fraction):
                continue
            out.append(doc.text)
            total += len(doc.text)
            if max_chars and total >= max_chars:
                return out
    return out


def load_chat_records(source) -> list[list[dict[str, str]]]:
    """All conversations of one `ChatSourceConfig`, read and validated (phalanx.data.chat)."""
    from phalanx.data.chat import conversations

    return conversations(read_records(resolve_path(source.path)), fmt=source.format, source_name=str(source.path),
                         messages_field=source.messages_field, prompt_field=source.prompt_field,
                         response_field=source.response_field, system=source.system,
                         max_examples=source.max_examples)
