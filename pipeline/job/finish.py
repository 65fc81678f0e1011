"""What happens once every row of a job (or task) is committed: input-order compaction
(output.order: input) and the OpenAI-style JSONL files. Both stream: memory follows a part, not
the job."""
from __future__ import annotations

import logging
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq

from ..config import JobSpec
from ..io.rows import InputIndex
from ..io.sortmerge import external_sort, group_starts, rebatch
from ..io.store import OutputStore

log = logging.getLogger("batchgen")


def wants_openai_jsonl(spec: JobSpec) -> bool:
    return spec.output.openai_jsonl if spec.output.openai_jsonl is not None else spec.input.format == "openai_batch"


def finish_outputs(store: OutputStore, spec: JobSpec, index: InputIndex, model_name: str) -> None:
    """Once every row is done: input-order compaction, then results.jsonl / errors.jsonl."""
    if spec.output.order == "input":
        compact_input_order(store, spec, index)
    if wants_openai_jsonl(spec):
        from ..io.openai_batch import write_openai_results

        n_ok, n_err = write_openai_results(store.part_files(), store.root, model_name)
        log.info("wrote results.jsonl (%d) and errors.jsonl (%d)", n_ok, n_err)


def entries_schema(store: OutputStore, entries: dict) -> list[str]:
    """Column names of the committed parts (from the first part's footer)."""
    for e in entries.values():
        for name in e.parts:
            return pq.read_schema(store.parts / name).names
    return []


def compact_input_order(store: OutputStore, spec: JobSpec, index: InputIndex) -> None:
    """Rewrite the parts in input order as final-*.parquet, by an external merge sort on each
    row's input position (kept in the ledger), crash-safe through OutputStore.write_finals."""
    entries = store.entries(strict=True, light=True)
    if not entries or all(name.startswith("final-") for name in entries):
        return
    keys = ["_pos"] + (["sample_index"] if "sample_index" in entries_schema(store, entries) else [])

    def sources():
        for name in entries:
            e = store.read_entry(name)
            pos_of = dict(zip(e.ids, e.pos))
            for name in e.parts:
                t = pq.read_table(store.parts / name)
                yield t.append_column("_pos", pa.array([pos_of[i] for i in t.column("id").to_pylist()],
                                                       type=pa.int64()))

    tmp = store.root / f".compact.tmp-{os.getpid()}"

    def finals():
        for t in rebatch(external_sort(sources(), keys, tmp), spec.output.rows_per_part, group="_pos"):
            firsts = pa.array(group_starts(t.column("_pos")))
            pos = t.column("_pos").take(firsts).to_pylist()
            ids = t.column("id").take(firsts).to_pylist()
            yield t.drop_columns(["_pos"]), ids, pos, index.shard_counts(pos)

    try:
        store.write_finals(finals(), replaces=list(entries))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
