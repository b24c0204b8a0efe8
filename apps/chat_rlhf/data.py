"""Records in TRL's dataset formats, read and validated before any training starts.

    load_records("apps/chat_rlhf/data/dpo_en_demo.jsonl", "preference")

Four kinds, as TRL names them (https://huggingface.co/docs/trl/dataset_formats):

- ``messages``   conversational SFT: ``{"messages": [{"role", "content"}, ...]}``; also
                 prompt-completion ``{"prompt", "completion"}`` (strings or message lists).
- ``preference`` ``{"prompt", "chosen", "rejected"}``, each a string or a message list; without a
                 ``prompt`` (TRL's "implicit prompt") the shared leading turns of chosen and rejected
                 are the prompt. Anthropic hh-rlhf text ("\\n\\nHuman: ...\\n\\nAssistant: ...") is
                 split into turns.
- ``prompt``     prompt-only, for online RL: ``{"prompt", "ground_truth" | "answer"}``
                 (``question`` is accepted for ``prompt``, as GSM8K names it).
- ``kto``        unpaired preference: ``{"prompt", "completion", "label": bool}``.

Every record comes back normalised to message lists:

    messages:   {"messages": [...]}
    preference: {"prompt": [...], "chosen": [...], "rejected": [...]}   prompt ends with a user turn
                (plus "margin": float when the record has TRL's reward-model margin column)
    prompt:     {"prompt": [...], "ground_truth": str | None}
    kto:        {"prompt": [...], "completion": [...], "label": bool}

Sources: a list of dicts, a ``.jsonl`` / ``.json`` file (optionally ``.gz``), a ``.parquet`` file or
a directory written by ``datasets.Dataset.save_to_disk``. JSON files are parsed here, line by line,
so a malformed line is reported with its number (``datasets``' JSON reader reports only a pyarrow
error); parquet and saved directories are read with ``datasets``. A bad record raises
``RecordError`` naming the file, the line (or row) and the field, before any model is loaded.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from phalanx.config import ConfigError

KINDS = ("messages", "preference", "prompt", "kto")
ROLES = ("system", "user", "assistant")
PROMPT_ALIASES = ("prompt", "question")
ANSWER_ALIASES = ("ground_truth", "answer")

_HH_TURN = re.compile(r"\n\n(Human|Assistant):[ ]?")


class RecordError(ValueError):
    """A record does not fit its kind; the message names the file, the line and the field."""


# --- reading rows ---------------------------------------------------------------------------

def read_rows(source: Any) -> Iterator[tuple[str, dict]]:
    """(where, row) for each row of a source; `where` is "FILE line N" or "FILE row N"."""
    if isinstance(source, (list, tuple)):
        for i, row in enumerate(source):
            yield f"record {i}", row
        return
    path = Path(source).expanduser()
    if not path.exists() and HUB_DATASET.match(str(source)):
        yield from _read_hub_dataset(str(source))
        return
    if not path.exists():
        raise RecordError(f"data file {str(path)!r} does not exist; fix the path in the config "
                          "(a .jsonl/.json/.parquet file or a saved datasets directory)")
    name = path.name.lower().removesuffix(".gz")
    if path.is_dir():
        yield from _read_datasets_dir(path)
    elif name.endswith(".jsonl"):
        with _open_text(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{path} line {n}", json.loads(line)
                except json.JSONDecodeError as exc:
                    raise RecordError(f"{path} line {n}: not valid JSON ({exc.msg} at column {exc.colno}); "
                                      "each line of a .jsonl file must be one JSON object") from None
    elif name.endswith(".json"):
        with _open_text(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise RecordError(f"{path} line {exc.lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(data, list):
            raise RecordError(f"{path}: a .json data file must hold a list of records; use .jsonl for one per line")
        for i, row in enumerate(data):
            yield f"{path} record {i}", row
    elif name.endswith(".parquet"):
        from datasets import Dataset

        for i, row in enumerate(Dataset.from_parquet(str(path))):
            yield f"{path} row {i}", row
    else:
        raise RecordError(f"{path}: unknown data file type; use .jsonl, .json, .parquet (optionally .gz for JSON) "
                          "or a directory saved with datasets' save_to_disk")


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def _read_datasets_dir(path: Path) -> Iterator[tuple[str, dict]]:
    from datasets import DatasetDict, load_from_disk

    try:
        data = load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise RecordError(f"{path} is a directory but not one written by datasets' save_to_disk ({exc})") from None
    if isinstance(data, DatasetDict):
        if "train" not in data:
            raise RecordError(f"{path} holds splits {sorted(data)}; point the config at one split's directory")
        data, path = data["train"], path / "train"
    for i, row in enumerate(data):
        yield f"{path} row {i}", row


HUB_DATASET = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<config>[\w.-]+))?(?:@(?P<split>.+))?$")


def _read_hub_dataset(spec: str) -> Iterator[tuple[str, dict]]:
    """Rows of a Hub dataset named `owner/name[:config][@split]` (split "train" unless named), read
    with `datasets.load_dataset` from its snapshot in the local Hugging Face cache: nothing
    downloads; a dataset not in the cache stops with the command that fetches it."""
    from datasets import load_dataset

    from phalanx.pretrained import hub_snapshot

    m = HUB_DATASET.match(spec)
    repo, config, split = m["repo"], m["config"], m["split"] or "train"
    try:
        root = hub_snapshot(repo, "dataset")
    except FileNotFoundError as exc:
        raise RecordError(f"data source {spec!r}: no local file of that name, and {exc}") from None
    try:
        data = load_dataset(str(root), config, split=split)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        raise RecordError(f"data source {spec!r} (cached at {root}): {exc}; name the config and split as "
                          "owner/name:config@split, e.g. openai/gsm8k:main@test") from None
    for i, row in enumerate(data):
        yield f"{spec} row {i}", row


# --- validating and normalising ---------------------------------------------------------------

def load_records(source: Any, kind: str, *, max_records: int = 0) -> list[dict]:
    """All records of `source` as `kind` (see the module docstring), validated; the first
    `max_records` only when it is positive."""
    if kind not in KINDS:
        raise ValueError(f"record kind {kind!r} is unknown; choose one of {', '.join(KINDS)}")
    normalise = {"messages": _messages_record, "preference": _preference_record, "prompt": _prompt_record,
                 "kto": _kto_record}[kind]
    out = []
    for where, row in read_rows(source):
        if not isinstance(row, dict):
            raise RecordError(f"{where}: a record must be a JSON object, got {type(row).__name__}")
        out.append(normalise(row, where))
        if max_records and len(out) >= max_records:
            break
    if not out:
        raise RecordError(f"{source if not isinstance(source, (list, tuple)) else 'the record list'} holds no records")
    return out


def _field(row: dict, names: tuple[str, ...], where: str, kind: str) -> tuple[str, Any]:
    for name in names:
        if row.get(name) is not None:
            return name, row[name]
    raise RecordError(f"{where}: missing field {' or '.join(repr(n) for n in names)} for a {kind} record "
                      f"(it has {', '.join(sorted(row)) or 'no fields'})")


def _message_list(value: Any, where: str, field: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise RecordError(f"{where}: field {field!r} must be text or a non-empty list of "
                          f"{{'role', 'content'}} messages, got {type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise RecordError(f"{where}: field {field!r} message {i} must be {{'role': system|user|assistant, "
                              f"'content': str}}, got {str(m)[:120]}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _as_messages(value: Any, where: str, field: str, role: str) -> list[dict[str, str]]:
    """A string becomes one `role` turn (hh-rlhf text becomes its turns); a list is validated."""
    if isinstance(value, str):
        if not value.strip():
            raise RecordError(f"{where}: field {field!r} is empty")
        turns = split_hh_text(value)
        return turns if turns is not None else [{"role": role, "content": value}]
    return _message_list(value, where, field)


def split_hh_text(text: str) -> list[dict[str, str]] | None:
    """Anthropic hh-rlhf text ("\\n\\nHuman: a\\n\\nAssistant: b ...") as messages; None if it is not."""
    parts = _HH_TURN.split(text)
    if len(parts) < 3 or parts[0].strip():
        return None
    roles = {"Human": "user", "Assistant": "assistant"}
    return [{"role": roles[who], "content": content.strip()} for who, content in zip(parts[1::2], parts[2::2])]


def _check_prompt(prompt: list[dict], where: str, field: str) -> None:
    if prompt[-1]["role"] != "user":
        raise RecordError(f"{where}: field {field!r} must end with a user turn (the model answers it), "
                          f"ends with {prompt[-1]['role']!r}")


def _check_completion(completion: list[dict], where: str, field: str) -> None:
    if any(m["role"] != "assistant" for m in completion) or not completion:
        raise RecordError(f"{where}: field {field!r} must hold only assistant turns, got roles "
                          f"{[m['role'] for m in completion]}")


def _messages_record(row: dict, where: str) -> dict:
    if "messages" in row:
        messages = _message_list(row["messages"], where, "messages")
    elif "prompt" in row and "completion" in row:
        messages = (_as_messages(row["prompt"], where, "prompt", "user")
                    + _as_messages(row["completion"], where, "completion", "assistant"))
    else:
        raise RecordError(f"{where}: a messages record needs field 'messages' (or 'prompt' + 'completion'); "
                          f"it has {', '.join(sorted(row)) or 'no fields'}")
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordError(f"{where}: field 'messages' has no assistant turn, so there is nothing to learn from")
    return {"messages": messages}


def _preference_record(row: dict, where: str) -> dict:
    for name in ("chosen", "rejected"):
        if row.get(name) is None:
            raise RecordError(f"{where}: missing field {name!r} for a preference record "
                              f"(it has {', '.join(sorted(row)) or 'no fields'})")
    chosen = _as_messages(row["chosen"], where, "chosen", "assistant")
    rejected = _as_messages(row["rejected"], where, "rejected", "assistant")
    if row.get("prompt") is not None:
        prompt = _as_messages(row["prompt"], where, "prompt", "user")
    else:  # implicit prompt: the turns chosen and rejected share
        k = 0
        while k < min(len(chosen), len(rejected)) - 1 and chosen[k] == rejected[k]:
            k += 1
        prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
        if not prompt:
            raise RecordError(f"{where}: no field 'prompt', and 'chosen' and 'rejected' share no leading turns "
                              "to take it from; add a 'prompt' field")
    _check_prompt(prompt, where, "prompt")
    _check_completion(chosen, where, "chosen")
    _check_completion(rejected, where, "rejected")
    out = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    if row.get("margin") is not None:  # TRL's optional reward-model margin column
        if not isinstance(row["margin"], (int, float)) or isinstance(row["margin"], bool):
            raise RecordError(f"{where}: field 'margin' must be a number, got {row['margin']!r}")
        out["margin"] = float(row["margin"])
    return out


def _prompt_record(row: dict, where: str) -> dict:
    name, value = _field(row, PROMPT_ALIASES, where, "prompt")
    prompt = _as_messages(value, where, name, "user")
    _check_prompt(prompt, where, name)
    truth = None
    for answer in ANSWER_ALIASES:
        if row.get(answer) is not None:
            truth = row[answer]
            if isinstance(truth, (int, float)) and not isinstance(truth, bool):
                truth = str(truth)
            if not isinstance(truth, str):
                raise RecordError(f"{where}: field {answer!r} must be text or a number, got {type(truth).__name__}")
            break
    return {"prompt": prompt, "ground_truth": truth}


def _kto_record(row: dict, where: str) -> dict:
    _, p = _field(row, ("prompt",), where, "kto")
    _, c = _field(row, ("completion",), where, "kto")
    prompt = _as_messages(p, where, "prompt", "user")
    completion = _as_messages(c, where, "completion", "assistant")
    _check_prompt(prompt, where, "prompt")
    _check_completion(completion, where, "completion")
    label = row.get("label")
    if not isinstance(label, bool):
        raise RecordError(f"{where}: field 'label' must be true (desirable) or false (undesirable), got {label!r}")
    return {"prompt": prompt, "completion": completion, "label": label}


# --- held-out split -----------------------------------------------------------------------------

def is_heldout(record: dict, fraction: float) -> bool:
    """A fixed share of records, chosen by a hash of the content (stable across runs and files)."""
    if fraction <= 0:
        return False
    digest = hashlib.sha1(json.dumps(record, sort_keys=True, ensure_ascii=False).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64 < fraction


def split_heldout(records: list[dict], fraction: float) -> tuple[list[dict], list[dict]]:
    """(train, held-out) by `is_heldout`."""
    train, held = [], []
    for r in records:
        (held if is_heldout(r, fraction) else train).append(r)
    return train, held


# --- token ids --------------------------------------------------------------------------------

def render_completion(tokenizer, prompt: list[dict], completion: list[dict]) -> tuple[str, str]:
    """(prompt text ending with the generation prompt, completion text) under the chat template."""
    prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
    if not full.startswith(prompt_text):
        raise ValueError("the tokenizer's chat template renders prompt + completion differently from the prompt "
                         "alone, so the completion cannot be located; use a prefix-stable template")
    return prompt_text, full[len(prompt_text):]


def encode_completion(tokenizer, prompt: list[dict], completion: list[dict], max_prompt_tokens: int,
                      max_completion_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids): the prompt keeps its last `max_prompt_tokens` tokens (the
    turns nearest the answer), the completion its first `max_completion_tokens`."""
    prompt_text, completion_text = render_completion(tokenizer, prompt, completion)
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"][-max_prompt_tokens:]
    completion_ids = tokenizer(completion_text, add_special_tokens=False)["input_ids"][:max_completion_tokens]
    return prompt_ids, completion_ids


