"""`batchgen merge`: every task's parts into output.path/merged/, ordered by id, after checking
that every input id is present exactly once (n times with sampling.n > 1) and that every part is
whole (SHA-256). Streams through an external merge sort; refuses while a run holds a lock."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..config import JobSpec
from ..errors import BatchgenError, LockedError
from ..io.sortmerge import external_sort, rebatch
from ..io.store import OutputStore, atomic_write, fsync_dir, write_error
from ..shard import all_roots, task_sets
from .prepare import prepare_job


def _examples(values: pa.Array, mask) -> list:
    return values.filter(mask).slice(0, 3).to_pylist()


def _check_exactly_once(spec: JobSpec, want: pa.Array, done: pa.Array) -> None:
    """Every input id committed exactly once, by comparing the two sorted id arrays (memory: a
    few copies of the ids, never a Python object per row); the examples only on a mismatch."""
    if len(want) == len(done) and pc.take(want, pc.sort_indices(want)).equals(pc.take(done, pc.sort_indices(done))):
        return
    import polars as pl

    missing = pc.invert(pc.is_in(want, value_set=done))
    extra = pc.invert(pc.is_in(done, value_set=want))
    dup_mask = pl.Series(done).is_duplicated().to_arrow()
    n_missing, n_extra, n_dup = (int(pc.sum(m).as_py() or 0) for m in (missing, extra, dup_mask))
    raise BatchgenError(f"{spec.output.path}: cannot merge: {n_missing} ids missing (e.g. "
                        f"{_examples(want, missing)}), {n_dup} ids committed more than once (e.g. "
                        f"{sorted(set(_examples(done, dup_mask)))}), {n_extra} ids not in the input (e.g. "
                        f"{_examples(done, extra)}); run the remaining tasks (or the job) first")


def merge_job(spec: JobSpec) -> dict:
    out_root = Path(spec.output.path)
    job = prepare_job(spec, model=False)
    stores = [OutputStore(r) for r in all_roots(spec.output.path)]
    if not stores:
        raise BatchgenError(f"{spec.output.path}: no committed parts to merge; run the job first")
    sets = task_sets(spec.output.path)
    if len(sets) > 1:
        raise BatchgenError(f"{spec.output.path}: holds task sets of {', '.join(map(str, sorted(sets)))} tasks, each "
                            "covering the input; rerun with --restart and one --shard count")
    held = []
    try:
        for s in stores:
            try:
                s.acquire_lock()
            except LockedError:
                raise LockedError(f"{s.root}: a run of this job is running; merge once it has finished") from None
            held.append(s)
        for stale in out_root.glob(".merged.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)  # a killed merge's leftovers
        return _merge(spec, job.index, stores, out_root)
    finally:
        for s in held:
            s.release_lock()


def _merge(spec: JobSpec, index, stores: list[OutputStore], out_root: Path) -> dict:
    entries = []
    problems = []
    for s in stores:
        good, found = s.audit(checksum=True)
        problems += found
        entries += [(s, e) for e in good.values()]
    if problems:
        raise BatchgenError(f"cannot merge: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1
                                                              else "") + "; rerun the job to generate those rows again")
    by_store: dict = {}
    for st, e in entries:
        by_store.setdefault(st, []).append(e.name)
    done = pa.concat_arrays([st.ids_array(names, index.ids.type) for st, names in by_store.items()] or
                            [pa.array([], type=index.ids.type)])
    _check_exactly_once(spec, index.ids, done)
    del done
    first = next((s.parts / p for s, e in entries for p in e.parts), None)
    keys = ["id"] + (["sample_index"] if first is not None and "sample_index" in pq.read_schema(first).names else [])

    def sources():
        for s, e in entries:
            for name in e.parts:
                yield pq.read_table(s.parts / name)

    out = out_root / "merged"
    tmp = out_root / f".merged.tmp-{os.getpid()}"
    rows = parts = 0
    try:
        tmp.mkdir(parents=True)
        for chunk in rebatch(external_sort(sources(), keys, tmp / "runs"), spec.output.rows_per_part, group="id"):
            atomic_write(tmp / f"part-{parts:06d}.parquet", lambda f, c=chunk: pq.write_table(c, f))
            rows += chunk.num_rows
            parts += 1
        shutil.rmtree(tmp / "runs", ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
        fsync_dir(out_root)
    except OSError as e:
        raise write_error(e, tmp, "the job's parts are untouched; nothing was merged") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"rows": rows, "ids": int(len(index)), "parts": parts, "path": str(out)}
