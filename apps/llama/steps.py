"""The recipe's preparation steps (expand_vocab -> init_model -> prepare_data) run for a command
that needs their outputs: cached by a key of the config (the demo), or only where an output is
missing (`pretrain` on a fresh checkout: the tiny config prepares in ~12 s on 2 cores)."""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable

from .config import RecipeConfig
from .tokenizer_io import TokenizerNotFound, tokenizer_kind

STAMP = ".prepared_key"  # the config key of the run that wrote a step's output directory


def config_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _run(name: str, run: Callable[[], object], log) -> None:
    start = time.perf_counter()
    run()
    log(f"{name}: done in {time.perf_counter() - start:.0f} s")


def cached(name: str, out_dir: Path, key: str, run: Callable[[], object], log) -> bool:
    """Run `run()` unless `out_dir` holds the output of a run with the same key; True if it ran."""
    stamp = out_dir / STAMP
    if stamp.is_file() and stamp.read_text() == key:
        log(f"{name}: cached in {out_dir}")
        return False
    _run(name, run, log)
    stamp.write_text(key)
    return True


def prepare_cached(cfg: RecipeConfig, log) -> dict:
    """Tokenizer, initial model and packed rows, each rebuilt when its part of the config changed;
    returns the vocabulary expansion report."""
    from .expand_vocab import expand_vocab
    from .init_model import init_model
    from .prepare_data import prepare_pretrain

    k_tok = config_key(cfg.tokenizer, cfg.holdout_fraction, cfg.data.sources)
    cached("expand_vocab", cfg.tokenizer_dir, k_tok, lambda: expand_vocab(cfg), log)
    cached("init_model", cfg.model_init_dir, config_key(k_tok, cfg.model), lambda: init_model(cfg), log)
    cached("prepare_data", cfg.data_dir, config_key(k_tok, cfg.data, cfg.holdout_fraction),
           lambda: prepare_pretrain(cfg), log)
    return json.loads((cfg.tokenizer_dir / "expansion_report.json").read_text())


def _has_tokenizer(directory: Path) -> bool:
    try:
        tokenizer_kind(directory)
        return True
    except TokenizerNotFound:
        return False


def prepare_missing(cfg: RecipeConfig, log) -> list[str]:
    """Run the steps whose output is missing (outputs a user prepared are never rebuilt); returns
    the steps that ran."""
    from .expand_vocab import expand_vocab
    from .init_model import init_model
    from .prepare_data import prepare_pretrain

    steps = [("expand_vocab", _has_tokenizer(cfg.tokenizer_dir), expand_vocab),
             ("init_model", (cfg.model_init_dir / "config.json").is_file(), init_model),
             ("prepare_data", (cfg.data_dir / "train").exists(), prepare_pretrain)]
    ran = []
    for name, present, step in steps:
        if not present:
            log(f"{name}: no output in {cfg.work_dir} yet, running it (python -m apps.llama.{name} does the same)")
            _run(name, lambda s=step: s(cfg), log)
            ran.append(name)
    return ran
