"""Held-out evaluation in bits per character, the one measure that compares across tokenizers.

Per-token loss or perplexity changes meaning when the vocabulary changes (an expanded tokenizer
spends fewer, harder tokens on the same text), so every before/after number of this recipe is per
character: the model's total negative log-likelihood of a text, in bits, divided by the text's
length in characters. The matching character-level perplexity is 2 ** bpc.

The held-out documents are cut into pieces of at most `chunk_chars` characters (at line breaks
where possible) by the text alone, so every model and tokenizer is scored on exactly the same
characters. Each piece is scored as the start of a document: after one EOS, the separator the
training stream puts between documents.

    python -m apps.llama.evaluate --config apps/llama/configs/tiny.yaml --model runs/llama_tiny/export
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from phalanx.amp.precision import Precision, resolve_precision
from phalanx.booster import unwrap_model
from phalanx.booster.state import boosted_state
from phalanx.device import to_device
from phalanx.train.data import pad_rows

LN2 = math.log(2.0)


@dataclass(frozen=True)
class Chunk:
    text: str
    category: str


def _split_text(text: str, limit: int) -> list[str]:
    """Pieces of at most `limit` characters, cut after a newline when one is close enough."""
    pieces = []
    while len(text) > limit:
        cut = text.rfind("\n", limit // 2, limit)
        cut = cut + 1 if cut >= 0 else limit
        pieces.append(text[:cut])
        text = text[cut:]
    if text:
        pieces.append(text)
    return [p for p in pieces if p.strip()]


def make_chunks(texts: list[str], categories: list[str], chunk_chars: int, max_chars_per_category: int) -> list[Chunk]:
    """The evaluation pieces: documents in order, cut to `chunk_chars`, up to a budget per category."""
    used: dict[str, int] = {}
    chunks = []
    for text, category in zip(texts, categories):
        for piece in _split_text(text, chunk_chars):
            if max_chars_per_category and used.get(category, 0) >= max_chars_per_category:
                break
            chunks.append(Chunk(piece, category))
            used[category] = used.get(category, 0) + len(piece)
    return chunks


def load_heldout_chunks(data_dir: str | Path, chunk_chars: int, max_chars_per_category: int) -> list[Chunk]:
    from datasets import load_from_disk

    path = Path(data_dir) / "heldout"
    if not path.exists():
        raise FileNotFoundError(f"no held-out split at {path}: run `python -m apps.llama.prepare_data` first")
    ds = load_from_disk(str(path))
    return make_chunks(ds["text"], ds["category"], chunk_chars, max_chars_per_category)


@torch.no_grad()
def bits_per_char(model, tokenizer, chunks: list[Chunk], batch_size: int = 8,
                  precision: str | Precision = "fp32") -> dict[str, dict[str, float]]:
    """Per category: bits per character, character perplexity, token loss (nats), chars, tokens.

    precision: "fp32", "bf16" (the body under bf16 autocast; the loss itself stays fp32) or
    "auto" (bf16 where the model's device computes it natively, else fp32).

    A plain (or DDP/ZeRO/FSDP) model is scored row by row from its final hidden states, so memory
    stays at one [seq, vocab] block even for large vocabularies. A model boosted with the hybrid
    plugin (tensor / sequence / pipeline parallel) is scored through `phalanx.train.eval_loss_sum`
    (its own vocabulary-parallel loss, or a forward-only pipeline pass), one category per batch.
    Every rank scores every chunk, so all ranks run the same forwards and return the same numbers.
    """
    model = unwrap_model(model)
    was_training = model.training
    model.eval()
    autocast_bf16 = resolve_precision(precision, next(model.parameters()).device).compute_dtype == torch.bfloat16
    encoded = tokenizer([c.text for c in chunks], add_special_tokens=False)["input_ids"]
    state = boosted_state(model)
    sharded = state is not None and state.model_computes_loss
    # similar lengths share a batch; the sharded path also keeps categories apart
    order = sorted(range(len(chunks)), key=lambda i: (chunks[i].category if sharded else "", len(encoded[i])))
    nll: dict[str, float] = {}
    tokens: dict[str, int] = {}
    score = _batch_nll_sharded if sharded else _batch_nll_rows
    try:
        for batch in _batches(order, chunks, batch_size, by_category=sharded):
            seqs = [[tokenizer.eos_token_id] + encoded[i] for i in batch]
            for i, loss, n in score(model, seqs, batch, tokenizer.pad_token_id, autocast_bf16):
                cat = chunks[i].category
                nll[cat] = nll.get(cat, 0.0) + loss
                tokens[cat] = tokens.get(cat, 0) + n
    finally:
        model.train(was_training)
    chars: dict[str, int] = {}
    for c in chunks:
        chars[c.category] = chars.get(c.category, 0) + len(c.text)
    out = {}
    for cat in nll:
        bpc = nll[cat] / LN2 / chars[cat]
        out[cat] = {"bpc": bpc, "char_ppl": 2.0 ** bpc, "token_loss": nll[cat] / tokens[cat],
                    "chars": chars[cat], "tokens": tokens[cat]}
    return out


def _batches(order: list[int], chunks: list[Chunk], batch_size: int, by_category: bool):
    batch: list[int] = []
    for i in order:
        if batch and (len(batch) == batch_size or (by_category and chunks[i].category != chunks[batch[0]].category)):
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def _batch_nll_rows(model, seqs, batch, pad_id, autocast_bf16):
    """(chunk index, summed NLL in nats, target tokens) per row, the loss in fp32 row by row."""
    device = next(model.parameters()).device
    ids, mask = to_device(pad_rows(seqs, pad_id), device)
    head = model.get_output_embeddings()
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
        hidden = body(input_ids=ids, attention_mask=mask).last_hidden_state
        for r, i in enumerate(batch):
            n = len(seqs[r])
            logits = head(hidden[r, :n - 1].to(head.weight.dtype)).float()  # the loss itself in fp32
            yield i, F.cross_entropy(logits, ids[r, 1:n], reduction="sum").item(), n - 1


def _batch_nll_sharded(model, seqs, batch, pad_id, autocast_bf16):
    """The whole batch's NLL through the parallel layout's own loss, attributed to its first chunk
    (batches hold one category; per-chunk numbers are not needed)."""
    from phalanx.train import eval_loss_sum

    device = next(model.parameters()).device
    ids, mask = pad_rows(seqs, pad_id)
    labels = ids.masked_fill(mask == 0, -100)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
        loss = eval_loss_sum(model, to_device({"input_ids": ids, "labels": labels}, device))
    yield batch[0], float(loss), sum(len(s) - 1 for s in seqs)


def flat_metrics(results: dict[str, dict[str, float]]) -> dict[str, float]:
    """{'zh/bpc': ..., 'zh/char_ppl': ..., ...} for the training loop's metrics log."""
    return {f"{cat}/{key}": float(value) for cat, r in results.items()
            for key, value in r.items() if key in ("bpc", "char_ppl", "token_loss")}


def format_results(results: dict[str, dict[str, float]]) -> str:
    return "  ".join(f"{cat}: {r['bpc']:.3f} bpc (char ppl {r['char_ppl']:.1f}, {r['chars']:,} chars / {r['tokens']:,} tokens)"
                     for cat, r in sorted(results.items()))


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM

    from .config import parse_args
    from .tokenizer_io import load_tokenizer

    def extra(parser):
        parser.add_argument("--model", required=True, help="HF model directory (export, checkpoint model/, model_init)")
        parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model directory, else <work_dir>/tokenizer)")

    cfg, args = parse_args("Bits per character of a model on the held-out split.", argv, extra)
    model_dir = Path(args.model)
    tok_dir = args.tokenizer or (model_dir if (model_dir / "tokenizer_config.json").exists() else cfg.tokenizer_dir)
    tokenizer = load_tokenizer(tok_dir)
    from phalanx.device import current_device

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(current_device())
    chunks = load_heldout_chunks(cfg.data_dir, cfg.eval.chunk_chars, cfg.eval.max_chars_per_category)
    print(format_results(bits_per_char(model, tokenizer, chunks, cfg.eval.batch_size, cfg.eval.precision)))


if __name__ == "__main__":
    main(sys.argv[1:])
