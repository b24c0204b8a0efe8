"""`MemoryProbe`'s measured peak (the end-of-run memory line of `fit`) counts the whole training
state: parameters, gradients, AdamW's two moments and the activations, on CPU and on the emulated
GPU's device meter.

The CPU case starts from what a benchmark leaves behind: memory a previous run freed that the
allocator kept resident. Training reuses it without the resident set rising, so a baseline taken
over it hides the training state (bench/train_throughput.py --part single printed a 225 MiB peak
for a 58M-parameter fp32 model whose state alone is 0.87 GiB).

Run as a script (`python tests/framework/test_memory_probe.py`) it prints one `PROBE {...}` line;
the emulated test runs it that way under PHALANX_EMULATE_GPU=1.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
STATE_BYTES_PER_PARAM = 4 + 4 + 8  # fp32: parameter, gradient, AdamW's exp_avg and exp_avg_sq
SEQ, BATCH, STEPS = 64, 2, 2


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # ~13.4M parameters: 214 MB of training state, well above process noise
    return LlamaForCausalLM(LlamaConfig(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
                                        num_attention_heads=6, num_key_value_heads=6, max_position_embeddings=SEQ,
                                        tie_word_embeddings=False))


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, vocab: int):
        self.ids = torch.randint(0, vocab, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i]}


def leave_freed_memory(nbytes: int) -> list[torch.Tensor]:
    """Allocate `nbytes` in 4 MiB tensors and free them, as a finished run does. After `launch()`
    glibc keeps freed blocks for reuse (phalanx.malloc); without it, one freed 12 MiB block raises
    glibc's mmap threshold so the 4 MiB ones come from the heap, and a small tensor after each keeps
    the heap's top in use. Either way the freed blocks stay resident until something hands them
    back, and the next allocations reuse them without the resident set rising. Returns the small
    tensors: keep them alive."""
    first = torch.ones(3 * 2**20)
    del first
    blocks, pins = [], []
    for _ in range(nbytes // 2**22):
        blocks.append(torch.ones(2**20))
        pins.append(torch.ones(64))
    del blocks
    return pins


def measure_fit() -> dict:
    """Train the model STEPS steps with `fit` (fp32, AdamW); the probe's measured peak and the
    bytes of the training state it must at least cover."""
    from phalanx.launch import context
    from phalanx.plan.run import MemoryProbe
    from phalanx.train import TrainConfig, fit

    context()  # as the benchmark does: on CPU, glibc now keeps freed blocks for reuse (phalanx.malloc)
    model = _model()
    params = sum(p.numel() for p in model.parameters())
    pins = leave_freed_memory(STATE_BYTES_PER_PARAM * params)  # noqa: F841 (kept alive)
    seen: list[int] = []
    original = MemoryProbe.measured

    def recorded(self) -> int:
        seen.append(original(self))
        return seen[-1]

    MemoryProbe.measured = recorded
    try:
        with tempfile.TemporaryDirectory(prefix="phalanx-probe-") as out:
            cfg = TrainConfig(output_dir=out, max_steps=STEPS, micro_batch_size=BATCH, lr=1e-4, precision="fp32",
                              plugin="ddp", progress_bar=False, plot=False, peak_tflops=0, resume=False, keep_last=1)
            fit(cfg, model, _Tokens(BATCH * STEPS, model.config.vocab_size))
    finally:
        MemoryProbe.measured = original
    assert seen, "fit did not ask its MemoryProbe for the measured peak"
    return {"params": params, "state_bytes": STATE_BYTES_PER_PARAM * params, "measured": seen[-1]}


def measure_model_on_device() -> dict:
    """The probe started after the model is on the device (its parameters already counted by the
    device meter), then a plain AdamW loop."""
    from phalanx.plan.run import MemoryProbe
    from phalanx_kernels.accelerator import current_device

    device = current_device()
    model = _model().to(device)
    params = sum(p.numel() for p in model.parameters())
    probe = MemoryProbe(model, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = _Tokens(BATCH, model.config.vocab_size).ids.to(device)
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"params": params, "state_bytes": STATE_BYTES_PER_PARAM * params, "measured": probe.measured()}


def measure() -> dict:
    return {"fit": measure_fit(), "model_on_device": measure_model_on_device()}


def _check(result: dict) -> None:
    state, measured = result["state_bytes"], result["measured"]
    # activations of 2 x 64 tokens (logits 4 MiB, a few MiB per layer) and allocator slack
    activations_and_slack = 96 * 2**20
    assert measured >= state, f"measured peak {measured / 2**20:.0f} MiB < training state {state / 2**20:.0f} MiB"
    assert measured < 3 * state + activations_and_slack, \
        f"measured peak {measured / 2**20:.0f} MiB is far above the training state {state / 2**20:.0f} MiB"


@pytest.fixture(scope="module")
def cpu_results() -> dict:
    return measure()


@pytest.fixture(scope="module")
def emulated_results() -> dict:
    env = dict(os.environ, PHALANX_EMULATE_GPU="1", TRITON_INTERPRET="1", PYTHONPATH=str(ROOT),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next((l for l in proc.stdout.splitlines() if l.startswith("PROBE ")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(line.removeprefix("PROBE "))
    assert results["device"].startswith("emucuda"), results
    return results


@pytest.mark.parametrize("case", ["fit", "model_on_device"])
def test_cpu_peak_counts_the_training_state(cpu_results, case):
    _check(cpu_results[case])


@pytest.mark.parametrize("case", ["fit", "model_on_device"])
def test_emulated_gpu_peak_counts_the_training_state(emulated_results, case):
    _check(emulated_results[case])


if __name__ == "__main__":
    from phalanx_kernels.accelerator import current_device

    out = measure()
    out["device"] = str(current_device())
    print("PROBE " + json.dumps(out), flush=True)
