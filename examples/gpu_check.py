"""One GPU check, under 5 minutes on one H200 (issue: Triton kernels for the CUDA path).

    python examples/gpu_check.py [--skip-8b]

(a) runs the kernel tests on real CUDA (TRITON_INTERPRET=0), among them the tier copy between a
    device cache and a pinned host tier (test_block_copy_between_a_device_cache_and_a_pinned_host_tier);
(b) reports decode-attention achieved bandwidth as a fraction of measured device copy bandwidth,
    at contexts of 1k, 8k and 32k tokens with batch 64 (Llama-3-8B KV shape: 8 KV heads, 32 query
    heads, head_dim 128, bf16);
(c) runs the end-to-end ShareGPT benchmark in bf16 on the default model (with and without CUDA
    graphs, and with fp8 KV) and on a random-weight Llama-3-8B-shaped model, printing output tokens/s.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
from batchgen.shapes import cdiv  # noqa: E402


def kernel_tests() -> int:
    env = dict(os.environ, TRITON_INTERPRET="0")
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "tests/test_kernels.py"], env=env)


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


def decode_bandwidth(ctx: int, batch: int = 64, kvh: int = 8, heads: int = 32, d: int = 128, bs: int = 16) -> float:
    from batchgen.kernels.paged_decode import paged_decode

    blocks_per_seq = cdiv(ctx, bs)
    nblocks = batch * blocks_per_seq
    kc = torch.randn(nblocks, bs, kvh, d, dtype=torch.bfloat16, device="cuda")
    vc = torch.randn_like(kc)
    tables = torch.randperm(nblocks, device="cuda", dtype=torch.int32).view(batch, blocks_per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, d, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        paged_decode(q, kc, vc, tables, lens, d ** -0.5)
    torch.cuda.synchronize()
    t = time.perf_counter()
    n = 20
    for _ in range(n):
        paged_decode(q, kc, vc, tables, lens, d ** -0.5)
    torch.cuda.synchronize()
    return 2 * kc.numel() * kc.element_size() * n / (time.perf_counter() - t)


def llama3_8b_like(tmpdir: str) -> str:
    from batchgen.models.loader import load_tokenizer, resolve_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, torch_dtype="bfloat16")
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(tmpdir)
    load_tokenizer(resolve_model("default")).save_pretrained(tmpdir)
    del model
    torch.cuda.empty_cache()
    return tmpdir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--num-prompts", type=int, default=512)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this script needs a CUDA device"
    print("(a) kernel tests on CUDA: exit", kernel_tests(), flush=True)
    bw = copy_bandwidth()
    print(f"(b) device copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    for ctx in (1024, 8192, 32768):
        got = decode_bandwidth(ctx)
        print(f"    decode attention ctx {ctx:6d} batch 64: {got / 1e9:.0f} GB/s = {got / bw:.0%} of copy", flush=True)
    from batchgen.bench import format_report, run_bench

    print("(c) end to end, bf16 (decode under CUDA graphs, the default)", flush=True)
    rep = run_bench(args.num_prompts, 256, dtypes=("bfloat16",), peers=(), engine_kw={"max_num_seqs": 256})
    print(format_report(rep), flush=True)
    for label, kw in (("without CUDA graphs", {"cuda_graphs": False}), ("fp8 KV", {"kv_cache_dtype": "fp8"})):
        rep = run_bench(args.num_prompts, 256, dtypes=("bfloat16",), peers=(),
                        engine_kw={"max_num_seqs": 256, **kw})
        print(f"    bf16, {label}:\n" + format_report(rep), flush=True)
    if not args.skip_8b:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            rep = run_bench(args.num_prompts, 256, dtypes=("bfloat16",), peers=(), model=llama3_8b_like(d),
                            engine_kw={"max_num_seqs": 256})
            print("Llama-3-8B-shaped, random weights:\n" + format_report(rep), flush=True)


if __name__ == "__main__":
    main()
