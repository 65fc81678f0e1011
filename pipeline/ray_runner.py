"""`batchgen run --runner ray`: the same job spec on a Ray cluster through Ray Data.

read_parquet (each input block read once) -> rows already done dropped by a semi-join against
the rows to do -> map_batches with one engine actor per device (each actor tokenizes its batch
and runs our Engine) -> the driver consumes the results as they stream out and commits them
through the same OutputStore (parts + ledger) as the local runner. So a killed run resumes from
its ledger, and `batchgen status` and `merge` read a Ray run's output like any other.

On a cluster, set RAY_ADDRESS (or start the driver on a Ray node); each actor asks for one GPU
when model.device is cuda (or auto with GPUs in the cluster), and the input path must be
readable from every node (shared filesystem or object store). The driver holds the job's lock
and writes the output.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import pyarrow as pa

from .config import JobSpec
from .errors import BatchgenError, ConfigError

log = logging.getLogger("batchgen")


class EngineActor:
    """One engine per actor (per device): a batch of input rows (with _pos, _shard) in, output
    rows (with _pos) out."""

    def __init__(self, spec_data: dict) -> None:
        from .syspath import drop_checkouts

        drop_checkouts()  # a Ray worker has the driver's working directory on its path
        from .job.prepare import prepare_job
        from .job.run import load_engine

        self.spec = JobSpec.model_validate(spec_data)
        self.job = prepare_job(self.spec, index=False)
        self.engine = load_engine(self.job)

    def __call__(self, batch: pa.Table) -> pa.Table:
        from .io.sortmerge import group_starts
        from .io.sources import window_from_table
        from .job.run import generate_rows

        spec = self.spec
        win = window_from_table(spec.input, batch.drop_columns(["_pos", "_shard"]),
                                batch.column("_pos").to_numpy(), batch.column("_shard").to_numpy())
        prepared = self.job.preparer.prepare(win)
        tables, positions = [], []

        class _Collect:  # a store that keeps committed tables in memory for the driver to commit
            def commit(self, table, ids, pos, shards):
                tables.append(table)
                counts = np.diff(np.append(group_starts(table.column("id")), table.num_rows))
                positions.append(np.repeat(np.asarray(pos, dtype=np.int64), counts))

        from .job.sink import ResultSink, RunStats

        sink = ResultSink(_Collect(), spec, self.schema(batch), None, RunStats(), rows_per_part=1 << 62)
        generate_rows(self.engine, [prepared], sink)
        sink.flush()
        if not tables:
            return self.schema(batch).empty_table().append_column("_pos", pa.array([], type=pa.int64()))
        return pa.concat_tables(tables).append_column("_pos", pa.array(np.concatenate(positions)))

    def schema(self, batch: pa.Table) -> pa.Schema:
        from .job.sink import output_schema

        idc = self.spec.input.id_column
        id_type = pa.int64() if pa.types.is_integer(batch.schema.field(idc).type) else pa.string()
        return output_schema(self.spec, id_type, {c: batch.schema.field(c).type
                                                  for c in self.spec.input.passthrough_columns})


def _check_input(spec: JobSpec) -> None:
    if spec.input.format != "parquet" or spec.input.dataset is not None:
        raise ConfigError("--runner ray reads Parquet input (input.path); datasets and JSONL run locally")
    if not spec.input.id_column:
        raise ConfigError("--runner ray needs input.id_column: rows are split across actors, so ids cannot come "
                          "from shard + row index")


def _dataset(ray, spec: JobSpec, index, keep: np.ndarray, num_actors: int):
    """read_parquet -> drop rows not to do (attaching _pos, _shard) -> engine actors."""
    import polars as pl

    from .io.sources import needed_columns

    idc = spec.input.id_column
    todo_ref = ray.put(pl.DataFrame({idc: index.ids.take(pa.array(keep)), "_pos": keep,
                                     "_shard": index.shard_of[keep].astype(np.int64)}))

    def drop_done(batch: pa.Table) -> pa.Table:
        import polars as pl

        todo = ray.get(todo_ref)
        b = pl.from_arrow(batch).with_columns(pl.col(idc).cast(todo.schema[idc]))
        # Hashed on the batch, probing the to-do table: cheap whatever the input's size.
        rows = todo.join(b.select(idc), on=idc, how="semi")
        return b.join(rows, on=idc, how="inner").to_arrow()

    gpus = 1 if spec.model.device == "cuda" or (spec.model.device == "auto" and ray.cluster_resources().get("GPU")) \
        else 0
    ds = ray.data.read_parquet([s.path for s in index.shards]).select_columns(needed_columns(spec.input))
    ds = ds.map_batches(drop_done, batch_format="pyarrow")
    return ds.map_batches(EngineActor, fn_constructor_kwargs={"spec_data": spec.model_dump(mode="json")},
                          batch_format="pyarrow", batch_size=max(64, spec.engine.max_num_seqs),
                          concurrency=num_actors, num_gpus=gpus)


def _commit_stream(ds, store, index) -> tuple[int, int, int]:
    """Commit the actors' output tables as parts as they arrive: (rows, rows with errors, tokens)."""
    from .io.sortmerge import group_starts

    rows = errors = tokens = 0
    for out in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
        if not out.num_rows:
            continue
        firsts = pa.array(group_starts(out.column("_pos")))
        pos = out.column("_pos").take(firsts).to_pylist()
        table = out.drop_columns(["_pos"])
        store.commit(table, table.column("id").take(firsts).to_pylist(), pos, index.shard_counts(pos))
        rows += len(pos)
        errors += len(set(table.filter(table.column("error").is_valid()).column("id").to_pylist()))
        tokens += sum(table.column("completion_tokens").to_pylist())
    return rows, errors, tokens


def run_ray(spec: JobSpec, restart: bool = False, limit: int | None = None, num_actors: int = 1,
            num_cpus: int | None = None) -> dict:
    try:
        import ray
        import ray.data
    except ImportError:
        raise ConfigError("--runner ray needs Ray: pip install 'batchgen[ray]'") from None
    from .io.store import OutputStore, atomic_write_json
    from .job.fingerprint import fingerprint
    from .job.prepare import prepare_job
    from .job.run import todo_positions

    _check_input(spec)
    job = prepare_job(spec)  # checks files, columns, ids and the model before any actor starts
    index = job.index
    store = OutputStore(spec.output.path)
    store.acquire_lock()
    try:
        done = store.open(fingerprint(spec, index, job.model.identity, job.max_len), restart, index.ids.type)
        keep = todo_positions(job, done, limit)
        if len(keep) == 0:
            log.info("nothing to do: all %d rows of %s are already done", len(index), spec.output.path)
            return {"status": "already_complete", "rows_total": len(index), "rows_done": len(done)}
        if not ray.is_initialized():
            ray.init(num_cpus=num_cpus, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
        t0 = time.monotonic()
        rows, errors, tokens = _commit_stream(_dataset(ray, spec, index, keep, num_actors), store, index)
        rows_done = len(done) + rows
        summary = {"runner": "ray", "rows_total": len(index), "rows_done": rows_done, "rows_ok": rows - errors,
                   "rows_error": errors, "completion_tokens": tokens,
                   "wall_s": round(time.monotonic() - t0, 2), "complete": rows_done == len(index)}
        atomic_write_json(store.root / "summary.json", summary)
        if rows_done < len(index) and limit is None:
            raise BatchgenError(f"ray run finished with {len(index) - rows_done} ids missing; rerun to resume")
        return summary
    finally:
        store.release_lock()
