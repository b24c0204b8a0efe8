"""LoRA in the RLHF recipe (apps/chat_rlhf/adapters.py): SFT, DPO and GRPO train adapters only and
learn, the base weights come back bit for bit, the reference of KL / DPO is the base itself (adapter
off, no second copy) and scores exactly as the base model does, the engine holds the merged weights,
and the exports open with peft and transformers and equal peft's own merge.

The tiny test model's embeddings are scaled up 6x (`sharp_model`): its random embeddings (std 0.02)
make logits nearly flat whatever the hidden state, so only a full fine-tune (which moves the
embedding rows) could shift its sampling; LoRA changes the hidden state alone."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.apps.chat_rlhf.conftest import tiny_overrides

LORA = ["lora.enabled=true", "lora.rank=8", "lora.alpha=16",
        "lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]", "train.precision=fp32"]


def e_share(*, completions, **_):
    """The share of 'e' characters in a reply: one token's worth of signal LoRA's hidden-state change can reach."""
    return [c.count("e") / max(len(c), 1) for c in completions]


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.apps.chat_rlhf.conftest import build_tiny_chat_model
    base = tmp_path_factory.mktemp("lora_tiny")
    build_tiny_chat_model(base / "plain")
    model = AutoModelForCausalLM.from_pretrained(str(base / "plain"))
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(6.0)
    model.save_pretrained(str(base / "model"))
    AutoTokenizer.from_pretrained(str(base / "plain")).save_pretrained(str(base / "model"))
    return base / "model"


def _frozen(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def _base_unchanged(model, before: dict[str, torch.Tensor]) -> bool:
    now = dict(model.named_parameters())
    return bool(before) and all(torch.equal(now[n].detach(), t) for n, t in before.items())


@pytest.fixture
def prepared(monkeypatch):
    """`prepared(module)` records, in the dict it returns, the model a recipe module's `prepare` builds
    ("model") and its frozen base weights at that moment ("base")."""
    def spy_on(module) -> dict:
        seen, original = {}, module.prepare

        def spy(model, lora, checkpointing, seed=0):
            seen["model"] = original(model, lora, checkpointing, seed)
            seen["base"] = _frozen(seen["model"])
            return seen["model"]
        monkeypatch.setattr(module, "prepare", spy)
        return seen
    return spy_on


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_lora_grpo_learns_with_the_base_as_reference(sharp_model, tmp_path):
    """The issue's "done when" for LoRA GRPO: the reward rises, the base is untouched, the KL reference
    is the base (no copy; its log-probs equal the base model's exactly), the engine held the merged
    weights every step, and both exports equal the trained model."""
    from transformers import AutoModelForCausalLM

    from apps.chat_rlhf.adapters import DisabledAdapter
    from apps.chat_rlhf.grpo import build_run, load_grpo_config
    from apps.chat_rlhf.models import load_policy
    from apps.chat_rlhf.rl_logprobs import completion_logprobs
    from apps.chat_rlhf.rollout import completion_batch

    out = tmp_path / "grpo"
    cfg = load_grpo_config(None, [f"model={sharp_model}", f"train.output_dir={out}", "grpo.num_generations=8",
                                  "grpo.max_new_tokens=8", "grpo.rewards=[test_rlhf_lora:e_share]", "grpo.kl_coef=1e-3",
                                  "data.num_train=32", "data.num_heldout=0", "train.micro_batch_size=4",
                                  "train.min_lr_ratio=1.0", "engine.max_model_len=96", "train.progress_bar=false",
                                  "train.plot=false", "train.max_steps=8", "train.lr=2e-2", "lora.merge=true", *LORA])
    run = build_run(cfg)
    assert isinstance(run.loss.reference, DisabledAdapter)
    model_storages = {p.untyped_storage().data_ptr() for p in run.model.parameters()}
    ref_storages = {p.untyped_storage().data_ptr() for p in run.loss.reference.parameters()}
    assert ref_storages == model_storages  # the reference holds no weights of its own
    before = _frozen(run.model)
    run.train()
    history = run.hook.history
    rewards = [r["reward_mean"] for r in history]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print("LoRA GRPO rewards", [round(r, 4) for r in rewards])
    assert last > first + 0.01 and last > 1.2 * first, rewards
    assert _base_unchanged(run.model, before)
    assert all(r["logprob_gap"] < 1e-4 for r in history)  # the engine sampled from W + BA every step
    assert history[-1]["kl"] > 1e-3  # the policy moved away from the reference, which is the frozen base

    # the reference (adapter off, through the boosted model) scores exactly as the base model does
    base = load_policy(sharp_model)
    tb = completion_batch([[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14, 15]], pad_id=0)
    with torch.no_grad():
        ref_lp, _ = completion_logprobs(run.loss.reference, tb)
        base_lp, _ = completion_logprobs(base, tb)
        policy_lp, _ = completion_logprobs(run.model, tb)
    assert torch.equal(ref_lp, base_lp)
    assert not torch.equal(policy_lp, base_lp)

    # exports: the adapter (peft) and the merged policy/ (transformers) give the trained model's logits,
    # and the merged one equals peft's own merge_and_unload
    import peft
    ckpt = Path(run.hook.output_dir) / "checkpoints"
    last_ckpt = sorted(ckpt.iterdir())[-1]
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    trained = _logits(run.model, ids)
    with_adapter = peft.PeftModel.from_pretrained(load_policy(sharp_model), str(last_ckpt / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(str(last_ckpt / "policy"))
    peft_merged = peft.PeftModel.from_pretrained(load_policy(sharp_model), str(last_ckpt / "adapter")).merge_and_unload()
    torch.testing.assert_close(_logits(with_adapter, ids), trained, rtol=0, atol=1e-5)
    torch.testing.assert_close(_logits(merged, ids), _logits(peft_merged, ids), rtol=0, atol=1e-5)
    torch.testing.assert_close(_logits(merged, ids), trained, rtol=0, atol=1e-5)


def test_engine_runs_in_the_trainer_compute_dtype(sharp_model, tmp_path):
    from apps.chat_rlhf.grpo import build_run, load_grpo_config
    from phalanx.amp.precision import resolve_precision
    from phalanx.device import run_device
    for precision in ("fp32", "bf16"):
        cfg = load_grpo_config(None, [f"model={sharp_model}", f"train.output_dir={tmp_path / precision}",
                                      "data.num_train=8", "data.num_heldout=0", "engine.max_model_len=96", "grpo.max_new_tokens=8",
                                      f"train.precision={precision}", "lora.enabled=true"])
        run = build_run(cfg)
        assert run.engine.llm.dtype == resolve_precision(precision, run_device()).compute_dtype


def _sft(model: Path, out: Path, *extra: str):
    from apps.chat_rlhf.sft import load_sft_config, sft
    cfg = load_sft_config(None, [f"model={model}", f"train.output_dir={out}", "data.max_records=60", "data.seq_len=96",
                                 "train.max_steps=6", "train.micro_batch_size=4", "train.lr=2e-2",
                                 "train.min_lr_ratio=1.0", "train.progress_bar=false", "train.plot=false",
                                 "train.peak_tflops=0", "data.heldout_fraction=0.1", *extra])
    return sft(cfg, log=lambda *a, **k: None)


def test_lora_sft_learns_and_merges_on_request(sharp_model, tmp_path, launched, prepared):
    """SFT with LoRA lowers the held-out loss with the base untouched; the adapter merged afterwards by
    the command (`python -m apps.chat_rlhf.adapters RUN --merge`) opens with transformers and equals
    peft's merge_and_unload."""
    import peft
    from transformers import AutoModelForCausalLM

    from apps.chat_rlhf import adapters
    from apps.chat_rlhf.models import load_policy, resolve_model_dir

    import apps.chat_rlhf.sft as sft_module
    captured = prepared(sft_module)
    result, before = _sft(sharp_model, tmp_path / "sft", *LORA)
    assert result.last_eval["loss"] < before["loss"] - 0.05, (before, result.last_eval)
    assert _base_unchanged(captured["model"], captured["base"])
    with pytest.raises(FileNotFoundError, match="apps.chat_rlhf.adapters"):
        resolve_model_dir(tmp_path / "sft")  # no merged policy/: the checkpoint's model/ is PEFT-named
    out = adapters.merge_adapter(tmp_path / "sft", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(str(out))
    reference = peft.PeftModel.from_pretrained(load_policy(sharp_model),
                                               str(adapters.find_adapter(tmp_path / "sft"))).merge_and_unload()
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    assert torch.equal(_logits(merged, ids), _logits(reference, ids))
    torch.testing.assert_close(_logits(merged, ids), _logits(captured["model"], ids), rtol=0, atol=1e-5)


def _first_step(out: Path) -> dict:
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])


