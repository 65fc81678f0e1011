"""From a job spec to windows of ready requests: read the input's id index, resolve the model,
then, a window of rows at a time (in a background thread while the engine runs), apply the chat
template, tokenize, check each prompt against the context, resolve per-row sampling and sort by
length. Bad rows become error rows. `prepare_job` is the one path run, validate, plan, status
and the Ray runner share.
"""
from __future__ import annotations

import hashlib
import itertools
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
from ..shapes import text_config

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


class TextEncoder:
    """The chat template and the tokenizer over many rows at once, with transformers' per-call
    overhead removed: the template compiled once (transformers' own compiler) and rendered
    directly, and texts encoded by the fast tokenizer's backend in one batch. Each shortcut is
    checked against the public call (apply_chat_template, tokenizer(...)) on the first rows it
    sees, and replaced by it for good where they differ."""

    CHECK_ROWS = 16

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.template = None
        self.template_kwargs: dict = {}
        if getattr(tokenizer, "chat_template", None):
            try:
                from transformers.utils.chat_template_utils import _compile_jinja_template

                self.template = _compile_jinja_template(tokenizer.get_chat_template())
                self.template_kwargs = dict(tokenizer.special_tokens_map)
            except Exception:  # noqa: BLE001 - another transformers: the public call it is
                self.template = None
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.segments = SegmentCache.for_backend(self.backend) if self.backend is not None else None
        self._template_checked = self._encode_checked = False
        self.fold_system = getattr(tokenizer, "chat_template", None) is not None and self._refuses_system()

    def _refuses_system(self) -> bool:
        """Whether the template rejects a system message but takes the same text in the user
        turn (Gemma 2's "System role not supported"): then system messages are folded into the
        first user turn, as Gemma 3's own template does."""
        def renders(conv) -> bool:
            try:
                self.tokenizer.apply_chat_template([conv], tokenize=False, add_generation_prompt=True)
                return True
            except Exception:  # noqa: BLE001 - a template may raise anything
                return False

        return (not renders([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
                and renders([{"role": "user", "content": "s\n\nu"}]))

    def fold(self, conv: list[dict]) -> list[dict]:
        """conv as the template takes it: with fold_system, a leading system message joins the
        first user turn as "system\n\nuser"."""
        if not (self.fold_system and len(conv) > 1 and conv[0]["role"] == "system" and conv[1]["role"] == "user"):
            return conv
        return [{"role": "user", "content": f"{conv[0]['content']}\n\n{conv[1]['content']}"}] + conv[2:]

    def render(self, convs: list[list[dict]]) -> list[str]:
        """The templated text of each conversation, with the generation prompt."""
        public = lambda cs: self.tokenizer.apply_chat_template(cs, tokenize=False, add_generation_prompt=True)  # noqa: E731
        if self.fold_system:
            convs = [self.fold(c) for c in convs]
        if self.template is None:
            return public(convs)
        out = [self.template.render(messages=c, tools=None, documents=None, add_generation_prompt=True,
                                    **self.template_kwargs) for c in convs]
        if not self._template_checked:
            if public(convs[: self.CHECK_ROWS]) != out[: self.CHECK_ROWS]:
                self.template = None
                return public(convs)
            self._template_checked = True
        return out

    def encode(self, texts: list[str], special: bool) -> list[list[int]]:
        """Token ids of each text (special: the tokenizer adds BOS/EOS as it would)."""
        public = lambda ts: self.tokenizer(ts, add_special_tokens=special)["input_ids"]  # noqa: E731
        if self.backend is None:
            return public(texts)
        if self.backend.truncation is not None:
            self.backend.no_truncation()
        if self.backend.padding is not None:
            self.backend.no_padding()
        if not special and self.segments is not None:
            out = self.segments.encode(texts)
        else:
            out = [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=special)]
        if not self._encode_checked:
            if [list(x) for x in public(texts[: self.CHECK_ROWS])] != out[: self.CHECK_ROWS]:
                self.backend = self.segments = None
                return public(texts)
            self._encode_checked = True
        return out


class SegmentCache:
    """Encodes templated texts a segment at a time. A fast tokenizer splits its input at added
    (special) tokens first and encodes the pieces between them on their own, so the pieces a chat
    template repeats on every row (a system prompt, the role headers) can be encoded once and
    reused; only the rows' own pieces go to the tokenizer. Used only where the split is provably
    the tokenizer's: no added token strips or matches whole words or is normalised, and the
    pre-tokenizer does not treat the start of the text specially (and TextEncoder checks the result
    against the public call on the first rows)."""

    MAX_CACHED = 4096

    def __init__(self, backend, pattern) -> None:
        self.backend = backend
        self.pattern = pattern
        self.special = {t.content: tid for tid, t in backend.get_added_tokens_decoder().items()}
        self.cache: dict[str, list[int]] = {}

    @classmethod
    def for_backend(cls, backend) -> "SegmentCache | None":
        import json
        import re

        added = backend.get_added_tokens_decoder()
        if not added or any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added.values()):
            return None
        pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
        for p in pre.get("pretokenizers", [pre]):
            if p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never":
                return None
            if p.get("type") == "ByteLevel" and p.get("add_prefix_space"):
                return None
        contents = sorted((t.content for t in added.values()), key=len, reverse=True)
        return cls(backend, re.compile("(" + "|".join(re.escape(c) for c in contents) + ")"))

    def encode(self, texts: list[str]) -> list[list[int]]:
        pieces = [self.pattern.split(t) for t in texts]
        seen: dict[str, int] = {}
        for ps in pieces:
            for piece in ps:
                if piece and piece not in self.special and piece not in self.cache:
                    seen[piece] = seen.get(piece, 0) + 1
        new = list(seen)
        fresh = dict(zip(new, (e.ids for e in self.backend.encode_batch(new, add_special_tokens=False)))) \
            if new else {}
        if len(self.cache) < self.MAX_CACHED:
            self.cache.update((k, v) for k, v in fresh.items() if seen[k] > 1)  # repeated: template parts
        out = []
        for ps in pieces:
            ids: list[int] = []
            for piece in ps:
                if not piece:
                    continue
                tid = self.special.get(piece)
                if tid is not None:
                    ids.append(tid)
                else:
                    ids += self.cache.get(piece) or fresh[piece]
            out.append(ids)
        return out


