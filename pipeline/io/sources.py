"""Read the job's input: Parquet shards, a Hugging Face dataset or OpenAI Batch JSONL.

`open_input(spec)` checks every file's schema up front (so bad input fails before the model
loads) without reading data. `index()` then reads only the id column; `windows()` reads the
rows to run a bounded window at a time, so memory follows the window, not the input.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..config import InputSpec
from ..errors import InputError
from .rows import (
    OUTPUT_COLUMNS,
    InputIndex,
    RowWindow,
    Shard,
    build_index,
    generated_ids,
    normalise_ids,
    resolve_paths,
    shard_names,
)

_INT_FIELDS = {"max_tokens", "top_k", "seed", "n", "logprobs"}


class InputSource(Protocol):
    shards: list[Shard]
    # Types of the pass-through columns, for the output schema.
    passthrough_types: dict[str, pa.DataType]

    def index(self) -> InputIndex: ...

    def windows(self, index: InputIndex, keep: np.ndarray, window_rows: int) -> Iterator[RowWindow]:
        """The rows at index positions `keep` (ascending), window_rows at a time."""
        ...


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", lambda _: False)(t)


def _check_messages_type(t: pa.DataType, where: str, col: str) -> None:
    ok = (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_struct(t.value_type)
    if ok:
        names = {t.value_type.field(i).name for i in range(t.value_type.num_fields)}
        ok = {"role", "content"} <= names
    if not ok:
        raise InputError(f"{where}: column {col!r} has type {t}, expected a list of {{role, content}} structs")


def check_schema(schema: pa.Schema, spec: InputSpec, where: str) -> None:
    names = set(schema.names)

    def need(col: str, what: str) -> pa.DataType:
        if col not in names:
            raise InputError(f"{where}: missing {what} column {col!r}; columns are: {', '.join(schema.names)}")
        return schema.field(col).type

    if spec.prompt_column:
        t = need(spec.prompt_column, "prompt")
        if not _is_string(t):
            raise InputError(f"{where}: column {spec.prompt_column!r} has type {t}, expected string")
    if spec.messages_column:
        _check_messages_type(need(spec.messages_column, "messages"), where, spec.messages_column)
    if spec.id_column:
        t = need(spec.id_column, "id")
        if not (_is_string(t) or pa.types.is_integer(t)):
            raise InputError(f"{where}: id column {spec.id_column!r} has type {t}, expected string or integer")
    for col in spec.passthrough_columns:
        need(col, "passthrough")
        if col in OUTPUT_COLUMNS:
            raise InputError(f"input.passthrough_columns: {col!r} clashes with an output column; rename it")
    for fld, col in spec.sampling_columns.items():
        t = need(col, f"sampling override ({fld})")
        if fld == "response_format":
            if not (_is_string(t) or ((pa.types.is_list(t) or pa.types.is_large_list(t)) and _is_string(t.value_type))):
                raise InputError(f"{where}: column {col!r} (per-row response_format) has type {t}, expected a "
                                 "string (a JSON object) or a list of strings (choices)")
            continue
        numeric = pa.types.is_integer(t) if fld in _INT_FIELDS else (pa.types.is_integer(t) or pa.types.is_floating(t))
        if not numeric:
            raise InputError(f"{where}: column {col!r} (per-row {fld}) has type {t}, expected "
                             f"{'an integer' if fld in _INT_FIELDS else 'a number'}")


def needed_columns(spec: InputSpec) -> list[str]:
    cols = [c for c in (spec.prompt_column, spec.messages_column, spec.id_column) if c]
    cols += list(spec.passthrough_columns) + list(spec.sampling_columns.values())
    return list(dict.fromkeys(cols))


def _window_columns(spec: InputSpec, table: pa.Table, win: RowWindow) -> None:
    """Append a table of rows (already selected) to a window as Python values."""
    if spec.prompt_column:
        win.prompts.extend(table.column(spec.prompt_column).to_pylist())
    if spec.messages_column:
        win.messages.extend(table.column(spec.messages_column).to_pylist())
    for col in spec.passthrough_columns:
        win.passthrough.setdefault(col, []).extend(table.column(col).to_pylist())
    for fld, col in spec.sampling_columns.items():
        win.overrides.setdefault(fld, []).extend(table.column(col).to_pylist())


def window_from_table(spec: InputSpec, table: pa.Table, pos: np.ndarray, shard: np.ndarray) -> RowWindow:
    """A window from a table of input rows that carries its own id column (the Ray runner)."""
    win = _new_window(spec)
    _window_columns(spec, table, win)
    win.pos.extend(pos.tolist())
    win.shard.extend(shard.tolist())
    win.ids.extend(table.column(spec.id_column).to_pylist())
    return win


def _new_window(spec: InputSpec) -> RowWindow:
    return RowWindow(pos=[], ids=[], shard=[], prompts=[] if spec.prompt_column else None,
                     messages=[] if spec.messages_column else None)


def _group_by_shard(index: InputIndex, keep: np.ndarray):
    """(shard index, rows in the shard, index positions) for each shard that has rows in keep."""
    if len(keep) == 0:
        return
    shard_of = index.shard_of[keep]
    bounds = np.flatnonzero(np.diff(shard_of)) + 1
    for part in np.split(np.arange(len(keep)), bounds):
        pos = keep[part]
        yield int(shard_of[part[0]]), index.row_in_shard[pos], pos


class _TableWindows:
    """windows() over per-shard Arrow record batches (Parquet files or a dataset table)."""

    spec: InputSpec

    def _batches(self, shard: int, rows: np.ndarray) -> Iterator[tuple[int, pa.RecordBatch]]:
        """(first row, batch) covering at least `rows` of the shard, in order."""
        raise NotImplementedError

    def windows(self, index: InputIndex, keep: np.ndarray, window_rows: int) -> Iterator[RowWindow]:
        win = _new_window(self.spec)
        ids = index.ids
        for si, rows, pos in _group_by_shard(index, keep):
            k = 0  # next wanted row (into rows/pos)
            for start, batch in self._batches(si, rows):
                end = start + batch.num_rows
                while k < len(rows) and rows[k] < end:
                    stop = min(int(np.searchsorted(rows, end)), k + window_rows - len(win))
                    local = pa.array(rows[k:stop] - start, type=pa.int64())
                    _window_columns(self.spec, pa.Table.from_batches([batch]).take(local), win)
                    win.pos.extend(pos[k:stop].tolist())
                    win.ids.extend(ids.take(pa.array(pos[k:stop], type=pa.int64())).to_pylist())
                    win.shard.extend([si] * (stop - k))
                    k = stop
                    if len(win) >= window_rows:
                        yield win
                        win = _new_window(self.spec)
        if len(win):
            yield win


def open_parquet(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{path}: not a readable Parquet file ({e})") from None


class ParquetSource(_TableWindows):
    def __init__(self, spec: InputSpec) -> None:
        self.spec = spec
        files = resolve_paths(spec.paths)
        self.shards: list[Shard] = []
        self.passthrough_types: dict[str, pa.DataType] = {}
        for name, f in zip(shard_names(files), files):
            pf = open_parquet(f)
            schema = pf.schema_arrow
            check_schema(schema, spec, str(f))
            for col in spec.passthrough_columns:
                self.passthrough_types.setdefault(col, schema.field(col).type)
            self.shards.append(Shard(name, str(f), pf.metadata.num_rows))

    def index(self) -> InputIndex:
        arrays = []
        for s in self.shards:
            if self.spec.id_column:
                try:
                    col = pq.read_table(s.path, columns=[self.spec.id_column]).column(0)
                except (pa.ArrowException, OSError) as e:
                    raise InputError(f"{s.path}: cannot read its id column ({e})") from None
                arrays.append(normalise_ids(col, s.path, self.spec.id_column))
            else:
                arrays.append(generated_ids(s.name, s.num_rows))
        return build_index(self.shards, arrays, self.spec.id_column)

    def _batches(self, shard: int, rows: np.ndarray):
        path = self.shards[shard].path
        pf = open_parquet(Path(path))
        # Only the row groups holding wanted rows are read (a resume skips what is done).
        bounds = np.cumsum([0] + [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)])
        groups = sorted(set(np.searchsorted(bounds, rows, side="right").tolist()))
        cols = needed_columns(self.spec)
        try:
            for g in groups:
                start = int(bounds[g - 1])
                for batch in pf.iter_batches(batch_size=8192, row_groups=[g - 1], columns=cols):
                    yield start, batch
                    start += batch.num_rows
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"{path}: cannot read its data ({e})") from None


class DatasetSource(_TableWindows):
    """A HF dataset as one shard: a save_to_disk folder, local data files, or a hub name already
    in the local cache (never downloaded). Arrow-backed datasets stay memory-mapped."""

    def __init__(self, spec: InputSpec) -> None:
        self.spec = spec
        ds = spec.dataset
        self.table = load_dataset_table(spec)
        check_schema(self.table.schema, spec, f"dataset {ds.path} ({ds.split})")
        self.shards = [Shard(f"{Path(ds.path).name}-{ds.split}", ds.path, self.table.num_rows)]
        self.passthrough_types = {c: self.table.schema.field(c).type for c in spec.passthrough_columns}

    def index(self) -> InputIndex:
        s = self.shards[0]
        if self.spec.id_column:
            ids = normalise_ids(self.table.column(self.spec.id_column), s.path, self.spec.id_column)
        else:
            ids = generated_ids(s.name, s.num_rows)
        return build_index(self.shards, [ids], self.spec.id_column)

    def _batches(self, shard: int, rows: np.ndarray):
        table = self.table.select(needed_columns(self.spec))
        start = 0
        for batch in table.to_batches(max_chunksize=8192):
            yield start, batch
            start += batch.num_rows


def open_input(spec: InputSpec) -> InputSource:
    """The job's input reader, with every file opened and its schema checked (no data read)."""
    if spec.format == "openai_batch":
        from .openai_batch import OpenAIBatchSource

        return OpenAIBatchSource(spec)
    if spec.dataset is not None:
        return DatasetSource(spec)
    return ParquetSource(spec)


