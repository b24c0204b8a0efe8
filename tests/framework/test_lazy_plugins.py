"""Lazy (meta-device) models under FSDP, ZeRO-2 and Gemini, and the streamed Hugging Face export.

The reference for loading is the same checkpoint loaded eagerly and boosted the same way: the
gathered weights, the logits and the weights after one step must be bit-identical (the same
numbers go through the same arithmetic). For random initialisation it is the same lazy model
materialised whole in one process with the same seed (`phalanx.lazy` seeds each decoder layer on
its own, so any split of the work gives the same values).
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import lazy_plugin_workers as lw
from phalanx.checkpoint.hf import INDEX, parse_shard_size, save_hf_model
from phalanx.testing import spawn


def _checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    lw.build_eager().save_pretrained(path)
    return path, load_file(path / "model.safetensors")


def _equal(got: dict, want: dict, what: str, keys=None) -> None:
    keys = list(want) if keys is None else keys
    assert set(keys) <= set(got), (what, sorted(set(keys) - set(got))[:3])
    bad = [k for k in keys if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: {len(bad)} tensor(s) differ, e.g. {bad[:3]}"


def _check_load(results: list[dict], world: int, shard_bound: dict[str, float]) -> None:
    for rank, r in enumerate(results):
        total = r["total"]
        for name in shard_bound:
            d = r[name]
            if rank == 0:  # complete on rank 0 (the writer)
                _equal(d["lazy"], d["eager"], f"{name}: lazy load vs eager load")
                _equal(d["lazy_after_step"], d["eager_after_step"], f"{name}: after one step")
                assert torch.equal(d["lazy_logits"], d["eager_logits"]), f"{name}: logits"
            # what each rank read from the file and holds: its share, not the model
            bound = shard_bound[name] * total
            assert d["read"] <= bound and d["held"] <= bound, (name, rank, d["read"], d["held"], total)
    for name in shard_bound:  # and together every element, once (FSDP) or with chunk padding (Gemini)
        held = sum(r[name]["held"] for r in results)
        assert sum(r[name]["read"] for r in results) >= results[0]["total"], name
        assert held == results[0]["total"] * (world if name == "zero2" else 1) or name == "gemini", (name, held)
        assert held >= results[0]["total"], (name, held)


def _check_export(export_dir, state: dict) -> None:
    """The streamed export: several shards, an index, and `from_pretrained` gives the state back."""
    from transformers import AutoModelForCausalLM

    index = json.loads((export_dir / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3, files
    assert (export_dir / "manifest.json").is_file()  # the atomic directory's checksums
    loaded = AutoModelForCausalLM.from_pretrained(export_dir)
    _equal(loaded.state_dict(), state, "from_pretrained of the streamed export",
           keys=[k for k in state if k != "lm_head.weight"])
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied again on load


@pytest.mark.slow
def test_lazy_plugins_2_ranks(tmp_path):
    path, saved = _checkpoint(tmp_path)
    export_dir = tmp_path / "export"
    results = spawn(lw.suite_2ranks, 2, str(path), str(export_dir), timeout=900)
    # FSDP reads and holds its rows of each parameter (66 of the 131 embedding rows on rank 0);
    # Gemini its chunk shards, read as the rows that cover them; ZeRO-2 the whole model by design.
    _check_load([r["load"] for r in results], 2, {"fsdp": 0.52, "gemini": 0.6, "zero2": 1.0})
    r0 = results[0]
    for name in ("fsdp", "zero2", "gemini"):
        _equal(r0["random"][name], r0["random"]["reference"], f"{name}: random lazy init vs whole")
    # bf16 compute: the fp32 masters are the checkpoint's values, not widened from bf16
    for name in ("zero2", "gemini"):
        low = r0["low"][name]
        assert low["dtypes"] == ["torch.bfloat16"], low["dtypes"]
        _equal(low["masters"], saved, f"{name} bf16: fp32 masters vs the checkpoint")
    weights = r0["low"]["zero2"]["weights"]
    _equal(weights, {k: v.to(torch.bfloat16) for k, v in saved.items()}, "zero2 bf16 weights")
    _check_export(export_dir, r0["export"])


@pytest.mark.slow
def test_lazy_plugins_4_ranks(tmp_path):
    path, _ = _checkpoint(tmp_path)
    export_dir = tmp_path / "export"
    results = spawn(lw.suite_4ranks, 4, str(path), str(export_dir), timeout=900)
    # 4 ranks: FSDP rank 0 holds 33 of the 131 embedding rows (0.2519 of every matrix at most)
    _check_load([r["load"] for r in results], 4, {"fsdp": 0.27, "gemini": 0.35})
    _equal(results[0]["random"]["fsdp"], results[0]["random"]["reference"], "fsdp 4 ranks: random lazy init")
    _check_export(export_dir, results[0]["export"])


# ---------------------------------------------------------------------- the streamed writer


def _written_tensor_bytes(directory) -> int:
    """Tensor bytes already in the writer's finished files (named *.part until the end)."""
    total = 0
    for part in directory.glob("*.safetensors.part"):
        total += sum(t.numel() * t.element_size() for t in load_file(part).values())
    return total


def test_streamed_export_holds_one_shard(tmp_path):
    """Counted from outside the writer: at each tensor handed to it, the bytes handed over so far
    minus the bytes already in its files is what it holds; that stays within one shard plus one
    tensor, and the export loads back equal in `from_pretrained`."""
    from transformers import AutoModelForCausalLM

    model = lw.build_eager()
    state = model.state_dict()
    max_shard = 6000  # bytes: the tiny model's 89 kB go into ~16 files
    held, handed = [], 0

    def stream():
        nonlocal handed
        for name, t in state.items():
            held.append(handed - _written_tensor_bytes(tmp_path / "out"))
            handed += 0 if name == "lm_head.weight" else t.numel() * t.element_size()  # an alias: dropped
            yield name, t.clone()

    stats = save_hf_model(model, stream(), tmp_path / "out", max_shard_size=max_shard)
    largest = max(t.numel() * t.element_size() for t in state.values())
    assert len(stats.files) >= 10 and stats.streamed, stats
    # a file holds up to max_shard bytes, or one tensor larger than that (the 16.8 kB embedding)
    bound = max(max_shard, largest)
    assert max(held) <= bound, (max(held), bound)             # before the next tensor comes in
    assert stats.peak_bytes_held <= bound + largest, stats    # the writer's own count agrees
    assert stats.peak_bytes_held >= max(held)
    assert not list((tmp_path / "out").glob("*.part"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    _equal(loaded.state_dict(), state, "from_pretrained of the streamed export")
    index = json.loads((tmp_path / "out" / INDEX).read_text())
    assert index["metadata"]["total_size"] == stats.total_bytes
    assert "lm_head.weight" not in index["weight_map"]  # tied: written once


def test_streamed_export_single_file_and_dtype(tmp_path):
    model = lw.build_eager()
    stats = save_hf_model(model, iter(model.state_dict().items()), tmp_path, dtype=torch.bfloat16)
    assert stats.files == ["model.safetensors"] and not (tmp_path / INDEX).exists()
    saved = load_file(tmp_path / "model.safetensors")
    assert {v.dtype for v in saved.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    want = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    _equal(saved, want, "bf16 export")


def test_shard_size_parsing():
    assert parse_shard_size("2GB") == 2 * 10**9
    assert parse_shard_size("64MiB") == 64 * 2**20
    assert parse_shard_size(1234) == 1234
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_shard_size("two gigs")


# ---------------------------------------------------------------------- the llama recipe's init, streamed
