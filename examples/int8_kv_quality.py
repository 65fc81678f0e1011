"""Quantised KV quality on the default model: greedy completions and per-token logprobs against
the unquantised cache, over ShareGPT prompts.

    python examples/int8_kv_quality.py [--num-prompts 64] [--tokens 32] [--kv-dtype int8|fp8]

fp8 runs here on the torch path, with the same quantiser (per-token-head e4m3 scales) as the
Triton kernels use on CUDA.

Reports the exact-match rate of the first N tokens, and the mean absolute difference of the
chosen tokens' logprobs over the positions where both runs still agree (after a divergence the
contexts differ and the comparison means nothing).
"""
from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--kv-dtype", default="int8", choices=["int8", "fp8"])
    args = ap.parse_args()
    from batchgen.bench import kv_quality
    from batchgen.models.loader import load_checkpoint, load_tokenizer, resolve_model
    from batchgen.workload import sample_sharegpt

    src = resolve_model("default")
    model, tok = load_checkpoint(src), load_tokenizer(src)
    prompts = [w.prompt_token_ids for w in sample_sharegpt(tok, args.num_prompts, args.tokens)]
    print(json.dumps(kv_quality(model, tok, prompts, args.tokens, kv_dtype=args.kv_dtype), indent=1))


if __name__ == "__main__":
    main()
