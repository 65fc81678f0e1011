"""Turn input rows into token ids: chat template (or raw prompt + system prompt), tokenize once,
check against the context, and sort by length for batching. Bad rows become error results."""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field, replace

from .config import JobSpec
from .engine.request import SamplingParams
from .errors import InputError
from .io.sources import InputRows


@dataclass
class PreparedRows:
    # Row indexes to run, shortest prompt first.
    order: list[int]
    token_ids: dict[int, array]
    sampling: dict[int, SamplingParams]
    # Row index -> error message, for rows that never reach the engine.
    errors: dict[int, str]
    num_truncated: int = 0
    prompt_tokens: dict[int, int] = field(default_factory=dict)


def row_seed(job_seed: int, row_id: str) -> int:
    """A per-row seed from the job's seed and the row id: stable across runs and batches."""
    h = hashlib.blake2b(f"{job_seed}\x00{row_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


def base_sampling(spec: JobSpec) -> SamplingParams:
    s = spec.sampling
    return SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                          min_p=s.min_p, seed=s.seed, stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids),
                          ignore_eos=s.ignore_eos, n=s.n)


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


def build_texts(rows: InputRows, spec: JobSpec, tokenizer, chat: bool) -> tuple[dict[int, str], dict[int, str]]:
    """Row index -> text to tokenize (with special tokens already in it when templated), and errors."""
    texts: dict[int, str] = {}
    errors: dict[int, str] = {}
    system = spec.input.system_prompt
    col = spec.input.messages_column or spec.input.prompt_column
    for i in range(len(rows)):
        if i in rows.errors:
            errors[i] = rows.errors[i]
            continue
        if rows.messages is not None:
            msgs = rows.messages[i]
            err = _messages_error(msgs)
            if err:
                errors[i] = f"column {col!r}: {err}"
                continue
            msgs = [{"role": m["role"], "content": m["content"]} for m in msgs]
            if system and msgs[0]["role"] != "system":
                msgs = [{"role": "system", "content": system}] + msgs
        else:
            prompt = rows.prompts[i]
            if prompt is None or prompt.strip() == "":
                errors[i] = f"column {col!r}: prompt is {'null' if prompt is None else 'empty'}"
                continue
            if not chat:
                texts[i] = f"{system}\n\n{prompt}" if system else prompt
                continue
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        try:
            texts[i] = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template may raise on roles it does not know
            errors[i] = f"column {col!r}: chat template failed ({e})"
    return texts, errors


def row_sampling(rows: InputRows, spec: JobSpec, i: int, base: SamplingParams) -> SamplingParams | str:
    changes = {}
    for fld, values in rows.overrides.items():
        v = values[i]
        if v is None:
            continue
        if fld == "stop":
            changes["stop"] = tuple(v)
            continue
        col = spec.input.sampling_columns.get(fld, f"body.{fld}")
        try:
            changes[fld] = type(getattr(base, fld) if getattr(base, fld) is not None else 0)(v)
            SamplingCheck.check(fld, changes[fld])
        except ValueError as e:
            return f"column {col!r}: bad per-row {fld} {v!r} ({e})"
    sp = replace(base, **changes) if changes else base
    if sp.seed is not None and "seed" not in changes:
        sp = replace(sp, seed=row_seed(sp.seed, rows.ids[i]))
    return sp


class SamplingCheck:
    _rules = {"max_tokens": lambda v: v >= 1, "temperature": lambda v: v >= 0, "top_p": lambda v: 0 < v <= 1,
              "top_k": lambda v: v >= 0, "min_p": lambda v: 0 <= v <= 1, "seed": lambda v: True}

    @classmethod
    def check(cls, fld: str, v) -> None:
        if not cls._rules[fld](v):
            raise ValueError("out of range")


def prepare_rows(rows: InputRows, spec: JobSpec, tokenizer, max_model_len: int, skip: set[str] = frozenset(),
                 chunk: int = 512) -> PreparedRows:
    chat = use_chat_template(spec, tokenizer)
    texts, errors = build_texts(rows, spec, tokenizer, chat)
    for i in list(texts):
        if rows.ids[i] in skip:
            del texts[i]
    for i in list(errors):
        if rows.ids[i] in skip:
            del errors[i]
    base = base_sampling(spec)
    out = PreparedRows(order=[], token_ids={}, sampling={}, errors=errors)
    idx = sorted(texts)
    for start in range(0, len(idx), chunk):
        batch = idx[start : start + chunk]
        enc = tokenizer([texts[i] for i in batch], add_special_tokens=not chat)["input_ids"]
        for i, ids in zip(batch, enc):
            _admit_row(out, rows, spec, i, ids, base, max_model_len)
    out.order = length_sorted_prefix_groups(out.order, out.token_ids)
    return out


def length_sorted_prefix_groups(order: list[int], token_ids: dict[int, array], prefix: int = 128) -> list[int]:
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


def _admit_row(out: PreparedRows, rows: InputRows, spec: JobSpec, i: int, ids: list[int], base: SamplingParams,
               max_len: int) -> None:
    sp = row_sampling(rows, spec, i, base)
    if isinstance(sp, str):
        out.errors[i] = sp
        return
    if len(ids) >= max_len:
        if spec.on_too_long == "fail":
            raise InputError(f"{rows.where(i)}: prompt has {len(ids)} tokens, over the model's context of {max_len} "
                             "(on_too_long: fail). Use on_too_long: error or truncate_left to go on without it")
        if spec.on_too_long == "error":
            out.errors[i] = f"prompt has {len(ids)} tokens; the context holds {max_len} (on_too_long: error)"
            return
        keep = max(1, max_len - min(sp.max_tokens, max_len // 2))
        ids = ids[-keep:]
        out.num_truncated += 1
    if len(ids) + sp.max_tokens > max_len:
        # Like vLLM: generation stops at the context's end with finish_reason "length".
        sp = replace(sp, max_tokens=max_len - len(ids))
    out.token_ids[i] = array("i", ids)
    out.sampling[i] = sp
    out.prompt_tokens[i] = len(ids)
    out.order.append(i)
