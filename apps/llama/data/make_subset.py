"""Rebuild the shipped data files from the project's shared data folder (`../shared/data`).

The recipe ships small, deterministic subsets so a clone stays light (a few MB). Running this
script again reproduces them byte for byte from the originals:

    python apps/llama/data/make_subset.py /path/to/shared/data

What is kept (see README.md in this folder for sources and licences):
- zh_classics.txt.gz: every 3rd poem/chapter of the Chinese classics corpus (blank-line separated).
- en_wikipedia_leads.jsonl.gz: every 2nd Wikipedia lead.
- shakespeare_4plays.txt.gz: the first four plays of the Shakespeare collection.
- chat/gsm8k_{train,test}.jsonl.gz: the first 2,000 training and 300 test problems of GSM8K.
- chat/alpaca_{en,zh}_demo.json.gz: the LLaMA-Factory demo instruction sets, unchanged.
- tokenizer/llama_sentencepiece_32k.model: unchanged.
"""
from __future__ import annotations

import gzip
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _write_gz(path: Path, text: str) -> None:
    # mtime=0 keeps the gzip header (and so the file) identical between runs.
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=9) as f:
        f.write(text.encode("utf-8"))


def main(shared: Path) -> None:
    text_dir, chat_dir = shared / "text", shared / "chat"
    (HERE / "chat").mkdir(exist_ok=True)
    (HERE / "tokenizer").mkdir(exist_ok=True)

    poems = gzip.open(text_dir / "zh_classics.txt.gz", "rt", encoding="utf-8").read().split("\n\n")
    _write_gz(HERE / "zh_classics.txt.gz", "\n\n".join(poems[::3]) + "\n")

    leads = gzip.open(text_dir / "en_wikipedia_leads.jsonl.gz", "rt", encoding="utf-8").read().splitlines()
    _write_gz(HERE / "en_wikipedia_leads.jsonl.gz", "\n".join(leads[::2]) + "\n")

    plays = gzip.open(text_dir / "shakespeare_plays.txt.gz", "rt", encoding="utf-8").read()
    cut = plays.index("THE TRAGEDY OF CORIOLANUS")  # start of the fifth play
    _write_gz(HERE / "shakespeare_4plays.txt.gz", plays[:cut].rstrip() + "\n")

    for split, keep in (("train", 2000), ("test", 300)):
        lines = (chat_dir / "gsm8k" / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
        _write_gz(HERE / "chat" / f"gsm8k_{split}.jsonl.gz", "\n".join(lines[:keep]) + "\n")
    for lang in ("en", "zh"):
        src = chat_dir / "llamafactory_demo" / f"alpaca_{lang}_demo.json"
        _write_gz(HERE / "chat" / f"alpaca_{lang}_demo.json.gz", src.read_text(encoding="utf-8"))

    shutil.copyfile(shared / "tokenizer" / "llama_sentencepiece_32k.model",
                    HERE / "tokenizer" / "llama_sentencepiece_32k.model")
    licences = {
        text_dir / "LICENSE-chinese-poetry-MIT.txt": HERE / "LICENSE-chinese-poetry-MIT.txt",
        text_dir / "COPYING-shakespeare.txt": HERE / "COPYING-shakespeare.txt",
        chat_dir / "gsm8k" / "LICENSE": HERE / "chat" / "LICENSE-gsm8k-MIT.txt",
        chat_dir / "llamafactory_demo" / "LICENSE": HERE / "chat" / "LICENSE-llamafactory-Apache-2.0.txt",
        shared / "tokenizer" / "LICENSE-Apache-2.0.txt": HERE / "tokenizer" / "LICENSE-Apache-2.0.txt",
    }
    for src, dst in licences.items():
        shutil.copyfile(src, dst)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python apps/llama/data/make_subset.py /path/to/shared/data")
    main(Path(sys.argv[1]))
