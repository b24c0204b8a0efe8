"""The pieces of the training loop that need no training: config, schedule, optimizer groups,
label shifting, the FLOPs formula, metrics file and throughput arithmetic."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from itertools import pairwise

import pytest
import torch

from phalanx.config import ConfigError, load_config
from phalanx.observe import MetricsWriter, ThroughputMeter, causal_lm_flops_per_token, read_metrics
from phalanx.testing import tiny_llama
from phalanx.train import TrainConfig, warmup_cosine
from phalanx.train.losses import next_token_targets
from phalanx.train.optim import param_groups


@dataclass
class RecipeConfig:
    name: str = "demo"
    train: TrainConfig = field(default_factory=TrainConfig)


def test_train_config_is_a_recipe_section(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("name: x\ntrain:\n  max_steps: 20\n  plugin: zero2\n  precision: bf16\n  lr: 3.0e-4\n")
    cfg = load_config(RecipeConfig, path, ["train.lr=1e-3", "train.wandb=true", "train.decay_steps=50",
                                           "train.plugin_options={reduce_bucket_mb: 50}"])
    assert cfg.train.max_steps == 20 and cfg.train.plugin == "zero2" and cfg.train.precision == "bf16"
    assert cfg.train.plugin_options == {"reduce_bucket_mb": 50}
    assert cfg.train.lr == 1e-3 and cfg.train.wandb is True and cfg.train.decay_steps == 50
    assert cfg.train.lr_decay_steps == 50 and TrainConfig(max_steps=7).lr_decay_steps == 7


@pytest.mark.parametrize("override, words", [
    ("train.lrr=1", ["train.lrr", "Did you mean 'lr'"]),
    ("train.max_steps=ten", ["train.max_steps", "not an int"]),
    ("train.plugin=zero3", ["'plugin'='zero3'", "zero2"]),
    ("train.precision=fp4", ["train.precision", "'bf16'"]),
    ("train.micro_batch_size=0", ["micro_batch_size", "at least 1"]),
    ("train.min_lr_ratio=2", ["min_lr_ratio", "between 0 and 1"]),
    ("train.decay_steps=1", ["decay_steps", "warmup_steps"]),
])
def test_bad_train_config_names_the_key(override, words):
    overrides = [override] + (["train.warmup_steps=5"] if "decay_steps" in override else [])
    with pytest.raises(ConfigError) as err:
        load_config(RecipeConfig, None, overrides)
    for word in words:
        assert word in str(err.value)


def test_warmup_cosine_schedule():
    f = lambda s: warmup_cosine(s, warmup_steps=4, decay_steps=14, min_lr_ratio=0.1)  # noqa: E731
    assert [round(f(s), 6) for s in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the cosine
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    values = [f(s) for s in range(4, 15)]
    assert all(a >= b for a, b in pairwise(values))


def test_no_weight_decay_on_norms_and_biases():
    model = tiny_llama()
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.dim() >= 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert no_decay["weight_decay"] == 0.0
    assert {names[id(p)].rsplit(".", 1)[0].rsplit(".", 1)[-1] for p in no_decay["params"]} >= {"norm", "input_layernorm"}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_next_token_targets_shift_and_mask():
    ids = torch.tensor([[5, 6, 7, 8]])
    assert next_token_targets({"input_ids": ids}).tolist() == [[6, 7, 8, -100]]
    mask = torch.tensor([[1, 1, 1, 0]])
    assert next_token_targets({"input_ids": ids, "attention_mask": mask}).tolist() == [[6, 7, -100, -100]]
    labels = torch.tensor([[-100, 6, 7, 8]])
    assert next_token_targets({"input_ids": ids, "labels": labels}).tolist() == [[6, 7, 8, -100]]


# Training FLOPs per token of tiny_llama (hidden 32, MLP 64, 2 layers, 4 heads of 8, 2 KV heads,
# vocab 128) at sequence length 16, by hand. A matmul of a token through an in x out weight is
# 2*in*out FLOPs forward and twice that backward (input and weight gradients): 6*in*out.
#   per layer: q 32x32, k 32x16, v 32x16, o 32x32, gate/up 32x64, down 64x32 = 9216 weights
#   LM head 32x128 = 4096 weights; the embedding is a lookup (no FLOPs)
#   matmuls: 6 * (2 * 9216 + 4096) = 135168
#   attention, per layer and head: QK^T and PV are 2*16*8 FLOPs per token each forward, twice
#   that backward: 3 * 2 * (2*16*8) = 1536; 2 layers * 4 heads = 12288
HAND_FLOPS_PER_TOKEN = 135168 + 12288
NORM_WEIGHTS = 5 * 32  # 2 RMSNorms per layer + the final one: elementwise, not matmuls


@pytest.mark.parametrize("tied", [False, True])
def test_flops_per_token_against_an_independent_count(tied):
    """torch's FlopCounterMode over a real forward+backward (eager attention: its matmuls are
    counted; CPU SDPA has no FLOP formula) agrees with the hand count above; the meter's formula
    (6N + 12*layers*heads*head_dim*seq) is that plus 6 FLOPs per norm weight, which the
    PaLM/torchtitan convention counts in N (0.65% here)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = tiny_llama(attn_implementation="eager", tie_word_embeddings=tied)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    assert counter.get_total_flops() == HAND_FLOPS_PER_TOKEN * ids.numel()
    assert causal_lm_flops_per_token(model, 16) == HAND_FLOPS_PER_TOKEN + 6 * NORM_WEIGHTS


def test_metrics_file_resume_cuts_redone_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as w:
        for step in range(1, 7):
            w.log({"step": step, "loss": 1.0 / step, "nan": float("nan")})
    with path.open("a") as f:
        f.write('{"step": 7, "lo')  # torn line from a crash
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5, 6]
    assert read_metrics(path)[0]["nan"] == "nan"  # still valid JSON
    with MetricsWriter(path, resume_step=4) as w:
        w.log({"step": 5, "loss": 0.5})
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5]
    assert all(json.loads(line) for line in path.read_text().splitlines())
    assert not MetricsWriter(tmp_path / "other.jsonl", enabled=False).path.exists()


def test_throughput_meter_rates():
    meter = ThroughputMeter(world_size=2, peak_flops=1e12, warmup_steps=1)
    meter.step(tokens=1000, seconds=10.0, flops=1e12)  # warm-up: excluded from the summary
    meter.step(tokens=1000, seconds=1.0, flops=1e12)
    window = meter.window()
    assert window["tokens_per_s"] == pytest.approx(2000 / 11)
    summary = meter.summary()
    assert summary["tokens_per_s"] == pytest.approx(1000.0)
    assert summary["tflops_per_rank"] == pytest.approx(0.5)  # 1e12 FLOP / 1 s / 2 ranks
    assert summary["mfu"] == pytest.approx(0.5)
    assert math.isclose(summary["step_time_s"], 1.0)


def test_progress_bar_and_rank0_logger(capsys):
    from phalanx.observe import ProgressBar, get_logger

    bar = ProgressBar(3, initial=1, enabled=True)
    bar.update(0, loss=2.5, lr=3e-4, tok_s=None, mfu=0.5)
    bar.update(1)
    get_logger("phalanx.train").info("a line through the bar")
    bar.close()
    err = capsys.readouterr().err
    assert "2/3" in err and "loss=2.5" in err and "lr=3.00e-04" in err and "a line through the bar" in err
    ProgressBar(3, enabled=False).update(1, loss=1.0)  # other ranks: a no-op
