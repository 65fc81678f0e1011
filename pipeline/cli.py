"""The `batchgen` command. Each command parses options, builds a validated spec and calls one
library function.

Exit codes: 0 done (or nothing left to do), 1 bad input, config or output path, 2 bad command
line, 3 another run of the job holds its lock, 74 disk full or over quota, 75 stopped by a
signal (rerun to resume), 130 Ctrl-C twice (stopped without draining; committed rows are kept).
"""
from __future__ import annotations

import enum
import json
import logging
import os
import sys
from pathlib import Path
from typing import List, NamedTuple, Optional

import typer

from .errors import BatchgenError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,
                  help="Offline bulk batch inference: Parquet prompts in, resumable Parquet results out.\n\n"
                       "Exit codes: 0 done, 1 bad input/config/output path, 2 bad command line, 3 job locked by "
                       "another run, 74 disk full, 75 interrupted by a signal (rerun to resume), 130 Ctrl-C twice.")
log = logging.getLogger("batchgen")

JOB_ARG = typer.Argument(..., help="Job spec YAML (see jobs/example.yaml and schemas/job.schema.json)",
                         metavar="JOB.yaml")
SET_OPT = typer.Option(None, "--set", help="Override a spec value: dotted.key=value (YAML value), repeatable")


class Task(NamedTuple):
    index: int
    count: int


def parse_task(value: str) -> Task:
    """--shard I/N with 0 <= I < N; a bad value is a command-line error (exit 2)."""
    try:
        i, n = (int(x) for x in str(value).split("/"))
    except ValueError:
        raise typer.BadParameter(f"{value!r}: expected I/N, e.g. 0/4") from None
    if not 0 <= i < n:
        raise typer.BadParameter(f"{value!r}: I must be in 0..N-1")
    return Task(i, n)


class Runner(str, enum.Enum):
    local = "local"
    ray = "ray"


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


def _load(job: Path, set_: list[str] | None):
    from .config import load_job

    return load_job(job, set_)


@app.command()
def run(job: Path = JOB_ARG,
        restart: bool = typer.Option(False, "--restart", help="Discard existing output of this job and start over"),
        limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Run at most N of the rows not yet done"),
        shard: Optional[Task] = typer.Option(None, "--shard", parser=parse_task, metavar="I/N",
                                             help="I/N: run task I (0-based) of N; defaults to "
                                                   "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT when set"),
        data_parallel: Optional[int] = typer.Option(None, "--data-parallel", min=1,
                                                    help="Engine processes on this node (overrides engine.data_parallel)"),
        runner: Runner = typer.Option(Runner.local, "--runner",
                                      help="local, or ray (Ray Data; needs the batchgen[ray] extra)"),
        allow_empty: bool = typer.Option(False, "--allow-empty", help="Exit 0 when the input has no rows"),
        set_: Optional[List[str]] = SET_OPT) -> None:
    """Run a job, or resume it from its ledger. Results go to output.path as Parquet parts."""
    _setup_logging()
    from .shard import parse_shard

    try:
        spec = _load(job, set_)
        dp = data_parallel or spec.engine.data_parallel
        if runner == Runner.ray:
            from .ray_runner import run_ray

            summary = run_ray(spec, restart=restart, limit=limit, num_actors=dp)
        elif dp > 1:
            from .parallel import run_data_parallel

            summary = run_data_parallel(spec, dp, restart=restart, limit=limit, allow_empty=allow_empty)
            typer.echo(f"done: {summary['rows_ok']} ok, {summary['rows_error']} errors over {dp} workers; "
                       f"{summary['rows_done']}/{summary['rows_total']} rows of the job are done")
            return
        else:
            from .job import run_job

            task = tuple(shard) if shard is not None else parse_shard(None)
            if task is not None and task[1] == 1:
                task = None
            summary = run_job(spec, restart=restart, limit=limit, shard=task, allow_empty=allow_empty)
    except BatchgenError as e:
        _fail(e)
    if summary.get("status") == "already_complete":
        typer.echo(f"job already complete: {summary['rows_total']} rows; nothing to do")
        return
    rate = f" at {summary['output_tokens_per_s']} tok/s" if summary.get("output_tokens_per_s") else ""
    typer.echo(f"done: {summary['rows_ok']} ok, {summary['rows_error']} errors, "
               f"{summary['completion_tokens']} tokens{rate}; "
               f"{summary['rows_done']}/{summary['rows_total']} rows of the job are done")


