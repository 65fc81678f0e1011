"""`batchgen bench`: throughput on a ShareGPT workload, side by side with transformers' peers in
the same run, plus this machine's GEMM ceiling for the model.

Peers are slow (transformers' padded generate ran ~20-80 output tok/s here), so by default they
run on the first --peer-num-prompts requests of the same workload; their tok/s are comparable
rates, and the report says how many requests each run used.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import torch

from .metrics import latency_summary, peak_rss_bytes
from .workload import WorkloadItem, cpu_info, sample_sharegpt, sample_workload

log = logging.getLogger("batchgen")


@dataclass
class BenchResult:
    name: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    extra: dict

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tps(self) -> float:
        return (self.output_tokens + self.prompt_tokens) / self.wall_s

    def row(self) -> dict:
        extra = {k: v for k, v in self.extra.items() if k != "output_lengths"}
        return {"name": self.name, "requests": self.num_requests, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "wall_s": round(self.wall_s, 2),
                "output_tok_s": round(self.output_tps, 1), "total_tok_s": round(self.total_tps, 1), **extra}


def workload_requests(items: list[WorkloadItem], response_format: dict | None = None):
    """Greedy requests for a workload: each item's own output length, EOS ignored (a constrained
    request still ends when its constraint is complete)."""
    from .engine.request import SamplingParams
    from .llm import GenerationRequest

    return [GenerationRequest(str(i), w.prompt_token_ids,
                              SamplingParams(max_tokens=w.output_len, temperature=0, ignore_eos=True,
                                             response_format=response_format))
            for i, w in enumerate(items)]


def run_batchgen(model, tokenizer, items: list[WorkloadItem], dtype: str, identity: str,
                 response_format: dict | None = None, **engine_kw) -> BenchResult:
    """model: a ModelSource (loaded here in `dtype`), a Checkpoint or a transformers model."""
    from .config import EngineSpec, ModelSpec
    from .llm import Engine
    from .models.loader import ModelSource, load_checkpoint

    if isinstance(model, ModelSource):
        model = load_checkpoint(model, dtype)
    engine = Engine(model, tokenizer, EngineSpec(**engine_kw), ModelSpec(dtype=dtype), model_identity=identity,
                    max_seq_tokens=max(len(w.prompt_token_ids) + w.output_len for w in items))
    reqs = workload_requests(items, response_format)
    t0 = time.perf_counter()
    results = list(engine.generate(reqs))
    wall = time.perf_counter() - t0
    out = sum(r.completion_tokens for r in results)
    c = engine.counters()
    lengths = {r.request_id: r.completion_tokens for r in results}
    extra = {"dtype": dtype, "output_lengths": [lengths[str(i)] for i in range(len(items))],
             "ttft_s": latency_summary([r.ttft_s for r in results if r.ttft_s is not None]),
             "itl_s": latency_summary([r.itl_s for r in results if r.itl_s is not None]),
             "kv_cache_gib": round(c["kv_cache_bytes"] / 2**30, 3), "num_kv_blocks": c["num_kv_blocks"],
             "peak_kv_blocks": c["peak_kv_blocks"], "preemptions": c["preemptions"], "steps": c["steps"],
             "peak_running": c["peak_running"], "linear_path": c["linear_path"],
             "attention_backend": c["attention_backend"], "fused_layer_ops": c["fused_layer_ops"]}
    del engine
    name = f"batchgen {dtype}" + (f" + {response_format['type']}" if response_format else "")
    return BenchResult(name, len(items), sum(len(w.prompt_token_ids) for w in items), out, wall, extra)


def run_hf_generate(hf_model, tokenizer, items: list[WorkloadItem], batch_size: int = 32) -> BenchResult:
    """transformers' generate, left-padded batches in dataset order; useful tokens only."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    t0 = time.perf_counter()
    for s in range(0, len(items), batch_size):
        batch = items[s : s + batch_size]
        width = max(len(w.prompt_token_ids) for w in batch)
        ids = torch.tensor([[pad] * (width - len(w.prompt_token_ids)) + w.prompt_token_ids for w in batch],
                           device=hf_model.device)
        mask = torch.tensor([[0] * (width - len(w.prompt_token_ids)) + [1] * len(w.prompt_token_ids) for w in batch],
                            device=hf_model.device)
        n = max(w.output_len for w in batch)
        with torch.inference_mode():
            hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=pad)
    wall = time.perf_counter() - t0
    return BenchResult(f"transformers generate (padded, batch {batch_size})", len(items),
                       sum(len(w.prompt_token_ids) for w in items), sum(w.output_len for w in items), wall, {})