def collate_completions(rows: list[tuple[list[int], list[int]]], pad_id: int) -> dict:
    """A left-padded batch of prompt + completion rows, so every completion ends at the last
    column and `completion_width` columns from the end hold them all."""
    import torch

    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    completion = torch.zeros_like(ids)
    for i, (p, c) in enumerate(rows):
        n = len(p) + len(c)
        ids[i, width - n:] = torch.tensor(p + c, dtype=torch.long)
        attention[i, width - n:] = 1
        completion[i, width - len(c):] = 1
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": attention, "position_ids": position_ids,
            "completion_mask": completion, "completion_width": torch.tensor(max(len(c) for _, c in rows))}


# --- the data section of the preference commands (dpo, train_rm) ----------------------------------

@dataclass
class PreferenceDataConfig:
    path: str = "apps/chat_rlhf/data/llamafactory_demo/dpo_en_demo.jsonl"  # jsonl/json/parquet/saved dataset dir
    heldout_fraction: float = 0.2        # share of records kept out of training (by a hash of the record)
    max_records: int = 0                 # read at most this many records (0: all)
    max_train: int = 0                   # train on at most this many of the rest (0: all)
    max_heldout: int = 0                 # evaluate at most this many held-out records (0: all)
    max_prompt_tokens: int = 256         # the prompt keeps its last tokens
    max_completion_tokens: int = 256     # each completion keeps its first tokens

    def validate(self) -> None:
        if not 0 < self.heldout_fraction < 1:
            raise ConfigError(f"data.heldout_fraction={self.heldout_fraction}: must be in (0, 1)")
        if self.max_prompt_tokens < 1 or self.max_completion_tokens < 1:
            raise ConfigError("data.max_prompt_tokens and data.max_completion_tokens must be at least 1")


