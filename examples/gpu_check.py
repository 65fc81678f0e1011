"""The one-shot GPU check, sized for one short visit to an H200 (issue 15).

    python examples/gpu_check.py [--model default|FOLDER] [--tokenizer FOLDER] [--budget-s 400] [--out DIR]

Stages, each on its own (one failing does not stop the next), the optional ones only while the
time budget lasts; every figure is printed as it comes and the whole lot is written to
DIR/gpu_check.json:
(a) the Triton kernel tests on real CUDA (TRITON_INTERPRET=0), the fused-MoE kernel tests, and the
    engine's CUDA path end to end in fp32 (greedy tokens equal transformers', with decode under
    CUDA graphs and eager);
(b) decode-attention achieved bandwidth as a fraction of measured device copy bandwidth, at
    contexts of 1k, 8k and 32k tokens with batch 64 (Llama-3-8B's KV shape: 8 KV heads, 32 query
    heads, head_dim 128, bf16), for both decode kernels (blockwise and tiled) side by side, and
    their ratio;
(c) ShareGPT prompt-heavy end to end in bf16 on the default model's shapes: decode under CUDA
    graphs (the default), eager, both again with torch's layer ops instead of the Triton ones
    (BATCHGEN_LAYER_OPS=torch), with an fp8 KV cache, and with the other decode kernel; then transformers' padded generate on
    the same GPU over the first 64 prompts against ours on the same 64 (a ratio);
(e) a small random-weight Qwen3-MoE (the Triton fused-MoE kernel) end to end;
(d) a random-weight Llama-3-8B-shaped bf16 folder (~16 GB, written a tensor at a time), loaded
    onto the GPU in a fresh process: load time, peak host RSS (the streaming loader keeps it near
    one tensor, not the model) and ShareGPT throughput.

--model default is the bundled SmolLM2 (its GGUF); where it is not installed (its 98 MB file
cannot travel to a lent GPU machine), give --tokenizer, a folder holding SmolLM2's tokenizer, and
the check writes random weights at SmolLM2's shapes: the speed is the real model's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from unittest import mock

os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from batchgen.shapes import cdiv  # noqa: E402

# --allow-cpu runs stages c, d and e on the CPU at small sizes: a dry run of the script itself.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CUDA_TESTS = ["tests/test_kernels.py", "tests/test_families.py::test_fused_moe_kernel_matches_reference",
              "tests/test_families.py::test_moe_align_puts_each_pair_once_in_its_experts_block",
              "tests/test_engine.py::test_greedy_on_cuda_matches_transformers"]


def kernel_tests(out: Path) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONSAFEPATH="1")
    workers = str(min(8, os.cpu_count() or 1))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-n", workers, "-p", "no:benchmark", f"--junitxml={out / 'cuda_tests.xml'}", *CUDA_TESTS], env=env, cwd=HERE.parent,
                       capture_output=True, text=True)
    (out / "cuda_tests.log").write_text(p.stdout + p.stderr)
    lines = (p.stdout + p.stderr).strip().splitlines()
    print("\n".join("    " + t for t in lines[-25:]), flush=True)
    summary = next((t for t in reversed(lines) if " passed" in t or " failed" in t or " error" in t), "")
    return {"exit": p.returncode, "summary": summary.strip("= ")}


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * nbytes * 10 / (time.perf_counter() - t)  # read + write


def decode_bandwidth(ctx: int, batch: int = 64, kvh: int = 8, heads: int = 32, d: int = 128, bs: int = 16,
                     kernels=("blockwise", "tiled"), rounds: int = 3) -> dict[str, float]:
    """Achieved bytes/s of each decode kernel on the same cache, alternating kernel by kernel
    (ABAB...) over `rounds`, the best round each."""
    from batchgen.kernels.paged_decode import paged_decode

    blocks_per_seq = cdiv(ctx, bs)
    nblocks = batch * blocks_per_seq
    kc = torch.randn(nblocks, bs, kvh, d, dtype=torch.bfloat16, device="cuda")
    vc = torch.randn_like(kc)
    tables = torch.randperm(nblocks, device="cuda", dtype=torch.int32).view(batch, blocks_per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, d, dtype=torch.bfloat16, device="cuda")
    ref = paged_decode(q, kc, vc, tables, lens, d ** -0.5, kernel=kernels[0])
    for kernel in kernels[1:]:  # the same answer, within bf16 rounding
        err = (paged_decode(q, kc, vc, tables, lens, d ** -0.5, kernel=kernel).float() - ref.float()).abs().max()
        assert err < 2e-2, f"decode kernel {kernel} differs from {kernels[0]} by {err:.3g} at ctx {ctx}"
    best = {k: float("inf") for k in kernels}
    n = 20
    for _ in range(rounds):
        for kernel in kernels:
            for _ in range(3):
                paged_decode(q, kc, vc, tables, lens, d ** -0.5, kernel=kernel)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(n):
                paged_decode(q, kc, vc, tables, lens, d ** -0.5, kernel=kernel)
            torch.cuda.synchronize()
            best[kernel] = min(best[kernel], time.perf_counter() - t)
    return {k: 2 * kc.numel() * kc.element_size() * n / secs for k, secs in best.items()}


def bandwidth() -> dict:
    bw = copy_bandwidth()
    print(f"    device copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    rows = {"copy_gb_s": round(bw / 1e9)}
    for ctx in (1024, 8192, 32768):
        got = decode_bandwidth(ctx)
        for kernel, rate in got.items():
            print(f"    decode attention ({kernel:9s}) ctx {ctx:6d} batch 64: {rate / 1e9:.0f} GB/s = {rate / bw:.0%} of copy",
                  flush=True)
            rows[f"decode_{kernel}_ctx{ctx}_gb_s"] = round(rate / 1e9)
            rows[f"decode_{kernel}_ctx{ctx}_of_copy"] = round(rate / bw, 3)
        rows[f"decode_ctx{ctx}_tiled_over_blockwise"] = round(got["tiled"] / got["blockwise"], 2)
        print(f"    tiled / blockwise at ctx {ctx}: {got['tiled'] / got['blockwise']:.2f}", flush=True)
    return rows


def end_to_end(source, tokenizer, num_prompts: int) -> dict:
    from batchgen.bench import run_batchgen, run_hf_generate
    from batchgen.workload import sample_workload

    items = sample_workload("prompt-heavy", tokenizer, num_prompts, 256)
    print(f"    {len(items)} prompts, {sum(len(w.prompt_token_ids) for w in items)} prompt + "
          f"{sum(w.output_len for w in items)} output tokens", flush=True)
    rows = {}
    from batchgen.kernels import paged_decode as decode_mod

    default_kernel = decode_mod.DEFAULT_DECODE_KERNEL
    torch_ops = {"BATCHGEN_LAYER_OPS": "torch"}  # the layer's norms, RoPE and SiLU-mul as torch ops
    for label, kw, kernel, env in (("graphs", {}, default_kernel, {}),
                                   ("eager", {"cuda_graphs": False}, default_kernel, {}),
                                   ("graphs_torch_layer_ops", {}, default_kernel, torch_ops),
                                   ("eager_torch_layer_ops", {"cuda_graphs": False}, default_kernel, torch_ops),
                                   ("fp8_kv", {"kv_cache_dtype": "fp8"}, default_kernel, {}),
                                   ("graphs_tiled_decode" if default_kernel != "tiled" else "graphs_blockwise_decode",
                                    {}, "tiled" if default_kernel != "tiled" else "blockwise", {})):
        decode_mod.DEFAULT_DECODE_KERNEL = kernel  # read at each launch; a fresh engine captures its own graphs
        try:  # env is read when the engine chooses its backend
            with mock.patch.dict(os.environ, env):
                r = run_batchgen(source, tokenizer, items, "bfloat16", source.identity, max_num_seqs=256, **kw).row()
        finally:
            decode_mod.DEFAULT_DECODE_KERNEL = default_kernel
        rows[label] = {k: r[k] for k in ("output_tok_s", "total_tok_s", "wall_s", "ttft_s", "itl_s", "steps",
                                         "preemptions", "attention_backend", "kv_cache_gib")}
        print(f"    bf16 {label:24s}: {r['output_tok_s']:9.1f} output tok/s, {r['total_tok_s']:9.1f} total tok/s, "
              f"wall {r['wall_s']:.1f} s, TTFT p50 {r['ttft_s']['p50']} s, ITL p50 {r['itl_s']['p50']} s", flush=True)
    from transformers import AutoModelForCausalLM

    from batchgen.models.loader import hf_view

    few = items[:64]
    hf = AutoModelForCausalLM.from_pretrained(str(hf_view(source, "bfloat16")), dtype=torch.bfloat16).to(DEVICE)
    peer = run_hf_generate(hf, tokenizer, few)
    del hf
    ours = run_batchgen(source, tokenizer, few, "bfloat16", source.identity, max_num_seqs=256)
    rows["same_64"] = {"batchgen_output_tok_s": round(ours.output_tps, 1), "hf_generate_output_tok_s":
                       round(peer.output_tps, 1), "ratio": round(ours.output_tps / peer.output_tps, 2)}
    print(f"    same 64 prompts: batchgen {ours.output_tps:.1f}, transformers generate (padded, batch 32) "
          f"{peer.output_tps:.1f} output tok/s: {ours.output_tps / peer.output_tps:.2f}x", flush=True)
    return rows


LOAD_AND_RUN = r"""
import json, os, resource, sys, time
os.environ["TRITON_INTERPRET"] = "0"
from batchgen.bench import workload_requests
from batchgen.config import EngineSpec, ModelSpec
from batchgen.llm import Engine
from batchgen.models.loader import load_checkpoint, load_tokenizer, resolve_model
from batchgen.workload import sample_workload
src = resolve_model(sys.argv[1])
tok = load_tokenizer(src)
t = time.perf_counter()
e = Engine(load_checkpoint(src, "bfloat16"), tok, EngineSpec(max_num_seqs=256), ModelSpec(dtype="bfloat16", device=sys.argv[3]))
load_s, rss = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
items = sample_workload("prompt-heavy", tok, int(sys.argv[2]), 256)
reqs = workload_requests(items)
t = time.perf_counter()
res = list(e.generate(reqs))
wall = time.perf_counter() - t
out = sum(r.completion_tokens for r in res)
print(json.dumps({"model": sys.argv[1], "load_s": round(load_s, 1), "peak_host_rss_gib_after_load": round(rss, 2),
                  "requests": len(reqs), "output_tokens": out, "output_tok_s": round(out / wall, 1),
                  "total_tok_s": round((out + sum(len(w.prompt_token_ids) for w in items)) / wall, 1),
                  "wall_s": round(wall, 1)}))
