"""The lm_head and greedy sampling of one decode step, all rows at once against row chunks,
side by side in one run (the fused CPU path computes logits in row chunks of at most
batchgen.runner.model_runner.LOGITS_CHUNK_BYTES).

    .venv/bin/python examples/bench_logits.py [--reps 9]

SmolLM2's shape: hidden 576, vocab 49,152. Medians of --reps calls over 3 alternating rounds;
GFLOP/s count the GEMM only, the time includes the argmax.
"""
from __future__ import annotations

import argparse
import statistics

import torch
from batchgen.kernels import cpu_attention as ops
from batchgen.runner.linear import Linear, onednn_available
from bench_cpu_attention import median_ms  # examples/ is on sys.path when run as a script

HIDDEN, VOCAB = 576, 49152


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    if not (ops.available() and onednn_available()):
        raise SystemExit("needs the C++ CPU ops and oneDNN")
    g = torch.Generator().manual_seed(0)
    print(f"threads: {torch.get_num_threads()}")
    print("dtype     rows  chunk   ms (GFLOP/s)      ratio to one chunk")
    for dtype in (torch.float32, torch.bfloat16):
        lin = Linear((torch.randn(VOCAB, HIDDEN, generator=g) * 0.02).to(dtype), None, "onednn")
        for rows in (256, 192, 128):
            x = torch.randn(rows, HIDDEN, generator=g).to(dtype)
            chunks = sorted({rows, 128, 64} & set(range(1, rows + 1)), reverse=True)
            times: dict[int, list[float]] = {c: [] for c in chunks}
            for _ in range(3):
                for c in chunks:
                    times[c].append(median_ms(lambda: [ops.argmax_rows(lin(x[a : a + c])) for a in range(0, rows, c)],
                                              args.reps))
            base = statistics.median(times[rows])
            for c in chunks:
                ms = statistics.median(times[c])
                print(f"{str(dtype).replace('torch.', ''):9s} {rows:4d} {c:6d} {ms:7.1f} ({2 * rows * HIDDEN * VOCAB / ms / 1e6:5.0f})"
                      f"   {base / ms:5.2f}")


if __name__ == "__main__":
    main()
