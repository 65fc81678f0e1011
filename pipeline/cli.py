"""The `batchgen` command. Each command parses options, builds a validated spec and calls one
library function.

Exit codes: 0 done (or nothing left to do), 1 bad input or config, 2 bad command line,
3 another run of the job holds its lock, 75 stopped by a signal (rerun to resume),
130 Ctrl-C twice (stopped without draining; committed rows are kept).
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from .errors import BatchgenError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Offline bulk batch inference: Parquet prompts in, resumable Parquet results out.\n\n"
                       "Exit codes: 0 done, 1 bad input/config, 2 bad command line, 3 job locked by another run, "
                       "75 interrupted by a signal (rerun to resume), 130 Ctrl-C twice.")
log = logging.getLogger("batchgen")

JOB_ARG = typer.Argument(..., help="Job spec YAML (see jobs/example.yaml and schemas/job.schema.json)")
SET_OPT = typer.Option(None, "--set", help="Override a spec value: dotted.key=value (YAML value), repeatable")


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s batchgen %(levelname)s %(message)s", stream=sys.stderr)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _fail(err: BatchgenError) -> None:
    if os.environ.get("BATCHGEN_DEBUG"):
        raise err
    typer.echo(f"error: {err}", err=True)
    raise typer.Exit(err.exit_code)


@app.command()
def run(job: Path = JOB_ARG,
        restart: bool = typer.Option(False, "--restart", help="Discard existing output of this job and start over"),
        limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Run at most N of the rows not yet done"),
        shard: Optional[str] = typer.Option(None, "--shard", help="I/N: run task I (0-based) of N; defaults to "
                                            "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT when set"),
        data_parallel: Optional[int] = typer.Option(None, "--data-parallel", min=1,
                                                    help="Engine processes on this node (overrides engine.data_parallel)"),
        runner: str = typer.Option("local", "--runner", help="local, or ray (Ray Data; needs batchgen[ray])"),
        set_: Optional[List[str]] = SET_OPT) -> None:
    """Run a job, or resume it from its ledger. Results go to output.path as Parquet parts."""
    _setup_logging()
    from .config import load_job
    from .job import run_job
    from .shard import parse_shard

    try:
        spec = load_job(job, set_)
        dp = data_parallel or spec.engine.data_parallel
        if runner == "ray":
            from .ray_runner import run_ray

            summary = run_ray(spec, restart=restart, limit=limit, num_actors=dp)
        elif runner != "local":
            raise BatchgenError(f"--runner: {runner!r} is not one of local, ray")
        elif dp > 1:
            from .parallel import run_data_parallel

            summary = run_data_parallel(spec, dp, restart=restart, limit=limit)
            typer.echo(f"done: {summary['rows_ok']} ok, {summary['rows_error']} errors over {dp} workers; "
                       f"{summary['rows_done']}/{summary['rows_total']} rows of the job are done")
            return
        else:
            summary = run_job(spec, restart=restart, limit=limit, shard=parse_shard(shard))
    except BatchgenError as e:
        _fail(e)
    except KeyboardInterrupt:
        typer.echo("error: interrupted twice: stopped without draining; rows committed so far are kept, "
                   "rerun the same command to resume", err=True)
        raise typer.Exit(130) from None
    if summary.get("status") == "already_complete":
        typer.echo(f"job already complete: {summary['rows_total']} rows; nothing to do")
        return
    rate = f" at {summary['output_tokens_per_s']} tok/s" if summary.get("output_tokens_per_s") else ""
    typer.echo(f"done: {summary['rows_ok']} ok, {summary['rows_error']} errors, "
               f"{summary['completion_tokens']} tokens{rate}; "
               f"{summary['rows_done']}/{summary['rows_total']} rows of the job are done")


@app.command()
def merge(job: Path = JOB_ARG, set_: Optional[List[str]] = SET_OPT) -> None:
    """Compact all tasks' parts into output.path/merged/, ordered by id, after checking that
    every input id is present exactly once."""
    _setup_logging()
    from .config import load_job
    from .job import merge_job

    try:
        res = merge_job(load_job(job, set_))
    except BatchgenError as e:
        _fail(e)
    typer.echo(f"merged {res['rows']} rows ({res['ids']} ids) into {res['parts']} part(s) at {res['path']}")


@app.command()
def validate(job: Path = JOB_ARG, set_: Optional[List[str]] = SET_OPT) -> None:
    """Check the spec, input files, columns, prompts and model without generating."""
    _setup_logging()
    from .config import load_job
    from .io.sources import read_input
    from .job import context_length
    from .models.loader import load_config, load_tokenizer, resolve_model
    from .prepare import prepare_rows

    try:
        spec = load_job(job, set_)
        rows = read_input(spec.input)
        source = resolve_model(spec.model.path)
        max_len = context_length(spec, load_config(source))
        prepared = prepare_rows(rows, spec, load_tokenizer(source), max_len)
    except BatchgenError as e:
        _fail(e)
    lengths = [len(prepared.token_ids[i]) for i in prepared.order]
    typer.echo(f"ok: {len(rows)} rows in {len(rows.shards)} shard(s); model {source.identity}, context {max_len}")
    if lengths:
        typer.echo(f"prompt tokens: min {min(lengths)}, max {max(lengths)}, total {sum(lengths)}")
    for i, msg in sorted(prepared.errors.items())[:20]:
        typer.echo(f"row error: {rows.where(i)}: {msg}")
    if prepared.errors:
        typer.echo(f"{len(prepared.errors)} row(s) would become error rows (the job still runs)")


@app.command()
def status(job: Path = JOB_ARG, set_: Optional[List[str]] = SET_OPT,
           as_json: bool = typer.Option(False, "--json", help="Print JSON")) -> None:
    """Rows done/total per input shard, read from the ledger."""
    _setup_logging()
    from .config import load_job
    from .job import job_status

    try:
        st = job_status(load_job(job, set_))
    except BatchgenError as e:
        _fail(e)
    if as_json:
        typer.echo(json.dumps(st, indent=1))
        return
    for s in st["shards"]:
        typer.echo(f"{s['shard']}: {s['done']}/{s['rows']}")
    typer.echo(f"total: {st['done']}/{st['rows']} rows done in {st['output']}")


@app.command()
def bench(num_prompts: int = typer.Option(256, "--num-prompts", min=1, help="ShareGPT requests in the workload"),
          output_cap: int = typer.Option(256, "--output-cap", min=1, help="Cap on each request's output tokens"),
          dtypes: str = typer.Option("float32,bfloat16", "--dtype", help="Comma-separated dtypes to run batchgen in"),
          peers: str = typer.Option("hf-cb,hf-generate", "--peers", help="Comma-separated peers: hf-cb, hf-generate; '' for none"),
          peer_num_prompts: int = typer.Option(64, "--peer-num-prompts", min=0,
                                               help="Requests the (slow) peers run; 0 for the whole workload"),
          model: str = typer.Option("default", "--model", help="Model: default, HF folder or .gguf"),
          max_num_seqs: int = typer.Option(256, "--max-num-seqs", min=1),
          max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens", min=1),
          json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the report as JSON here"),
          sweep: Optional[str] = typer.Option(None, "--sweep", help="NAME=v1,v2,...: measure the workload at each "
                                              "setting (max_num_seqs, max_num_batched_tokens, block_size)"),
          plot: Path = typer.Option(Path("out/sweep.png"), "--plot", help="PNG of throughput vs ITL for --sweep")) -> None:
    """Throughput on a ShareGPT workload (sampled as vLLM's benchmark_throughput), side by side with
    transformers' peers, with this CPU's GEMM ceiling and the ratios. With --sweep: the
    throughput-latency curve (a table and a PNG plot) instead."""
    _setup_logging()
    from .bench import format_report, format_sweep, parse_sweep, run_bench, run_sweep

    if sweep:
        try:
            name, values = parse_sweep(sweep)
        except ValueError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2)
        plot.parent.mkdir(parents=True, exist_ok=True)
        kw = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens}
        report = run_sweep(name, values, num_prompts, output_cap, dtypes.split(",")[0], model, kw, str(plot))
        typer.echo(format_sweep(report))
        if json_out:
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_text(json.dumps(report, indent=1))
        return

    report = run_bench(num_prompts, output_cap, [d for d in dtypes.split(",") if d],
                       [p for p in peers.split(",") if p], peer_num_prompts or None, model,
                       {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens})
    typer.echo(format_report(report))
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=1))


@app.command()
def plan(job: Optional[Path] = typer.Argument(None, help="Job spec; its model, dtype and prompt lengths are used"),
         model: Optional[str] = typer.Option(None, "--model", help="Model folder, config.json, .gguf or 'default'"),
         dtype: str = typer.Option("bfloat16", "--dtype", help="Weights dtype: float32, bfloat16 or float16"),
         kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help="KV dtype (default: --dtype, or the "
                                                "job's engine.kv_cache_dtype): float32, bfloat16, float16, int8, fp8"),
         context: Optional[int] = typer.Option(None, "--context", help="Tokens per sequence (prompt + output)"),
         batch: Optional[int] = typer.Option(None, "--batch", help="Sequences at once"),
         kv_gib: Optional[float] = typer.Option(None, "--kv-gib", help="KV budget in GiB (default: the job's, or 16)"),
         set_: Optional[List[str]] = SET_OPT) -> None:
    """Memory plan from the model config alone: weights, KV per token, sequences that fit,
    suggested max_num_seqs / max_num_batched_tokens, and a warning when settings will thrash."""
    from . import plan as planner

    try:
        spec = None
        if job is not None:
            from .config import load_job

            spec = load_job(job, set_)
            model = model or spec.model.path
            if spec.model.dtype != "auto":
                dtype = spec.model.dtype
            if kv_dtype is None and spec.engine.kv_cache_dtype != "auto":
                kv_dtype = spec.engine.kv_cache_dtype
        if model is None:
            raise BatchgenError("give a JOB.yaml or --model")
        for name, value in (("--dtype", dtype), ("--kv-dtype", kv_dtype or dtype)):
            if value not in planner.DTYPE_BYTES:
                raise BatchgenError(f"{name}: {value!r} is not one of {', '.join(planner.DTYPE_BYTES)}")
        cfg, name = planner.load_model_config(model)
        mem = planner.ModelMemory.from_config(cfg, name)
        avg_prompt = None
        if context is None and spec is not None:
            context, avg_prompt = _job_lengths(spec)
        context = context or mem.max_position
        budget = kv_gib if kv_gib is not None else (spec.engine.kv_cache_gib if spec and spec.engine.kv_cache_gib else 16)
        p = planner.plan(mem, dtype, int(budget * 2**30), context, batch,
                         spec.engine.max_num_seqs if spec else None, spec.engine.block_size if spec else 16, avg_prompt,
                         kv_dtype)
    except BatchgenError as e:
        _fail(e)
    typer.echo(planner.format_plan(p))


def _job_lengths(spec) -> tuple[int, int]:
    """Longest prompt + max_tokens of the job, and its mean prompt length (tokenizer only)."""
    from .io.sources import read_input
    from .job import context_length
    from .models.loader import load_config, load_tokenizer, resolve_model
    from .prepare import prepare_rows

    source = resolve_model(spec.model.path)
    prepared = prepare_rows(read_input(spec.input), spec, load_tokenizer(source), context_length(spec, load_config(source)))
    lens = [len(prepared.token_ids[i]) + prepared.sampling[i].max_tokens for i in prepared.order] or [1]
    prompts = [len(prepared.token_ids[i]) for i in prepared.order] or [1]
    return max(lens), sum(prompts) // len(prompts)


@app.command()
def schema(out_dir: Path = typer.Option(Path("schemas"), "--out", help="Folder for the JSON schema files")) -> None:
    """Regenerate schemas/job.schema.json from the job spec model."""
    from .config import job_json_schema

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "job.schema.json").write_text(json.dumps(job_json_schema(), indent=2) + "\n")
    typer.echo(f"wrote {out_dir / 'job.schema.json'}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
