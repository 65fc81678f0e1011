"""From a job spec to windows of ready requests: read the input's id index, resolve the model,
then, a window of rows at a time (in a background thread while the engine runs), apply the chat
template, tokenize, check each prompt against the context, resolve per-row sampling and sort by
length. Bad rows become error rows. `prepare_job` is the one path run, validate, plan, status
and the Ray runner share.
"""
from __future__ import annotations

import hashlib
import logging
import queue
import threading
from array import array
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
from pydantic import ValidationError

from ..config import JobSpec
from ..engine.request import SamplingParams
from ..errors import InputError
from ..io.rows import InputIndex, RowWindow
from ..io.sources import InputSource, open_input

log = logging.getLogger("batchgen")


@dataclass
class PreparedRow:
    # Position in the job's InputIndex (input order) and the row's id and shard.
    pos: int
    id: object
    shard: int
    token_ids: array
    sampling: SamplingParams
    # The prompt lost its start to fit the context (on_too_long: truncate_left).
    truncated: bool
    passthrough: tuple


@dataclass
class RowError:
    pos: int
    id: object
    shard: int
    message: str
    passthrough: tuple


@dataclass
class PreparedWindow:
    # Rows to run, shortest prompt first (prefix groups kept together); rows that never run.
    rows: list[PreparedRow]
    errors: list[RowError]


