"""PPO end to end on a tiny model with a tiny reward model: it runs, the engine follows the actor,
the adaptive KL controller moves, and the actor/critic split is right."""
import pytest
import torch

from apps.chat_rlhf.ppo import ActorCritic, actor_weights, load_ppo_config, train_ppo


def test_ppo_three_stage_tiny(tiny_chat_model, tmp_path):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    config = AutoConfig.from_pretrained(str(tiny_chat_model), num_labels=1)
    torch.manual_seed(1)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(str(tmp_path / "rm"))
    AutoTokenizer.from_pretrained(str(tiny_chat_model)).save_pretrained(str(tmp_path / "rm"))
    cfg = load_ppo_config(None, [f"model={tiny_chat_model}", "data.num_train=12", "data.num_heldout=4",
                                 "ppo.num_generations=2", "ppo.max_new_tokens=6", f"ppo.rewards=[rm:{tmp_path / 'rm'}]",
                                 "ppo.kl_target=0.001", "ppo.kl_horizon=10", "train.max_steps=3",
                                 "train.micro_batch_size=2", f"train.output_dir={tmp_path / 'ppo'}", "train.lr=1e-3",
                                 "engine.max_model_len=96", "train.progress_bar=false", "train.plot=false"])
    result, hook = train_ppo(cfg)
    assert result.final_step == 3 and all(torch.isfinite(torch.tensor(result.losses)))
    history = hook.history
    assert all(r["logprob_gap"] < 1e-4 for r in history)  # the engine got the actor's weights every step
    assert history[-1]["kl"] > 0 and history[-1]["kl_coef"] != 0.05  # moved away from the reference; controller moved
    assert "heldout_reward" in result.last_eval


def test_actor_weights_strip_wrappers(tiny_chat_model):
    from transformers import AutoModel, AutoModelForCausalLM
    model = ActorCritic(AutoModelForCausalLM.from_pretrained(str(tiny_chat_model)),
                        AutoModel.from_pretrained(str(tiny_chat_model)))
    names = set(actor_weights(model))
    assert names == set(model.actor.state_dict())
    wrapped = torch.nn.Module()
    wrapped.module = model
    assert set(actor_weights(wrapped)) == names


def test_bad_ppo_settings():
    from phalanx.config import ConfigError
    with pytest.raises(ConfigError, match="lam"):
        load_ppo_config(None, ["ppo.lam=1.5"])
