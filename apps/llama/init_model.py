"""Step 2: give the base model rows for the new tokens.

    python -m apps.llama.init_model --config apps/llama/configs/tiny.yaml

Resizes the input embeddings and the LM head to the expanded vocabulary. Each new token's row
starts as the mean of the base model's rows for the pieces the *old* tokenizer splits that token
into (for a new Chinese character in a byte-level vocabulary: its UTF-8 byte tokens). A global
mean would make every new token look alike; the per-token mean keeps what the base model already
knows about the token's text, so the expanded model starts close to the base model.

The split is computed with the old tokenizer's BPE model on the token's own string (in the
tokenizer's internal alphabet: `▁` for spaces in SentencePiece, byte symbols in byte-level BPE),
which avoids any decode/re-encode whitespace quirks.

Big models: when `train.plugin` shards parameters (fsdp, zero1/2, gemini, hybrid:
`phalanx.booster.plugins.builds_lazily`)
and `model.base` is a checkpoint, the base is never loaded whole: its tensors are copied file by
file into the new checkpoint (`phalanx.checkpoint.hf.ShardedSafetensorsWriter`), and only the
embedding and LM head are read whole to get their new rows (`stream_resized_checkpoint`); the
same values as the eager path. Training then builds the model on the meta device
(`pretrain.load_model`), and the plugin reads only each rank's part. A model built from
`model.architecture` (recipe tests, the tiny config) is still initialised eagerly.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from phalanx.booster.plugins import builds_lazily
from phalanx.checkpoint import atomic_directory

from .config import RecipeConfig, parse_args
from .corpus import resolve_path
from .tokenizer_io import load_tokenizer


def check_extension(base_tok, new_tok) -> list[int]:
    """Ids of the tokens the new tokenizer adds; fails unless every base token keeps its id."""
    new_vocab = new_tok.get_vocab()
    moved = [(t, i, new_vocab.get(t)) for t, i in base_tok.get_vocab().items() if new_vocab.get(t) != i]
    if moved:
        t, old, new = moved[0]
        raise ValueError(
            f"the expanded tokenizer is not an extension of the base: token {t!r} has id {old} in the base and {new} "
            f"in the expanded one ({len(moved)} tokens differ). Re-run expand_vocab from the same base tokenizer."
        )
    base_ids = set(base_tok.get_vocab().values())
    return sorted(i for i in new_vocab.values() if i not in base_ids)


def old_piece_ids(base_tok, new_tok, new_ids: list[int]) -> dict[int, list[int]]:
    """For each new token id, the ids of the pieces the base tokenizer splits it into."""
    model = base_tok.backend_tokenizer.model
    out = {}
    for i in new_ids:
        token = new_tok.convert_ids_to_tokens(i)
        pieces = [t.id for t in model.tokenize(token)]
        if not pieces:
            raise ValueError(f"the base tokenizer cannot split new token {token!r} (id {i}) into known pieces")
        out[i] = pieces
    return out


@torch.no_grad()
def resize_with_piece_means(model, pieces: dict[int, list[int]], vocab_size: int) -> None:
    """Resize embeddings (and an untied LM head) to `vocab_size` rows; new rows = mean of piece rows."""
    emb_old = model.get_input_embeddings().weight.detach().clone()
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    head_old = None if head is None or tied else head.weight.detach().clone()
    if vocab_size > emb_old.shape[0]:
        model.resize_token_embeddings(vocab_size, mean_resizing=False)
    emb = model.get_input_embeddings().weight
    for new_id, ids in pieces.items():
        index = torch.tensor(ids)
        emb[new_id] = emb_old[index].mean(0)
        if head_old is not None:
            model.get_output_embeddings().weight[new_id] = head_old[index].mean(0)


def build_from_config(architecture: dict, tokenizer, seed: int):
    """A freshly initialised model of the family `architecture["model_type"]` names (default
    `llama`), any family in `phalanx.models`; its config fields come from `architecture`, the
    vocabulary and special tokens from the tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from phalanx.models import family_of

    reserved = {"vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"} & set(architecture)
    if reserved:
        raise ValueError(f"model.architecture sets {sorted(reserved)}; these come from the tokenizer, remove them")
    fields = dict(architecture)
    model_type = fields.pop("model_type", "llama")
    try:
        family_of(model_type)
    except ValueError as e:
        raise ValueError(f"model.architecture.model_type: {e}") from None
    known = AutoConfig.for_model(model_type).to_dict()
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ValueError(f"model.architecture: {unknown} are not {model_type} config fields (a misspelling?); "
                         f"the {model_type} config has: {', '.join(sorted(k for k in known if not k.startswith('_')))}")
    try:
        config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"model.architecture is not a valid {model_type} config: {e}") from None
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def load_base_model(path: str | Path):
    from transformers import AutoModelForCausalLM

    p = resolve_path(path)
    check_base_dir(p)
    return AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32)


def resized_rows(old: torch.Tensor, pieces: dict[int, list[int]], rows: int, std: float,
                 generator: torch.Generator) -> torch.Tensor:
    """`old` grown to `rows` rows: the old rows kept, each new token's row the mean of its pieces'
    old rows (as `resize_with_piece_means`), any other added row drawn from N(0, std)."""
    out = torch.empty((max(rows, old.shape[0]), *old.shape[1:]), dtype=old.dtype)
    out[:old.shape[0]] = old
    if out.shape[0] > old.shape[0]:
        out[old.shape[0]:].normal_(0.0, std, generator=generator)
    for new_id, ids in pieces.items():
        out[new_id] = old[torch.tensor(ids)].mean(0)
    return out


