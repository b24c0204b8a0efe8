"""Stage 1: supervised fine-tuning on conversations, through the framework's chat path.

    python -m apps.chat_rlhf.sft --config apps/chat_rlhf/configs/sft.yaml
    phalanx run -n 2 -m apps.chat_rlhf.sft --config apps/chat_rlhf/configs/sft.yaml train.plugin=fsdp

Records (TRL `messages`, or `prompt`/`completion`) are rendered with the tokenizer's chat template
and labelled only on assistant turns (`phalanx.data.chat.encode_chat`), packed into rows of
`data.seq_len` tokens (`phalanx.data.packing.ExamplePacker`), and trained with `phalanx.train.fit`'s
causal-LM loss; the held-out assistant-token loss is evaluated every `train.eval_every` steps.
The output_dir's latest checkpoint (`model/`, with the tokenizer) is what `train_rm`, `dpo`,
`ppo` and `grpo` take as `model`.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from phalanx.config import ConfigError, load_config, parse_config_args
from phalanx.train.config import TrainConfig

from .adapters import LoRASettings, lora_hooks, prepare
from .data import load_records, split_heldout


@dataclass
class SFTDataConfig:
    path: str = "apps/chat_rlhf/data/llamafactory_demo/alpaca_en_demo.jsonl"  # jsonl/json/parquet/saved dir
    max_records: int = 0                 # read at most this many (0: all)
    heldout_fraction: float = 0.05       # share kept out of training (by a hash of the record)
    seq_len: int = 512                   # tokens per training row; longer conversations are cut
    pack: bool = True                    # several conversations per row (padding only at the end)

    def validate(self) -> None:
        if self.seq_len < 8:
            raise ConfigError(f"data.seq_len={self.seq_len}: must be at least 8")
        if not 0 <= self.heldout_fraction < 1:
            raise ConfigError(f"data.heldout_fraction={self.heldout_fraction}: must be in [0, 1)")


@dataclass
class SFTConfig:
    model: str = ""                      # HF dir, checkpoint, output_dir, or "" for SmolLM2-135M-Instruct
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    eval_batch_size: int = 8
    lora: LoRASettings = field(default_factory=LoRASettings)  # adapters only (adapters.py)
    activation_checkpointing: bool = False  # recompute each decoder layer in backward (any plugin)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> None:
        if self.train.output_dir == TrainConfig.output_dir:
            self.train.output_dir = "runs/chat_rlhf/sft"
        self.lora.validate()


def load_sft_config(path, overrides=None) -> SFTConfig:
    return load_config(SFTConfig, path, overrides)


def build_rows(records: list[dict], tokenizer, data: SFTDataConfig) -> tuple[list[dict], dict[str, int]]:
    """Packed rows {"input_ids", "labels"} (tensors) and counts of what went in."""
    from phalanx.data.chat import encode_chat
    from phalanx.data.packing import ExamplePacker

    packer = ExamplePacker(data.seq_len, tokenizer.pad_token_id, data.pack)
    rows, stats = [], {"conversations": 0, "dropped": 0, "target_tokens": 0}
    for r in records:
        encoded = encode_chat(tokenizer, r["messages"], data.seq_len)
        if encoded is None:  # every assistant token was cut off
            stats["dropped"] += 1
            continue
        stats["conversations"] += 1
        stats["target_tokens"] += sum(label >= 0 for label in encoded[1])
        rows.extend(packer.add(*encoded))
    rows.extend(packer.finish())
    return [{k: torch.tensor(v) for k, v in row.items()} for row in rows], stats


def sft(cfg: SFTConfig, log=print):
    from phalanx.device import run_device
    from phalanx.train import causal_lm_eval, fit

    from .models import load_policy, load_tokenizer, resolve_model_dir

    cfg.data.validate()
    records = load_records(cfg.data.path, "messages", max_records=cfg.data.max_records)  # bad records stop here
    train_records, held_records = split_heldout(records, cfg.data.heldout_fraction)
    model_dir = resolve_model_dir(cfg.model)
    tokenizer = load_tokenizer(model_dir)
    train_rows, stats = build_rows(train_records, tokenizer, cfg.data)
    held_rows, _ = build_rows(held_records, tokenizer, cfg.data)
    log(f"sft: {stats['conversations']} conversations ({stats['target_tokens']} assistant tokens, {stats['dropped']} "
        f"dropped) in {len(train_rows)} rows of {cfg.data.seq_len}; {len(held_rows)} held-out rows")
    model = load_policy(model_dir).to(run_device())  # the "before" evaluation runs where training will
    eval_fn = causal_lm_eval(held_rows, batch_size=cfg.eval_batch_size) if held_rows else None
    before = {}
    if eval_fn is not None:
        model.eval()
        before = eval_fn(model, 0)
        model.train()
        log(f"held-out assistant-token loss before: {before['loss']:.4f}")
    model = prepare(model, cfg.lora, cfg.activation_checkpointing, cfg.train.seed)
    return fit(cfg.train, model, train_rows, eval_fn=eval_fn, tokenizer=tokenizer,
               hooks=lora_hooks(cfg.lora, tokenizer)), before


def main(argv: list[str] | None = None) -> None:
    from phalanx.launch import launched

    cfg, _ = parse_config_args("Supervised fine-tuning (labels on assistant turns only).", load_sft_config, argv,
                               example="apps/chat_rlhf/configs/sft.yaml")
    with launched(seed=cfg.train.seed) as ctx:
        log = print if ctx.is_main else (lambda *a, **k: None)
        result, before = sft(cfg, log)
        held = result.last_eval.get("loss")
        log(f"SFT done at step {result.final_step}: train loss {result.losses[-1]:.4f}"
            + (f", held-out assistant-token loss {before['loss']:.4f} -> {held:.4f}" if held is not None else "")
            + f"; checkpoint {result.checkpoint_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
