"""What every input reader produces: the job's id index (read up front, ids only) and windows of
rows (read lazily, a bounded number at a time)."""
from __future__ import annotations

import glob as globlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..errors import InputError

# Columns every output part has; an input column passed through must not clash with them.
OUTPUT_COLUMNS = ("id", "sample_index", "text", "finish_reason", "error", "prompt_tokens", "completion_tokens",
                  "ttft_s", "itl_s", "prompt_truncated", "logprobs", "prompt_logprobs")


@dataclass
class Shard:
    name: str
    path: str
    num_rows: int


@dataclass
class InputIndex:
    """The ids of the job's rows in input order, with where each comes from. Held in memory as
    Arrow/NumPy arrays (a few bytes a row), never as Python objects per row."""

    shards: list[Shard]
    # int64, or large_string (the id column's type; generated ids are strings).
    ids: pa.Array
    # [rows] index of each row's shard in `shards`, and its row inside that shard.
    shard_of: np.ndarray
    row_in_shard: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def id_type(self) -> pa.DataType:
        """The output's id type: int64 or string."""
        return pa.int64() if pa.types.is_integer(self.ids.type) else pa.string()

    def where(self, i: int) -> str:
        s = self.shards[int(self.shard_of[i])]
        return f"{s.path}, row {int(self.row_in_shard[i])} (id {self.ids[i].as_py()!r})"

    def shard_counts(self, pos) -> dict[str, int]:
        """Rows per shard name among index positions `pos` (for the ledger)."""
        counts = np.bincount(self.shard_of[np.asarray(pos, dtype=np.int64)], minlength=len(self.shards))
        return {self.shards[i].name: int(c) for i, c in enumerate(counts) if c}

    def take(self, keep: np.ndarray) -> "InputIndex":
        """The rows at positions `keep` (in order); shards stay whole so their names are stable."""
        return InputIndex(self.shards, self.ids.take(pa.array(keep, type=pa.int64())), self.shard_of[keep],
                          self.row_in_shard[keep])


@dataclass
class RowWindow:
    """A window of input rows as Python values, for templating and tokenizing."""

    # Position of each row in the job's InputIndex.
    pos: list[int]
    ids: list
    # Index of each row's shard in the job's shards.
    shard: list[int]
    prompts: list | None = None
    messages: list | None = None
    passthrough: dict[str, list] = field(default_factory=dict)
    # Sampling field -> per-row values (None keeps the job's value); "stop" holds tuples.
    overrides: dict[str, list] = field(default_factory=dict)
    # Rows known bad while reading (e.g. a malformed JSONL line): window index -> message.
    errors: dict[int, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.pos)


def resolve_paths(paths: list[str], suffix: str = ".parquet") -> list[Path]:
    """Expand files, globs and directories into a sorted, de-duplicated list of input files."""
    out: list[Path] = []
    for p in paths:
        if any(c in p for c in "*?["):
            matches = sorted(Path(m) for m in globlib.glob(p, recursive=True) if os.path.isfile(m))
            if not matches:
                raise InputError(f"input.path: the glob {p!r} matches no file (relative to {os.getcwd()})")
            out.extend(matches)
        elif os.path.isdir(p):
            matches = sorted(Path(p).rglob(f"*{suffix}"))
            if not matches:
                raise InputError(f"input.path: the directory {p!r} holds no {suffix} file")
            out.extend(matches)
        elif os.path.isfile(p):
            out.append(Path(p))
        else:
            raise InputError(f"input.path: {p!r} not found (relative to {os.getcwd()})")
    seen: set[Path] = set()
    return [p for p in out if not (p.resolve() in seen or seen.add(p.resolve()))]


def shard_names(files: list[Path]) -> list[str]:
    stems = [f.stem for f in files]
    if len(set(stems)) == len(stems):
        return stems
    return [str(f.with_suffix("")) for f in files]


def generated_ids(name: str, n: int) -> pa.Array:
    """'<shard>:<row>' for rows without an id column, built without a Python object per row."""
    rows = pa.array(np.arange(n, dtype=np.int64)).cast(pa.string())
    import pyarrow.compute as pc

    return pc.binary_join_element_wise(pa.scalar(f"{name}:"), rows, "").cast(pa.large_string())


def normalise_ids(col: pa.ChunkedArray | pa.Array, where: str, column: str) -> pa.Array:
    """An id column as int64 or large_string (one chunk), refusing nulls and other types."""
    if isinstance(col, pa.ChunkedArray):
        col = pa.concat_arrays(col.chunks) if col.num_chunks else pa.array([], type=col.type)
    t = col.type
    if pa.types.is_integer(t):
        col = col.cast(pa.int64())
    elif pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", lambda _: False)(t):
        col = col.cast(pa.large_string())
    else:
        raise InputError(f"{where}: id column {column!r} has type {t}, expected string or integer")
    if col.null_count:
        import pyarrow.compute as pc

        row = pc.index(pc.is_null(col), True).as_py()
        raise InputError(f"{where}, row {row}: id column {column!r} is null")
    return col


def build_index(shards: list[Shard], id_arrays: list[pa.Array], id_column: str | None) -> InputIndex:
    """One index over all shards: checks that ids share one type and are unique, naming the
    file and row of the first duplicate and of its first occurrence."""
    kinds = {("int" if pa.types.is_integer(a.type) else "string") for a in id_arrays}
    if len(kinds) > 1:
        typed = [f"{s.path}: {'integer' if pa.types.is_integer(a.type) else 'string'}" for s, a in zip(shards, id_arrays)]
        raise InputError(f"input.id_column {id_column!r} is an integer in some files and a string in others "
                         f"({'; '.join(typed[:4])}); give every file one id type")
    ids = pa.concat_arrays(id_arrays) if id_arrays else pa.array([], type=pa.large_string())
    counts = [s.num_rows for s in shards]
    shard_of = np.repeat(np.arange(len(shards), dtype=np.int32), counts)
    row_in_shard = np.concatenate([np.arange(n, dtype=np.int64) for n in counts]) if counts else np.zeros(0, np.int64)
    index = InputIndex(shards, ids, shard_of, row_in_shard)
    if id_column is not None:
        _check_unique(index)
    return index


def _check_unique(index: InputIndex) -> None:
    import polars as pl

    s = pl.Series("id", index.ids)
    if s.n_unique() == len(s):
        return
    j = int((~s.is_first_distinct()).arg_true()[0])
    i = int((s == s[j]).arg_true()[0])
    raise InputError(f"{index.where(j)}: duplicate id {s[j]!r} (first seen at {index.where(i)}); "
                     "ids must be unique across all input shards")


def ids_digest(ids: pa.Array) -> str:
    """SHA-256 of an id array's values (int64 or large_string), read straight from its buffers."""
    import hashlib

    arr = pa.concat_arrays([ids]) if len(ids) else ids
    if arr.offset:
        arr = pa.array(arr.to_pylist(), type=arr.type)
    h = hashlib.sha256(str(arr.type).encode())
    bufs = arr.buffers()[1:]
    if pa.types.is_large_string(arr.type) and len(arr):
        import numpy as np

        offsets = np.frombuffer(bufs[0], dtype=np.int64, count=len(arr) + 1)
        h.update((offsets - offsets[0]).tobytes())
        h.update(memoryview(bufs[1])[int(offsets[0]) : int(offsets[-1])])
    elif len(arr):
        h.update(memoryview(bufs[0])[: 8 * len(arr)])
    return h.hexdigest()
