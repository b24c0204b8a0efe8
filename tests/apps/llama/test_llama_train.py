"""Training through phalanx.train: a 2-rank ZeRO-2 run of the tiny recipe lowers the loss and
resumes; SFT runs from its checkpoint; the exported model opens in plain transformers."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

TRAIN_OVERRIDES = [
    "train.plugin=zero2", "train.precision=fp32", "train.micro_batch_size=4", "train.lr=3e-3",
    "train.warmup_steps=1", "train.save_every=3", "train.eval_every=0", "train.log_every=1", "train.progress_bar=false",
    "sft.plugin=zero2", "sft.micro_batch_size=2", "sft.max_steps=3", "sft.save_every=0", "sft.eval_every=0",
    "sft.progress_bar=false", "eval.max_chars_per_category=600",
]


TINY = Path(__file__).resolve().parents[3] / "apps" / "llama" / "configs" / "tiny.yaml"


def _train_ranks(overrides: list[str]) -> dict:
    """Runs on each of 2 ranks: 6 steps, then the same command with max_steps=9 (a resume), then 3 SFT steps."""
    import torch.distributed as dist

    from apps.llama.config import load_recipe
    from apps.llama.pretrain import pretrain
    from apps.llama.sft import sft

    first = pretrain(load_recipe(TINY, overrides + ["train.max_steps=6"]))
    second = pretrain(load_recipe(TINY, overrides + ["train.max_steps=9"]))
    tuned = sft(load_recipe(TINY, overrides))
    return {"rank": dist.get_rank(), "first": first.losses, "first_step": first.final_step,
            "second_start": second.start_step, "second_step": second.final_step, "second": second.losses,
            "eval": second.last_eval, "checkpoint": str(second.checkpoint_dir),
            "sft_step": tuned.final_step, "sft_losses": tuned.losses, "sft_eval": tuned.last_eval}


@pytest.fixture(scope="module")
def trained(tiny_run, tmp_path_factory):
    from phalanx.testing import spawn

    cfg, _ = tiny_run
    work = tmp_path_factory.mktemp("llama_train")
    # The prepared steps 1–3 live in the session's work_dir; training writes under this test's dir.
    overrides = [f"work_dir={cfg.work_dir}", f"train.output_dir={work / 'pretrain'}", f"sft.output_dir={work / 'sft'}",
                 *TRAIN_OVERRIDES]
    results = spawn(_train_ranks, 2, overrides, timeout=600)
    return cfg, work, results


def test_zero2_two_ranks_lowers_loss_and_resumes(trained):
    cfg, work, results = trained
    r0, r1 = results
    assert r0["first"] == r1["first"]  # the global loss is the same number on every rank
    assert r0["first_step"] == 6 and len(r0["first"]) == 6
    assert r0["first"][-1] < r0["first"][0] - 0.5, r0["first"]
    assert r0["second_start"] == 6 and r0["second_step"] == 9 and len(r0["second"]) == 3  # resumed, not restarted
    assert r0["second"][-1] < r0["first"][0]
    assert {"zh/bpc", "en/bpc", "zh/char_ppl"} <= set(r0["eval"])
    assert r0["eval"] == r1["eval"]
    metrics = [json.loads(line) for line in (work / "pretrain" / "metrics.jsonl").read_text().splitlines()]
    assert max(m["step"] for m in metrics) == 9
    assert r0["sft_step"] == 3 and all(map(lambda x: x == x, r0["sft_losses"]))
    assert "loss" in r0["sft_eval"]


def test_exported_model_opens_in_plain_transformers(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from apps.llama.evaluate import bits_per_char, load_heldout_chunks
    from apps.llama.export import export_model

    cfg, work, results = trained
    checkpoint = Path(results[0]["checkpoint"])
    out = export_model(checkpoint / "model", work / "export", cfg.tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    assert model.config.vocab_size == len(tok)
    ids = tok("春风", return_tensors="pt").input_ids
    out_ids = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out_ids.shape[1] == ids.shape[1] + 5
    # the exported weights are the trained ones: same held-out bits per character as the run reported
    chunks = load_heldout_chunks(cfg.data_dir, cfg.eval.chunk_chars, 600)
    bpc = bits_per_char(model, tok, chunks)
    assert abs(bpc["zh"]["bpc"] - results[0]["eval"]["zh/bpc"]) < 1e-3
    info = json.loads((out / "export_info.json").read_text())
    assert info["train_state"]["step"] == 9


def test_generate_prints_samples_from_the_latest_checkpoint(trained, capsys):
    from apps.llama.generate import main

    cfg, work, _ = trained
    main(["--config", str(TINY),
          f"work_dir={cfg.work_dir}", f"train.output_dir={work / 'pretrain'}", "generate.max_new_tokens=4",
          "generate.prompts=[春风]"])
    printed = capsys.readouterr().out
    assert printed.startswith("--- 春风\n春风") and len(printed.splitlines()) >= 2


# name: overrides of one 2-rank layout (the hybrid ones: tensor parallel, and a pipeline whose
# evaluation runs forward-only through the stages)
LAYOUTS = {
    "ddp": ["train.plugin=ddp"], "fsdp": ["train.plugin=fsdp"], "zero1": ["train.plugin=zero1"],
    "tp2": ["train.plugin=hybrid", "train.plugin_options={tp_size: 2}", "train.micro_batch_size=8"],
    "pp2": ["train.plugin=hybrid", "train.plugin_options={pp_size: 2, num_microbatches: 2}",
            "train.micro_batch_size=8"],
}


def _plugin_ranks(overrides: list[str], layouts: dict[str, list[str]], out_dir: str) -> dict:
    from apps.llama.config import load_recipe
    from apps.llama.pretrain import pretrain

    out = {}
    for name, extra in layouts.items():
        cfg = load_recipe(TINY, overrides + extra + [f"train.output_dir={out_dir}/{name}"])
        result = pretrain(cfg)
        out[name] = {"losses": result.losses, "eval": result.last_eval}
    return out


def test_every_plugin_trains_and_evaluates(tiny_run, tmp_path):
    """ddp, FSDP2, ZeRO-1, tp2 and pp2 on 2 ranks (global batch 8 everywhere): the recipe's eval
    (every rank scores the same chunks) works under each layout, gives every rank the same numbers
    and, under tensor and pipeline parallelism, DDP's; the loss falls."""
    from phalanx.testing import spawn

    cfg, _ = tiny_run
    overrides = [f"work_dir={cfg.work_dir}", *TRAIN_OVERRIDES, "train.max_steps=4", "train.eval_every=2",
                 "train.save_every=0", "eval.max_chars_per_category=300"]
    results = spawn(_plugin_ranks, 2, overrides, LAYOUTS, str(tmp_path), timeout=600)
    ddp = results[0]["ddp"]
    for name, r in results[0].items():
        assert r["losses"][-1] < r["losses"][0], (name, r["losses"])
        assert r["eval"]["zh/bpc"] > 0 and r["eval"] == results[1][name]["eval"], name
        if name in ("tp2", "pp2"):  # the same global batches as DDP's 2 x 4
            for key, value in ddp["eval"].items():
                assert abs(r["eval"][key] - value) <= 1e-4 * abs(value), (name, key, r["eval"][key], value)
