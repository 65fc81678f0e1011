"""An external merge sort over Parquet parts, in memory bounded by the batch size, not the job.

Each part is sorted on its own into a run; runs are merged fan_in at a time (in passes over
temp files when there are more), a batch of rows per run in memory. `batchgen merge` (order by
id) and `output.order: input` compaction (order by input position) both go through it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq


def group_starts(col) -> np.ndarray:
    """Indices where a sorted column's value changes (0 included): the first row of each group."""
    if len(col) == 0:
        return np.zeros(0, dtype=np.int64)
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    neq = pc.not_equal(col.slice(1), col.slice(0, len(col) - 1)).to_numpy(zero_copy_only=False)
    return np.concatenate([[0], np.flatnonzero(neq) + 1])


def rebatch(tables: Iterable[pa.Table], rows: int, group: str | None = None) -> Iterator[pa.Table]:
    """Tables of about `rows` rows from a stream of tables; with `group`, cut only where that
    (sorted) column changes, so a group (all samples of an id) stays in one table."""
    pending: pa.Table | None = None
    for t in tables:
        pending = t if pending is None else pa.concat_tables([pending, t])
        while pending.num_rows >= rows:
            cut = rows
            if group is not None:
                col = pending.column(group).combine_chunks()
                starts = group_starts(col.slice(rows - 1))
                if len(starts) < 2:
                    break  # the group at the cut runs to the end: wait for more rows
                cut = rows - 1 + int(starts[1])
            yield pending.slice(0, cut).combine_chunks()
            pending = pending.slice(cut)
    if pending is not None and pending.num_rows:
        yield pending.combine_chunks()


def _prefix_le(table: pa.Table, keys: list[str], bound: tuple) -> int:
    """Rows at the head of a sorted table whose key is <= bound (lexicographic over keys)."""
    mask = None
    for k in reversed(range(len(keys))):
        col = table.column(keys[k])
        le = pc.less_equal(col, pa.scalar(bound[k], type=col.type)) if mask is None else pc.or_(
            pc.less(col, pa.scalar(bound[k], type=col.type)),
            pc.and_(pc.equal(col, pa.scalar(bound[k], type=col.type)), mask))
        mask = le
    return int(pc.sum(mask).as_py() or 0)


def _key(table: pa.Table, keys: list[str], i: int) -> tuple:
    return tuple(table.column(k)[i].as_py() for k in keys)


def merge_runs(paths: list[Path], keys: list[str], batch_rows: int) -> Iterator[pa.Table]:
    """The rows of sorted Parquet runs, merged in key order, as a stream of tables."""
    readers = [pq.ParquetFile(p).iter_batches(batch_size=batch_rows) for p in paths]
    bufs: list[pa.Table | None] = [None] * len(paths)

    def refill(i: int) -> None:
        b = next(readers[i], None)
        bufs[i] = pa.Table.from_batches([b]) if b is not None else None

    for i in range(len(paths)):
        refill(i)
    while True:
        live = [i for i, b in enumerate(bufs) if b is not None]
        if not live:
            return
        # Every live buffer's rows up to the smallest last key can go: nothing unread sorts before them.
        bound = min(_key(bufs[i], keys, bufs[i].num_rows - 1) for i in live)
        taken = []
        for i in live:
            n = _prefix_le(bufs[i], keys, bound)
            if n:
                taken.append(bufs[i].slice(0, n))
                bufs[i] = bufs[i].slice(n)
            if bufs[i].num_rows == 0:
                refill(i)
        yield pa.concat_tables(taken).sort_by([(k, "ascending") for k in keys])


def external_sort(sources: Iterable[pa.Table], keys: list[str], tmp_dir: Path, fan_in: int = 32,
                  batch_rows: int = 4096, on_run: Callable[[], None] | None = None) -> Iterator[pa.Table]:
    """All rows of `sources` (tables that fit in memory one at a time, each with the key
    columns) in key order, as a stream of tables. Temp runs go under tmp_dir (created here; the
    caller removes it). on_run is called after each run is written (a signal check)."""
    tmp_dir.mkdir(parents=True, exist_ok=True)
    runs: list[Path] = []
    order = [(k, "ascending") for k in keys]
    for t in sources:
        path = tmp_dir / f"run-0-{len(runs):06d}.parquet"
        pq.write_table(t.sort_by(order), path)
        runs.append(path)
        if on_run:
            on_run()
    level = 0
    while len(runs) > fan_in:
        level += 1
        merged = []
        for g in range(0, len(runs), fan_in):
            path = tmp_dir / f"run-{level}-{len(merged):06d}.parquet"
            group = runs[g : g + fan_in]
            writer = None
            for t in merge_runs(group, keys, batch_rows):
                if writer is None:
                    writer = pq.ParquetWriter(path, t.schema)
                writer.write_table(t)
            if writer is not None:
                writer.close()
                merged.append(path)
            for p in group:
                p.unlink()
            if on_run:
                on_run()
        runs = merged
    yield from merge_runs(runs, keys, batch_rows)
