"""Decode attention over the paged KV cache on CPU: the engine's path (gather the group's blocks,
then one SDPA call) against a formulation that reads the blocks in place, measured in one run.

    python bench/inference_decode_attention.py                 # SmolLM2-135M's decode shapes, bf16
    python bench/inference_decode_attention.py --compiled      # + the in-place variant through torch.compile
    python bench/inference_decode_attention.py --smoke         # small shapes: does it run

Shapes (default: one layer of SmolLM2-135M's decode step in bench/inference.py): 32 sequences,
3 KV heads x 3 query heads, head dim 64, contexts 100-290 tokens, blocks of 16 scattered over a
2,000-block cache. Rows: the engine's `attention.paged_attention` on one decode group; its two
block gathers alone; SDPA alone on the gathered (strided) view and on a contiguous copy; with
`--compiled`, scores and weighted values computed by indirect loads through the block table (no
gathered tensor), compiled by inductor (its compilation is timed apart). Milliseconds per layer
(best of --repeats, each the mean of --iters calls) and CPU ms; the last line is JSON. The
compiled variant's largest difference from the engine's output is printed (bf16 rounding).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F


def in_place(q, k_cache, v_cache, tables, lens):
    """Attention of one query per sequence over its blocks, read through the table by indexing
    (inductor fuses the indexing into the reductions: no gathered tensor)."""
    b, h, d = q.shape
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    pos = torch.arange(tables.shape[1] * bs, device=q.device)
    slots = tables[:, pos // bs] * bs + pos % bs  # [B, L]
    k = k_cache.view(-1, hk, d)[slots].float()
    v = v_cache.view(-1, hk, d)[slots].float()
    qg = q.view(b, hk, h // hk, d).float() * d ** -0.5
    s = (qg[:, None] * k[:, :, :, None, :]).sum(-1)  # [B, L, Hkv, g]
    s = s.masked_fill((pos[None, :] >= lens[:, None])[:, :, None, None], float("-inf"))
    p = (s - s.amax(1, keepdim=True)).exp()
    out = (p[..., None] * v[:, :, :, None, :]).sum(1) / p.sum(1)[..., None]
    return out.reshape(b, h, d).to(q.dtype)


def timed(fn, iters: int, repeats: int) -> tuple[float, float]:
    fn()
    best = (float("inf"), float("inf"))
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(iters):
            fn()
        best = min(best, ((time.perf_counter() - start) / iters * 1e3, (time.process_time() - cpu) / iters * 1e3))
    return best


def main(argv=None) -> int:
    from phalanx.inference.attention import AttentionBatch, BatchedGroup, _gather, paged_attention

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--group", type=int, default=3, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--min-ctx", type=int, default=100)
    parser.add_argument("--max-ctx", type=int, default=290)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--cache-blocks", type=int, default=2000)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compiled", action="store_true", help="also time the in-place variant (torch.compile)")
    parser.add_argument("--smoke", action="store_true", help="small shapes, few iterations")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seqs, args.min_ctx, args.max_ctx, args.cache_blocks, args.iters, args.repeats = 4, 8, 40, 64, 2, 1
    torch.set_num_threads(args.threads)
    dtype, bs = getattr(torch, args.dtype), args.block_size
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(args.min_ctx, args.max_ctx + 1, (args.seqs,), generator=g)
    nb = int(-(-lens.max() // bs))
    tables = torch.randperm(args.cache_blocks, generator=g)[:args.seqs * nb].view(args.seqs, nb)
    shape = (args.cache_blocks, bs, args.kv_heads, args.head_dim)
    k_cache, v_cache = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(args.seqs, args.kv_heads * args.group, args.head_dim, generator=g).to(dtype)
    batch = AttentionBatch(slot_mapping=torch.empty(0, dtype=torch.long), block_size=bs,
                           groups=[BatchedGroup(0, args.seqs, 1, tables, lens)])
    engine = lambda: paged_attention(q, q, q, k_cache, v_cache, batch)  # noqa: E731 (k, v unused at decode)
    keys, values = _gather(k_cache, tables), _gather(v_cache, tables)
    mask = batch.groups[0].mask(bs, None, dtype)
    qb = q.view(args.seqs, args.kv_heads, args.group, args.head_dim)
    contiguous = (keys.contiguous(), values.contiguous())
    rows = {"engine: gathers + SDPA": engine,
            "the two gathers alone": lambda: (_gather(k_cache, tables), _gather(v_cache, tables)),
            "SDPA alone, strided gathered view":
                lambda: F.scaled_dot_product_attention(qb, keys, values, attn_mask=mask),
            "SDPA alone, contiguous copy": lambda: F.scaled_dot_product_attention(qb, *contiguous, attn_mask=mask)}
    result = {"bench": "inference_decode_attention", "dtype": args.dtype, "threads": args.threads, "seqs": args.seqs,
              "kv_heads": args.kv_heads, "group": args.group, "head_dim": args.head_dim,
              "load_avg_1m": round(os.getloadavg()[0], 2)}
    if args.compiled:
        compiled_fn = torch.compile(in_place, dynamic=True)
        start = time.perf_counter()
        got = compiled_fn(q, k_cache, v_cache, tables, lens)
        result["compile_s"] = round(time.perf_counter() - start, 1)
        result["in_place_max_abs_diff"] = float((got.float() - engine().float()).abs().max())
        print(f"in-place variant: compiled in {result['compile_s']} s; largest difference from the engine's "
              f"output {result['in_place_max_abs_diff']:.3g}")
        rows["in place, torch.compile (no gathered tensor)"] = lambda: compiled_fn(q, k_cache, v_cache, tables, lens)
    print(f"{args.seqs} sequences, {args.kv_heads} KV x {args.group} query heads, dim {args.head_dim}, contexts "
          f"{int(lens.min())}-{int(lens.max())}, {args.dtype}, {args.threads} thread(s), load {result['load_avg_1m']}")
    times = {}
    for name, call in rows.items():
        times[name] = timed(call, args.iters, args.repeats)
        print(f"  {name:48} {times[name][0]:8.3f} ms  ({times[name][1]:.3f} CPU ms)")
    base = times["engine: gathers + SDPA"][1]
    for name in rows:
        if name.startswith(("the two", "in place")):
            print(f"{name} vs gather + SDPA: {base / times[name][1]:.2f}x per CPU-second (above 1: faster)")
    result.update({name: round(t[1], 4) for name, t in times.items()})
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
