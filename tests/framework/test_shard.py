"""Shard specs, policies and the vocabulary-parallel loss, in one process (no ranks needed)."""
from __future__ import annotations

import pytest
import torch

import hybrid_models as hm
from phalanx.mesh import LayoutError
from phalanx.shard import ShardSpec, check_heads, policy_for, supported_families
from phalanx.shard.policy import HeadCounts
from phalanx.testing import check, rel_diff, rounding_rtol


@pytest.mark.parametrize("shape,spec,tp", [
    ((6, 4), ShardSpec(0), 2),
    ((6, 4), ShardSpec(1), 2),
    ((5, 3), ShardSpec(0, pad=True), 2),            # a vocabulary tp does not divide
    ((7, 2), ShardSpec(0, pad=True), 4),            # the last rank holds only padding rows
    ((4, 12), ShardSpec(1, (4, 4, 4)), 2),          # GPT-2's fused [q | k | v] (Conv1D: [in, out])
    ((12,), ShardSpec(0, (8, 2, 2)), 2),            # fused bias with fewer key/value heads
    ((2, 3, 8), ShardSpec(2, (4, 4)), 4),
])
def test_shard_unshard_and_runs_agree(shape, spec, tp):
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 1
    pieces = [spec.shard(full, r, tp) for r in range(tp)]
    assert all(p.shape == spec.local_shape(shape, tp) for p in pieces)
    assert torch.equal(spec.unshard(pieces, shape), full)
    covered = torch.zeros(full.numel())
    for r, piece in enumerate(pieces):
        flat = piece.reshape(-1)
        runs = spec.runs(shape, r, tp)
        real = torch.zeros(flat.numel(), dtype=torch.bool)
        for l_start, f_start, length in runs.pieces(0, flat.numel()):
            assert torch.equal(flat[l_start:l_start + length], full.reshape(-1)[f_start:f_start + length])
            covered[f_start:f_start + length] += 1
            real[l_start:l_start + length] = True
        assert bool((flat[~real] == 0).all()), "padding must be zeros"
        # any sub-range maps to the same elements
        lo, hi = flat.numel() // 3, flat.numel() - 1
        for l_start, f_start, length in runs.pieces(lo, hi):
            assert lo <= l_start and l_start + length <= hi
            assert torch.equal(flat[l_start:l_start + length], full.reshape(-1)[f_start:f_start + length])
    assert bool((covered == 1).all()), "every element of the full tensor belongs to exactly one rank"


def test_policies_cover_the_families_and_name_their_parts():
    assert supported_families() == ["deepseek_v2", "deepseek_v3", "gpt2", "llama", "mistral", "mixtral", "opt", "qwen2",
                                    "qwen2_moe", "qwen3", "qwen3_moe"]
    for family in hm.FAMILIES:
        model = hm.build(family)
        policy = policy_for(model)
        assert policy.family == family
        layers = policy.decoder_layers(model)
        assert len(layers) == 2
        assert model.get_submodule(policy.embedding) is model.get_input_embeddings()
        assert model.get_submodule(policy.head) is model.get_output_embeddings()
        model.get_submodule(policy.final_norm)
        for layer in layers:
            for path in (policy.out_proj, *policy.mlp_column, *policy.mlp_row,
                         *(p for p in (policy.q, policy.k, policy.v, policy.fused_qkv) if p)):
                layer.get_submodule(path)


def test_unknown_family_names_the_supported_ones():
    class Custom(torch.nn.Module):
        pass

    with pytest.raises(LayoutError, match="supports the families deepseek_v2, deepseek_v3, gpt2, llama, mistral, mixtral, opt, qwen2, qwen2_moe, qwen3, qwen3_moe"):
        policy_for(Custom())


def test_head_checks_carry_the_arithmetic():
    check_heads(HeadCounts(8, 2, 16), 4)   # split heads, replicate kv heads (2 | 4)
    check_heads(HeadCounts(8, 8, 16), 8)
    with pytest.raises(LayoutError, match=r"num_attention_heads=6 \(6 % 4 = 2\)"):
        check_heads(HeadCounts(6, 6, 16), 4)
    with pytest.raises(LayoutError, match=r"4 % 3 = 1"):
        check_heads(HeadCounts(12, 3, 16), 4)


def test_vocab_parallel_cross_entropy_one_rank_is_cross_entropy():
    from phalanx.shard.loss import CausalLMLoss

    logits = torch.randn(2, 5, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, 2] = -100
    ours = CausalLMLoss()(logits, labels, 11)
    theirs = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1))
    check(rel_diff(ours, theirs), rounding_rtol(torch.float32, 11), "vocab-parallel loss on one rank")  # 11 classes
