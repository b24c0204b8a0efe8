"""Stage 2 of the InstructGPT pipeline: a reward model trained on preference pairs.

    python -m apps.chat_rlhf.train_rm --config apps/chat_rlhf/configs/rm.yaml
    phalanx run -n 2 -m apps.chat_rlhf.train_rm --config apps/chat_rlhf/configs/rm.yaml

The model is `AutoModelForSequenceClassification` with one output on the backbone of `model` (the
SFT output, or SmolLM2-135M-Instruct): the backbone's last-layer state at the last token of the
conversation, through a new linear score head. The loss is Bradley–Terry, -logσ(r_chosen -
r_rejected - margin), with the record's `margin` column when it has one, else `loss.margin`.

Held-out accuracy (chosen scored above rejected) and the mean reward gap are evaluated every
`train.eval_every` steps; they go to metrics.jsonl and `rm_curves.png`.

Output: every checkpoint's `model/` directory is a Hugging Face classifier with its tokenizer, so
`AutoModelForSequenceClassification.from_pretrained(dir)` opens it; PPO's `reward_model` setting
takes the training `output_dir` (default runs/chat_rlhf/rm) and uses its latest checkpoint.
Score conversations with `score_conversations` below, which encodes them exactly as training did.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from phalanx.config import ConfigError, load_config, parse_config_args
from phalanx.device import run_device, to_device
from phalanx.train.config import TrainConfig

from .adapters import LoRASettings, lora_hooks, prepare
from .data import PreferenceDataConfig, read_split, render_completion


@dataclass
class RMLossConfig:
    margin: float = 0.0                  # used when a record has no `margin` column
    center_coefficient: float = 0.0      # TRL's center_rewards_coefficient: c * mean((r_w + r_l)^2)


@dataclass
class RMConfig:
    model: str = ""                      # backbone: HF dir, checkpoint, output_dir, or "" for SmolLM2
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    loss: RMLossConfig = field(default_factory=RMLossConfig)
    eval_batch_size: int = 8
    eval_before: bool = True             # also evaluate the untrained head (a forward over the held-out set)
    train_layers: int = 0                # train only the top N blocks (+ final norm, score head); 0: all
    lora: LoRASettings = field(default_factory=LoRASettings)  # adapters + the score head (adapters.py)
    activation_checkpointing: bool = False  # recompute each decoder layer in backward (any plugin)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> None:
        self.lora.validate(self.train_layers)
        if self.train.output_dir == TrainConfig.output_dir:
            self.train.output_dir = "runs/chat_rlhf/rm"
        if self.loss.center_coefficient < 0:
            raise ConfigError(f"loss.center_coefficient={self.loss.center_coefficient}: must be 0 or more")


def load_rm_config(path, overrides=None) -> RMConfig:
    return load_config(RMConfig, path, overrides)


# --- encoding and scoring -------------------------------------------------------------------------

def encode_conversation(tokenizer, prompt: list[dict], completion: list[dict], max_prompt_tokens: int,
                        max_completion_tokens: int) -> list[int]:
    """Token ids of prompt + completion under the chat template, the prompt cut from the left and
    the completion from the right (what the reward model reads)."""
    prompt_text, completion_text = render_completion(tokenizer, prompt, completion)
    p = tokenizer(prompt_text, add_special_tokens=False)["input_ids"][-max_prompt_tokens:]
    return p + tokenizer(completion_text, add_special_tokens=False)["input_ids"][:max_completion_tokens]


def pad_right(rows: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    from phalanx.train.data import pad_rows

    ids, mask = pad_rows(rows, pad_id, side="right")
    return {"input_ids": ids, "attention_mask": mask}


def rewards_of(model, batch: dict) -> torch.Tensor:
    """One scalar reward per row (the classifier's logit at the row's last non-padding token)."""
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits[:, 0]


@torch.no_grad()
def score_conversations(model, tokenizer, prompts: list[list[dict]], completions: list[list[dict]], *,
                        max_prompt_tokens: int = 256, max_completion_tokens: int = 256,
                        batch_size: int = 8) -> torch.Tensor:
    """Rewards of (prompt messages, completion messages) pairs, float32 [N]."""
    rows = [encode_conversation(tokenizer, p, c, max_prompt_tokens, max_completion_tokens)
            for p, c in zip(prompts, completions, strict=True)]
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device  # score where the model is (the run's device once trained)
    out = [rewards_of(model, to_device(pad_right(rows[i:i + batch_size], tokenizer.pad_token_id), device)).float()
           for i in range(0, len(rows), batch_size)]
    model.train(was_training)
    return torch.cat(out).cpu() if out else torch.zeros(0)


# --- training -----------------------------------------------------------------------------------

def build_pairs(records: list[dict], tokenizer, data: PreferenceDataConfig, default_margin: float) -> list[dict]:
    def enc(r, side):
        return encode_conversation(tokenizer, r["prompt"], r[side], data.max_prompt_tokens, data.max_completion_tokens)
    return [{"chosen": enc(r, "chosen"), "rejected": enc(r, "rejected"), "margin": r.get("margin", default_margin)}
            for r in records]


def collate_pairs(pairs: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """[all chosen, all rejected] right-padded, plus the margins."""
    batch = pad_right([p["chosen"] for p in pairs] + [p["rejected"] for p in pairs], pad_id)
    batch["margin"] = torch.tensor([p["margin"] for p in pairs], dtype=torch.float32)
    return batch


def make_loss_fn(loss: RMLossConfig):
    from .preference_losses import bradley_terry_losses

    def loss_fn(model, batch):
        chosen, rejected = rewards_of(model, batch).float().chunk(2)
        return bradley_terry_losses(chosen, rejected, batch["margin"], loss.center_coefficient).mean()
    return loss_fn


def make_eval_fn(pairs: list[dict], pad_id: int, batch_size: int):
    @torch.no_grad()
    def eval_fn(model, step):
        chosen, rejected = [], []
        device = next(model.parameters()).device
        for i in range(0, len(pairs), batch_size):
            batch = to_device(collate_pairs(pairs[i:i + batch_size], pad_id), device)
            c, r = rewards_of(model, batch).double().chunk(2)
            chosen.append(c)
            rejected.append(r)
        c, r = torch.cat(chosen), torch.cat(rejected)
        gap = c - r
        return {"accuracy": ((gap > 0).double() + 0.5 * (gap == 0).double()).mean().item(),
                "reward_gap": gap.mean().item(), "reward_mean": torch.cat([c, r]).mean().item(),
                "reward_std": torch.cat([c, r]).std().item(),
                "loss": torch.nn.functional.softplus(-gap).mean().item()}
    return eval_fn


def train_reward_model(cfg: RMConfig, log=print):
    """Train; returns (TrainResult, held-out metrics before training or {})."""
    from phalanx.train import fit

    from .evaluate import plot_eval_curves
    from .models import init_reward_model, train_top_layers

    cfg.data.validate()
    train_records, held_records = read_split(cfg.data, "preference")  # bad records stop here, before any model loads
    model, tokenizer = init_reward_model(cfg.model)
    model.to(run_device())  # the held-out evaluation before training runs where training will
    pad = tokenizer.pad_token_id
    train_pairs = build_pairs(train_records, tokenizer, cfg.data, cfg.loss.margin)
    held_pairs = build_pairs(held_records, tokenizer, cfg.data, cfg.loss.margin)
    log(f"reward model: {len(train_pairs)} training and {len(held_pairs)} held-out pairs from {cfg.data.path}")
    eval_fn = make_eval_fn(held_pairs, pad, cfg.eval_batch_size)
    before = {}
    if cfg.eval_before:
        model.eval()
        before = eval_fn(model, 0)
        model.train()
        log("held-out before training: " + ", ".join(f"{k}={v:.4g}" for k, v in before.items()))
    train_top_layers(model, cfg.train_layers)
    model = prepare(model, cfg.lora, cfg.activation_checkpointing, cfg.train.seed)
    if cfg.lora.enabled:
        # the new score head trains whole beside the adapters; it is not a LoRA layer, so a PEFT adapter
        # file cannot carry it: every checkpoint holds the merged classifier (policy/), which PPO's rm: opens
        for name, p in model.named_parameters():
            if name.endswith("score.weight"):
                p.requires_grad_(True)
    result = fit(cfg.train, model, train_pairs, collate_fn=lambda p: collate_pairs(p, pad),
                 loss_fn=make_loss_fn(cfg.loss), eval_fn=eval_fn, tokenizer=tokenizer,
                 hooks=lora_hooks(dataclasses.replace(cfg.lora, merge=True), tokenizer))
    plot_eval_curves(result.metrics_path, Path(cfg.train.output_dir) / "rm_curves.png",
                     ("eval/accuracy", "eval/reward_gap"), title="reward model, held-out")
    return result, before


def main(argv: list[str] | None = None) -> None:
    from phalanx.launch import launched

    cfg, _ = parse_config_args("Train a reward model (Bradley-Terry) on preference pairs.", load_rm_config, argv,
                               example="apps/chat_rlhf/configs/rm.yaml")
    with launched(seed=cfg.train.seed) as ctx:
        log = print if ctx.is_main else (lambda *a, **k: None)
        result, before = train_reward_model(cfg, log)
        after = result.last_eval
        log(f"held-out reward accuracy: {before.get('accuracy', float('nan')):.3f} before -> "
            f"{after.get('accuracy', float('nan')):.3f} after {result.final_step} steps "
            f"(mean gap {after.get('reward_gap', float('nan')):.3g}); reward model {result.checkpoint_dir}/model")


if __name__ == "__main__":
    main(sys.argv[1:])
