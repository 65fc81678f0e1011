"""Write ShareGPT prompts as a Parquet input for jobs/sharegpt.yaml (the data is never committed).

    python examples/make_sharegpt_parquet.py --num-prompts 256 --output-cap 256 --out out/sharegpt/prompts.parquet

Sampled as vLLM's benchmark_throughput does (see batchgen.workload): the first human turn is
the prompt, the token count of the first reply (capped) is the row's max_tokens.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from batchgen.models.loader import load_tokenizer, resolve_model
from batchgen.workload import sample_sharegpt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--output-cap", type=int, default=256)
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", default="out/sharegpt/prompts.parquet")
    args = ap.parse_args()
    tok = load_tokenizer(resolve_model(args.model))
    # Not chat-templated here: the job applies the template itself.
    items = sample_sharegpt(tok, args.num_prompts, args.output_cap)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": [f"sharegpt-{i:06d}" for i in range(len(items))],
                             "prompt": [w.prompt for w in items],
                             "max_tokens": pa.array([w.output_len for w in items], pa.int32())}), out)
    print(f"wrote {len(items)} prompts to {out}")


if __name__ == "__main__":
    main()
