"""Run a job end to end: read, prepare, generate, write durable parts, resume after a crash."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from .config import JobSpec
from .errors import BatchgenError, Interrupted
from .io.sources import InputRows, read_input
from .io.store import OutputStore, atomic_write_json
from .metrics import latency_summary, peak_rss_bytes

log = logging.getLogger("batchgen")


def fingerprint(spec: JobSpec, rows: InputRows, model_identity: str) -> dict:
    """What decides the output: a resume under a different fingerprint would mix two jobs."""
    inputs = hashlib.sha256("\n".join(f"{s.path}:{s.num_rows}" for s in rows.shards).encode())
    inputs.update("\n".join(rows.ids).encode())
    return {
        "model": model_identity,
        "dtype": spec.model.dtype,
        "kv_cache_dtype": spec.engine.kv_cache_dtype,
        "sampling": spec.sampling.model_dump(mode="json"),
        "template": {k: v for k, v in spec.input.model_dump(mode="json").items() if k not in ("path", "dataset")},
        "on_too_long": spec.on_too_long,
        "inputs": inputs.hexdigest()[:32],
    }


def engine_config(spec: JobSpec):
    from .llm import EngineConfig

    e = spec.engine
    return EngineConfig(block_size=e.block_size, max_num_seqs=e.max_num_seqs,
                        max_num_batched_tokens=e.max_num_batched_tokens, kv_cache_gib=e.kv_cache_gib,
                        kv_cache_fraction=e.kv_cache_fraction, max_model_len=e.max_model_len,
                        prefix_caching=e.prefix_caching, cpu_offload_gib=e.cpu_offload_gib, preemption=e.preemption,
                        dtype=spec.model.dtype, kv_cache_dtype=e.kv_cache_dtype, device=spec.model.device,
                        linear_path=e.linear_path, decode_attention=e.decode_attention,
                        attention_backend=e.attention_backend, cuda_graphs=e.cuda_graphs, seed=e.seed,
                        profile=e.profile)


def context_length(spec: JobSpec, model_config) -> int:
    n = model_config.max_position_embeddings
    if spec.engine.max_model_len:
        n = min(n, spec.engine.max_model_len)
    return n


@dataclass
class RunStats:
    rows_ok: int = 0
    rows_error: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)


class ResultSink:
    """Buffers finished rows (all n samples of an id together) and commits them as parts."""

    def __init__(self, store: OutputStore, spec: JobSpec, rows: InputRows, stats: RunStats,
                 rows_per_part: int | None = None) -> None:
        self.store, self.spec, self.rows, self.stats = store, spec, rows, stats
        self.rows_per_part = rows_per_part or spec.output.rows_per_part
        self.n = spec.sampling.n
        self.index = {rid: i for i, rid in enumerate(rows.ids)}
        self.schema = output_schema(spec, rows)
        self.buffer: list[dict] = []
        self.buffer_ids: list[str] = []
        self.partial: dict[str, list[dict]] = {}
        self.last_flush = time.monotonic()
        self.rows_done = 0

    def add(self, row_id: str, sample_index: int, text: str | None, finish_reason: str, error: str | None,
            prompt_tokens: int, completion_tokens: int, ttft: float | None, itl: float | None) -> None:
        i = self.index[row_id]
        rec = {"id": row_id, "sample_index": sample_index, "text": text, "finish_reason": finish_reason,
               "error": error, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
               "ttft_s": ttft, "itl_s": itl}
        for col, (_, values) in self.rows.passthrough.items():
            rec[col] = values[i]
        s = self.stats
        if error is None:
            s.completion_tokens += completion_tokens
            if ttft is not None:
                s.ttft.append(ttft)
            if itl is not None:
                s.itl.append(itl)
        s.prompt_tokens += prompt_tokens
        samples = self.partial.setdefault(row_id, [])
        samples.append(rec)
        if len(samples) < self.n:
            return
        del self.partial[row_id]
        if all(r["error"] is None for r in samples):
            s.rows_ok += 1
        else:
            s.rows_error += 1
        samples.sort(key=lambda r: r["sample_index"])
        self.buffer.extend(samples)
        self.buffer_ids.append(row_id)
        self.rows_done += 1
        if len(self.buffer) >= self.rows_per_part:
            self.flush()

    def add_error(self, row_id: str, message: str, prompt_tokens: int = 0) -> None:
        for k in range(self.n):
            self.add(row_id, k, None, "error", message, prompt_tokens, 0, None, None)

    def maybe_flush(self) -> None:
        if self.buffer and time.monotonic() - self.last_flush >= self.spec.output.flush_interval_s:
            self.flush()

    def flush(self) -> None:
        self.last_flush = time.monotonic()
        if not self.buffer:
            return
        cols = {f.name: [r[f.name] for r in self.buffer] for f in self.schema}
        table = pa.table(cols, schema=self.schema)
        self.store.commit(table, self.buffer_ids)
        self.buffer, self.buffer_ids = [], []


def output_schema(spec: JobSpec, rows: InputRows) -> pa.Schema:
    fields = [pa.field("id", pa.string(), nullable=False)]
    if spec.sampling.n > 1:
        fields.append(pa.field("sample_index", pa.int32(), nullable=False))
    fields += [pa.field(c, t) for c, (t, _) in rows.passthrough.items()]
    fields += [pa.field("text", pa.string()), pa.field("finish_reason", pa.string(), nullable=False),
               pa.field("error", pa.string()), pa.field("prompt_tokens", pa.int32(), nullable=False),
               pa.field("completion_tokens", pa.int32(), nullable=False), pa.field("ttft_s", pa.float64()),
               pa.field("itl_s", pa.float64())]
    return pa.schema(fields)


def _stopped_early(signum: int) -> Interrupted:
    return Interrupted(f"stopped by signal {signum} before any row was generated; rerun to start")


class StopFlag:
    """SIGTERM, SIGINT and SIGUSR1 (Slurm's warning) ask the job to stop.

    Before any row has been generated there is nothing to save, so the signal stops the run at
    once (Interrupted, exit 75). Once `defer` is set (generation, flushing, compaction) it only
    raises the flag: admission stops, running rows get the grace period, finished rows are
    committed and the outputs are left whole. A second SIGINT (Ctrl-C twice) skips the drain:
    rows committed so far are kept."""

    def __init__(self, defer: bool = False) -> None:
        self.signal: int | None = None
        self.defer = defer
        self._old = {}

    def __enter__(self) -> "StopFlag":
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside a test runner thread)
                pass
        return self

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signum
        if not self.defer:
            raise _stopped_early(signum)
        # No logging here: a handler that writes to stderr while the interrupted code is writing
        # to it raises "reentrant call". The engine logs the drain when it sees the flag.

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def __bool__(self) -> bool:
        return self.signal is not None


class Progress:
    """A tqdm bar on a TTY; periodic plain log lines otherwise (cron, Slurm)."""

    def __init__(self, total: int, interval_s: float = 30.0, enabled: bool = True) -> None:
        self.total = total
        self.enabled = enabled
        self.tty = sys.stderr.isatty() and enabled
        self.interval = interval_s
        self.start = time.monotonic()
        self.last = self.start
        self._last_tokens = (0, 0)
        self.bar = None
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="row", dynamic_ncols=True)

    def update(self, done: int, out_tokens: int, engine=None) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        rate = out_tokens / max(now - self.start, 1e-9)
        if self.bar is not None:
            self.bar.n = done
            self.bar.set_postfix_str(f"{rate:.0f} tok/s" + (f" kv {engine.kv_manager.usage():.0%}" if engine else ""),
                                     refresh=False)
            self.bar.refresh()
            return
        if now - self.last >= self.interval or done == self.total:
            eta = (now - self.start) / done * (self.total - done) if done else float("nan")
            extra = ""
            if engine is not None:
                sch = engine.scheduler
                st = sch.stats
                dt = max(now - self.last, 1e-9)
                pre_rate = (st.prefill_tokens - self._last_tokens[0]) / dt
                dec_rate = (st.decode_tokens - self._last_tokens[1]) / dt
                self._last_tokens = (st.prefill_tokens, st.decode_tokens)
                extra = (f", running {len(sch.running)}, waiting {len(sch.waiting)}, finished {done}, "
                         f"kv {engine.kv_manager.usage():.0%}, prefix hits {engine.kv_manager.prefix_hit_rate():.0%}, "
                         f"prefill {pre_rate:.0f} tok/s, decode {dec_rate:.0f} tok/s, preemptions {st.num_preemptions} "
                         f"(swap {st.num_swap_preemptions}, recompute {st.num_recompute_preemptions})")
                tiers = engine.kv_manager
                if tiers.cpu_pool is not None:
                    t = tiers.tier
                    extra += (f", cpu tier {tiers.cpu_pool.num_used_blocks}/{tiers.cpu_pool.num_blocks} blocks, "
                              f"swapped out/in {t.swapped_out_blocks}/{t.swapped_in_blocks} blocks, "
                              f"spilled/reloaded {t.spilled_blocks}/{t.reloaded_blocks}")
            log.info("progress: %d/%d rows, %.1f output tok/s, ETA %.0fs%s", done, self.total, rate, eta, extra)
            self.last = now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_job(spec: JobSpec, restart: bool = False, limit: int | None = None, shard: tuple[int, int] | None = None,
            progress: bool = True) -> dict:
    """Run (or resume) a job, or one shard of it. Returns the summary; raises BatchgenError
    subclasses on failure, Interrupted (exit 75) when a signal stopped it before the end."""
    with StopFlag() as stop:
        return _run_job(spec, restart, limit, shard, progress, stop)


def _run_job(spec: JobSpec, restart: bool, limit: int | None, shard: tuple[int, int] | None, progress: bool,
             stop: StopFlag) -> dict:
    from .models.loader import load_config, load_tokenizer, resolve_model
    from .shard import select_shard, task_root

    t0 = time.monotonic()
    rows = select_shard(read_input(spec.input), shard)
    source = resolve_model(spec.model.path)
    out_dir = task_root(spec.output.path, shard)
    store = OutputStore(out_dir)
    try:
        store.acquire_lock()
        fp = fingerprint(spec, rows, source.identity)
        if shard is not None:
            fp["shard"] = f"{shard[0]}/{shard[1]}"
        stop.defer = True  # store.open may clear or repair the output: let it finish
        done = store.open(fp, restart)
        stop.defer = False
        if stop:
            raise _stopped_early(stop.signal)
        todo = [i for i, rid in enumerate(rows.ids) if rid not in done]
        if not todo:
            log.info("nothing to do: all %d rows of %s are already done", len(rows), spec.output.path)
            stop.defer = True
            _finish_outputs(store, spec, rows, True, spec.model.path)
            return {"status": "already_complete", "rows_total": len(rows), "rows_done": len(done)}
        if limit is not None:
            todo = todo[:limit]
        skip = set(rows.ids) - {rows.ids[i] for i in todo}
        log.info("%d rows to run (%d already done, %d in input)", len(todo), len(done), len(rows))
        tokenizer = load_tokenizer(source)
        max_len = context_length(spec, load_config(source))
        from .prepare import prepare_rows

        prepared = prepare_rows(rows, spec, tokenizer, max_len, skip=skip)
        stats = RunStats()
        sink = ResultSink(store, spec, rows, stats)
        for i, msg in sorted(prepared.errors.items()):
            sink.add_error(rows.ids[i], msg)
        summary = _generate(spec, source, rows, prepared, sink, stats, t0, tokenizer, progress, stop)
        stop.defer = True
        sink.flush()
        complete = len(done) + sink.rows_done == len(rows)
        _finish_outputs(store, spec, rows, complete, spec.model.path)
        summary.update(rows_total=len(rows), rows_done=len(done) + sink.rows_done, complete=complete)
        # A signal that came after the last row (during flushing or compaction) stopped nothing.
        summary["interrupted"] = stop.signal if stop and not complete else None
        if shard is not None:
            summary["shard"] = f"{shard[0]}/{shard[1]}"
        atomic_write_json(out_dir / "summary.json", summary)
        if summary["interrupted"]:
            raise Interrupted(f"stopped by signal {summary['interrupted']} after committing finished rows; "
                              "rerun the same command to resume")
        return summary
    finally:
        store.release_lock()


def _finish_outputs(store: OutputStore, spec: JobSpec, rows: InputRows, complete: bool, model_name: str) -> None:
    """Once every row is done: input-order compaction, then the OpenAI-style JSONL files."""
    _compact_if_needed(store, spec, rows, complete)
    want_jsonl = spec.output.openai_jsonl if spec.output.openai_jsonl is not None else spec.input.format == "openai_batch"
    if complete and want_jsonl:
        from .io.openai_batch import write_openai_results

        n_ok, n_err = write_openai_results(store.part_files(), store.root, model_name)
        log.info("wrote results.jsonl (%d) and errors.jsonl (%d)", n_ok, n_err)


def _compact_if_needed(store: OutputStore, spec: JobSpec, rows: InputRows, complete: bool) -> None:
    if spec.output.order == "input" and complete:
        index = {rid: i for i, rid in enumerate(rows.ids)}

        def input_order(table: pa.Table) -> list[int]:
            pos = [index[rid] for rid in table.column("id").to_pylist()]
            sample = table.column("sample_index").to_pylist() if spec.sampling.n > 1 else [0] * len(pos)
            return sorted(range(len(pos)), key=lambda i: (pos[i], sample[i]))

        store.compact(input_order, spec.output.rows_per_part)


def _generate(spec, source, rows, prepared, sink: ResultSink, stats: RunStats, t0: float, tokenizer,
              show_progress: bool, stop: StopFlag) -> dict:
    from .llm import Engine, GenerationRequest
    from .models.loader import load_hf_model

    summary: dict = {}
    engine = None
    gen_start = time.monotonic()
    if prepared.order:
        t_load = time.monotonic()
        cfg = engine_config(spec)
        cfg.max_seq_tokens = max(len(prepared.token_ids[i]) + prepared.sampling[i].max_tokens for i in prepared.order)
        engine = Engine(load_hf_model(source), tokenizer, cfg, model_identity=source.identity)
        log.info("model loaded in %.1fs", time.monotonic() - t_load)
        requests = (GenerationRequest(rows.ids[i], list(prepared.token_ids[i]), prepared.sampling[i])
                    for i in prepared.order)
        progress = Progress(len(prepared.order) + len(prepared.errors), enabled=show_progress)
        gen_start = time.monotonic()
        stop.defer = True  # from here on, finished rows are worth committing before exit
        for res in engine.generate(requests, should_stop=lambda: bool(stop), grace_s=spec.engine.grace_s):
            sink.add(res.request_id, res.sample_index, res.text, res.finish_reason, res.error,
                     res.prompt_tokens, res.completion_tokens, res.ttft_s, res.itl_s)
            stats.cached_tokens += res.cached_tokens
            progress.update(sink.rows_done, stats.completion_tokens, engine)
            sink.maybe_flush()
        progress.close()
    wall = time.monotonic() - gen_start
    summary.update({
        "rows_ok": stats.rows_ok, "rows_error": stats.rows_error, "rows_truncated": prepared.num_truncated,
        "prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
        "cached_prompt_tokens": stats.cached_tokens,
        "generate_wall_s": round(wall, 3), "total_wall_s": round(time.monotonic() - t0, 3),
        "output_tokens_per_s": round(stats.completion_tokens / wall, 2) if wall > 0 else None,
        "total_tokens_per_s": round((stats.completion_tokens + stats.prompt_tokens) / wall, 2) if wall > 0 else None,
        "ttft_s": latency_summary(stats.ttft), "itl_s": latency_summary(stats.itl),
        "peak_rss_bytes": peak_rss_bytes(),
        "engine": engine.counters() if engine else None,
    })
    return summary


def done_ids(output_path: str) -> set[str]:
    """Ids committed by the unsharded run and every task, from their ledgers."""
    from .shard import all_roots

    done: set[str] = set()
    for root in all_roots(output_path):
        for e in OutputStore(root).entries().values():
            done.update(e["ids"])
    return done


def job_status(spec: JobSpec) -> dict:
    """Rows done/total per input shard, over all tasks, from the ledgers (no model, no lock)."""
    from .shard import all_roots

    rows = read_input(spec.input)
    done = done_ids(spec.output.path)
    per_shard = []
    for si, shard in enumerate(rows.shards):
        ids = [rid for rid, s in zip(rows.ids, rows.shard_of) if s == si]
        per_shard.append({"shard": shard.name, "path": shard.path, "rows": len(ids),
                          "done": sum(1 for rid in ids if rid in done)})
    summary_path = Path(spec.output.path) / "summary.json"
    tasks = [str(r) for r in all_roots(spec.output.path) if r != Path(spec.output.path)]
    return {"output": spec.output.path, "rows": len(rows), "done": sum(s["done"] for s in per_shard),
            "shards": per_shard, "tasks": tasks,
            "last_summary": json.loads(summary_path.read_text()) if summary_path.exists() else None}


def merge_job(spec: JobSpec) -> dict:
    """Compact every task's parts into output.path/merged/, ordered by id, after checking that
    every input id is present exactly once (n times with sampling.n > 1)."""
    import shutil

    import pyarrow.parquet as pq

    from .io.store import atomic_write, fsync_dir
    from .shard import all_roots

    rows = read_input(spec.input)
    files = [f for root in all_roots(spec.output.path) for f in OutputStore(root).part_files()]
    if not files:
        raise BatchgenError(f"{spec.output.path}: no committed parts to merge; run the job first")
    table = pa.concat_tables([pq.read_table(f) for f in files], promote_options="default")
    counts: dict[str, int] = {}
    for rid in table.column("id").to_pylist():
        counts[rid] = counts.get(rid, 0) + 1
    n = spec.sampling.n
    missing = [rid for rid in rows.ids if rid not in counts]
    dupes = [rid for rid, c in counts.items() if c != n]
    extra = sorted(set(counts) - set(rows.ids))
    if missing or dupes or extra:
        raise BatchgenError(f"{spec.output.path}: cannot merge: {len(missing)} ids missing (e.g. {missing[:3]}), "
                            f"{len(dupes)} ids not present exactly {n}x (e.g. {dupes[:3]}), "
                            f"{len(extra)} ids not in the input (e.g. {extra[:3]}); run the remaining tasks first")
    keys = ["id"] + (["sample_index"] if n > 1 else [])
    table = table.sort_by([(k, "ascending") for k in keys])
    out = Path(spec.output.path) / "merged"
    tmp = out.with_name(f".merged.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    per = spec.output.rows_per_part
    for k, start in enumerate(range(0, table.num_rows, per)):
        chunk = table.slice(start, per)
        atomic_write(tmp / f"part-{k:06d}.parquet", lambda f, c=chunk: pq.write_table(c, f))
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    fsync_dir(out.parent)
    return {"rows": table.num_rows, "ids": len(counts), "parts": -(-table.num_rows // per), "path": str(out)}
