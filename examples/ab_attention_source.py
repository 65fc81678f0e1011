"""Our CPU decode attention (kernels/csrc/paged_attention_cpu.cpp), or with --op prefill the prompt
attention (kernels/csrc/prefill_attention_cpu.cpp), at a git revision against the working tree's,
and against any variant files, in one process: the speed check for a change to the kernel.

    .venv/bin/python examples/ab_attention_source.py --base HEAD~1 [--op decode|prefill]
        [--variant NAME=FILE.cpp ...] [--shape 9,3,64] [--dtype float32|bfloat16] [--threads 1,2]
        [--cases 256x625,mixed,64x150] [--reps 9]

Each source is built with the engine's flags as its own op library (torch.ops.ab_base,
torch.ops.ab_head, torch.ops.ab_<NAME>), as examples/ab_gemm_source.py does for the GEMMs. A case
is N sequences of L tokens (`NxL`), or `mixed` (256 sequences of 50-1,200 tokens), each
sequence's blocks consecutive in a shuffled cache, as the engine's runs place them. Every build
first runs once and must agree with base (the largest difference is printed); then the builds
alternate call by call (the order reversed every other rep), and the medians give ms, GB/s of K/V
read (each K and V byte once) and the speed over base. With --op prefill a case `NxL` is N whole
prompts of L tokens and `mixed` 64 prompts of 16-512 tokens; the figures are ms, GFLOP/s of the
causal half (4 * L^2 / 2 * heads * head_dim a prompt) and the speed over base.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import bench_cpu_attention as bca  # noqa: E402
from ab_gemm_source import CSRC, build, sources_at  # noqa: E402

SOURCES = {"decode": ("paged_attention_cpu.cpp", "TORCH_LIBRARY(batchgen_cpu, m)"),
           "prefill": ("prefill_attention_cpu.cpp", "TORCH_LIBRARY_FRAGMENT(batchgen_cpu, m)")}


def lengths(case: str, g: torch.Generator, op: str = "decode") -> list[int]:
    if case == "mixed":
        if op == "prefill":
            return torch.randint(16, 513, (64,), generator=g).tolist()
        return torch.randint(50, 1200, (256,), generator=g).tolist()
    try:
        n, length = (int(x) for x in case.split("x"))
    except ValueError:
        raise SystemExit(f"--cases: {case!r} is neither NxL (e.g. 256x625) nor mixed") from None
    return [length] * n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the git revision to compare with")
    ap.add_argument("--op", default="decode", choices=sorted(SOURCES), help="the decode or the prompt attention op")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FILE",
                    help="another source of the op's file to time beside them (repeatable)")
    ap.add_argument("--shape", default="9,3,64", help="query heads, KV heads, head_dim")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--cases", default="256x625,mixed,64x150")
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    heads, kvh, d = (int(x) for x in args.shape.split(","))
    source, marker = SOURCES[args.op]
    bca.HEADS, bca.KVH, bca.D = heads, kvh, d
    head = {f: (ROOT / CSRC / f).read_text() for f in (source, "cpu_common.h")}
    builds = {"base": sources_at(args.base, source), "head": head}
    for spec in args.variant:
        name, _, path = spec.partition("=")
        if not name.isidentifier() or not path:
            raise SystemExit(f"--variant {spec!r}: want NAME=FILE, NAME a Python identifier")
        builds[name] = {source: Path(path).read_text(), "cpu_common.h": head["cpu_common.h"]}
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory(prefix="ab_attn_") as tmp:
        ops = {}
        for name, files in builds.items():
            build(f"ab_{name}", files, Path(tmp) / name, source, marker)
            ops[name] = getattr(getattr(torch.ops, f"ab_{name}"), f"paged_{args.op}")
        print(f"{args.op}: {heads} query heads, {kvh} KV heads, head_dim {d}, {args.dtype}; builds: {', '.join(ops)}")
        g = torch.Generator().manual_seed(1)
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for case in args.cases.split(","):
                lens = torch.tensor(lengths(case, g, args.op))
                kc, vc, tables = bca.paged(lens.tolist(), dtype, g, consecutive=True)
                zeros = torch.zeros_like(lens)  # prefill: each prompt's start; decode: each window's low end
                if args.op == "prefill":  # whole prompts: one query row per token
                    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
                    q = torch.randn(int(cu[-1]), heads, d, generator=g).to(dtype)
                    rest = (q, kc, vc, None, None, tables, cu, zeros, 0, d ** -0.5, 0.0)
                    work, unit = sum(4 * x * x / 2 * heads * d for x in lens.tolist()), "GFLOP/s"
                else:
                    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
                    rest = (None, q, kc, vc, None, None, tables, zeros, lens, d ** -0.5, 0.0)
                    work, unit = int(lens.sum()) * kvh * d * 2 * kc.element_size(), "GB/s"
                outs = {n: torch.empty_like(q) for n in ops}

                def call(n: str) -> None:
                    ops[n](outs[n], *rest)

                for n in ops:
                    call(n)
                diff = max((outs[n].float() - outs["base"].float()).abs().max().item() for n in ops)
                times = {n: [] for n in ops}
                for rep in range(args.reps):
                    for n in (list(ops) if rep % 2 == 0 else list(ops)[::-1]):
                        t = time.perf_counter()
                        call(n)
                        times[n].append(time.perf_counter() - t)
                med = {n: statistics.median(t) for n, t in times.items()}
                cells = "  ".join(f"{n} {med[n] * 1e3:.2f} ms {work / med[n] / 1e9:.1f} {unit} {med['base'] / med[n]:.3f}x"
                                  for n in ops)
                print(f"threads {threads} {case:>9}: {cells}  (max diff {diff:.1e})", flush=True)


if __name__ == "__main__":
    main()