def user_conversation(system: str | None, prompt: str) -> list[dict]:
    """A prompt-column row's conversation: the job's system prompt, if any, then the prompt."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


class PromptFrame:
    """For prompt-column jobs: the chat template's text around a row's prompt, so the template
    need not be rendered for every row. A conversation of one user message (after the job's
    fixed system prompt, if any) renders as prefix + prompt + suffix for any prompt when the
    template only ever outputs the content as it is. That is checked at the start against
    prompts chosen to trip what templates do to content (trimming, JSON escaping, reasoning and
    tool-response markers, template syntax, non-ASCII), and again on a few real rows of every
    window; one mismatch and every row is rendered by the template for the rest of the job."""

    PROBES = ("batchgen probe 7f3a", "  padded\n with space  ", "<tool_response>\nx\n</tool_response>", "<think>\nr\n</think>\nanswer",
              "{{ not jinja }} {% raw %}", "{\"json\": \"quote\\\\\"}", "caf\u00e9 \U0001f600", "x" * 300)
    SAMPLE = 4

    def __init__(self, render, system: str | None) -> None:
        self.render, self.system = render, system
        self.frame: tuple[str, str] | None = None
        # Templates that trim the content (Llama 3's `| trim`) frame the stripped prompt.
        self.strip = False
        try:
            outs = render([self.conversation(p) for p in self.PROBES])
        except Exception:  # noqa: BLE001 - a template that refuses a probe: render every row
            return
        first = outs[0]
        cut = first.find(self.PROBES[0])
        prefix, suffix = first[:cut], first[cut + len(self.PROBES[0]):]
        for strip in (False, True):
            if cut >= 0 and all(o == prefix + (p.strip() if strip else p) + suffix for o, p in zip(outs, self.PROBES)):
                self.frame, self.strip = (prefix, suffix), strip
                return

    def conversation(self, prompt: str) -> list[dict]:
        return user_conversation(self.system, prompt)

    def texts(self, prompts: dict[int, str]) -> dict[int, str] | None:
        """The templated text of each prompt, or None where the template must render them."""
        if self.frame is None:
            return None
        prefix, suffix = self.frame
        out = {k: prefix + (p.strip() if self.strip else p) + suffix for k, p in prompts.items()}
        ks = list(prompts)
        sample = ks[:: max(1, len(ks) // self.SAMPLE)][: self.SAMPLE]
        try:
            rendered = self.render([self.conversation(prompts[k]) for k in sample])
        except Exception:  # noqa: BLE001 - the row-by-row path finds which
            rendered = None
        if rendered != [out[k] for k in sample]:
            self.frame = None
            return None
        return out


class Preparer:
    """Turns a RowWindow into a PreparedWindow for one job and tokenizer."""

    def __init__(self, spec: JobSpec, tokenizer, max_len: int, index: InputIndex | None = None,
                 grammars=None) -> None:
        """grammars: the job's guided.GrammarBook, where rows may carry constraints."""
        self.spec = spec
        self.grammars = grammars
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.index = index
        self.chat = use_chat_template(spec, tokenizer)
        self.column = spec.input.messages_column or spec.input.prompt_column
        self.encoder = TextEncoder(tokenizer)
        self.frame = PromptFrame(self.encoder.render, spec.input.system_prompt) \
            if self.chat and spec.input.prompt_column else None
        # Per-row sampling is the job's own unless a row overrides it or the job is seeded.
        self.plain_sampling = spec.sampling.seed is None

    def prepare(self, win: RowWindow) -> PreparedWindow:
        texts, errors = self._texts(win)
        rows: list[PreparedRow] = []
        out_errors: list[RowError] = []
        passthrough = list(zip(*win.passthrough.values())) if win.passthrough else [()] * len(win)
        for k, msg in sorted(errors.items()):
            out_errors.append(RowError(win.pos[k], win.ids[k], win.shard[k], msg, passthrough[k]))
        ks = sorted(texts)
        if ks:
            enc = self.encoder.encode([texts[k] for k in ks], special=not self.chat)
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
        prompts: dict[int, str] = {}
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
                    prompts[k] = prompt
        if prompts:
            framed = self.frame.texts(prompts) if self.frame is not None else None
            if framed is not None:
                texts.update(framed)
            else:
                convs.update((k, user_conversation(system, p)) for k, p in prompts.items())
        if convs:
            texts.update(self._render(convs, errors))
        return texts, errors

    def _render(self, convs: dict[int, list], errors: dict[int, str]) -> dict[int, str]:
        """The chat template over many conversations in one call; on a failure, row by row so
        that only the rows the template refuses become errors."""
        ks = list(convs)
        try:
            return dict(zip(ks, self.encoder.render([convs[k] for k in ks])))
        except Exception:  # noqa: BLE001 - find the row(s) below
            pass
        out = {}
        for k in ks:
            try:
                out[k] = self.tokenizer.apply_chat_template(self.encoder.fold(convs[k]), tokenize=False,
                                                            add_generation_prompt=True)
            except Exception as e:  # a template may raise on roles it does not know
                errors[k] = f"column {self.column!r}: chat template failed ({e})"
        return out

    @property
    def _format_column(self) -> str:
        """Where a row's own response_format comes from: its sampling column, or the OpenAI body."""
        return self.spec.input.sampling_columns.get("response_format", "body.response_format")

    def _constraint_error(self, fmt, per_row: bool) -> str | None:
        """Compile the row's constraint once (cached): an invalid one makes the row an error row."""
        error = self.grammars.error(fmt)
        if error is None:
            return None
        return f"{f'column {self._format_column!r}' if per_row else 'sampling.response_format'}: {error}"

    def sampling(self, win: RowWindow, k: int) -> SamplingParams | str:
        """The job's sampling with the row's overrides (validated like the job's), and its seed."""
        base = self.spec.sampling
        if self.plain_sampling and not win.overrides:
            return base
        changes = {f: values[k] for f, values in win.overrides.items() if values[k] is not None}
        if "response_format" in changes:
            fmt = _cell_format(changes["response_format"])
            if isinstance(fmt, str):
                return f"column {self._format_column!r}: bad per-row response_format ({fmt})"
            changes["response_format"] = fmt
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
        if sp.response_format is not None:
            error = self._constraint_error(sp.response_format, "response_format" in win.overrides and
                                           win.overrides["response_format"][k] is not None)
            if error:
                return error
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


