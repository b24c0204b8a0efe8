"""Every benchmark runs as its docstring says (`python bench/<name>.py ...` from the repository
root) with its smallest arguments, exits 0 and prints the ratio against its peer that it promises.

Run from the root, `sys.path[0]` is bench/: a bench module named like an installed package shadows
it for every library that imports that package (bench/kernels.py hid the `kernels` package from
transformers until it was renamed kernel_speed.py); `test_no_bench_shadows_an_installed_package`
guards that. A bench whose part needs a GPU prints why it skips it on CPU and still exits 0.
"""
from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
HELPERS = {"timing.py"}  # imported by the benches, not run on its own

# name -> (smallest arguments, regex of the ratio line(s) it must print, over ~30 s on 2 cores)
CASES: dict[str, tuple[list[str], list[str], bool]] = {
    "checkpoint_async.py": (["--layers", "1", "--hidden", "64", "--vocab", "512", "--seq", "16", "--batch", "2",
                             "--steps", "4", "--save-every", "2"],
                            [r"phalanx async vs DCP async_save: [\d.]+x"], False),
    "collectives.py": (["--mb", "2", "--reps", "2"], [r"[\d.]+x torch's reduce_scatter", r"[\d.]+x torch's all_gather"],
                       False),
    "faults.py": (["--repeat", "1", "--steps", "4", "--save-every", "2", "--kill-step", "3"],
                  [r"ratio: recovered job wall time / uninterrupted job = [\d.]+x"], False),
    "fp8_comm.py": (["--plugins", "ddp", "--steps", "3", "--hidden", "32", "--layers", "1", "--seq", "16",
                     "--vocab", "128"], [r"ratio fp8/fp32: [\d.]+x", r"step time fp8 / fp32 communication: [\d.]+x"],
                    False),
    "gemini.py": (["--ladder", "1", "--steps", "1", "--seq", "16"], [r"vs DDP"], False),
    "hybrid.py": (["--worlds", "2", "--batch", "2", "--seq", "32", "--steps", "1", "--rounds", "1"],
                  [r"vs DDP", r"[\d.]+x"], False),
    "inference.py": (["--smoke", "--no-hf-ttft", "--ngram", "2"],
                     [r"eager / HF: [\d.]+x wall-clock", r"ngram / HF: [\d.]+x wall-clock"], False),
    "inference_ceiling.py": (["--smoke", "--dtype", "float32"], [r"throughput vs HF +[\d.]+x"], False),
    "inference_lora.py": (["--model", "tiny", "--requests", "2", "--new-tokens", "2", "--prompt-len", "8", "--rank", "4",
                           "--repeats", "1"], [r"mixed adapters / base: [\d.]+x time per token"], False),
    "inference_decode_attention.py": (["--smoke"], [r"vs gather \+ SDPA: [\d.]+x per CPU-second"], False),
    "kernel_speed.py": (["--tokens", "256", "--hidden", "64", "--vocab", "512", "--reps", "2"],
                        [r"memory ratio eager/fused: [\d.]+x", r"time ratio eager/fused: [\d.]+x"], False),
    "lora_memory.py": (["--model", "tiny", "--seq", "32", "--steps", "1"],
                       [r"LoRA / full fine-tuning: optimizer state [\d.]+x, peak memory [\d.]+x"], False),
    "memory_sharded.py": (["--world", "2", "--plugins", "ddp,zero2", "--quick", "--seq", "16", "--steps", "1"],
                          [r"ratio"], False),
    "moe_ep.py": (["--steps", "1", "--rounds", "1", "--seq", "32", "--batch", "4", "--hidden", "64", "--layers", "2",
                   "--vocab", "256", "--expert-width", "64"], [r"ratio ep2 / dp2 tokens/s: [\d.]+x"], False),
    "pipeline.py": (["--worlds", "2", "--batch", "4", "--seq", "32", "--microbatches", "2", "--steps", "1",
                     "--rounds", "1"], [r"vs DDP", r"[\d.]+x"], False),
    "plan_validate.py": (["--quick", "--only", "ddp"], [r"est dev +meas dev +err", r"[+-][\d.]+%"], False),
    "protein.py": (["--lengths", "8", "16", "--msa-rows", "4", "--c-m", "8", "--c-z", "8", "--blocks", "1",
                    "--chunk", "4", "--reps", "1"], [r"DAP-2 / one process: time x[\d.]+"], False),
    # --smoke: SmolLM2's config and tokenizer at hidden 64, 2 layers, 1 prompt x 2 samples, 4 tokens, 2 steps
    # (SmolLM2-135M itself took 81 s of CI here; the smoke takes the same code paths, ~20 s)
    "rlhf.py": (["--smoke"], [r"step throughput: .* -> [\d.]+x"], False),
    "serve.py": (["--model", "tiny", "--clients", "1,2", "--prompt-len", "8", "--new-tokens", "4", "--threads", "1"],
                 [r"2 clients / 1 client: [\d.]+x throughput"], False),
    "train_throughput.py": (["--smoke"], [r"vs raw DDP", r"vs HF fp32"], False),
    "video.py": (["--frames", "1", "--size", "8", "--steps", "1", "--layers", "1", "--heads", "2"],
                 [r"SP/DP speed"], False),
    "video_sp_memory.py": (["--frames", "1", "--size", "8", "--layers", "1", "--heads", "2"],
                           [r"saved MB +ratio", r"\n +2 +\d+ \| +[\d.]+ +[\d.]+"], False),
}
# benches that print no machine-readable JSON line yet (docs/DESIGN conventions ask for one)
NO_JSON: set[str] = set()
# benches whose part needs a GPU: the line each prints on a machine without one
GPU_SKIPS = {"kernel_speed.py": r"Part 2 -- skipped: no CUDA GPU"}


