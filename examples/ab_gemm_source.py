"""Our CPU GEMMs (kernels/csrc/gemm_cpu.cpp) at a git revision against the working tree's, in one
process: the GEMM-rate check for a change to the kernel.

    .venv/bin/python examples/ab_gemm_source.py --base HEAD~1 --model /tmp/ladder/qwen2.5-1.5b \
        [--dtype bfloat16|float32] [--kernel auto|avx512|fma] [--rows 8,16,32,64,128,256,2048] [--reps 7]

--kernel avx512 compares gemm_bf16 (AVX512-BF16) or gemm_f32_avx512; fma compares the AVX2 kernels,
gemm_bf16_fma or gemm_f32_fma (no activation epilogue: the gate/up GEMM writes both halves); auto
takes avx512 where this CPU's build has it, else fma.

Both sources are built with the engine's flags, each as its own op library (`torch.ops.ab_base`,
`torch.ops.ab_head`), and each packs its own copy of the weights. Under BATCHGEN_CPU_MARCH (e.g.
znver3 or x86-64-v3 on an AVX-512 CPU) both are built for that target: `--kernel fma` then compares
the AVX2 kernels as AVX2 CPUs compile them: a proxy for Zen 3's core-bound rates (it has two
256-bit FMA pipes, as Zen 4 has), not for its memory system. At each row count a layer's four
linears (fused QKV, output, fused gate/up with its SiLU epilogue, down) run over --copies copies
of the weights, so they stream from memory as in a real forward, on 2 MiB pages as the engine holds
them (hostmem; --small-pages: 4 KiB pages, where a panel's four 16-column blocks stream from four
pages at once, and a layout change measured 2-6% faster at 16-2,048 rows that was level on 2 MiB
pages). The two builds alternate (ABBA over the reps), so both see the machine's noise. It first
checks that both give the same values at a few row counts, and says by how much they differ when
they do not. GFLOP/s = 2 * M * K * N / the median time; `head / base` is the ratio of the medians,
`best` that of the fastest reps (steadier where neighbours load the machine in bursts).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from bench_gemm_rows import layer_shapes  # noqa: E402

from batchgen.kernels.cpu_attention import flags  # noqa: E402
from batchgen.plan import load_model_config, shape_from_config  # noqa: E402
from batchgen.runner.hostmem import on_huge_pages  # noqa: E402

CSRC = "kernels/csrc"


FRAGMENT = "TORCH_LIBRARY_FRAGMENT(batchgen_cpu, m)"


def renamed(src: str, name: str, source: str = "gemm_cpu.cpp", marker: str = FRAGMENT) -> str:
    """A source file with its ops registered under torch.ops.<name> instead of batchgen_cpu."""
    if src.count(marker) != 1:
        raise SystemExit(f"{name}: {source} has {src.count(marker)} {marker} lines, not one to rename")
    return src.replace(marker, marker.replace("batchgen_cpu", name))


def build(name: str, files: dict[str, str], where: Path, source: str = "gemm_cpu.cpp", marker: str = FRAGMENT) -> None:
    """Write `source` (its op library renamed to `name`) and cpu_common.h into `where`, then build."""
    from torch.utils.cpp_extension import load

    where.mkdir(parents=True, exist_ok=True)
    (where / source).write_text(renamed(files[source], name, source, marker))
    (where / "cpu_common.h").write_text(files["cpu_common.h"])
    load(name=name, sources=[str(where / source)], extra_cflags=flags() + [f"-I{where}"],
         extra_ldflags=["-fopenmp"], build_directory=str(where), is_python_module=False, verbose=False)


def sources_at(rev: str, source: str = "gemm_cpu.cpp") -> dict[str, str]:
    """`source` and cpu_common.h as they were at git revision `rev`."""
    def show(f: str) -> str:
        r = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{CSRC}/{f}"], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"--base {rev}: {r.stderr.strip()}")
        return r.stdout
    return {f: show(f) for f in (source, "cpu_common.h")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the git revision to compare the working tree's source with")
    ap.add_argument("--model", required=True, help="a local HF folder, a config.json or a GGUF file (its shapes)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rows", default="8,16,32,64,128,256,2048")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--copies", type=int, default=2, help="copies of the layer's weights (more than L3 in all)")
    ap.add_argument("--kernel", default="auto", choices=["auto", "avx512", "fma"])
    ap.add_argument("--small-pages", action="store_true",
                    help="leave the packed weights on 4 KiB pages (by default they are copied onto 2 MiB pages, "
                         "as the engine holds them)")
    args = ap.parse_args()
    bf16 = args.dtype == "bfloat16"
    head = {f: (ROOT / CSRC / f).read_text() for f in ("gemm_cpu.cpp", "cpu_common.h")}
    with tempfile.TemporaryDirectory(prefix="ab_gemm_") as tmp:
        build("ab_base", sources_at(args.base), Path(tmp) / "base")
        build("ab_head", head, Path(tmp) / "head")
        libs = {"base": torch.ops.ab_base, "head": torch.ops.ab_head}
        kernel = pick_kernel(args.kernel, bf16, libs)
        run(libs, args, bf16, kernel)


def pick_kernel(kernel: str, bf16: bool, libs: dict) -> str:
    """avx512 or fma: the kernel asked for (auto: avx512 where the build has it), checked in both builds."""
    need = {"avx512": "has_dpbf16_gemm" if bf16 else "has_avx512_f32_gemm", "fma": "has_fma_bf16_gemm"}
    if kernel == "auto":
        kernel = "avx512" if all(getattr(lib, need["avx512"])() for lib in libs.values()) else "fma"
    if not all(getattr(lib, need[kernel])() for lib in libs.values()):
        isa = {"avx512": "AVX512-BF16" if bf16 else "AVX-512", "fma": "AVX2/FMA"}[kernel]
        raise SystemExit(f"this CPU's build has no {isa} GEMM ({need[kernel]})")
    return kernel


def run(libs: dict, args, bf16: bool, kernel: str) -> None:
    dt = torch.bfloat16 if bf16 else torch.float32
    cfg, where = load_model_config(args.model)
    shapes = {k: v for k, v in layer_shapes(shape_from_config(cfg, where)).items() if k != "lm_head"}
    torch.manual_seed(0)
    layers = []  # (k, n, act, {lib: packed weight})
    for _ in range(args.copies):
        for name, (k, n) in shapes.items():
            w = (torch.randn(n, k) * 0.02).to(dt)
            act = 1 if kernel == "avx512" and name == "gate_up" and n % 32 == 0 else 0
            pack = {v: (lib.pack_bf16_weight if bf16 else lib.pack_f32_weight)(w) for v, lib in libs.items()}
            layers.append((k, n, act, pack if args.small_pages else {v: on_huge_pages(p) for v, p in pack.items()}))
    op = {("avx512", True): "gemm_bf16", ("avx512", False): "gemm_f32_avx512",
          ("fma", True): "gemm_bf16_fma", ("fma", False): "gemm_f32_fma"}[(kernel, bf16)]
    gemm = {v: getattr(lib, op) for v, lib in libs.items()}

    def call(v: str, m: int, xs: dict, outs: dict) -> None:
        for k, n, act, packed in layers:
            if kernel == "avx512":
                gemm[v](outs[(n, act)], xs[k], packed[v], None, act)
            else:  # the AVX2 kernels take no act
                gemm[v](outs[(n, act)], xs[k], packed[v], None)

    def buffers(m: int):
        xs = {k: torch.randn(m, k).to(dt) for k in {k for k, _, _, _ in layers}}
        return xs, {(n, act): torch.empty(m, n // (2 if act else 1), dtype=dt) for _, n, act, _ in layers}

    worst = 0.0
    for m in (1, 5, 13, 32, 300):
        xs, _ = buffers(m)
        got = {}
        for v in libs:
            outs = buffers(m)[1]
            call(v, m, xs, outs)
            got[v] = outs
        worst = max(worst, max((got["head"][key].float() - got["base"][key].float()).abs().max().item()
                               for key in got["head"]))
    print(f"{kernel} {args.dtype}, {torch.get_num_threads()} threads, shapes (in, out): {shapes}, {args.copies} copies; "
          + ("outputs identical" if worst == 0 else f"outputs differ by up to {worst:.3g}"), flush=True)
    print(f"{'rows':>6} {'base GFLOP/s':>13} {'head GFLOP/s':>13} {'head / base':>12} {'best: head / base':>18}")
    for m in (int(r) for r in args.rows.split(",")):
        xs, outs = buffers(m)
        times = {v: [] for v in libs}
        for rep in range(args.reps):
            for v in (("base", "head") if rep % 2 == 0 else ("head", "base")):
                t = time.perf_counter()
                call(v, m, xs, outs)
                times[v].append(time.perf_counter() - t)
        flop = 2 * m * sum(k * n for k, n, _, _ in layers)
        med = {v: statistics.median(t) for v, t in times.items()}
        print(f"{m:>6} {flop / med['base'] / 1e9:>13.0f} {flop / med['head'] / 1e9:>13.0f} "
              f"{med['base'] / med['head']:>12.3f} {min(times['base']) / min(times['head']):>18.3f}", flush=True)


if __name__ == "__main__":
    main()
