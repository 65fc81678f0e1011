"""`batchgen run --runner ray`: the same job spec on a Ray cluster through Ray Data.

read_parquet -> drop ids already committed -> map_batches with one engine actor per device
(each actor tokenizes its batch and runs our Engine) -> write_parquet. Ray writes each chunk
into an attempt folder; its files move into output.path/ray/ only after the write finished, so
a file in ray/ means its ids are done (the ledger idea), and a rerun skips them. The output
schema is the local runner's.

On a cluster, set RAY_ADDRESS (or start the driver on a Ray node); each actor asks for one GPU
when model.device is cuda (or auto with GPUs in the cluster), and the input path must be
readable from every node (shared filesystem or object store).
"""
from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .config import JobSpec
from .errors import BatchgenError, ConfigError

log = logging.getLogger("batchgen")


class EngineActor:
    """One engine per actor (per device): a batch of input rows in, output rows out."""

    def __init__(self, spec_data: dict) -> None:
        from .job import engine_config
        from .llm import Engine
        from .models.loader import load_config, load_hf_model, load_tokenizer, resolve_model

        self.spec = JobSpec.model_validate(spec_data)
        source = resolve_model(self.spec.model.path)
        self.tokenizer = load_tokenizer(source)
        from .job import context_length

        self.max_len = context_length(self.spec, load_config(source))
        self.engine = Engine(load_hf_model(source), self.tokenizer, engine_config(self.spec),
                             model_identity=source.identity)

    def __call__(self, batch: pa.Table) -> pa.Table:
        from .io.sources import Shard, _collect
        from .job import ResultSink, RunStats, output_schema
        from .llm import GenerationRequest
        from .prepare import prepare_rows

        spec = self.spec
        rows = _collect([(Shard("ray", "ray", batch.num_rows), batch)], spec.input)
        prepared = prepare_rows(rows, spec, self.tokenizer, self.max_len)
        collected: list[pa.Table] = []

        class _Collect:  # a store that keeps committed tables in memory for Ray to write
            def commit(self, table, ids):
                collected.append(table)

        # One table per batch: Ray writes it; no flushing in between.
        sink = ResultSink(_Collect(), spec, rows, RunStats(), rows_per_part=1 << 62)
        for i, msg in sorted(prepared.errors.items()):
            sink.add_error(rows.ids[i], msg)
        reqs = (GenerationRequest(rows.ids[i], list(prepared.token_ids[i]), prepared.sampling[i]) for i in prepared.order)
        for r in self.engine.generate(reqs):
            sink.add(r.request_id, r.sample_index, r.text, r.finish_reason, r.error, r.prompt_tokens,
                     r.completion_tokens, r.ttft_s, r.itl_s)
        sink.flush()
        return pa.concat_tables(collected) if collected else output_schema(spec, rows).empty_table()


def _done_ids(out: Path, id_column: str = "id") -> set[str]:
    ids: set[str] = set()
    for f in sorted(out.glob("*.parquet")):
        ids.update(pq.read_table(f, columns=[id_column]).column(id_column).to_pylist())
    return ids


def run_ray(spec: JobSpec, restart: bool = False, limit: int | None = None, num_actors: int = 1,
            chunk_rows: int = 4096, num_cpus: int | None = None) -> dict:
    try:
        import ray
        import ray.data
    except ImportError:
        raise ConfigError("--runner ray needs Ray: pip install 'batchgen[ray]'") from None
    from .io.sources import _needed_columns, scan_parquet

    if spec.input.format != "parquet" or spec.input.dataset is not None:
        raise ConfigError("--runner ray reads Parquet input (input.path); datasets and JSONL run locally")
    if not spec.input.id_column:
        raise ConfigError("--runner ray needs input.id_column: rows are split across actors, so ids cannot come "
                          "from shard + row index")
    files = [s.path for s, _ in scan_parquet(spec.input)]  # checks files and columns before any actor starts
    out = Path(spec.output.path) / "ray"
    if restart:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("_attempt-*"):
        shutil.rmtree(stale, ignore_errors=True)  # a killed run's unfinished write: not committed
    done = _done_ids(out)
    if not ray.is_initialized():
        ray.init(num_cpus=num_cpus, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    idc = spec.input.id_column
    ds = ray.data.read_parquet(files).select_columns(_needed_columns(spec.input))
    all_ids = [str(x) for f in files for x in pq.read_table(f, columns=[idc]).column(idc).to_pylist()]
    todo = [i for i in all_ids if i not in done]
    if limit is not None:
        todo = todo[:limit]
    if not todo:
        log.info("nothing to do: all %d rows of %s are already done", len(all_ids), out)
        return {"status": "already_complete", "rows_total": len(all_ids), "rows_done": len(done)}
    gpus = 1 if spec.model.device == "cuda" or (spec.model.device == "auto" and ray.cluster_resources().get("GPU")) else 0
    t0 = time.monotonic()
    written = 0
    for start in range(0, len(todo), chunk_rows):
        chunk = pa.array(todo[start : start + chunk_rows])
        part = ds.map_batches(lambda b, c=chunk: b.filter(pc.is_in(pc.cast(b.column(idc), pa.string()), value_set=c)),
                              batch_format="pyarrow")
        part = part.map_batches(EngineActor, fn_constructor_kwargs={"spec_data": spec.model_dump(mode="json")},
                                batch_format="pyarrow", batch_size=max(64, spec.engine.max_num_seqs),
                                concurrency=num_actors, num_gpus=gpus)
        attempt = out / f"_attempt-{uuid.uuid4().hex[:8]}"
        part.write_parquet(str(attempt))
        for f in sorted(attempt.glob("*.parquet")):
            os.replace(f, out / f"{attempt.name[9:]}-{f.name}")
            written += 1
        shutil.rmtree(attempt, ignore_errors=True)
    done = _done_ids(out)
    table = pa.concat_tables([pq.read_table(f) for f in sorted(out.glob("*.parquet"))], promote_options="default")
    ok = table.column("error").null_count
    summary = {"runner": "ray", "rows_total": len(all_ids), "rows_done": len(done), "rows_ok": ok,
               "rows_error": table.num_rows - ok,
               "completion_tokens": int(pc.sum(table.column("completion_tokens")).as_py() or 0),
               "wall_s": round(time.monotonic() - t0, 2), "files_written": written}
    if len(done) < len(all_ids) and limit is None:
        raise BatchgenError(f"ray run finished with {len(all_ids) - len(done)} ids missing; rerun to resume")
    return summary
