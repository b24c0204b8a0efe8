"""`LLM`: the inference engine's front door — load a model, take requests, run steps, return
outputs.

    engine = LLM("path/to/hf_model", max_num_seqs=64, block_size=16, tp_size=1)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=128, temperature=0.7, top_p=0.9))

Each `step()` asks the scheduler what to run, runs it (target model, draft model when
speculating), samples, appends, and retires finished requests; `generate()` is add + step until
done. With tensor parallelism every rank builds the same `LLM` and calls `generate` with the same
arguments: rank 0 of the TP group drives (schedules, samples), the others run the model for the
steps it broadcasts, and all return the same outputs.

A step that raises fails only the request whose own step fails (`_step`: the step is rolled back,
its sequences retried alone); that request ends with finish_reason "error" and `error` set, and
the engine goes on (with tensor parallelism the error is raised).

Structured output (`SamplingParams.structured_output`): each constrained sequence carries a
grammar (`phalanx.inference.structured`) that masks its row in the sampler and advances only in
`_append`, so a rolled-back step leaves it untouched. Speculative steps draft for constrained
sequences too: the speculator advances each grammar over its proposals, masks the drafted and the
verified positions with the state of each, and rolls the grammar back before returning
(`phalanx.inference.speculative`).

LoRA adapters with a draft model: the target verifies each sequence with its own adapter; the
draft model runs without adapters (it proposes the base draft's tokens, which only changes how
many are accepted). N-gram lookup needs no model: it serves adapter requests as any other.
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import time
from pathlib import Path
from typing import Iterable, Mapping, Sequence as Seq

import torch

from phalanx_kernels.accelerator import current_device, new_generator

from phalanx.inference.block_manager import BlockManager
from phalanx.inference.config import EngineConfig
from phalanx.inference.llama import check_tp, spec_for_inference
from phalanx.inference.lora import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, LoraAdapters, LoraError
from phalanx.inference.model_runner import Chunk, ModelRunner, resolve_dtype
from phalanx.inference.outputs import CompletionOutput, RequestOutput
from phalanx.inference.sampler import RowContext, Sampler
from phalanx.inference.sampling_params import SamplingParams
from phalanx.inference.scheduler import Scheduler
from phalanx.inference.sequence import Sequence
from phalanx.inference.ngram import NgramProposer
from phalanx.inference.speculative import DraftModelProposer, SpeculativeDecoder
from phalanx.inference.structured import GrammarCompiler
from phalanx.inference.stopping import StopChecker
from phalanx.inference.tp import TPGroup
from phalanx.inference.weights import directory_source, load_weights, state_dict_source

Prompt = str | list[int]
log = logging.getLogger(__name__)


def _load_config(path: Path):
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(str(path))


def _load_tokenizer(path: Path):
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))


def _eos_ids(config, generation_config, tokenizer) -> set[int]:
    for source in (generation_config, config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            return set(value if isinstance(value, (list, tuple)) else [value])
    return set()


_LORA_OPTIONS = ("enable_lora", "max_loras", "max_lora_rank")


def _default_device(tp: TPGroup) -> torch.device:
    if tp.size > 1:
        from phalanx.launch import context
        return context().device
    return current_device()


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed`: the request's own seed for sample 0
    (so n=1 is unchanged), a hash of (seed, index) for the others (no collision with the seeds
    of neighbouring requests)."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _check_lora_served(spec) -> None:
    """Refuse `enable_lora` where the engine serves no adapters, before any work (weights read,
    cache allocated): multi-head latent attention (DeepSeek-V2 / V3)."""
    if spec.mla:
        raise ValueError(f"LoRA adapters are not served on {spec.family} (multi-head latent attention) yet: merge "
                         "the adapter into the base model (booster.save_lora_as_pretrained(..., merge=True), or peft's "
                         "merge_and_unload then save_pretrained) and serve the merged model without enable_lora")


class LLM:
    """A decoder-only model (see `phalanx.models.SUPPORTED`) served with a paged KV cache and continuous
    batching. Keyword arguments are `EngineConfig` fields; `draft_model` (a directory or a live
    module) enables speculative decoding, as does `prompt_lookup_max=n` without a draft model
    (n-gram lookup, `phalanx.inference.ngram`); `enable_lora=True` (with `max_loras`, `max_lora_rank`)
    serves LoRA adapters (`load_lora_adapter`, `SamplingParams.lora_name`; `phalanx.inference.lora`)."""

    def __init__(self, model: str | Path, *, tokenizer=None, draft_model: str | Path | torch.nn.Module | None = None,
                 device: str | torch.device | None = None, **engine_kwargs) -> None:
        path = Path(model)
        config = _load_config(path)
        if tokenizer is None:
            tokenizer = _load_tokenizer(path)
        generation_config = None
        if (path / "generation_config.json").exists():
            from transformers import GenerationConfig
            generation_config = GenerationConfig.from_pretrained(str(path))
        self._setup(config, generation_config, tokenizer, directory_source(path), draft_model, device,
                    engine_kwargs, name=path.name)

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer=None, *, draft_model=None, device=None,
                   **engine_kwargs) -> "LLM":
        """An engine over a live HF-style module's weights (copied, no disk round trip): e.g. the
        policy being trained in RLHF. Later, `load_weights(model.state_dict())` refreshes them."""
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError("from_model needs a module with an HF `config` (e.g. LlamaForCausalLM)")
        self = cls.__new__(cls)
        self._setup(config, getattr(model, "generation_config", None), tokenizer,
                    state_dict_source(model.state_dict()), draft_model, device, engine_kwargs,
                    name=getattr(config, "_name_or_path", "") or config.model_type)
        return self

    # -- construction ----------------------------------------------------------------------------
    def _setup(self, config, generation_config, tokenizer, weights, draft_model, device, engine_kwargs, name):
        lora_options = {k: engine_kwargs.pop(k) for k in _LORA_OPTIONS if k in engine_kwargs}
        self.config = EngineConfig(**engine_kwargs)
        enable_lora = lora_options.pop("enable_lora", False)
        self.model_name = name or "model"
        self.hf_config = config
        self.spec = spec_for_inference(config)
        if enable_lora:
            _check_lora_served(self.spec)  # before the weights are read or the cache allocated
        check_tp(self.spec, self.config.tp_size)  # before any process group is touched
        self.tp = TPGroup(self.config.tp_size)
        self.device = torch.device(device) if device is not None else _default_device(self.tp)
        self.dtype = resolve_dtype(self.config.dtype, config, self.device)
        limit = self.spec.max_position_embeddings
        if self.config.max_model_len is not None and self.config.max_model_len > limit:
            raise ValueError(f"max_model_len={self.config.max_model_len} exceeds the model's "
                             f"max_position_embeddings={limit}")
        self.max_model_len = self.config.max_model_len or limit
        self.tokenizer = tokenizer
        self.runner = ModelRunner(self.spec, engine_config=self.config, tp=self.tp, device=self.device,
                                  dtype=self.dtype, max_model_len=self.max_model_len)
        load_weights(self.runner.model, weights, strict=True)
        self.runner.model.pack_weights()
        self.lora = self._setup_lora(**lora_options) if enable_lora else None
        self.draft_runner = None
        self.speculator = None
        if draft_model is not None and self.config.prompt_lookup_max:
            raise ValueError("speculative decoding takes a draft model or n-gram lookup (prompt_lookup_max), "
                             "not both: drop one")
        if self.tp.is_driver:
            proposer = None
            if draft_model is not None:
                self.draft_runner = self._build_draft(draft_model)
                proposer = DraftModelProposer(self.draft_runner)
            elif self.config.prompt_lookup_max:
                proposer = NgramProposer(self.spec.vocab_size, self.device, self.config.prompt_lookup_min,
                                         self.config.prompt_lookup_max)
            if proposer is not None:
                self.speculator = SpeculativeDecoder(self.runner, proposer, self.config.num_speculative_tokens)

        self.num_blocks = self._num_blocks()
        self.runner.allocate_kv_cache(self.num_blocks)
        if self.draft_runner is not None:
            self.draft_runner.allocate_kv_cache(self.num_blocks)
        self.block_manager = BlockManager(self.num_blocks, self.config.block_size,
                                          enable_prefix_caching=self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=self.config.max_num_seqs,
                                   max_num_batched_tokens=self.config.max_num_batched_tokens,
                                   num_lookahead_tokens=self.config.num_speculative_tokens if self.speculator else 0,
                                   max_model_len=self.max_model_len)
        self.stop_checker = StopChecker(tokenizer, _eos_ids(config, generation_config, tokenizer), self.max_model_len)
        self._grammars: GrammarCompiler | None = None  # built on the first structured request
        self.sampler = Sampler()
        self._ids = itertools.count()
        self._seqs: dict[str, list[Sequence]] = {}  # request id -> its samples (index 0 first)
        self._seeds: dict[str, int] = {}  # request id -> its seed (forked samples derive theirs)
        self._adapters: dict = {}  # request id -> the LoRA adapter it holds (released when it is forgotten)

    def _setup_lora(self, max_loras: int = DEFAULT_MAX_LORAS, max_lora_rank: int = DEFAULT_MAX_LORA_RANK):
        """The adapter registry; the runner tells it each step's token slots. The compiled model
        step is bypassed (it calls the matmuls directly, past the adapters' wrappers)."""
        lora = LoraAdapters(self.runner.model, max_loras=max_loras, max_lora_rank=max_lora_rank)
        self.runner.lora = lora
        if self.runner.compiled is not None:
            self.runner.compiled, self.runner.compile_reason = None, "LoRA adapters run eagerly"
            log.warning("running the model eagerly (LoRA adapters are applied by the eager layers)")
        return lora

    def load_lora_adapter(self, name: str, path: str | Path) -> dict:
        """Load the PEFT adapter saved in `path` (adapter_config.json + adapter_model.safetensors)
        under `name`; requests choose it with `SamplingParams(lora_name=name)`. Safe to call from
        another thread while the engine steps. `LoraError` (a ValueError) names what is wrong.
        With tp_size > 1 call it on every rank with the same arguments (as `generate`): each rank
        keeps its part of the adapter, in the same slot."""
        adapter = self._lora_registry().load(name, path)
        return {"name": adapter.name, "path": adapter.path, "rank": adapter.rank, "slot": adapter.slot}

    def unload_lora_adapter(self, name: str) -> None:
        """Forget adapter `name` (refused while requests in flight use it)."""
        self._lora_registry().unload(name)

    def lora_adapters(self) -> dict[str, str]:
        """Loaded adapters: name -> the directory each was loaded from."""
        # a snapshot (list() is one step under the GIL): the HTTP thread reads it while a load may run
        return {a.name: a.path for a in list(self.lora.adapters.values())} if self.lora is not None else {}

    def _lora_registry(self) -> LoraAdapters:
        if self.lora is None:
            raise LoraError("this engine serves no LoRA adapters: build it with LLM(..., enable_lora=True) "
                            "(phalanx serve --enable-lora)")
        return self.lora

    def _build_draft(self, draft_model) -> ModelRunner:
        if isinstance(draft_model, torch.nn.Module):
            config, weights = draft_model.config, state_dict_source(draft_model.state_dict())
        else:
            config, weights = _load_config(Path(draft_model)), directory_source(Path(draft_model))
        spec = spec_for_inference(config)
        if spec.vocab_size != self.spec.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({spec.vocab_size}) differs from the target's "
                             f"({self.spec.vocab_size}); speculative decoding needs the same tokenizer")
        if spec.max_position_embeddings < self.max_model_len:
            raise ValueError(f"the draft model handles {spec.max_position_embeddings} positions, fewer than "
                             f"max_model_len={self.max_model_len}; lower max_model_len")
        runner = ModelRunner(spec, engine_config=self.config, tp=TPGroup(1), device=self.device,
                             dtype=self.dtype, max_model_len=self.max_model_len)
        load_weights(runner.model, weights, strict=True)
        runner.model.pack_weights()
        return runner

    def _num_blocks(self) -> int:
        """KV blocks from the memory budget, the same on every TP rank (their minimum)."""
        if self.config.num_blocks is not None:
            return self.config.num_blocks
        per_block = self.runner.bytes_per_block()
        if self.draft_runner is not None:
            per_block += self.draft_runner.bytes_per_block()
        blocks = self.runner.kv_budget_bytes() // per_block
        # More blocks than every sequence at full length could hold would never be used.
        blocks = min(blocks, self.config.max_num_seqs * -(-self.max_model_len // self.config.block_size) + 1)
        if self.tp.size > 1:
            t = torch.tensor([blocks], dtype=torch.long, device=self.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.tp.group)
            blocks = int(t.item())
        if blocks < 2:
            raise RuntimeError(f"the KV-cache budget holds {blocks} block(s) of {per_block} bytes; raise "
                               "kv_cache_memory_gib (CPU) or gpu_memory_utilization, or use a smaller block_size")
        return int(blocks)

    # -- requests --------------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        """The token ids a prompt runs as (strings through the model's tokenizer)."""
        return self._tokenize(prompt)[1]

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer (none in the model directory and none given): "
                                 "pass prompts as lists of token ids")
            return prompt, self.tokenizer(prompt)["input_ids"]
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise TypeError(f"a prompt is a string or a list of token ids, not {type(prompt).__name__}")
        return None, list(prompt)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request (it joins the running batch at the next step); returns its id."""
        params = params or SamplingParams()
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.spec.vocab_size})")
        bad = [t for t in params.logit_bias if t >= self.spec.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {self.spec.vocab_size})")
        bad = [t for t in params.stop_token_ids if t >= self.spec.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.spec.vocab_size})")
        if len(ids) + params.max_new_tokens > self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens and max_new_tokens={params.max_new_tokens}: "
                             f"together more than max_model_len={self.max_model_len}")
        grammar = self.grammar_compiler().matcher(params.structured_output) if params.structured_output else None
        number = next(self._ids)
        request_id = request_id if request_id is not None else str(number)
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in flight")
        seed = params.seed if params.seed is not None else self.config.seed + number
        seq = Sequence(request_id, ids, params, prompt=text, generator=self._generator(params, seed, 0))
        seq.grammar = grammar
        seq.num_pending_forks = params.num_samples - 1
        if params.lora_name is not None:
            adapter = self._lora_registry().acquire(params.lora_name)
            seq.lora_slot, seq.cache_salt = adapter.slot, adapter.salt
            self._adapters[request_id] = adapter
        try:
            self.scheduler.add(seq)
        except BaseException:  # refused (too long for the cache): it holds no adapter
            self._release_adapter(request_id)
            raise
        self._seqs[request_id] = [seq]
        self._seeds[request_id] = seed
        return request_id

    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles `StructuredOutput` constraints against this model's tokenizer (its
        `check(spec)` raises ValueError naming what cannot be enforced)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.spec.vocab_size, self.stop_checker.eos_token_ids)
        return self._grammars

    def _generator(self, params: SamplingParams, seed: int, index: int) -> torch.Generator | None:
        if params.greedy:
            return None
        generator = new_generator(self.device)
        generator.manual_seed(sample_seed(seed, index))
        return generator

    def abort(self, request_id: str) -> None:
        """Drop a request (e.g. its client went away); the blocks of all its samples are freed at once."""
        for seq in self._seqs.pop(request_id, []):
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        self._seeds.pop(request_id, None)
        self._release_adapter(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- stepping --------------------------------------------------------------------------------
    def _row(self, seq: Sequence, extra_tokens: int = 0, history: list[int] | None = None) -> RowContext:
        params = seq.params
        tokens = history if history is not None else seq.token_ids
        # (at a drafted position, extra_tokens > 0, the speculator replaces the grammar by the mask
        # of that position's state)
        return RowContext(params, seq.generator, grammar=seq.grammar,
                          history=tokens if params.repetition_penalty != 1.0 else None,
                          banned=self.stop_checker.banned_now(seq, extra_tokens),
                          generated=(tokens[seq.num_prompt_tokens:]
                                     if params.presence_penalty or params.frequency_penalty else None),
                          track_logprob=params.best_of > params.n)

    def _append(self, seq: Sequence, token: int, logprob: float | None, top: dict | None,
                processed: float | None = None) -> bool:
        seq.token_ids.append(token)
        if seq.grammar is not None:
            seq.grammar.accept(token)
        if logprob is not None:
            seq.cumulative_logprob += logprob
        if seq.params.logprobs is not None:
            seq.logprobs.append(logprob)
            seq.top_logprobs.append(top or {})
        if seq.params.processed_logprobs:
            seq.processed_logprobs.append(processed)
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        done = self.stop_checker.check(seq)
        if not done and seq.grammar is not None and seq.grammar.finished:  # (EOS with ignore_eos)
            seq.finish_reason, done = "stop", True
        return done

    def _children(self, parent: Sequence) -> list[Sequence]:
        """The other samples of the parent's request, made (not yet attached: `_attach`) now
        that its prompt is in the cache."""
        params, seed = parent.params, self._seeds[parent.request_id]
        children = [Sequence(parent.request_id, parent.prompt_token_ids, params, prompt=parent.prompt,
                             generator=self._generator(params, seed, index), arrival_time=parent.arrival_time,
                             index=index)
                    for index in range(1, parent.num_pending_forks + 1)]
        for child in children:  # the parent has no output yet: its grammar is at the start
            child.grammar = parent.grammar.fork() if parent.grammar is not None else None
            child.lora_slot, child.cache_salt = parent.lora_slot, parent.cache_salt
        return children

    def _attach(self, parent: Sequence, children: list[Sequence]) -> None:
        """Fork the children in: each shares the parent's full prompt blocks (see `BlockManager.fork`)."""
        for child in children:
            self.block_manager.fork(parent, child)
            child.num_cached_prompt_tokens = parent.num_cached_prompt_tokens
            child.status = parent.status
        parent.num_pending_forks = 0
        self._seqs[parent.request_id].extend(children)

    def _collect_prompt_logprobs(self, seq: Sequence, start: int, logits: torch.Tensor) -> None:
        """Log-probs of the prompt tokens predicted by rows start, start + 1, … of this chunk."""
        want = [p for p in range(start, start + logits.shape[0])
                if p + 1 < seq.num_prompt_tokens and p >= len(seq.prompt_logprobs)]
        if not want:
            return
        rows = logits[want[0] - start:want[-1] - start + 1].float()
        logp = torch.log_softmax(rows, dim=-1)
        targets = torch.tensor(seq.prompt_token_ids[want[0] + 1:want[-1] + 2], device=logp.device)
        seq.prompt_logprobs.extend(logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist())
        n = seq.params.logprobs
        if n:
            values, ids = logp.topk(n, dim=-1)
            seq.prompt_top_logprobs.extend(dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist()))
        else:
            seq.prompt_top_logprobs.extend({} for _ in want)

    def _step(self) -> list[Sequence]:
        """One engine step; returns the sequences that got tokens or finished (failed included).

        Fault isolation: the step computes (model, draft, sampler) before it changes any
        sequence, so when that raises, `_step_failed` can put every sequence of the step back as
        it was (`Scheduler.roll_back`, the generators' states restored) and only the request
        whose own step fails is failed; an error while one sequence's tokens are appended fails
        that sequence's request alone."""
        plan = self.scheduler.schedule()
        if not plan:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not run any request (KV cache too small for the next "
                                   "step?); raise the KV-cache budget")
            return []
        states = [(seq.generator, seq.generator.get_state()) for seq in (s.seq for s in plan.scheduled)
                  if seq.generator is not None]
        try:
            computed = self._compute_speculative(plan) if plan.speculative else self._compute(plan)
        except Exception as exc:  # noqa: BLE001 - isolated below; TP steps cannot be recovered
            if self.tp.size > 1:
                raise
            return self._step_failed(plan, states, exc)
        for s in plan.scheduled:
            if s.samples or plan.speculative:
                s.seq.suspect = False
        if plan.speculative:
            return self._commit_speculative(plan, computed)
        return self._commit(plan, *computed)

    def _step_failed(self, plan, states, exc: BaseException) -> list[Sequence]:
        """Undo the failed step; fail its request when it ran alone, else retry each of its
        sequences alone (suspects) to find the one that fails."""
        for generator, state in states:
            generator.set_state(state)
        self.scheduler.roll_back(plan)
        seqs = [s.seq for s in plan.scheduled]
        if len({seq.request_id for seq in seqs}) == 1:
            log.error("request %s failed in an engine step: %s", seqs[0].request_id, exc, exc_info=exc)
            return self._fail(seqs[0].request_id, exc, seqs[0])
        log.warning("an engine step of %d sequences failed (%s: %s); retrying each alone",
                    len(seqs), type(exc).__name__, exc)
        for seq in seqs:
            seq.suspect = True
        return []

    def _fail(self, request_id: str, exc: BaseException, seq: Sequence) -> list[Sequence]:
        """End every sample of `seq`'s request with finish_reason 'error' and the cause; frees
        their blocks."""
        samples = self._seqs.get(request_id) or [seq]
        message = f"{type(exc).__name__}: {exc}"
        for sample in samples:
            sample.error, sample.suspect, sample.num_pending_forks = message, False, 0
            if not sample.is_finished:
                sample.finish_reason = "error"
                self._retire(sample)
        return list(samples)

    def _compute(self, plan):
        """Run the model (and the draft) on a plain step and sample; changes no sequence."""
        chunks = []
        for s in plan.scheduled:  # rows of logits: every position while prompt log-probs are collected
            rows = s.num_tokens if s.seq.needs_prompt_logits else (1 if s.samples else 0)
            chunks.append(Chunk(s.seq.token_ids[s.start:s.start + s.num_tokens], s.start, s.seq.block_table, rows,
                                s.seq.lora_slot))
        with self.lora.lock if self.lora is not None else contextlib.nullcontext():
            logits = self.runner.execute(chunks)
        if self.draft_runner is not None:  # keep the draft's cache in step with the target's
            self.draft_runner.execute([Chunk(c.token_ids, c.start, c.block_table, 0) for c in chunks])
        sampling: list[Sequence] = []
        children: dict[int, list[Sequence]] = {}  # id(parent) -> samples forked off it this step
        sample_rows: list[int] = []
        at = 0
        for s, chunk in zip(plan.scheduled, chunks):
            if s.samples:
                kids = children[id(s.seq)] = self._children(s.seq) if s.seq.num_pending_forks else []
                sampling.extend([s.seq, *kids])
                sample_rows.extend([at + chunk.num_logits - 1] * (1 + len(kids)))
            at += chunk.num_logits
        result = None
        if sampling:
            rows = logits
            if sample_rows != list(range(len(sample_rows))) or len(sample_rows) != logits.shape[0]:
                rows = logits[sample_rows]
            result = self.sampler(rows, [self._row(seq) for seq in sampling])
        return chunks, logits, children, result

    def _commit(self, plan, chunks, logits, children, result) -> list[Sequence]:
        """Append a plain step's tokens: prompt log-probs, forks, sampled tokens, retirements."""
        touched: list[Sequence] = []
        at = first = 0  # first logits row / first sampled row of each scheduled sequence
        for s, chunk in zip(plan.scheduled, chunks):
            seq, kids, samples = s.seq, children.get(id(s.seq), []), s.samples  # (before tokens are appended)
            try:
                if seq.needs_prompt_logits:
                    self._collect_prompt_logprobs(seq, s.start, logits[at:at + chunk.num_logits])
                if samples:
                    if kids:
                        self._attach(seq, kids)
                    for i, sample in enumerate((seq, *kids), start=first):
                        processed = result.processed_logprobs[i] if result.processed_logprobs is not None else None
                        done = self._append(sample, result.token_ids[i], result.logprobs[i], result.top_logprobs[i],
                                            processed)
                        touched.append(sample)
                        if sample is not seq:
                            self.scheduler.add_forked(sample)
                        if done:
                            self._retire(sample)
            except Exception as exc:  # noqa: BLE001 - this request's own bookkeeping: fail it alone
                log.error("request %s failed: %s", seq.request_id, exc, exc_info=exc)
                touched.extend(self._fail(seq.request_id, exc, seq))
            at += chunk.num_logits
            first += 1 + len(kids) if samples else 0
        return touched

    def _compute_speculative(self, plan):
        """Draft and verify (the target with each sequence's LoRA adapter); changes no sequence
        (the grammars the speculator advances over the drafts come back as they were)."""
        seqs = [s.seq for s in plan.scheduled]
        with self.lora.lock if self.lora is not None else contextlib.nullcontext():
            return self.speculator.step(seqs, self._row, [s.lookahead for s in plan.scheduled])

    def _commit_speculative(self, plan, emitted) -> list[Sequence]:
        touched: list[Sequence] = []
        for s, tokens in zip(plan.scheduled, emitted):
            seq = s.seq
            try:
                done = False
                for e in tokens:
                    done = self._append(seq, e.token_id, e.logprob, e.top_logprobs)
                    if done:
                        break
                touched.append(seq)
                if done:
                    self._retire(seq)
                else:
                    seq.num_computed_tokens = seq.num_tokens - 1
                    self.block_manager.register_full_blocks(seq, seq.num_computed_tokens)
            except Exception as exc:  # noqa: BLE001 - this request's own bookkeeping: fail it alone
                log.error("request %s failed: %s", seq.request_id, exc, exc_info=exc)
                touched.extend(self._fail(seq.request_id, exc, seq))
        return touched

    def _retire(self, seq: Sequence) -> None:
        seq.finish_time = time.perf_counter()
        self.scheduler.finish(seq)

    def _completion(self, seq: Sequence, index: int) -> CompletionOutput:
        if seq.stop_reason is None or not isinstance(seq.stop_reason, str):
            seq.text = self.stop_checker.text(seq)
        params = seq.params
        want = params.logprobs is not None
        text, token_ids = seq.text, list(seq.output_token_ids)
        logprobs = list(seq.logprobs) if want else None
        tops = list(seq.top_logprobs) if want else None
        if params.echo:
            head = self._seqs[seq.request_id][0]  # the sample that ran the prompt holds its log-probs
            text = self._prompt_text(seq) + text
            token_ids = list(seq.prompt_token_ids) + token_ids
            if want:
                logprobs = [None] + list(head.prompt_logprobs) + logprobs
                tops = [None] + list(head.prompt_top_logprobs) + tops
        tracked = want or params.best_of > params.n
        return CompletionOutput(
            index=index, text=text, token_ids=token_ids, finished=seq.is_finished,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, logprobs=logprobs, top_logprobs=tops,
            processed_logprobs=list(seq.processed_logprobs) if params.processed_logprobs else None,
            cumulative_logprob=seq.cumulative_logprob if tracked else None,
            first_token_time=seq.first_token_time, finish_time=seq.finish_time)

    def _prompt_text(self, seq: Sequence) -> str:
        if seq.prompt is not None:
            return seq.prompt
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(seq.prompt_token_ids, skip_special_tokens=seq.params.skip_special_tokens)

    def _output(self, request_id: str) -> RequestOutput | None:
        """The request's output: its n completions (for best_of > n, the n best by cumulative
        log-prob, and only once every sample finished); None while there is nothing to report."""
        samples = self._seqs[request_id]
        head, params = samples[0], samples[0].params
        error = next((s.error for s in samples if s.error is not None), None)
        if error is not None:  # failed: whatever it had, at once
            samples = samples[:params.n]
        elif params.best_of > params.n:
            if len(samples) < params.best_of or not all(s.is_finished for s in samples):
                return None
            samples = sorted(samples, key=lambda s: (-s.cumulative_logprob, s.index))[:params.n]
        else:
            samples = samples[:params.n]
        completions = [self._completion(seq, i) for i, seq in enumerate(samples)]
        if len(completions) < params.n and error is None:  # not forked yet (still in its prompt): nothing sampled
            return None
        return RequestOutput.of(
            request_id, head.prompt, head.prompt_token_ids, completions,
            num_cached_tokens=head.num_cached_prompt_tokens, arrival_time=head.arrival_time,
            prompt_logprobs=list(head.prompt_logprobs) if head.wants_prompt_logprobs else None,
            prompt_top_logprobs=list(head.prompt_top_logprobs) if head.wants_prompt_logprobs else None,
            error=error)

    def _request_finished(self, request_id: str) -> bool:
        samples = self._seqs.get(request_id)
        return bool(samples) and samples[0].num_pending_forks == 0 and all(s.is_finished for s in samples)

    def _forget(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
        self._seeds.pop(request_id, None)
        self._release_adapter(request_id)

    def _release_adapter(self, request_id: str) -> None:
        adapter = self._adapters.pop(request_id, None)
        if adapter is not None:
            self.lora.release(adapter)

    def step(self) -> list[RequestOutput]:
        """Run one step; outputs (cumulative, `finished` when done) of every request it advanced.
        Finished requests are forgotten after they are returned here. A request with best_of > n
        reports only once, when finished."""
        outs = []
        for request_id in dict.fromkeys(seq.request_id for seq in self._step()):
            if request_id not in self._seqs:
                continue
            out = self._output(request_id)
            if out is not None:
                outs.append(out)
            if self._request_finished(request_id):
                self._forget(request_id)
        return outs

    # -- batch API -------------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for each prompt (strings or token-id lists); outputs in prompt order.

        When a step raises, or one of the requests fails in the engine (`RequestOutput.error`),
        every request of this call is aborted (its blocks freed) and the error is raised.

        With tensor parallelism, call it on every rank of the TP group with the same arguments.
        """
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(batch):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(batch)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(batch)
        if not self.tp.is_driver:
            self.runner.worker_loop()
            result = self.tp.broadcast_object()
            if isinstance(result, str):
                raise RuntimeError(f"the TP driver (rank {self.tp.driver}) failed: {result}")
            return result
        outputs: list[RequestOutput] | str = "generate did not finish"
        ids: list[str] = []
        try:
            ids.extend(self.add_request(p, sp) for p, sp in zip(batch, params))
            wanted = set(ids)
            done: dict[str, RequestOutput] = {}
            while wanted - done.keys():
                for request_id in dict.fromkeys(seq.request_id for seq in self._step()):
                    if request_id in wanted and self._request_finished(request_id):
                        done[request_id] = out = self._output(request_id)
                        self._forget(request_id)
                        if out.error is not None:
                            raise RuntimeError(f"request {request_id} failed: {out.error}")
            outputs = [done[i] for i in ids]
        except BaseException as exc:
            for request_id in ids:  # the others end too, and every block is freed
                self.abort(request_id)
            outputs = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if self.tp.size > 1:
                self.runner.stop_workers()
                self.tp.broadcast_object(outputs)
        return outputs

    # -- weights ---------------------------------------------------------------------------------
    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                     strict: bool = False) -> int:
        """Copy new weights in place (HF names, e.g. `policy.state_dict()`), on every TP rank.

        Takes full tensors (or DTensors) and slices this rank's shard. The prefix cache is
        emptied: keys/values computed with the old weights would be wrong. Returns the number of
        tensors loaded.
        """
        if self.scheduler.has_unfinished():
            raise RuntimeError(f"load_weights with {len(self.scheduler.running) + len(self.scheduler.waiting)} "
                               "requests in flight: their cached keys/values come from the old weights; "
                               "finish or abort them first")
        loaded = load_weights(self.runner.model, state_dict_source(weights), strict=strict)
        self.runner.model.pack_weights()
        self.block_manager.reset_prefix_cache()
        return len(loaded)

    # -- TP serving helpers ----------------------------------------------------------------------
    def run_worker(self) -> None:
        """Non-driver ranks of a TP server: run steps until the driver stops."""
        self.runner.worker_loop()

    def stats(self) -> dict:
        return {
            "num_blocks": self.num_blocks, "free_blocks": self.block_manager.num_free_blocks,
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cached_tokens": self.scheduler.num_prefix_cached_tokens,
            "spec_acceptance_rate": self.speculator.acceptance_rate if self.speculator else None,
        }
