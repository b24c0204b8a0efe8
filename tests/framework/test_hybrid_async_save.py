"""Asynchronous checkpoints of HybridParallelPlugin: the copy of the model kept until the
background write is spread over every rank (`HybridCheckpointIO.spread_model_copy`), and no
pickled object crosses ranks in any plugin's checkpoint save.

Each hybrid layout trains one AdamW step on a tiny Llama (untied) and GPT-2 (tied embeddings, a
vocabulary tp=2 pads), then `CheckpointWriter` saves the same state synchronously and
asynchronously with torch's object collectives patched to raise on every rank. Checked:
- the asynchronous checkpoint holds the synchronous one's tensors bit for bit (model and
  optimizer), is committed with its manifest, and its model is a sharded export with a file per
  rank and an index, which `from_pretrained` opens (tied again);
- it loads into another layout (model and optimizer) and gathers back to the same tensors;
- each rank's snapshot kept at most its share of the model (total/N plus one tensor), nothing
  was kept whole on rank 0, and together the ranks kept every tensor once;
- DDP, ZeRO-2, FSDP and Gemini save the same way with no pickled object (their optimizer index
  and the temporary directory's name are JSON now).
And on 4 ranks (tp2 × pp2), a 24.1 MiB Llama: the bytes each rank keeps. The cases of one world
size share one spawn (spawn_batch); the 4-rank ones are `slow`.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hybrid_models as hm
import hybrid_workers as hw
from spawn_batch import spawn_suites

LM = dict(zero_stage=1)
TWO_RANKS = {
    "tp2": dict(save=dict(tp_size=2, **LM), load_into=dict(pp_size=2, num_microbatches=2)),
    "pp2": dict(save=dict(pp_size=2, num_microbatches=2, **LM), load_into=dict(tp_size=2, zero_stage=2)),
}
FOUR_RANKS = {
    "tp2+pp2": dict(save=dict(tp_size=2, pp_size=2, num_microbatches=2, **LM), load_into=dict(tp_size=2, zero_stage=2)),
}
PLUGINS = ("ddp", "zero2", "fsdp", "gemini")
HYBRID, OTHERS = ("test_hybrid_async_save_spreads_the_copy_two_ranks",
                  "test_every_plugin_saves_without_pickled_objects")
HYBRID_4, SIZES_4 = ("test_hybrid_async_save_spreads_the_copy_four_ranks",
                     "test_hybrid_async_copy_of_a_mid_sized_model_four_ranks")


# ---------------------------------------------------------------------- per rank (spawned)
def _checkpoint_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a training checkpoint: the model's by name, the optimizer's by file/name."""
    from safetensors.torch import load_file

    from phalanx.checkpoint import load_hf_state_dict

    out = {f"model/{k}": v for k, v in load_hf_state_dict(checkpoint / "model").items()}
    for f in sorted((checkpoint / "optimizer").glob("*.safetensors")):
        out.update({f"{f.name}/{k}": v for k, v in load_file(str(f)).items()})
    return out


def _save_both_ways(booster, model, optimizer, root: Path) -> dict:
    """The same state saved by `CheckpointWriter` synchronously and asynchronously, with object
    collectives refused on every rank for the whole save (the background write included); what
    this rank's asynchronous snapshot kept of the model."""
    from phalanx.checkpoint.train_state import TrainState
    from phalanx.checkpoint.writer import CheckpointWriter

    out: dict = {}
    for mode in ("sync", "async"):
        writer = CheckpointWriter(booster, root / mode, async_write=mode == "async")
        snapshot = writer._snapshot

        def recording(*args, **kwargs):
            snap = snapshot(*args, **kwargs)
            spread = snap.model_spread
            out["kept"] = sum(t.numel() * t.element_size() for t in spread.tensors.values()) if spread else None
            out["spread_total"] = spread.total_bytes if spread else None
            out["kept_names"] = sorted(spread.tensors) if spread else []
            out["whole_on_this_rank"] = snap.model_state is not None
            return snap

        writer._snapshot = recording
        undo = hw._refuse_object_collectives()
        try:
            outcome = writer.save(root / mode / "step-00000001", 1, model, optimizer, None, TrainState(step=1))
            outcome = outcome or writer.wait()
        finally:
            undo()
        out[f"{mode}_error"] = "" if outcome.ok else outcome.error
    return out


