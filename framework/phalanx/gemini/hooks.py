"""Module and parameter hooks that drive the chunk manager from forward and backward.

- forward pre-hook of every module with parameters of its own: fetch the chunks holding them
  (the parameters become views of the gathered buffers); forward hook: release them;
- full backward pre-hook of the same modules: fetch them again before the module's backward
  (its weights are needed for the input gradient and for its own gradient);
- post-accumulate-grad hook of every parameter: hand the gradient to the manager, which
  reduces a chunk as soon as all its gradients are in. A parameter used by several modules
  (tied embeddings) gets one accumulated gradient per backward, so it is reduced once;
- root pre-hook: start an iteration (and the tracer's warm-up recording), enter the manager's
  saved-tensors hooks for the forward (so that autograd keeps chunk views, not gathered
  buffers, for backward; `ChunkManager.saved_tensors`), and gather the
  *root-held* chunks: those of modules whose forward does not run although their weights are
  used, such as an LM head whose weight a fused linear-cross-entropy loss reads directly. Before
  the first forward that is the model's output embeddings; after it, every module with
  parameters whose forward did not run. They stay gathered until their gradients are reduced.
  A parameter used while its chunk is not gathered is caught when its gradient arrives.

Under activation checkpointing the recomputed forward runs inside backward, fires the same
forward hooks, and finds the chunks it needs gathered or gathers them again.
"""
from __future__ import annotations

import warnings
import weakref

import torch
from torch import nn

from phalanx.gemini.manager import ChunkManager


def module_chunks(manager: ChunkManager, module: nn.Module) -> list:
    seen, out = set(), []
    for p in module.parameters(recurse=False):
        if id(p) in manager.where:
            chunk = manager.where[id(p)][0]
            if chunk.index not in seen:
                seen.add(chunk.index)
                out.append(chunk)
    return out


def install_hooks(manager: ChunkManager, root: nn.Module, tracer=None) -> dict[str, list]:
    """Hook `root`'s modules; returns {module name: its chunks} (for the fit checks)."""
    handles, table = [], {}
    # torch warns that the embedding's full backward pre-hook fires on output gradients only
    # (token ids need no gradient), which is exactly what the hook wants.
    warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with "
                            "respect to module outputs since no inputs require gradients")
    ran: set[str] = set()
    held = {"names": _output_embeddings(root)}
    manager.tracer = tracer

    depth = [0]
    saving = []  # the saved-tensors hooks of the forward in progress

    def on_enter(module, args):
        """The outermost hooked module starting a forward (not a recompute in backward) starts
        an iteration: whichever module the caller entered through (the root, or e.g. the
        decoder that a loss function calls directly)."""
        depth[0] += 1
        if depth[0] > 1 or manager.in_backward:
            return
        manager.begin_iteration()
        ran.clear()
        if tracer is not None and manager.tracing:
            tracer.start_forward()
        if torch.is_grad_enabled():
            saving.append(manager.saved_tensors())
            saving[-1].__enter__()
        chunks, params = held_chunks()
        for c, k in params:
            c.used.add(k)
        if chunks:
            # released when their gradients are reduced, or at the next iteration
            manager.fetch(chunks, step=False)

    def held_chunks():
        chunks, params = [], []
        for name in sorted(held["names"]):
            for c in table.get(name, []):
                if c not in chunks:
                    chunks.append(c)
            params += [manager.where[id(p)] for p in root.get_submodule(name).parameters(recurse=False)
                       if id(p) in manager.where]
        return chunks, params

    def on_exit(module, args, output):
        depth[0] = max(0, depth[0] - 1)
        if depth[0] or manager.in_backward:
            return
        if saving:
            saving.pop().__exit__(None, None, None)
        if tracer is not None:
            tracer.stop_forward()
        if manager.tracing and torch.is_grad_enabled():
            held["names"] = {name for name in table if name not in ran and name != "<root>"}
        if not torch.is_grad_enabled():
            # No backward will follow: free everything now, except the root-held chunks, which
            # the caller may still read (a loss on the decoder's output and the head's weight);
            # the next iteration frees those.
            manager.end_iteration(close_trace=False, keep=held_chunks()[0])

    for module in root.modules():
        handles.append(module.register_forward_pre_hook(on_enter, prepend=True))
        handles.append(module.register_forward_hook(on_exit, always_call=True))

    for name, module in root.named_modules():
        chunks = module_chunks(manager, module)
        if not chunks:
            continue
        table[name or "<root>"] = chunks
        indices = {c.index: [manager.where[id(p)][1] for p in module.parameters(recurse=False)
                             if id(p) in manager.where and manager.where[id(p)][0] is c] for c in chunks}

        def pre_forward(module, args, chunks=chunks, indices=indices, name=name or "<root>"):
            ran.add(name)
            for c in chunks:
                c.used.update(indices[c.index])
            manager.fetch(chunks)
            if tracer is not None and manager.tracing:
                tracer.record(manager.position - 1, chunks)

        def post_forward(module, args, output, chunks=chunks):
            for c in chunks:
                manager.release(c)

        def pre_backward(module, grad_output, chunks=chunks):
            manager.start_backward()
            manager.fetch(chunks, hold_user=False)
            if tracer is not None and manager.tracing:
                tracer.record(manager.position - 1, chunks, backward=True)

        handles.append(module.register_forward_pre_hook(pre_forward))
        handles.append(module.register_forward_hook(post_forward))
        handles.append(module.register_full_backward_pre_hook(pre_backward))

    grad_arrived = _weak_hook(manager.grad_arrived)
    for chunk in manager.chunks:
        for p in chunk.params:
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(grad_arrived))
    manager.hook_handles = handles
    return table


def _weak_hook(method):
    """`method` as a tensor hook that does not keep its object alive. A tensor's hooks are held
    by the C++ tensor, where Python's garbage collector cannot see them: a hook referring to
    the manager, which refers to the parameters (`Chunk.params`), made a cycle the collector
    never frees, so every boosted model, its chunks and their device memory outlived the
    plugin (on a GPU, `memory_allocated()` then charged them to the next model's activations)."""
    ref = weakref.WeakMethod(method)

    def hook(param):
        bound = ref()
        if bound is not None:
            bound(param)
    return hook


def _output_embeddings(root: nn.Module) -> set[str]:
    """Names of the modules any `get_output_embeddings()` under `root` returns (HF models)."""
    names = {id(m): n for n, m in root.named_modules()}
    out = set()
    for m in root.modules():
        get = getattr(m, "get_output_embeddings", None)
        if callable(get):
            try:
                emb = get()
            except Exception:  # noqa: BLE001 - a model without a head
                emb = None
            if isinstance(emb, nn.Module) and id(emb) in names and any(True for _ in emb.parameters(recurse=False)):
                out.add(names[id(emb)])
    return out
