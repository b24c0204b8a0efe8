"""The demo's own helpers (the full demo needs the SmolLM2 download, so it is not run here)."""
from __future__ import annotations

import copy


def test_cached_step_runs_once_per_key(tmp_path):
    from apps.llama.steps import cached

    out = tmp_path / "step"
    calls = []

    def run():
        out.mkdir(exist_ok=True)
        calls.append(1)

    logs = []
    assert cached("step", out, "k1", run, logs.append) is True
    assert cached("step", out, "k1", run, logs.append) is False
    assert cached("step", out, "k2", run, logs.append) is True  # a changed config re-runs the step
    assert len(calls) == 2 and "cached" in logs[1]


def test_demo_overrides_are_valid_config_keys():
    from apps.llama.config import load_recipe
    from apps.llama.demo import CONFIG, DEMO_OVERRIDES

    cfg = load_recipe(CONFIG, DEMO_OVERRIDES)
    assert cfg.train.resume is False and cfg.train.max_steps * cfg.train.micro_batch_size * cfg.data.seq_len <= 100_000
    assert cfg.train.output_dir.endswith("pretrain")
    assert cfg.train.precision == "auto" and cfg.eval.precision == "auto"  # the hardware chooses


def test_table_lists_every_category():
    from apps.llama.demo import table

    m = {"bpc": {"zh": {"bpc": 10.5, "char_ppl": 1448.2}, "en": {"bpc": 1.2, "char_ppl": 2.3}}}
    text = table([("before", m), ("after", m)], ["zh", "en"])
    assert "zh bpc" in text and "en bpc" in text and text.count("10.500") == 2


def test_before_measurements_are_cached_by_model_and_settings(tiny_run):
    """The *before* rows are measured once; a second demo run reads them without building the model."""
    from apps.llama.demo import measure_cached
    from apps.llama.evaluate import load_heldout_chunks
    from apps.llama.pretrain import load_model
    from apps.llama.tokenizer_io import load_tokenizer

    cfg = copy.deepcopy(tiny_run[0])  # the session's config is shared with other tests
    cfg.generate.max_new_tokens = 4
    chunks = load_heldout_chunks(cfg.data_dir, cfg.eval.chunk_chars, 600)
    tokenizer = load_tokenizer(cfg.model_init_dir)
    loads = []

    def loader():
        loads.append(1)
        return load_model(cfg.model_init_dir)

    logs = []
    first = measure_cached("step 0", "key-a", loader, tokenizer, chunks, cfg, logs.append)
    again = measure_cached("step 0", "key-a", loader, tokenizer, chunks, cfg, logs.append)
    assert again == first and len(loads) == 1 and "cached" in logs[-1]
    measure_cached("step 0", "key-a", loader, tokenizer, chunks[:-1], cfg, logs.append)  # other text: measured anew
    assert len(loads) == 2


def test_missing_preparation_steps_run_and_prepared_ones_are_kept(tmp_path):
    from apps.llama.config import load_recipe
    from apps.llama.steps import prepare_missing

    cfg = load_recipe("apps/llama/configs/tiny.yaml", [f"work_dir={tmp_path}", "data.seq_len=64",
                                                        "tokenizer.domain_vocab_size=4000"])
    cfg.tokenizer.domain_sources[0].max_chars = 60_000
    for source, limit in zip(cfg.data.sources, (20_000, 10_000, 5_000), strict=True):
        source.max_chars = limit
    logs = []
    assert prepare_missing(cfg, logs.append) == ["expand_vocab", "init_model", "prepare_data"]
    assert prepare_missing(cfg, logs.append) == []  # everything present: nothing rebuilt
    marker = cfg.model_init_dir / "config.json"
    before = marker.stat().st_mtime_ns
    import shutil
    shutil.rmtree(cfg.data_dir / "train")
    assert prepare_missing(cfg, logs.append) == ["prepare_data"]  # only the missing output is made again
    assert marker.stat().st_mtime_ns == before
