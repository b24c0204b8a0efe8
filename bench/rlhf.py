"""One GRPO step, Phalanx (rollouts on its own engine, in-memory weight sync) against TRL's
`GRPOTrainer` (Hugging Face `generate`), same model, prompts, n and lengths, in the same run.

    python bench/rlhf.py                                   # SmolLM2-135M-Instruct, 4 prompts x 8 samples, 32 tokens
    python bench/rlhf.py --prompts 2 --n 4 --max-new-tokens 16 --steps 3
    python bench/rlhf.py --shared-prompt-forward false --skip-trl  # Phalanx without the shared-prompt forward
    python bench/rlhf.py --profile-update                # CPU time of one policy update, packed vs unshared
    python bench/rlhf.py --lora                          # peak memory of LoRA GRPO against full GRPO
    python bench/rlhf.py --rollout ray --max-staleness 1 # time per step: colocated vs Ray staleness 0 vs 1
    python bench/rlhf.py --smoke                         # the test suite's run: a tiny random SmolLM2, 1 x 2, 2 steps

Prints step time and its split (generate / score / train / weight sync), rollout tokens/s, the
ratio of step throughputs, and one JSON line. The first step of each (warm-up) is not counted.
TRL is a dev-only dependency. Both train in fp32 with the same learning rate, no KL (beta 0), one
policy update per rollout, temperature 1, sampling to the full length (EOS ignored on neither:
lengths may differ, so throughput is compared per completion token as well as per step).
`--lora` measures memory instead: one GRPO run with full fine-tuning and one with LoRA (r 8, alpha 16 on
q/k/v/o_proj), each in a fresh process, with the KL term on (`--kl-coef`, 0.05) so that each builds its
reference: a frozen copy of the policy for the full run, the same model with its adapter off for LoRA.
It prints each run's peak resident memory (VmHWM; the peak allocated device memory on a GPU) and the
ratio LoRA / full.
`--rollout ray` measures decoupled rollouts instead (no TRL): the same GRPO run colocated, with
`rollout.mode=ray` and max_staleness 0 (the rollout waits for its worker), and with `--max-staleness`
k (generation of the next rollouts overlaps training); the time per step is the wall time from the
step's rollout request to the end of its weight broadcast (`time_step_s`), median over the steps after
the first. The Ray instance is local (`--ray-cpus`, default: every core), one worker of 1 CPU.
Phalanx's policy update runs the shared-prompt forward (`grpo.shared_prompt_forward`, on by default:
each prompt's n samples packed into one row holding the prompt once; exact); `--shared-prompt-forward
false` measures the unshared forward for comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(key, "1")
os.environ.setdefault("WANDB_MODE", "offline")


def reward_len(completions, **_):
    """Any cheap reward with spread; both sides score the same text with it."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(len(t) % 7) for t in texts]


LORA = ["lora.enabled=true", "lora.rank=8", "lora.alpha=16", "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"]


def run_phalanx(model_dir: str, records: list[dict], args, out: Path, extra: list[str] = ()) -> dict:
    from apps.chat_rlhf.grpo import build_run, load_grpo_config
    overrides = [f"model={model_dir}", f"grpo.num_generations={args.n}", f"grpo.max_new_tokens={args.max_new_tokens}",
                 "grpo.rewards=[rlhf:reward_len]", "grpo.clip_high=0.2", "data.num_heldout=0",
                 f"data.num_train={len(records)}", f"train.micro_batch_size={args.prompts}",
                 f"train.max_steps={args.steps}", f"train.output_dir={out}", "train.resume=false", "train.lr=1e-6",
                 "train.progress_bar=false", "train.plot=false", "train.save_every=0", "train.keep_last=1",
                 "engine.max_model_len=256", "train.precision=fp32",
                 f"grpo.shared_prompt_forward={args.shared_prompt_forward}", *extra]
    cfg = load_grpo_config(None, overrides)
    run = build_run(cfg)
    run.train_records[:] = records  # the bench's prompts, not the generated task's
    from apps.chat_rlhf.grpo import encode_prompts
    run.loss.prompt_ids[:] = encode_prompts(run.tokenizer, records)
    t0 = time.perf_counter()
    try:
        run.train()
    finally:
        run.close()  # the Ray rollout workers, if any
    total = time.perf_counter() - t0
    hist = run.hook.history[1:] or run.hook.history
    step = [r["time_generate_s"] + r["time_score_s"] + r["time_train_s"] + r["time_sync_s"] for r in hist]
    return {"step_s": statistics.median(step), "generate_s": statistics.median(r["time_generate_s"] for r in hist),
            "score_s": statistics.median(r["time_score_s"] for r in hist),
            "train_s": statistics.median(r["time_train_s"] for r in hist),
            "sync_s": statistics.median(r["time_sync_s"] for r in hist),
            "completion_tokens": statistics.median(r["completion_len"] for r in hist) * args.prompts * args.n,
            "rollout_tokens_per_s": statistics.median(r["rollout_tokens_per_s"] for r in hist), "total_s": total,
            "time_step_s": statistics.median(r["time_step_s"] for r in hist),
            "wait_s": statistics.median(r["time_wait_s"] for r in hist),
            "lags": [r["rollout_lag"] for r in run.hook.history]}