"""


def load_and_run(folder: Path, num_prompts: int, timeout: float) -> dict:
    p = subprocess.run([sys.executable, "-c", LOAD_AND_RUN, str(folder), str(num_prompts), DEVICE], capture_output=True,
                       text=True, timeout=timeout, env=dict(os.environ, PYTHONSAFEPATH="1"))
    if p.returncode:
        raise RuntimeError(f"exit {p.returncode}: {p.stderr[-3000:]}")
    row = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"    {row}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--tokenizer", help="a folder with SmolLM2's tokenizer, where the bundled GGUF is not installed")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--budget-s", type=float, default=400.0, help="skip the optional stages past this")
    ap.add_argument("--out", default=".")
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--stages", default="a,b,c,e,d", help="which stages to run, in this order")
    ap.add_argument("--allow-cpu", action="store_true", help="a dry run of stages c, d and e on the CPU")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if not torch.cuda.is_available() and not (args.allow_cpu and not {"a", "b"} & set(args.stages.split(","))):
        sys.exit("this script needs a CUDA device (--allow-cpu --stages c,e: a dry run of the end-to-end stages)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "none (a CPU dry run)", "torch": torch.__version__,
                    "triton": __import__("triton").__version__}
    print(json.dumps(report), flush=True)

    def left() -> float:
        return args.budget_s - (time.perf_counter() - t0)

    chosen = args.stages.split(",")

    def stage(key: str, title: str, fn, need_s: float = 0.0):
        if key[0] not in chosen:
            return None
        if left() < need_s:
            print(f"{title}: skipped ({left():.0f} s of the budget left, it needs ~{need_s:.0f})", flush=True)
            report[key] = {"skipped": f"{left():.0f} s left"}
            return None
        print(f"{title} (at {time.perf_counter() - t0:.0f} s)", flush=True)
        t = time.perf_counter()
        try:
            report[key] = fn()
        except Exception as e:  # noqa: BLE001 - one stage failing must not lose the others' figures
            traceback.print_exc()
            report[key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        if isinstance(report[key], dict):
            report[key]["stage_s"] = round(time.perf_counter() - t, 1)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
        return report[key]

    from make_model_ladder import make

    from batchgen.models.loader import load_tokenizer, resolve_model

    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        tok = load_tokenizer(resolve_model("default"))

    stage("a_cuda_tests", "(a) kernel tests and the engine's fp32 CUDA path", lambda: kernel_tests(out))
    stage("b_bandwidth", "(b) bandwidth", bandwidth)

    def e2e():
        model = args.model
        if model == "default" and args.tokenizer:
            model = str(make("smollm2-135m", work, tok))
            print(f"    random weights at SmolLM2-135M's shapes: {model}", flush=True)
        source = resolve_model(model)
        return end_to_end(source, load_tokenizer(source), args.num_prompts)

    stage("c_end_to_end", "(c) ShareGPT prompt-heavy end to end, bf16", e2e, need_s=60)
    stage("e_moe", "(e) Qwen3-MoE-shaped 0.5B (16 experts, 4 per token), Triton fused MoE",
          lambda: load_and_run(make("qwen3-moe-0.5b", work, tok), args.num_prompts, max(30.0, left())), need_s=45)
    if not args.skip_8b:

        def eight_b():
            t = time.perf_counter()
            folder = make("llama-3-8b", work, tok)
            made = time.perf_counter() - t
            print(f"    folder written in {made:.0f} s", flush=True)
            row = load_and_run(folder, args.num_prompts, max(30.0, left()))
            row["folder_written_s"] = round(made, 1)
            return row

        stage("d_llama3_8b", "(d) Llama-3-8B-shaped bf16: write, load, run", eight_b, need_s=150)
    report["total_s"] = round(time.perf_counter() - t0, 1)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1), flush=True)


if __name__ == "__main__":
    main()
