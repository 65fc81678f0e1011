"""`batchgen status`: rows done per input shard over all tasks, from the ledgers and the input's
metadata (no prompt is read, no model loaded, no lock taken: it may run beside a job)."""
from __future__ import annotations

import json
from pathlib import Path

from ..config import JobSpec
from ..errors import ConfigError
from ..io.store import OutputStore
from ..shard import all_roots, task_sets
from .prepare import prepare_job


def job_status(spec: JobSpec, verify: bool = False) -> dict:
    """Per-shard done/total, and every problem found in the output (a broken job.json or ledger
    entry, a missing or damaged part: sizes always, SHA-256 checksums with verify)."""
    job = prepare_job(spec, index=False, model=False)
    done_by_shard: dict[str, int] = {}
    problems: list[str] = []
    for root in all_roots(spec.output.path):
        store = OutputStore(root)
        try:
            store.fingerprint()
        except ConfigError as e:
            problems.append(str(e))
        entries, found = store.audit(checksum=verify)
        problems.extend(found)
        for e in entries.values():
            for name, count in e.shards.items():
                done_by_shard[name] = done_by_shard.get(name, 0) + count
    sets = task_sets(spec.output.path)
    if len(sets) > 1:
        problems.append(f"{spec.output.path}: holds task sets of {', '.join(map(str, sorted(sets)))} tasks; only one "
                        "can be merged: rerun with --restart and one --shard count")
    per_shard = [{"shard": s.name, "path": s.path, "rows": s.num_rows, "done": done_by_shard.get(s.name, 0)}
                 for s in job.source.shards]
    summary_path = Path(spec.output.path) / "summary.json"
    try:
        last = json.loads(summary_path.read_text()) if summary_path.exists() else None
    except (OSError, ValueError):
        last = None
        problems.append(f"{summary_path}: unreadable (the next run rewrites it)")
    tasks = [str(r) for r in all_roots(spec.output.path) if r != Path(spec.output.path)]
    return {"output": spec.output.path, "rows": sum(s["rows"] for s in per_shard),
            "done": sum(s["done"] for s in per_shard), "shards": per_shard, "tasks": tasks,
            "problems": problems, "last_summary": last}


def count_done(output_path: str) -> int:
    """Rows committed under output.path, over every task (ledgers only)."""
    return sum(e.rows for r in all_roots(output_path) for e in OutputStore(r).entries(light=True).values())
