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

import numpy as np

from .errors import ConfigError
from .io.rows import InputIndex


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


def _id_bucket(row_id, n: int) -> int:
    return int.from_bytes(hashlib.blake2b(str(row_id).encode(), digest_size=8).digest(), "little") % n


def select_shard(index: InputIndex, shard: tuple[int, int] | None) -> InputIndex:
    if shard is None:
        return index
    i, n = shard
    if len(index.shards) >= n:
        keep = np.flatnonzero(index.shard_of % n == i)
    else:
        keep = np.array([k for k, rid in enumerate(index.ids.to_pylist()) if _id_bucket(rid, n) == i], dtype=np.int64)
    return index.take(keep)


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


def task_sets(output_path: str) -> set[int]:
    """Task counts with committed output under output.path (1 for an unsharded run)."""
    root = Path(output_path)
    sets = {1} if (root / "_ledger").is_dir() else set()
    tasks = root / "tasks"
    if tasks.is_dir():
        sets |= {int(p.name.rsplit("-of-", 1)[1]) for p in tasks.iterdir()
                 if (p / "_ledger").is_dir() and "-of-" in p.name}
    return sets


def check_task_layout(output_path: str, shard: tuple[int, int] | None, restart: bool) -> None:
    """A run's task count must match the output's: task sets of two counts would each cover the
    whole input. With --restart, other counts' output is removed (unless one of them is running)."""
    from .errors import LockedError
    from .io.store import OutputStore

    n = shard[1] if shard else 1
    other = sorted(task_sets(output_path) - {n})
    if not other:
        return
    root = Path(output_path)
    if not restart:
        raise ConfigError(f"{output_path}: holds output of the same job split into {', '.join(map(str, other))} "
                          f"task(s); this run is {'task ' + f'{shard[0]}/{n}' if shard else 'unsharded'}. Run with "
                          f"the old count (--shard I/{other[0]}), or add --restart to discard that output and start "
                          f"over with {n}")
    stale = [r for r in all_roots(output_path) if (r == root and 1 in other) or
             (r != root and int(r.name.rsplit("-of-", 1)[1]) in other)]
    for r in stale:
        if OutputStore(r).is_locked():
            raise LockedError(f"{r}: a run of this job with another task count is running; not discarding it")
    import shutil

    for r in stale:
        if r == root:
            for sub in ("_ledger", "parts"):
                shutil.rmtree(root / sub, ignore_errors=True)
        else:
            shutil.rmtree(r, ignore_errors=True)
