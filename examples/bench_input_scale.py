"""The input path at scale: millions of short prompts, read, templated, tokenized, committed.

    .venv/bin/python examples/bench_input_scale.py --rows 1000000 [--engine stub|model] [--window ...]

Writes N rows of short one-turn prompts (about 20 words) to Parquet once (cached under
/tmp/batchgen-scale), then runs the job with max_tokens 1 in a fresh process and reports:
- start-up: seconds from the start to the first request reaching the engine and to the first
  committed part;
- input rows/s: rows committed per second of the whole run (read, template, tokenize, ledger,
  write), with the engine stubbed out (`--engine stub`: one token per row, no model) or the real
  default model at one token per row (`--engine model`);
- peak RSS of the run, and of `batchgen status` and `batchgen merge` afterwards (each in its own
  process), with their wall times;
- with --resume-check: the start-up of a resume after half the rows are done.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

WORDS = ("alpha beta gamma delta river mountain cloud stone window garden music paper light city "
         "quiet simple question answer number story").split()


def make_input(rows: int, folder: Path, files: int) -> Path:
    import numpy as np
    import polars as pl

    out = folder / f"rows-{rows}"
    if (out / "done").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per = -(-rows // files)
    for f in range(files):
        n = min(per, rows - f * per)
        if n <= 0:
            break
        words = pl.DataFrame({f"w{k}": rng.choice(WORDS, n) for k in range(18)})
        df = words.select(
            id=pl.int_range(f * per, f * per + n).cast(pl.Utf8).str.zfill(9),
            prompt=pl.concat_str([pl.lit("Tell me about")] + [pl.col(f"w{k}") for k in range(18)] + [pl.lit("please.")],
                                 separator=" "))
        df.write_parquet(out / f"part-{f:03d}.parquet", row_group_size=100_000)
    (out / "done").write_text("ok")
    return out


def write_job(data: Path, out: Path, window: int, model: str) -> Path:
    job = out.with_suffix(".yaml")
    job.write_text(json.dumps({
        "model": model, "input": {"path": str(data), "prompt_column": "prompt", "id_column": "id",
                                  "window_rows": window},
        "output": {"path": str(out), "rows_per_part": 20000, "flush_interval_s": 30},
        "sampling": {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True},
        "engine": {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "kv_cache_gib": 1.0}}))
    return job


class StubEngine:
    """Stands in for the engine: one token per request, at once (the input path alone)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def generate(self, requests, should_stop=None, grace_s=0.0, on_step=None):
        from batchgen.llm import GenerationResult

        for k, r in enumerate(requests):
            yield GenerationResult(r.request_id, 0, "x", [42], "length", None, len(r.prompt_token_ids), 0, 0.0,
                                   None, [], 0)
            if on_step is not None and k % 256 == 0:
                on_step(self)
            if should_stop is not None and should_stop():
                return

    def stats(self):
        from batchgen.llm import EngineStats

        return EngineStats(*([0] * 4), *([0] * 12))

    def counters(self) -> dict:
        return {"engine": "stub"}


def child_run(job: str, engine: str, limit: int | None = None) -> None:
    """In a fresh process: run the job, print timings as JSON."""
    from batchgen.config import load_job
    from batchgen.io import store
    from batchgen.job import run

    marks: dict = {"start": time.monotonic()}
    real_commit = store.OutputStore.commit

    def commit(self, *a, **k):
        marks.setdefault("first_part", time.monotonic())
        return real_commit(self, *a, **k)

    store.OutputStore.commit = commit
    real_generate = run.generate_rows

    def generate_rows(engine_, windows, *a, **k):
        def first(ws):
            for w in ws:
                marks.setdefault("first_window", time.monotonic())
                yield w
        return real_generate(engine_, first(windows), *a, **k)

    run.generate_rows = generate_rows
    if engine == "stub":
        run.load_engine = lambda job: StubEngine(job.tokenizer)
    summary = run.run_job(load_job(job), progress=False, limit=limit)
    end = time.monotonic()
    print(json.dumps({"rows": summary.get("rows_done"), "wall_s": round(end - marks["start"], 2),
                      "to_first_request_s": round(marks.get("first_window", end) - marks["start"], 2),
                      "to_first_part_s": round(marks.get("first_part", end) - marks["start"], 2),
                      "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}))


def timed(cmd: list[str]) -> dict:
    t = time.monotonic()
    p = subprocess.run(["/usr/bin/time", "-f", "%M"] + cmd, capture_output=True, text=True)
    if p.returncode not in (0, 1):
        raise RuntimeError(p.stderr[-2000:])
    return {"wall_s": round(time.monotonic() - t, 2), "peak_rss_gib": round(int(p.stderr.strip().splitlines()[-1]) / 2**20, 2),
            "exit": p.returncode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--files", type=int, default=10)
    ap.add_argument("--window", type=int, default=100_000)
    ap.add_argument("--engine", choices=["stub", "model"], default="stub")
    ap.add_argument("--model", default="default")
    ap.add_argument("--tmp", default="/tmp/batchgen-scale")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--skip-merge", action="store_true")
    ap.add_argument("--resume-check", action="store_true",
                    help="run half the rows first, then time the resume's start-up on the other half")
    ap.add_argument("--limit", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_run(args.child, args.engine, args.limit)
        return
    tmp = Path(args.tmp)
    t = time.monotonic()
    data = make_input(args.rows, tmp, args.files)
    print(f"input: {args.rows} rows in {data} ({time.monotonic() - t:.1f}s to make or find)", flush=True)
    out = tmp / f"out-{args.rows}-{args.engine}"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    job = write_job(data, out, args.window, args.model)
    py = sys.executable

    def child(limit: int | None = None) -> dict:
        cmd = [py, __file__, "--child", str(job), "--engine", args.engine] + (["--limit", str(limit)] if limit else [])
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(p.stderr[-3000:])
        return json.loads(p.stdout.strip().splitlines()[-1])

    report = {"rows": args.rows, "engine": args.engine, "window_rows": args.window}
    if args.resume_check:
        report["first_half"] = child(args.rows // 2)
    res = child()
    res["input_rows_per_s"] = round(res["rows"] / res["wall_s"])
    report["run" if not args.resume_check else "resume"] = res
    bg = str(Path(py).with_name("batchgen"))
    report["status"] = timed([bg, "status", str(job)])
    if not args.skip_merge:
        report["merge"] = timed([bg, "merge", str(job)])
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