def _compare_checkpoints(root: Path) -> dict:
    """Rank 0: the asynchronous checkpoint against the synchronous one, and its model directory."""
    from transformers import AutoModelForCausalLM

    from phalanx.checkpoint import load_hf_state_dict, verify_manifest

    sync, spread = root / "sync" / "step-00000001", root / "async" / "step-00000001"
    verify_manifest(spread)
    a, b = _checkpoint_tensors(spread), _checkpoint_tensors(sync)
    export = load_hf_state_dict(spread / "model")
    loaded = AutoModelForCausalLM.from_pretrained(str(spread / "model"))
    sizes = [t.numel() * t.element_size() for t in export.values()]
    return {"async_vs_sync": hw._differences(a, b, sorted(set(a) | set(b))),
            "model_files": sorted(p.name for p in (spread / "model").glob("*.safetensors")),
            "index": (spread / "model" / "model.safetensors.index.json").is_file(),
            "from_pretrained_vs_export": hw._differences(loaded.state_dict(), export, sorted(export)),
            "tied_on_load": (not getattr(loaded.config, "tie_word_embeddings", False))
            or loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight,
            "export_total": sum(sizes), "largest": max(sizes)}


def hybrid_async_suite(directory: str, layouts: dict, families=("llama", "gpt2")) -> dict:
    """For each layout and family: one AdamW step, both saves, the comparison on rank 0, and the
    asynchronous checkpoint loaded into `layouts[name]["load_into"]` and gathered back."""
    from phalanx.checkpoint import load_hf_state_dict

    rank = dist.get_rank()
    out: dict = {}
    for name, spec in layouts.items():
        for family in families:
            booster, model, optimizer = hw.boost(family, dict(spec["save"]), kind="adamw")
            hw.train_steps(booster, model, optimizer, hm.tokens(family, steps=1))
            root = Path(directory) / name / family
            r = _save_both_ways(booster, model, optimizer, root)
            if rank == 0:
                r.update(_compare_checkpoints(root))
            dist.barrier()
            booster2, model2, optimizer2 = hw.boost(family, dict(spec["load_into"]), kind="adamw", seed=99)
            booster2.load_checkpoint(root / "async" / "step-00000001", model2, optimizer2)
            back = booster2.plugin.full_model_state_dict(model2)
            if rank == 0:
                export = load_hf_state_dict(root / "async" / "step-00000001" / "model")
                r["reloaded_vs_export"] = hw._differences(back, export, sorted(export))
            out.setdefault(name, {})[family] = r
            dist.barrier()
    return out


def plugins_suite(directory: str, plugins: tuple[str, ...]) -> dict:
    """DDP, ZeRO-2, FSDP and Gemini: one AdamW step on the tiny Llama, both saves with object
    collectives refused, and on rank 0 the asynchronous checkpoint against the synchronous one."""
    from phalanx.booster.plugins import make_plugin

    out = {}
    for name in plugins:
        booster, model, optimizer = hw.boost("llama", make_plugin(name), kind="adamw")
        hw.train_steps(booster, model, optimizer, hm.tokens("llama", steps=1))
        root = Path(directory) / name
        r = _save_both_ways(booster, model, optimizer, root)
        if dist.get_rank() == 0:
            r.update(_compare_checkpoints(root))
        out[name] = r
        dist.barrier()
    return out


def spread_size_suite(directory: str, layout: dict, hidden: int = 256, layers: int = 8, vocab: int = 1024) -> dict:
    """The bytes each rank keeps in an asynchronous snapshot of a Llama of many mid-sized tensors
    (test_hybrid_save's memory model: 6.3M parameters, 24.1 MiB in fp32, the largest tensors
    1 MiB), saved after boosting (no step: the optimizer has no state yet)."""
    model, sizes = hw.mid_sized_llama(hidden, layers, vocab)
    booster, model, optimizer = hw.boost("llama", layout, model=model, kind="adamw")
    r = _save_both_ways(booster, model, optimizer, Path(directory))
    return {**r, "model": sum(sizes), "largest": max(sizes)}


# ---------------------------------------------------------------------- the tests
def _check_saves(results: list[dict], where: str) -> None:
    """Both saves succeeded with no pickled object on any rank (a refused object collective
    fails the save, whose outcome names it), and the asynchronous one equals the synchronous."""
    for rank, r in enumerate(results):
        assert not r["sync_error"] and not r["async_error"], (where, rank, r["sync_error"], r["async_error"])
    r0 = results[0]
    assert not r0["async_vs_sync"], f"{where}: the asynchronous checkpoint differs: {r0['async_vs_sync'][:3]}"
    assert not r0["from_pretrained_vs_export"], (where, r0["from_pretrained_vs_export"][:3])
    assert r0["tied_on_load"], where


