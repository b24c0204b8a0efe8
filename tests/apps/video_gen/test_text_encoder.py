"""A user's local text encoder (`model.text_encoder_dir`): tiny random T5 and CLIP encoders saved to
tmp_path with the recipe's own word-level tokenizer, loaded offline; the transformer's text_dim
follows the encoder; the T5 trains with the transformer and comes back from the exported pipeline;
a frozen encoder gets no gradients; bad directories get one ConfigError naming the key and the fix."""
from __future__ import annotations

import pytest
import torch

from video_tiny import tiny_config


def _captions() -> list[str]:
    from apps.video_gen.shapes import COLOURS, DIRECTIONS, SHAPES, caption_for

    return [caption_for(c, s, d) for c in COLOURS for s in SHAPES for d in [None, *DIRECTIONS]]


def _tokenizer():
    from apps.video_gen.text import build_tokenizer

    return build_tokenizer(_captions(), 12)


def _save_t5(directory, tokenizer, d_model: int = 24):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    config = T5Config(vocab_size=len(tokenizer), d_model=d_model, d_kv=8, d_ff=48, num_layers=1, num_heads=3,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                      decoder_start_token_id=tokenizer.pad_token_id)
    encoder = T5EncoderModel(config)
    encoder.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return encoder


def _batch(tokenizer, frames: int = 8):
    from apps.video_gen.shapes import moving_shapes
    from apps.video_gen.text import tokenize

    clips = moving_shapes(2, frames, 16, seed=3)
    return torch.stack([c.video for c in clips]), tokenize(tokenizer, [c.caption for c in clips])


@pytest.mark.slow
def test_a_local_t5_encoder_trains_with_the_transformer_and_comes_back_from_the_pipeline(tmp_path):
    from transformers import T5EncoderModel

    from apps.video_gen.pipeline import VideoPipeline
    from apps.video_gen.train import train

    saved = _save_t5(tmp_path / "t5", _tokenizer())
    cfg = tiny_config(tmp_path / "run", f"model.text_encoder_dir={tmp_path / 't5'}", "train.max_steps=2",
                      "data.clips_dir=null", "data.buckets=[[1,16,16,8],[8,16,16,4]]")
    assert train(cfg).final_step == 2
    pipe = VideoPipeline.from_pretrained(cfg.final_path)
    assert isinstance(pipe.model.text_encoder, T5EncoderModel)
    assert pipe.model.transformer.config.text_dim == 24 and pipe.tokenizer.model_max_length == 12
    trained = pipe.model.text_encoder.state_dict()
    assert any(not torch.equal(v, trained[k]) for k, v in saved.state_dict().items() if k in trained)
    a = pipe(["a red square moving left"], seed=1, steps=2)
    b = VideoPipeline.from_pretrained(cfg.final_path)(["a red square moving left"], seed=1, steps=2)
    assert a.shape == (1, 3, 8, 16, 16) and torch.equal(a, b)


def test_a_frozen_local_t5_gets_no_gradients_and_stays_in_eval_mode(tmp_path):
    from phalanx.train import build_optimizer

    from apps.video_gen.train import build_model

    tok = _tokenizer()
    _save_t5(tmp_path / "t5", tok)
    cfg = tiny_config(tmp_path / "run", f"model.text_encoder_dir={tmp_path / 't5'}", "model.freeze_text_encoder=true")
    model, tokenizer = build_model(cfg, [])
    assert type(model.text_encoder).__name__ == "T5EncoderModel" and model.transformer.config.text_dim == 24
    assert model.training and not model.text_encoder.training          # no dropout in a frozen encoder
    video, ids = _batch(tokenizer)
    model(video, ids).backward()
    assert all(p.grad is None for p in model.text_encoder.parameters())
    assert all(p.grad is not None for p in model.transformer.parameters() if p.requires_grad)
    in_optimizer = {id(p) for g in build_optimizer(model, cfg.train).param_groups for p in g["params"]}
    assert not in_optimizer & {id(p) for p in model.text_encoder.parameters()}
    assert {id(p) for p in model.transformer.parameters()} <= in_optimizer


