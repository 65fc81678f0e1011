"""The dpbf16 gate/up GEMM with its fused activation against the GEMM followed by silu_mul.

    .venv/bin/python examples/bench_gated_gemm.py [K,I]   (default 1536,8960: Qwen2.5-1.5B's MLP)

Needs an AVX512-BF16 CPU (the dpbf16 path). Three cold weight copies, the two variants alternating
in each of 9 rounds; medians per call.
"""
import time, statistics, torch, sys
from batchgen.runner.linear import Linear
from batchgen.kernels import cpu_attention as ops
torch.manual_seed(0)
K, I = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "1536,8960").split(",")]
ws = [(torch.randn(2*I, K) * .02).bfloat16() for _ in range(3)]
plain = [Linear(w, None, "dpbf16") for w in ws]; fused = [Linear(w, None, "dpbf16", gated="silu") for w in ws]
for m in (1, 8, 16, 32, 64, 128, 256):
    x = torch.randn(m, K).bfloat16()
    tp, tf = [], []
    for _ in range(9):
        t = time.perf_counter()
        for l in plain: ops.silu_mul(l(x))
        tp.append(time.perf_counter() - t)
        t = time.perf_counter()
        for l in fused: l(x)
        tf.append(time.perf_counter() - t)
    a, b = statistics.median(tp) / 3 * 1e3, statistics.median(tf) / 3 * 1e3
    print(f"rows {m:4}: gemm+silu_mul {a:.3f} ms, fused {b:.3f} ms, {a / b:.3f}x")
