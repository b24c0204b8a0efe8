"""Chat data for SFT: records → messages → token ids with labels only on assistant turns.

Accepted record layouts:
- `messages` (TRL / OpenAI): {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
- `alpaca`: {"instruction", "input" (optional), "output", "system" (optional)}
- `qa`: a prompt field and a response field (GSM8K: "question" / "answer")

Masking works on characters, not on token positions: the conversation is rendered once with the
tokenizer's chat template, each assistant turn's character span is found by rendering the
conversation up to that turn (with and without the generation prompt), and a token is a target
when its character range overlaps an assistant span. That is exact for any prefix-stable
template, whatever the tokenizer does at turn boundaries, and it includes the end-of-turn token
so the model learns to stop.
"""
from __future__ import annotations

from typing import Any, Iterable

from phalanx.data.labels import IGNORE_INDEX

# Used when a tokenizer has no chat template (the bare LLaMA SentencePiece tokenizer): the
# LLaMA-2 chat layout, prefix-stable, with EOS closing every assistant turn.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}<<SYS>>\n{{ message['content'] }}\n<</SYS>>\n\n"
    "{% elif message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
    "{% elif message['role'] == 'assistant' %} {{ message['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)

ROLES = {"system", "user", "assistant"}


class ChatFormatError(ValueError):
    pass


def ensure_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE


def detect_format(record: dict, messages_field: str, prompt_field: str, response_field: str) -> str:
    if messages_field in record:
        return "messages"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if prompt_field in record and response_field in record:
        return "qa"
    raise ChatFormatError(
        f"cannot tell the chat format of a record with fields {sorted(record)}: expected '{messages_field}' (messages), "
        f"'instruction'+'output' (alpaca) or '{prompt_field}'+'{response_field}' (qa); set `format` and the field names"
    )


def _text(record: dict, key: str, where: str) -> str:
    if key not in record:
        raise ChatFormatError(f"{where}: missing field {key!r} (fields: {', '.join(sorted(record))})")
    value = record[key]
    if not isinstance(value, str):
        raise ChatFormatError(f"{where}: field {key!r} is a {type(value).__name__}, expected text")
    return value


def to_messages(record: dict, fmt: str, *, where: str, messages_field: str = "messages",
                prompt_field: str = "question", response_field: str = "answer", system: str = "") -> list[dict[str, str]]:
    """One record as a validated list of {role, content} messages."""
    if fmt == "messages":
        raw = record.get(messages_field)
        if not isinstance(raw, list) or not raw:
            raise ChatFormatError(f"{where}: field {messages_field!r} must be a non-empty list of {{role, content}}")
        messages = []
        for i, m in enumerate(raw):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ChatFormatError(f"{where}: message {i} must be {{'role': system|user|assistant, 'content': str}}, got {m!r:.120}")
            messages.append({"role": m["role"], "content": m["content"]})
    elif fmt == "alpaca":
        prompt = _text(record, "instruction", where)
        extra = record.get("input") or ""
        if extra:
            prompt = f"{prompt}\n\n{extra}"
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": _text(record, "output", where)}]
        system = record.get("system") or system
    elif fmt == "qa":
        messages = [{"role": "user", "content": _text(record, prompt_field, where)},
                    {"role": "assistant", "content": _text(record, response_field, where)}]
    else:
        raise ChatFormatError(f"unknown chat format {fmt!r}; use messages, alpaca or qa")
    if system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatFormatError(f"{where}: the conversation has no assistant turn, so nothing to learn from")
    return messages


def assistant_spans(tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant turn in it."""
    def render(msgs, gen):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    full = render(messages, False)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = render(messages[:k], True), render(messages[:k + 1], False)
        if not (full.startswith(before) and full.startswith(through) and through.startswith(before)):
            raise ChatFormatError("the tokenizer's chat template renders a conversation differently from its prefixes, "
                                  "so assistant turns cannot be located; use a prefix-stable template")
        spans.append((len(before), len(through)))
    return full, spans


def encode_chat(tokenizer, messages: list[dict[str, str]], max_len: int) -> tuple[list[int], list[int]] | None:
    """(input_ids, labels) of one conversation, truncated to max_len; None if no target survives."""
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"][:max_len], enc["offset_mapping"][:max_len]
    labels = []
    for token_id, (start, end) in zip(ids, offsets):
        inside = any(start < s_end and end > s_start for s_start, s_end in spans)
        labels.append(token_id if inside else IGNORE_INDEX)
    if all(label == IGNORE_INDEX for label in labels):
        return None
    return ids, labels


def conversations(records: Iterable[tuple[Any, dict]], *, fmt: str = "auto", source_name: str = "records",
                  messages_field: str = "messages", prompt_field: str = "question", response_field: str = "answer",
                  system: str = "", max_examples: int = 0) -> list[list[dict[str, str]]]:
    """Validated conversations from `(where, record)` pairs (where: a line or record number for errors).

    The format is detected from the first record when `fmt` is "auto"; every record must then
    have that format. `max_examples` > 0 stops after that many conversations.
    """
    out = []
    for where, record in records:
        if fmt == "auto":
            fmt = detect_format(record, messages_field, prompt_field, response_field)
        out.append(to_messages(record, fmt, where=f"{source_name} record {where}", messages_field=messages_field,
                               prompt_field=prompt_field, response_field=response_field, system=system))
        if max_examples and len(out) >= max_examples:
            break
    return out