def compare_rollouts(model_dir: str, records: list[dict], args, out: Path) -> dict:
    """Time per step of the same GRPO run colocated, on Ray with staleness 0, and on Ray with
    staleness `args.max_staleness` (if > 0); one local Ray instance for the Ray runs."""
    import ray
    runs = {"colocated": []}
    runs["ray_staleness_0"] = ["rollout.mode=ray", "rollout.max_staleness=0"]
    if args.max_staleness > 0:
        runs[f"ray_staleness_{args.max_staleness}"] = ["rollout.mode=ray", f"rollout.max_staleness={args.max_staleness}"]
    results = {}
    ray.init(num_cpus=args.ray_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        for name, extra in runs.items():
            results[name] = run_phalanx(model_dir, records, args, out / name, extra)
            r = results[name]
            print(f"{name:18s} step {r['time_step_s']:.2f} s (trainer waited {r['wait_s']:.2f} s for its rollout, "
                  f"engine {r['generate_s']:.2f} s, train {r['train_s']:.2f} s, sync {r['sync_s']:.3f} s), lags "
                  f"{r['lags']}", flush=True)
    finally:
        ray.shutdown()
    base = results["colocated"]["time_step_s"]
    return {"runs": results, "step_s_over_colocated": {k: v["time_step_s"] / base for k, v in results.items()}}


def peak_memory() -> dict:
    """This process's peak resident memory (VmHWM) and, on an accelerator, its peak allocated memory, in GiB."""
    out = {"peak_rss_gib": float("nan"), "peak_device_gib": None}
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                out["peak_rss_gib"] = int(line.split()[1]) / 2 ** 20
    from phalanx.device import device_module, is_accelerator, run_device
    if is_accelerator(run_device()):
        out["peak_device_gib"] = device_module().max_memory_allocated() / 2 ** 30
    return out


def memory_child(kind: str, model_dir: str, records: list[dict], args) -> None:
    """One GRPO run (full or LoRA, KL to the reference on) in this process; prints its peaks as JSON."""
    extra = [f"grpo.kl_coef={args.kl_coef}", *(LORA if kind == "lora" else [])]
    with tempfile.TemporaryDirectory() as tmp:
        timing = run_phalanx(model_dir, records, args, Path(tmp) / kind, extra)
    print("MEMORY " + json.dumps({"kind": kind, **peak_memory(), "step_s": timing["step_s"]}), flush=True)


def compare_lora_memory(model_dir: str, args) -> dict:
    """Full GRPO and LoRA GRPO, each in a fresh process (peaks do not mix), same prompts and lengths."""
    import subprocess
    peaks = {}
    for kind in ("full", "lora"):
        cmd = [sys.executable, __file__, "--memory-child", kind, "--model", model_dir, "--prompts", str(args.prompts),
               "--n", str(args.n), "--max-new-tokens", str(args.max_new_tokens), "--steps", str(args.steps),
               "--kl-coef", str(args.kl_coef)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("MEMORY ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"the {kind} GRPO run failed:\n{proc.stderr[-3000:]}")
        peaks[kind] = json.loads(lines[-1][len("MEMORY "):])
        print(f"{kind:4s}: peak RSS {peaks[kind]['peak_rss_gib']:.3f} GiB"
              + (f", device peak {peaks[kind]['peak_device_gib']:.3f} GiB" if peaks[kind]["peak_device_gib"] else "")
              + f", step {peaks[kind]['step_s']:.1f} s", flush=True)
    ratio = {"rss": peaks["lora"]["peak_rss_gib"] / peaks["full"]["peak_rss_gib"]}
    if peaks["full"]["peak_device_gib"]:
        ratio["device"] = peaks["lora"]["peak_device_gib"] / peaks["full"]["peak_device_gib"]
    print("LoRA / full peak memory: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items()))
    return {"full": peaks["full"], "lora": peaks["lora"], "lora_over_full": ratio}


def profile_update(model_dir: str, records: list[dict], args, out: Path, repeats: int = 2) -> dict:
    """CPU seconds of one policy update (log-prob forward, loss, backward, AdamW step) on one fixed
    rollout, the shared-prompt forward and the unshared one alternately (CPU time: meaningful on a
    loaded machine, where wall time is not), then torch.profiler's top operators of each."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from apps.chat_rlhf.grpo import build_run, encode_prompts, load_grpo_config
    cfg = load_grpo_config(None, [f"model={model_dir}", f"grpo.num_generations={args.n}",
                                  f"grpo.max_new_tokens={args.max_new_tokens}", "grpo.rewards=[rlhf:reward_len]",
                                  "data.num_heldout=0", f"data.num_train={len(records)}", "engine.max_model_len=256",
                                  f"train.output_dir={out}", "train.precision=fp32"])
    run = build_run(cfg)
    run.train_records[:] = records
    run.loss.prompt_ids[:] = encode_prompts(run.tokenizer, records)
    rollout = run.engine.generate(run.loss.prompt_ids[:args.prompts], args.n, seeds=range(args.prompts * args.n))
    run.loss.rollout_fn = lambda indices, step: rollout
    # lr 0: AdamW does all its work but the weights stay those the rollout was sampled with (the guard holds)
    optimizer = torch.optim.AdamW([p for p in run.model.parameters() if p.requires_grad], lr=0.0)
    batch = {"index": torch.arange(args.prompts)}

    def update(shared: bool) -> float:
        run.loss.s.shared_prompt_forward = shared
        t0 = time.process_time()
        run.loss(run.model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.process_time() - t0

    update(True)  # warm-up
    cpu = {True: [], False: []}
    for _ in range(repeats):
        for shared in (True, False):
            cpu[shared].append(update(shared))
    for shared in (True, False):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            update(shared)
        print(f"shared_prompt_forward={shared}:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))
    result = {"update_cpu_s_shared": statistics.median(cpu[True]),
              "update_cpu_s_unshared": statistics.median(cpu[False]),
              "completion_lens": [len(c) for c in rollout.completion_ids],
              "prompt_lens": sorted({len(p) for p in rollout.prompt_ids})}
    result["update_speedup"] = result["update_cpu_s_unshared"] / result["update_cpu_s_shared"]
    return result


def run_trl(model_dir: str, records: list[dict], args, out: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen_times: list[float] = []
    original = model.generate

    def timed_generate(*a, **k):
        t = time.perf_counter()
        result = original(*a, **k)
        gen_times.append(time.perf_counter() - t)
        return result

    model.generate = timed_generate
    step_times: list[float] = []
    lengths: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t = time.perf_counter()

        def on_step_end(self, *_, **__):
            step_times.append(time.perf_counter() - self.t)

        def on_log(self, _a, _s, _c, logs=None, **__):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    cfg = GRPOConfig(output_dir=str(out), per_device_train_batch_size=args.prompts * args.n,
                     num_generations=args.n, max_completion_length=args.max_new_tokens, max_steps=args.steps,
                     learning_rate=1e-6, beta=0.0, temperature=1.0, top_p=1.0, use_cpu=True, bf16=False,
                     report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
                     dataloader_num_workers=0)
    dataset = Dataset.from_list([{"prompt": r["prompt"]} for r in records])
    trainer = GRPOTrainer(model=model, reward_funcs=[reward_len], args=cfg, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Timer()])
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    steps, gens = step_times[1:] or step_times, gen_times[1:] or gen_times
    mean_len = statistics.median(lengths[1:] or lengths) if lengths else float("nan")
    gen = statistics.median(gens)
    return {"step_s": statistics.median(steps), "generate_s": gen, "train_s": statistics.median(steps) - gen,
            "completion_tokens": mean_len * args.prompts * args.n,
            "rollout_tokens_per_s": mean_len * args.prompts * args.n / gen, "total_s": total}


def smoke_model_dir(base: str, out: Path) -> str:
    """`base`'s config (family, vocabulary, tied embeddings, special tokens) and tokenizer, shrunk to
    hidden 64 and 2 layers with random weights: the smoke run goes through every code path of the
    real one (both frameworks' rollout, scoring, update and weight sync) in a fraction of its time."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(base)
    config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return str(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="HF model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="steps per framework; the first is warm-up")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--profile-update", action="store_true",
                        help="no step timing: CPU time and top operators of one update, shared vs unshared forward")
    parser.add_argument("--shared-prompt-forward", default="true", choices=["true", "false"],
                        help="Phalanx's update holds each prompt once for its n samples (default) or n times")
    parser.add_argument("--lora", action="store_true",
                        help="peak memory of LoRA GRPO (r 8 on q/k/v/o, reference = adapter off) against full GRPO "
                             "(reference = a frozen copy), each in its own process, KL on (--kl-coef)")
    parser.add_argument("--kl-coef", type=float, default=0.05, help="with --lora: the KL term (builds the reference)")
    parser.add_argument("--memory-child", choices=["full", "lora"], help=argparse.SUPPRESS)
    parser.add_argument("--rollout", default="colocated", choices=["colocated", "ray"],
                        help="ray: time per step colocated vs rollout.mode=ray at staleness 0 and --max-staleness")
    parser.add_argument("--max-staleness", type=int, default=1, help="with --rollout ray: the overlapped run's k")
    parser.add_argument("--ray-cpus", type=int, default=0, help="with --rollout ray: the local Ray instance's CPUs")
    parser.add_argument("--smoke", action="store_true",
                        help="the test suite's run: --model's config and tokenizer at hidden 64, 2 layers (random "
                             "weights), 1 prompt x 2 samples, 4 new tokens, 2 steps")
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompts, args.n, args.max_new_tokens, args.steps = 1, 2, 4, 2
    sys.modules.setdefault("rlhf", sys.modules[__name__])

    import torch
    from apps.chat_rlhf.models import resolve_model_dir
    from apps.chat_rlhf.tasks import arithmetic_records
    model_dir = str(resolve_model_dir(args.model or None))
    if args.smoke:
        smoke_dir = tempfile.TemporaryDirectory(prefix="rlhf-smoke-")  # removed at exit
        model_dir = smoke_model_dir(model_dir, Path(smoke_dir.name) / "model")
    records = arithmetic_records(args.prompts * args.steps, seed=7)
    load = open("/proc/loadavg").read().split()[:3] if Path("/proc/loadavg").exists() else []
    print(f"model {model_dir}; {args.prompts} prompts x {args.n} samples, {args.max_new_tokens} new tokens, "
          f"{args.steps} steps; torch {torch.__version__} {torch.backends.cpu.get_cpu_capability()} "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, loadavg {' '.join(load)}")
    if args.memory_child:
        memory_child(args.memory_child, model_dir, records, args)
        return
    if args.lora:
        result = compare_lora_memory(model_dir, args)
        load_after = open("/proc/loadavg").read().split()[:3] if Path("/proc/loadavg").exists() else []
        print(json.dumps({"bench": "rlhf_lora_memory", **result, "prompts": args.prompts, "n": args.n,
                          "max_new_tokens": args.max_new_tokens, "kl_coef": args.kl_coef, "loadavg_before": load,
                          "loadavg_after": load_after}))
        return
    if args.rollout == "ray":
        with tempfile.TemporaryDirectory() as tmp:
            result = compare_rollouts(model_dir, records, args, Path(tmp))
        load_after = open("/proc/loadavg").read().split()[:3] if Path("/proc/loadavg").exists() else []
        print("time per step / colocated: " + ", ".join(f"{k} {v:.2f}x" for k, v in
                                                        result["step_s_over_colocated"].items()))
        print(json.dumps({"bench": "rlhf_ray_rollouts", **result, "prompts": args.prompts, "n": args.n,
                          "max_new_tokens": args.max_new_tokens, "loadavg_before": load, "loadavg_after": load_after}))
        return
    if args.profile_update:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps({"bench": "rlhf_update_profile", **profile_update(model_dir, records, args, Path(tmp))}))
        return
    with tempfile.TemporaryDirectory() as tmp:
        ours = run_phalanx(model_dir, records, args, Path(tmp) / "phalanx")
        print("phalanx:", json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in ours.items()}),
              flush=True)
        theirs = None if args.skip_trl else run_trl(model_dir, records, args, Path(tmp) / "trl")
        if theirs:
            print("trl:    ", json.dumps({k: round(v, 3) for k, v in theirs.items()}), flush=True)
    load_after = open("/proc/loadavg").read().split()[:3] if Path("/proc/loadavg").exists() else []
    line = {"bench": "rlhf_grpo_step", "phalanx": ours, "trl": theirs, "prompts": args.prompts, "n": args.n,
            "max_new_tokens": args.max_new_tokens, "shared_prompt_forward": args.shared_prompt_forward == "true",
            "loadavg_before": load, "loadavg_after": load_after}
    if theirs:
        line["step_speedup"] = theirs["step_s"] / ours["step_s"]
        line["rollout_speedup"] = ours["rollout_tokens_per_s"] / theirs["rollout_tokens_per_s"]
        print(f"step throughput: phalanx {1 / ours['step_s']:.3f} steps/s vs TRL {1 / theirs['step_s']:.3f} "
              f"-> {line['step_speedup']:.2f}x; rollout tokens/s {line['rollout_speedup']:.2f}x; "
              f"weight sync {ours['sync_s'] * 1000:.0f} ms")
    print(json.dumps(line))


if __name__ == "__main__":
    main()
