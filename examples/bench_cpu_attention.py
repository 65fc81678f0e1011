"""The C++ CPU attention ops against the torch path they replace, side by side in one run.

    .venv/bin/python examples/bench_cpu_attention.py [--reps 9] [--shape 12,2,128] [--decode-only]

Prefill: whole prompts of SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64; --shape
HEADS,KV_HEADS,HEAD_DIM takes another, e.g. 12,2,128 for Qwen2.5-1.5B) through the
op (K/V read from a paged cache) and through per-sequence causal SDPA (the torch path), in fp32
and bf16; GFLOP/s count the causal half, 4 * n^2 / 2 * heads * head_dim per sequence.
Decode: 256 decodes over 50-1,200-token contexts, op against the torch path's padded buckets,
with blocks scattered over the cache and with each sequence's blocks consecutive.
Medians of --reps calls; ratios are torch time / op time.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from batchgen.kernels import cpu_attention as ca
from batchgen.runner.attention import DecodeBucket, _decode_batched, _sdpa_one, decode_buckets
from batchgen.runner.model_runner import host_zeros
from batchgen.shapes import cdiv

HEADS, KVH, D, BS = 9, 3, 64, 16


def median_ms(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def paged(lens: list[int], dtype: torch.dtype, g: torch.Generator, consecutive: bool = False):
    """K/V caches holding each sequence's positions [0, len) in shuffled blocks (with consecutive,
    each sequence's blocks in a row, as the engine's runs place them), and the tables. The caches
    are on 2 MiB pages where the kernel allows, as the engine's are."""
    blocks = [cdiv(n, BS) for n in lens]
    nb = sum(blocks) + 1
    kc = host_zeros((nb, BS, KVH, D), dtype)
    vc = host_zeros((nb, BS, KVH, D), dtype)
    kc.copy_(torch.randn(nb, BS, KVH, D, generator=g))
    vc.copy_(torch.randn(nb, BS, KVH, D, generator=g))
    if consecutive:  # sequences in shuffled order, each one's blocks in a row
        order = torch.randperm(len(lens), generator=g).tolist()
        starts, c = {}, 0
        for i in order:
            starts[i] = c
            c += blocks[i]
        perm = torch.cat([torch.arange(starts[i], starts[i] + b) for i, b in enumerate(blocks)])
    else:
        perm = torch.randperm(nb, generator=g)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.long)
    c = 0
    for i, b in enumerate(blocks):
        tables[i, :b] = perm[c : c + b]
        c += b
    return kc, vc, tables


def bench_prefill(reps: int) -> None:
    g = torch.Generator().manual_seed(0)
    print("prefill (whole prompts)          dtype      torch ms (GFLOP/s)    op ms (GFLOP/s)   torch/op")
    for lens in ([64] * 32, [136] * 15, [500, 500, 1000], [1000, 1000]):
        for dtype in (torch.float32, torch.bfloat16):
            kc, vc, tables = paged(lens, dtype, g)
            cu = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], dtype=torch.long)
            start = torch.zeros(len(lens), dtype=torch.long)
            n = int(cu[-1])
            q = torch.randn(n, HEADS, D, generator=g).to(dtype)
            # The same K/V as contiguous per-sequence tensors, for SDPA.
            slots = torch.cat([tables[i, torch.arange(x) // BS] * BS + torch.arange(x) % BS
                               for i, x in enumerate(lens)])
            k = kc.view(-1, KVH, D)[slots]
            v = vc.view(-1, KVH, D)[slots]

            def torch_path():
                for i, x in enumerate(lens):
                    a = int(cu[i])
                    _sdpa_one(q[a : a + x], k[a : a + x], v[a : a + x], D ** -0.5, causal=True)

            t_torch = median_ms(torch_path, reps)
            t_op = median_ms(lambda: ca.paged_prefill(q, kc, vc, tables, cu, start, D ** -0.5), reps)
            flop = sum(4 * x * x / 2 * HEADS * D for x in lens)
            name = f"{len(lens)} x {lens[0]}" if len(set(lens)) == 1 else "+".join(map(str, lens))
            print(f"{name:32s} {str(dtype).replace('torch.', ''):9s} {t_torch:8.2f} ({flop / t_torch / 1e6:5.0f})"
                  f"      {t_op:8.2f} ({flop / t_op / 1e6:5.0f})   {t_torch / t_op:6.2f}")


def bench_decode(reps: int) -> None:
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(50, 1200, (256,), generator=g).sort().values
    print("decode (256 sequences, 50-1,200 tokens)  dtype     torch ms   op ms   torch/op   op GB/s of KV")
    for dtype, consecutive in ((torch.float32, False), (torch.bfloat16, False), (torch.float32, True),
                               (torch.bfloat16, True)):
        if consecutive and dtype == torch.float32:
            print("decode, each sequence's blocks consecutive (the engine's runs)")
        kc, vc, tables = paged(lens.tolist(), dtype, g, consecutive)
        q = torch.randn(len(lens), HEADS, D, generator=g).to(dtype)
        lo = torch.zeros_like(lens)
        blocks = ((lens + BS - 1) // BS).tolist()
        buckets = []
        for s, e in decode_buckets(blocks):
            w = max(blocks[s:e])
            pos = torch.arange(w * BS)[None]
            buckets.append(DecodeBucket(s, e, tables[s:e, :w].contiguous(), (pos < lens[s:e, None])[:, None, None, :]))

        def torch_path():
            out = torch.empty_like(q)
            for b in buckets:
                out[b.start : b.end] = _decode_batched(q[b.start : b.end], kc, vc, b, D ** -0.5)

        t_torch = median_ms(torch_path, reps)
        t_op = median_ms(lambda: ca.paged_decode(q, kc, vc, tables, lo, lens, D ** -0.5), reps)
        kv_bytes = int(lens.sum()) * KVH * D * 2 * kc.element_size()
        print(f"{'':41s}{str(dtype).replace('torch.', ''):9s} {t_torch:8.2f} {t_op:7.2f}   {t_torch / t_op:6.2f}"
              f"   {kv_bytes / t_op / 1e6:6.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--shape", default="9,3,64", help="query heads, KV heads, head_dim")
    ap.add_argument("--decode-only", action="store_true")
    args = ap.parse_args()
    global HEADS, KVH, D
    HEADS, KVH, D = (int(x) for x in args.shape.split(","))
    if not ca.available():
        raise SystemExit("the C++ ops could not be built here (see the warning above)")
    print(f"threads: {torch.get_num_threads()}; {HEADS} query heads, {KVH} KV heads, head_dim {D}")
    if not args.decode_only:
        bench_prefill(args.reps)
    bench_decode(args.reps)


if __name__ == "__main__":
    main()
