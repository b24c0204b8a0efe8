"""phalanx.plan: exact parameter counts, activation bytes against autograd's saved tensors, the
planner's arithmetic on hand-computed cases, its refusals, and its estimate against the measured
peak memory of real 2-rank training runs."""
from __future__ import annotations

import math

import pytest
import torch

from phalanx.plan import Layout, load_spec, plan
from phalanx.plan.cli import plan_main
from phalanx.plan.memory import estimate_memory, kv_cache_bytes_per_token, layer_activation_bytes_per_token
from phalanx.plan.planner import estimate_layout
from phalanx.plan.timing import estimate_time
from phalanx.plan.units import parse_bytes, parse_flops, parse_rate
from phalanx.plan.workload import Hardware, Workload

torch.set_num_threads(1)

# A hand-sized Llama: vocab 1000, hidden 64, MLP 128, 2 layers, 4 heads (MHA, head dim 16), untied.
HAND = dict(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
# embedding 64,000 + LM head 64,000 + final norm 64 + 2 layers × (q,k,v,o 4·64·64 = 16,384;
# gate, up, down 3·64·128 = 24,576; two norms 128) = 2 × 41,088
HAND_PARAMS = 64_000 + 64_000 + 64 + 2 * 41_088  # 210,240


def _meta_count(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------- the model's size
def test_parameter_count_equals_transformers_on_meta_device():
    from transformers import AutoConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    from phalanx.plan.model import PRESETS

    for name, fields in PRESETS.items():  # the mixtures of experts too (every expert counted)
        config = AutoConfig.for_model(fields["model_type"], **{k: v for k, v in fields.items() if k != "model_type"})
        assert load_spec(name).total_params() == _meta_count(config), name
    small = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    for config in (Qwen2Config(num_key_value_heads=2, **small),                     # q/k/v biases
                   Qwen3Config(num_key_value_heads=2, head_dim=32, **small),        # q/k norms, head_dim ≠ h/heads
                   MistralConfig(num_key_value_heads=1, **small),                   # GQA with one kv head
                   LlamaConfig(num_key_value_heads=2, tie_word_embeddings=True, attention_bias=True, mlp_bias=True, **small),
                   GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0)):
        assert load_spec(config).total_params() == _meta_count(config), type(config).__name__
    assert load_spec(HAND).total_params() == HAND_PARAMS
    # the published sizes
    assert round(load_spec("llama2-7b").total_params() / 1e9, 2) == 6.74
    assert round(load_spec("llama2-70b").total_params() / 1e9, 2) == 68.98
    assert round(load_spec("mixtral-8x7b").active_params() / 1e9, 1) == 12.9  # of 46.7B
    assert round(load_spec("qwen3-30b-a3b").active_params() / 1e9, 1) == 3.4  # "A3B": 3.35B of 30.5B


def test_model_from_directory_and_config_file(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(HAND))
    assert load_spec(tmp_path).total_params() == HAND_PARAMS
    assert load_spec(tmp_path / "config.json").total_params() == HAND_PARAMS
    with pytest.raises(ValueError, match="not a preset"):
        load_spec(tmp_path / "missing")
    (tmp_path / "bad.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ValueError, match="lacks vocab_size"):
        load_spec(tmp_path / "bad.json")


# ---------------------------------------------------------------------------- activations
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_activations_equal_autograd_saved_tensors(dtype):
    """The bytes autograd keeps for backward per decoder layer (distinct storages, parameters
    excluded), measured as the difference between a 2-layer and a 1-layer model, equal the
    formula exactly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    batch, seq = 2, 32
    saved = {}
    for layers in (1, 2):
        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
        model = LlamaForCausalLM(config).to(dtype)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.model(input_ids=torch.randint(0, 128, (batch, seq)))
        saved[layers] = sum(n for ptr, n in storages.items() if ptr not in params)
    per_token = (saved[2] - saved[1]) / (batch * seq)
    p = 4 if dtype == torch.float32 else 2
    assert layer_activation_bytes_per_token(load_spec(config), Layout("ddp", 1), p) == per_token


# A tiny DeepSeek (multi-head latent attention): 4 heads, q_lora_rank 24, kv_lora_rank 16, no-RoPE 8 +
# RoPE 8 query/key head width, v_head_dim 16 (equal to it, so CPU SDPA runs its flash kernel as a GPU
# would; with v ≠ qk head width CPU SDPA falls back to the math kernel, which keeps the attention matrix),
# 4 routed experts of 16, top-2, a shared expert of 32; DeepSeek-V3 routes within 2 groups.
MLA_FIELDS = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
                  q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=2)
MLA_FAMILIES = {"deepseek_v2": {}, "deepseek_v3": dict(n_group=2, topk_group=1)}


def _saved_bytes_per_token(model_type: str, fields: dict, dtype, batch: int = 2, seq: int = 32):
    """Bytes autograd saves for backward per token of one decoder layer (distinct storages still
    held by the output's graph, parameters excluded: `phalanx.testing.live_saved_bytes`): a
    2-layer model less a 1-layer one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from phalanx.testing import live_saved_bytes

    saved = {}
    for layers in (1, 2):
        config = AutoConfig.for_model(model_type, **dict(fields, num_hidden_layers=layers, attn_implementation="sdpa"))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).to(dtype)
        ids = torch.randint(0, fields["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))
        saved[layers] = live_saved_bytes(model, ids)
    return (saved[2] - saved[1]) / (batch * seq), config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type", list(MLA_FAMILIES))
def test_mla_layer_activations_equal_autograd_saved_tensors(model_type, dtype):
    """DeepSeek's latent attention (the q/kv down projections' norms, the expanded keys and values,
    SDPA's tensors, o_proj's copied input) in dense layers: equal to what autograd keeps, with and
    without q_lora_rank. In expert layers the expert block's estimate is short by the routing's
    8.25 bytes per token, as for Mixtral and Qwen2-MoE (test_plan_moe.py; the bound allows 12); the
    bf16 model's router also keeps an fp32 copy of its weight, per layer rather than per token
    (taken out here)."""
    p = 4 if dtype == torch.float32 else 2
    fields = dict(MLA_FIELDS, **MLA_FAMILIES[model_type])
    for extra in ({}, dict(q_lora_rank=None)):
        got, config = _saved_bytes_per_token(model_type, dict(fields, first_k_dense_replace=2, **extra), dtype)
        spec = load_spec(config)
        assert spec.mla and not spec.is_moe
        assert layer_activation_bytes_per_token(spec, Layout("ddp", 1), p) == got, (extra, got)
    got, config = _saved_bytes_per_token(model_type, dict(fields, first_k_dense_replace=0), dtype)
    spec = load_spec(config)
    router_copy = 0 if p == 4 else 4 * spec.num_experts * spec.hidden_size / (2 * 32)
    est = layer_activation_bytes_per_token(spec, Layout("ddp", 1), p)
    assert spec.is_moe and 0 <= got - router_copy - est <= 12, (est, got)


def test_kv_cache_per_token_counts_mla_latent_like_transformers_cache():
    """Serving's KV cache per token: DeepSeek-V2/V3 cache the compressed latent (kv_lora_rank +
    qk_rope_head_dim per layer), as transformers' own cache does after a forward, not every head's
    keys and values; other families cache their key/value heads, split over tp; both as the
    inference engine's paged cache holds them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from phalanx.inference.llama import kv_bytes_per_block

    llama = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    cases = [(m, dict(MLA_FIELDS, **extra)) for m, extra in MLA_FAMILIES.items()] + [("llama", llama)]
    for model_type, fields in cases:
        config = AutoConfig.for_model(model_type, **dict(fields, num_hidden_layers=2))
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
        with torch.no_grad():
            cache = model(input_ids=torch.randint(0, 128, (2, 10)), use_cache=True).past_key_values
        held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        assert kv_cache_bytes_per_token(load_spec(config), 1, 2) == held / 20, model_type
    mla = load_spec(dict(MLA_FIELDS, model_type="deepseek_v2", num_hidden_layers=2, first_k_dense_replace=1))
    assert kv_cache_bytes_per_token(mla, 1, 2) == 2 * (16 + 8) * 2  # not 2 · 4 heads · (16 + 16) · 2 = 512
    assert kv_cache_bytes_per_token(mla, 4, 2) == 2 * (16 + 8) * 2  # the latent is whole on every tp rank
    spec = load_spec(dict(llama, model_type="llama", num_hidden_layers=2))
    for tp in (1, 2, 4):  # 2 KV heads: split over 2, replicated (one per rank) over 4; the engine's latent whole
        assert kv_cache_bytes_per_token(spec, tp, 2) * 16 == kv_bytes_per_block(spec, 16, tp, torch.bfloat16)
        assert kv_cache_bytes_per_token(mla, tp, 2) * 16 == kv_bytes_per_block(mla, 16, tp, torch.bfloat16)
    assert kv_cache_bytes_per_token(load_spec("deepseek-v2-lite"), 1, 2) == 27 * (512 + 64) * 2
    # and training FLOPs under latent attention: causal QKᵀ over the query/key width, AV over the value width
    from phalanx.plan.timing import training_flops_per_token

    lite = load_spec("deepseek-v2-lite")  # 16 heads, query/key 192, value 128
    assert training_flops_per_token(lite, 4096, False) == 6 * lite.matmul_params() + 6 * 27 * 4096 * 16 * (192 + 128) / 2


# ---------------------------------------------------------------------------- memory arithmetic
def test_memory_terms_by_hand():
    spec = load_spec(HAND)
    n = HAND_PARAMS
    fp32, bf16 = Workload(seq=8, micro_batch=1, dtype="fp32", loss="hf"), Workload(seq=8, micro_batch=1, dtype="bf16")

    # DDP, bf16: bf16 weights and DDP's bf16 gradient buckets; fp32 masters + two Adam moments
    ddp = estimate_memory(spec, Layout("ddp", 4), bf16)
    assert ddp.device["parameters"] == 2 * n == 420_480
    assert ddp.device["gradients"] == 2 * n
    assert ddp.device["optimizer"] == 12 * n == 2_522_880

    # ZeRO-2, fp32, 4 ranks: the moments of ceil(210,240 / 4) = 52,560 elements (the fp32
    # master is the rank's own slice of the parameters)
    z2 = estimate_memory(spec, Layout("zero", 4, zero_stage=2), fp32)
    assert z2.device["optimizer"] == 8 * 52_560 == 420_480
    assert z2.device["parameters"] == 4 * n
    # ...moved to the host with offload, with a separate master shard and the fp32 gradient shard
    z2o = estimate_memory(spec, Layout("zero", 4, zero_stage=2, offload_optim=True), fp32)
    assert z2o.device["optimizer"] == 0 and z2o.host["optimizer"] == 630_720 and z2o.host["gradients"] == 210_240

    # FSDP, fp32, 2 ranks: sharded parameters 4 × 105,120 and moments 8 × 105,120
    fsdp = estimate_memory(spec, Layout("fsdp", 2), fp32)
    assert fsdp.device["parameters"] == 420_480 and fsdp.device["optimizer"] == 840_960
    # ...backward's peak, root R = 128,064 (embedding, head, norm), block B = 41,088, 8 tokens:
    # the blocks' gradient shards 4·41,088 = 164,352 (more than the layers' activations
    # 8·(2·4,632 + 908) = 81,376; the root's shard is made after its reduce) under the root gathered
    # 4R = 512,256, the head's whole gradient 4·1000·64 = 256,000, two blocks gathered 8B = 328,704,
    # one block's gradients + fp32 reduce input 8B = 328,704, the pending block's all-to-all
    # receive buffer (gloo; two ranks: only the other rank's copy) 2B = 82,176: 1,507,840. The
    # start of backward (activations + loss 177,376 + 4R + 8B = 1,018,336) and its end (164,352 +
    # 4R + max(4R + 6B, 4R) = 1,435,392; the root's reduce is in place) are smaller; so is the
    # step (420,480 + Adam's temporaries of half the embedding 8·32,000 = 676,480).
    assert fsdp.phase == "backward"
    assert fsdp.device["gradients"] == 164_352 and fsdp.device["activations"] == 0
    assert fsdp.device["buffers"] == 512_256 + 256_000 + 328_704 + 328_704 + 82_176 == 1_507_840
    assert fsdp.device_total == 420_480 + 840_960 + 164_352 + 1_507_840

    # activations, fp32, 8 tokens, hf loss. Per layer and token: two norms 2·(4·64 + 4 + 8·64) =
    # 1,544; attention 4·(64 + 64 + 64 + 64) + 4·4 heads = 1,040; MLP 4·4·128 = 2,048 → 4,632.
    # Outside the layers per token: final norm 772 + ids 8 + RoPE cos/sin 2·4·16 = 908.
    # Loss: fp32 log-softmax output, its gradient, the logits' gradient: 3·4·1000 = 12,000 per token.
    expected = 8 * (2 * 4_632 + 908) + 8 * 12_000  # 177,376
    ddp32 = estimate_memory(spec, Layout("ddp", 1), fp32)
    assert ddp32.activations + ddp32.loss == expected == 177_376
    assert ddp32.loss == 96_000
    # checkpointing keeps each layer's input (4·64 per token) and one layer's activations
    ckpt = estimate_memory(spec, Layout("ddp", 1, checkpointing=True), fp32)
    assert ckpt.activations == 8 * (2 * 256 + 4_632 + 908)

    # tensor parallel 2: heads and MLP halved, norms whole: 1,544 + (4·(32·4) + 4·2) + 1,024 = 3,088
    assert layer_activation_bytes_per_token(spec, Layout("hybrid", 2, tp=2), 4) == 1_544 + 520 + 1_024


def test_pipeline_stage_and_in_flight_microbatches():
    spec = load_spec(dict(HAND, num_hidden_layers=4))
    work = Workload(seq=8, micro_batch=1, global_batch=8, dtype="fp32", loss="fused")
    # pp=2 over 2 ranks, dp=1: 8 microbatches; 1F1B keeps pp=2 in flight on the first stage, GPipe all 8
    one = estimate_memory(spec, Layout("hybrid", 2, pp=2, zero_stage=1), work, microbatches=8)
    gpipe = estimate_memory(spec, Layout("hybrid", 2, pp=2, zero_stage=1, pp_schedule="gpipe"), work, microbatches=8)
    per_microbatch = 8 * (2 * 4_632 + 908)  # 2 layers on the stage
    assert one.activations == 2 * per_microbatch
    assert gpipe.activations == 8 * per_microbatch
    # stage parameters: first stage = embedding + 2 layers (64,000 + 82,176); last = 2 layers + head + norm (146,240)
    assert one.device["parameters"] == 4 * 146_240


# ---------------------------------------------------------------------------- time arithmetic
def test_step_time_by_hand():
    spec = load_spec(HAND)
    hw = Hardware(device_memory=2**40, peak_flops=1e12, efficiency=0.5, bandwidth=1e9)
    work = Workload(seq=8, micro_batch=1, dtype="bf16")
    t = estimate_time(spec, Layout("ddp", 4), work, hw, microbatches=1)
    # 6 × (layers 82,176 + head 64,000) + 6 × 2 layers × 8 seq × 64 q_dim per token, 4 × 8 tokens
    flops = 32 * (6 * 146_176 + 6 * 2 * 8 * 64)
    assert math.isclose(t.compute, flops / 4 / 0.5e12)
    # DDP all-reduces 2 × 3/4 × 2 bytes × 210,240; backward (2/3 of compute) hides part of it
    assert math.isclose(t.dp_comm, 2 * 0.75 * 2 * HAND_PARAMS / 1e9 - t.compute * 2 / 3)
    # the pipeline bubble: (pp − 1) / (m + pp − 1) of the step, pp = 2, m = 4
    spec4 = load_spec(dict(HAND, num_hidden_layers=4))
    tp = estimate_time(spec4, Layout("hybrid", 2, pp=2, zero_stage=1), Workload(seq=8, micro_batch=1, global_batch=4),
                       hw, microbatches=4)
    assert math.isclose(tp.bubble / (tp.compute + tp.bubble), 1 / 5)
    # activation checkpointing: 8/6 of the compute
    tc = estimate_time(spec, Layout("ddp", 4, checkpointing=True), work, hw, microbatches=1)
    assert math.isclose(tc.compute / t.compute, 8 / 6)


# ---------------------------------------------------------------------------- refusals and the CLI
def test_refusals_name_the_memory_and_its_parts():
    estimates = {e.name: e for e in plan("llama2-70b", 8, "80GiB")}
    ddp = estimates["ddp"]
    assert not ddp.fits
    # bf16 DDP of 68.98B parameters: masters + moments 12 bytes each = 771 GiB
    assert "of 80 GiB device memory" in ddp.reason and "optimizer 771 GiB" in ddp.reason, ddp.reason
    need = float(ddp.reason.split("needs ")[1].split(" GiB")[0])
    assert need == pytest.approx(ddp.memory.device_total / 2**30 + 2, rel=1e-2)  # + the 2 GiB reserve
    # layouts that cannot be built say why
    six = {e.name: e for e in plan("llama2-7b", 6, "80GiB")}
    assert "tp_size=3 does not divide num_attention_heads=32 (32 % 3 = 2)" in six["hybrid tp3 zero1"].reason
    pipe = estimate_layout(load_spec("llama2-7b"), Layout("hybrid", 4, pp=4, zero_stage=1), Workload(seq=2048),
                           Hardware(device_memory=2**40))
    assert "needs at least pp=4 microbatches" in pipe.reason
    with pytest.raises(ValueError, match="80 gigs.*80GiB"):
        parse_bytes("80 gigs", "device_memory")
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_rate("200GB/s") == 200e9 and parse_flops("989TFLOPS") == 989e12


def test_plan_ranks_fitting_layouts_by_throughput_and_cli_prints_them(capsys):
    for global_batch in (16, None):  # without one, layouts with more data parallelism do more per step
        estimates = plan("llama2-7b", 8, "80GiB", global_batch=global_batch)
        fitting = [e for e in estimates if e.fits]
        assert fitting and all(e.fits for e in estimates[:len(fitting)])
        rates = [float(f"{e.time.tokens_per_s:.3g}") for e in fitting]
        assert rates == sorted(rates, reverse=True)
    assert plan_main(["--model", "llama2-7b", "--world-size", "8", "--device-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "Recommended:" in out and "Rejected" in out and "needs" in out
    # the serving KV cache under the header: 32 layers × 2 × 32 KV heads × 128 × 2 bytes = 512 KiB per token
    assert "serving KV cache (bf16): 512.0 KiB per token, 1 GiB per 2048-token sequence" in out
    assert plan_main(["--model", "deepseek-v2-lite", "--world-size", "8", "--device-memory", "80GiB", "--seq", "4096",
                      "--show", "1"]) == 0
    # 27 layers × (512 + 64) × 2 bytes: the latent, 8.9× less than 16 heads' keys (192) and values (128)
    assert ("serving KV cache (bf16): 30.4 KiB per token, 122 MiB per 4096-token sequence: latent kv_lora_rank 512 "
            "+ rope 64 per layer (multi-head latent attention; 16 heads' keys and values would take 8.9×)"
            in capsys.readouterr().out)
    # Gemini with everything offloaded fits 70B in 24 GiB of device memory, given 1.1 TiB of host memory
    assert plan_main(["--model", "llama2-70b", "--world-size", "1", "--device-memory", "24GiB"]) == 0
    assert "Recommended: gemini offload optim offload params ckpt" in capsys.readouterr().out
    assert plan_main(["--model", "llama2-70b", "--world-size", "1", "--device-memory", "24GiB",
                      "--host-memory", "512GiB"]) == 1
    out = capsys.readouterr().out
    assert "No layout fits" in out and "of 512 GiB host memory" in out
    assert plan_main(["--model", "nope", "--world-size", "1", "--device-memory", "24GiB"]) == 2
    assert "not a preset" in capsys.readouterr().err


# ---------------------------------------------------------------------------- beside a run
def test_estimate_for_run_reads_the_plugin_and_the_train_config():
    from phalanx.booster.plugins import make_plugin
    from phalanx.plan import estimate_for_run, estimate_vs_measured
    from phalanx.testing import tiny_llama_config
    from phalanx.train import TrainConfig

    config = tiny_llama_config()
    z = estimate_for_run(config, make_plugin("zero1", cpu_offload=True, reduce_bucket_mb=1), 16, 4, 2)
    assert z.name == "zero1 offload optim" and z.memory.host_total > 0
    cfg = TrainConfig(output_dir="unused", plugin="hybrid", micro_batch_size=4,
                      plugin_options={"tp_size": 2, "pp_size": 2, "num_microbatches": 2})
    h = estimate_for_run(config, cfg, 16, 4, 4)
    assert h.name == "hybrid tp2+pp2 1f1b" and h.microbatches == 2 and h.fits
    g = estimate_for_run(config, make_plugin("gemini", placement_policy="static", chunk_size_mb=1,
                                             offload_optim_frac=1.0), 16, 4, 2)
    assert g.name == "gemini offload optim"
    line = estimate_vs_measured(z, z.memory.device_total / 1.1)
    assert "+10.0%" in line and "zero1 offload optim" in line
    with pytest.raises(ValueError, match="does not know plugin"):
        estimate_for_run(config, object(), 16, 4, 2)


# ---------------------------------------------------------------------------- against measured runs
MEASURED_MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
MEASURED_CASES = {  # layout -> (make_plugin arguments, seq, micro batch)
    "ddp": (dict(name="ddp"), 128, 2),
    "zero2": (dict(name="zero2", reduce_bucket_mb=1), 128, 2),
    "fsdp": (dict(name="fsdp"), 128, 2),
    "gemini": (dict(name="gemini", placement_policy="static", chunk_size_mb=1), 128, 2),
    "hybrid tp2 zero1": (dict(name="hybrid", tp_size=2, zero_stage=1), 128, 2),
}


@pytest.mark.slow
def test_estimate_within_15_percent_of_measured_peak():
    """2 gloo ranks, 3 fp32 AdamW steps of a 5M-parameter Llama per layout; the worst rank's
    peak resident memory above its baseline against the plan. 15%: the issue's target; what
    the estimate leaves out here (allocator rounding, gloo buffers, Python objects) is a few MiB
    against 80–110 MiB."""
    from transformers import LlamaConfig

    from phalanx.booster.plugins import make_plugin
    from phalanx.plan import estimate_for_run
    from phalanx.plan.measure import measure_many
    from phalanx.testing import spawn

    cases = [(dict(kw, precision="fp32"), MEASURED_MODEL, seq, mb) for kw, seq, mb in MEASURED_CASES.values()]
    ranks = spawn(measure_many, 2, cases, timeout=300)
    if "skip" in ranks[0][0]:
        pytest.skip(ranks[0][0]["skip"])
    errors = {}
    for i, (name, (kwargs, seq, mb)) in enumerate(MEASURED_CASES.items()):
        kwargs = dict(kwargs)
        plugin = make_plugin(kwargs.pop("name"), precision="fp32", **kwargs)
        est = estimate_for_run(LlamaConfig(**MEASURED_MODEL), plugin, seq, mb, 2, loss="hf").memory.device_total
        measured = max(r[i]["anon"] for r in ranks)
        errors[name] = est / measured - 1
        # same losses on both ranks' views is not the point here; training must have run
        assert all(math.isfinite(x) for r in ranks for x in r[i]["losses"])
    assert all(abs(e) <= 0.15 for e in errors.values()), errors


# ---------------------------------------------------------------------------- mixtures of experts
# HAND as a Mixtral: 4 experts of width 32, top-2. Per layer: q,k,v,o 16,384; router 4·64 = 256;
# experts 4 × 3·64·32 = 24,576 (one token uses 2: 12,288); two norms 128.
MOE_HAND = dict(HAND, model_type="mixtral", intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
MOE_TOTAL = 64_000 + 64_000 + 64 + 2 * (16_384 + 256 + 24_576 + 128)  # 210,752
MOE_ACTIVE = 64_000 + 64_000 + 64 + 2 * (16_384 + 256 + 12_288 + 128)  # 186,176


def test_moe_memory_counts_every_expert_and_compute_the_active_ones(capsys):
    from transformers import MixtralConfig

    from phalanx.plan.memory import local_model
    spec = load_spec(MOE_HAND)
    assert spec.total_params() == MOE_TOTAL == _meta_count(MixtralConfig(**{k: v for k, v in MOE_HAND.items()
                                                                               if k != "model_type"}))
    assert spec.active_params() == MOE_ACTIVE
    work, hw = Workload(seq=8, micro_batch=1, dtype="bf16"), Hardware(device_memory=2**40, peak_flops=1e12,
                                                                      efficiency=0.5, bandwidth=1e9)
    # memory: every expert, on every rank (ddp) and whole on every tp rank (attention and vocab split)
    dense = estimate_memory(load_spec(HAND), Layout("ddp", 4), work, microbatches=1)
    moe = estimate_memory(spec, Layout("ddp", 4), work, microbatches=1)
    assert moe.device["parameters"] * HAND_PARAMS == dense.device["parameters"] * MOE_TOTAL
    assert local_model(spec, Layout("hybrid", 2, tp=2)).params == 32_000 * 2 + 64 + 2 * (8_192 + 256 + 24_576 + 128)
    # compute: 6 × (active layers 58,112 + head 64,000) + attention, 4 × 8 tokens; DDP moves every gradient
    t = estimate_time(spec, Layout("ddp", 4), work, hw, microbatches=1)
    assert math.isclose(t.compute, 32 * (6 * 122_112 + 6 * 2 * 8 * 64) / 4 / 0.5e12)
    assert math.isclose(t.dp_comm, 2 * 0.75 * 2 * MOE_TOTAL / 1e9 - t.compute * 2 / 3)
    # tp2: an expert layer has attention's all-reduces only, 2 per layer (1 forward, 1 backward) of
    # 8 tokens × 64 × 2 bytes, ring factor 1/2, 2 layers
    t2 = estimate_time(spec, Layout("hybrid", 2, tp=2), work, hw, microbatches=1)
    assert math.isclose(t2.tp_comm, 2 * 2 * 2 * 0.5 * 8 * 64 * 2 / 1e9)
    plan_main(["--model", "mixtral-8x7b", "--world-size", "8", "--device-memory", "80GiB"])
    assert "mixtral-8x7b (46.7B parameters, 12.9B active: 8 experts, top-2)" in capsys.readouterr().out


def test_moe_dense_and_sparse_layers_are_counted_apart():
    """Qwen3-MoE with layer 0 dense (mlp_only_layers): memory sums the layers as they are; a
    pipeline stage is sized by the largest layer."""
    from phalanx.plan.memory import local_model
    config = dict(HAND, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  head_dim=16, mlp_only_layers=[0], decoder_sparse_step=1)
    spec = load_spec(config)
    attention = 16_384 + 2 * 16 + 128  # + q/k norms + the two layer norms
    dense_layer, sparse_layer = attention + 24_576, attention + 256 + 24_576
    assert local_model(spec, Layout("ddp", 1)).params == 128_064 + dense_layer + sparse_layer == spec.total_params()
    assert local_model(spec, Layout("hybrid", 2, pp=2)).layer == sparse_layer
