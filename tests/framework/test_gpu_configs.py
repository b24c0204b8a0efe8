"""The GPU-sized recipe configs plan, and shard at their real size without memory.

One config per recipe, sized for real hardware (docs/plan.md, "GPU-sized configs"):

| config | hardware | checked by |
|---|---|---|
| apps/llama/configs/llama3_8b_8xh100.yaml | 8 x 80 GiB | `phalanx plan` (fsdp) + FSDP2 on the meta device |
| apps/chat_rlhf/configs/grpo_gsm8k_qwen7b_8xh100.yaml | 8 x 80 GiB | `phalanx plan` (hybrid tp2 zero2 ckpt) + engine + apply_tp |
| apps/video_gen/configs/stage1_t2i_8xh100.yaml | 8 x 80 GiB | training state of the meta model + FSDP2 |
| apps/protein/configs/alphafold2_dap4_4xh100.yaml | 4 x 80 GiB | training state of the meta model + DAP groups |
| apps/diffusion/configs/sd15_finetune_1x24gb.yaml | 1 x 24 GiB | training state of the meta UNet (+ frozen parts) |

Each model is built on the meta device at full size (no weights, no memory); the fake-world cases
start torch's `fake` process group (every collective a no-op) with the configured world size, set
the plugin up (its own mesh / groups) and shard the meta model the way the plugin's
`configure_model` does, then check every parameter's local shape. `phalanx plan` models
decoder-only LMs (Llama/Qwen/Mistral/GPT-2) only: for the video DiT, AlphaFold and the SD UNet the
test bounds the training state (parameters, gradients, AdamW, masters) from the meta model's
parameter count instead, and activations are NOT modelled there (stated per test).
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30
RESERVE = 2 * GiB  # `phalanx plan --reserve`: CUDA context, NCCL, fragmentation
HEADROOM = 0.10

LLAMA3_8B_VOCAB = 128256  # the tokenizer's size (model.architecture may not set it)
QWEN25_7B = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584,
                 intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                 max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                 torch_dtype="bfloat16")
# stable-diffusion-v1-5/unet/config.json, text_encoder (CLIP ViT-L/14 text) and vae sizes
SD15_UNET = dict(sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
                 block_out_channels=(320, 640, 1280, 1280),
                 down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
                 cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32)
SD15_VAE = dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, sample_size=512,
                block_out_channels=(128, 256, 512, 512),
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4)
SD15_TEXT = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                 num_attention_heads=12, max_position_embeddings=77)


def headroom(need_bytes: float, device_bytes: float) -> float:
    return 1.0 - need_bytes / device_bytes


def report(name: str, layout: str, need: float, device: float) -> None:
    print(f"{name}: {layout}: {need / GiB:.1f} GiB of {device / GiB:.0f} GiB per rank "
          f"(reserve included), headroom {headroom(need, device):.1%}")


@pytest.fixture
def fake_world(monkeypatch):
    """`start(world)`: torch's fake process group of `world` ranks (this process is rank 0), with
    phalanx.launch.context() answering a CPU context so that plugins' `setup()` builds their
    meshes on it; destroyed at the end of the test."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    launch_module = importlib.import_module("phalanx.launch")  # phalanx.launch the attribute is the function
    monkeypatch.setattr(launch_module, "context", lambda: SimpleNamespace(device=torch.device("cpu")))

    def start(world: int) -> None:
        if dist.is_initialized():  # an earlier test's one-rank group in this pytest process
            import phalanx

            phalanx.shutdown()  # phalanx.launch.context() launches a fresh one when next asked
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def gpu_train(train):
    """The TrainConfig as it resolves on a GPU: precision auto -> bf16 (this CPU may say fp32)."""
    return dataclasses.replace(train, precision="bf16" if train.precision == "auto" else train.precision)