def run_bench(name: str, args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop("PHALANX_EMULATE_GPU", None)
    return subprocess.run([sys.executable, f"bench/{name}", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _top_level_names() -> set[str]:
    """Import names of the installed distributions (top_level.txt, else the files' top folders)."""
    names = set()
    for dist in importlib.metadata.distributions():
        top = dist.read_text("top_level.txt")
        if top:
            names.update(top.split())
            continue
        for f in dist.files or ():
            head = f.parts[0]
            if not head.endswith((".dist-info", ".data", ".pth")) and head != "..":
                names.add(head.removesuffix(".py"))
    return names


# where the libraries a bench imports ask whether an optional package is there (an importable name is
# enough for some): a bench named like one of them changes what the library does
PROBING_MODULES = ("transformers.utils.import_utils", "diffusers.utils.import_utils", "accelerate.utils.imports",
                   "peft.import_utils", "trl.import_utils")


def _probed_names() -> set[str]:
    """Optional packages the installed libraries probe for (`_is_package_available("x")`, `find_spec("x")`)."""
    import importlib.util

    names = set()
    for module in PROBING_MODULES:
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:  # the library is not installed
            continue
        if spec is None or not spec.origin:
            continue
        source = Path(spec.origin).read_text()
        for pattern in (r"_is_package_available\(\s*[\"']([\w.]+)[\"']", r"find_spec\(\s*[\"']([\w.]+)[\"']"):
            names.update(name.split(".")[0] for name in re.findall(pattern, source))
    return names


def test_every_bench_is_smoke_tested():
    benches = {p.name for p in BENCH.glob("*.py")} - HELPERS
    assert benches == set(CASES), f"add smoke arguments for {sorted(benches - set(CASES))}; " \
                                  f"drop {sorted(set(CASES) - benches)}"


def test_no_bench_shadows_an_installed_package():
    taken = _top_level_names() | _probed_names() | set(sys.stdlib_module_names)
    shadowing = sorted(p.name for p in BENCH.glob("*.py") if p.stem in taken)
    assert not shadowing, f"bench/{shadowing} shadow installed modules when a bench runs from bench/: rename them"


def _cases():
    for name, (args, patterns, slow) in sorted(CASES.items()):
        yield pytest.param(name, args, patterns, id=name.removesuffix(".py"),
                           marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("name,args,patterns", _cases())
def test_bench_smoke(name, args, patterns):
    if name == "rlhf.py":
        from phalanx.pretrained import default_dir

        if not (default_dir() / "config.json").exists():
            pytest.skip("bench/rlhf.py needs SmolLM2-135M-Instruct cached (the llama recipe's convert step)")
    start = time.perf_counter()
    proc = run_bench(name, args)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"python bench/{name} {' '.join(args)} exited {proc.returncode}:\n{output[-5000:]}"
    for pattern in patterns:
        assert re.search(pattern, proc.stdout), f"bench/{name} printed no line matching {pattern!r}:\n" \
                                                f"{proc.stdout[-5000:]}"
    if name not in NO_JSON:
        assert re.search(r"^(BENCH_JSON )?\{.*\}$", proc.stdout, re.M), f"bench/{name} printed no JSON line"
    if name in GPU_SKIPS:
        import torch

        if not torch.cuda.is_available():
            assert re.search(GPU_SKIPS[name], proc.stdout), f"bench/{name} did not say why it skips its GPU part"
    print(f"bench/{name}: {time.perf_counter() - start:.1f} s")
