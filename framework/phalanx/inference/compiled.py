"""The engine's compiled fast path: the model step with its elementwise work fused by inductor.

What is compiled: everything of a decoder layer that is not attention or a collective — the bias
and residual adds, RMSNorm, the q/k/v and gate/up matmuls, RoPE and SwiGLU — as two pieces per
layer (`attention_input`: residual add, norm, q/k/v, RoPE; `mlp`: o-bias and residual add, norm,
gate/up, SwiGLU, down), plus the final norm. What stays eager between the pieces: the KV-cache
write, the loop over attention groups and prefill segments (they change every step), the
o-projection and, with tensor parallelism, the all-reduces. The pieces take the weights as
arguments, so the 30 layers of a model share one compiled graph per piece.

Shapes: every step has a different number of tokens N. On CPU the row dimension is marked
dynamic (one graph per piece for N >= 2, one for N = 1, which dynamo always specialises), so
nothing is padded. With `shapes="buckets"` (the CUDA default) N is padded up to one of a few
bucket sizes (1, 2, 4, 8, 12, 16, 24, 32, 48, ...) and each bucket is compiled statically; on CUDA
these pieces then run as CUDA graphs (`mode="reduce-overhead"`), which needs static shapes.

The numerics are the eager path's, op for op (RMSNorm's statistics in fp32, RoPE as in HF); the
fused kernels reduce in a different order, so results agree to rounding, not bit for bit.

Compilation needs a working C++ compiler on CPU: `probe_compiler()` compiles a tiny function
once per process and says why not when it fails; the runner then stays eager. Inductor's FX graph
cache lives under `$PHALANX_CACHE/inductor` (default ~/.cache/phalanx/inductor) unless
TORCHINDUCTOR_CACHE_DIR is set, so a second process reuses the compiled kernels.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
import types

import torch
import torch.nn.functional as F

from phalanx.observe.log import get_logger

log = get_logger("phalanx.inference")

# Below this many parameters compile="auto" stays eager: the seconds of compilation never pay back.
AUTO_MIN_PARAMS = 10_000_000

_probe_lock = threading.Lock()
_probe_reason: dict[str, str | None] = {}  # device type -> None (works) or why not


def inductor_cache_dir() -> str:
    """Point inductor's on-disk caches at the phalanx cache, unless the user chose a directory
    (inductor itself writes its per-user /tmp default into the variable on first use, so that
    value does not count as a choice)."""
    from torch._inductor.runtime.runtime_utils import default_cache_dir
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not current or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        from phalanx.pretrained import cache_root
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def _configure_inductor() -> None:
    import torch._inductor.config as inductor_config
    inductor_cache_dir()
    inductor_config.fx_graph_cache = True
    # Compile in this process: no pool of compile workers (forked from a server thread or a TP rank,
    # on a machine with a few cores, they cost more than they save).
    inductor_config.compile_threads = 1


def _probe_function(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x) * x + 1.0


def probe_compiler(device: torch.device | str = "cpu") -> str | None:
    """None when torch.compile works on this device type, else one line saying why not. The
    tiny probe is compiled once per process and device type (later calls return the cached
    answer)."""
    kind = torch.device(device).type
    with _probe_lock:
        if kind not in _probe_reason:
            _probe_reason[kind] = _run_probe(kind)
        return _probe_reason[kind]


def _run_probe(kind: str) -> str | None:
    if kind == "cpu":
        try:
            import torch._inductor.config as inductor_config
            cxx = inductor_config.cpp.cxx[-1] if isinstance(inductor_config.cpp.cxx, tuple) else inductor_config.cpp.cxx
        except Exception as e:  # noqa: BLE001 - any failure to import inductor means no compile
            return f"torch inductor is unavailable ({type(e).__name__}: {e})"
        cxx = os.environ.get("CXX") or cxx or "g++"
        if shutil.which(cxx) is None:
            return f"no C++ compiler found ({cxx!r} is not on PATH; install g++ or set CXX)"
    elif kind != "cuda":
        return f"compile is only used on CPU and CUDA, not {kind}"
    try:
        _configure_inductor()
        fn = torch.compile(_fresh_copy(_probe_function), backend="inductor", dynamic=False, fullgraph=True)
        x = torch.linspace(-2, 2, 16, device=kind)
        got = fn(x)
        if not torch.allclose(got, _probe_function(x), rtol=1e-5, atol=1e-6):
            return "the compiled probe function computed a wrong result"
    except Exception as e:  # noqa: BLE001 - a broken toolchain fails in many ways; all mean eager
        first_line = (str(e).strip().splitlines() or [""])[0][:200]
        return f"torch.compile failed on a probe function ({type(e).__name__}: {first_line})"
    return None


def _fresh_copy(fn):
    """The same function with its own code object. Dynamo keeps its compiled graphs (and the
    recompile limit) per code object, so each runner compiles into caches of its own: two engines
    with different models in one process neither evict nor count against each other."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


