"""OpenAI Batch API files: JSONL requests in, results and errors JSONL out.

A request line: {"custom_id": ..., "method": "POST", "url": "/v1/chat/completions",
"body": {"messages": [...], "max_tokens": N, "temperature": t, "top_p": p, "stop": s, "seed": k}}.
A malformed line becomes an error row naming its file and line number; the job goes on.
"""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from ..config import InputSpec
from ..errors import InputError
from .sources import InputRows, Shard, resolve_jsonl_paths, shard_names

_OVERRIDES = {"max_tokens": int, "temperature": float, "top_p": float, "seed": int}


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


def read_openai_batch(spec: InputSpec) -> InputRows:
    files = resolve_jsonl_paths(spec.paths)
    names = shard_names(files)
    rows = InputRows(shards=[], ids=[], shard_of=[], row_in_shard=[], prompts=None, messages=[])
    for fld in list(_OVERRIDES) + ["stop"]:
        rows.overrides[fld] = []
    seen: dict[str, str] = {}
    for si, (name, path) in enumerate(zip(names, files)):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"{path}: cannot read ({e})") from None
        count = 0
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {n}"
            cid, body = _parse_line(line, where)
            rid = cid if cid is not None else f"{name}:line{n}"
            if rid in seen:
                raise InputError(f"{where}: duplicate custom_id {rid!r} (first seen at {seen[rid]})")
            seen[rid] = where
            i = len(rows.ids)
            rows.ids.append(rid)
            rows.shard_of.append(si)
            rows.row_in_shard.append(n)
            if isinstance(body, str):
                rows.errors[i] = body
                body = {}
            rows.messages.append(body.get("messages"))
            for fld, typ in _OVERRIDES.items():
                v = body.get(fld, body.get("max_completion_tokens") if fld == "max_tokens" else None)
                try:
                    rows.overrides[fld].append(typ(v) if v is not None else None)
                except (TypeError, ValueError):
                    rows.overrides[fld].append(None)
                    rows.errors.setdefault(i, f"{where}: body.{fld} {v!r} is not a {typ.__name__}")
            stop = body.get("stop")
            if isinstance(stop, str):
                stop = [stop]
            if stop is not None and not (isinstance(stop, list) and all(isinstance(x, str) and x for x in stop)):
                rows.errors.setdefault(i, f"{where}: body.stop must be a string or a list of non-empty strings")
                stop = None
            rows.overrides["stop"].append(tuple(stop) if stop else None)
            count += 1
        rows.shards.append(Shard(name, str(path), count))
    return rows


def write_openai_results(part_files: list[Path], out_dir: Path, model_name: str) -> tuple[int, int]:
    """results.jsonl and errors.jsonl from the committed parts (atomically); returns their line counts."""
    from .store import atomic_write

    ok, bad = [], []
    for f in part_files:
        for r in pq.read_table(f).to_pylist():
            rid = r["id"]
            if r["error"] is None:
                body = {"object": "chat.completion", "model": model_name,
                        "choices": [{"index": r.get("sample_index") or 0, "finish_reason": r["finish_reason"],
                                     "message": {"role": "assistant", "content": r["text"]}}],
                        "usage": {"prompt_tokens": r["prompt_tokens"], "completion_tokens": r["completion_tokens"],
                                  "total_tokens": r["prompt_tokens"] + r["completion_tokens"]}}
                ok.append({"id": f"batch_req_{rid}", "custom_id": rid,
                           "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None})
            else:
                bad.append({"id": f"batch_req_{rid}", "custom_id": rid, "response": None,
                            "error": {"code": "invalid_request", "message": r["error"]}})

    def dump(records):
        return "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in records).encode()

    atomic_write(out_dir / "results.jsonl", lambda fh: fh.write(dump(ok)))
    atomic_write(out_dir / "errors.jsonl", lambda fh: fh.write(dump(bad)))
    return len(ok), len(bad)
