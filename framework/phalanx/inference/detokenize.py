"""Incremental detokenisation: a sequence's text grows by decoding only its newest tokens.

Decoding the whole output again after every step is quadratic in its length (and runs on the
engine thread for every running request). Decoding each token on its own is wrong: a byte-level
BPE token may hold part of a UTF-8 character, and a SentencePiece token's leading space is
dropped at the start of a decode. So each update decodes a short window: the tokens of the
previous update (`prefix:read`, already emitted, kept as context) plus the new ones, and appends
what the window's text adds beyond the context's. While the window's text ends in U+FFFD (a
character not complete yet) nothing is emitted and the offsets stay, so the text only ever grows
by whole characters: a stream never sends half a character.
"""
from __future__ import annotations

from typing import Sequence

REPLACEMENT = "\ufffd"


class IncrementalText:
    """The text of one growing list of output token ids (see the module docstring)."""

    def __init__(self) -> None:
        self.text = ""
        self.prefix = 0  # first token of the context window
        self.read = 0  # tokens whose text is in `self.text`
        self.decoded_tokens = 0  # tokens passed to the tokenizer so far (what a test bounds)

    def update(self, tokenizer, ids: Sequence[int], skip_special_tokens: bool = True, *, final: bool = False) -> str:
        """The text of `ids` (which extend the ids of the previous call), complete characters only;
        `final`: the sequence is done, so a trailing incomplete character is kept as U+FFFD (what
        decoding the whole output gives)."""
        if tokenizer is None or len(ids) <= self.read:
            return self.text
        context = self._decode(tokenizer, ids[self.prefix:self.read], skip_special_tokens) if self.read > self.prefix \
            else ""
        window = self._decode(tokenizer, ids[self.prefix:], skip_special_tokens)
        if window.endswith(REPLACEMENT) and not final:
            return self.text  # a character still incomplete: wait for its next bytes
        if window.startswith(context):
            self.text += window[len(context):]
        else:  # the tokenizer's clean-up rewrote the context's text in the longer window: decode it all (rare)
            self.text = self._decode(tokenizer, ids, skip_special_tokens)
        self.prefix, self.read = self.read, len(ids)
        return self.text

    def _decode(self, tokenizer, ids: Sequence[int], skip_special_tokens: bool) -> str:
        self.decoded_tokens += len(ids)
        return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