def test_a_local_clip_in_the_diffusers_layout_sets_the_text_dim(tmp_path):
    """A pipeline-style directory (text_encoder/ + tokenizer/): the CLIP's hidden size 40 becomes
    the transformer's text_dim; the tokenizer pads to data.max_prompt_tokens; not frozen: gradients."""
    from transformers import CLIPTextConfig, CLIPTextModel

    from apps.video_gen.train import build_model

    tok = _tokenizer()
    CLIPTextModel(CLIPTextConfig(vocab_size=len(tok), hidden_size=40, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=16, pad_token_id=tok.pad_token_id,
                                 bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
                  ).save_pretrained(str(tmp_path / "pipe" / "text_encoder"))
    tok.save_pretrained(str(tmp_path / "pipe" / "tokenizer"))
    cfg = tiny_config(tmp_path / "run", f"model.text_encoder_dir={tmp_path / 'pipe'}", "data.max_prompt_tokens=10")
    model, tokenizer = build_model(cfg, [])
    assert isinstance(model.text_encoder, CLIPTextModel) and model.transformer.config.text_dim == 40
    video, ids = _batch(tokenizer)
    assert ids.shape == (2, 10)
    model(video, ids).backward()
    assert model.text_encoder.get_input_embeddings().weight.grad is not None


def test_text_encoder_directories_that_do_not_load_get_one_clear_error(tmp_path):
    from phalanx.config import ConfigError

    from apps.video_gen.train import build_model

    with pytest.raises(ConfigError, match=r"'model.text_encoder_dir'.*holds no config.json.*T5EncoderModel.*null"):
        build_model(tiny_config(tmp_path / "run", f"model.text_encoder_dir={tmp_path / 'missing'}"), [])
    tok = _tokenizer()
    encoder = _save_t5(tmp_path / "t5", tok)
    encoder.save_pretrained(str(tmp_path / "no_tokenizer"))
    with pytest.raises(ConfigError, match=r"'model.text_encoder_dir'.*no tokenizer loads.*model.tokenizer_dir"):
        build_model(tiny_config(tmp_path / "run", f"model.text_encoder_dir={tmp_path / 'no_tokenizer'}"), [])
    model, _ = build_model(tiny_config(tmp_path / "run", f"model.text_encoder_dir={tmp_path / 'no_tokenizer'}",
                                       f"model.tokenizer_dir={tmp_path / 't5'}"), [])
    assert model.transformer.config.text_dim == 24
    _save_t5(tmp_path / "small", _tokenizer(), d_model=24)
    from apps.video_gen.text import build_tokenizer
    build_tokenizer(_captions() + ["many more words than the encoder embeds"], 12).save_pretrained(str(tmp_path / "big"))
    with pytest.raises(ConfigError, match=r"'model.tokenizer_dir'.*tokenizer has \d+ tokens but the text encoder"):
        build_model(tiny_config(tmp_path / "run", f"model.text_encoder_dir={tmp_path / 'small'}",
                                f"model.tokenizer_dir={tmp_path / 'big'}"), [])
    with pytest.raises(ConfigError, match=r"'model.text_encoder_dir'.*init_from already brings its text encoder"):
        tiny_config(tmp_path / "run", f"model.text_encoder_dir={tmp_path / 't5'}", f"model.init_from={tmp_path}")


def test_t5_padding_states_are_zeroed_before_cross_attention_as_wan_does(tmp_path):
    """Wan's pipelines cut T5's states at each prompt's length and pad with zeros; the recipe's
    encode_prompts (training, evaluation and sampling) gives exactly that for a T5 encoder, and
    leaves the causal from-scratch CLIP's states as they are."""
    from apps.video_gen.shapes import moving_shapes
    from apps.video_gen.text import tokenize
    from apps.video_gen.train import build_model

    _save_t5(tmp_path / "t5", _tokenizer())
    model, tokenizer = build_model(tiny_config(tmp_path / "run", f"model.text_encoder_dir={tmp_path / 't5'}"), [])
    model.eval()
    ids = tokenize(tokenizer, ["a red square moving left", "a blue circle"])
    mask = ids != tokenizer.pad_token_id
    raw = model.text_encoder(input_ids=ids, attention_mask=mask.long()).last_hidden_state
    reference = torch.stack([torch.cat([u[:n], u.new_zeros(len(u) - n, u.shape[-1])])
                             for u, n in zip(raw, mask.sum(1).tolist(), strict=True)])
    assert model.zero_padding and (raw[~mask] != 0).any()    # T5 does write states at the padding
    states = model.encode_prompts(ids)
    assert torch.equal(states, reference)
    video = torch.stack([c.video for c in moving_shapes(2, 8, 16, seed=3)])
    t = torch.tensor([0.5, 0.9])
    assert not torch.allclose(model.velocity(video, t, states), model.velocity(video, t, raw))  # what the model reads

    clip, clip_tok = build_model(tiny_config(tmp_path / "run2", "model.pooled_text=flat"), _captions())
    clip.eval()
    ids = tokenize(clip_tok, ["a red square moving left"])
    assert not clip.zero_padding
    assert torch.equal(clip.encode_prompts(ids), clip.text_encoder(
        input_ids=ids, attention_mask=(ids != clip_tok.pad_token_id).long()).last_hidden_state)
