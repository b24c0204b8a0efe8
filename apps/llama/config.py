"""The recipe's config: one YAML file drives all steps (expand_vocab → init_model → prepare_data →
pretrain/sft → generate/export).

Each step reads its own section and finds the previous step's output under `work_dir` (unless
the section names another directory), so a run is reproducible from the YAML alone:

    work_dir/tokenizer/     expanded tokenizer (HF directory)      expand_vocab
    work_dir/model_init/    resized base model (HF directory)      init_model
    work_dir/data/          packed training sequences, held-out    prepare_data
    work_dir/pretrain/      checkpoints, metrics.jsonl             pretrain (train.output_dir)
    work_dir/sft_data/      chat sequences with masked labels      prepare_data --sft
    work_dir/sft/           checkpoints                            sft (sft.output_dir)
    work_dir/export/        final model (HF directory)             export

Every command takes `--config FILE` and `key=value` overrides (`train.lr=1e-4`, `data.seq_len=256`).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from phalanx.booster.lora import LoRASection
from phalanx.config import ConfigError, load_config, parse_config_args
from phalanx.train.config import TrainConfig

from .corpus import SourceConfig, resolve_path


_DEFAULT_TRAIN_DIR = TrainConfig.output_dir  # the class default, i.e. "not set by the recipe config"


@dataclass
class TokenizerConfig:
    """Step 1, vocabulary expansion."""

    base: str = "apps/llama/data/tokenizer/llama_sentencepiece_32k.model"  # a tokenizer.model file or an HF tokenizer directory
    kind: Literal["auto", "sentencepiece", "bpe"] = "auto"  # auto: SentencePiece when the base has a tokenizer.model
    domain_sources: list[SourceConfig] = field(default_factory=list)
    domain_vocab_size: int = 8000  # size of the vocabulary learned on the domain corpus; pieces the base has are skipped
    max_piece_length: int = 8  # SentencePiece: longest new piece, in characters
    character_coverage: float = 0.9995  # SentencePiece: share of the corpus's characters that get their own piece
    max_training_chars: int = 0  # 0: learn from the whole (non-held-out) domain corpus
    output_dir: str = ""  # default: <work_dir>/tokenizer

    def validate(self) -> None:
        if self.domain_vocab_size < 1:
            raise ConfigError(f"tokenizer.domain_vocab_size must be positive, got {self.domain_vocab_size}")


@dataclass
class ModelConfig:
    """Step 2, model initialisation."""

    base: str = ""  # HF directory with the base weights; empty: a fresh LLaMA built from `architecture`
    architecture: dict[str, Any] = field(default_factory=dict)  # HF config fields of a model built from config (model_type: any family, default llama)
    init_seed: int = 0
    output_dir: str = ""  # default: <work_dir>/model_init


@dataclass
class DataConfig:
    """Step 3, pre-training data."""

    sources: list[SourceConfig] = field(default_factory=list)
    seq_len: int = 512
    per_category_bins: bool = False  # pack each category separately (no sequence mixes two categories)
    drop_last_partial: bool = False  # keep the final partial sequence (padded, padding unlabelled) so no token is lost
    output_dir: str = ""  # default: <work_dir>/data

    def validate(self) -> None:
        if self.seq_len < 2:
            raise ConfigError(f"data.seq_len must be at least 2, got {self.seq_len}")


@dataclass
class ChatSourceConfig:
    """One chat/instruction file for SFT."""

    path: str
    format: Literal["auto", "messages", "alpaca", "qa"] = "auto"  # auto: by the fields of the first record
    messages_field: str = "messages"  # messages: a list of {role, content}
    prompt_field: str = "question"  # qa: the user turn
    response_field: str = "answer"  # qa: the assistant turn
    system: str = ""  # a system prompt to prepend (none when empty)
    max_examples: int = 0  # 0: all


@dataclass
class SFTDataConfig:
    sources: list[ChatSourceConfig] = field(default_factory=list)
    seq_len: int = 512
    pack: bool = True  # several conversations per row (padding only at the end of a row)
    holdout_fraction: float = 0.02
    output_dir: str = ""  # default: <work_dir>/sft_data


@dataclass
class EvalConfig:
    """Held-out evaluation: bits per character per category."""

    chunk_chars: int = 256  # held-out documents are cut into pieces of at most this many characters
    max_chars_per_category: int = 20000
    batch_size: int = 8
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast where the CPU/GPU computes it natively


@dataclass
class GenerateConfig:
    prompts: list[str] = field(default_factory=lambda: ["春风"])
    chat: bool = False  # wrap each prompt as a user turn with the chat template
    max_new_tokens: int = 48
    do_sample: bool = True
    temperature: float = 0.7
    top_p: float = 0.9
    repetition_penalty: float = 1.1
    seed: int = 0


@dataclass
class LoRAConfig(LoRASection):
    """LoRA (low-rank adapters, PEFT underneath) for pretrain and sft: the base model is frozen and
    only the adapters train, in the optimizer and in the plugin's shards. At the end the adapter is
    written in PEFT's format to `<output_dir>/adapter` (`peft.PeftModel.from_pretrained(base, dir)`
    opens it) and, with `merge`, the base model with the adapter merged in to `<output_dir>/merged`
    (a plain HF directory: point `sft_init` or `generate` at it). Plugins: ddp, zero1, zero2, fsdp,
    gemini, hybrid (docs/lora.md)."""


@dataclass
class RecipeConfig:
    work_dir: str = "runs/llama"
    holdout_fraction: float = 0.01  # fixed share of each corpus kept for evaluation (by a hash of the text)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft_data: SFTDataConfig = field(default_factory=SFTDataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    train: TrainConfig = field(default_factory=TrainConfig)  # the training loop, for pretrain
    sft: TrainConfig = field(default_factory=TrainConfig)  # the training loop, for sft
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # adapters instead of full fine-tuning (pretrain and sft)
    sft_init: str = ""  # model SFT starts from; empty: the latest pre-training checkpoint, else model_init

    def validate(self) -> None:
        if not 0 <= self.holdout_fraction < 1:
            raise ConfigError(f"holdout_fraction must be in [0, 1), got {self.holdout_fraction}")
        # Unless a config names them, training runs write under work_dir like every other step.
        if self.train.output_dir == _DEFAULT_TRAIN_DIR:
            self.train.output_dir = str(self.path("pretrain"))
        if self.sft.output_dir == _DEFAULT_TRAIN_DIR:
            self.sft.output_dir = str(self.path("sft"))

    # Where each step writes (and the next reads) unless the section names a directory.
    def path(self, name: str) -> Path:
        return Path(self.work_dir).expanduser() / name

    @property
    def tokenizer_dir(self) -> Path:
        return Path(self.tokenizer.output_dir).expanduser() if self.tokenizer.output_dir else self.path("tokenizer")

    @property
    def model_init_dir(self) -> Path:
        return Path(self.model.output_dir).expanduser() if self.model.output_dir else self.path("model_init")

    @property
    def data_dir(self) -> Path:
        return Path(self.data.output_dir).expanduser() if self.data.output_dir else self.path("data")

    @property
    def sft_data_dir(self) -> Path:
        return Path(self.sft_data.output_dir).expanduser() if self.sft_data.output_dir else self.path("sft_data")


def parse_args(description: str, argv: list[str] | None = None,
               extra: "Callable[[argparse.ArgumentParser], None] | None" = None) -> tuple[RecipeConfig, argparse.Namespace]:
    """`--config FILE key=value ...` → (RecipeConfig, namespace). `extra(parser)` adds step options."""
    return parse_config_args(description, load_recipe, argv, example="apps/llama/configs/tiny.yaml", extra=extra)


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> RecipeConfig:
    if path is not None:
        path = resolve_path(path)
    return load_config(RecipeConfig, path, overrides)