@app.command()
def merge(job: Path = JOB_ARG, set_: Optional[List[str]] = SET_OPT) -> None:
    """Compact all tasks' parts into output.path/merged/, ordered by id, after checking that every
    input id is present exactly once and every part is whole."""
    _setup_logging()
    from .job import merge_job

    try:
        res = merge_job(_load(job, set_))
    except BatchgenError as e:
        _fail(e)
    typer.echo(f"merged {res['rows']} rows ({res['ids']} ids) into {res['parts']} part(s) at {res['path']}")


@app.command()
def validate(job: Path = JOB_ARG, set_: Optional[List[str]] = SET_OPT,
             outputs: bool = typer.Option(False, "--outputs", help="Also verify the committed output: ledger "
                                          "entries and every part's size and SHA-256")) -> None:
    """Check the spec, input files, columns, prompts and model without generating."""
    _setup_logging()
    import numpy as np

    from .job import prepare_job

    try:
        spec = _load(job, set_)
        prepared = prepare_job(spec)
        lengths: list[int] = []
        errors = []
        for w in prepared.windows(np.arange(len(prepared.index), dtype=np.int64), background=False):
            lengths += [len(r.token_ids) for r in w.rows]
            errors += w.errors
        problems = []
        if outputs:
            from .job import job_status

            problems = job_status(spec, verify=True)["problems"]
    except BatchgenError as e:
        _fail(e)
    index = prepared.index
    model = prepared.model
    name = model.gguf_file.name if model.gguf_file is not None else model.folder.name
    typer.echo(f"ok: {len(index)} rows in {len(index.shards)} shard(s); model {name} ({model.identity}), "
               f"context {prepared.max_len}")
    if lengths:
        typer.echo(f"prompt tokens: min {min(lengths)}, max {max(lengths)}, total {sum(lengths)}")
    for e in sorted(errors, key=lambda e: e.pos)[:20]:
        typer.echo(f"row error: {index.where(e.pos)}: {e.message}")
    if errors:
        typer.echo(f"{len(errors)} row(s) would become error rows (the job still runs)")
    for p in problems:
        typer.echo(f"output problem: {p}")
    if problems:
        raise typer.Exit(1)


@app.command()
def status(job: Path = JOB_ARG, set_: Optional[List[str]] = SET_OPT,
           as_json: bool = typer.Option(False, "--json", help="Print JSON"),
           verify: bool = typer.Option(False, "--verify", help="Also check every part's SHA-256")) -> None:
    """Rows done/total per input shard, read from the ledgers (safe beside a running job)."""
    _setup_logging()
    from .job import job_status

    try:
        st = job_status(_load(job, set_), verify=verify)
    except BatchgenError as e:
        _fail(e)
    if as_json:
        typer.echo(json.dumps(st, indent=1))
    else:
        for s in st["shards"]:
            typer.echo(f"{s['shard']}: {s['done']}/{s['rows']}")
        typer.echo(f"total: {st['done']}/{st['rows']} rows done in {st['output']}")
        for p in st["problems"]:
            typer.echo(f"problem: {p}")
    if st["problems"]:
        raise typer.Exit(1)


