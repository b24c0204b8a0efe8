"""CUDA graphs of the decode step: one captured forward per batch size, replayed.

Measured on an H100 (docs/gpu.md), the eager engine spent 1.7 s of host time and 0.15 s of GPU
time on 32 prompts x 64 tokens of a SmolLM2-135M-shaped model: ~640 kernel launches per decode
step, each paid for in Python, and the GPU idle ~90% of the time. A CUDA graph launches the whole
step's kernels with one call.

What is captured: the model's forward and the LM head for B one-token sequences (B in `sizes`),
reading fixed device buffers — token ids, positions, cache slots, block tables of the widest
possible sequence (max_model_len), context lengths. A step of n <= B decodes copies its inputs
into the first n rows, points the other B - n rows at a scratch KV block that no sequence owns
(each writes its key there and attends to it alone), replays the graph of the smallest B >= n
and returns the first n rows of its logits (copied out of the graph's memory).

When: steps whose every chunk is one token with one logit (decode, and the draft model's
proposals), on CUDA, for dense models (mixture-of-experts routing and multi-head latent attention
stay eager), without tensor parallelism. With LoRA adapters each row's adapter is a one-hot over
every slot in a fixed buffer, so one capture serves any mix of adapters; an adapter that adapts a
matmul no loaded adapter adapted before changes the forward, and the sizes are captured again.
Prefills, chunked prefills and speculative verification run eagerly as before. Each batch size is
captured the first time a step needs it (two warm-up forwards, then the capture), so a server
pays nothing for sizes it never sees.

Off CUDA the same buffers and padding run with `mode="eager"` (the forward called on the buffers
instead of a replay): the tests check it token for token against the normal path on the CPU, and
the graph-specific part (capture and replay) on a GPU (`gpu` tests).
"""
from __future__ import annotations

from typing import Callable

import torch

from phalanx.inference.attention import AttentionBatch, BatchedGroup
from phalanx.observe.log import get_logger

log = get_logger("phalanx.inference")
# A replay may differ from the eager step only by rounding (relative to the largest logit): the
# same kernels run, though a library may pick another algorithm inside a capture.
VERIFY_TOLERANCE = 1e-2


def batch_sizes(max_num_seqs: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (and it)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16)) + [max_num_seqs]
    return sorted(set(sizes))


def unsupported_reason(runner) -> str | None:
    """Why the runner's model cannot run captured decode steps (None: it can)."""
    layers = runner.model.layers
    if any(layer.mla for layer in layers):
        return "multi-head latent attention (DeepSeek) runs eagerly"
    if any(layer.sparse for layer in layers):
        return "mixture-of-experts routing runs eagerly"
    if runner.tp.size > 1:
        return "tensor parallelism runs eagerly"
    return None


