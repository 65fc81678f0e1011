"""Splitting a job across Slurm array tasks or data-parallel workers.

Task I of N takes input files I, I+N, I+2N, ... when there are at least N files, and otherwise
the rows whose id hashes to I mod N. Either way the subsets are disjoint, cover the input, and
do not change between runs. Each task writes its own parts, ledger and lock under
output.path/tasks/task-I-of-N, so tasks never contend; `batchgen status` and `batchgen merge`
read them all.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .errors import ConfigError
from .io.sources import InputRows


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """'I/N' (0-based I), or the Slurm array variables, or None for an unsharded run."""
    if text:
        try:
            i, n = (int(x) for x in text.split("/"))
        except ValueError:
            raise ConfigError(f"--shard {text!r}: expected I/N, e.g. 0/4") from None
        if not 0 <= i < n:
            raise ConfigError(f"--shard {text!r}: I must be in 0..N-1")
        return (i, n) if n > 1 else None
    if "SLURM_ARRAY_TASK_ID" in os.environ and "SLURM_ARRAY_TASK_COUNT" in os.environ:
        task = int(os.environ["SLURM_ARRAY_TASK_ID"]) - int(os.environ.get("SLURM_ARRAY_TASK_MIN", "0"))
        n = int(os.environ["SLURM_ARRAY_TASK_COUNT"])
        if not 0 <= task < n:
            raise ConfigError(f"SLURM_ARRAY_TASK_ID {os.environ['SLURM_ARRAY_TASK_ID']} is outside the array "
                              f"(min {os.environ.get('SLURM_ARRAY_TASK_MIN', '0')}, count {n})")
        return (task, n) if n > 1 else None
    return None


def _id_bucket(row_id: str, n: int) -> int:
    return int.from_bytes(hashlib.blake2b(row_id.encode(), digest_size=8).digest(), "little") % n


def select_shard(rows: InputRows, shard: tuple[int, int] | None) -> InputRows:
    if shard is None:
        return rows
    i, n = shard
    if len(rows.shards) >= n:
        keep = [r for r, s in enumerate(rows.shard_of) if s % n == i]
    else:
        keep = [r for r, rid in enumerate(rows.ids) if _id_bucket(rid, n) == i]
    return rows.subset(keep)


def task_root(output_path: str, shard: tuple[int, int] | None) -> Path:
    if shard is None:
        return Path(output_path)
    i, n = shard
    return Path(output_path) / "tasks" / f"task-{i:04d}-of-{n:04d}"


def all_roots(output_path: str) -> list[Path]:
    """The unsharded store (if any) and every task's store under output.path."""
    root = Path(output_path)
    roots = [root] if (root / "_ledger").is_dir() else []
    tasks = root / "tasks"
    if tasks.is_dir():
        roots += sorted(p for p in tasks.iterdir() if (p / "_ledger").is_dir())
    return roots
