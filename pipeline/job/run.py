"""Run a job end to end: prepare, generate, write durable parts, resume after a crash."""
from __future__ import annotations

import logging
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..config import JobSpec
from ..errors import Aborted, InputError, Interrupted
from ..io.store import OutputStore, atomic_write_json
from ..metrics import latency_summary, peak_rss_bytes
from ..shard import check_task_layout, task_root
from .fingerprint import fingerprint
from .finish import finish_outputs
from .prepare import PreparedJob, prepare_job
from .progress import Progress
from .signals import StopFlag
from .sink import ResultSink, RunStats, TokenText, output_schema

log = logging.getLogger("batchgen")

# Bytes of output per generated token and per row, for the free-space check before loading.
_BYTES_PER_TOKEN, _BYTES_PER_ROW = 8, 256


def run_job(spec: JobSpec, restart: bool = False, limit: int | None = None, shard: tuple[int, int] | None = None,
            progress: bool = True, allow_empty: bool = False) -> dict:
    """Run (or resume) a job, or one shard of it. Returns the summary; raises BatchgenError
    subclasses on failure, Interrupted (exit 75) when a signal stopped it before the end."""
    with StopFlag() as stop:
        return _run_job(spec, restart, limit, shard, progress, allow_empty, stop)


def todo_positions(job: PreparedJob, done: pa.Array, limit: int | None) -> np.ndarray:
    """Index positions of the rows not yet done (an anti-join of the ids against the ledger's)."""
    index = job.index
    if len(done):
        mask = pc.is_in(index.ids, value_set=done)
        keep = np.flatnonzero(~mask.to_numpy(zero_copy_only=False))
    else:
        keep = np.arange(len(index), dtype=np.int64)
    return keep[:limit] if limit is not None else keep


def _run_job(spec: JobSpec, restart: bool, limit: int | None, shard: tuple[int, int] | None, progress: bool,
             allow_empty: bool, stop: StopFlag) -> dict:
    t0 = time.monotonic()
    job = prepare_job(spec, shard, check=stop.check_before_generation)
    if len(job.index) == 0 and not allow_empty:
        raise InputError(f"input: no rows to run ({', '.join(s.path for s in job.source.shards) or 'no files'}"
                         f"{' in this task' if shard else ''}); pass --allow-empty to accept an empty input")
    store = OutputStore(task_root(spec.output.path, shard))
    check_task_layout(spec.output.path, shard, restart)
    try:
        store.acquire_lock()
        fp = fingerprint(spec, job.index, job.model.identity, job.max_len, shard)
        done = store.open(fp, restart, job.index.ids.type)
        stop.check_before_generation()
        keep = todo_positions(job, done, limit)
        if len(keep) == 0:
            log.info("nothing to do: all %d rows of %s are already done", len(job.index), store.root)
            finish_outputs(store, spec, job.index, spec.model.path)
            return {"status": "already_complete", "rows_total": len(job.index), "rows_done": len(done)}
        sp = spec.sampling
        store.check_free_space(spec.output.rows_per_part * sp.n * (sp.max_tokens * _BYTES_PER_TOKEN + _BYTES_PER_ROW))
        log.info("%d rows to run (%d already done, %d in input)", len(keep), len(done), len(job.index))
        stats = RunStats()
        schema = output_schema(spec, job.index.id_type, job.source.passthrough_types)
        sink = ResultSink(store, spec, schema, job.index, stats)
        try:
            summary = _generate(job, keep, sink, stats, t0, progress, stop)
        except Aborted:
            sink.flush()  # Ctrl-C twice skips the drain, not the rows already finished (a flush is quick)
            raise
        sink.flush()
        stop.check_forced()
        rows_done = len(done) + sink.rows_done
        complete = rows_done == len(job.index)
        if complete:
            finish_outputs(store, spec, job.index, spec.model.path)
        summary.update(rows_total=len(job.index), rows_done=rows_done, complete=complete)
        # A signal that came after the last row (during flushing or compaction) stopped nothing.
        summary["interrupted"] = stop.signal if stop and not complete else None
        if shard is not None:
            summary["shard"] = f"{shard[0]}/{shard[1]}"
        atomic_write_json(store.root / "summary.json", summary)
        if summary["interrupted"]:
            raise Interrupted(f"stopped by signal {summary['interrupted']} after committing finished rows; "
                              "rerun the same command to resume")
        return summary
    finally:
        store.release_lock()


