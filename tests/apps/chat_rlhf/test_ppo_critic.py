"""The PPO critic starts from the reward model when one is given (InstructGPT, ColossalChat): its
backbone and score head, so V at a sequence's last token is the RM's score of that sequence
before any training; `critic=policy` keeps the actor's backbone with a zero value head; a reward
model with another vocabulary is refused with the fix named."""
from __future__ import annotations

import pytest
import torch

from apps.chat_rlhf.ppo import ActorCritic, critic_start, load_ppo_config
from apps.chat_rlhf.rollout import completion_batch


@pytest.fixture(scope="module")
def tiny_rm(tiny_chat_model, tmp_path_factory):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    directory = tmp_path_factory.mktemp("critic_rm") / "rm"
    config = AutoConfig.from_pretrained(str(tiny_chat_model), num_labels=1, pad_token_id=0)
    torch.manual_seed(3)
    rm = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        rm.score.weight.normal_(0.0, 0.5)  # scores well away from 0
    rm.save_pretrained(str(directory))
    AutoTokenizer.from_pretrained(str(tiny_chat_model)).save_pretrained(str(directory))
    return directory


def _setup(tiny_chat_model, *extra):
    from apps.chat_rlhf.models import load_policy, load_tokenizer
    cfg = load_ppo_config(None, [f"model={tiny_chat_model}", *extra])
    return cfg, load_policy(tiny_chat_model), load_tokenizer(tiny_chat_model)


def test_critic_starts_as_the_reward_model(tiny_chat_model, tiny_rm):
    from apps.chat_rlhf.models import load_reward_model
    cfg, actor, tokenizer = _setup(tiny_chat_model, f"ppo.rewards=[rm:{tiny_rm}]")
    critic, head = critic_start(cfg, actor, tokenizer)
    model = ActorCritic(actor, critic)
    model.value_head.weight.data.copy_(head)
    rm, _ = load_reward_model(tiny_rm)
    batch = completion_batch([[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14, 15, 16, 17, 18]], pad_id=0)
    T = batch["completion_mask"].shape[1]
    with torch.no_grad():
        _, values = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"], logits_to_keep=T + 1)
        # the RM scores each whole sequence; the critic's value at the last token must equal it
        want = [rm(input_ids=torch.tensor([row]), attention_mask=torch.ones(1, len(row), dtype=torch.long)).logits.item()
                for row in ([5, 6, 7, 8, 11, 12, 13], [9, 10, 14, 15, 16, 17, 18])]
    got = [values[0, -3].item(), values[1, -1].item()]  # row 0 ends 2 columns early (right padding)
    assert got == pytest.approx(want, abs=1e-4)
    assert abs(want[0]) > 1e-2 and want[0] != pytest.approx(want[1])


def test_critic_policy_keeps_the_actor_backbone(tiny_chat_model, tiny_rm):
    cfg, actor, tokenizer = _setup(tiny_chat_model, f"ppo.rewards=[rm:{tiny_rm}]", "critic=policy")
    critic, head = critic_start(cfg, actor, tokenizer)
    assert head is None
    for name, tensor in critic.state_dict().items():
        assert torch.equal(tensor, actor.model.state_dict()[name]), name


def test_reward_model_with_another_tokenizer_is_refused(tiny_chat_model, tmp_path):
    from apps.chat_rlhf.models import init_reward_model
    from phalanx.config import ConfigError
    from tests.apps.chat_rlhf.conftest import build_tiny_chat_model
    other = build_tiny_chat_model(tmp_path / "other", vocab_size=300)
    rm, tok = init_reward_model(other)
    rm.save_pretrained(str(tmp_path / "rm"))
    tok.save_pretrained(str(tmp_path / "rm"))
    cfg, actor, tokenizer = _setup(tiny_chat_model, f"ppo.rewards=[rm:{tmp_path / 'rm'}]")
    with pytest.raises(ConfigError, match="critic=policy"):
        critic_start(cfg, actor, tokenizer)
