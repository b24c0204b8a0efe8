"""Structured output: each constrained request carries a grammar matcher (llguidance) that says
which tokens may come next; the sampler masks the others out of that request's row of logits.

    compiler = GrammarCompiler(hf_tokenizer, vocab_size=model_vocab, eos_token_ids={2})
    grammar = compiler.matcher(StructuredOutput(json_schema={"type": "object", ...}))
    # each step: the sampler calls apply_grammar_masks(logits, grammars); the engine, once the
    # token is appended: grammar.accept(token)

The grammar state moves only when the engine appends a token (`Grammar.accept`), never while a
step computes: a step that fails and is rolled back leaves every matcher as it was, and the next
try computes the same masks. Speculative decoding drafts for constrained requests too
(`phalanx.inference.speculative`): while the draft proposes, each constrained sequence's matcher
advances over its own proposals (`try_accept`), so every proposal is drawn from the draft's
distribution masked at its position, and the mask of every position is kept for verification;
then the matcher is rolled back over all of them (`rollback`, also when the step raises), and the
engine advances it over the tokens it accepts, as for any other step.

Why llguidance: it computes masks lazily, token by token, without a per-schema precompile
(JSON schemas, JSON mode, regexes and Lark grammars through one API), is a structured-output
backend of vLLM and SGLang, installs as one abi3 wheel with no Python dependencies (in
particular it does not pull a torch, as xgrammar's wheel would), and reports unsupported schema
features as errors instead of ignoring them.

The server turns `response_format` and a forced `tool_choice` into a `StructuredOutput`
(`openai_protocol`) and checks that it compiles before the request reaches the engine
(`server_routes.Routes.check_structured`: a 400 naming what cannot be enforced).

Compiled grammars are cached by their constraint (`StructuredOutput.key`): many requests with
one schema compile it once and each gets a cheap copy of the compiled matcher.
"""
from __future__ import annotations

import os
from collections import OrderedDict

import torch

from phalanx.inference.sampling_params import StructuredOutput

# JSON is emitted compact (no whitespace between tokens): the output is as valid and as
# parseable, and a model cannot spend its tokens on runs of spaces and newlines.
JSON_OPTIONS = {"whitespace_flexible": False}
CACHE_SIZE = 128  # compiled constraints kept
MASK_THREADS = max(1, min(4, os.cpu_count() or 1))  # llguidance threads filling a step's masks
_executor = None


