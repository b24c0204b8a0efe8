"""LoRA GRPO of apps/chat_rlhf under the emulated GPU (PHALANX_EMULATE_GPU=1), one rank, two steps: the
adapters, the merged weights sent to the engine each sync (W + BA computed on the device), the KL
reference that is the same model with its adapter off, and the exports all run on the device path.
A merged weight or a reference batch left on the host next to the device policy fails the run."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from emulated_run import DEVICE_LINE, run_module_emulated  # noqa: E402

SHORT_REWARD = "tests.apps.chat_rlhf.test_learning:short_reward"  # 1 - characters / 40: spread in every group


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from tests.apps.chat_rlhf.conftest import build_tiny_chat_model
    return build_tiny_chat_model(tmp_path_factory.mktemp("chat_rlhf_lora_emulated") / "model")


def test_lora_grpo_one_rank(tiny_model, tmp_path):  # 7 s on 2 quiet cores (270-370 s at load 27)
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "grpo_lora"
    log = run_module_emulated(
        "apps.chat_rlhf.grpo", "--config", "apps/chat_rlhf/configs/grpo_arithmetic.yaml", f"model={tiny_model}",
        f"train.output_dir={out}", "data.num_train=8", "data.num_heldout=0", "grpo.num_generations=2",
        "grpo.max_new_tokens=4", f"grpo.rewards=[{SHORT_REWARD}]", "grpo.kl_coef=0.05", "train.micro_batch_size=2",
        "train.max_steps=2", "train.lr=5e-2", "engine.max_model_len=64", "engine.max_num_seqs=4",
        "engine.kv_cache_memory_gib=0.01", "train.progress_bar=false", "train.plot=false", "lora.enabled=true",
        "lora.merge=true", "activation_checkpointing=true", "train_layers=0")
    assert DEVICE_LINE in log
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rollouts] == [1, 2]
    assert all(r["logprob_gap"] < 1e-2 for r in rollouts)  # the engine sampled from the merged device weights
    assert rollouts[1]["kl"] > 0.0  # the adapter moved the policy off the base (the reference, adapter off)
    ckpt = sorted((out / "checkpoints").iterdir())[-1]
    assert (ckpt / "adapter" / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(str(ckpt / "policy"))
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    # the emulated GPU trains in bf16 (precision auto), so DDP holds the frozen base in bf16 and the merged
    # model carries it so (docs/lora.md): compare with the base in the saved dtype
    base_state = base.state_dict()
    changed = [n for n, p in merged.state_dict().items() if not torch.equal(p, base_state[n].to(p.dtype))]
    assert changed and all(n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))
                           for n in changed), changed  # only the adapted layers differ from the base


def test_lora_ppo_one_rank(tiny_model, tmp_path):
    """LoRA PPO on the device path: the actor's merged weights to the engine, the reference that is the
    actor with its adapter off, the critic's adapters and the actor's exports."""
    out = tmp_path / "ppo_lora"
    log = run_module_emulated(
        "apps.chat_rlhf.ppo", "--config", "apps/chat_rlhf/configs/ppo.yaml", f"model={tiny_model}", "critic=policy",
        f"train.output_dir={out}", "data.num_train=8", "data.num_heldout=0", "ppo.num_generations=2",
        "ppo.max_new_tokens=4", f"ppo.rewards=[{SHORT_REWARD}]", "ppo.train_layers=0", "ppo.cache_frozen_trunk=false",
        "ppo.ppo_epochs=1", "ppo.num_mini_batches=1", "train.micro_batch_size=2", "train.max_steps=2",
        "train.lr=5e-2", "engine.max_model_len=256", "engine.max_num_seqs=4", "engine.kv_cache_memory_gib=0.02",
        "train.progress_bar=false", "train.plot=false", "lora.enabled=true", "lora.merge=true")
    assert DEVICE_LINE in log
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert rollouts and all(r["logprob_gap"] < 1e-2 for r in rollouts)  # the engine sampled from the merged actor
    ckpt = sorted((out / "checkpoints").iterdir())[-1]
    assert (ckpt / "adapter" / "adapter_config.json").is_file() and (ckpt / "policy" / "config.json").is_file()