def _check_spread(results: list[dict], where: str) -> list[float]:
    """Each rank kept at most total/N plus the largest tensor, all together every tensor once,
    written as one file per rank with an index; returns each rank's share of the model."""
    world, r0 = len(results), results[0]
    total, largest = r0["export_total"], r0["largest"]
    assert not any(r["whole_on_this_rank"] for r in results), where
    assert all(r["spread_total"] == total for r in results), (where, total, [r["spread_total"] for r in results])
    kept = [r["kept"] for r in results]
    assert sum(kept) == total, (where, kept, total)
    names = [n for r in results for n in r["kept_names"]]
    assert len(names) == len(set(names)), f"{where}: a tensor was kept twice"
    for rank, k in enumerate(kept):
        assert 0 < k <= total / world + largest, (where, rank, k, total, largest)
    assert r0["index"] and len(r0["model_files"]) == world, (where, r0["model_files"])
    return [k / total for k in kept]


def _check_hybrid(results: list[dict], layouts: dict) -> None:
    shares = {}
    for layout in layouts:
        for family in ("llama", "gpt2"):
            where = f"{layout}/{family}"
            per_rank = [r[layout][family] for r in results]
            _check_saves(per_rank, where)
            assert not per_rank[0]["reloaded_vs_export"], (where, per_rank[0]["reloaded_vs_export"][:3])
            shares[where] = [round(s, 3) for s in _check_spread(per_rank, where)]
    print("share of the model each rank kept in its asynchronous snapshot:", shares)


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory):
    """The 2-rank hybrid layouts and the other plugins in one spawn (spawn_batch)."""
    root = tmp_path_factory.mktemp("async2")
    suites = {HYBRID: (hybrid_async_suite, (str(root / "hybrid"), TWO_RANKS), {}),
              OTHERS: (plugins_suite, (str(root / "plugins"), PLUGINS), {})}
    return spawn_suites(request, 2, suites, timeout=900)


def test_hybrid_async_save_spreads_the_copy_two_ranks(two_ranks):
    _check_hybrid(two_ranks.get(HYBRID), TWO_RANKS)


def test_every_plugin_saves_without_pickled_objects(two_ranks):
    results = two_ranks.get(OTHERS)
    shares = {}
    for name in PLUGINS:
        per_rank = [r[name] for r in results]
        _check_saves(per_rank, name)
        shares[name] = [round(s, 3) for s in _check_spread(per_rank, name)]
    print("share of the model each rank kept:", shares)


@pytest.fixture(scope="module")
def four_ranks(request, tmp_path_factory):
    """The 4-rank cases in one spawn (spawn_batch)."""
    root = tmp_path_factory.mktemp("async4")
    suites = {HYBRID_4: (hybrid_async_suite, (str(root / "hybrid"), FOUR_RANKS), {}),
              SIZES_4: (spread_size_suite, (str(root / "sizes"), dict(tp_size=2, pp_size=2, num_microbatches=2,
                                                                       zero_stage=1)), {})}
    return spawn_suites(request, 4, suites, timeout=900)


@pytest.mark.slow
def test_hybrid_async_save_spreads_the_copy_four_ranks(four_ranks):
    _check_hybrid(four_ranks.get(HYBRID_4), FOUR_RANKS)


@pytest.mark.slow
def test_hybrid_async_copy_of_a_mid_sized_model_four_ranks(four_ranks):
    """tp2 × pp2: each rank keeps about a quarter of a 24.1 MiB model (at most a quarter plus one
    1 MiB tensor), where the copy used to be whole on rank 0."""
    results = four_ranks.get(SIZES_4)
    mib, model, largest = 2**20, results[0]["model"], results[0]["largest"]
    kept = [r["kept"] for r in results]
    print(f"asynchronous snapshot of a {model / mib:.1f} MiB model, MiB kept per rank:",
          [round(k / mib, 2) for k in kept], f"(a quarter: {model / 4 / mib:.2f})")
    for rank, r in enumerate(results):
        assert not r["sync_error"] and not r["async_error"], (rank, r)
        assert not r["whole_on_this_rank"] and r["spread_total"] == model, (rank, r["spread_total"], model)
        assert 0 < r["kept"] <= model / 4 + largest, (rank, r["kept"] / mib)
    assert sum(kept) == model
