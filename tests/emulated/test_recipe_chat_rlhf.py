"""apps/chat_rlhf under the emulated GPU (PHALANX_EMULATE_GPU=1): every algorithm's command (SFT, reward
model, DPO/KTO, GRPO, PPO, the demo, the evaluate command) cut to 2 steps on a tiny model, on 1 rank, and
DPO, KTO and GRPO on 2 ranks (`phalanx run -n 2`). A batch, reference model or reward model left on the
host next to the device policy, or a collective on a CPU tensor (GRPO's step sums, the reward gather),
fails these runs as it would on a GPU.

Each test checks what the run wrote: the steps reached, the metrics finite, and something that shows the
device path did real work (the first DPO loss is log 2, the KL against the device reference moved off 0,
the engine's log-probs match the trainer's).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from emulated_run import DEVICE_LINE, run_module_emulated  # noqa: E402

SHORT_REWARD = "tests.apps.chat_rlhf.test_grpo:short_reward"  # 1 for replies under 12 characters


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """The chat tests' tiny Llama (BPE tokenizer, ChatML) and a one-label reward model on its backbone."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from tests.apps.chat_rlhf.conftest import build_tiny_chat_model

    base = tmp_path_factory.mktemp("chat_rlhf_emulated")
    model = build_tiny_chat_model(base / "model")
    config = AutoConfig.from_pretrained(str(model), num_labels=1)
    torch.manual_seed(1)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(str(base / "rm"))
    AutoTokenizer.from_pretrained(str(model)).save_pretrained(str(base / "rm"))
    return {"model": model, "rm": base / "rm"}


def _preference(model: Path, out: Path, *extra: str) -> list[str]:
    return [f"model={model}", f"train.output_dir={out}", "data.max_records=40", "data.max_prompt_tokens=24",
            "data.max_completion_tokens=12", "train.max_steps=2", "train.micro_batch_size=4", "train.lr=1e-3",
            "train.progress_bar=false", "train.plot=false", "train.peak_tflops=0", "train_layers=1", *extra]


def _grpo(model: Path, out: Path, *extra: str) -> list[str]:
    return ["--config", "apps/chat_rlhf/configs/grpo_arithmetic.yaml", f"model={model}", f"train.output_dir={out}",
            "data.num_train=8", "data.num_heldout=4", "grpo.num_generations=2", "grpo.max_new_tokens=4",
            f"grpo.rewards=[{SHORT_REWARD}]", "grpo.kl_coef=0.05", "train.micro_batch_size=2", "train.max_steps=2",
            "train.eval_every=2", "train.lr=1e-3", "engine.max_model_len=64", "engine.max_num_seqs=4",
            "engine.kv_cache_memory_gib=0.01", "train.progress_bar=false", "train.plot=false", *extra]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _train_records(out: Path) -> list[dict]:
    return [r for r in _jsonl(out / "metrics.jsonl") if "loss" in r]


def _eval_records(out: Path) -> list[dict]:
    return [r for r in _jsonl(out / "metrics.jsonl") if any(k.startswith("eval/") for k in r)]


