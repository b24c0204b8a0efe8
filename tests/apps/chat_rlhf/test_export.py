"""Every trained policy opens everywhere: a GRPO and a PPO run of two steps on the tiny model, then
their checkpoint's policy directory opened with `AutoModelForCausalLM.from_pretrained`, our
inference engine (what `chat` and `phalanx serve` build) and the `chat` command, with weights equal
to the trained policy's (and not to the starting ones) and the same greedy tokens."""
from __future__ import annotations

import pytest
import torch

from apps.chat_rlhf.models import resolve_model_dir


def length_reward(*, completions, **_):
    return [float(len(c)) for c in completions]


COMMON = ["data.num_train=8", "data.num_heldout=0", "train.micro_batch_size=2", "train.lr=1e-2",
          "train.min_lr_ratio=1.0", "engine.max_model_len=96", "train.progress_bar=false", "train.plot=false",
          "train.max_steps=2"]
PROMPT = [{"role": "user", "content": "What is 3 + 4?"}]


def check_policy_dir(directory, trained: torch.nn.Module, start_dir) -> None:
    """`directory` holds exactly the trained policy, and every consumer opens it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from phalanx.inference import LLM, SamplingParams

    assert {"config.json", "generation_config.json", "tokenizer.json"} <= {p.name for p in directory.iterdir()}
    opened = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    start = AutoModelForCausalLM.from_pretrained(str(start_dir), dtype=torch.float32)
    trained_sd, start_sd = trained.state_dict(), start.state_dict()
    assert opened.state_dict().keys() == trained_sd.keys()
    for name, tensor in opened.state_dict().items():
        assert torch.equal(tensor, trained_sd[name].detach().float().cpu()), name
    assert any(not torch.equal(start_sd[k], trained_sd[k].cpu()) for k in start_sd)  # training moved it

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True, return_dict=False)
    x = torch.tensor([list(ids)])
    with torch.no_grad():
        want = trained.cpu().eval().generate(x, max_new_tokens=8, do_sample=False)[0, x.shape[1]:]
        got = opened.generate(x, max_new_tokens=8, do_sample=False)[0, x.shape[1]:]
    assert got.tolist() == want.tolist()
    # what `chat` and `phalanx serve` build: the engine over the directory
    engine = LLM(str(directory), tokenizer=tokenizer, dtype="float32")  # `want` is fp32 HF
    out = engine.generate([list(ids)], SamplingParams(max_new_tokens=8, temperature=0.0))[0]
    stop = tokenizer.eos_token_id
    want_ids = want.tolist()
    want_ids = want_ids[:want_ids.index(stop) + 1] if stop in want_ids else want_ids
    assert list(out.token_ids) == want_ids


def test_grpo_checkpoint_model_is_the_policy(tiny_chat_model, tmp_path, capsys):
    from apps.chat_rlhf import chat
    from apps.chat_rlhf.grpo import build_run, load_grpo_config
    cfg = load_grpo_config(None, [f"model={tiny_chat_model}", f"train.output_dir={tmp_path}", "grpo.num_generations=2",
                                  "grpo.max_new_tokens=6", "grpo.rewards=[test_export:length_reward]", *COMMON])
    run = build_run(cfg)
    result = run.train()
    directory = resolve_model_dir(tmp_path)  # the output_dir's latest checkpoint
    assert directory == result.checkpoint_dir / "model"
    check_policy_dir(directory, run.model, tiny_chat_model)
    capsys.readouterr()
    chat.main(["--model", str(tmp_path), "--prompt", "Hello?", "--max-new-tokens", "4", "--temperature", "0"])
    assert capsys.readouterr().out.startswith("user: Hello?\nassistant:")


def test_ppo_checkpoint_exports_the_actor_alone(tiny_chat_model, tmp_path, capsys):
    from apps.chat_rlhf import chat
    from apps.chat_rlhf.ppo import load_ppo_config, train_ppo
    from phalanx.booster.plugins.base import unwrap_model
    cfg = load_ppo_config(None, [f"model={tiny_chat_model}", f"train.output_dir={tmp_path}", "ppo.num_generations=2",
                                 "ppo.max_new_tokens=6", "ppo.rewards=[test_export:length_reward]", "ppo.ppo_epochs=1",
                                 "ppo.num_mini_batches=2", *COMMON])
    result, hook = train_ppo(cfg)
    directory = resolve_model_dir(tmp_path)
    assert directory == result.checkpoint_dir / "policy"
    assert not (result.checkpoint_dir / "model" / "config.json").exists()  # the actor-critic is no HF model
    check_policy_dir(directory, unwrap_model(hook.model).actor, tiny_chat_model)
    capsys.readouterr()
    chat.main(["--model", str(tmp_path), "--prompt", "Hello?", "--max-new-tokens", "4", "--temperature", "0"])
    assert capsys.readouterr().out.startswith("user: Hello?\nassistant:")


def test_missing_policy_names_the_fix(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_dir(tmp_path)
