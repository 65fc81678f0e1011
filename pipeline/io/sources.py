"""Read the job's input rows from Parquet shards or a Hugging Face dataset, checking columns
and types up front so that bad input fails before the model loads."""
from __future__ import annotations

import glob as globlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..config import InputSpec
from ..errors import InputError

OUTPUT_COLUMNS = ("id", "sample_index", "text", "finish_reason", "error", "prompt_tokens", "completion_tokens",
                  "ttft_s", "itl_s")
_INT_FIELDS = {"max_tokens", "top_k", "seed"}


@dataclass
class Shard:
    name: str
    path: str
    num_rows: int


@dataclass
class InputRows:
    shards: list[Shard]
    ids: list[str]
    # Index of each row's shard in `shards`.
    shard_of: list[int]
    # Row index inside its shard (for error messages).
    row_in_shard: list[int]
    prompts: list | None  # list[str | None] when prompt_column is used
    messages: list | None  # list[list[dict] | None] when messages_column is used
    passthrough: dict[str, tuple[pa.DataType, list]] = field(default_factory=dict)
    overrides: dict[str, list] = field(default_factory=dict)
    # Rows known bad while reading (e.g. a malformed JSONL line): row index -> message.
    errors: dict[int, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)

    def subset(self, keep: list[int]) -> "InputRows":
        """The rows at `keep` (in order); shards are kept whole so their names stay stable."""
        pos = {old: new for new, old in enumerate(keep)}
        return InputRows(
            shards=self.shards, ids=[self.ids[i] for i in keep], shard_of=[self.shard_of[i] for i in keep],
            row_in_shard=[self.row_in_shard[i] for i in keep],
            prompts=[self.prompts[i] for i in keep] if self.prompts is not None else None,
            messages=[self.messages[i] for i in keep] if self.messages is not None else None,
            passthrough={c: (t, [v[i] for i in keep]) for c, (t, v) in self.passthrough.items()},
            overrides={f: [v[i] for i in keep] for f, v in self.overrides.items()},
            errors={pos[i]: m for i, m in self.errors.items() if i in pos})

    def where(self, i: int) -> str:
        s = self.shards[self.shard_of[i]]
        return f"{s.path}, row {self.row_in_shard[i]} (id {self.ids[i]!r})"


def resolve_jsonl_paths(paths: list[str]) -> list[Path]:
    return resolve_paths(paths, suffix=".jsonl")


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
        numeric = pa.types.is_integer(t) if fld in _INT_FIELDS else (pa.types.is_integer(t) or pa.types.is_floating(t))
        if not numeric:
            raise InputError(f"{where}: column {col!r} (per-row {fld}) has type {t}, expected "
                             f"{'an integer' if fld in _INT_FIELDS else 'a number'}")


def _needed_columns(spec: InputSpec) -> list[str]:
    cols = [c for c in (spec.prompt_column, spec.messages_column, spec.id_column) if c]
    cols += list(spec.passthrough_columns) + list(spec.sampling_columns.values())
    return list(dict.fromkeys(cols))


def open_parquet(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{path}: not a readable Parquet file ({e})") from None


def scan_parquet(spec: InputSpec) -> list[tuple[Shard, pq.ParquetFile]]:
    """Open every shard and check its schema, without reading the data."""
    files = resolve_paths(spec.paths)
    out = []
    for name, f in zip(shard_names(files), files):
        pf = open_parquet(f)
        check_schema(pf.schema_arrow, spec, str(f))
        out.append((Shard(name, str(f), pf.metadata.num_rows), pf))
    return out


def read_input(spec: InputSpec) -> InputRows:
    if spec.format == "openai_batch":
        from .openai_batch import read_openai_batch

        return read_openai_batch(spec)
    if spec.dataset is not None:
        table = load_dataset_table(spec)
        shard = Shard(f"{Path(spec.dataset.path).name}-{spec.dataset.split}", spec.dataset.path, table.num_rows)
        check_schema(table.schema, spec, f"dataset {spec.dataset.path} ({spec.dataset.split})")
        tables = [(shard, table)]
    else:
        tables = []
        for shard, pf in scan_parquet(spec):
            try:
                tables.append((shard, pf.read(columns=_needed_columns(spec))))
            except (pa.ArrowException, OSError) as e:
                raise InputError(f"{shard.path}: cannot read its data ({e})") from None
    return _collect(tables, spec)


def _collect(tables: list[tuple[Shard, pa.Table]], spec: InputSpec) -> InputRows:
    rows = InputRows(shards=[s for s, _ in tables], ids=[], shard_of=[], row_in_shard=[],
                     prompts=[] if spec.prompt_column else None, messages=[] if spec.messages_column else None)
    first_seen: dict[str, str] = {}
    for si, (shard, table) in enumerate(tables):
        n = table.num_rows
        if spec.id_column:
            raw = table.column(spec.id_column).to_pylist()
            for r, v in enumerate(raw):
                if v is None:
                    raise InputError(f"{shard.path}, row {r}: id column {spec.id_column!r} is null")
            ids = [str(v) for v in raw]
        else:
            ids = [f"{shard.name}:{r}" for r in range(n)]
        for r, i in enumerate(ids):
            if i in first_seen:
                raise InputError(f"{shard.path}, row {r}: duplicate id {i!r} (first seen at {first_seen[i]}); "
                                 "ids must be unique across all input shards")
            first_seen[i] = f"{shard.path}, row {r}"
        rows.ids.extend(ids)
        rows.shard_of.extend([si] * n)
        rows.row_in_shard.extend(range(n))
        if spec.prompt_column:
            rows.prompts.extend(table.column(spec.prompt_column).to_pylist())
        if spec.messages_column:
            rows.messages.extend(table.column(spec.messages_column).to_pylist())
        for col in spec.passthrough_columns:
            t, vals = rows.passthrough.setdefault(col, (table.schema.field(col).type, []))
            vals.extend(table.column(col).to_pylist())
        for fld, col in spec.sampling_columns.items():
            rows.overrides.setdefault(fld, []).extend(table.column(col).to_pylist())
    return rows


def load_dataset_table(spec: InputSpec) -> pa.Table:
    """A HF dataset as an Arrow table: a save_to_disk folder, local data files, or a hub name
    already in the local cache (never downloaded)."""
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
    return ds.with_format("arrow")[:]