class DecodeGraphs:
    """The captured decode steps of one `ModelRunner` (see the module docstring)."""

    def __init__(self, runner, scratch_block: int, *, mode: str | None = None) -> None:
        mode = mode or ("cuda" if runner.device.type == "cuda" else "eager")
        if mode not in ("cuda", "eager"):
            raise ValueError(f"DecodeGraphs mode={mode!r}: 'cuda' or 'eager'")
        self.runner, self.mode, self.scratch_block = runner, mode, scratch_block
        self.block_size = runner.block_size
        self.sizes = batch_sizes(runner.config.max_num_seqs)
        self.max_batch = self.sizes[-1]
        self.width = -(-runner.max_model_len // self.block_size)  # blocks of the longest sequence
        device = runner.device
        self.ids = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.slots = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.context_lens = torch.ones(self.max_batch, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(self.max_batch, self.width, dtype=torch.long, device=device)
        lora = runner.lora
        # LoRA: each row's adapter as a one-hot over every slot (padding rows: none), so the captured
        # delta matmuls have one shape whichever adapters a step mixes
        self.lora_mask = (torch.zeros(self.max_batch, lora.max_loras, dtype=lora.dtype, device=device)
                          if lora is not None else None)
        self._lora_structure = lora.structure if lora is not None else 0
        self._pad(0, self.max_batch)
        self.steps: dict[int, Callable[[], torch.Tensor]] = {}  # batch size -> run the step, get its logits
        self.replays = self.captures = 0

    def accepts(self, chunks) -> bool:
        """Whether this step is a plain decode step the graphs can run."""
        return (0 < len(chunks) <= self.max_batch and (self.runner.lora is None) == (self.lora_mask is None)
                and all(len(c.token_ids) == 1 and c.num_logits == 1 and c.start > 0 for c in chunks))

    def run(self, chunks) -> torch.Tensor | None:
        """Logits [len(chunks), vocab shard] of one decode step; None when capturing this batch size
        failed or its replay disagreed with the eager step (then the runner drops the graphs, says
        why in one warning, and runs this step and every later one eagerly)."""
        n = len(chunks)
        size = next(s for s in self.sizes if s >= n)
        bs = self.block_size
        needed = [c.start // bs + 1 for c in chunks]
        width = max(needed)
        flat = [c.token_ids[0] for c in chunks] + [c.start for c in chunks]
        flat += [c.block_table[c.start // bs] * bs + c.start % bs for c in chunks]
        flat += [c.start + 1 for c in chunks]
        for c, k in zip(chunks, needed):
            flat += c.block_table[:k] + [self.scratch_block] * (width - k)
        host = torch.tensor(flat, dtype=torch.long)
        staged = host.to(self.runner.device, non_blocking=True)
        self.ids[:n].copy_(staged[:n])
        self.positions[:n].copy_(staged[n:2 * n])
        self.slots[:n].copy_(staged[2 * n:3 * n])
        self.context_lens[:n].copy_(staged[3 * n:4 * n])
        self.block_tables[:n, :width].copy_(staged[4 * n:].view(n, width))
        if self.lora_mask is not None:
            self._set_adapters(chunks)
        if size > n:
            self._pad(n, size)
        if size not in self.steps:
            try:
                step = self._capture(size)
                self._verify(step, size, n)
            except Exception as e:  # noqa: BLE001 -- any failure: this engine decodes eagerly from here on
                self._disable(f"capturing the {size}-row decode step failed ({type(e).__name__}: {e})")
                return None
            self.steps[size] = step
        self.replays += 1
        return self.steps[size]()[:n].clone()

    def _verify(self, step: Callable[[], torch.Tensor], size: int, n: int) -> None:
        """A new capture's first replay against the eager forward on the same rows (both write the
        same keys to the same slots): a graph that computes anything else is never used."""
        expected = self._forward(size)[:n].float()
        got = step()[:n].float()
        error = (got - expected).abs().max().item()
        scale = expected.abs().max().item()
        if not error <= VERIFY_TOLERANCE * max(scale, 1e-6):
            raise RuntimeError(f"its logits differ from the eager step's by {error:.3g} (largest logit {scale:.3g})")

    def _disable(self, why: str) -> None:
        log.warning("decode steps run eagerly: %s", why)
        self.runner.graphs, self.runner.graphs_reason = None, why

    def _set_adapters(self, chunks) -> None:
        """Each row's adapter slot into the mask; a matmul that gained adapter factors since the
        captures (a newly loaded adapter adapts it) changes the forward: capture again. Factors
        loaded into existing stacks are written in place, which the graphs read as they are."""
        lora = self.runner.lora
        if lora.structure != self._lora_structure:
            self.steps.clear()
            self._lora_structure = lora.structure
        slots = torch.tensor([c.lora_slot for c in chunks])
        rows = torch.nn.functional.one_hot(slots, lora.max_loras + 1)[:, 1:].to(self.lora_mask.dtype)
        self.lora_mask[:len(chunks)].copy_(rows.to(self.lora_mask.device, non_blocking=True))

    def _pad(self, start: int, end: int) -> None:
        """Rows [start, end) decode a dummy token into the scratch block and attend to it alone."""
        self.ids[start:end] = 0
        self.positions[start:end] = 0
        self.slots[start:end] = self.scratch_block * self.block_size
        self.context_lens[start:end] = 1
        self.block_tables[start:end, 0] = self.scratch_block
        if self.lora_mask is not None:
            self.lora_mask[start:end] = 0

    def _forward(self, size: int) -> torch.Tensor:
        model, runner = self.runner.model, self.runner
        if runner.lora is not None:
            runner.lora.use_mask(self.lora_mask[:size])
        batch = AttentionBatch(slot_mapping=self.slots[:size], block_size=self.block_size,
                               groups=[BatchedGroup(0, size, 1, self.block_tables[:size], self.context_lens[:size])])
        with torch.inference_mode():
            hidden = model(self.ids[:size], self.positions[:size], batch, runner.kv_caches, runner.cos, runner.sin)
            return model.logits(hidden)

    def _capture(self, size: int) -> Callable[[], torch.Tensor]:
        self.captures += 1
        if self.mode == "eager":
            return lambda: self._forward(size)
        # The capture records whatever the current rows hold: padding rows only, so the warm-up and
        # capture forwards write their keys to the scratch block alone.
        buffers = [self.ids, self.positions, self.slots, self.context_lens]
        buffers += [self.lora_mask] if self.lora_mask is not None else []
        saved = [t[:size].clone() for t in buffers]
        saved_tables = self.block_tables[:size].clone()
        self._pad(0, size)
        stream = torch.cuda.Stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # first calls pick kernels and allocate workspaces outside the capture
                self._forward(size)
        torch.cuda.current_stream(self.runner.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA work another thread may do meanwhile (the server's) is not the capture's concern
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            logits = self._forward(size)
        for t, values in zip(buffers, saved):
            t[:size].copy_(values)
        self.block_tables[:size].copy_(saved_tables)

        def replay() -> torch.Tensor:
            graph.replay()
            return logits
        return replay