def fsdp_shard_meta(plugin, model) -> None:
    """FSDPPlugin.configure_model's sharding (its block rule, mesh and mixed-precision policy) on a
    meta model: configure_model itself would materialise the shards."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from phalanx.booster.plugins.fsdp import transformer_blocks

    kwargs = {"mesh": plugin.mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                     reduce_dtype=torch.float32)}
    blocks = transformer_blocks(model)
    assert blocks, "no blocks to shard"
    for block in reversed(blocks):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def check_fsdp_shards(model, world: int, *, exact: bool) -> int:
    """Every parameter a DTensor sharded on dim 0 with ceil(rows / world) local rows (FSDP2 pads the
    last ranks); `exact`: every dim 0 divisible by world. Returns the full parameter count."""
    from torch.distributed.tensor import DTensor, Shard

    total = 0
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), name
        full, local = tuple(p.shape), tuple(p.to_local().shape)
        assert local[0] == math.ceil(full[0] / world) and local[1:] == full[1:], (name, full, local)
        if exact:
            assert full[0] % world == 0, (name, full)
        total += p.numel()
    return total


# ------------------------------------------------------------------------------ LLaMA-3-8B
def test_llama3_8b_fsdp_on_8x80gib(fake_world):
    """LLaMA-3-8B continual pre-training, fsdp, 8 x 80 GiB, 8192 tokens per rank: planned by
    `phalanx plan`'s estimate for the configured layout (>= 10% headroom), the planner's own
    recommendation printed; then FSDP2 over 8 fake ranks on the meta model: every weight split
    exactly 8 ways (dim 0 of every matrix, the 128,256-row embedding and head included)."""
    from transformers import LlamaConfig

    from apps.llama.config import load_recipe
    from phalanx import lazy
    from phalanx.booster.plugins import make_plugin
    from phalanx.plan import estimate_for_run, load_spec, plan

    cfg = load_recipe(ROOT / "apps/llama/configs/llama3_8b_8xh100.yaml")
    config = dict(model_type="llama", vocab_size=LLAMA3_8B_VOCAB, **cfg.model.architecture)
    spec = load_spec(config)
    assert spec.total_params() == load_spec("llama3-8b").total_params() == 8_030_261_248
    world, device = 8, 80 * GiB
    train = gpu_train(cfg.train)
    est = estimate_for_run(config, train, seq=cfg.data.seq_len, micro_batch=train.micro_batch_size, world=world)
    need = est.memory.device_total + RESERVE
    report("llama3-8b", est.name, need, device)
    assert est.name == "fsdp" and headroom(need, device) >= HEADROOM
    best = next(e for e in plan(config, world, "80GiB", seq=cfg.data.seq_len, micro_batch=train.micro_batch_size)
                if e.fits)
    print(f"  planner's choice: {best.name} {best.layout.plugin_options()}, "
          f"{best.memory.device_total / GiB:.1f} GiB per rank")

    fake_world(world)
    plugin = make_plugin(train.plugin, train.precision, None, **train.plugin_options)
    plugin.setup()
    model = lazy.from_config(LlamaConfig(**config))
    fsdp_shard_meta(plugin, model)
    assert check_fsdp_shards(model, world, exact=True) == spec.total_params()
    q = model.model.layers[0].self_attn.q_proj.weight
    assert tuple(q.to_local().shape) == (512, 4096)
    assert tuple(model.lm_head.weight.to_local().shape) == (LLAMA3_8B_VOCAB // 8, 4096)


# ------------------------------------------------------------------------------ Qwen2.5-7B GRPO
def test_grpo_qwen25_7b_hybrid_tp2_on_8x80gib(fake_world, tmp_path):
    """GRPO of a Qwen2.5-7B-class policy (config.json only, in tmp_path) on GSM8K: hybrid tp2 x dp4,
    ZeRO-2, activation checkpointing; 2 prompts x 8 samples = 16 sequences of up to
    engine.max_model_len tokens per replica. Memory = the planner's estimate for that layout + what
    the planner does not model, counted here: the colocated rollout engine's own fp32 copy of the
    weights split over tp (RolloutEngine.build uses dtype="float32") and its KV-cache budget; >= 10%
    headroom. Then apply_tp (the hybrid plugin's step 2) on the meta model over the plugin's tp
    group of a fake 8-rank world: heads, KV heads (4 over 2), MLP and vocabulary split in two."""
    from transformers import Qwen2Config

    from apps.chat_rlhf.grpo import load_grpo_config, rollout_tp_size
    from phalanx import lazy
    from phalanx.booster.plugins import make_plugin
    from phalanx.plan import estimate_for_run, load_spec
    from phalanx.shard import apply_tp, policy_for

    model_dir = tmp_path / "qwen2.5-7b"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(QWEN25_7B))
    cfg = load_grpo_config(str(ROOT / "apps/chat_rlhf/configs/grpo_gsm8k_qwen7b_8xh100.yaml"), [f"model={model_dir}"])
    spec = load_spec(model_dir)
    assert spec.total_params() == 7_615_616_512  # Qwen2.5-7B
    world, device = 8, 80 * GiB
    train = gpu_train(cfg.train)
    tp = rollout_tp_size(train)
    assert tp == 2
    sequences = train.micro_batch_size * cfg.grpo.num_generations
    est = estimate_for_run(model_dir, train, seq=cfg.engine.max_model_len, micro_batch=sequences, world=world)
    engine_weights = 4 * spec.total_params() / tp
    need = est.memory.device_total + engine_weights + cfg.engine.kv_cache_memory_gib * GiB + RESERVE
    report("grpo qwen2.5-7b", f"{est.name} + engine fp32/tp + KV {cfg.engine.kv_cache_memory_gib} GiB", need, device)
    print(f"  planner (training only): {est.memory.device_total / GiB:.1f} GiB; engine weights "
          f"{engine_weights / GiB:.1f} GiB")
    assert est.name == "hybrid tp2 zero2 ckpt" and headroom(need, device) >= HEADROOM
    # the KV budget holds a full batch of sequences: 2 (k, v) x layers x local kv heads x head_dim x fp32
    per_token = 2 * 28 * (4 // tp) * 128 * 4
    assert cfg.engine.max_num_seqs * cfg.engine.max_model_len * per_token <= cfg.engine.kv_cache_memory_gib * GiB

    fake_world(world)
    plugin = make_plugin(train.plugin, train.precision, None, **train.plugin_options)
    plugin.setup()
    assert (plugin.parallel.tp, plugin.parallel.dp) == (2, 4)
    config = Qwen2Config(**{k: v for k, v in QWEN25_7B.items() if k not in ("model_type", "architectures")})
    model = lazy.from_config(config)
    tp_plan = apply_tp(model, policy_for(model), group=plugin.tp_group)
    layer = model.model.layers[0]
    expect = {"self_attn.q_proj.weight": (1792, 3584), "self_attn.q_proj.bias": (1792,),
              "self_attn.k_proj.weight": (256, 3584), "self_attn.v_proj.weight": (256, 3584),
              "self_attn.o_proj.weight": (3584, 1792), "mlp.gate_proj.weight": (9472, 3584),
              "mlp.up_proj.weight": (9472, 3584), "mlp.down_proj.weight": (3584, 9472),
              "input_layernorm.weight": (3584,)}
    got = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    for name, shape in expect.items():
        assert got[name] == shape, (name, got[name])
    assert tuple(model.model.embed_tokens.weight.shape) == (152064 // 2, 3584)
    assert tuple(model.lm_head.weight.shape) == (152064 // 2, 3584)
    # the split parameters hold 1/tp of their full size on this rank, the rest is whole
    local = sum(p.numel() for p in model.parameters())
    split = sum(math.prod(s.full_shape) for s in tp_plan.params.values() if s.spec.is_sharded)
    assert local == spec.total_params() - split + split // tp
    assert all(p.is_meta for p in model.parameters())


# ------------------------------------------------------------------------------ video DiT
def test_video_stage1_1b_fsdp_on_8x80gib(fake_world):
    """Open-Sora-style stage 1 (text-to-image) with a Wan-2.1-1.3B-sized transformer, fsdp over 8 x
    80 GiB. The planner does not model a video DiT: the bound here is the FSDP training state from
    the meta model's parameter count (fp32 sharded masters, gradients and AdamW moments, 16 B/N per
    parameter) + one bf16 copy of the whole transformer (a generous bound on the gathered blocks)
    + the frozen Wan VAE (~127 M, fp32) + reserve, >= 10% headroom; the activations of 32 images x
    256 tokens with checkpointing are NOT modelled (what is left is their budget, printed). FSDP2
    over 8 fake ranks: every transformer parameter split on dim 0, the blocks' matrices exactly 8 ways."""
    from apps.video_gen.config import load_recipe
    from apps.video_gen.model import build_transformer
    from phalanx.booster.plugins import make_plugin

    cfg = load_recipe(ROOT / "apps/video_gen/configs/stage1_t2i_8xh100.yaml")
    m = cfg.model
    assert (m.num_layers, m.num_heads * m.head_dim, m.ffn_dim) == (30, 1536, 8960)
    with torch.device("meta"):
        model = build_transformer(m, 16, m.text_hidden_size)  # Wan 2.1 VAE: z_dim 16
    params = sum(p.numel() for p in model.parameters())
    assert 1.0e9 < params < 1.6e9, params
    world, device = 8, 80 * GiB
    state = 16 * params / world + 2 * params + 4 * 127e6
    need = state + RESERVE
    report(f"video stage1 ({params / 1e9:.2f} B)", "fsdp state (activations not modelled)", need, device)
    print(f"  left for activations before the 10% headroom: {(0.9 * device - need) / GiB:.1f} GiB")
    assert headroom(need, device) >= HEADROOM

    fake_world(world)
    train = gpu_train(cfg.train)
    plugin = make_plugin(train.plugin, train.precision, None, **train.plugin_options)
    plugin.setup()
    fsdp_shard_meta(plugin, model)
    assert check_fsdp_shards(model, world, exact=False) == params
    for name, p in model.blocks.named_parameters():
        if p.dim() == 2:  # every matrix of the blocks splits exactly (the 1-row modulation tables are padded)
            assert p.shape[0] % world == 0, name