def run_hf_continuous(hf_model, items: list[WorkloadItem], max_requests: int = 16, max_batch_tokens: int = 512) -> BenchResult:
    """transformers' continuous batching manager (what generate_batch wraps), per-request lengths."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(w.output_len for w in items), pad_token_id=0)
    cb = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens, max_requests_per_batch=max_requests)
    manager = hf_model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    t0 = time.perf_counter()
    try:
        for i, w in enumerate(items):
            manager.add_request(w.prompt_token_ids, request_id=str(i), max_new_tokens=w.output_len, eos_token_id=-1)
        out, got = 0, 0
        while got < len(items):
            r = manager.get_result(timeout=600)
            if r is None:
                raise RuntimeError("transformers' manager returned no result within 600 s")
            if getattr(r, "error", None):
                raise RuntimeError(f"transformers' manager failed request {r.request_id}: {r.error}")
            got += 1
            out += len(r.generated_tokens)
    finally:
        manager.stop(block=True)
    wall = time.perf_counter() - t0
    return BenchResult(f"transformers continuous batching ({max_requests} req, {max_batch_tokens} tok)", len(items),
                       sum(len(w.prompt_token_ids) for w in items), out, wall, {})


def gemm_ceiling(shape, items: list[WorkloadItem], batch: int = 256) -> dict:
    """Measured GEMM FLOP/s at the model's shapes (fp32 and bf16, F.linear, oneDNN, dpbf16 and fma; the best of
    15 calls each), and the output tok/s this workload would reach if it ran at the fastest path's
    rate."""
    from .runner.linear import Linear, amx_gemm_available, dpbf16_available, fma_available, onednn_available

    h, q = shape.hidden_size, shape.num_heads * shape.head_dim
    kv = 2 * shape.num_kv_heads * shape.head_dim
    mats = [(h, q + kv), (q, h), (h, 2 * shape.intermediate_size), (shape.intermediate_size, h)]
    paths = ["plain"] + (["onednn"] if onednn_available() else [])
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        # dpbf16 is for bf16 weights only; fma takes both dtypes
        own = [p for p, ok in (("dpbf16", dpbf16_available), ("amx", amx_gemm_available), ("fma", fma_available))
               if ok() and (dtype == torch.bfloat16 or p == "fma")]
        for path in paths + own:
            flops = secs = 0.0
            for k, n in mats:
                lin = Linear(torch.randn(n, k, dtype=dtype), None, path)
                if lin.path != path:  # e.g. bf16 onto oneDNN where it has no bf16 kernels: measured as fma
                    secs = 0.0
                    break
                x = torch.randn(batch, k, dtype=dtype)
                for _ in range(3):
                    lin(x)
                ts = []
                for _ in range(15):
                    t = time.perf_counter()
                    lin(x)
                    ts.append(time.perf_counter() - t)
                flops += 2 * batch * k * n
                # The fastest of 15: a ceiling is what the machine can do, and on a shared machine
                # a median moves between runs.
                secs += min(ts)
            if secs:
                rates[f"{str(dtype).replace('torch.', '')}/{path}"] = flops / secs
    p_tok = sum(len(w.prompt_token_ids) for w in items)
    o_tok = sum(w.output_len for w in items)
    non_emb = shape.non_embedding_params()
    work = 2 * non_emb * (p_tok + o_tok) + 2 * shape.vocab_size * shape.hidden_size * o_tok
    out = {"gflops": {k: round(v / 1e9, 1) for k, v in rates.items()},
           "workload_gflop": round(work / 1e9, 1), "flop_per_output_token": round(work / o_tok)}
    for dt in ("float32", "bfloat16"):
        best = max(v for k, v in rates.items() if k.startswith(dt))
        out[f"ceiling_output_tok_s_{dt}"] = round(o_tok * best / work, 1)
    return out


def constrained_pair(model, tokenizer, items: list[WorkloadItem], dtype: str, identity: str,
                     response_format: dict, engine_kw: dict) -> tuple[BenchResult, BenchResult]:
    """The workload constrained, then unconstrained with each request's output length set to what
    it generated constrained: the same tokens either way, so the ratio is the constraint's cost."""
    from dataclasses import replace

    constrained = run_batchgen(model, tokenizer, items, dtype, identity, response_format, **engine_kw)
    same = [replace(w, output_len=max(1, n)) for w, n in zip(items, constrained.extra["output_lengths"])]
    return constrained, run_batchgen(model, tokenizer, same, dtype, identity, None, **engine_kw)


