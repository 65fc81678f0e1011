"""The README's ladder table: one `compare_vllm.py` run per row, one after another, then a table.

    .venv/bin/python examples/make_model_ladder.py --out /tmp/ladder
    .venv/bin/python examples/run_ladder.py --ladder /tmp/ladder --log /tmp/ladder.jsonl
    .venv/bin/python examples/run_ladder.py --render /tmp/ladder.jsonl      # the markdown rows

Each row's result line (compare_vllm.py's JSON) is appended to --log as soon as it is measured,
so a cut-off pass keeps its rows, and `--skip-done` measures only the rows the log lacks.
`--only 1.5b,smollm2` keeps the rows whose model name contains one of the words, `--rows 1,2,14`
those rows of ROWS (numbered from 1; `--list` prints them), `--repeat N` runs each engine N times
per row in alternating order and logs the median pair ratio (compare_vllm.py --repeat). Nothing
else should run on the machine meanwhile: both engines are timed in turn on the same cores.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# (model folder under --ladder, or "default"), workload, dtype, requests, output cap
ROWS = [
    ("qwen2.5-1.5b", "prompt-heavy", "bfloat16", 64, 256),
    ("qwen2.5-1.5b", "decode-heavy", "bfloat16", 64, 256),
    ("qwen2.5-1.5b", "prefill-only", "bfloat16", 64, 256),
    ("qwen2.5-0.5b", "prompt-heavy", "bfloat16", 128, 256),
    ("qwen2.5-0.5b", "prompt-heavy", "float32", 128, 256),
    ("llama-3.2-1b", "prompt-heavy", "bfloat16", 64, 256),
    ("llama-3.2-1b", "prompt-heavy", "float32", 64, 256),
    ("qwen2.5-3b", "prompt-heavy", "bfloat16", 32, 128),
    ("qwen2.5-1.5b", "prompt-heavy", "float32", 32, 128),
    ("llama-3-8b", "prompt-heavy", "bfloat16", 16, 32),
    ("gemma-3-1b", "prompt-heavy", "bfloat16", 64, 256),
    ("gemma-3-1b", "prompt-heavy", "float32", 64, 256),
    ("default", "prompt-heavy", "float32", 128, 256),
    ("default", "prompt-heavy", "bfloat16", 128, 256),
    ("qwen2.5-0.5b", "decode-heavy", "bfloat16", 128, 256),
    ("qwen2.5-3b", "decode-heavy", "bfloat16", 32, 128),
    ("qwen2.5-1.5b", "decode-heavy", "float32", 32, 128),
    ("qwen2.5-1.5b", "prefill-only", "float32", 32, 128),
    ("qwen2.5-3b", "prompt-heavy", "float32", 16, 128),
    ("phi-3-mini", "decode-heavy", "bfloat16", 32, 128),
    ("phi-3-mini", "prompt-heavy", "bfloat16", 32, 128),
    ("qwen3-30b-a3b-6l", "prompt-heavy", "bfloat16", 32, 128),
    ("qwen3-moe-0.5b", "prompt-heavy", "bfloat16", 64, 256),
]
DTYPE = {"bfloat16": "bf16", "float32": "fp32"}


def key(model: str, workload: str, dtype: str, requests: int) -> tuple:
    return (Path(model).name, workload, dtype, requests)


def logged(log: Path) -> list[dict]:
    if not log.exists():
        return []
    rows = []
    for n, line in enumerate(log.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise SystemExit(f"{log}:{n}: not a JSON result line ({e})")
    return rows


def render(rows: list[dict]) -> str:
    out = ["| model | workload | dtype | requests | prompt / output tokens | vLLM CPU | batchgen | batchgen / vLLM "
           "| peak RSS vLLM / batchgen (GiB) | load s vLLM / batchgen |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = "SmolLM2-135M (default)" if r["model"] == "default" else r["model"]
        if r["workload"] == "prefill-only":
            v, b = f"{r['vllm_wall_s']:.1f} s", f"{r['batchgen_wall_s']:.1f} s"
        else:
            v, b = f"{r['vllm_output_tok_s']:,.1f} tok/s", f"{r['batchgen_output_tok_s']:,.1f} tok/s"
        ratio = f"**{r['ratio_batchgen_over_vllm']:.2f}**"
        if r.get("pair_ratios"):  # --repeat: the median, then each alternating pair's ratio
            ratio += " (" + ", ".join(f"{x:.2f}" for x in r["pair_ratios"]) + ")"
        out.append(f"| {name} | {r['workload']} | {DTYPE.get(r['dtype'], r['dtype'])} | {r['requests']} "
                   f"| {r['prompt_tokens']:,} / {r['output_tokens']:,} | {v} | {b} "
                   f"| {ratio} | {r['vllm_peak_rss_gib']} / {r['batchgen_peak_rss_gib']} "
                   f"| {r['vllm_load_s']} / {r['batchgen_load_s']} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ladder", default="/tmp/batchgen-ladder", help="folder of make_model_ladder.py's models")
    ap.add_argument("--log", default="ladder.jsonl", help="result lines are appended here")
    ap.add_argument("--only", default="", help="comma-separated words; keep rows whose model contains one")
    ap.add_argument("--rows", default="", help="comma-separated row numbers of ROWS (from 1)")
    ap.add_argument("--list", action="store_true", help="print the numbered rows and exit")
    ap.add_argument("--skip-done", action="store_true", help="skip rows the log already holds")
    ap.add_argument("--render", metavar="LOG", help="print the markdown table of LOG's rows and exit")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each engine per row (alternating order; median ratio)")
    args = ap.parse_args()
    if args.render:
        print(render(logged(Path(args.render))))
        return
    if args.list:
        for i, row in enumerate(ROWS, 1):
            print(i, *row)
        return
    try:
        picked = {int(r) for r in args.rows.split(",") if r.strip()}
    except ValueError:
        raise SystemExit(f"--rows: comma-separated row numbers, got {args.rows!r}")
    if bad := sorted(r for r in picked if not 1 <= r <= len(ROWS)):
        raise SystemExit(f"--rows: no row {bad[0]} (rows are 1-{len(ROWS)}; --list prints them)")
    log = Path(args.log)
    done = {key(r["model"], r["workload"], r["dtype"], r["requests"]) for r in logged(log)} if args.skip_done else set()
    words = [w for w in args.only.split(",") if w]
    script = Path(__file__).with_name("compare_vllm.py")
    for i, (model, workload, dtype, n, cap) in enumerate(ROWS, 1):
        if picked and i not in picked:
            continue
        name = "smollm2" if model == "default" else model
        if words and not any(w in name for w in words):
            continue
        if key(model, workload, dtype, n) in done:
            continue
        path = model if model == "default" else str(Path(args.ladder) / model)
        if model != "default" and not Path(path).is_dir():
            raise SystemExit(f"{path}: no such model folder (make it with examples/make_model_ladder.py --out {args.ladder})")
        cmd = [sys.executable, str(script), "--model", path, "--workload", workload, "--num-prompts", str(n),
               "--output-cap", str(cap), "--dtype", dtype, "--repeat", str(args.repeat)]
        print("+", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        result = None
        for line in proc.stdout.splitlines():
            if line.startswith("{") and '"ratio_batchgen_over_vllm"' in line:
                result = json.loads(line)
        if proc.returncode != 0 or result is None:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
            raise SystemExit(f"row {model} {workload} {dtype} failed (exit {proc.returncode}); earlier rows are in {log}")
        with log.open("a") as f:
            f.write(json.dumps(result) + "\n")
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
