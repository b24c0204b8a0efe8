"""apps/llama and apps/protein under the emulated GPU (`PHALANX_EMULATE_GPU=1`): each recipe's
commands, cut to 2 steps, on one process and on `phalanx run -n 2`, with their evaluation, export
and sampling / prediction phases.

Under emulation every Triton kernel runs in Triton's interpreter (the protein's masked softmax and
the LM loss's fused cross-entropy, one program per row), so the configs are shrunk further than
the CPU tests': fewer rows per step is what keeps these runs short. The llama preparation steps
(vocabulary, initialisation, data) are host-only work and run once, in this process, on the CPU.
"""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from emulated_run import DEVICE_LINE, ROOT, run_module_emulated  # noqa: E402

# ---------------------------------------------------------------------------------------- protein

PROTEIN_CONFIG = ["--config", "apps/protein/configs/tiny.yaml"]
PROTEIN_SMALL = ["model.c_m=16", "model.c_z=8", "model.c_e=8", "model.c_s=16", "model.evoformer_blocks=1",
                 "model.extra_msa_blocks=1", "model.evoformer.heads_msa=2", "model.evoformer.c_hidden_msa=4",
                 "model.evoformer.heads_pair=2", "model.evoformer.c_hidden_pair=4", "model.evoformer.c_hidden_mul=8",
                 "model.evoformer.c_hidden_opm=4", "model.structure.heads=2", "model.structure.c_ipa=4",
                 "model.structure.query_points=2", "model.structure.value_points=2", "model.structure.layers=2",
                 "model.structure.c_resnet=8", "data.crop_size=8", "data.max_msa_clusters=2", "data.max_extra_msa=2",
                 "max_train_chains=2", "eval_recycles=0", "train.micro_batch_size=1", "train.max_steps=2",
                 "train.eval_every=2", "train.save_every=2", "train.log_every=1", "train.progress_bar=false",
                 "train.plot=false"]


def _protein_eval(output_dir: Path) -> dict:
    evaluation = json.loads((output_dir / "eval.json").read_text())
    assert evaluation["step"] == 2
    summary = evaluation["summary"]
    assert set(evaluation["train"]) == {"1psm_A", "2q2k_A"} and evaluation["heldout"]
    for prefix in ("train", "heldout"):
        assert 0.0 <= summary[f"{prefix}_lddt_ca"] <= 1.0
        assert 0.0 < summary[f"{prefix}_rmsd"] < 100.0
        assert 0.0 <= summary[f"{prefix}_tm_score"] <= 1.0 and 0.0 <= summary[f"{prefix}_gdt_ts"] <= 1.0
        assert 0.0 <= summary[f"{prefix}_plddt"] <= 100.0
    return summary


@pytest.mark.slow
def test_protein_train_and_predict_one_rank(tmp_path):
    """`python -m apps.protein.train` for 2 steps (training, EMA eval of the fixed crops, checkpoint),
    then `python -m apps.protein.predict` from that run on the emulated GPU, scored against the true
    structure by `--reference`."""
    out = tmp_path / "run"
    log = run_module_emulated("apps.protein.train", *PROTEIN_CONFIG, *PROTEIN_SMALL, f"train.output_dir={out}")
    assert DEVICE_LINE in log and "done at step 2" in log
    _protein_eval(out)
    assert list((out / "checkpoints").glob("step-00000002"))

    fasta = tmp_path / "q.fasta"
    fasta.write_text(">2q2k_A\nMGSSHHHHHHSSGLVP\n")  # the first 16 residues of 2q2k A: a short, fast query
    pred = tmp_path / "pred"
    run_module_emulated("apps.protein.predict", *PROTEIN_CONFIG, "--checkpoint", str(out), "--fasta", str(fasta),
                        "--out", str(pred), "--recycles", "0", *PROTEIN_SMALL)
    summary = json.loads((pred / "2q2k_A.json").read_text())
    assert summary["length"] == 16 and 0.0 < summary["mean_plddt"] < 100.0
    pdb_atoms = [line for line in (pred / "2q2k_A.pdb").read_text().splitlines() if line.startswith("ATOM")]
    assert sum(line[12:16].strip() == "CA" for line in pdb_atoms) == 16
    assert (pred / "2q2k_A.cif").stat().st_size > 0 and (pred / "2q2k_A_confidence.png").stat().st_size > 10_000


@pytest.mark.slow
def test_protein_train_two_ranks(tmp_path):
    """`phalanx run -n 2 -m apps.protein.train`: data parallel over 2 emulated GPUs (NCCL-path
    collectives on device tensors), 2 steps with the evaluation and a checkpoint."""
    out = tmp_path / "run"
    log = run_module_emulated("apps.protein.train", *PROTEIN_CONFIG, *PROTEIN_SMALL, f"train.output_dir={out}",
                              ranks=2)
    assert "done at step 2" in log
    _protein_eval(out)
    assert list((out / "checkpoints").glob("step-00000002"))


# ------------------------------------------------------------------------------------------ llama

LLAMA_SHAPE = ["data.seq_len=64", "sft_data.seq_len=64", "eval.max_chars_per_category=1000", "eval.batch_size=4",
               "tokenizer.domain_vocab_size=4000", "generate.max_new_tokens=8"]