# ------------------------------------------------------------------------------ AlphaFold 2
def test_alphafold2_full_size_dap4_on_4x80gib(fake_world, monkeypatch):
    """AlphaFold 2 at full size (c_m 256, c_z 128, 48 Evoformer blocks, extra MSA stack of 4 blocks at
    c_e 64) with DAP over 4 x 80 GiB. The planner does not model AlphaFold: the bound is the DDP
    training state in fp32 (parameters, gradients, AdamW moments, EMA copy: 20 B per parameter,
    replicated) + reserve, >= 10% headroom; the Evoformer's activations (crop 256, 128 MSA
    clusters, 1024 extra sequences) are NOT modelled. The config validates DAP's divisibility
    (crop, clusters and extra sequences multiples of 4), and in a fake 4-rank world the DDP plugin
    with ranks_per_replica=4 (what train.with_dap_replicas gives fit) sets up one replica of 4 ranks."""
    from apps.protein.config import load_recipe
    from apps.protein.model.alphafold import AlphaFold
    from apps.protein.train import with_dap_replicas
    from phalanx.booster.plugins import make_plugin

    cfg = load_recipe(ROOT / "apps/protein/configs/alphafold2_dap4_4xh100.yaml")
    m = cfg.model
    assert (m.c_m, m.c_z, m.c_e, m.evoformer_blocks, m.extra_msa_blocks, cfg.dap_size) == (256, 128, 64, 48, 4, 4)
    import apps.protein.model.alphafold as af

    tables = af.ideal_tables()  # constant tables computed from the ideal geometry (needs real values)
    monkeypatch.setattr(af, "ideal_tables", lambda: tables)
    with torch.device("meta"):
        model = AlphaFold(m)
    params = sum(p.numel() for p in model.parameters())
    assert 85e6 < params < 100e6, params  # AF2 model_1 without templates: ~93 M
    world, device = 4, 80 * GiB
    need = 20 * params + RESERVE
    report(f"alphafold2 ({params / 1e6:.1f} M)", "ddp, dap 4 (activations not modelled)", need, device)
    assert headroom(need, device) >= HEADROOM
    for size in (cfg.data.crop_size, cfg.data.max_msa_clusters, cfg.data.max_extra_msa):
        assert size % cfg.dap_size == 0

    fake_world(world)
    train = with_dap_replicas(cfg)
    assert train.plugin == "ddp" and train.plugin_options["ranks_per_replica"] == 4
    plugin = make_plugin(train.plugin, train.precision, None, **train.plugin_options)
    plugin.setup()
    assert plugin.dp_size == 1, "4 ranks, one DAP group: one data replica"


