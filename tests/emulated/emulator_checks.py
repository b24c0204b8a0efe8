"""Checks of the emulated GPU itself, run in one child process with PHALANX_EMULATE_GPU=1 by
test_emulator.py; prints one JSON object {check name: null if it passed, else what went wrong}."""
from __future__ import annotations

import json
import traceback

import torch

import phalanx  # noqa: F401 - installs the emulated GPU (PHALANX_EMULATE_GPU=1)
from phalanx.device import EMULATED_TYPE, device_module, display, emulated, is_accelerator, to_device
from phalanx.emulate import SYNCS

DEV = torch.device(EMULATED_TYPE, 0) if emulated() else None  # None where only the names are read
CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def raises(fn, *words: str) -> None:
    try:
        fn()
    except RuntimeError as exc:
        missing = [w for w in words if w not in str(exc)]
        assert not missing, f"error lacks {missing}: {exc}"
        return
    raise AssertionError("did not raise")


@check
def histc_counts_integer_tensors_as_cuda_does():
    """transformers' grouped MoE experts call histc on int32 expert ids on a GPU (float on the CPU);
    the CPU kernel refuses integers, so Mixtral failed outside the hybrid plugin under emulation."""
    ids = torch.tensor([0, 2, 2, 3, 5], dtype=torch.int32, device=DEV)
    counts = torch.histc(ids, bins=4, min=0, max=3)
    assert counts.device == DEV and counts.dtype == torch.int32, (counts.device, counts.dtype)
    assert counts.cpu().tolist() == [1, 0, 2, 1], counts.cpu().tolist()


@check
def the_device_context_still_builds_on_the_meta_device():
    """The pinned-memory factory wrappers must not hide the factories from `with torch.device(...)`
    (lazy, meta-device model building): before the fix, modules came out on the CPU."""
    with torch.device("meta"):
        layer = torch.nn.Linear(4, 4)
        empty = torch.empty(3)
    assert layer.weight.is_meta and empty.is_meta, (layer.weight.device, empty.device)


@check
def complex_products_and_their_gradients_match_the_cpu():
    """A conjugate (or negative) view only sets a bit that the wrapper could not carry: products with
    `conj()` and complex gradients (mul's backward uses `other.conj()`, as DeepSeek-V2's complex RoPE
    does) came out wrong before they were materialised."""
    torch.manual_seed(0)
    x0, w0 = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    freqs = torch.polar(torch.ones(4, 4), torch.randn(4, 4))

    def rope_loss(device):
        x = x0.clone().to(device).requires_grad_()
        rotated = torch.view_as_real(torch.view_as_complex(x.reshape(2, 4, 4, 2)) * freqs.to(device)).flatten(2)
        (rotated * w0.to(device)).sum().backward()
        return x.grad.cpu()

    a = torch.randn(3, dtype=torch.cfloat)
    assert torch.equal((a.to(DEV).conj() * a.to(DEV)).cpu(), a.conj() * a)
    assert torch.equal(a.to(DEV)._neg_view().cpu(), -a)
    torch.testing.assert_close(rope_loss(DEV), rope_loss("cpu"), rtol=0, atol=0)


@check
def the_accelerator_current_stream_waits_on_device_events():
    """FSDP2 waits on its all-gather events through torch.accelerator.current_stream() (after a
    recomputed forward): that stream must take the emulated device's events."""
    event = device_module().current_stream().record_event()
    torch.accelerator.current_stream().wait_event(event)
    torch.accelerator.current_stream(DEV).wait_event(event)
    assert torch.accelerator.current_stream() is device_module().current_stream()


@check
def mixing_a_device_and_a_cpu_tensor_raises_as_cuda_does():
    x = torch.ones(3, 4, device=DEV)
    raises(lambda: x + torch.ones(3, 4), "same device", "emucuda:0", "cpu")
    raises(lambda: torch.nn.Linear(4, 2)(x), "same device")
    assert (x * torch.tensor(2.0)).device == DEV  # a 0-dim CPU tensor is a scalar, as on CUDA
    assert x[torch.tensor([0, 2])].shape == (2, 4)  # CPU indices are allowed, as on CUDA


@check
def device_tensors_report_the_accelerator_and_compute_like_the_cpu():
    torch.manual_seed(0)
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    got = (a.to(DEV) @ b.to(DEV)).relu().sum(0)
    assert got.device == DEV and is_accelerator(got) and display(got.device) == "cuda:0 (emulated)"
    assert torch.equal(got.cpu(), (a @ b).relu().sum(0))


