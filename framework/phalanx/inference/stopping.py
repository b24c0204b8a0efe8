"""Deciding when a sequence ends, and its text: EOS, stop tokens, stop strings, length limits.

Text is decoded from all output tokens at once (not token by token), so multi-byte characters
split over several tokens come out right, and a stop string is found wherever the token
boundaries fall (one token may end with its first half and the next start with the rest); it
cuts the text before it, and the tokens that produced it stay in `token_ids` (what the model
actually generated). A streaming server sends only `streamable_prefix` of unfinished text: the
rest might still turn out to be the start of a stop string.
"""
from __future__ import annotations

from phalanx.inference.sequence import Sequence


def streamable_prefix(text: str, stops: list[str]) -> int:
    """How many leading characters of an unfinished output's text are safe to send: text that
    ends with the beginning of a stop string (or an unfinished UTF-8 character, decoded as
    U+FFFD) is held back until the next tokens decide it."""
    end = len(text)
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):  # longest suffix of text that begins stop
            if text.endswith(stop[:k]):
                end = min(end, len(text) - k)
                break
    while end > 0 and text[end - 1] == "\ufffd":
        end -= 1
    return end


# The tail decoded to look for a stop string: enough tokens for its characters even when each
# takes four byte-level tokens, plus a few for a partial character at the window's start.
TAIL_TOKENS_PER_CHAR = 4
TAIL_SLACK_TOKENS = 8


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def decode(self, seq: Sequence) -> str:
        """The whole output's text (decoded in full: for cutting at a stop string)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)

    def text(self, seq: Sequence) -> str:
        """The output's text so far, decoding only the tokens added since the last call
        (`detokenize.IncrementalText`); complete characters only until the sequence finishes."""
        return seq.detokenizer.update(self.tokenizer, seq.output_token_ids, seq.params.skip_special_tokens,
                                      final=seq.is_finished)

    def _stop_in_tail(self, seq: Sequence) -> bool:
        """Whether a stop string occurs in the text of the last few output tokens. Checked after
        every token, a stop string can only newly appear in text that ends with the newest token,
        so decoding a tail of `TAIL_TOKENS_PER_CHAR` tokens per character of the longest stop
        string (a character may take several byte-level tokens) finds it without decoding the
        whole output each step (quadratic in the output length); the full text is decoded only
        when a stop is there, to cut it."""
        params = seq.params
        window = TAIL_TOKENS_PER_CHAR * max(len(stop) for stop in params.stop) + TAIL_SLACK_TOKENS
        ids = seq.output_token_ids
        if len(ids) <= window:
            return True  # short outputs: the full decode is the tail
        tail = self.tokenizer.decode(ids[-window:], skip_special_tokens=params.skip_special_tokens)
        return any(stop in tail for stop in params.stop)

    def check(self, seq: Sequence) -> bool:
        """After a token was appended: set seq.finish_reason/stop_reason and return True if done."""
        params = seq.params
        token = seq.token_ids[-1]
        produced = seq.num_output_tokens
        if produced >= params.min_new_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                seq.finish_reason = "stop"
                return True
            if token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                return True
        if params.stop and self.tokenizer is not None and self._stop_in_tail(seq):
            text = self.decode(seq)
            cut = None
            for stop in params.stop:
                at = text.find(stop)
                if at != -1 and (cut is None or at < cut[0]):
                    cut = (at, stop)
            if cut is not None:
                seq.text = text[:cut[0]]
                seq.finish_reason, seq.stop_reason = "stop", cut[1]
                return True
        if produced >= params.max_new_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
            return True
        return False

    def banned_now(self, seq: Sequence, extra_tokens: int = 0) -> list[int] | None:
        """EOS and the request's stop_token_ids may not be chosen before min_new_tokens (the HF
        MinNewTokens rule; vLLM's min_tokens bans both)."""
        if seq.num_output_tokens + extra_tokens < seq.params.min_new_tokens:
            banned = self.eos_token_ids.union(seq.params.stop_token_ids)
            return sorted(banned) if banned else None
        return None