# -- the compiled pieces ------------------------------------------------------------------------------
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The eager reference's RMSNorm, op for op: statistics in fp32, cast back, then the weight."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] rotated like the eager path: x * cos + rotate_half(x) * sin on the halves."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def attention_input(h, h_bias, residual, norm_weight, eps: float, qkv_weight, qkv_bias, cos, sin,
                    heads: int, kv_heads: int, head_dim: int):
    """The previous block's output h (+ its bias, added after the TP reduce) + residual -> RMSNorm
    -> q/k/v -> RoPE. Returns q [N, Hq, D], k and v [N, Hkv, D], and the new residual."""
    if h_bias is not None:
        h = h + h_bias
    if residual is not None:
        h = h + residual
    x = _rms_norm(h, norm_weight, eps)
    qkv = F.linear(x, qkv_weight, qkv_bias)
    n = h.shape[0]
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q = _rope(qkv[:, :q_size].view(n, heads, head_dim), cos, sin)
    k = _rope(qkv[:, q_size:q_size + kv_size].view(n, kv_heads, head_dim), cos, sin)
    v = qkv[:, q_size + kv_size:].reshape(n, kv_heads, head_dim)
    return q, k, v, h


def mlp(o, o_bias, residual, norm_weight, eps: float, gate_up_weight, gate_up_bias, down_weight, inter: int):
    """The attention block's output o (+ bias) + residual -> RMSNorm -> gate/up -> SwiGLU -> down
    (without its bias, which is added after the TP reduce). Returns (down output, new residual)."""
    if o_bias is not None:
        o = o + o_bias
    h = o + residual
    x = _rms_norm(h, norm_weight, eps)
    gate_up = F.linear(x, gate_up_weight, gate_up_bias)
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    return F.linear(act, down_weight), h


def final_norm(h, h_bias, residual, norm_weight, eps: float):
    if h_bias is not None:
        h = h + h_bias
    if residual is not None:
        h = h + residual
    return _rms_norm(h, norm_weight, eps)