def run_bench(num_prompts: int = 256, output_cap: int = 256, dtypes=("float32", "bfloat16"),
              peers=("hf-cb", "hf-generate"), peer_num_prompts: int | None = 64, model: str = "default",
              engine_kw: dict | None = None, seed: int = 0, response_format: dict | None = None,
              workload: str = "prompt-heavy") -> dict:
    from .models.loader import load_config, load_hf_model, load_tokenizer, resolve_model
    from .shapes import ModelShape

    source = resolve_model(model)
    tokenizer = load_tokenizer(source)
    items = sample_workload(workload, tokenizer, num_prompts, output_cap, seed=seed)
    shape = ModelShape.from_config(load_config(source))
    report: dict = {"cpu": cpu_info(), "model": source.identity,
                    "workload": {"source": "ShareGPT_V3_unfiltered_cleaned_split.json", "kind": workload,
                                 "num_prompts": len(items),
                                 "output_cap": output_cap, "prompt_tokens": sum(len(w.prompt_token_ids) for w in items),
                                 "output_tokens": sum(w.output_len for w in items)},
                    "torch_threads": torch.get_num_threads(), "results": []}
    log.info("bench: %d prompts, %d prompt + %d output tokens", len(items), report["workload"]["prompt_tokens"],
             report["workload"]["output_tokens"])
    report["ceiling"] = gemm_ceiling(shape, items)
    ours = []
    for dtype in dtypes:
        if response_format is not None:
            c, u = constrained_pair(source, tokenizer, items, dtype, source.identity, response_format,
                                    engine_kw or {})
            for r in (c, u):
                log.info("%s: %.1f output tok/s", r.name, r.output_tps)
                report["results"].append(r.row())
            report.setdefault("constraint", {})[dtype] = {
                "response_format": response_format, "output_tokens": c.output_tokens,
                "constrained_over_unconstrained": round(c.output_tps / u.output_tps, 3)}
            ours.append(u)
            continue
        r = run_batchgen(source, tokenizer, items, dtype, source.identity, **(engine_kw or {}))
        log.info("%s: %.1f output tok/s", r.name, r.output_tps)
        report["results"].append(r.row())
        ours.append(r)
    peer_items = items[:peer_num_prompts] if peer_num_prompts else items
    peer_results = []
    hf_model = load_hf_model(source) if peers else None
    for peer in peers:
        try:
            if peer == "hf-cb":
                r = run_hf_continuous(hf_model, peer_items)
            elif peer == "hf-generate":
                r = run_hf_generate(hf_model, tokenizer, peer_items)
            else:
                raise ValueError(f"unknown peer {peer!r} (hf-cb, hf-generate)")
        except Exception as e:  # a peer failing must not lose our figures
            log.warning("peer %s failed: %s", peer, e)
            report["results"].append({"name": peer, "error": str(e)})
            continue
        log.info("%s: %.1f output tok/s", r.name, r.output_tps)
        report["results"].append(r.row())
        peer_results.append(r)
    ratios = {}
    for o in ours:
        dt = o.extra["dtype"]
        ratios[f"{o.name} / GEMM ceiling"] = round(o.output_tps / report["ceiling"][f"ceiling_output_tok_s_{dt}"], 3)
        for p in peer_results:
            if p.output_tokens:
                ratios[f"{o.name} / {p.name}"] = round(o.output_tps / p.output_tps, 2)
    report["ratios"] = ratios
    report["peak_rss_bytes"] = peak_rss_bytes()
    return report


