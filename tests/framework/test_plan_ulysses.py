"""phalanx.plan under Ulysses sequence parallelism (docs/plan.md): what Ulysses' attention keeps
beyond plain SDPA (o_proj's copied input; the repeated key and value where the key/value heads do
not divide by sp), checked by hand and against the tensors autograd saves on 4 gloo ranks, the
forward moment of the last layer's output all-to-all that can be the peak, and the estimate of an
attention-heavy Llama against its measured peak on 4 gloo ranks."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from phalanx.plan import Layout, load_spec
from phalanx.plan.memory import (ULYSSES_ALL_TO_ALL_COPIES, estimate_memory, layer_activation_bytes_per_token,
                                 loss_bytes_per_token, ulysses_forward_excess_bytes_per_token,
                                 sp_saved_extra_bytes_per_token)
from phalanx.plan.workload import Workload
from spawn_batch import spawn_suites

torch.set_num_threads(1)

# hidden 64, 4 heads of 16 (q 64), 2 key/value heads (kv 32)
LLAMA_HAND = dict(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
# attention-heavy: hidden 256, 4 heads of 128 (q = kv = 512), MLP 128, vocabulary 256 (test_plan_ring's MEASURED)
HEAVY = dict(vocab_size=256, hidden_size=256, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, head_dim=128, max_position_embeddings=1024, tie_word_embeddings=False)


def _uly(world=4, sp=2, **kw):
    return Layout("hybrid", world, sp=sp, sp_mode="ulysses", **kw)


# ---------------------------------------------------------------------------- by hand
def test_ulysses_saved_extra_by_hand():
    """fp32 (p = 4), hand Llama (q 64, kv 32 per token): under Ulysses sp 2 a layer saves o_proj's
    copied input, p·q = 256 bytes per token, beyond plain SDPA's layer (ring saves the same copy);
    with sp 4 the 2 key/value heads do not divide by sp, so the kernel saves the repeated key and
    value, q wide: + 2·4·(64 − 32) = 256; under tp 2 (2 heads, 1 key/value head per rank) on sp 2
    the repeat again: q 32, kv 16: 4·32 + 2·4·(32 − 16) = 256. LoRA without an o_proj adapter
    drops the copy (o_proj's weight takes no gradient). Catches: the copy left out, the repeat
    not counted or counted where the heads divide."""
    spec = load_spec(LLAMA_HAND)
    plain = layer_activation_bytes_per_token(spec, Layout("hybrid", 4, zero_stage=1), 4)
    assert layer_activation_bytes_per_token(spec, _uly(), 4) - plain == 4 * 64 == 256
    ring = Layout("hybrid", 4, sp=2, sp_mode="ring")
    assert layer_activation_bytes_per_token(spec, ring, 4) == layer_activation_bytes_per_token(spec, _uly(), 4)
    assert sp_saved_extra_bytes_per_token(spec, _uly(sp=4), 4) == 256 + 2 * 4 * (64 - 32)
    tp2 = layer_activation_bytes_per_token(spec, Layout("hybrid", 8, tp=2), 4)
    assert layer_activation_bytes_per_token(spec, _uly(world=8, tp=2), 4) - tp2 == 4 * 32 + 2 * 4 * (32 - 16)
    assert sp_saved_extra_bytes_per_token(spec, ring, 4) == 256  # the copy, no repeat
    assert sp_saved_extra_bytes_per_token(spec, dataclasses.replace(ring, world=8, sp=4), 4) == 256

    @dataclasses.dataclass(frozen=True)
    class Lora:
        rank: int = 8
        target_modules: tuple = ("q_proj", "v_proj")
        target_parameters: tuple = ()

    assert sp_saved_extra_bytes_per_token(spec, _uly(), 4, Lora()) == 0.0
    assert sp_saved_extra_bytes_per_token(spec, _uly(), 4, Lora(target_modules=("o_proj",))) == 256


def test_ulysses_forward_moment_by_hand():
    """The attention-heavy Llama, fp32, sp 2 on 4 ranks, 16 × 256 tokens (2048 per rank): during the
    last layer's output all-to-all the rank holds, beyond the activations at the start of backward,
    q, k, v as handed to attention p·(q + 2kv) = 6,144 and (4 − 1)·p·q = 6,144 for the exchange
    (4 tensors' worth on gloo; o_proj's copy, counted in the activations, is not made yet), less the
    layer's second norm 4·256 + 4 + 2·4·256 = 3,076, its MLP 4·4·128 = 2,048 and the final norm
    3,076: 4,088 bytes per token, above the loss' 12·V = 3,072: this moment is the peak, by 1,016
    bytes per token (2 MiB here). The quick-validation Llama (MLP 688, vocabulary 4096) has none: its MLP and
    loss outweigh the exchange. Catches: the moment left out (the estimate 2 MiB lower), added on
    top of the loss instead of taken as the larger, or counted with backward's buckets."""
    spec = load_spec(dict(HEAVY, model_type="llama"))
    work = Workload(seq=256, micro_batch=16, dtype="fp32", loss="hf")
    layout = _uly(zero_stage=1)
    x = ulysses_forward_excess_bytes_per_token(spec, layout, 4)
    assert ULYSSES_ALL_TO_ALL_COPIES == 4
    assert x == 4 * (512 + 2 * 512) + 3 * 4 * 512 - 3_076 - 4 * 4 * 128 - 3_076 == 4_088
    assert loss_bytes_per_token(spec, layout, work) == 3_072
    mem = estimate_memory(spec, layout, work)
    tokens = 2048
    assert mem.phase == "backward" and mem.device["buffers"] == tokens * 4_088
    assert mem.device["activations"] == mem.activations  # the loss' working set is not held then
    start_of_backward = mem.activations + mem.loss
    assert mem.device["activations"] + mem.device["buffers"] - start_of_backward == tokens * 1_016
    # ZeRO-2's buckets are backward's: at this moment they are not there
    z2 = estimate_memory(spec, dataclasses.replace(layout, zero_stage=2), dataclasses.replace(work, bucket_mb=0.25))
    assert z2.device["buffers"] == tokens * 4_088
    quick = load_spec(dict(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=688,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2))
    assert ulysses_forward_excess_bytes_per_token(quick, layout, 4) < 0
    assert estimate_memory(quick, layout, Workload(seq=512, micro_batch=2, dtype="fp32", loss="hf")).device["buffers"] == 0


# ---------------------------------------------------------------------------- on 4 gloo ranks
def _saved_per_token(fields: dict, seq: int, batch: int) -> float:
    """Rank body: bytes per token and layer that the decoder saves under Ulysses over all ranks
    (`apply_sp`), from `live_saved_bytes` of 2- and 1-layer models."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from phalanx.device import run_device, to_device
    from phalanx.sequence.apply import apply_sp
    from phalanx.shard import policy_for
    from phalanx.testing import live_saved_bytes

    out = {}
    for layers in (1, 2):
        torch.manual_seed(0)
        config = AutoConfig.for_model(fields["model_type"], attn_implementation="sdpa", num_hidden_layers=layers,
                                      **{k: v for k, v in fields.items() if k not in ("model_type", "num_hidden_layers")})
        model = AutoModelForCausalLM.from_config(config).to(run_device())  # the run's device (emulated GPU too)
        ids = to_device(torch.randint(0, config.vocab_size, (batch, seq // dist.get_world_size())))
        seq_ctx = apply_sp(model, policy_for(model), mode="ulysses", group=dist.group.WORLD)
        with seq_ctx.sharded_inputs():
            out[layers] = live_saved_bytes(model, ids)
    return (out[2] - out[1]) / ids.numel()


def _rank(saved_jobs, cases):
    from phalanx.plan.measure import measure_many

    from phalanx.device import emulated

    return {"saved": [_saved_per_token(*job) for job in saved_jobs], "measured": measure_many(cases),
            "emulated": emulated()}


SAVED_JOBS = {  # name: (model, seq, batch); Ulysses sp 4 over the 4 ranks
    "4 kv heads": (dict(LLAMA_HAND, num_key_value_heads=4), 32, 2),
    "2 kv heads (repeated)": (LLAMA_HAND, 32, 2),
}
U = dict(name="hybrid", sp_size=2, sequence_parallelism="ulysses", zero_stage=1, reduce_bucket_mb=1)
MEASURED_CASES = {  # name: (make_plugin kwargs, model, seq, micro batch per data rank)
    # head 64: the peak is the start of backward, o_proj's copy the term
    "hybrid sp2 ulysses zero1, head 64": (U, dict(HEAVY, head_dim=64), 256, 16),
    # head 128: the last layer's output all-to-all in forward is the peak
    "hybrid sp2 ulysses zero1, head 128": (U, HEAVY, 256, 16),
}


@pytest.fixture(scope="module")
def four_ranks(request):
    cases = [(dict(kw, precision="fp32"), model, seq, mb) for kw, model, seq, mb in MEASURED_CASES.values()]
    suite = (_rank, (list(SAVED_JOBS.values()), cases), {})
    return spawn_suites(request, 4, {"test_ulysses_saved_tensors_and_measured_peak": suite}, timeout=600)


def _errors(ranks) -> dict:
    """{case: estimate / measured - 1} of MEASURED_CASES (each with its own model), through the
    planner tests' shared `estimate_errors`; the layout must be the one measured."""
    from plan_measured import estimate_errors

    def ulysses_sp2(name, est):
        assert est.layout.sp_mode == "ulysses" and est.layout.sp == 2, name

    errors = {}
    for i, (name, (kwargs, model, seq, mb)) in enumerate(MEASURED_CASES.items()):
        errors.update(estimate_errors(model, {name: (kwargs, seq, mb)}, [[r["measured"][i]] for r in ranks], 4,
                                      ulysses_sp2))
    return errors


@pytest.mark.slow
def test_ulysses_saved_tensors_and_measured_peak(four_ranks, monkeypatch):
    """On 4 gloo ranks: (1) Ulysses sp 4 on the hand Llama saves per token and layer what the planner
    counts, exactly, with 4 key/value heads (o_proj's copy) and with 2 (the repeated key and value
    too); (2) dp 2 × Ulysses sp 2, ZeRO-1, 3 fp32 AdamW steps of the attention-heavy Llama with
    heads of 64 and of 128, 16 × 128 tokens per rank: the worst rank's peak above its baseline
    against the plan. Measured 2026-12-06 (docs/plan.md): head 64 73.1 MiB against 75.8-76.2
    (−3.9% to −4.0%; −9.1% before the terms), head 128 100.7 against 104.7-106.6 (−4.3% to −5.5%;
    −14.9% before).
    Head 64 within ±6%, and outside it without o_proj's copy (the mutant: the saved term → 0);
    head 128 within the planner's 15%, and further under without the forward moment (its mutant:
    the estimate then falls back to the start of backward, 2 MiB lower; −6.2% in the run above)."""
    ranks = four_ranks.get("test_ulysses_saved_tensors_and_measured_peak")
    if ranks[0]["emulated"]:  # the Ulysses forward ran on the (emulated) device on every rank
        assert all(r["saved"] == ranks[0]["saved"] and min(r["saved"]) > 0 for r in ranks), ranks
        pytest.skip("emulated GPU: SDPA takes torch's math path there and saves its scores (docs/testing.md), "
                    "and memory is not modelled: the exact counts and peaks are checked on the CPU")
    for i, (name, (fields, _, _)) in enumerate(SAVED_JOBS.items()):
        want = layer_activation_bytes_per_token(load_spec(fields), _uly(sp=4), 4)
        assert all(r["saved"][i] == want for r in ranks), (name, want, [r["saved"][i] for r in ranks])
    if "skip" in ranks[0]["measured"][0]:
        pytest.skip(ranks[0]["measured"][0]["skip"])
    errors = _errors(ranks)
    head64, head128 = errors.values()
    assert abs(head64) <= 0.06 and abs(head128) <= 0.15, errors
    import phalanx.plan.memory as memory

    monkeypatch.setattr(memory, "sp_saved_extra_bytes_per_token", lambda *a, **k: 0.0)
    no_copy = _errors(ranks)
    print("  without o_proj's copy:", no_copy)
    assert abs(list(no_copy.values())[0]) > 0.06, no_copy
    monkeypatch.undo()
    monkeypatch.setattr(memory, "ulysses_forward_excess_bytes_per_token", lambda *a, **k: 0.0)
    no_moment = _errors(ranks)
    print("  without the forward moment:", no_moment)
    assert list(no_moment.values())[1] < head128 < 0, no_moment  # under, and further under without it
