"""Write the final model as a plain Hugging Face directory (safetensors + tokenizer).

    python -m apps.llama.export --config apps/llama/configs/tiny.yaml                    # latest pre-training checkpoint
    python -m apps.llama.export --config ... --checkpoint runs/llama_tiny/sft/checkpoints/step-000020 --out DIR

The result opens with `AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)`
and needs nothing from Phalanx.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from phalanx.checkpoint import atomic_directory

from .config import parse_args
from .generate import resolve_model_dir
from .tokenizer_io import load_tokenizer

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_model(model_dir: Path, out: Path, tokenizer_dir: Path, dtype: str = "auto") -> Path:
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype] or "auto")
    tokenizer = load_tokenizer(model_dir if (model_dir / "tokenizer_config.json").exists() else tokenizer_dir)
    with atomic_directory(out) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        info = {"source": str(model_dir), "dtype": str(model.dtype).replace("torch.", ""),
                "parameters": sum(p.numel() for p in model.parameters()), "vocab_size": len(tokenizer)}
        state_file = model_dir.parent / "train_state.json"
        if state_file.is_file():
            info["train_state"] = json.loads(state_file.read_text())
            info["train_state"].pop("extra", None)
        (tmp / "export_info.json").write_text(json.dumps(info, indent=2), encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> None:
    def extra(parser):
        parser.add_argument("--checkpoint", default=None, help="checkpoint or model directory (default: latest pre-training checkpoint)")
        parser.add_argument("--out", default=None, help="output directory (default: <work_dir>/export)")
        parser.add_argument("--dtype", default="auto", choices=sorted(DTYPES), help="weights dtype (default: as trained)")

    cfg, args = parse_args("Export a checkpoint as a Hugging Face model directory.", argv, extra)
    model_dir = resolve_model_dir(args.checkpoint, Path(cfg.train.output_dir))
    out = export_model(model_dir, Path(args.out) if args.out else cfg.path("export"), cfg.tokenizer_dir, args.dtype)
    print(f"exported {model_dir} → {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
