"""The recipe's `lora:` section: a tiny 2-rank ZeRO-2 pre-training run with LoRA trains only the
adapters (the base in its checkpoint is the initial model, bit for bit; the optimizer state is the
adapters'), and exports a PEFT adapter that peft opens on the initial model and a merged model that
plain transformers opens, both giving the trained model's logits."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

TINY = Path(__file__).resolve().parents[3] / "apps" / "llama" / "configs" / "tiny.yaml"
STEPS = 4
OVERRIDES = [
    "train.plugin=zero2", "train.precision=fp32", "train.micro_batch_size=4", "train.lr=3e-2", "train.warmup_steps=0",
    f"train.max_steps={STEPS}", "train.save_every=0", "train.eval_every=0", "train.log_every=1",
    "train.progress_bar=false", "lora.enabled=true", "lora.rank=4", "lora.alpha=8", "lora.merge=true",
    "lora.target_modules=[q_proj, v_proj, down_proj]",
]


def _lora_ranks(overrides: list[str]) -> dict:
    from apps.llama.config import load_recipe
    from apps.llama.pretrain import pretrain

    result = pretrain(load_recipe(TINY, overrides))
    return {"losses": result.losses, "checkpoint": str(result.checkpoint_dir)}


@pytest.fixture(scope="module")
def lora_run(tiny_run, tmp_path_factory):
    from phalanx.testing import spawn

    cfg, _ = tiny_run
    out = tmp_path_factory.mktemp("llama_lora") / "pretrain"
    results = spawn(_lora_ranks, 2, [f"work_dir={cfg.work_dir}", f"train.output_dir={out}", *OVERRIDES], timeout=600)
    return cfg, out, results[0]


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.slow  # ~40 s: two ranks start, load the tiny recipe's 37k-token model and train 4 steps
def test_lora_run_trains_only_the_adapters_and_exports_them(lora_run):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from phalanx.checkpoint.hf import load_hf_state_dict

    cfg, out, result = lora_run
    assert len(result["losses"]) == STEPS and result["losses"][-1] < result["losses"][0], result["losses"]
    init = AutoModelForCausalLM.from_pretrained(str(cfg.model_init_dir), dtype=torch.float32)
    init_state = init.state_dict()
    saved = load_hf_state_dict(Path(result["checkpoint"]) / "model")
    adapters = {k: v for k, v in saved.items() if "lora_" in k}
    assert len(adapters) == 2 * 3 * init.config.num_hidden_layers  # A and B of 3 targets per layer
    assert all(v.abs().max() > 0 for k, v in adapters.items() if "lora_B" in k)  # B starts at zero: it trained
    optimizer_index = json.loads((Path(result["checkpoint"]) / "optimizer" / "index.json").read_text())
    assert sorted(optimizer_index["params"]) == sorted(adapters)  # optimizer state: the adapters' alone
    for key, value in saved.items():  # the frozen base is the initial model, bit for bit
        if "lora_" not in key:
            base = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
            assert torch.equal(value, init_state[base]), key

    # The adapter, in PEFT's format, opens on the initial model; the merged model is plain HF.
    adapter_dir, merged_dir = out / "adapter", out / "merged"
    exported = load_file(str(adapter_dir / "adapter_model.safetensors"))
    assert len(exported) == len(adapters)
    lora_model = PeftModel.from_pretrained(init, str(adapter_dir))
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32)
    assert set(merged.state_dict()) == set(init_state)
    ids = torch.randint(0, init.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    want = _logits(lora_model, ids)
    assert (want - _logits(AutoModelForCausalLM.from_pretrained(str(cfg.model_init_dir)), ids)).abs().max() > 1e-3
    torch.testing.assert_close(_logits(merged, ids), want, rtol=1e-4, atol=1e-4)
    assert (merged_dir / "tokenizer_config.json").is_file()


def test_lora_config_is_checked():
    from apps.llama.config import load_recipe
    from phalanx.config import ConfigError

    with pytest.raises(ConfigError, match="lora.rank"):
        load_recipe(TINY, ["lora.rank=0"])
    with pytest.raises(ConfigError, match="lora.target_modules"):
        load_recipe(TINY, ["lora.enabled=true", "lora.target_modules=[]"])