def _llguidance():
    try:
        import llguidance
        import llguidance.hf  # noqa: F401 - the Hugging Face tokenizer bridge
    except ImportError:
        raise ImportError("structured output (response_format / structured_output) needs llguidance: "
                          "pip install 'phalanx[serve]' (or pip install llguidance)") from None
    return llguidance


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of a constraint."""
    llg = _llguidance()
    if spec.json_schema is not None:
        try:
            return llg.LLMatcher.grammar_from_json_schema(spec.json_schema, overrides=JSON_OPTIONS)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"the JSON schema is not valid: {exc}") from None
    if spec.json_object:
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if spec.regex is not None:
        return llg.LLMatcher.grammar_from_regex(spec.regex)
    return llg.LLMatcher.grammar_from_lark(spec.grammar)


class Grammar:
    """One sequence's matcher: the tokens allowed next, and the state after each accepted one."""

    def __init__(self, matcher, n_vocab: int) -> None:
        self.matcher = matcher
        self.n_vocab = n_vocab  # tokens the bitmask covers (>= the model's vocabulary)

    def fork(self) -> "Grammar":
        """An independent copy in the same state (another sample of the same request)."""
        return Grammar(self.matcher.deep_copy(), self.n_vocab)

    def fill(self, row: torch.Tensor) -> None:
        """Write the allowed-token bitmask (int32 words, bit t % 32 of word t // 32) into `row`, a
        contiguous CPU int32 tensor."""
        if self.matcher.is_error():
            raise RuntimeError(f"the output constraint failed: {self.matcher.get_error()}")
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def accept(self, token: int) -> None:
        """Advance past an appended token; one the constraint forbids is an error (never happens
        for tokens the masked sampler chose)."""
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"token {token} breaks the output constraint: {self.matcher.get_error()}")

    def try_accept(self, token: int) -> bool:
        """Advance past a proposed (drafted) token if the constraint allows it; False (and the
        state unchanged) if it does not. Undo with `rollback`."""
        return self.matcher.try_consume_tokens([token]) == 1

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` tokens accepted (the drafts of a speculative step)."""
        if num_tokens and not self.matcher.rollback(num_tokens):
            raise RuntimeError(f"the output constraint could not roll back {num_tokens} drafted tokens: "
                               f"{self.matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The constraint is complete and nothing more may follow (EOS was accepted)."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()


class GrammarCompiler:
    """Compiles constraints against one tokenizer (built once, on first use) and hands out a fresh
    matcher per sequence; bad constraints raise ValueError naming the problem."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids) -> None:
        if tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer (none in the model directory "
                             "and none given to LLM)")
        self.hf_tokenizer = tokenizer
        self.n_vocab = max(vocab_size, len(tokenizer))
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = None
        self._compiled: OrderedDict[str, object] = OrderedDict()  # key -> a matcher in its start state

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            llg = _llguidance()
            eos = self.eos_token_ids or None
            try:
                self._tokenizer = llg.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.n_vocab, eos_token=eos)
            except ValueError as exc:  # a slow (Python) tokenizer
                raise ValueError(f"structured output needs a fast Hugging Face tokenizer: {exc}") from None
        return self._tokenizer

    def _compile(self, spec: StructuredOutput):
        key = spec.key()
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        llg = _llguidance()
        text = grammar_text(spec)
        error = llg.LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise ValueError(f"the output constraint cannot be enforced: {error}")
        matcher = llg.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the output constraint cannot be enforced: {matcher.get_error()}")
        self._compiled[key] = matcher
        if len(self._compiled) > CACHE_SIZE:
            self._compiled.popitem(last=False)
        return matcher

    def check(self, spec: StructuredOutput) -> None:
        """Compile (and cache) the constraint; ValueError naming the problem if it cannot be enforced."""
        self._compile(spec)

    def matcher(self, spec: StructuredOutput) -> Grammar:
        return Grammar(self._compile(spec).deep_copy(), self.n_vocab)


def words_for(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def _fill(grammars: list[Grammar], bits: torch.Tensor) -> None:
    """Every grammar's bitmask into its row of `bits`: one call into llguidance's executor for
    the batch (its threads, no Python per row) when there are several."""
    global _executor
    for grammar in grammars:
        if grammar.matcher.is_error():
            grammar.fill(bits[0])  # raises, naming the error
    if len(grammars) == 1:
        grammars[0].fill(bits[0])
        return
    if _executor is None:
        _executor = _llguidance().LLExecutor(num_threads=MASK_THREADS)
    row_bytes = bits.shape[1] * bits.element_size()
    _executor.unsafe_compute_mask_ptr([(g.matcher, i) for i, g in enumerate(grammars)], bits.data_ptr(),
                                      row_bytes, len(grammars))


def allowed_tokens(grammars: list[Grammar], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[G, vocab_size] bool on `device`: the tokens each grammar allows next. The bitmasks are
    filled on the host (one transfer for all rows) and unpacked on the device."""
    n_vocab = max(g.n_vocab for g in grammars)
    words = words_for(n_vocab)
    bits = torch.zeros((len(grammars), words), dtype=torch.int32)
    _fill(grammars, bits)
    bits = bits.to(device)
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    unpacked = (bits.unsqueeze(-1) >> shifts) & 1  # [G, words, 32]: bit j of word w is token 32 w + j
    allowed = unpacked.reshape(len(grammars), words * 32)[:, :vocab_size].bool()
    if allowed.shape[-1] < vocab_size:  # (never: the bitmask covers the model's vocabulary)
        raise ValueError(f"the grammar's vocabulary ({n_vocab}) is smaller than the logits' ({vocab_size})")
    return allowed


def apply_grammar_masks(logits: torch.Tensor, grammars: list[Grammar | None]) -> torch.Tensor:
    """-inf, in place, on every token row r's grammar forbids (rows without one are untouched)."""
    rows = [r for r, g in enumerate(grammars) if g is not None]
    if not rows:
        return logits
    allowed = allowed_tokens([grammars[r] for r in rows], logits.shape[-1], logits.device)
    if len(rows) == logits.shape[0]:  # every row constrained: in place, no gather
        return logits.masked_fill_(~allowed, float("-inf"))
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
    return logits


def apply_allowed(logits: torch.Tensor, allowed: list[torch.Tensor | None]) -> torch.Tensor:
    """`logits` with -inf on every token row r's precomputed mask `allowed[r]` ([vocab] bool, from
    `allowed_tokens`) forbids (a new tensor; `logits` itself is left as it is); rows whose mask is
    None are untouched. Speculative decoding masks its drafted positions this way (each with the
    grammar state after the drafts before it)."""
    if all(a is None for a in allowed):
        return logits
    full = torch.stack([a if a is not None else torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
                        for a in allowed])
    return logits.masked_fill(~full, float("-inf"))
