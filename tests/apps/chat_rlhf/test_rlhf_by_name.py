"""Models and data by Hub name, through the local Hugging Face cache and never the network:
`model: owner/name` (phalanx.pretrained.hub_snapshot) and `data.source: owner/name[:config][@split]`
(datasets.load_dataset on the cached snapshot). The cache is one this test lays out as the hub does
(`<cache>/<kind>s--owner--name/refs/main` naming a snapshot under `snapshots/<commit>/`), with
HF_HUB_CACHE pointed at it; a name missing from it stops with the download command."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

COMMIT = "0123456789abcdef0123456789abcdef01234567"
ROWS = {"train": [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(6)],
        "test": [{"question": "What is 7 + 1?", "answer": "#### 8"}, {"question": "What is 2 + 2?", "answer": "#### 4"}]}
README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
---
A two-split test dataset laid out as openai/gsm8k is.
"""


def _snapshot(cache: Path, kind: str, repo: str) -> Path:
    """An empty snapshot directory of `repo` in the hub cache layout (refs/main -> snapshots/<commit>)."""
    root = cache / f"{kind}s--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_chat_model) -> Path:
    from datasets import Dataset
    cache = tmp_path / "hub"
    model = _snapshot(cache, "model", "tiny-org/tiny-chat")
    for f in tiny_chat_model.iterdir():
        shutil.copy(f, model / f.name)
    data = _snapshot(cache, "dataset", "tiny-org/gsm8k-mini")
    (data / "README.md").write_text(README)
    (data / "main").mkdir()
    for split, rows in ROWS.items():
        Dataset.from_list(rows).to_parquet(str(data / "main" / f"{split}-00000-of-00001.parquet"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)  # relative names resolve against an empty directory
    return cache


def test_model_by_hub_id_resolves_to_the_cached_snapshot(hub_cache, tiny_chat_model):
    import torch

    from apps.chat_rlhf.models import load_policy, load_tokenizer, resolve_model_dir
    directory = resolve_model_dir("tiny-org/tiny-chat")
    assert directory == hub_cache / "models--tiny-org--tiny-chat" / "snapshots" / COMMIT
    model, local = load_policy("tiny-org/tiny-chat"), load_policy(tiny_chat_model)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), local.state_dict().values()))
    assert load_tokenizer("tiny-org/tiny-chat").encode("hello there") == load_tokenizer(tiny_chat_model).encode("hello there")


def test_missing_model_names_the_download_command(hub_cache):
    from apps.chat_rlhf.models import resolve_model_dir
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_dir("Qwen/Qwen2.5-0.5B-Instruct")
    message = str(info.value)
    assert "hf download Qwen/Qwen2.5-0.5B-Instruct" in message and str(hub_cache) in message
    assert "no local directory" in message


def test_partial_model_download_is_named(hub_cache):
    from apps.chat_rlhf.models import resolve_model_dir
    _snapshot(hub_cache, "model", "tiny-org/half")  # the ref exists, the files do not
    with pytest.raises(FileNotFoundError, match=r"lacks \['config.json'\].*hf download tiny-org/half"):
        resolve_model_dir("tiny-org/half")


def test_dataset_by_name_reads_the_cached_splits(hub_cache):
    from apps.chat_rlhf.data import load_records
    from apps.chat_rlhf.rl_rollouts import DataSettings, load_prompt_sets
    test = load_records("tiny-org/gsm8k-mini:main@test", "prompt")
    assert [r["ground_truth"] for r in test] == [r["answer"] for r in ROWS["test"]]
    assert test[0]["prompt"] == [{"role": "user", "content": "What is 7 + 1?"}]
    train, held = load_prompt_sets(DataSettings(source="tiny-org/gsm8k-mini:main",
                                                heldout="tiny-org/gsm8k-mini:main@test", num_train=4))
    assert [r["prompt"][0]["content"] for r in train] == [r["question"] for r in ROWS["train"][:4]]
    assert len(held) == 2


def test_missing_dataset_names_the_download_command(hub_cache):
    from apps.chat_rlhf.data import RecordError, load_records
    with pytest.raises(RecordError, match=r"hf download openai/gsm8k --repo-type dataset"):
        load_records("openai/gsm8k", "prompt")
    with pytest.raises(RecordError, match="openai/gsm8k:main@test"):  # a split the cached dataset lacks
        load_records("tiny-org/gsm8k-mini:main@validation", "prompt")