@pytest.fixture(scope="module")
def llama_work(tmp_path_factory) -> Path:
    """Steps 1-3 of the tiny llama recipe (host work, on the CPU in this process) on small corpus slices."""
    from apps.llama.config import load_recipe
    from apps.llama.expand_vocab import expand_vocab
    from apps.llama.init_model import init_model
    from apps.llama.prepare_data import prepare_pretrain, prepare_sft

    work = tmp_path_factory.mktemp("llama_emulated")
    cfg = load_recipe(ROOT / "apps" / "llama" / "configs" / "tiny.yaml", [f"work_dir={work}", *LLAMA_SHAPE])
    cfg.tokenizer.domain_sources[0].max_chars = 60_000
    for source, limit in zip(cfg.data.sources, (20_000, 10_000, 5_000), strict=True):
        source.max_chars = limit
    for source in cfg.sft_data.sources:
        source.max_examples = 24
    expand_vocab(cfg)
    init_model(cfg)
    prepare_pretrain(cfg)
    prepare_sft(cfg)
    return work


def _llama_args(work: Path, *more: str) -> list[str]:
    return ["--config", "apps/llama/configs/tiny.yaml", f"work_dir={work}", *LLAMA_SHAPE, *more]


PRETRAIN_2 = ["train.max_steps=2", "train.micro_batch_size=1", "train.eval_every=2", "train.save_every=2",
              "train.log_every=1", "train.progress_bar=false"]


def _bpc(log: str) -> dict[str, float]:
    line = next(line for line in log.splitlines() if line.startswith("pre-training done at step 2"))
    values = dict(part.split("=") for part in line.split(": loss ")[1].split("; checkpoint")[0].split(", ")[1:])
    return {k: float(v) for k, v in values.items()}


def test_llama_pretrain_export_evaluate_generate_one_rank(llama_work):
    """pretrain (2 steps, zero2, held-out bits per character at step 2) -> export -> evaluate the
    export on the emulated GPU (the same numbers as the in-loop eval) -> generate from the checkpoint."""
    work = llama_work / "one"
    log = run_module_emulated("apps.llama.pretrain", *_llama_args(llama_work, f"train.output_dir={work}", *PRETRAIN_2))
    assert DEVICE_LINE in log
    bpc = _bpc(log)
    assert "zh/bpc" in bpc and all(0.5 < v < 30 and math.isfinite(v) for v in bpc.values())
    metrics = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    assert any(m.get("step") == 2 and m.get("eval/zh/bpc") == pytest.approx(bpc["zh/bpc"], abs=1e-3) for m in metrics)

    export = llama_work / "export_one"
    run_module_emulated("apps.llama.export", *_llama_args(llama_work, f"train.output_dir={work}", "--out", str(export)))
    assert (export / "model.safetensors").is_file() and json.loads((export / "export_info.json").read_text())[
        "train_state"]["step"] == 2

    log = run_module_emulated("apps.llama.evaluate", *_llama_args(llama_work, "--model", str(export)))
    scored = {cat: float(value) for cat, value in re.findall(r"(\w+): ([\d.]+) bpc \(char ppl", log)}
    assert scored == pytest.approx({k.split("/")[0]: v for k, v in bpc.items()}, abs=2e-3)

    log = run_module_emulated("apps.llama.generate", *_llama_args(llama_work, f"train.output_dir={work}"))
    assert "--- 春风\n春风" in log and "--- The king\nThe king" in log


def test_llama_pretrain_two_ranks(llama_work):
    """`phalanx run -n 2 -m apps.llama.pretrain`: zero2 over 2 emulated GPUs, 2 steps, eval and checkpoint."""
    work = llama_work / "two"
    log = run_module_emulated("apps.llama.pretrain", *_llama_args(llama_work, f"train.output_dir={work}", *PRETRAIN_2),
                              ranks=2)
    bpc = _bpc(log)
    assert all(0.5 < v < 30 for v in bpc.values())
    assert (work / "checkpoints" / "step-00000002" / "model").is_dir()


def test_llama_sft_one_rank(llama_work):
    """`python -m apps.llama.sft` from model_init: 2 steps with the held-out assistant-token loss."""
    work = llama_work / "sft"
    log = run_module_emulated("apps.llama.sft", *_llama_args(
        llama_work, f"train.output_dir={llama_work / 'no_pretrain'}", f"sft.output_dir={work}", "sft.max_steps=2",
        "sft.micro_batch_size=1", "sft.eval_every=2", "sft.save_every=2", "sft.progress_bar=false"))
    line = next(line for line in log.splitlines() if line.startswith("SFT done at step 2"))
    held = float(line.split("held-out assistant-token loss ")[1].split(";")[0])
    assert 1.0 < held < 15.0  # ~ln(vocabulary) for a fresh model
    assert (work / "checkpoints" / "step-00000002" / "model").is_dir()


def test_llama_one_step_from_a_fresh_checkout_on_the_emulated_gpu(tmp_path):
    """`pretrain` on a work directory with nothing in it: it prepares the tokenizer, the initial
    model and the rows itself, then trains one step on the emulated GPU."""
    log = run_module_emulated("apps.llama.pretrain", "--config", "apps/llama/configs/tiny.yaml",
                              f"work_dir={tmp_path}", "train.max_steps=1", "train.progress_bar=false", timeout=300)
    assert "expand_vocab: no output" in log and "pre-training done at step 1" in log, log[-3000:]