@app.command()
def bench(num_prompts: int = typer.Option(256, "--num-prompts", min=1, help="ShareGPT requests in the workload"),
          output_cap: int = typer.Option(256, "--output-cap", min=1, help="Cap on each request's output tokens"),
          dtypes: str = typer.Option("float32,bfloat16", "--dtype", help="Comma-separated dtypes to run batchgen in"),
          peers: str = typer.Option("hf-cb,hf-generate", "--peers",
                                    help="Comma-separated peers: hf-cb, hf-generate; empty for none"),
          peer_num_prompts: int = typer.Option(64, "--peer-num-prompts", min=0,
                                               help="Requests the (slow) peers run; 0 for the whole workload"),
          model: str = typer.Option("default", "--model", help="Model: default, a local HF folder or a .gguf file"),
          workload: str = typer.Option("prompt-heavy", "--workload", help="prompt-heavy (chat-templated prompts), "
                                       "decode-heavy (vLLM's sampling: raw prompts) or prefill-only (max_tokens 1)"),
          max_num_seqs: int = typer.Option(256, "--max-num-seqs", min=1),
          max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens", min=1),
          json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the report as JSON here"),
          sweep: Optional[str] = typer.Option(None, "--sweep", help="NAME=v1,v2,...: measure the workload at each "
                                              "setting (max_num_seqs, max_num_batched_tokens, block_size)"),
          plot: Path = typer.Option(Path("out/sweep.png"), "--plot", help="PNG of throughput vs ITL for --sweep"),
          response_format: Optional[Path] = typer.Option(None, "--response-format", help="A YAML/JSON file holding a "
                                                        "sampling.response_format: run batchgen with it and without it "
                                                        "(on the same output tokens) and report the ratio")) -> None:
    """Throughput on a ShareGPT workload (sampled as vLLM's benchmark_throughput), side by side with
    transformers' peers, with this CPU's GEMM ceiling and the ratios. With --sweep: the
    throughput-latency curve (a table and a PNG plot) instead."""
    _setup_logging()
    from .bench import format_report, format_sweep, parse_sweep, run_bench, run_sweep
    from .workload import WORKLOADS

    if workload not in WORKLOADS:
        raise typer.BadParameter(f"{workload!r} is not one of {', '.join(WORKLOADS)}", param_hint="--workload")
    if sweep:
        try:
            name, values = parse_sweep(sweep)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--sweep") from None
        plot.parent.mkdir(parents=True, exist_ok=True)
        kw = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens}
        report = run_sweep(name, values, num_prompts, output_cap, dtypes.split(",")[0], model, kw, str(plot))
        typer.echo(format_sweep(report))
    else:
        fmt = None
        if response_format is not None:
            import yaml

            from .engine.request import ResponseFormat

            try:
                fmt = ResponseFormat.model_validate(yaml.safe_load(response_format.read_text())).model_dump(
                    mode="json", by_alias=True, exclude_none=True)
            except Exception as e:  # noqa: BLE001 - a bad file is a bad command line
                raise typer.BadParameter(f"{response_format}: {e}", param_hint="--response-format") from None
        report = run_bench(num_prompts, output_cap, [d for d in dtypes.split(",") if d],
                           [p for p in peers.split(",") if p], peer_num_prompts or None, model,
                           {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens},
                           response_format=fmt, workload=workload)
        typer.echo(format_report(report))
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=1))


@app.command()
def plan(job: Optional[Path] = typer.Argument(None, help="Job spec; its model, dtype, device, KV budget and prompt "
                                              "lengths are used, resolved as `run` resolves them",
                                              metavar="[JOB.yaml]"),
         model: Optional[str] = typer.Option(None, "--model", help="Model folder, config.json, .gguf or 'default'"),
         dtype: str = typer.Option("bfloat16", "--dtype", help="Weights dtype without a job: float32, bfloat16, "
                                   "float16"),
         kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help="KV dtype without a job (default: --dtype): "
                                                "float32, bfloat16, float16, int8, fp8"),
         context: Optional[int] = typer.Option(None, "--context", help="Tokens per sequence (prompt + output)"),
         batch: Optional[int] = typer.Option(None, "--batch", help="Sequences at once"),
         kv_gib: Optional[float] = typer.Option(None, "--kv-gib", help="KV budget in GiB without a job (default 16)"),
         set_: Optional[List[str]] = SET_OPT) -> None:
    """Memory plan from the model config alone: weights, KV per token, sequences that fit,
    suggested max_num_seqs / max_num_batched_tokens, and a warning when settings will thrash."""
    from . import plan as planner

    try:
        if job is not None:
            p = planner.plan_job(_load(job, set_))
        else:
            if model is None:
                raise typer.BadParameter("give a JOB.yaml or --model", param_hint="JOB.yaml")
            for name, value in (("--dtype", dtype), ("--kv-dtype", kv_dtype or dtype)):
                if value not in planner.DTYPE_BYTES or (name == "--dtype" and value in ("int8", "fp8")):
                    raise typer.BadParameter(f"{value!r} is not one of {', '.join(planner.DTYPE_BYTES)}",
                                             param_hint=name)
            cfg, name = planner.load_model_config(model)
            shape = planner.shape_from_config(cfg, name)
            p = planner.plan(shape, dtype, int((kv_gib if kv_gib is not None else 16) * 2**30),
                             context or shape.max_position, batch, kv_dtype=kv_dtype, name=name)
    except BatchgenError as e:
        _fail(e)
    typer.echo(planner.format_plan(p))


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