def _cell_format(value) -> dict | str:
    """A per-row response_format cell (a JSON object as text, or a list of choices) as a dict, or
    what is wrong with it."""
    import json

    if isinstance(value, (list, tuple)):
        return {"type": "choice", "choices": list(value)}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            return f"not JSON: {e}"
    return value if isinstance(value, dict) else f"expected a JSON object, got {type(value).__name__}"


def context_length(spec: JobSpec, model_config) -> int:
    n = text_config(model_config).max_position_embeddings
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
    # Compiled constraints, shared by preparation (which validates them) and the engine.
    grammars: object | None = None

    def windows(self, keep: np.ndarray, background: bool = True,
                should_stop: Callable[[], bool] | None = None) -> Iterator[PreparedWindow]:
        """Prepared windows of the rows at index positions `keep`. With background, reading and
        tokenizing start at once in a thread and run up to two windows ahead of the caller. The
        first window is a sixteenth of the others, so the engine starts within seconds."""
        size = self.spec.input.window_rows
        first = min(len(keep), max(1, size // 16))
        rows = itertools.chain(self.source.windows(self.index, keep[:first], size),
                               self.source.windows(self.index, keep[first:], size))
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
    src = tok = max_len = preparer = grammars = None
    if model:
        src = resolve_model(spec.model.path)
        cfg = load_config(src)
        tok = load_tokenizer(src)
        max_len = context_length(spec, cfg)
        if spec.sampling.response_format is not None or spec.input.per_row_response_format:
            from ..models.loader import eos_token_ids
            from ..runner.guided import GrammarBook

            grammars = GrammarBook(tok, text_config(cfg).vocab_size, eos_token_ids(src, cfg, tok))
        preparer = Preparer(spec, tok, max_len, idx, grammars)
        check()
    return PreparedJob(spec, shard, source, idx, src, tok, max_len, preparer, grammars)
