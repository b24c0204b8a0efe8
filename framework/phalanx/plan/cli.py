"""`phalanx plan`: which parallel layout fits, and which is fastest, before renting the GPUs."""
from __future__ import annotations

import argparse
import json
import sys

from phalanx.amp.precision import NAMES, precision_named
from phalanx.plan.model import PRESETS
from phalanx.plan.planner import plan
from phalanx.plan.report import format_plan
from phalanx.plan.units import gib


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="phalanx plan", description=(
        "Estimate per-rank memory and step time of every parallel layout (DDP, ZeRO-1/2, FSDP, Gemini, "
        "tensor/pipeline/sequence parallel, activation checkpointing, CPU offload) and recommend one."))
    ap.add_argument("--model", required=True,
                    help=f"HF model directory, config.json, or a preset: {', '.join(PRESETS)}")
    ap.add_argument("--world-size", type=int, required=True, help="number of ranks (GPUs)")
    ap.add_argument("--device-memory", required=True, help="memory of one device, e.g. 80GiB")
    ap.add_argument("--host-memory", default=None, help="host memory available to one rank, e.g. 200GiB")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sample (default 2048)")
    ap.add_argument("--micro-batch", type=int, default=1, help="samples per forward per data-parallel rank")
    ap.add_argument("--global-batch", type=int, default=None,
                    help="samples per optimizer step (default: micro batch × data-parallel ranks)")
    ap.add_argument("--dtype", default="bf16", choices=NAMES, help="compute precision (mixed: fp32 masters)")
    ap.add_argument("--peak-tflops", default="989",
                    help="one device's dense peak in --dtype, TFLOP/s (H100 bf16: 989), or 'measure': time a "
                         "matmul on this machine's device")
    ap.add_argument("--efficiency", type=float, default=0.45, help="fraction of the peak a step reaches (MFU)")
    ap.add_argument("--bandwidth", default="100GB/s", help="per-rank bandwidth of collectives")
    ap.add_argument("--host-bandwidth", default="25GB/s", help="device↔host copy bandwidth (offload)")
    ap.add_argument("--reserve", default="2GiB", help="device memory not modelled (CUDA context, NCCL, fragmentation)")
    ap.add_argument("--loss", default="fused", choices=("fused", "hf"),
                    help="fused: phalanx.train's chunked loss; hf: the model's own (full fp32 logits)")
    ap.add_argument("--lora-rank", type=int, default=None,
                    help="LoRA adapters of this rank instead of full fine-tuning (frozen base in --dtype)")
    ap.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj",
                    help="comma-separated linear layers that take adapters (default q_proj,k_proj,v_proj,o_proj)")
    ap.add_argument("--show", type=int, default=15, help="rows per section (0: all)")
    ap.add_argument("--json", action="store_true", help="print one JSON line per layout instead of the table")
    return ap


def _measured_peak_tflops(dtype: str) -> float:
    from phalanx.observe.throughput import measure_matmul_flops
    from phalanx_kernels.accelerator import current_device

    device = current_device()
    return measure_matmul_flops(device, precision_named(dtype).compute_dtype) / 1e12


def kv_cache_line(spec, seq: int, dtype: str) -> str:
    """The serving KV cache this model needs per token and per sequence of `seq` tokens (one rank,
    no tensor parallelism), saying what it holds."""
    import torch

    from phalanx.plan.memory import kv_cache_bytes_per_token
    from phalanx.plan.workload import Workload

    compute = Workload(seq=seq, micro_batch=1, dtype=dtype).dtype.compute_dtype  # fp8 training: bf16 activations
    label = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(compute, str(compute))
    per_token = kv_cache_bytes_per_token(spec, 1, compute)
    if spec.mla:
        full = spec.num_heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim + spec.v_head_dim)
        what = (f"latent kv_lora_rank {spec.kv_lora_rank} + rope {spec.qk_rope_head_dim} per layer "
                f"(multi-head latent attention; {spec.num_heads} heads' keys and values would take "
                f"{full / (spec.kv_lora_rank + spec.qk_rope_head_dim):.1f}×)")
    else:
        what = f"keys and values of {spec.num_kv_heads} KV heads × {spec.head_dim} per layer"
    return (f"serving KV cache ({label}): {per_token / 1024:,.1f} KiB per token, {gib(per_token * seq)} per "
            f"{seq}-token sequence: {what}")


def plan_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.peak_tflops == "measure":
        args.peak_tflops = _measured_peak_tflops(args.dtype)
        print(f"measured matmul peak: {args.peak_tflops:.3g} TFLOP/s ({args.dtype})")
    lora = None
    if args.lora_rank is not None:
        lora = dict(rank=args.lora_rank, target_modules=[t.strip() for t in args.lora_targets.split(",") if t.strip()])
    options = dict(host_memory=args.host_memory, seq=args.seq, micro_batch=args.micro_batch,
                   global_batch=args.global_batch, dtype=args.dtype, peak_tflops=args.peak_tflops,
                   efficiency=args.efficiency, bandwidth=args.bandwidth, host_bandwidth=args.host_bandwidth,
                   reserve=args.reserve, loss=args.loss, lora=lora)
    try:
        estimates = plan(args.model, args.world_size, args.device_memory, **options)
    except ValueError as exc:
        print(f"phalanx plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        for e in estimates:
            print(json.dumps({"layout": e.name, "fits": e.fits, "reason": e.reason,
                              "options": e.layout.plugin_options(),
                              "device_bytes": e.memory.device_total if e.memory else None,
                              "device": e.memory.device if e.memory else None,
                              "host": e.memory.host if e.memory else None,
                              "step_s": e.time.total if e.time else None,
                              "all_to_all_s": e.time.ep_comm if e.time else None}))
        return 0
    from phalanx.plan.lora import LoRA, adapter_params
    from phalanx.plan.model import load_spec
    from phalanx.plan.planner import suggest_fix
    spec = load_spec(args.model)
    active = (f", {spec.active_params() / 1e9:.3g}B active: {spec.num_experts} experts, top-{spec.experts_per_token}"
              if spec.is_moe else "")
    ranks = f"{args.world_size} rank{'s' if args.world_size != 1 else ''}"
    tuning = "AdamW"
    if lora:
        adapters = LoRA.of(lora)
        tuning = f"{adapters.describe()} ({adapter_params(spec, adapters) / 1e6:.3g}M trainable), AdamW"
    header = (f"phalanx plan: {spec.name} ({spec.total_params() / 1e9:.3g}B parameters{active}), {ranks} × "
              f"{args.device_memory}, seq {args.seq}, micro batch {args.micro_batch}, {args.dtype}, {tuning}")
    header += "\n" + kv_cache_line(spec, args.seq, args.dtype)
    fix = None
    if not any(e.fits for e in estimates):
        fix = suggest_fix(estimates, args.model, args.world_size, args.device_memory, **options)
    print(format_plan(estimates, header, show=args.show or None, fix=fix))
    return 0 if any(e.fits for e in estimates) else 1


if __name__ == "__main__":
    raise SystemExit(plan_main())
