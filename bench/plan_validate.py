"""Check `phalanx plan`'s memory estimate against the measured peak per rank.

Trains a Llama for 3 AdamW steps under each layout on gloo ranks of this machine (fp32, or
`--precision bf16`: bf16 compute with fp32 masters, meant for a CPU with native bf16; the
model's own loss) and measures each rank's peak resident memory above its baseline (after a
warm-up, before the model is built: phalanx.plan.measure); prints the plan's estimate
(phalanx.plan.estimate_for_run) beside the worst rank's peak. Target: within 15%.

    python bench/plan_validate.py                # 2 ranks, every layout (~3 min on 2 idle cores)
    python bench/plan_validate.py --world 4 --only ddp,zero2,fsdp
    python bench/plan_validate.py --quick        # a smaller model and fewer layouts
    python bench/plan_validate.py --quick --only fsdp,zero2 --precision bf16

On a CPU-only machine "device" is the kernel's RssAnon and "host" its RssShmem (the pool that
ZeRO/Gemini offload allocate from, phalanx.hostmem). Timings are not measured here.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False)
QUICK_MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)

# name -> (make_plugin keyword arguments, seq, micro batch); "checkpointing" turns activation checkpointing on
CASES = {
    "ddp": (dict(name="ddp"), 256, 2),
    "ddp ckpt": (dict(name="ddp", checkpointing=True), 256, 2),
    "zero1": (dict(name="zero1"), 256, 2),
    "zero2": (dict(name="zero2", reduce_bucket_mb=4), 256, 2),
    "zero2 offload": (dict(name="zero2", reduce_bucket_mb=4, cpu_offload=True), 256, 2),
    "fsdp": (dict(name="fsdp"), 256, 2),
    "gemini": (dict(name="gemini", placement_policy="static", chunk_size_mb=4), 256, 2),
    "gemini offload": (dict(name="gemini", placement_policy="static", chunk_size_mb=4, offload_optim_frac=1.0), 256, 2),
    "hybrid tp2 zero1": (dict(name="hybrid", tp_size=2, zero_stage=1), 256, 2),
}
QUICK = ("ddp", "zero2", "fsdp", "gemini", "hybrid tp2 zero1")


def estimate(case: str, world: int, model_kwargs: dict, precision: str = "fp32"):
    from transformers import LlamaConfig

    from phalanx.booster.plugins import make_plugin
    from phalanx.plan import estimate_for_run

    kwargs, seq, micro_batch = CASES[case]
    kwargs = dict(kwargs)
    name = kwargs.pop("name")
    checkpointing = kwargs.pop("checkpointing", False)
    plugin = make_plugin(name, precision=precision, **kwargs)
    return estimate_for_run(LlamaConfig(**model_kwargs), plugin, seq, micro_batch, world, loss="hf",
                            checkpointing=checkpointing)


def measure(cases: list[str], world: int, model_kwargs: dict, precision: str = "fp32") -> list[dict]:
    """All cases in one spawn (starting ranks and importing transformers is the slow part)."""
    from phalanx.plan.measure import measure_many
    from phalanx.testing import spawn

    todo = [(dict(CASES[c][0], precision=precision), model_kwargs, CASES[c][1], CASES[c][2]) for c in cases]
    ranks = spawn(measure_many, world, todo, timeout=1200)
    if "skip" in ranks[0][0]:
        raise SystemExit(ranks[0][0]["skip"])
    return [{"device": max(r[i]["anon"] for r in ranks), "host": max(r[i]["shmem"] for r in ranks),
             "per_rank_device": [r[i]["anon"] for r in ranks]} for i in range(len(cases))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--only", default=None, help="comma-separated case names: " + ", ".join(CASES))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model_kwargs = QUICK_MODEL if args.quick else MODEL
    cases = args.only.split(",") if args.only else (QUICK if args.quick else list(CASES))
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}: choose from {', '.join(CASES)}")
    from phalanx.plan import load_spec
    from transformers import LlamaConfig
    n = load_spec(LlamaConfig(**model_kwargs)).total_params()
    print(f"Llama {n / 1e6:.1f}M parameters, {args.precision}, AdamW, {args.world} gloo ranks, 3 steps; MiB per rank "
          "(device = RssAnon, host = RssShmem pool)")
    print(f"{'layout':<20} {'seq×mb':>7} {'est dev':>9} {'meas dev':>9} {'err':>7} {'est host':>9} {'meas host':>9} {'err':>7}  ok")
    rows, worst = [], 0.0
    t0 = time.perf_counter()
    measured = measure(cases, args.world, model_kwargs, args.precision)
    print(f"(measured in {time.perf_counter() - t0:.0f} s)")
    for case, got in zip(cases, measured, strict=True):
        est = estimate(case, args.world, model_kwargs, args.precision)
        # host: what lives in the pool; the update's temporaries on the host are ordinary allocations
        # (host RAM on a GPU machine, RssAnon here, where they run beside no device work)
        ed = est.memory.device_total
        eh = est.memory.host_total - est.memory.host.get("temporaries", 0.0)
        err_d = ed / got["device"] - 1
        err_h = (eh / got["host"] - 1) if got["host"] > 2**20 else (0.0 if eh < 2**20 else float("inf"))
        ok = abs(err_d) <= 0.15 and abs(err_h) <= 0.15
        worst = max(worst, abs(err_d), abs(err_h) if eh else 0.0)
        _, seq, mb = CASES[case]
        mib = 2**20
        print(f"{case:<20} {f'{seq}×{mb}':>7} {ed / mib:>9.1f} {got['device'] / mib:>9.1f} {err_d:>+7.1%} "
              f"{eh / mib:>9.1f} {got['host'] / mib:>9.1f} {err_h:>+7.1%}  {'yes' if ok else 'NO'}", flush=True)
        rows.append({"case": case, "world": args.world, "estimate_device": ed, "measured_device": got["device"],
                     "estimate_host": eh, "measured_host": got["host"], "device_parts": est.memory.device,
                     "per_rank_device": got["per_rank_device"]})
    print(json.dumps({"bench": "plan_validate", "world": args.world, "precision": args.precision, "params": n, "worst_rel_error": worst,
                      "rows": rows}))
    return 0 if worst <= 0.15 else 1


if __name__ == "__main__":
    sys.exit(main())
