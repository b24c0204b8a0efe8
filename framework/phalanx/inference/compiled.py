"""The engine's compiled fast path: a decoder layer's elementwise work fused by inductor.

The decoder is written once, in `llama.DecoderModel.forward`. It takes its elementwise pieces —
residual add + norm, RoPE, SwiGLU (`llama.Pieces`) — as arguments; this module compiles those same
functions (`llama.norm` with the RMSNorm reference, `attention.rotate_`, SwiGLU's reference) and
hands the compiled forms to that forward. Everything else stays eager and is shared with the eager
path: the matmuls (through `DecoderLayer.linear`, so oneDNN-packed bf16 weights and LoRA wrappers
apply to both paths), the KV-cache write, the attention over the block tables, the collectives.
The pieces take the weights as arguments, so every layer shares one graph per piece.

Shapes: the row dimension (tokens in the step) is marked dynamic when a piece first compiles (one
graph for N >= 2, one for N = 1, which dynamo always specialises), so nothing is padded. On CPU the
compiled pieces run only for steps of at least `CPU_MIN_ROWS` tokens (prefills): at decode's few
dozen rows a compiled call costs as much as the eager ops it replaces (RMSNorm of [32, 576] bf16:
45 µs compiled, 40 µs eager; [4096, 576]: 3.0 ms against 12–22 ms, one thread, load 20).

Numerics: inductor is told to round where eager rounds (`emulate_precision_casts`), so a bf16 norm
matches eager's bits (RMSNorm [32, 576]: identical; [4096, 576]: 1 element in 2.4M differs, by one
bf16 step, from the fused mean's summation order).

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

from phalanx.inference.attention import rotate_
from phalanx.inference.llama import EAGER, Pieces, norm
from phalanx.observe.log import get_logger
from phalanx_kernels.glu import swiglu_reference
from phalanx_kernels.rmsnorm import rms_norm_reference

log = get_logger("phalanx.inference")

# Below this many parameters compile="auto" stays eager: the seconds of compilation never pay back.
AUTO_MIN_PARAMS = 10_000_000
# On CPU, steps with fewer tokens run the eager pieces (a compiled call's overhead is their cost).
CPU_MIN_ROWS = 64

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
    inductor_config.emulate_precision_casts = True  # round a bf16 intermediate where eager does
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
def is_supported(model) -> bool:
    """The compiled pieces cover the RMSNorm / RoPE / SwiGLU decoders (Llama, Mistral, Qwen2);
    the other families run eager."""
    if model.spec.family not in ("llama", "mistral", "qwen2"):
        return False
    plain_layers = all(getattr(layer, "q_norm", None) is None and getattr(layer, "gated", True)
                       and getattr(layer, "input_norm_bias", None) is None for layer in model.layers)
    extras = ("pos_embed", "project_in", "project_out", "norm_bias")
    return plain_layers and all(getattr(model, name, None) is None for name in extras)


class _Piece:
    """A compiled function whose `rows` arguments (by position) have the step's token count as
    their first dimension: marked dynamic while a new shape class compiles."""

    def __init__(self, fn, rows: tuple[int, ...], owner: "CompiledModelStep") -> None:
        self.fn = torch.compile(_fresh_copy(fn), backend="inductor", dynamic=None, fullgraph=True)
        self.rows, self.owner = rows, owner

    def __call__(self, *args, **kwargs):
        if self.owner._marking:
            for i in self.rows:
                if i < len(args) and isinstance(args[i], torch.Tensor) and args[i].shape[0] > 1:
                    torch._dynamo.mark_dynamic(args[i], 0)
            if isinstance(kwargs.get("residual"), torch.Tensor) and kwargs["residual"].shape[0] > 1:
                torch._dynamo.mark_dynamic(kwargs["residual"], 0)
        return self.fn(*args, **kwargs)


def _rms_norm_piece(x, weight, bias, eps: float, residual=None):
    """`llama.norm` through the RMSNorm's torch reference (the dispatching eager RMSNorm asks
    the device layer first, which dynamo need not trace)."""
    return norm(x, weight, bias, eps, residual, rms=rms_norm_reference)


class CompiledModelStep:
    """Runs `DecoderModel.forward` (the one decoder definition) with its elementwise pieces
    compiled: `llama.Pieces` of compiled functions, for steps of at least `min_rows` tokens (default:
    `CPU_MIN_ROWS` on CPU, every step elsewhere); smaller steps run the eager pieces."""

    def __init__(self, model, *, device: torch.device, min_rows: int | None = None) -> None:
        _configure_inductor()
        self.model, self.device = model, device
        self.min_rows = (CPU_MIN_ROWS if device.type == "cpu" else 1) if min_rows is None else min_rows
        self.pieces = Pieces(norm=_Piece(_rms_norm_piece, (0,), self), rotate=_Piece(rotate_, (0, 1, 2), self),
                             swiglu=_Piece(swiglu_reference, (0, 1), self))
        self.seen: set = set()  # shape classes of the model step already compiled (1: one row, 2: more)
        self.compile_seconds = 0.0  # total time of first calls (compilation) so far
        self._printed = False
        self._marking = False

    @staticmethod
    def shape_class(n: int) -> int:
        """What a step of n rows compiles as: 1 (dynamo specialises a single row) or 2 (2+ rows)."""
        return 1 if n == 1 else 2

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch, kv_caches, cos_table, sin_table):
        """Tokens [N] at positions [N] -> final hidden states [N, hidden], like DecoderModel.forward."""
        n = input_ids.shape[0]
        if n < self.min_rows:
            return self.model(input_ids, positions, batch, kv_caches, cos_table, sin_table, EAGER)
        key = self.shape_class(n)
        first_time = key not in self.seen
        self._marking = first_time and n > 1
        start = time.perf_counter()
        out = self.model(input_ids, positions, batch, kv_caches, cos_table, sin_table, self.pieces)
        self._marking = False
        if first_time:
            self.seen.add(key)
            elapsed = time.perf_counter() - start
            self.compile_seconds += elapsed
            if not self._printed:
                self._printed = True
                log.info("compiled the model step's norm/RoPE/SwiGLU pieces in %.1f s (inductor cache: %s)",
                         elapsed, inductor_cache_dir())
        return out
