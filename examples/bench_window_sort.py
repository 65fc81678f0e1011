"""What sorting prompts by length within a window buys, against a global sort and against none.

    .venv/bin/python examples/bench_window_sort.py [--num-prompts 2048] [--output-cap 64] [--windows 16,1024,1000000]

Writes ShareGPT prompts (as examples/make_sharegpt_parquet.py does) in the dataset's shuffled
order, then runs the same job (jobs/sharegpt.yaml's settings, greedy, EOS ignored, per-row
max_tokens) once per input.window_rows value, each in a fresh process, and reports each run's
output tok/s from summary.json and its ratio to the largest window (a global sort). A window of
16 rows is about no sort at all. Runs alternate in the order given.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=2048)
    ap.add_argument("--output-cap", type=int, default=64)
    ap.add_argument("--windows", default="16,1024,1000000")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="/tmp/batchgen-window-sort")
    args = ap.parse_args()
    out = Path(args.out)
    prompts = out / "prompts.parquet"
    here = Path(__file__).parent
    if not prompts.exists():
        subprocess.run([sys.executable, str(here / "make_sharegpt_parquet.py"), "--num-prompts", str(args.num_prompts),
                        "--output-cap", str(args.output_cap), "--out", str(prompts)], check=True)
    bg = str(Path(sys.executable).with_name("batchgen"))
    rows = []
    for w in [int(x) for x in args.windows.split(",")]:
        res = out / f"w{w}"
        cmd = [bg, "run", str(here.parent / "jobs" / "sharegpt.yaml"), "--restart",
               "--set", f"input.path={prompts}", "--set", f"output.path={res}", "--set", f"input.window_rows={w}",
               "--set", f"model.dtype={args.dtype}", "--set", "output.rows_per_part=1000"]
        subprocess.run(cmd, check=True, capture_output=True)
        s = json.loads((res / "summary.json").read_text())
        rows.append({"window_rows": w, "output_tok_s": s["output_tokens_per_s"], "generate_wall_s": s["generate_wall_s"],
                     "preemptions": s["engine"]["preemptions"], "steps": s["engine"]["steps"]})
        print(json.dumps(rows[-1]), flush=True)
    best = rows[-1]["output_tok_s"]
    for r in rows:
        r["vs_global_sort"] = round(r["output_tok_s"] / best, 3)
    print(json.dumps({"num_prompts": args.num_prompts, "output_cap": args.output_cap, "dtype": args.dtype,
                      "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
