"""KV tier benchmarks, side by side in one run (issue: prefix caching and CPU offloading).

    python examples/bench_kv_tiers.py [--num-requests 256] [--prefix-tokens 1000] [--pressure-requests 64]

(a) Shared prefix: N requests share a long prefix (real ShareGPT text), each with a different
    short question; end-to-end throughput with prefix caching on versus off.
(b) Memory pressure: the device KV budget is ~25% of what the batch wants; the CPU tier
    (preemption: swap) versus recompute-only.
(c) int8 KV under a memory-bound budget: the same GiB in the model dtype and in int8.
"""
from __future__ import annotations

import argparse
import json
import time

from batchgen.bench import workload_requests
from batchgen.config import EngineSpec
from batchgen.engine.request import SamplingParams
from batchgen.llm import Engine, GenerationRequest
from batchgen.models.loader import load_checkpoint, load_tokenizer, resolve_model
from batchgen.shapes import cdiv
from batchgen.workload import load_sharegpt_pairs, sample_sharegpt


def timed(engine: Engine, reqs: list[GenerationRequest]) -> dict:
    t = time.perf_counter()
    res = list(engine.generate(reqs))
    wall = time.perf_counter() - t
    out = sum(r.completion_tokens for r in res)
    engine.kv_manager.check_all_free()
    c = engine.counters()
    keep = ("preemptions", "preemptions_swap", "preemptions_recompute", "swapped_out_bytes", "swapped_in_bytes",
            "prefix_hit_rate", "num_kv_blocks", "peak_kv_blocks", "cpu_kv_blocks", "peak_cpu_kv_blocks")
    return {"wall_s": round(wall, 2), "output_tok_s": round(out / wall, 1),
            "tokens": {r.request_id: r.token_ids for r in res}, **{k: c[k] for k in keep}}


def shared_prefix(model, tok, ident, n: int, prefix_tokens: int, out_tokens: int) -> dict:
    pairs = load_sharegpt_pairs()
    text, prefix = "", []
    for human, _ in pairs:
        text += human + "\n"
        prefix = tok(text).input_ids
        if len(prefix) >= prefix_tokens:
            break
    prefix = prefix[:prefix_tokens]
    questions = [tok("\nQuestion: " + h).input_ids for h, _ in pairs if 5 <= len(h) <= 120][:n]
    sp = SamplingParams(max_tokens=out_tokens, temperature=0, ignore_eos=True)
    reqs = [GenerationRequest(str(i), prefix + q, sp) for i, q in enumerate(questions)]
    out = {}
    for caching in (True, False):
        e = Engine(model, tok, EngineSpec(prefix_caching=caching, max_num_seqs=64, kv_cache_gib=2.0),
                   model_identity=ident)
        out["on" if caching else "off"] = timed(e, reqs)
    same = out["on"].pop("tokens") == out["off"].pop("tokens")
    return {"requests": len(reqs), "prefix_tokens": len(prefix), **out, "identical_outputs": same,
            "speedup": round(out["on"]["output_tok_s"] / out["off"]["output_tok_s"], 2)}


def memory_pressure(model, tok, ident, n: int, cap: int) -> dict:
    items = sample_sharegpt(tok, n, cap)
    reqs = workload_requests(items)
    probe = Engine(model, tok, EngineSpec(kv_cache_gib=0.01))
    block_bytes = probe.kv_bytes_per_token * 16
    want = sum(cdiv(len(w.prompt_token_ids) + w.output_len, 16) for w in items)
    device_gib = 0.25 * want * block_bytes / 2**30
    base = dict(kv_cache_gib=device_gib, max_num_seqs=n, prefix_caching=False)
    out = {"requests": len(items), "blocks_wanted": want, "device_kv_gib": round(device_gib, 3)}
    out["cpu_tier"] = timed(Engine(model, tok, EngineSpec(cpu_offload_gib=4 * device_gib, preemption="swap", **base),
                                   model_identity=ident), reqs)
    out["recompute"] = timed(Engine(model, tok, EngineSpec(preemption="recompute", **base), model_identity=ident), reqs)
    out["identical_outputs"] = out["cpu_tier"].pop("tokens") == out["recompute"].pop("tokens")
    out["speedup"] = round(out["cpu_tier"]["output_tok_s"] / out["recompute"]["output_tok_s"], 2)
    return out


def int8_capacity(model, tok, ident, n: int, cap: int, gib: float) -> dict:
    """(c) A memory-bound budget: the same KV GiB in the model dtype and in int8; int8 holds
    ~3.7x the tokens (fp32 model), so more sequences run at once."""
    items = sample_sharegpt(tok, n, cap)
    reqs = workload_requests(items)
    out = {"requests": len(items), "kv_cache_gib": gib}
    for kv in ("auto", "int8"):
        e = Engine(model, tok, EngineSpec(kv_cache_dtype=kv, kv_cache_gib=gib, max_num_seqs=n, prefix_caching=False),
                   model_identity=ident)
        r = timed(e, reqs)
        r.pop("tokens")
        r["peak_running"] = e.scheduler.stats.peak_running
        out[kv] = r
    out["speedup"] = round(out["int8"]["output_tok_s"] / out["auto"]["output_tok_s"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--pressure-requests", type=int, default=64)
    ap.add_argument("--pressure-cap", type=int, default=128)
    ap.add_argument("--int8-requests", type=int, default=128)
    ap.add_argument("--int8-gib", type=float, default=0.5)
    ap.add_argument("--only", default="prefix,pressure,int8", help="scenarios to run: prefix, pressure, int8")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    src = resolve_model("default")
    model, tok = load_checkpoint(src), load_tokenizer(src)
    only = set(args.only.split(","))
    report = {}
    if "prefix" in only:
        report["shared_prefix"] = shared_prefix(model, tok, src.identity, args.num_requests, args.prefix_tokens,
                                                args.output_tokens)
    if "pressure" in only:
        report["memory_pressure"] = memory_pressure(model, tok, src.identity, args.pressure_requests, args.pressure_cap)
    if "int8" in only:
        report["int8_capacity"] = int8_capacity(model, tok, src.identity, args.int8_requests, args.pressure_cap,
                                                args.int8_gib)
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