def format_report(report: dict) -> str:
    cpu = report.get("cpu", {})
    march = cpu.get("march", "native")
    built = "" if march == "native" else f", the ops built for -march={march}"
    lines = [f"cpu: {cpu.get('model')} ({', '.join(cpu.get('isa', []))}{built}); GEMMs {cpu.get('gemms')}, attention "
             f"{cpu.get('attention_ops')}", f"model: {report.get('model')}", f"workload: {json.dumps(report['workload'])}",
             "",
             f"{'engine':58s} {'reqs':>5s} {'out tok/s':>10s} {'total tok/s':>12s} {'wall s':>8s}"]
    for r in report["results"]:
        if "error" in r:
            lines.append(f"{r['name']:58s} failed: {r['error']}")
            continue
        lines.append(f"{r['name']:58s} {r['requests']:5d} {r['output_tok_s']:10.1f} {r['total_tok_s']:12.1f} {r['wall_s']:8.1f}")
        if "ttft_s" in r:
            lines.append(f"    TTFT p50/p99 {r['ttft_s']['p50']}/{r['ttft_s']['p99']} s, ITL p50/p99 "
                         f"{r['itl_s']['p50']}/{r['itl_s']['p99']} s, KV {r['kv_cache_gib']} GiB "
                         f"({r['num_kv_blocks']} blocks, peak {r['peak_kv_blocks']}), preemptions {r['preemptions']}")
    c = report["ceiling"]
    lines += ["", f"GEMM GFLOP/s at the model's shapes (batch 256): {c['gflops']}",
              f"ceiling: {c['ceiling_output_tok_s_float32']} output tok/s fp32, {c['ceiling_output_tok_s_bfloat16']} bf16 "
              f"({c['flop_per_output_token'] / 1e6:.0f} MFLOP per output token)", "", "ratios:"]
    lines += [f"  {k}: {v}" for k, v in report["ratios"].items()]
    for dt, c in report.get("constraint", {}).items():
        lines.append(f"  {dt}: with response_format {c['response_format']['type']} / without, same "
                     f"{c['output_tokens']} output tokens: {c['constrained_over_unconstrained']}")
    lines.append(f"peak RSS {report['peak_rss_bytes'] / 2**30:.2f} GiB")
    return "\n".join(lines)


SWEEPABLE = ("max_num_seqs", "max_num_batched_tokens", "block_size")


def parse_sweep(text: str) -> tuple[str, list[int]]:
    """'max_num_seqs=1,4,16' -> ('max_num_seqs', [1, 4, 16])."""
    name, sep, values = text.partition("=")
    if not sep or name not in SWEEPABLE:
        raise ValueError(f"--sweep takes NAME=v1,v2,... with NAME one of {', '.join(SWEEPABLE)}; got {text!r}")
    try:
        vals = [int(v) for v in values.split(",") if v]
    except ValueError:
        raise ValueError(f"--sweep {text!r}: values must be integers") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"--sweep {text!r}: give positive values")
    return name, vals


def run_sweep(name: str, values: list[int], num_prompts: int, output_cap: int, dtype: str = "float32",
              model: str = "default", engine_kw: dict | None = None, plot_path: str | None = None) -> dict:
    """The same workload at each setting: the throughput-latency curve."""
    from .models.loader import load_tokenizer, resolve_model

    source = resolve_model(model)
    tokenizer = load_tokenizer(source)
    items = sample_sharegpt(tokenizer, num_prompts, output_cap)
    rows = []
    for v in values:
        kw = dict(engine_kw or {})
        kw[name] = v
        r = run_batchgen(source, tokenizer, items, dtype, source.identity, **kw).row()
        r[name] = v
        log.info("%s=%d: %.1f output tok/s, ITL p50 %s s", name, v, r["output_tok_s"], r["itl_s"]["p50"])
        rows.append(r)
    report = {"sweep": name, "values": values, "dtype": dtype, "num_prompts": len(items), "output_cap": output_cap,
              "rows": rows}
    if plot_path:
        plot_sweep(report, plot_path)
        report["plot"] = plot_path
    return report


