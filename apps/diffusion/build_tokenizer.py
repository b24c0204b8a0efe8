"""Train the small CLIP-format BPE tokenizer that ships in `data/tokenizer/` (vocab.json + merges.txt).

    python -m apps.diffusion.build_tokenizer [--vocab-size 1000] [--out apps/diffusion/data/tokenizer]

It is trained on the emoji captions plus the DreamBooth prompts, in CLIP's format (byte-level
alphabet, `</w>` marks a word's end, `<|startoftext|>` / `<|endoftext|>`), so transformers'
`CLIPTokenizer` -- and therefore `StableDiffusionPipeline` -- loads it unchanged. Takes < 1 s.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .config import APP_DATA, DreamBoothConfig

SPECIAL = ["<|startoftext|>", "<|endoftext|>"]


def captions(root: Path) -> list[str]:
    meta = root / "metadata.jsonl"
    return [json.loads(line)["text"] for line in meta.read_text().splitlines() if line.strip()]


def train_clip_bpe(texts: list[str], out_dir: Path, vocab_size: int = 1000) -> Path:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=SPECIAL[1], end_of_word_suffix="</w>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, end_of_word_suffix="</w>",
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.model.save(str(out_dir))  # vocab.json + merges.txt, the files CLIPTokenizer reads
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=1000)
    parser.add_argument("--out", default=str(APP_DATA / "tokenizer"))
    args = parser.parse_args(argv)
    db = DreamBoothConfig()
    texts = captions(APP_DATA / "noto_emoji_64") + [db.instance_prompt, db.class_prompt, *db.validation_prompts]
    print(f"tokenizer written to {train_clip_bpe(texts, Path(args.out), args.vocab_size)}")


if __name__ == "__main__":
    main()
