"""OpenAI Batch API files: JSONL requests in, results and errors JSONL out.

A request line: {"custom_id": ..., "method": "POST", "url": "/v1/chat/completions",
"body": {"model": ..., "messages": [...], "max_tokens": N, "temperature": t, "top_p": p, "stop": s,
"seed": k, "n": n, "logprobs": true, "top_logprobs": k, "response_format": {...}}}.
A malformed line, or a body field we would not honour, becomes an error row naming its file,
line and field; the job goes on.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..config import InputSpec
from ..errors import InputError
from .rows import InputIndex, RowWindow, Shard, build_index, resolve_paths, shard_names

# body field -> (sampling field, type) honoured per row.
_OVERRIDES = {"max_tokens": ("max_tokens", int), "max_completion_tokens": ("max_tokens", int),
              "temperature": ("temperature", float), "top_p": ("top_p", float), "seed": ("seed", int),
              "n": ("n", int)}
# Fields that do not change what is generated: the job's model answers whatever `model` names.
_INFORMATIONAL = {"model", "user", "metadata", "store", "service_tier"}
# Fields accepted at their neutral value only.
_NEUTRAL = {"frequency_penalty": (0, 0.0, None), "presence_penalty": (0, 0.0, None), "logit_bias": (None,),
            "stream": (False, None), "parallel_tool_calls": (None,), "stream_options": (None,)}
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "n", "logprobs", "stop", "response_format")


def _parse_line(line: str, where: str) -> tuple[str | None, dict | str]:
    """(custom_id or None, body dict or an error message)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return None, f"{where}: not valid JSON ({e.msg} at column {e.colno})"
    if not isinstance(obj, dict):
        return None, f"{where}: a request must be a JSON object"
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return None, f"{where}: custom_id must be a non-empty string"
    body = obj.get("body")
    if not isinstance(body, dict):
        return cid, f"{where}: body must be an object"
    if "messages" not in body:
        return cid, f"{where}: body.messages is missing (only chat completions are supported)"
    return cid, body


def _text_content(content, where: str, j: int):
    """A message's content as one string: a string, or a list of {type: text, text} parts
    (joined by newlines, as vLLM does). Other part types are refused."""
    if isinstance(content, str) or content is None:
        return content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{where}: body.messages[{j}].content[{k}] has type {kind!r}; only text parts "
                                 "are supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"{where}: body.messages[{j}].content must be a string or a list of text parts")


def parse_body(body: dict, where: str) -> tuple[list | None, dict]:
    """(messages, sampling overrides) of one request body; ValueError names a field we cannot honour."""
    for key, value in body.items():
        if key in _OVERRIDES or key in _INFORMATIONAL or key in ("messages", "stop", "logprobs", "top_logprobs",
                                                                   "response_format"):
            continue
        if key in _NEUTRAL and (value == {} if isinstance(value, dict) else value in _NEUTRAL[key]):
            continue
        raise ValueError(f"{where}: body.{key} is not supported (batchgen honours messages, "
                         f"{', '.join(sorted(set(_OVERRIDES) | {'stop', 'logprobs', 'top_logprobs', 'response_format'}))})")
    msgs = body.get("messages")
    if isinstance(msgs, list):
        msgs = [dict(m, content=_text_content(m.get("content"), where, j)) if isinstance(m, dict) else m
                for j, m in enumerate(msgs)]
    out: dict = {}
    for key, (fld, typ) in _OVERRIDES.items():
        v = body.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (typ is int and float(v) != int(v)):
            raise ValueError(f"{where}: body.{key} {v!r} is not {'an integer' if typ is int else 'a number'}")
        out[fld] = typ(v)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not (isinstance(stop, list) and all(isinstance(x, str) and x for x in stop)):
            raise ValueError(f"{where}: body.stop must be a string or a list of non-empty strings")
        out["stop"] = tuple(stop)
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if lp not in (None, True, False):
        raise ValueError(f"{where}: body.logprobs must be true or false")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)):
        raise ValueError(f"{where}: body.top_logprobs {top!r} is not an integer")
    if top is not None and not lp:
        raise ValueError(f"{where}: body.top_logprobs needs body.logprobs: true")
    if lp:
        out["logprobs"] = top or 0
    fmt = body.get("response_format")
    if fmt is not None:
        fmt = openai_response_format(fmt, where)
        if fmt is not None:
            out["response_format"] = fmt
    return msgs, out


def openai_response_format(fmt, where: str) -> dict | None:
    """OpenAI's response_format as ours: {type: text} is none, {type: json_object} stays, and
    {type: json_schema, json_schema: {name, schema, strict}} becomes {type: json_schema, schema}."""
    if not isinstance(fmt, dict) or "type" not in fmt:
        raise ValueError(f"{where}: body.response_format must be an object with a type")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError(f"{where}: body.response_format.json_schema.schema must be a JSON schema object")
        return {"type": "json_schema", "schema": spec["schema"]}
    raise ValueError(f"{where}: body.response_format.type {kind!r} is not one of text, json_object, json_schema")