# ------------------------------------------------------------------------------ SD 1.5
def test_sd15_finetune_on_one_24gib_gpu():
    """SD 1.5 UNet fine-tuning on one 24 GiB GPU (ddp on one rank: nothing to shard). The planner
    does not model a UNet: the bound is DDP's mixed-precision state from the meta UNet's parameter
    count (the planner's DDP terms: bf16 parameters and gradients, fp32 masters, AdamW moments, fp32
    master gradients at the step: 20 B per parameter) + the frozen VAE and CLIP text encoder in fp32
    + reserve, >= 10% headroom; activations (2 x 512 px with gradient checkpointing) are NOT
    modelled, and what is left for them is printed. The UNet, VAE and text encoder are built at
    SD 1.5's sizes on the meta device."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from apps.diffusion.config import load_recipe

    cfg = load_recipe(ROOT / "apps/diffusion/configs/sd15_finetune_1x24gb.yaml")
    assert cfg.model.gradient_checkpointing and not cfg.ema.enabled and cfg.train.plugin == "ddp"
    with torch.device("meta"):
        unet = UNet2DConditionModel(**SD15_UNET)
        vae = AutoencoderKL(**SD15_VAE)
        text = CLIPTextModel(CLIPTextConfig(**SD15_TEXT))
    n_unet = sum(p.numel() for p in unet.parameters())
    n_frozen = sum(p.numel() for p in vae.parameters()) + sum(p.numel() for p in text.parameters())
    assert 855e6 < n_unet < 865e6, n_unet  # 859.5 M
    device = 24 * GiB
    need = 20 * n_unet + 4 * n_frozen + RESERVE
    report(f"sd15 unet ({n_unet / 1e6:.1f} M)", "ddp bf16, 1 rank (activations not modelled)", need, device)
    print(f"  left for activations before the 10% headroom: {(0.9 * device - need) / GiB:.1f} GiB")
    assert headroom(need, device) >= HEADROOM