def load_dataset_table(spec: InputSpec) -> pa.Table:
    ds_spec = spec.dataset
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    path = Path(ds_spec.path)
    try:
        if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()
                              or (path / "state.json").exists()):
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if ds_spec.split not in ds:
                    raise InputError(f"input.dataset.split: {ds_spec.split!r} not in {path} (splits: {', '.join(ds)})")
                ds = ds[ds_spec.split]
        elif path.exists():
            files = [str(p) for p in (sorted(path.rglob("*")) if path.is_dir() else [path]) if p.is_file()]
            ext = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}
            kinds = {ext.get(Path(f).suffix) for f in files} - {None}
            if len(kinds) != 1:
                raise InputError(f"input.dataset.path: {path} holds no single kind of parquet/json/csv data files")
            kind = kinds.pop()
            files = [f for f in files if ext.get(Path(f).suffix) == kind]
            ds = datasets.load_dataset(kind, data_files={ds_spec.split: files}, split=ds_spec.split)
        else:
            ds = datasets.load_dataset(ds_spec.path, ds_spec.name, split=ds_spec.split)
    except InputError:
        raise
    except Exception as e:  # datasets raises many kinds; all mean the same to the user
        raise InputError(f"input.dataset: cannot load {ds_spec.path!r} split {ds_spec.split!r} offline ({e})") from None
    # A dataset with an indices mapping (select/shuffle) is flattened; plain ones stay memory-mapped.
    if getattr(ds, "_indices", None) is not None:
        ds = ds.flatten_indices()
    return ds.data.table