def row_seed(job_seed: int, row_id) -> int:
    """A per-row seed from the job's seed and the row id: stable across runs and batches."""
    h = hashlib.blake2b(f"{job_seed}\x00{row_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


def use_chat_template(spec: JobSpec, tokenizer) -> bool:
    has = bool(getattr(tokenizer, "chat_template", None))
    want = spec.input.chat_template
    if want is None:
        want = has
    if (want or spec.input.messages_column) and not has:
        raise InputError("input.chat_template: the model's tokenizer has no chat template; set chat_template: false "
                         "and use prompt_column")
    return want or bool(spec.input.messages_column)


def _messages_error(msgs) -> str | None:
    if msgs is None:
        return "messages are null"
    if not msgs:
        return "messages are empty"
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"message {j} needs string role and content (got {m!r})"
    return None


def length_sorted_prefix_groups(order: list[int], token_ids: list, prefix: int = 128) -> list[int]:
    """Shortest prompts first, except that rows sharing their first `prefix` tokens run together
    (as a group placed at its shortest member), so a shared few-shot or system prefix stays hot
    in the prefix cache instead of being evicted between its users."""
    counts: dict[bytes, int] = {}
    keys: dict[int, bytes | None] = {}
    for i in order:
        ids = token_ids[i]
        key = ids[:prefix].tobytes() if len(ids) > prefix else None
        keys[i] = key
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    group_start: dict[bytes, int] = {}
    for i in order:
        k = keys[i]
        if k is not None and counts[k] > 1:
            group_start[k] = min(group_start.get(k, 1 << 62), len(token_ids[i]))

    def sort_key(i: int):
        k = keys[i]
        if k is not None and counts[k] > 1:
            return (group_start[k], 0, k, len(token_ids[i]), i)
        return (len(token_ids[i]), 1, b"", 0, i)

    return sorted(order, key=sort_key)


class Preparer:
    """Turns a RowWindow into a PreparedWindow for one job and tokenizer."""

    def __init__(self, spec: JobSpec, tokenizer, max_len: int, index: InputIndex | None = None) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.index = index
        self.chat = use_chat_template(spec, tokenizer)
        self.column = spec.input.messages_column or spec.input.prompt_column

    def prepare(self, win: RowWindow) -> PreparedWindow:
        texts, errors = self._texts(win)
        rows: list[PreparedRow] = []
        out_errors: list[RowError] = []
        passthrough = list(zip(*win.passthrough.values())) if win.passthrough else [()] * len(win)
        for k, msg in sorted(errors.items()):
            out_errors.append(RowError(win.pos[k], win.ids[k], win.shard[k], msg, passthrough[k]))
        ks = sorted(texts)
        if ks:
            enc = self.tokenizer([texts[k] for k in ks], add_special_tokens=not self.chat)["input_ids"]
            for k, ids in zip(ks, enc):
                row = self._row(win, k, ids, passthrough[k])
                if isinstance(row, str):
                    out_errors.append(RowError(win.pos[k], win.ids[k], win.shard[k], row, passthrough[k]))
                else:
                    rows.append(row)
        order = length_sorted_prefix_groups(list(range(len(rows))), [r.token_ids for r in rows])
        return PreparedWindow([rows[i] for i in order], out_errors)

    def _texts(self, win: RowWindow) -> tuple[dict[int, str], dict[int, str]]:
        """Window index -> text to tokenize (special tokens already in it when templated), and errors."""
        texts: dict[int, str] = {}
        errors: dict[int, str] = dict(win.errors)
        system = self.spec.input.system_prompt
        col = self.column
        convs: dict[int, list] = {}
        for k in range(len(win)):
            if k in errors:
                continue
            if win.messages is not None:
                msgs = win.messages[k]
                err = _messages_error(msgs)
                if err:
                    errors[k] = f"column {col!r}: {err}"
                    continue
                msgs = [{"role": m["role"], "content": m["content"]} for m in msgs]
                if system and msgs[0]["role"] != "system":
                    msgs = [{"role": "system", "content": system}] + msgs
                convs[k] = msgs
            else:
                prompt = win.prompts[k]
                if prompt is None or prompt.strip() == "":
                    errors[k] = f"column {col!r}: prompt is {'null' if prompt is None else 'empty'}"
                elif not self.chat:
                    texts[k] = f"{system}\n\n{prompt}" if system else prompt
                else:
                    convs[k] = ([{"role": "system", "content": system}] if system else []) + \
                               [{"role": "user", "content": prompt}]
        if convs:
            texts.update(self._render(convs, errors))
        return texts, errors

    def _render(self, convs: dict[int, list], errors: dict[int, str]) -> dict[int, str]:
        """The chat template over many conversations in one call; on a failure, row by row so
        that only the rows the template refuses become errors."""
        ks = list(convs)
        try:
            return dict(zip(ks, self.tokenizer.apply_chat_template([convs[k] for k in ks], tokenize=False,
                                                                   add_generation_prompt=True)))
        except Exception:  # noqa: BLE001 - find the row(s) below
            pass
        out = {}
        for k in ks:
            try:
                out[k] = self.tokenizer.apply_chat_template(convs[k], tokenize=False, add_generation_prompt=True)
            except Exception as e:  # a template may raise on roles it does not know
                errors[k] = f"column {self.column!r}: chat template failed ({e})"
        return out

    def sampling(self, win: RowWindow, k: int) -> SamplingParams | str:
        """The job's sampling with the row's overrides (validated like the job's), and its seed."""
        base = self.spec.sampling
        changes = {f: values[k] for f, values in win.overrides.items() if values[k] is not None}
        sp = base
        if changes:
            try:
                sp = base.with_overrides(changes)
            except ValidationError as e:
                err = e.errors()[0]
                fld = str(err["loc"][0]) if err["loc"] else next(iter(changes))
                col = self.spec.input.sampling_columns.get(fld, f"body.{fld}")
                return f"column {col!r}: bad per-row {fld} {changes.get(fld)!r} ({err['msg']})"
        if sp.seed is not None and "seed" not in changes:
            sp = sp.model_copy(update={"seed": row_seed(sp.seed, win.ids[k])})
        return sp

    def _row(self, win: RowWindow, k: int, ids: list[int], passthrough: tuple) -> PreparedRow | str:
        sp = self.sampling(win, k)
        if isinstance(sp, str):
            return sp
        max_len = self.max_len
        truncated = False
        if len(ids) >= max_len:
            if self.spec.on_too_long == "fail":
                where = self.index.where(win.pos[k]) if self.index is not None else f"id {win.ids[k]!r}"
                raise InputError(f"{where}: prompt has {len(ids)} tokens, over the model's context of {max_len} "
                                 "(on_too_long: fail). Use on_too_long: error or truncate_left to go on without it")
            if self.spec.on_too_long == "error":
                return f"prompt has {len(ids)} tokens; the context holds {max_len} (on_too_long: error)"
            keep = max(1, max_len - min(sp.max_tokens, max_len // 2))
            ids = ids[-keep:]
            truncated = True
        if len(ids) + sp.max_tokens > max_len:
            # Like vLLM: generation stops at the context's end with finish_reason "length".
            sp = sp.model_copy(update={"max_tokens": max_len - len(ids)})
        return PreparedRow(win.pos[k], win.ids[k], win.shard[k], array("i", ids), sp, truncated, passthrough)


def context_length(spec: JobSpec, model_config) -> int:
    n = model_config.max_position_embeddings
    if spec.engine.max_model_len:
        n = min(n, spec.engine.max_model_len)
    return n


@dataclass
class PreparedJob:
    spec: JobSpec
    shard: tuple[int, int] | None
    source: InputSource
    # The ids of this job's (or task's) rows; None when asked for without it (status).
    index: InputIndex | None
    model: object | None  # ModelSource
    tokenizer: object | None
    max_len: int | None
    preparer: Preparer | None

    def windows(self, keep: np.ndarray, background: bool = True,
                should_stop: Callable[[], bool] | None = None) -> Iterator[PreparedWindow]:
        """Prepared windows of the rows at index positions `keep`. With background, reading and
        tokenizing start at once in a thread and run up to two windows ahead of the caller."""
        rows = self.source.windows(self.index, keep, self.spec.input.window_rows)
        prepared = (self.preparer.prepare(w) for w in rows)
        return Prefetch(prepared, depth=2, should_stop=should_stop) if background else prepared


class Prefetch:
    """Iterates `items` in a background thread (started at once), up to `depth` items ahead;
    an exception there is raised here. close() (or garbage collection) stops the thread."""

    def __init__(self, items: Iterator, depth: int, should_stop: Callable[[], bool] | None = None) -> None:
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._halt = threading.Event()
        self._items, self._should_stop = items, should_stop
        self._finished = False
        self._thread = threading.Thread(target=self._produce, name="batchgen-prepare", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        try:
            for item in self._items:
                if not self._put(("item", item)):
                    return
                if self._should_stop is not None and self._should_stop():
                    break
            self._put(("end", None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._put(("error", e))

    def _put(self, msg) -> bool:
        while not self._halt.is_set():
            try:
                self._q.put(msg, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> "Prefetch":
        return self

    def __next__(self):
        if self._finished:
            raise StopIteration
        kind, item = self._q.get()
        if kind == "item":
            return item
        self._finished = True
        self._halt.set()
        if kind == "error":
            raise item
        raise StopIteration

    def close(self) -> None:
        self._finished = True
        self._halt.set()

    def __del__(self) -> None:
        self._halt.set()


def prepare_job(spec: JobSpec, shard: tuple[int, int] | None = None, *, index: bool = True, model: bool = True,
                check: Callable[[], None] | None = None) -> PreparedJob:
    """Open the input (schemas checked), read the id index (selecting a task's rows), resolve the
    model and its tokenizer: everything that can fail on bad input fails here, before any
    weights load. check() is called between the steps (a pending signal raises there)."""
    from ..models.loader import load_config, load_tokenizer, resolve_model
    from ..shard import select_shard

    check = check or (lambda: None)
    source = open_input(spec.input)
    idx = None
    if index:
        idx = select_shard(source.index(), shard)
        check()
    src = tok = max_len = preparer = None
    if model:
        src = resolve_model(spec.model.path)
        cfg = load_config(src)
        tok = load_tokenizer(src)
        max_len = context_length(spec, cfg)
        preparer = Preparer(spec, tok, max_len, idx)
        check()
    return PreparedJob(spec, shard, source, idx, src, tok, max_len, preparer)