def test_activation_checkpointing_gives_the_same_gradients(sharp_model, tmp_path, launched):
    """One LoRA SFT step with every decoder layer recomputed in backward: the same loss and gradient
    norm as without (later steps drift apart through AdamW's sign-like updates of near-zero gradients)."""
    from phalanx.testing import rounding_rtol
    tol = rounding_rtol(torch.float32, 4 * 96)  # the batch's tokens: 4 rows of 96
    _sft(sharp_model, tmp_path / "plain", "train.max_steps=1", *LORA)
    _sft(sharp_model, tmp_path / "ckpt", "train.max_steps=1", "activation_checkpointing=true", *LORA)
    plain, checkpointed = _first_step(tmp_path / "plain"), _first_step(tmp_path / "ckpt")
    assert checkpointed["loss"] == pytest.approx(plain["loss"], rel=tol)
    assert checkpointed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=tol)


def test_lora_dpo_learns_against_the_base_with_its_adapter_off(sharp_model, tmp_path, launched, prepared):
    """DPO with LoRA and an online reference (the policy itself, adapter off): the first loss is log 2
    exactly (policy = reference at step 0), the training loss falls, and the base is untouched."""
    from apps.chat_rlhf import dpo as dpo_module
    from apps.chat_rlhf.dpo import load_dpo_config, train_preference

    seen = prepared(dpo_module)
    cfg = load_dpo_config(None, tiny_overrides(sharp_model, tmp_path / "dpo", "loss.reference=online",
                                               "train.max_steps=8", "train.lr=2e-2", "data.max_train=8",
                                               "train.min_lr_ratio=1.0", *LORA))
    result, _ = train_preference(cfg, log=lambda *a, **k: None)
    assert result.losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert sum(result.losses[-2:]) / 2 < 0.6, result.losses  # measured: see the docs page
    assert _base_unchanged(seen["model"], seen["base"])
    adapter = json.loads((Path(result.checkpoint_dir) / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 8 and adapter["lora_alpha"] == 16


def test_lora_settings_are_checked():
    from phalanx.config import ConfigError

    from apps.chat_rlhf.dpo import load_dpo_config
    from apps.chat_rlhf.grpo import load_grpo_config
    with pytest.raises(ConfigError, match="train_layers"):
        load_grpo_config(None, ["lora.enabled=true", "train_layers=2"])
    with pytest.raises(ConfigError, match="lora.rank"):
        load_grpo_config(None, ["lora.enabled=true", "lora.rank=0"])
    with pytest.raises(ConfigError, match="reference"):
        load_dpo_config(None, ["lora.enabled=true", "reference=/some/model"])
    # a tensor-parallel trainer merges its own shards for the engine (test_grpo_tp.py runs it)
    load_grpo_config(None, ["lora.enabled=true", "train.plugin=hybrid", "train.plugin_options={tp_size: 2}"])


def test_lora_reward_model_learns_and_exports_the_merged_classifier(sharp_model, tmp_path, launched, prepared):
    """The reward model with LoRA (adapters + its new score head): the training loss falls, the base is
    untouched, and the output_dir opens as a plain classifier (policy/, merged) scoring as the trained model."""
    from apps.chat_rlhf import train_rm as rm_module
    from apps.chat_rlhf.models import load_reward_model

    seen = prepared(rm_module)
    cfg = rm_module.load_rm_config(None, tiny_overrides(sharp_model, tmp_path / "rm", "train.max_steps=8",
                                                        "train.lr=2e-2", "data.max_train=8", "train.min_lr_ratio=1.0",
                                                        "eval_before=false", *LORA))
    result, _ = rm_module.train_reward_model(cfg, log=lambda *a: None)
    assert sum(result.losses[-2:]) / 2 < sum(result.losses[:2]) / 2 - 0.1, result.losses
    base = {n: t for n, t in seen["base"].items() if "score" not in n}
    assert _base_unchanged(seen["model"], base)
    merged, _ = load_reward_model(tmp_path / "rm")
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    torch.testing.assert_close(_logits(merged, ids), _logits(seen["model"], ids), rtol=0, atol=1e-5)


def lora_sync_under_layouts(model_dir: str, out_dir: str) -> dict:
    """On every rank: 3 LoRA GRPO steps (KL to the adapter-off base on) per layout, then the engine's
    log-probs of fresh samples against the trainer's, and whether the base moved."""
    import torch.distributed as dist

    from apps.chat_rlhf.grpo import build_run, load_grpo_config
    from apps.chat_rlhf.rollout import completion_batch, completion_logprobs, padded

    result = {}
    for plugin in ("ddp", "zero2", "fsdp"):
        cfg = load_grpo_config(None, [f"model={model_dir}", "data.num_train=16", "data.num_heldout=0",
                                      "grpo.num_generations=4", "grpo.max_new_tokens=6", "grpo.kl_coef=0.05",
                                      "grpo.rewards=[test_rlhf_lora:e_share]", "train.micro_batch_size=2",
                                      f"train.output_dir={out_dir}/{plugin}", "train.lr=2e-2", "train.max_steps=3",
                                      "engine.max_model_len=96", "train.progress_bar=false", "train.plot=false",
                                      "train.resume=false", f"train.plugin={plugin}", *LORA])
        run = build_run(cfg)
        run.train()
        rollout = run.engine.generate(run.loss.prompt_ids[:2], 2, seeds=[1, 2, 3, 4])
        batch = completion_batch(rollout.prompt_ids, rollout.completion_ids, pad_id=run.tokenizer.pad_token_id)
        with torch.no_grad():
            logp, _ = completion_logprobs(run.hook.model, batch)
            ref, _ = completion_logprobs(run.loss.reference, batch)
        engine = padded(rollout.engine_logprobs, logp.shape[1]).to(logp.device)
        mask = batch["completion_mask"].to(logp.device)
        result[plugin] = {"max_diff": ((logp - engine).abs() * mask).max().item(), "rank": dist.get_rank(),
                          "gaps": [r["logprob_gap"] for r in run.hook.history],
                          "kl": [r["kl"] for r in run.hook.history],
                          "policy_vs_ref": ((logp - ref).abs() * mask).max().item()}
    return result


@pytest.mark.slow  # one 2-rank spawn, three layouts x 3 steps
def test_lora_grpo_engine_follows_merged_weights_under_ddp_zero2_fsdp(request, sharp_model, tmp_path):
    """Under each data-parallel layout on 2 ranks the engine holds W + BA after every LoRA step (the
    merged sync gathers FSDP2's shards one tensor at a time), and the adapter-off reference, called
    through the boosted model, differs from the trained policy."""
    from tests.framework.spawn_batch import spawn_suites
    name = "test_lora_grpo_engine_follows_merged_weights_under_ddp_zero2_fsdp"  # spawn_batch keys suites by test
    suites = {name: (lora_sync_under_layouts, (str(sharp_model), str(tmp_path / "sync")), {})}
    results = spawn_suites(request, 2, suites, timeout=1800).get(name)
    assert len(results) == 2 and all(set(r) == {"ddp", "zero2", "fsdp"} for r in results)
    print({plugin: (r["max_diff"], max(r["gaps"]), r["kl"][-1]) for plugin, r in results[0].items()})
    for rank, per_plugin in enumerate(results):
        for plugin, r in per_plugin.items():
            assert r["max_diff"] < 1e-4 and max(r["gaps"]) < 1e-4, (plugin, rank, r)
            assert r["kl"][-1] > 0 and r["policy_vs_ref"] > 1e-3, (plugin, rank, r)


def lora_fixed_update(model_dir: str, out_dir: str, world: int, *extra: str) -> list[float] | None:
    """One LoRA GRPO update (KL to the adapter-off base on) from fixed rollouts; the adapters after it
    (gathered from FSDP2's shards). AdamW with a large eps makes the step proportional to the gradient,
    so a wrong average over ranks shows."""
    import torch.distributed as dist

    from apps.chat_rlhf.adapters import DisabledAdapter, prepare
    from apps.chat_rlhf.grpo import GRPOLoss, PromptIndices, RLHook, encode_prompts, load_grpo_config, load_prompt_sets
    from apps.chat_rlhf.models import load_policy, load_tokenizer
    from apps.chat_rlhf.rewards import RewardSet
    from fixed_rollouts import seeded_rollout_fn
    from phalanx.launch import context
    from phalanx.train import fit

    context()
    cfg = load_grpo_config(None, [f"model={model_dir}", "data.num_train=16", "data.num_heldout=0",
                                  "grpo.num_generations=4", "grpo.max_new_tokens=6", "grpo.kl_coef=0.5",
                                  "grpo.rewards=[test_grpo_dist:length_reward]", f"train.micro_batch_size={4 // world}",
                                  f"train.output_dir={out_dir}", "train.max_steps=2", "train.max_grad_norm=0",
                                  "train.lr=1.0", "train.adam_eps=10.0", "train.progress_bar=false", "train.plot=false",
                                  "train.resume=false", *LORA, *extra])
    tokenizer = load_tokenizer(model_dir)
    model = prepare(load_policy(model_dir), cfg.lora, cfg.activation_checkpointing, cfg.train.seed)
    records, _ = load_prompt_sets(cfg.data)
    ids = encode_prompts(tokenizer, records)
    rollout_fn = seeded_rollout_fn(load_policy(model_dir).eval(), tokenizer, ids, cfg.grpo.num_generations)
    loss = GRPOLoss(cfg.grpo, records, ids, RewardSet.from_specs(cfg.grpo.rewards), rollout_fn, tokenizer.pad_token_id,
                    reference=DisabledAdapter(model))
    fit(cfg.train, model, PromptIndices(len(records)), loss_fn=loss, hooks=[RLHook(loss, None, out_dir)])
    adapters = [p.detach() for p in model.parameters() if p.requires_grad]
    if "train.plugin=fsdp" in extra:
        return torch.cat([p.full_tensor().flatten() for p in adapters]).tolist()
    return torch.cat([p.flatten() for p in adapters]).tolist() if dist.get_rank() == 0 else None


@pytest.mark.slow  # a 1-rank and a 2-rank spawn
@pytest.mark.parametrize("plugin", ["ddp", "zero2", "fsdp"])
def test_lora_grpo_update_on_two_ranks_matches_one_process(request, sharp_model, tmp_path, plugin):
    """Two LoRA GRPO steps with the KL term (its reference the base, adapter off, through the boosted
    model) on 2 ranks give one process's adapters (2 prompts per rank against 4 on one). The 2-rank
    runs recompute each decoder layer in backward (activation checkpointing) and the one-process run
    does not: the same gradients under each plugin."""
    from phalanx.testing import assert_update_close
    from tests.framework.spawn_batch import spawn_suites

    from apps.chat_rlhf.models import load_policy
    name = f"test_lora_grpo_update_on_two_ranks_matches_one_process[{plugin}]"
    one = spawn_suites(request, 1, {name: (lora_fixed_update, (str(sharp_model), str(tmp_path / "one"), 1), {})},
                       timeout=1800).get(name)[0]
    many = spawn_suites(request, 2, {name: (lora_fixed_update, (str(sharp_model), str(tmp_path / "two"), 2,
                                                               f"train.plugin={plugin}", "activation_checkpointing=true"),
                                            {})}, timeout=1800).get(name)[0]
    from apps.chat_rlhf.adapters import prepare
    from apps.chat_rlhf.grpo import load_grpo_config
    cfg = load_grpo_config(None, LORA)
    initial = prepare(load_policy(sharp_model), cfg.lora, False, cfg.train.seed)  # the adapters every run starts from
    start = torch.cat([p.detach().flatten() for p in initial.parameters() if p.requires_grad])
    one, many = torch.tensor(one), torch.tensor(many)
    assert (one - start).abs().max() > 1e-3  # the adapters moved
    assert_update_close(many, one, start, 1e-5, f"LoRA GRPO, {plugin} on 2 ranks vs one process")



def test_lora_ppo_trains_adapters_with_the_actor_off_adapter_as_reference(sharp_model, tmp_path):
    """PPO with `lora:`: adapters on actor and critic, the KL reference is the actor with its adapter
    off (no copy), the base comes back bit for bit, the engine samples from the merged actor every
    rollout, and adapter/ (peft) and policy/ (merged, transformers) give the trained actor's logits."""
    import peft
    from transformers import AutoModelForCausalLM

    from apps.chat_rlhf.adapters import DisabledAdapter
    from apps.chat_rlhf.models import load_policy
    from apps.chat_rlhf.ppo import load_ppo_config, train_ppo

    out = tmp_path / "ppo"
    cfg = load_ppo_config(None, [f"model={sharp_model}", f"train.output_dir={out}", "critic=policy",
                                 "ppo.num_generations=4", "ppo.max_new_tokens=8", "ppo.rewards=[test_rlhf_lora:e_share]",
                                 "ppo.ppo_epochs=2", "ppo.num_mini_batches=2", "data.num_train=16", "data.num_heldout=0",
                                 "train.micro_batch_size=2", "train.min_lr_ratio=1.0", "engine.max_model_len=96",
                                 "train.progress_bar=false", "train.plot=false", "train.max_steps=8", "train.lr=2e-2",
                                 "lora.merge=true", *LORA])
    result, hook = train_ppo(cfg)
    reference = hook.loss.reference
    assert isinstance(reference, DisabledAdapter)
    actor = reference.module  # the trained actor (a peft model); the reference is it with the adapter off
    trained = {n for n, p in hook.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n or "value_head." in n for n in trained), sorted(trained)[:4]
    base = load_policy(sharp_model)
    base_state = base.state_dict()
    for name, param in actor.get_base_model().named_parameters():  # the frozen base, bit for bit
        if "lora_" not in name:
            assert torch.equal(param.detach().cpu(), base_state[name.replace(".base_layer", "")]), name
    rollouts = [r for r in hook.history if "logprob_gap" in r]
    assert rollouts and all(r["logprob_gap"] < 1e-4 for r in rollouts)  # the engine sampled from W + BA

    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        trained_logits = actor(input_ids=ids).logits
        with actor.disable_adapter():
            assert torch.equal(actor(input_ids=ids).logits, _logits(base, ids))  # the reference is the base
    assert not torch.allclose(trained_logits, _logits(base, ids))  # and the adapters moved the policy
    last_ckpt = sorted((out / "checkpoints").iterdir())[-1]
    with_adapter = peft.PeftModel.from_pretrained(load_policy(sharp_model), str(last_ckpt / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(str(last_ckpt / "policy"))
    torch.testing.assert_close(_logits(with_adapter, ids), trained_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(_logits(merged, ids), trained_logits, rtol=0, atol=1e-5)


def test_lora_ppo_refuses_plugins_that_shard_the_actor(sharp_model, tmp_path):
    from apps.chat_rlhf.ppo import load_ppo_config
    from phalanx.config import ConfigError

    with pytest.raises(ConfigError, match="ddp, zero1, zero2 or hybrid"):
        load_ppo_config(None, [f"model={sharp_model}", "train.plugin=fsdp", *LORA])