def _finite(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def test_sft_one_rank(tiny, tmp_path):
    out = tmp_path / "sft"
    log = run_module_emulated("apps.chat_rlhf.sft", "--config", "apps/chat_rlhf/configs/sft.yaml",
                              f"model={tiny['model']}", f"train.output_dir={out}", "data.max_records=40",
                              "data.seq_len=128", "train.max_steps=2", "train.micro_batch_size=4", "train.lr=5e-3",
                              "train.progress_bar=false", "train.plot=false", "train.peak_tflops=0")
    assert DEVICE_LINE in log
    train = _train_records(out)
    assert [r["step"] for r in train] == [1, 2] and _finite(*(r["loss"] for r in train))
    assert train[1]["loss"] < train[0]["loss"]  # lr 5e-3 on 38 conversations: the device step learns
    (final,) = [r for r in _eval_records(out) if r["step"] == 2]
    assert _finite(final["eval/loss"]) and final["eval/tokens"] > 0
    assert "held-out assistant-token loss before" in log  # the before-training eval ran on the device model


def test_reward_model_one_rank(tiny, tmp_path):
    out = tmp_path / "rm"
    log = run_module_emulated("apps.chat_rlhf.train_rm", "--config", "apps/chat_rlhf/configs/rm.yaml",
                              *_preference(tiny["model"], out, "eval_before=true", "train.eval_every=1"))
    assert "held-out before training: accuracy=" in log
    assert [r["step"] for r in _train_records(out)] == [1, 2]
    evals = _eval_records(out)
    assert [r["step"] for r in evals] == [1, 2]
    assert all(_finite(r["eval/accuracy"], r["eval/reward_gap"], r["eval/loss"]) for r in evals)
    assert evals[0]["eval/reward_gap"] != evals[1]["eval/reward_gap"]  # the score head trained between evals


def test_dpo_cached_reference_and_trunk_one_rank(tiny, tmp_path):
    out = tmp_path / "dpo"
    run_module_emulated("apps.chat_rlhf.dpo", "--config", "apps/chat_rlhf/configs/dpo.yaml",
                        *_preference(tiny["model"], out, "train.eval_every=1"))
    train = _train_records(out)
    assert [r["step"] for r in train] == [1, 2]
    # cached reference log-probs (device reference pass) against the bf16 policy fed the cached trunk states
    assert train[0]["loss"] == pytest.approx(math.log(2), abs=2e-3)
    evals = _eval_records(out)
    assert [r["step"] for r in evals] == [1, 2] and evals[0]["eval/pairs"] == 7
    assert all(_finite(r["eval/loss"], r["eval/margin"]) for r in evals) and evals[1]["eval/margin"] != 0


def test_dpo_online_reference_two_ranks(tiny, tmp_path):
    out = tmp_path / "dpo2"
    log = run_module_emulated("apps.chat_rlhf.dpo", "--config", "apps/chat_rlhf/configs/dpo.yaml",
                              *_preference(tiny["model"], out, "loss.reference=online"), ranks=2)
    assert "phalanx: 2 rank(s)" in log and "dp=2" in log
    train = _train_records(out)
    assert [r["step"] for r in train] == [1, 2] and _finite(*(r["loss"] for r in train))
    assert train[0]["loss"] == pytest.approx(math.log(2), abs=2e-3)  # the device reference scored every batch
    (final,) = _eval_records(out)
    assert final["step"] == 2 and final["eval/pairs"] == 7 and _finite(final["eval/margin"])


def test_kto_two_ranks(tiny, tmp_path):
    out = tmp_path / "kto"
    run_module_emulated("apps.chat_rlhf.dpo", "--config", "apps/chat_rlhf/configs/kto.yaml",
                        *_preference(tiny["model"], out), ranks=2)
    train = _train_records(out)
    assert [r["step"] for r in train] == [1, 2] and _finite(*(r["loss"] for r in train))
    (final,) = _eval_records(out)  # KTO's KL estimate: all-reduced on the device in training, not in the eval
    assert final["step"] == 2 and _finite(final["eval/loss"], final["eval/accuracy"])


def test_evaluate_command_scores_policy_and_reward_model_on_the_device(tiny, tmp_path):
    result = tmp_path / "eval.json"
    run_module_emulated("apps.chat_rlhf.evaluate", "--config", "apps/chat_rlhf/configs/dpo.yaml",
                        "--model", str(tiny["model"]), "--reward-model", str(tiny["rm"]), "--json", str(result),
                        f"model={tiny['model']}", "data.max_records=40", "data.max_prompt_tokens=24",
                        "data.max_completion_tokens=12")
    saved = json.loads(result.read_text())
    policy, rm = saved["policy_heldout"], saved["reward_model_heldout"]
    assert policy["pairs"] == 7 and policy["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference
    assert _finite(rm["accuracy"], rm["reward_gap"]) and rm["reward_std"] > 0


def _check_grpo(out: Path) -> list[dict]:
    rollouts = _jsonl(out / "rollouts.jsonl")
    assert [r["step"] for r in rollouts] == [1, 2]
    for r in rollouts:
        assert _finite(r["reward_mean"], r["kl"], r["entropy"], r["logprob_gap"])
        assert r["logprob_gap"] < 1e-2  # the engine sampled with the trained (device) weights
    (final,) = _eval_records(out)
    assert final["step"] == 2 and final["eval/heldout_n"] == 4
    assert (out / "rl_curves.png").is_file()
    return rollouts


@pytest.mark.slow  # 50-80 s on 2 shared CPU cores (the engine's kernels run in the Triton interpreter)
def test_grpo_with_kl_two_ranks(tiny, tmp_path):
    """The step sums and the reward gather are collectives: on the device under NCCL."""
    out = tmp_path / "grpo2"
    log = run_module_emulated("apps.chat_rlhf.grpo", *_grpo(tiny["model"], out), ranks=2)
    assert "dp=2" in log
    rollouts = _check_grpo(out)
    assert rollouts[1]["kl"] > rollouts[0]["kl"]  # the policy moved away from the frozen device reference


def test_grpo_rollout_reused_for_mini_batches_one_rank(tiny, tmp_path):
    """grpo.ppo_epochs x mini_batches > 1: the rollout buffer, its mini-batch rows and the ratio
    against rollout-time log-probs all live on the device."""
    out = tmp_path / "grpo_mb"
    run_module_emulated("apps.chat_rlhf.grpo", *_grpo(tiny["model"], out, "grpo.ppo_epochs=1", "grpo.mini_batches=2",
                                                      "data.num_heldout=0"), ranks=1)
    records = _jsonl(out / "rollouts.jsonl")
    assert [(r["step"], r["new_rollout"]) for r in records] == [(1, True), (2, False)]
    assert records[0]["logprob_gap"] < 1e-2 and "reward_mean" not in records[1]
    assert _finite(records[1]["clip_frac_low"], records[1]["clip_frac_high"])


def test_ppo_one_rank(tiny, tmp_path):
    out = tmp_path / "ppo"
    run_module_emulated("apps.chat_rlhf.ppo", "--config", "apps/chat_rlhf/configs/ppo.yaml",
                        f"model={tiny['model']}", f"train.output_dir={out}", "data.num_train=4", "data.num_heldout=2",
                        "data.max_prompt_tokens=40", "ppo.num_generations=2", "ppo.max_new_tokens=3",
                        f"ppo.rewards=[rm:{tiny['rm']}]", "ppo.num_mini_batches=2", "ppo.train_layers=1",
                        "train.micro_batch_size=2", "train.max_steps=2", "train.lr=1e-3", "engine.max_model_len=48",
                        "engine.max_num_seqs=4", "engine.kv_cache_memory_gib=0.01", "train.progress_bar=false",
                        "train.plot=false")
    train = _train_records(out)
    assert [r["step"] for r in train] == [1, 2] and _finite(*(r["loss"] for r in train))
    records = _jsonl(out / "rollouts.jsonl")
    assert [r["step"] for r in records] == [1, 2] and _finite(*(r["value_loss"] for r in records))
    (rollout,) = [r for r in records if r["new_rollout"]]  # one rollout, two mini-batch steps over it
    assert _finite(rollout["reward_mean"], rollout["kl"], rollout["logprob_gap"]) and rollout["logprob_gap"] < 1e-2
    assert rollout["reward_mean"] != 0 and rollout["reward_std"] > 0  # the reward model scored on the device
    assert abs(rollout["tis_weight"] - 1.0) < 1e-2  # engine and trainer agree: importance weights ~1
    (final,) = _eval_records(out)
    assert final["step"] == 2 and _finite(final["eval/heldout_reward"])
    # the checkpoint's policy/ (gathered from the device) is the actor of the actor-critic model/, tensor for tensor
    import torch

    from phalanx.checkpoint import latest_checkpoint
    from phalanx.checkpoint.hf import load_hf_state_dict
    ckpt = Path(latest_checkpoint(out))
    policy = load_hf_state_dict(ckpt / "policy")
    actor = {k.removeprefix("actor."): v for k, v in load_hf_state_dict(ckpt / "model").items() if k.startswith("actor.")}
    assert policy and policy.keys() <= actor.keys()
    assert all(torch.equal(policy[k], actor[k]) for k in policy)
    assert (ckpt / "policy" / "config.json").is_file() and (ckpt / "policy" / "tokenizer.json").is_file()


@pytest.mark.slow  # ~70 s
def test_demo_is_grpo_with_kl_on_one_rank(tiny, tmp_path):
    """The demo command is the GRPO trainer on one rank (with before/after evaluations); with a KL term
    it also covers GRPO's frozen reference on 1 rank (the 2-rank test above covers the collectives)."""
    run_module_emulated("apps.chat_rlhf.demo", f"model={tiny['model']}", f"train.output_dir={tmp_path}",
                        "train.max_steps=2", "data.num_train=8", "data.num_heldout=4", "grpo.num_generations=2",
                        "grpo.max_new_tokens=3", "grpo.kl_coef=0.05", "train.micro_batch_size=2", "train_layers=1",
                        "train.lr=1e-3", "engine.max_num_seqs=4", "train.progress_bar=false")
    _check_grpo(tmp_path)
    saved = json.loads((tmp_path / "demo_result.json").read_text())
    assert saved["steps"] == 2 and saved["n"] == 4
    lo, hi = saved["after_ci95"]
    assert 0.0 <= lo <= saved["after"] <= hi <= 1.0
    assert (tmp_path / "rl_curves.png").is_file()

