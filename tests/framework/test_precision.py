"""precision="auto": bf16 only where the hardware computes it natively, fp32 elsewhere, and every
bf16 path (plugins, the train loop, the fused cross-entropy, inference packing, evaluation
autocast) falls back cleanly on a CPU that emulates bf16. The precision is one typed value
(`Precision`), resolved once; no code below the configs compares precision names.

Both kinds of CPU are exercised on whichever machine runs the suite: PHALANX_CPU_BF16 forces the
decision (the probe still measures), and the cached answer is cleared around each test.
"""
from __future__ import annotations

import ast
import dataclasses
import warnings
from pathlib import Path

import pytest
import torch

from phalanx.amp import precision as amp_precision
from phalanx.amp.precision import BF16, CHOICES, FP16, FP32, resolve_precision
from phalanx_kernels import capability, fused_linear_cross_entropy
from phalanx_kernels.cross_entropy import linear_cross_entropy_eager


@pytest.fixture
def cpu_kind(monkeypatch):
    """cpu_kind("native" | "emulated"): make this process see that kind of CPU."""
    def use(kind: str) -> None:
        monkeypatch.setenv("PHALANX_CPU_BF16", kind)
        capability.cpu_bf16_support.cache_clear()
        monkeypatch.setattr(amp_precision, "_warned", set())

    yield use
    capability.cpu_bf16_support.cache_clear()


def test_detection_reports_capability_and_measured_rates():
    capability.cpu_bf16_support.cache_clear()
    info = capability.cpu_bf16_support()
    assert info.capability == torch.backends.cpu.get_cpu_capability()
    assert info.fp32_gflops > 0.1 and info.bf16_gflops > 0.01
    assert info.reason
    # The decision agrees with the rule it documents, unless an override is set for the whole run.
    if not info.reason.startswith("PHALANX_CPU_BF16"):
        fast = info.bf16_slowdown <= capability._MAX_NATIVE_SLOWDOWN
        assert info.native == (info.capability in ("AVX512", "AMX") and info.instructions and fast)
    assert capability.cpu_bf16_support() is info  # measured once per process


def test_precision_fields():
    assert [(p.name, p.compute_dtype, p.master_dtype) for p in (FP32, BF16, FP16)] == [
        ("fp32", torch.float32, torch.float32), ("bf16", torch.bfloat16, torch.float32),
        ("fp16", torch.float16, torch.float32)]
    assert [p.mixed for p in (FP32, BF16, FP16)] == [False, True, True]
    assert [p.loss_scaling for p in (FP32, BF16, FP16)] == [False, False, True]
    assert [p.low_dtype for p in (FP32, BF16, FP16)] == [None, torch.bfloat16, torch.float16]
    assert f"{BF16}" == "bf16" and CHOICES == ("auto", "fp32", "bf16", "fp16", "fp8")
    assert resolve_precision(FP16) is FP16  # a Precision passes through unchanged
    with pytest.raises(dataclasses.FrozenInstanceError):
        FP32.name = "bf16"


@pytest.mark.parametrize("kind, auto", [("native", BF16), ("emulated", FP32)])
def test_auto_follows_the_cpu(cpu_kind, kind, auto):
    cpu_kind(kind)
    assert resolve_precision("auto", "cpu") is auto
    assert resolve_precision("fp32", "cpu") is FP32 and resolve_precision("fp16", "cpu") is FP16


def test_explicit_bf16_is_honoured_with_one_warning_where_it_crawls(cpu_kind):
    cpu_kind("emulated")
    with pytest.warns(UserWarning, match=r"without native bf16.*GFLOP/s.*precision=auto \(or fp32\)"):
        assert resolve_precision("bf16", "cpu") is BF16
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second request says nothing more
        assert resolve_precision("bf16", "cpu") is BF16
    cpu_kind("native")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_precision("bf16", "cpu") is BF16