def plot_sweep(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name = report["sweep"]
    xs = [r["itl_s"]["p50"] * 1000 if r["itl_s"]["p50"] is not None else 0.0 for r in report["rows"]]
    ys = [r["output_tok_s"] for r in report["rows"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, ys, marker="o")
    for x, y, r in zip(xs, ys, report["rows"]):
        ax.annotate(f"{name}={r[name]}", (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xlabel("inter-token latency p50 (ms)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"batchgen throughput vs latency ({report['dtype']}, {report['num_prompts']} ShareGPT prompts)")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_sweep(report: dict) -> str:
    name = report["sweep"]
    lines = [f"{name:>22s} {'out tok/s':>10s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'ITL p50':>9s} {'ITL p99':>9s} "
             f"{'preempt':>8s}"]
    for r in report["rows"]:
        t, i = r["ttft_s"], r["itl_s"]

        def f(x):
            return f"{x:9.3f}" if x is not None else f"{'-':>9s}"

        lines.append(f"{r[name]:22d} {r['output_tok_s']:10.1f} {f(t['p50'])} {f(t['p99'])} {f(i['p50'])} {f(i['p99'])} "
                     f"{r['preemptions']:8d}")
    if report.get("plot"):
        lines.append(f"plot: {report['plot']}")
    return "\n".join(lines)


def greedy_with_logprobs(hf, tok, prompts, tokens: int, dtype: str = "float32", kv_dtype: str = "auto") -> dict:
    """Greedy runs of `prompts` with the chosen tokens' logprobs: {"results": {id: result},
    "bytes_per_token": KV bytes a token takes}. kv_quality's runs; its baseline is kv_dtype "auto"."""
    from .config import EngineSpec, ModelSpec
    from .engine.request import SamplingParams
    from .llm import Engine, GenerationRequest

    sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=1)
    e = Engine(hf, tok, EngineSpec(kv_cache_dtype=kv_dtype, kv_cache_gib=1.0), ModelSpec(dtype=dtype))
    results = {r.request_id: r for r in e.generate(GenerationRequest(str(i), p, sp) for i, p in enumerate(prompts))}
    return {"results": results, "bytes_per_token": e.kv_bytes_per_token}


def kv_quality(hf, tok, prompts, tokens: int, dtype: str = "float32", kv_dtype: str = "int8",
               baseline: dict | None = None) -> dict:
    """Quantised (int8 or fp8) KV against the unquantised cache: exact-match rate of the first
    `tokens` greedy tokens, and mean |logprob difference| of the chosen tokens while both runs
    agree. fp8 runs on the torch path here (the same quantiser as the Triton kernels). `baseline`:
    greedy_with_logprobs' unquantised run of the same prompts, when the caller already has it."""
    base = baseline or greedy_with_logprobs(hf, tok, prompts, tokens, dtype)
    if len(base["results"]) != len(prompts):
        raise ValueError(f"the baseline has {len(base['results'])} prompts, not {len(prompts)}")
    quant = greedy_with_logprobs(hf, tok, prompts, tokens, dtype, kv_dtype)
    diffs, exact = [], 0
    for i in range(len(prompts)):
        a, b = quant["results"][str(i)], base["results"][str(i)]
        same = True
        for (ta, (la, _)), (tb, (lb, _)) in zip(zip(a.token_ids, a.logprobs), zip(b.token_ids, b.logprobs)):
            if ta != tb:
                same = False
                break
            diffs.append(abs(la - lb))
        exact += same
    return {"prompts": len(prompts), "tokens": tokens, "exact_match_rate": round(exact / len(prompts), 3),
            "mean_abs_logprob_diff": round(sum(diffs) / len(diffs), 5), "max_abs_logprob_diff": round(max(diffs), 5),
            "kv_dtype": kv_dtype, "kv_bytes_per_token_fp": base["bytes_per_token"],
            f"kv_bytes_per_token_{kv_dtype}": quant["bytes_per_token"]}