class OpenAIBatchSource:
    """One shard per JSONL file; a row per non-empty line (its line number is its row)."""

    def __init__(self, spec: InputSpec) -> None:
        self.spec = spec
        self.files = resolve_jsonl_paths(spec.paths)
        self.names = shard_names(self.files)
        self.passthrough_types: dict[str, pa.DataType] = {}
        self._lines: list[list[int]] = []
        self.shards: list[Shard] = []
        self._ids: list[list[str]] = []
        for name, path in zip(self.names, self.files):
            lines, ids = [], []
            for n, line in self._read(path):
                cid, _ = _parse_line(line, "")
                lines.append(n)
                ids.append(cid if cid is not None else f"{name}:line{n}")
            self._lines.append(lines)
            self._ids.append(ids)
            self.shards.append(Shard(name, str(path), len(lines)))

    @staticmethod
    def _read(path: Path) -> Iterator[tuple[int, str]]:
        try:
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, start=1):
                    if line.strip():
                        yield n, line
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"{path}: cannot read ({e})") from None

    def index(self) -> InputIndex:
        arrays = [pa.array(ids, type=pa.large_string()) for ids in self._ids]
        index = build_index(self.shards, arrays, "custom_id")
        # Rows are named by their line numbers.
        index.row_in_shard = np.concatenate([np.array(ls, dtype=np.int64) for ls in self._lines]) if self._lines \
            else np.zeros(0, np.int64)
        return index

    def windows(self, index: InputIndex, keep: np.ndarray, window_rows: int) -> Iterator[RowWindow]:
        win = self._new()
        wanted = {}
        for p in keep.tolist():
            wanted.setdefault(int(index.shard_of[p]), {})[int(index.row_in_shard[p])] = p
        for si, path in enumerate(self.files):
            lines = wanted.get(si)
            if not lines:
                continue
            for n, line in self._read(path):
                p = lines.get(n)
                if p is None:
                    continue
                self._add(win, p, index.ids[p].as_py(), si, line, f"{path}, line {n}")
                if len(win) >= window_rows:
                    yield win
                    win = self._new()
        if len(win):
            yield win

    @staticmethod
    def _new() -> RowWindow:
        return RowWindow(pos=[], ids=[], shard=[], messages=[], overrides={f: [] for f in _SAMPLING_FIELDS})

    @staticmethod
    def _add(win: RowWindow, pos: int, rid: str, shard: int, line: str, where: str) -> None:
        k = len(win.pos)
        win.pos.append(pos)
        win.ids.append(rid)
        win.shard.append(shard)
        _, body = _parse_line(line, where)
        msgs, over = None, {}
        if isinstance(body, str):
            win.errors[k] = body
        else:
            try:
                msgs, over = parse_body(body, where)
            except ValueError as e:
                win.errors[k] = str(e)
        win.messages.append(msgs)
        for f in _SAMPLING_FIELDS:
            win.overrides[f].append(over.get(f))


def resolve_jsonl_paths(paths: list[str]) -> list[Path]:
    return resolve_paths(paths, suffix=".jsonl")


def _logprobs_content(entries) -> list[dict] | None:
    """Our logprobs column ([{token, token_id, logprob, top: [...]}]) in OpenAI's shape."""
    if entries is None:
        return None
    return [{"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode("utf-8")),
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": list(t["token"].encode("utf-8"))}
                              for t in (e.get("top") or [])]} for e in entries]


def _request_records(rows: list[dict], model_name: str) -> Iterator[tuple[bool, dict]]:
    """(ok, record) per request id of one part's rows (all samples of an id sit in one part)."""
    by_id: dict = {}
    for r in rows:
        by_id.setdefault(r["id"], []).append(r)
    for rid, samples in by_id.items():
        failed = next((r for r in samples if r["error"] is not None), None)
        if failed is not None:
            yield False, {"id": f"batch_req_{rid}", "custom_id": rid, "response": None,
                          "error": {"code": "invalid_request", "message": failed["error"]}}
            continue
        choices = []
        for r in sorted(samples, key=lambda r: r.get("sample_index") or 0):
            choice = {"index": r.get("sample_index") or 0, "finish_reason": r["finish_reason"],
                      "message": {"role": "assistant", "content": r["text"]}}
            if "logprobs" in r:
                choice["logprobs"] = {"content": _logprobs_content(r["logprobs"])} if r["logprobs"] is not None else None
            choices.append(choice)
        prompt = samples[0]["prompt_tokens"]
        completion = sum(r["completion_tokens"] for r in samples)
        body = {"object": "chat.completion", "model": model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}
        yield True, {"id": f"batch_req_{rid}", "custom_id": rid,
                     "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}


def write_openai_results(part_files: list[Path], out_dir: Path, model_name: str) -> tuple[int, int]:
    """results.jsonl and errors.jsonl from the committed parts (atomically, a part at a time),
    one line per request with all its choices; returns their line counts."""
    from .store import atomic_write

    counts = [0, 0]

    def write(ok: bool):
        def go(fh):
            for f in part_files:
                for good, rec in _request_records(pq.read_table(f).to_pylist(), model_name):
                    if good == ok:
                        fh.write((json.dumps(rec, ensure_ascii=False) + "\n").encode())
                        counts[0 if ok else 1] += 1
        return go

    atomic_write(out_dir / "results.jsonl", write(True))
    atomic_write(out_dir / "errors.jsonl", write(False))
    return counts[0], counts[1]
