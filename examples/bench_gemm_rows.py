"""GEMM rate at a model's layer shapes as a function of the rows per call (M), per linear path.

    .venv/bin/python examples/bench_gemm_rows.py --model /tmp/batchgen-ladder/qwen2.5-1.5b \
        [--dtype bfloat16] [--paths onednn,dpbf16]

The engine's CPU linears are `torch.ops.mkldnn._linear_pointwise` over weights packed once, or on
AVX512-BF16 CPUs without AMX our dpbf16 kernel (pipeline/runner/linear.py); vLLM's CPU build
calls oneDNN's brgemm kernels. The paths alternate rep by rep at each M (ABBA), so all see the
same noise; run in turn, a burst of load on a shared machine once put fma at 0.89x oneDNN at 2,048
rows where alternating gave 1.09x. A decode step is one call per linear with M = the running
sequences; a prefill step has up to max_num_batched_tokens rows. Each layer's four linears (fused
QKV, output, fused gate/up, down) run in order over 4 copies of the weights, so weights come from
memory as in a real forward, and the lm_head apart. Medians of --reps; GFLOP/s = 2 * M * K * N / time.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from batchgen.plan import load_model_config, shape_from_config
from batchgen.runner.linear import Linear, dpbf16_available, onednn_available
from batchgen.shapes import ModelShape


def layer_shapes(s: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) features of the dense layer's linears and the lm_head."""
    h, q, kv = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    return {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * s.intermediate_size),
            "down": (s.intermediate_size, h), "lm_head": (h, s.vocab_size)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a local HF folder, a config.json or a GGUF file")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rows", default="1,16,32,64,128,256,512,2048")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--paths", default=None, help="comma-separated linear paths (default: onednn, and dpbf16 "
                    "where it runs and the dtype is bfloat16)")
    args = ap.parse_args()
    if not onednn_available():
        raise SystemExit("this torch build has no oneDNN linear")
    dt = getattr(torch, args.dtype)
    paths = args.paths.split(",") if args.paths else ["onednn"] + (
        ["dpbf16"] if dt == torch.bfloat16 and dpbf16_available() else [])
    cfg, where = load_model_config(args.model)
    shapes = layer_shapes(shape_from_config(cfg, where))
    layer = {k: v for k, v in shapes.items() if k != "lm_head"}
    weights = {k: [(torch.randn(n, kk) * 0.02).to(dt) for _ in range(4)] for k, (kk, n) in layer.items()}
    lm_w = (torch.randn(shapes["lm_head"][1], shapes["lm_head"][0]) * 0.02).to(dt)
    linears = {p: ({k: [Linear(w, None, p) for w in ws] for k, ws in weights.items()}, Linear(lm_w, None, p))
               for p in paths}
    print(f"threads {torch.get_num_threads()}, {args.dtype}, shapes (in, out): {shapes}")
    print(f"{'rows':>6} {'path':>7} {'layer ms':>9} {'layer GFLOP/s':>14} " + " ".join(f"{k + ' GF/s':>13}" for k in shapes))
    for m in (int(x) for x in args.rows.split(",")):
        measure(m, linears, shapes, layer, dt, args.reps)


def measure(m: int, linears: dict, shapes: dict, layer: dict, dt, reps: int) -> None:
    """Each path's layer and lm_head at m rows; the paths alternate rep by rep (ABBA), so a burst of
    load on the machine lands on all of them, and the last line gives each path's layer speed over
    the first's (the first's layer time over theirs)."""
    xs = {k: torch.randn(m, k).to(dt) for k in {kk for kk, _ in shapes.values()}}
    paths = list(linears)
    per = {p: {k: [] for k in shapes} for p in paths}
    layer_t = {p: [] for p in paths}
    for rep in range(reps + 1):
        for path in (paths if rep % 2 == 0 else paths[::-1]):
            copies, lm = linears[path]
            t_layer = 0.0
            for c in range(4):
                for k, (kk, _) in layer.items():
                    t = time.perf_counter()
                    copies[k][c](xs[kk])
                    dt_ = time.perf_counter() - t
                    per[path][k].append(dt_)
                    t_layer += dt_
            layer_t[path].append(t_layer / 4)
            t = time.perf_counter()
            lm(xs[shapes["lm_head"][0]])
            per[path]["lm_head"].append(time.perf_counter() - t)
    flop = {k: 2 * m * kk * n for k, (kk, n) in shapes.items()}
    layer_flop = sum(flop[k] for k in layer)
    lt = {}
    for path in paths:  # the first rep (4 calls of each layer linear, 1 of the lm_head) warms up
        med = {k: statistics.median(v[4:] if k != "lm_head" else v[1:]) for k, v in per[path].items()}
        lt[path] = statistics.median(layer_t[path][1:])
        print(f"{m:>6} {path:>7} {lt[path] * 1e3:>9.2f} {layer_flop / lt[path] / 1e9:>14.0f} "
              + " ".join(f"{flop[k] / med[k] / 1e9:>13.0f}" for k in shapes), flush=True)
    if len(paths) > 1:
        print(f"{m:>6} layer speed over {paths[0]}'s: "
              + ", ".join(f"{p} {lt[paths[0]] / lt[p]:.3f}" for p in paths[1:]), flush=True)


if __name__ == "__main__":
    main()
