"""Runs the model for one step: packs the scheduled chunks into flat tensors, owns the KV cache,
and, with tensor parallelism, drives the other ranks.

A step is a list of `Chunk`s, one per sequence: the tokens to run, the position of the first,
the sequence's block table, and how many of its last positions need logits (0 for a prompt chunk
that does not end the prompt, 1 to sample, k + 1 to verify k speculative tokens). Everything a
rank needs to run the step is packed into one int64 tensor, so a TP step costs the driver two
small broadcasts (header, payload) before the forward, and one gather of the logits' vocabulary
slices after it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from phalanx_kernels.accelerator import device_module, is_accelerator

from phalanx.amp.precision import resolve_precision, warn_if_emulated_bf16
from phalanx.inference import compiled, cuda_graphs
from phalanx.inference.attention import AttentionBatch, BatchedGroup, PrefillSegment
from phalanx.inference.config import EngineConfig
from phalanx.inference.llama import LlamaModel, ModelSpec, kv_bytes_per_block, rope_tables
from phalanx.inference.tp import TPGroup

_CMD_STOP, _CMD_STEP, _CMD_KEEPALIVE = 0, 1, 2
_HEADER = 8
_MAX_BATCHED_Q = 16  # equal-length chunks up to this length run as batched (gathered) groups
_GROUP_COST_BLOCKS = 32  # one more decode group costs about as much as gathering this many blocks


def split_by_length(items: list[int], blocks: list[int]) -> list[list[int]]:
    """Sort sequences by the blocks they read and cut them into contiguous groups minimising
    sum(group size x its longest sequence) + a fixed cost per group: each group is padded to its
    longest member, so mixing short and long sequences wastes gathers and attention work."""
    if not items:
        return []
    order = sorted(range(len(items)), key=lambda j: blocks[j])
    size = [blocks[j] for j in order]
    n = len(order)
    best = [0] + [None] * n  # best[j]: cost of the first j sequences
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # last group is order[i:j], padded to size[j - 1]
            cost = best[i] + (j - i) * size[j - 1] + _GROUP_COST_BLOCKS
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j > 0:
        groups.append([items[order[k]] for k in range(cut[j], j)])
        j = cut[j]
    return groups[::-1]


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        compiled.log.warning(message)


@dataclass
class Chunk:
    token_ids: list[int]
    start: int  # position of token_ids[0]
    block_table: list[int]
    num_logits: int = 1
    lora_slot: int = 0  # the sequence's LoRA adapter slot (0: the base model)


def resolve_dtype(name: str, config, device: torch.device) -> torch.dtype:
    """The engine's compute dtype. `auto` follows the hardware by `precision: auto`'s one rule
    (`phalanx.amp.precision.resolve_precision`): bf16 where `device` computes bf16 faster than fp32
    (CUDA with bf16; a CPU with AMX whose bf16 matmul measures faster), fp32 elsewhere, whatever
    the checkpoint's dtype (an fp32 checkpoint serves in bf16 on an AMX CPU; a bf16 checkpoint
    serves in fp32 on an AVX2-only CPU, where bf16 is emulated). An explicit bfloat16 is honoured,
    with a warning where it will crawl."""
    if name != "auto":
        if name == "bfloat16":
            warn_if_emulated_bf16(device, what="dtype=bfloat16", fix="dtype=auto (or float32)")
        return getattr(torch, name)
    dtype = resolve_precision("auto", device).compute_dtype
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    stored = getattr(torch, stored) if isinstance(stored, str) else stored
    if stored is not None and stored != dtype:
        _log_once(f"dtype=auto: the checkpoint is {stored}, serving in {dtype} (fastest on {device.type}); "
                  f"pass dtype=... to choose")
    return dtype


class ModelRunner:
    lora = None  # the engine's `lora.LoraAdapters` when it serves adapters: told each step's token slots

    def __init__(self, spec: ModelSpec, *, engine_config: EngineConfig, tp: TPGroup, device: torch.device,
                 dtype: torch.dtype, max_model_len: int) -> None:
        self.spec, self.config, self.tp = spec, engine_config, tp
        self.device, self.dtype = device, dtype
        self.block_size = engine_config.block_size
        self.max_model_len = max_model_len
        with torch.device("meta"):  # no host copy of the weights: parameters are born on the device
            model = LlamaModel(spec, tp_rank=tp.rank, tp_size=tp.size, all_reduce=tp.all_reduce)
        model = model.to(dtype=dtype)
        for layer in model.layers:  # weights transformers keeps in fp32 whatever the dtype (DeepSeek's router)
            for name in layer.fp32_params:
                if getattr(layer, name) is not None:
                    setattr(layer, name, torch.nn.Parameter(getattr(layer, name).float(), requires_grad=False))
        self.model = model.to_empty(device=device)
        torch.nn.init.zeros_(self.model.lm_head)
        self.model.eval()
        self.cos, self.sin = (t.to(dtype) for t in rope_tables(spec, max_model_len, device))
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.compiled: compiled.CompiledModelStep | None = None
        self.compile_reason = self._setup_compile(getattr(engine_config, "compile", "auto"))
        self.graphs: cuda_graphs.DecodeGraphs | None = None  # built with the KV cache (it needs a scratch block)
        self.graphs_reason = self._graphs_reason(getattr(engine_config, "cuda_graphs", "auto"))

    def _graphs_reason(self, setting) -> str | None:
        """None when decode steps will run as CUDA graphs, else why not (an error when asked for
        with cuda_graphs=True and impossible here)."""
        why = ("cuda_graphs=False" if setting is False else
               f"CUDA graphs need a CUDA device (this engine runs on {self.device})" if self.device.type != "cuda"
               else cuda_graphs.unsupported_reason(self))
        if why is not None and setting is True:
            raise ValueError(f"EngineConfig.cuda_graphs=True, but {why}: set cuda_graphs='auto' or False")
        return why

    def _setup_compile(self, setting) -> str:
        """Build the compiled model step when `setting` and the machine allow; else say why not,
        in one log line when compilation was wanted but cannot work here."""
        if setting is False:
            return "compile=False"
        num_params = sum(p.numel() for p in self.model.parameters())
        if setting == "auto" and self.device.type == "cpu":  # quietly: measured no faster on CPU
            return "compile='auto' runs eagerly on CPU (compiled was no faster there: docs/inference.md)"
        if setting == "auto" and num_params < compiled.AUTO_MIN_PARAMS:  # quietly: nothing is lost
            return f"compile='auto' skips models under {compiled.AUTO_MIN_PARAMS:,} parameters"
        why = (None if compiled.is_supported(self.model) else f"no compiled path for {self.spec.family!r} models")
        why = why or compiled.probe_compiler(self.device)
        if why is not None:
            _log_once(f"running the model eagerly ({why})")
            return why
        self.compiled = compiled.CompiledModelStep(self.model, device=self.device)
        return "a working compiler was found"

    # -- KV cache --------------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.spec, self.block_size, self.tp.size, self.dtype)

    def kv_budget_bytes(self) -> int:
        """Memory this rank may give the KV cache: what is left of the GPU after weights and a
        profiled step's activations, or the configured CPU budget."""
        if not is_accelerator(self.device):
            return int(self.config.kv_cache_memory_gib * 2**30)
        gpu = device_module(self.device)
        gpu.synchronize(self.device)
        gpu.empty_cache()
        gpu.reset_peak_memory_stats(self.device)
        before = gpu.memory_allocated(self.device)
        self._profile_step()
        activations = gpu.max_memory_allocated(self.device) - before
        free, total = gpu.mem_get_info(self.device)
        used_by_others_and_us = total - free
        return int(total * self.config.gpu_memory_utilization - used_by_others_and_us - activations)

    def _profile_step(self) -> None:
        """A forward of the largest step (one fresh prompt of the full token budget), writing
        nowhere, to measure activation memory."""
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        caches = [(torch.zeros(1, self.block_size, l.cache_heads, l.cache_dim, dtype=self.dtype,
                               device=self.device),) * 2 for l in self.model.layers]
        batch = AttentionBatch(slot_mapping=torch.full((n,), -1, device=self.device), block_size=self.block_size,
                               skips_slots=True, prefills=[PrefillSegment(0, n, n, None)])
        with torch.inference_mode():
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            hidden = self.model(ids, torch.arange(n, device=self.device), batch, caches, self.cos, self.sin)
            self.model.logits(hidden[-1:])
        device_module(self.device).synchronize(self.device)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Key and value caches [blocks, block_size, heads, dim] per layer; under multi-head latent
        attention one latent cache per layer, which is both (`mla`)."""
        self.kv_caches = []
        captured = self.graphs_reason is None  # one block more: the captured steps' padding rows write there
        for layer in self.model.layers:
            shape = (num_blocks + captured, self.block_size, layer.cache_heads, layer.cache_dim)
            keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
            values = keys if layer.mla else torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.kv_caches.append((keys, values))
        self.num_blocks = num_blocks
        self.graphs = cuda_graphs.DecodeGraphs(self, scratch_block=num_blocks) if captured else None

    # -- packing ---------------------------------------------------------------------------------
    def pack(self, chunks: list[Chunk]) -> torch.Tensor:
        """Lay the chunks out as one flat step (batched groups first) in a single int64 tensor:
        header, then token ids, positions, slots, groups (sizes, block tables, context lengths),
        prefill segments and their block tables, and the rows that need logits."""
        bs = self.block_size
        lens = [len(c.token_ids) for c in chunks]
        # decodes and short chunks over a cache (verification of k proposals) run as batched
        # groups, one set per chunk length; prompts (and longer chunks) as prefill segments
        by_length: dict[int, list[int]] = {}
        for i, c in enumerate(chunks):
            if lens[i] == 1 or (c.start > 0 and lens[i] <= _MAX_BATCHED_Q):
                by_length.setdefault(lens[i], []).append(i)
        groups = [g for same in by_length.values()
                  for g in split_by_length(same, [-(-(chunks[i].start + lens[i]) // bs) for i in same])]
        in_batched = {i for same in by_length.values() for i in same}
        prefill = [i for i in range(len(chunks)) if i not in in_batched]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        row_start = [0] * len(chunks)
        lora_slots: list[int] = []
        for i in [i for g in groups for i in g] + prefill:
            c = chunks[i]
            row_start[i] = len(ids)
            ids.extend(c.token_ids)
            lora_slots.extend([c.lora_slot] * len(c.token_ids))
            table = c.block_table
            for p in range(c.start, c.start + len(c.token_ids)):
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
        group_info: list[int] = []
        tables: list[int] = []
        ctx_lens: list[int] = []
        for g in groups:
            needed = [-(-(chunks[i].start + lens[i]) // bs) for i in g]
            nb = max(needed)
            group_info += [len(g), nb, lens[g[0]]]
            for i, n in zip(g, needed):
                tables.extend(chunks[i].block_table[:n] + [0] * (nb - n))
                ctx_lens.append(chunks[i].start + lens[i])
        segments: list[int] = []
        prefill_tables: list[int] = []
        for i in prefill:
            c = chunks[i]
            used = -(-(c.start + lens[i]) // bs) if c.start else 0  # fresh prompts read no table
            segments += [row_start[i], row_start[i] + lens[i], c.start + lens[i], used]
            prefill_tables.extend(c.block_table[:used])
        logits_rows: list[int] = []
        for i, c in enumerate(chunks):
            end = row_start[i] + lens[i]
            logits_rows.extend(range(end - c.num_logits, end))
        header = [_CMD_STEP, len(ids), len(groups), len(tables), len(ctx_lens), len(prefill),
                  len(prefill_tables), len(logits_rows)]
        return torch.tensor(header + ids + positions + slots + group_info + tables + ctx_lens + segments
                            + prefill_tables + logits_rows + (lora_slots if self.lora is not None else []),
                            dtype=torch.long)

    def _payload_size(self, header: list[int]) -> int:
        _, n, g, t, s, p, pt, nl = header
        return 3 * n + 3 * g + t + s + 4 * p + pt + nl + (n if self.lora is not None else 0)

    def _unpack(self, packed: torch.Tensor):
        _, n, g, t, num_seqs, p, pt, nl = packed[:_HEADER].tolist()
        body = packed[_HEADER:]
        info = body[3 * n:3 * n + 3 * g].view(g, 3).tolist()
        at = 3 * n + 3 * g + t + num_seqs  # the prefill segments, read here on the host (not back from the device)
        segment_list = body[at:at + 4 * p].view(p, 4).tolist()
        sizes = [n, n, n, 3 * g, t, num_seqs, 4 * p, pt, nl]
        if self.lora is not None:  # every token's adapter slot, last (read on the host, on every TP rank)
            self.lora.set_step(body[sum(sizes):sum(sizes) + n])
            body = body[:sum(sizes)]
        parts = torch.split(body.to(self.device), sizes)
        ids, positions, slots, _, tables, ctx_lens, _, prefill_tables, logits_rows = parts
        batch = AttentionBatch(slot_mapping=slots, block_size=self.block_size)
        row = table_at = seq_at = 0
        for b, nb, q_len in info:
            batch.groups.append(BatchedGroup(row, b, q_len, tables[table_at:table_at + b * nb].view(b, nb),
                                             ctx_lens[seq_at:seq_at + b]))
            row += b * q_len
            table_at += b * nb
            seq_at += b
        offset = 0
        for start, end, ctx, used in segment_list:
            table = prefill_tables[offset:offset + used] if used else None
            offset += used
            batch.prefills.append(PrefillSegment(start, end, ctx, table))
        return ids, positions, batch, logits_rows

    # -- running ---------------------------------------------------------------------------------
    def _forward(self, packed: torch.Tensor) -> torch.Tensor:
        ids, positions, batch, logits_rows = self._unpack(packed)
        with torch.inference_mode():
            if self.compiled is not None:
                hidden = self.compiled.forward(ids, positions, batch, self.kv_caches, self.cos, self.sin)
            else:
                hidden = self.model(ids, positions, batch, self.kv_caches, self.cos, self.sin)
            return self.model.logits(hidden[logits_rows])

    def execute(self, chunks: list[Chunk]) -> torch.Tensor:
        """Run one step on every TP rank; the driver gets the logits [sum(num_logits), vocab] in
        chunk order, in the model's dtype (like HF's; the sampler upcasts when it needs to)."""
        if self.graphs is not None and self.graphs.accepts(chunks):  # a decode step: one graph replay
            logits = self.graphs.run(chunks)
            if logits is not None:  # None: the graphs disabled themselves (cuda_graphs.DecodeGraphs.run)
                return logits[:, :self.spec.vocab_size]
        packed = self.pack(chunks)
        if self.tp.size > 1:
            self.tp.broadcast(packed[:_HEADER].to(self.device))
            self.tp.broadcast(packed[_HEADER:].to(self.device))
        local = self._forward(packed)
        if self.tp.size > 1:
            with torch.inference_mode():
                local = torch.cat(self.tp.gather_to_driver(local.contiguous()), dim=-1)
        return local[:, :self.spec.vocab_size]

    # -- TP worker side --------------------------------------------------------------------------
    def send_command(self, command: int) -> None:
        """Driver: tell the workers to stop (end of generate) or that it is still alive (idle server)."""
        if self.tp.size > 1:
            self.tp.broadcast(torch.tensor([command] + [0] * (_HEADER - 1), dtype=torch.long, device=self.device))

    def stop_workers(self) -> None:
        self.send_command(_CMD_STOP)

    def keepalive(self) -> None:
        self.send_command(_CMD_KEEPALIVE)

    def worker_loop(self) -> None:
        """Non-driver ranks: run the steps the driver broadcasts until it says stop."""
        while True:
            header = self.tp.broadcast(torch.empty(_HEADER, dtype=torch.long, device=self.device)).cpu()
            command = int(header[0])
            if command == _CMD_STOP:
                return
            if command == _CMD_KEEPALIVE:
                continue
            size = self._payload_size(header.tolist())
            payload = self.tp.broadcast(torch.empty(size, dtype=torch.long, device=self.device))
            local = self._forward(torch.cat([header, payload.cpu()]))
            self.tp.gather_to_driver(local.contiguous())
