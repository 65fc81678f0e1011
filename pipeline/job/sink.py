"""Finished rows into durable Parquet parts: buffered, all n samples of an id together, committed
every output.rows_per_part rows or output.flush_interval_s seconds."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import pyarrow as pa

from ..config import JobSpec
from ..io.rows import InputIndex
from ..io.store import OutputStore
from .prepare import PreparedRow, RowError


def output_schema(spec: JobSpec, id_type: pa.DataType, passthrough_types: dict[str, pa.DataType]) -> pa.Schema:
    fields = [pa.field("id", id_type, nullable=False)]
    if spec.sampling.n > 1 or spec.input.per_row_n:
        fields.append(pa.field("sample_index", pa.int32(), nullable=False))
    fields += [pa.field(c, passthrough_types[c]) for c in spec.input.passthrough_columns]
    fields += [pa.field("text", pa.string()), pa.field("finish_reason", pa.string(), nullable=False),
               pa.field("error", pa.string()), pa.field("prompt_tokens", pa.int32(), nullable=False),
               pa.field("completion_tokens", pa.int32(), nullable=False), pa.field("ttft_s", pa.float64()),
               pa.field("itl_s", pa.float64())]
    if spec.on_too_long == "truncate_left":
        fields.append(pa.field("prompt_truncated", pa.bool_(), nullable=False))
    if wants_logprobs(spec):
        fields.append(pa.field("logprobs", LOGPROBS_TYPE))
    if spec.sampling.prompt_logprobs is not None:
        fields.append(pa.field("prompt_logprobs", LOGPROBS_TYPE))
    return pa.schema(fields)


def wants_logprobs(spec: JobSpec) -> bool:
    return spec.sampling.logprobs is not None or spec.input.per_row_logprobs


_TOKEN = pa.struct([("token", pa.string()), ("token_id", pa.int32()), ("logprob", pa.float64())])
# Per generated token: the token, its logprob and the top-K alternatives (null where not asked for).
LOGPROBS_TYPE = pa.list_(pa.struct(list(_TOKEN) + [pa.field("top", pa.list_(_TOKEN))]))


class TokenText:
    """Token id -> its text (decoded alone), cached: logprobs name every token they list."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        text = self.cache.get(tid)
        if text is None:
            text = self.cache[tid] = self.tokenizer.decode([tid])
        return text

    def records(self, token_ids: list[int], logprobs: list) -> list[dict] | None:
        """The logprobs column's value for one sample (None when it asked for none)."""
        if not logprobs:
            return None
        return [{"token": self(t), "token_id": t, "logprob": lp,
                 "top": [{"token": self(a), "token_id": a, "logprob": alp} for a, alp in top.items()]}
                for t, (lp, top) in zip(token_ids, logprobs)]


@dataclass
class RunStats:
    rows_ok: int = 0
    rows_error: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    rows_truncated: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)


class ResultSink:
    """Buffers finished rows (all n samples of an id together) and commits them as parts."""

    def __init__(self, store: OutputStore, spec: JobSpec, schema: pa.Schema, index: InputIndex | None,
                 stats: RunStats, rows_per_part: int | None = None) -> None:
        """index: the job's InputIndex, for the ledger's per-shard counts (None: not counted)."""
        self.store, self.spec, self.schema, self.stats = store, spec, schema, stats
        self.index = index
        self.rows_per_part = rows_per_part or spec.output.rows_per_part
        self.n = spec.sampling.n
        self.passthrough = list(spec.input.passthrough_columns)
        self.truncation = spec.on_too_long == "truncate_left"
        self.buffer: list[dict] = []
        self.buffer_rows: list[PreparedRow | RowError] = []
        self.partial: dict[int, list[dict]] = {}
        self.last_flush = time.monotonic()
        self.rows_done = 0

    def add(self, row: PreparedRow | RowError, sample_index: int, text: str | None, finish_reason: str,
            error: str | None, prompt_tokens: int, completion_tokens: int, ttft: float | None, itl: float | None,
            cached_tokens: int = 0, logprobs: list | None = None, prompt_logprobs: list | None = None) -> None:
        rec = {"id": row.id, "sample_index": sample_index, "text": text, "finish_reason": finish_reason,
               "error": error, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
               "ttft_s": ttft, "itl_s": itl, "prompt_truncated": getattr(row, "truncated", False),
               "logprobs": logprobs, "prompt_logprobs": prompt_logprobs}
        rec.update(zip(self.passthrough, row.passthrough))
        s = self.stats
        if error is None:
            s.completion_tokens += completion_tokens
            if ttft is not None:
                s.ttft.append(ttft)
            if itl is not None:
                s.itl.append(itl)
        s.cached_tokens += cached_tokens
        samples = self.partial.setdefault(row.pos, [])
        samples.append(rec)
        if len(samples) < self.samples_of(row):
            return
        del self.partial[row.pos]
        # The prompt is counted once per row, whatever n is.
        s.prompt_tokens += prompt_tokens
        if all(r["error"] is None for r in samples):
            s.rows_ok += 1
        else:
            s.rows_error += 1
        if rec["prompt_truncated"]:
            s.rows_truncated += 1
        samples.sort(key=lambda r: r["sample_index"])
        self.buffer.extend(samples)
        self.buffer_rows.append(row)
        self.rows_done += 1
        if len(self.buffer) >= self.rows_per_part:
            self.flush()

    def samples_of(self, row: PreparedRow | RowError) -> int:
        """Output rows an id gets: its sampling's n (an error row: the job's n)."""
        return row.sampling.n if isinstance(row, PreparedRow) else self.n

    def add_error(self, row: RowError, message: str | None = None) -> None:
        for k in range(self.n):
            self.add(row, k, None, "error", message or row.message, 0, 0, None, None)

    def maybe_flush(self) -> None:
        if self.buffer and time.monotonic() - self.last_flush >= self.spec.output.flush_interval_s:
            self.flush()

    def flush(self) -> None:
        self.last_flush = time.monotonic()
        if not self.buffer:
            return
        cols = {f.name: [r[f.name] for r in self.buffer] for f in self.schema}
        table = pa.table(cols, schema=self.schema)
        pos = [r.pos for r in self.buffer_rows]
        shards = self.index.shard_counts(pos) if self.index is not None else {}
        self.store.commit(table, [r.id for r in self.buffer_rows], pos, shards)
        self.buffer, self.buffer_rows = [], []