def read_split(data: PreferenceDataConfig, kind: str) -> tuple[list[dict], list[dict]]:
    """(training records, held-out records) of a preference or KTO file, validated."""
    records = load_records(data.path, kind, max_records=data.max_records)
    train, held = split_heldout(records, data.heldout_fraction)
    if data.max_train:
        train = train[:data.max_train]
    if data.max_heldout:
        held = held[:data.max_heldout]
    if not train or not held:
        raise ValueError(f"{data.path}: {len(records)} records give {len(train)} training and {len(held)} held-out "
                         "examples; both must be non-empty (change data.heldout_fraction or add data)")
    return train, held


# --- the prompt-length filter of the online-RL commands -------------------------------------------

def drop_long_prompts(records: list[dict], prompt_ids: list[list[int]], max_tokens: int
                      ) -> tuple[list[dict], list[list[int]], int]:
    """(records, token ids, number dropped): the prompts of at most `max_tokens` tokens, in order.
    Long prompts are dropped, not cut: a prompt cut at the front loses the conversation's start and
    one cut at the back loses the question the completion answers."""
    if max_tokens < 1:
        raise ConfigError(f"data.max_prompt_tokens={max_tokens}: must be at least 1 (or 0 for no filter)")
    keep = [i for i, ids in enumerate(prompt_ids) if len(ids) <= max_tokens]
    return [records[i] for i in keep], [prompt_ids[i] for i in keep], len(records) - len(keep)