def test_native_bf16_slower_than_fp32_trains_in_fp32(monkeypatch):
    """An AVX512-BF16 CPU without AMX (seen: an Intel Xeon under KVM, bf16 0.6x fp32's rate):
    bf16 is native (no emulation, weights may be packed) but `auto` trains in fp32 and an
    explicit bf16 warns that it is slower; the probe's rates decide, so they are faked here."""
    monkeypatch.delenv("PHALANX_CPU_BF16", raising=False)
    monkeypatch.setattr(capability.torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(capability, "_bf16_instructions", lambda: True)
    rates = {torch.float32: 143.0, torch.bfloat16: 83.0}
    monkeypatch.setattr(capability, "_matmul_gflops", lambda dtype, *a, **k: rates[dtype])
    monkeypatch.setattr(amp_precision, "_warned", set())
    capability.cpu_bf16_support.cache_clear()
    try:
        info = capability.cpu_bf16_support()
        assert info.native and not info.faster_than_fp32 and "slower than fp32" in info.reason
        assert capability.native_bf16("cpu") and not capability.bf16_is_fastest("cpu")
        assert resolve_precision("auto", "cpu") is FP32
        with pytest.warns(UserWarning, match=r"where bf16 is slower than fp32.*83\.0 GFLOP/s against 143\.0 for fp32, 1\.7x slower"):
            assert resolve_precision("bf16", "cpu") is BF16
        rates[torch.bfloat16] = 430.0  # the same CPU with AMX: bf16 ~3x faster
        capability.cpu_bf16_support.cache_clear()
        assert capability.cpu_bf16_support().faster_than_fp32 and resolve_precision("auto", "cpu") is BF16
    finally:
        capability.cpu_bf16_support.cache_clear()


def test_unknown_precision_and_override_are_refused_clearly(cpu_kind, monkeypatch):
    with pytest.raises(ValueError, match="auto, fp32, bf16, fp16"):
        resolve_precision("bfloat16")
    monkeypatch.setenv("PHALANX_CPU_BF16", "yes")
    capability.cpu_bf16_support.cache_clear()
    with pytest.raises(ValueError, match="PHALANX_CPU_BF16='yes'.*native.*emulated"):
        capability.cpu_bf16_support()


@pytest.mark.parametrize("kind", ["native", "emulated"])
def test_plugins_and_train_config_resolve_auto(cpu_kind, kind):
    from phalanx.booster.plugins import make_plugin
    from phalanx.config import ConfigError
    from phalanx.plan.run import layout_of
    from phalanx.train import TrainConfig

    cpu_kind(kind)
    want = BF16 if kind == "native" else FP32
    for name in ("ddp", "fsdp", "zero2", "gemini", "hybrid"):
        plugin = make_plugin(name, "auto")
        assert plugin.precision is want, name
        assert f"precision={want.name}," in plugin.describe(), name
        assert make_plugin(name, want).precision is want, name  # a resolved Precision passes through
    # A config keeps the name; whatever it reaches (the plugin, the planner's estimate) resolves it.
    cfg = TrainConfig(output_dir="unused", plugin="zero2", precision="auto")
    cfg.validate()
    assert cfg.precision == "auto"
    assert make_plugin(cfg.plugin, cfg.precision).precision is want
    assert layout_of(cfg, 2)[1]["dtype"] is want
    with pytest.raises(ConfigError, match="precision.*auto, fp32, bf16, fp16"):
        TrainConfig(output_dir="unused", precision="bfloat16").validate()


PRECISION_NAMES = {"fp32", "bf16", "fp16"}
REPO = Path(__file__).resolve().parents[2]


def _names_a_precision(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in PRECISION_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_precision(e) for e in node.elts)
    return False


def test_no_precision_name_comparisons_outside_the_precision_module():
    """Below the configs the precision is a `Precision`: code reads `.mixed`, `.loss_scaling`,
    `.compute_dtype`, never `precision == "fp16"` / `!= "fp32"` / `in ("bf16", ...)`."""
    found = []
    for root in ("framework", "apps"):
        for path in sorted((REPO / root).rglob("*.py")):
            if path.match("phalanx/amp/precision.py"):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Compare) and any(map(_names_a_precision, [node.left, *node.comparators])):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "compare a Precision's fields, not its name:\n" + "\n".join(found)


def test_fused_cross_entropy_multiplies_in_fp32_where_bf16_is_emulated(cpu_kind):
    """Same loss as the fp32 computation of the same bf16 values, gradients back in bf16."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(12, 16, generator=gen).to(torch.bfloat16).requires_grad_()
    weight = (0.3 * torch.randn(40, 16, generator=gen)).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 40, (12,), generator=gen)
    cpu_kind("emulated")
    loss = fused_linear_cross_entropy(hidden, weight, labels)
    loss.backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    exact = linear_cross_entropy_eager(hidden.detach().float(), weight.detach().float(), labels)
    # fp32 arithmetic on bf16 inputs: only summation order differs from the fp32 oracle.
    assert abs(loss.item() - exact.item()) <= 1e-5 * abs(exact.item())
    cpu_kind("native")
    native = fused_linear_cross_entropy(hidden.detach(), weight.detach(), labels)
    # bf16 logits: about 2^-8 relative rounding per logit; the loss (~4 nats here) moves by far less.
    assert abs(native.item() - exact.item()) <= 2e-2 * abs(exact.item())


def test_llama_eval_precision_auto_autocasts_only_on_native_cpus(cpu_kind):
    from transformers import LlamaConfig, LlamaForCausalLM

    from apps.llama.evaluate import Chunk, bits_per_char

    class Tok:  # characters as tokens: enough for bits_per_char
        eos_token_id, pad_token_id = 1, 0

        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [[2 + ord(ch) % 60 for ch in t] for t in texts]}

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    chunks = [Chunk(text="the quick brown fox " * 3, category="en"), Chunk(text="jumps over " * 4, category="en")]
    seen = []
    real_autocast = torch.autocast

    def spy(device_type, *args, **kw):
        seen.append(kw.get("enabled", True))
        return real_autocast(device_type, *args, **kw)

    results = {}
    for kind in ("emulated", "native"):
        cpu_kind(kind)
        seen.clear()
        torch.autocast = spy
        try:
            results[kind] = bits_per_char(model, Tok(), chunks, batch_size=2, precision="auto")["en"]["bpc"]
        finally:
            torch.autocast = real_autocast
        assert seen and all(flag == (kind == "native") for flag in seen), (kind, seen)
    # bf16 autocast moves bits per character by rounding only (6 bpc here; bf16 ~3 significant digits).
    assert abs(results["native"] - results["emulated"]) <= 0.02 * results["emulated"]


def _decide_with_rank_override():
    """Rank 0 sees a fast-bf16 CPU, rank 1 an emulating one; both must follow rank 1."""
    import os

    import torch.distributed as dist

    os.environ["PHALANX_CPU_BF16"] = "native" if dist.get_rank() == 0 else "emulated"
    capability.cpu_bf16_support.cache_clear()
    alone = capability._measured_cpu_bf16_support().native
    agreed = capability.agree_across_ranks()
    return alone, agreed.native, resolve_precision("auto", "cpu"), capability.cpu_bf16_support() is agreed


def test_ranks_agree_on_the_least_capable_decision():
    from phalanx.testing import spawn

    results = spawn(_decide_with_rank_override, 2)
    assert [r[0] for r in results] == [True, False]  # they measured differently
    assert all(r[1:] == (False, FP32, True) for r in results), results