def stream_resized_checkpoint(base_dir: Path, out_dir: Path, pieces: dict[int, list[int]], rows: int,
                              config_updates: dict, seed: int = 0, max_shard_size: str = "2GB") -> int:
    """Write the base checkpoint into `out_dir` with the embedding (and an untied LM head) grown
    to `rows` rows, one tensor at a time; returns the number of parameters written. The config and
    generation config get `config_updates` (vocab_size, eos/pad ids)."""
    from transformers import AutoConfig, GenerationConfig

    from phalanx import lazy
    from phalanx.checkpoint.hf import ShardedSafetensorsWriter, parse_shard_size

    config = AutoConfig.from_pretrained(str(base_dir))
    model = lazy.from_pretrained(base_dir)  # meta: names, ties and shapes only
    source = lazy.source_for(model)
    resized = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
    generator = torch.Generator().manual_seed(seed)
    writer = ShardedSafetensorsWriter(Path(out_dir), parse_shard_size(max_shard_size))
    numel = 0
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied parameters once
            value = source.full(name, p)
            if id(p) in resized:
                value = resized_rows(value, pieces, rows, config.initializer_range, generator)
            writer.add(name, value)
            numel += value.numel()
            del value
    writer.finish()
    for key, value in config_updates.items():
        setattr(config, key, value)
    config.save_pretrained(str(out_dir))
    if (Path(base_dir) / "generation_config.json").is_file():
        gen = GenerationConfig.from_pretrained(str(base_dir))
    else:
        gen = GenerationConfig.from_model_config(config)
    for key in ("eos_token_id", "pad_token_id"):
        if key in config_updates:
            setattr(gen, key, config_updates[key])
    gen.save_pretrained(str(out_dir))
    return numel


def _init_streamed(cfg: RecipeConfig, base_tok, new_tok) -> dict:
    """`init_model` for a sharding plugin and a base checkpoint: never the whole base in memory."""
    base_dir = resolve_path(cfg.model.base)
    check_base_dir(base_dir)
    new_ids = check_extension(base_tok, new_tok)
    pieces = old_piece_ids(base_tok, new_tok, new_ids)
    from transformers import AutoConfig

    old_rows = AutoConfig.from_pretrained(str(base_dir)).vocab_size
    rows = max(len(new_tok), old_rows)
    updates = {"vocab_size": rows, "eos_token_id": new_tok.eos_token_id, "pad_token_id": new_tok.pad_token_id}
    with atomic_directory(cfg.model_init_dir) as tmp:
        numel = stream_resized_checkpoint(base_dir, tmp, pieces, rows, updates, seed=cfg.model.init_seed)
        new_tok.save_pretrained(str(tmp))
        report = {
            "base": cfg.model.base, "parameters": numel,
            "vocab_before": len(base_tok), "vocab_after": rows, "new_rows": len(new_ids),
            "mean_pieces_per_new_token": round(sum(len(v) for v in pieces.values()) / max(len(pieces), 1), 2),
            "streamed": True,
        }
        (tmp / "init_report.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    return report


def check_base_dir(p: Path) -> None:
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"no model at {str(p)!r} (no config.json): set model.base to a Hugging Face model directory, "
            "for SmolLM2 run `python -m phalanx.pretrained` first, or leave model.base empty to build from model.architecture"
        )


def init_model(cfg: RecipeConfig) -> dict:
    base_tok = load_tokenizer(cfg.tokenizer.base)
    new_tok = load_tokenizer(cfg.tokenizer_dir)
    if cfg.model.base and builds_lazily(cfg.train.plugin):
        return _init_streamed(cfg, base_tok, new_tok)
    model = load_base_model(cfg.model.base) if cfg.model.base else build_from_config(cfg.model.architecture, base_tok, cfg.model.init_seed)
    new_ids = check_extension(base_tok, new_tok)
    pieces = old_piece_ids(base_tok, new_tok, new_ids)
    rows = max(len(new_tok), model.get_input_embeddings().weight.shape[0])
    resize_with_piece_means(model, pieces, rows)
    model.config.vocab_size = rows
    model.config.eos_token_id = new_tok.eos_token_id
    model.config.pad_token_id = new_tok.pad_token_id
    if model.generation_config is not None:
        model.generation_config.eos_token_id = new_tok.eos_token_id
        model.generation_config.pad_token_id = new_tok.pad_token_id

    out = cfg.model_init_dir
    with atomic_directory(out) as tmp:
        model.save_pretrained(str(tmp))
        new_tok.save_pretrained(str(tmp))
        report = {
            "base": cfg.model.base or "from config",
            "parameters": sum(p.numel() for p in model.parameters()),
            "vocab_before": len(base_tok), "vocab_after": rows, "new_rows": len(new_ids),
            "mean_pieces_per_new_token": round(sum(len(v) for v in pieces.values()) / max(len(pieces), 1), 2),
        }
        (tmp / "init_report.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    return report


def main(argv: list[str] | None = None) -> None:
    cfg, _ = parse_args("Resize the base model to the expanded vocabulary (new rows: mean of their old pieces).", argv)
    report = init_model(cfg)
    print(f"model {report['base']}: {report['parameters'] / 1e6:.1f} M parameters, vocabulary {report['vocab_before']} → "
          f"{report['vocab_after']} ({report['new_rows']} new rows, each the mean of "
          f"{report['mean_pieces_per_new_token']} old pieces on average); saved to {cfg.model_init_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