# -- shapes ---------------------------------------------------------------------------------------------
def bucket_sizes(limit: int) -> list[int]:
    """1, 2, 4, 8, then each power of two p >= 8 and 1.5 p, up to the first size >= limit: at most
    ~2 log2(limit) graphs per piece, padding a step by less than 50%."""
    sizes = [1, 2, 4]
    p = 8
    while sizes[-1] < limit:
        sizes += [p, p + p // 2]
        p *= 2
    return [s for s in sizes if s < limit] + [next(s for s in sizes if s >= limit)]


def bucket_for(n: int, sizes: list[int]) -> int:
    for s in sizes:
        if s >= n:
            return s
    raise ValueError(f"a step of {n} tokens exceeds the largest compiled bucket ({sizes[-1]}); "
                     f"raise max_num_batched_tokens")


def is_supported(model) -> bool:
    """The pieces implement the Llama-style decoder (Llama, Mistral, Qwen2: RMSNorm, RoPE, gated
    SwiGLU MLP, no q/k norm, no learned positions or embedding projections); anything else runs
    eager."""
    if model.spec.family not in ("llama", "mistral", "qwen2"):
        return False
    plain_layers = all(getattr(layer, "q_norm", None) is None and getattr(layer, "gated", True)
                       and getattr(layer, "input_norm_bias", None) is None for layer in model.layers)
    extras = ("pos_embed", "project_in", "project_out", "norm_bias")
    return plain_layers and all(getattr(model, name, None) is None for name in extras)


class CompiledModelStep:
    """Runs `LlamaModel.forward`'s computation through compiled pieces, attention eager between.

    shapes: "dynamic" (rows marked dynamic, nothing padded; the CPU default) or "buckets" (rows
    padded to `bucket_sizes`, one static graph per bucket; CUDA, where the graphs are captured).
    """

    def __init__(self, model, *, device: torch.device, max_tokens: int, shapes: str | None = None) -> None:
        if shapes is None:
            shapes = "buckets" if device.type == "cuda" else "dynamic"
        if shapes not in ("dynamic", "buckets"):
            raise ValueError(f"shapes={shapes!r}: choose 'dynamic' or 'buckets'")
        _configure_inductor()
        self.model, self.device, self.shapes = model, device, shapes
        self.buckets = bucket_sizes(max_tokens)
        self.cuda_graphs = device.type == "cuda" and shapes == "buckets"
        mode = "reduce-overhead" if self.cuda_graphs else None
        dynamic = False if shapes == "buckets" else None
        if shapes == "buckets":
            import torch._dynamo.config as dynamo_config
            # one static graph per bucket and piece variant (first layer, other layers)
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 2 * len(self.buckets) + 2)

        def compile_(fn):
            return torch.compile(_fresh_copy(fn), backend="inductor", mode=mode, dynamic=dynamic, fullgraph=True)

        self._attention_input = compile_(attention_input)
        self._mlp = compile_(mlp)
        self._final_norm = compile_(final_norm)
        self.seen: set = set()  # shape classes of the model step already compiled
        self.compile_seconds = 0.0  # total time of first calls (compilation) so far
        self._printed = False
        self._marking = False

    def shape_class(self, n: int) -> int:
        """What a step of n rows compiles as: its bucket, or with dynamic rows 1 (specialised) or 2+."""
        if self.shapes == "buckets":
            return bucket_for(n, self.buckets)
        return 1 if n == 1 else 2

    def _rows(self, *tensors: torch.Tensor) -> None:
        """Mark the row dimension dynamic while a new shape class compiles (later calls match the
        compiled graphs' guards without marks)."""
        if self._marking:
            for t in tensors:
                torch._dynamo.mark_dynamic(t, 0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch, kv_caches, cos_table, sin_table):
        """Tokens [N] at positions [N] -> final hidden states [N, hidden], like LlamaModel.forward."""
        from phalanx.inference.attention import paged_attention, store_kv

        model = self.model
        n = input_ids.shape[0]
        key = self.shape_class(n)
        first_time = key not in self.seen
        self._marking = first_time and self.shapes == "dynamic" and n > 1
        start = time.perf_counter()
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        rows = n if self.shapes == "dynamic" else key
        if rows != n:  # pad: the extra rows are computed and ignored (attention and the cache see n)
            input_ids = F.pad(input_ids, (0, rows - n))
            positions = F.pad(positions, (0, rows - n))
        h = F.embedding(input_ids, model.embed)
        cos, sin = cos_table.index_select(0, positions), sin_table.index_select(0, positions)
        self._rows(h, cos, sin)
        residual = h_bias = None
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches):
            if residual is not None:
                self._rows(h, residual)
            q, k, v, residual = self._attention_input(
                h, h_bias, residual, layer.input_norm, layer.eps, layer.qkv_weight, layer.qkv_bias, cos, sin,
                layer.heads, layer.kv_heads, layer.head_dim)
            if rows != n:
                q, k, v = q[:n], k[:n], v[:n]
            store_kv(k, v, k_cache, v_cache, batch.slot_mapping, batch.skips_slots)
            attn = paged_attention(q, k, v, k_cache, v_cache, batch, layer.sliding_window)
            if rows != n:
                attn = torch.cat((attn, attn.new_zeros(rows - n, *attn.shape[1:])))
            o = model._reduce(layer.linear("o", attn.view(rows, layer.q_size), bias=False))
            self._rows(o, residual)
            h, residual = self._mlp(o, layer.o_bias, residual, layer.post_norm, layer.eps, layer.gate_up_weight,
                                    layer.gate_up_bias, layer.down_weight, layer.inter)
            h = model._reduce(h)
            h_bias = layer.down_bias
        if residual is not None:
            self._rows(h, residual)
        out = self._final_norm(h, h_bias, residual, model.norm, model.spec.norm_eps)
        if rows != n:
            out = out[:n]
        if first_time:
            self.seen.add(key)
            elapsed = time.perf_counter() - start
            self.compile_seconds += elapsed
            if not self._printed:
                self._printed = True
                log.info("compiled the model step for %s in %.1f s (inductor cache: %s)",
                            "1 token" if key == 1 else f"{key} tokens" if self.shapes == "buckets" else "N tokens",
                            elapsed, inductor_cache_dir())
        return out