def load_engine(job: PreparedJob, check=None):
    """The engine with the job's model; check() runs after each layer's weights load (a pending
    signal stops the run there)."""
    from ..llm import Engine
    from ..models.loader import load_checkpoint
    from .fingerprint import resolved_dtype

    t = time.monotonic()
    engine = Engine(load_checkpoint(job.model, resolved_dtype(job.spec)), job.tokenizer, job.spec.engine,
                    job.spec.model, model_identity=job.model.identity, grammars=job.grammars,
                    on_layer=(lambda i: check()) if check else None)
    log.info("model loaded in %.1fs", time.monotonic() - t)
    return engine


def generate_rows(engine, windows, sink: ResultSink, stop: StopFlag | None = None, grace_s: float = 0.0,
                  on_step=None) -> None:
    """Every row of the prepared windows through the engine into the sink (error rows straight
    in). With a stop flag: a signal stops admission (running rows get grace_s), Ctrl-C twice
    stops at the next step."""
    from ..llm import GenerationRequest

    inflight: dict[str, object] = {}

    def requests():
        for w in windows:
            if stop is not None:
                stop.check_forced()
            for e in w.errors:
                sink.add_error(e)
            for r in w.rows:
                key = str(r.pos)
                inflight[key] = r
                yield GenerationRequest(key, r.token_ids, r.sampling)

    should_stop = (lambda: bool(stop)) if stop is not None else None
    token_text = TokenText(engine.tokenizer)
    for res in engine.generate(requests(), should_stop=should_stop, grace_s=grace_s, on_step=on_step):
        row = inflight[res.request_id]
        sink.add(row, res.sample_index, res.text, res.finish_reason, res.error, res.prompt_tokens,
                 res.completion_tokens, res.ttft_s, res.itl_s, res.cached_tokens,
                 token_text.records(res.token_ids, res.logprobs),
                 token_text.records(list(row.token_ids[1:]), res.prompt_logprobs))
        if row.pos not in sink.partial:
            del inflight[res.request_id]


def _generate(job: PreparedJob, keep: np.ndarray, sink: ResultSink, stats: RunStats, t0: float, show_progress: bool,
              stop: StopFlag) -> dict:
    # Reading and tokenizing start now, in the background, while the weights load.
    windows = job.windows(keep, should_stop=lambda: bool(stop))
    try:
        engine = load_engine(job, stop.check_before_generation)
        stop.check_before_generation()
        progress = Progress(len(keep), enabled=show_progress)

        def on_step(eng) -> None:
            stop.check_forced()
            progress.update(sink.rows_done, eng.stats())
            sink.maybe_flush()

        gen_start = time.monotonic()
        generate_rows(engine, windows, sink, stop, job.spec.engine.grace_s, on_step)
        progress.close(sink.rows_done, engine.stats())
    finally:
        windows.close()
    wall = time.monotonic() - gen_start
    return {
        "rows_ok": stats.rows_ok, "rows_error": stats.rows_error, "rows_truncated": stats.rows_truncated,
        "prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
        "cached_prompt_tokens": stats.cached_tokens,
        "generate_wall_s": round(wall, 3), "total_wall_s": round(time.monotonic() - t0, 3),
        "output_tokens_per_s": round(stats.completion_tokens / wall, 2) if wall > 0 else None,
        "total_tokens_per_s": round((stats.completion_tokens + stats.prompt_tokens) / wall, 2) if wall > 0 else None,
        "ttft_s": latency_summary(stats.ttft), "itl_s": latency_summary(stats.itl),
        "peak_rss_bytes": peak_rss_bytes(),
        "engine": engine.counters(),
    }