@check
def modules_move_in_place_and_train_with_autograd():
    m = torch.nn.Linear(4, 2)
    weight = m.weight
    m.to(DEV)
    assert m.weight is weight and m.weight.device == DEV  # identity kept, as param.data = cuda does
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    before = m.weight.detach().cpu().clone()
    m(torch.ones(3, 4, device=DEV)).square().sum().backward()
    assert m.weight.grad.device == DEV
    opt.step()
    assert not torch.equal(before, m.weight.detach().cpu())


@check
def setting_data_repoints_the_storage():
    p = torch.nn.Parameter(torch.zeros(4, device=DEV))
    flat = torch.zeros(8, device=DEV)
    p.data = flat[2:6]
    flat.add_(1.0)
    assert torch.equal(p.detach().cpu(), torch.ones(4))


@check
def device_to_host_transfers_are_counted():
    x = torch.arange(6.0, device=DEV)
    SYNCS.reset()
    x.sum().item()
    x.tolist()
    x.cpu()
    float(x[0])
    assert SYNCS.count == 4, dict(SYNCS.by_op)
    SYNCS.reset()
    y = x * 2 + 1
    y.to(DEV)
    assert SYNCS.count == 0, dict(SYNCS.by_op)


@check
def memory_statistics_follow_live_tensors():
    gpu = device_module(DEV)
    gpu.reset_peak_memory_stats(DEV)
    start = gpu.memory_allocated(DEV)
    big = torch.empty(1 << 20, device=DEV)  # 4 MiB
    assert gpu.memory_allocated(DEV) - start == 4 << 20
    del big
    assert gpu.memory_allocated(DEV) == start
    assert gpu.max_memory_allocated(DEV) - start >= 4 << 20


@check
def autocast_on_the_device_casts_as_cuda_autocast_does():
    x, w = torch.randn(4, 8, device=DEV), torch.randn(8, 8, device=DEV)
    with torch.autocast(EMULATED_TYPE, dtype=torch.bfloat16):
        y = x @ w
        s = torch.softmax(y, -1)
        n = torch.nn.functional.layer_norm(y, (8,))
    assert (y.dtype, s.dtype, n.dtype) == (torch.bfloat16, torch.float32, torch.float32)


@check
def random_numbers_come_from_the_device_generator():
    torch.manual_seed(3)
    cpu_state = torch.get_rng_state()
    a = torch.randn(4, device=DEV)
    assert torch.equal(torch.get_rng_state(), cpu_state)  # the CPU stream is untouched
    torch.manual_seed(3)
    assert torch.equal(torch.randn(4, device=DEV).cpu(), a.cpu())


@check
def nested_batches_move_with_one_helper():
    batch = {"ids": torch.ones(2, 3, dtype=torch.long), "extra": [torch.zeros(1), ("x", torch.ones(1))], "n": 3}
    moved = to_device(batch, DEV)
    assert moved["ids"].device == DEV and moved["extra"][0].device == DEV and moved["extra"][1][1].device == DEV
    assert moved["n"] == 3 and moved["extra"][1][0] == "x"


@check
def triton_kernels_dispatch_on_device_tensors_through_the_interpreter():
    import phalanx_kernels as pk
    from phalanx_kernels.rmsnorm import rms_norm_reference

    if not pk.dispatch.triton_available():
        return
    x, w = torch.randn(4, 32), torch.randn(32)
    assert pk.dispatch.use_triton(x.to(DEV))
    got = pk.rms_norm(x.to(DEV), w.to(DEV), 1e-6)
    assert got.device == DEV
    torch.testing.assert_close(got.cpu(), rms_norm_reference(x, w, 1e-6), rtol=1e-5, atol=1e-5)


@check
def the_loss_scaler_checks_every_gradient_with_one_host_sync():
    from phalanx.amp.loss_scaler import DynamicLossScaler

    grads = [torch.ones(4, device=DEV) for _ in range(10)]
    SYNCS.reset()
    assert DynamicLossScaler.found_inf(grads) is False
    assert SYNCS.count == 1, dict(SYNCS.by_op)  # was one per gradient
    grads[7][2] = float("inf")
    assert DynamicLossScaler.found_inf(grads) is True


def main() -> None:
    results = {}
    for name, fn in CHECKS.items():
        try:
            fn()
            results[name] = None
        except Exception:  # noqa: BLE001 - reported per check
            results[name] = traceback.format_exc()[-3000:]
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
