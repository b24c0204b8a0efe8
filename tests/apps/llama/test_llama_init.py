"""Model initialisation: each new row is the mean of the base rows of the token's old pieces."""
from __future__ import annotations

import pytest
import torch


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def test_new_rows_are_means_of_their_old_byte_pieces(tiny_run):
    from apps.llama.init_model import build_from_config
    from apps.llama.tokenizer_io import load_tokenizer

    cfg, reports = tiny_run
    base_tok, new_tok = load_tokenizer(cfg.tokenizer.base), load_tokenizer(cfg.tokenizer_dir)
    # The tiny base model is a seeded model from config: rebuild the very same weights.
    base = build_from_config(cfg.model.architecture, base_tok, cfg.model.init_seed)
    model = _load(cfg.model_init_dir)
    emb_b, emb_n = base.get_input_embeddings().weight, model.get_input_embeddings().weight
    head_b, head_n = base.get_output_embeddings().weight, model.get_output_embeddings().weight
    assert emb_n.shape[0] == len(new_tok) and head_n.shape[0] == len(new_tok)
    assert torch.equal(emb_n[:len(base_tok)], emb_b) and torch.equal(head_n[:len(base_tok)], head_b)

    # Single characters the base vocabulary lacks: the old tokenizer splits them into UTF-8 byte pieces.
    checked = 0
    for new_id in range(len(base_tok), len(new_tok)):
        token = new_tok.convert_ids_to_tokens(new_id)
        if len(token) != 1 or token in base_tok.get_vocab():
            continue
        byte_ids = base_tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in token.encode("utf-8")])
        torch.testing.assert_close(emb_n[new_id], emb_b[byte_ids].mean(0))
        torch.testing.assert_close(head_n[new_id], head_b[byte_ids].mean(0))
        checked += 1
        if checked == 50:
            break
    assert checked == 50

    # A multi-character piece made of base pieces: the mean of those pieces' rows.
    multi = next(i for i in range(len(base_tok), len(new_tok))
                 if all(c in base_tok.get_vocab() for c in new_tok.convert_ids_to_tokens(i)) and len(new_tok.convert_ids_to_tokens(i)) > 1)
    parts = base_tok.convert_tokens_to_ids(list(new_tok.convert_ids_to_tokens(multi)))
    torch.testing.assert_close(emb_n[multi], emb_b[parts].mean(0))
    # Not a global mean: different tokens get different rows.
    assert not torch.allclose(emb_n[len(base_tok)], emb_n[len(base_tok) + 1])
    assert reports["init"]["new_rows"] == len(new_tok) - len(base_tok)


def test_tied_embeddings_resize_once():
    from phalanx.testing import tiny_llama

    from apps.llama.init_model import resize_with_piece_means

    model = tiny_llama(tie_word_embeddings=True)
    old = model.get_input_embeddings().weight.detach().clone()
    resize_with_piece_means(model, {128: [3, 5, 7], 129: [10]}, 130)
    emb = model.get_input_embeddings().weight
    assert emb.shape[0] == 130 and model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()
    torch.testing.assert_close(emb[128], old[[3, 5, 7]].mean(0))
    torch.testing.assert_close(emb[129], old[10])


def test_tokenizer_that_is_not_an_extension_is_rejected(tiny_run):
    from apps.llama.init_model import check_extension
    from apps.llama.tokenizer_io import load_tokenizer

    cfg, _ = tiny_run
    base = load_tokenizer(cfg.tokenizer.base)
    with pytest.raises(ValueError, match="not an extension"):
        check_extension(base, _swapped_ids(base))


def _swapped_ids(tok):
    """A stand-in tokenizer whose vocabulary swaps the ids of two base tokens."""
    class Swapped:
        def get_vocab(self):
            vocab = dict(tok.get_vocab())
            a, b = "<unk>", "<s>"
            vocab[a], vocab[b] = vocab[b], vocab[a]
            return vocab
    return Swapped()


def test_architecture_may_not_set_tokenizer_fields(tiny_run):
    from apps.llama.init_model import build_from_config
    from apps.llama.tokenizer_io import load_tokenizer

    cfg, _ = tiny_run
    with pytest.raises(ValueError, match="come from the tokenizer"):
        build_from_config({**cfg.model.architecture, "vocab_size": 10}, load_tokenizer(cfg.tokenizer.base), 0)


@pytest.mark.parametrize("tied", [False, True])
def test_streamed_recipe_init_equals_eager_resize(tmp_path, tied):
    """apps/llama/init_model for a sharding plugin copies the base tensor by tensor and grows only
    the embedding / LM head: the same weights as loading the base whole and resizing it."""
    from transformers import AutoModelForCausalLM

    from apps.llama.init_model import resize_with_piece_means, stream_resized_checkpoint
    from phalanx.booster.plugins import builds_lazily
    from phalanx.testing import tiny_llama

    base = tiny_llama(seed=2, tie_word_embeddings=tied)
    base.save_pretrained(tmp_path / "base")
    pieces = {128: [3, 5, 7], 129: [10], 130: [11, 12]}
    numel = stream_resized_checkpoint(tmp_path / "base", tmp_path / "new", pieces, 131,
                                      {"vocab_size": 131, "eos_token_id": 2, "pad_token_id": 0},
                                      max_shard_size=20_000)
    resize_with_piece_means(base, pieces, 131)
    new = AutoModelForCausalLM.from_pretrained(tmp_path / "new")
    assert new.config.vocab_size == 131 and new.generation_config.eos_token_id == 2
    assert numel == sum(p.numel() for p in base.parameters())
    want = base.state_dict()
    assert set(new.state_dict()) == set(want)
    bad = [k for k, v in new.state_dict().items() if not torch.equal(v, want[k])]
    assert not bad, f"streamed init (tied={tied}): {bad[:3]} differ"
    assert len(list((tmp_path / "new").glob("*.safetensors"))) >= 2
    assert builds_lazily("fsdp") and builds_lazily("zero2") and not builds_lazily("ddp") and not builds_lazily(None)


def test_architecture_builds_the_family_its_model_type_names(tiny_run):
    """`model_type: mixtral` builds a Mixtral (it used to build a LLaMA, the expert fields ignored);
    no model_type builds the same LLaMA, value for value, as LlamaForCausalLM did."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralForCausalLM

    from apps.llama.init_model import build_from_config
    from apps.llama.tokenizer_io import load_tokenizer

    cfg, _ = tiny_run
    tok = load_tokenizer(cfg.tokenizer.base)
    arch = dict(cfg.model.architecture)
    moe = build_from_config({**arch, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}, tok, 0)
    assert isinstance(moe, MixtralForCausalLM)
    assert moe.config.num_local_experts == 4 and moe.config.vocab_size == len(tok)

    llama = build_from_config(arch, tok, 3)
    torch.manual_seed(3)
    reference = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **arch))
    assert type(llama) is LlamaForCausalLM
    for (name, a), (_, b) in zip(llama.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("fields, message", [
    ({"model_type": "bert"}, "model type 'bert' is not supported"),
    ({"num_local_experts": 4}, r"\['num_local_experts'\] are not llama config fields"),
    ({"model_type": "mixtral", "hidden_sizes": 64}, r"\['hidden_sizes'\] are not mixtral config fields"),
])
def test_architecture_refuses_unknown_families_and_fields(tiny_run, fields, message):
    from apps.llama.init_model import build_from_config
    from apps.llama.tokenizer_io import load_tokenizer

    cfg, _ = tiny_run
    with pytest.raises(ValueError, match=message):
        build_from_config({**cfg.model.architecture, **fields}, load_tokenizer(cfg.tokenizer.base), 0)
