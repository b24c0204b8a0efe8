"""Held-out evaluation of a trained policy or reward model, and samples through our inference engine.

    # implicit-reward preference accuracy of a DPO/IPO/SimPO/KTO policy against its reference
    python -m apps.chat_rlhf.evaluate --config apps/chat_rlhf/configs/dpo.yaml --model runs/chat_rlhf/dpo
    # a reward model's held-out accuracy on the same pairs
    python -m apps.chat_rlhf.evaluate --config apps/chat_rlhf/configs/rm.yaml --reward-model runs/chat_rlhf/rm
    # answers to held-out prompts (phalanx.inference), scored by a reward model when one is given
    python -m apps.chat_rlhf.evaluate --config apps/chat_rlhf/configs/dpo.yaml --model runs/chat_rlhf/dpo \\
        --samples 4 --reward-model runs/chat_rlhf/rm

The config supplies the data section (file, held-out split, lengths) and, for policies, the loss
section (which implicit reward to rank by); `--model` overrides its `model`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def plot_eval_curves(metrics_path: str | Path, png_path: str | Path, keys: tuple[str, ...],
                     title: str = "") -> Path | None:
    """One panel per metric in `keys` against step, from metrics.jsonl; None if none was logged."""
    from phalanx.observe.metrics import read_metrics

    if not Path(metrics_path).exists():
        return None
    records = read_metrics(metrics_path)
    series = {k: [(r["step"], r[k]) for r in records if isinstance(r.get(k), (int, float))] for k in keys}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(series), figsize=(4.5 * len(series), 3.6), dpi=120, squeeze=False)
    for ax, (key, points) in zip(axes[0], series.items()):
        ax.plot(*zip(*points), marker="o")
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path)
    plt.close(fig)
    return png_path


def prompt_ids(tokenizer, messages: list[dict], max_prompt_tokens: int) -> list[int]:
    """A prompt's token ids ending with the assistant generation prompt, cut from the left."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"][-max_prompt_tokens:]


def generate_answers(model, tokenizer, prompts: list[list[dict]], *, max_prompt_tokens: int = 256,
                     max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0) -> list[str]:
    """Answers from phalanx.inference's engine over the live model's weights (greedy by default)."""
    from phalanx.inference import LLM, SamplingParams

    engine = LLM.from_model(model, tokenizer=tokenizer)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    outs = engine.generate([prompt_ids(tokenizer, p, max_prompt_tokens) for p in prompts], params)
    return [o.text for o in outs]


def load_any_config(path: str, overrides: list[str]):
    """A dpo/kto config (DPOConfig) or an rm config (RMConfig), told apart by the loss section."""
    import yaml

    from .dpo import load_dpo_config
    from .train_rm import load_rm_config

    raw = yaml.safe_load(Path(path).read_text()) or {}
    is_rm = "eval_before" in raw or ("loss" in raw and "type" not in (raw["loss"] or {}))
    return (load_rm_config if is_rm else load_dpo_config)(path, overrides)


def main(argv: list[str] | None = None) -> None:
    import argparse

    from phalanx.device import current_device

    from .data import read_split
    from .dpo import build_examples, load_dpo_config, make_eval_fn, attach_reference
    from .models import load_policy, load_reward_model, load_tokenizer, resolve_model_dir
    from .preference_losses import REFERENCE_FREE
    from .train_rm import build_pairs, make_eval_fn as rm_eval_fn, score_conversations

    parser = argparse.ArgumentParser(description="Evaluate a policy or reward model on held-out preference data.")
    parser.add_argument("--config", "-c", required=True, help="a dpo/kto/rm YAML (its data and loss sections)")
    parser.add_argument("--model", default=None, help="policy to evaluate (default: the config's model)")
    parser.add_argument("--reward-model", default=None, help="reward model directory / train_rm output_dir")
    parser.add_argument("--samples", type=int, default=0, help="generate answers to this many held-out prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    args = parser.parse_args(argv)

    cfg = load_any_config(args.config, args.overrides)
    reference = (cfg.reference or cfg.model) if hasattr(cfg, "reference") else None  # before --model replaces it
    if args.model:
        if not hasattr(cfg, "reference"):
            parser.error("--model needs a dpo/kto config (its loss section says which implicit reward to rank by)")
        cfg.model = args.model
    if not hasattr(cfg, "reference") and not args.reward_model:
        parser.error("an rm config evaluates a reward model: pass --reward-model")
    kind = "kto" if getattr(cfg.loss, "type", "") == "kto" else "preference"
    _, held = read_split(cfg.data, kind)
    results: dict = {"data": cfg.data.path, "heldout_records": len(held)}

    policy = tokenizer = None
    if hasattr(cfg, "reference") and (args.model or args.samples or not args.reward_model):
        policy_dir = resolve_model_dir(cfg.model)
        tokenizer = load_tokenizer(policy_dir)
        policy = load_policy(policy_dir).to(current_device()).eval()
        examples = build_examples(held, tokenizer, cfg)
        if cfg.loss.type not in REFERENCE_FREE:
            ref_model = load_policy(resolve_model_dir(reference)).to(current_device()).eval()
            attach_reference(ref_model, examples, tokenizer.pad_token_id, cfg.eval_batch_size)
        results["policy"] = str(policy_dir)
        evaluate_policy = make_eval_fn(cfg.loss, examples, tokenizer.pad_token_id, cfg.eval_batch_size)
        results["policy_heldout"] = evaluate_policy(policy, 0)
    rm = None
    if args.reward_model and kind == "preference":
        rm, rm_tok = load_reward_model(args.reward_model)
        rm.to(current_device()).eval()
        pairs = build_pairs(held, rm_tok, cfg.data, 0.0)
        results["reward_model"] = str(resolve_model_dir(args.reward_model))
        results["reward_model_heldout"] = rm_eval_fn(pairs, rm_tok.pad_token_id, cfg.eval_batch_size)(rm, 0)
    if args.samples:
        if policy is None:
            parser.error("--samples needs a policy: pass --model with a dpo/kto config")
        prompts = [r["prompt"] for r in held[:args.samples]]
        answers = generate_answers(policy, tokenizer, prompts, max_prompt_tokens=cfg.data.max_prompt_tokens,
                                   max_new_tokens=args.max_new_tokens)
        scores = score_conversations(rm, rm_tok, prompts, [[{"role": "assistant", "content": a}] for a in answers]
                                     ).tolist() if rm is not None else [None] * len(answers)
        results["samples"] = [{"prompt": p[-1]["content"][:300], "answer": a, "reward": s}
                              for p, a, s in zip(prompts, answers, scores)]
    print(json.dumps(results, indent=2, ensure_ascii=False))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main(sys.argv[1:])
