"""Print samples from a model directory or a training checkpoint.

    python -m apps.llama.generate --config apps/llama/configs/tiny.yaml                  # latest pre-training checkpoint
    python -m apps.llama.generate --config apps/llama/configs/tiny.yaml --model runs/llama_tiny/export
    python -m apps.llama.generate --config ... --model DIR generate.prompts='[你好]' generate.chat=true

Prompts, sampling and length come from the `generate` section; sampling is seeded, so the same
model and config give the same text.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from .config import GenerateConfig, parse_args
from .tokenizer_io import load_tokenizer


@torch.no_grad()
def sample(model, tokenizer, prompts: list[str], gcfg: GenerateConfig) -> list[str]:
    """The continuation of each prompt (prompt text excluded)."""
    from phalanx.data.chat import ensure_chat_template
    from phalanx.booster import unwrap_model

    model = unwrap_model(model)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    outputs = []
    try:
        for prompt in prompts:
            if gcfg.chat:
                ensure_chat_template(tokenizer)
                text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                     tokenize=False)
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                # Start the prompt as a new document, the way training data presents one.
                ids = [tokenizer.eos_token_id] + tokenizer(prompt, add_special_tokens=False)["input_ids"]
            input_ids = torch.tensor([ids], device=device)
            torch.manual_seed(gcfg.seed)
            out = model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                max_new_tokens=gcfg.max_new_tokens, do_sample=gcfg.do_sample,
                temperature=gcfg.temperature if gcfg.do_sample else None,
                top_p=gcfg.top_p if gcfg.do_sample else None,
                repetition_penalty=gcfg.repetition_penalty,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            )
            outputs.append(tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True))
    finally:
        model.train(was_training)
    return outputs


def resolve_model_dir(path: str | None, output_dir: Path) -> Path:
    """An explicit model directory, checkpoint or output_dir (`phalanx.checkpoint.find.model_dir`),
    or without one the model of the latest checkpoint under `output_dir`."""
    from phalanx.checkpoint.find import model_dir

    if path:
        return model_dir(path)
    if not Path(output_dir).is_dir():
        raise FileNotFoundError(f"no checkpoint under {output_dir}: train first or pass --model DIR")
    return model_dir(output_dir)


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM

    def extra(parser):
        parser.add_argument("--model", default=None, help="model or checkpoint directory (default: latest pre-training checkpoint)")
        parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's, else <work_dir>/tokenizer)")

    cfg, args = parse_args("Print samples from a model or checkpoint.", argv, extra)
    model_dir = resolve_model_dir(args.model, Path(cfg.train.output_dir))
    tok_dir = args.tokenizer or (model_dir if (model_dir / "tokenizer_config.json").exists() else cfg.tokenizer_dir)
    tokenizer = load_tokenizer(tok_dir)
    from phalanx.device import current_device

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(current_device())
    for prompt, text in zip(cfg.generate.prompts, sample(model, tokenizer, cfg.generate.prompts, cfg.generate)):
        print(f"--- {prompt}\n{prompt}{text}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
