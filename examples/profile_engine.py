"""Where an engine step's time goes, on any device: the host phases, a Python profile, and (on
CUDA) how busy the GPU is.

    python examples/profile_engine.py --model FOLDER [--num-prompts 512] [--output-cap 256]
        [--dtype bfloat16] [--workload prompt-heavy] [--top 30] [--skip-cprofile] [--skip-gpu-trace]
        [--cpu-ops] [--trace-prompts 128]

1. phases: milliseconds per step in the scheduler (schedule, update), the runner's input
   preparation, and the rest of the runner's execute (forward, sampling, the token sync), with
   the step count and output tok/s, on a fresh engine;
2. cProfile of a second run, the top functions by own time;
3. on CUDA, torch.profiler over a third run (the first --trace-prompts prompts): the GPU's kernel time as a share of the wall time
   (a low share means the host, not the GPU, sets the pace) and the top kernels;
4. with --cpu-ops, torch.profiler over the host ops of a run of the first --trace-prompts prompts:
   self time per op and per row bucket of its first input (a GEMM's rows: 1, 2-16, 17-64, ...), so a
   decode step's small GEMMs and a prefill chunk's large ones show apart, and our packed GEMMs'
   GFLOP/s in each bucket.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import os
import pstats
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def engine_for(args, source, tokenizer, items):
    from batchgen.config import EngineSpec, ModelSpec
    from batchgen.llm import Engine
    from batchgen.models.loader import load_checkpoint

    return Engine(load_checkpoint(source, args.dtype), tokenizer, EngineSpec(max_num_seqs=args.max_num_seqs),
                  ModelSpec(dtype=args.dtype), model_identity=source.identity,
                  max_seq_tokens=max(len(w.prompt_token_ids) + w.output_len for w in items))


def timed(obj, name: str, key: str, totals: dict) -> None:
    f = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            totals[key] += time.perf_counter() - t

    setattr(obj, name, wrapper)


def run(engine, items) -> tuple[float, int]:
    from batchgen.bench import workload_requests

    t = time.perf_counter()
    out = sum(r.completion_tokens for r in engine.generate(workload_requests(items)))
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--output-cap", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--workload", default="prompt-heavy")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--skip-cprofile", action="store_true")
    ap.add_argument("--skip-gpu-trace", action="store_true")
    ap.add_argument("--trace-prompts", type=int, default=128, help="the first N prompts in the torch.profiler run")
    ap.add_argument("--cpu-ops", action="store_true", help="torch.profiler's host op times, by op and row bucket")
    args = ap.parse_args()
    from batchgen.models.loader import load_tokenizer, resolve_model
    from batchgen.workload import sample_workload

    source = resolve_model(args.model)
    tok = load_tokenizer(source)
    items = sample_workload(args.workload, tok, args.num_prompts, args.output_cap)

    totals: dict = collections.defaultdict(float)
    e = engine_for(args, source, tok, items)
    timed(e.scheduler, "schedule", "schedule", totals)
    timed(e.scheduler, "update", "update", totals)
    timed(e.runner, "_prepare", "prepare", totals)
    timed(e.runner, "execute", "execute", totals)
    wall, out = run(e, items)
    steps = e.counters()["steps"]
    phases = {"schedule": totals["schedule"], "prepare": totals["prepare"],
              "forward+sample": totals["execute"] - totals["prepare"], "update": totals["update"]}
    phases["other"] = wall - sum(phases.values())
    report = {"device": str(e.device), "steps": steps, "output_tok_s": round(out / wall, 1), "wall_s": round(wall, 2),
              "ms_per_step": {k: round(v / steps * 1e3, 3) for k, v in phases.items()},
              "graph_replays": e.counters()["cuda_graph_replays"]}
    print(json.dumps(report), flush=True)
    del e

    if not args.skip_cprofile:
        e = engine_for(args, source, tok, items)
        prof = cProfile.Profile()
        prof.enable()
        run(e, items)
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        print(s.getvalue(), flush=True)
        del e

    if torch.cuda.is_available() and not args.skip_gpu_trace:
        from torch.profiler import ProfilerActivity, profile

        few = items[: args.trace_prompts]
        e = engine_for(args, source, tok, few)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            wall, _ = run(e, few)
        gpu_us = sum(ev.self_device_time_total for ev in p.key_averages() if ev.self_device_time_total > 0)
        print(f"GPU kernel time {gpu_us / 1e6:.2f} s over a {wall:.2f} s run (profiled): {gpu_us / 1e6 / wall:.0%} busy",
              flush=True)
        print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.top), flush=True)

    if args.cpu_ops:
        cpu_op_report(args, source, tok, items[: args.trace_prompts])


ROW_BUCKETS = (1, 16, 64, 256, 1024)


def row_bucket(shapes) -> str:
    """The bucket of the first input's leading dimension: "" for ops without a tensor input."""
    first = next((s for s in shapes if s), None)
    if not first:
        return ""
    rows = first[0]
    lo = 0
    for hi in ROW_BUCKETS:
        if rows <= hi:
            return f"{lo + 1}-{hi}" if hi > lo + 1 else str(hi)
        lo = hi
    return f">{ROW_BUCKETS[-1]}"


def gemm_flops(name: str, shapes) -> int:
    """2 * M * K * N of one call of our packed GEMMs (out, x [M, K], packed [N / 16, ...], ...),
    N counting a gated GEMM's gate and up columns; 0 for other ops."""
    if not name.startswith("batchgen_cpu::gemm") or len(shapes) < 3 or len(shapes[1]) != 2 or not shapes[2]:
        return 0
    return 2 * shapes[1][0] * shapes[1][1] * shapes[2][0] * 16


def group_by_rows(events) -> dict:
    """{(op, row bucket): [self microseconds, calls, GEMM flops]} over torch.profiler's
    per-shape averages."""
    groups: dict = collections.defaultdict(lambda: [0.0, 0, 0])
    for ev in events:
        g = groups[(ev.key, row_bucket(ev.input_shapes))]
        g[0] += ev.self_cpu_time_total
        g[1] += ev.count
        g[2] += ev.count * gemm_flops(ev.key, ev.input_shapes)
    return dict(groups)


def cpu_op_report(args, source, tok, items) -> None:
    from torch.profiler import ProfilerActivity, profile

    e = engine_for(args, source, tok, items)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        wall, out = run(e, items)
    groups = group_by_rows(p.key_averages(group_by_input_shape=True))
    total = sum(g[0] for g in groups.values())
    print(f"host ops: {total / 1e6:.2f} s of self time over a {wall:.2f} s run (profiled), {out} output tokens",
          flush=True)
    print(f"{'op':48} {'rows':>9} {'calls':>8} {'self s':>8} {'share':>6} {'GFLOP/s':>8}")
    for (name, bucket), (us, n, flops) in sorted(groups.items(), key=lambda kv: -kv[1][0])[: args.top]:
        rate = f"{flops / us / 1e3:8.0f}" if flops and us else ""
        print(f"{name[:48]:48} {bucket:>9} {n:8d} {us / 1e6:8.3f} {us / total:6.1%} {rate}")


if __name__ == "__main__":
    sys.exit(main())
