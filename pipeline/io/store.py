"""The output folder: immutable Parquet parts, a ledger of committed ids, a lock and the job's
fingerprint.

Layout of output.path:
  parts/part-000001.parquet ...   immutable once renamed into place
  _ledger/part-000001.json ...    {"parts": [...], "ids": [...]}, written after its part is durable
  _ledger/job.json                the fingerprint of the job that wrote the ledger
  .lock                           flock()ed by the running job; the kernel drops it if the job dies
  summary.json

An id is done exactly when a ledger entry lists it. A part without a ledger entry (a crash
between the two renames) is an orphan and is deleted on the next start, so every id ends up
in exactly one part.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import ConfigError, LockedError


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write) -> None:
    """write(file) into a temp file beside path, fsync, rename over path, fsync the folder."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_json(path: Path, data) -> None:
    atomic_write(path, lambda f: f.write(json.dumps(data, indent=1, sort_keys=True).encode()))


class OutputStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.parts = self.root / "parts"
        self.ledger = self.root / "_ledger"
        self._lock_fd: int | None = None
        self._next_part = 1

    # -- lock ------------------------------------------------------------------------------

    def acquire_lock(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            os.close(fd)
            raise LockedError(f"{self.root}: another batchgen run of this job is running ({holder or 'pid unknown'}); "
                              "not starting a second one") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0)
        self._lock_fd = fd

    def release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- ledger ----------------------------------------------------------------------------

    def entries(self) -> dict[str, dict]:
        if not self.ledger.is_dir():
            return {}
        out = {}
        for p in sorted(self.ledger.glob("part-*.json")) + sorted(self.ledger.glob("final-*.json")):
            out[p.name] = json.loads(p.read_text())
        return out

    def fingerprint(self) -> dict | None:
        p = self.ledger / "job.json"
        return json.loads(p.read_text())["fingerprint"] if p.exists() else None

    def open(self, fingerprint: dict, restart: bool) -> set[str]:
        """Check the fingerprint, tidy up after a crash and return the ids already done."""
        if restart and self.root.exists():
            for sub in (self.parts, self.ledger):
                shutil.rmtree(sub, ignore_errors=True)
            (self.root / "summary.json").unlink(missing_ok=True)
        old = self.fingerprint()
        if old is not None and old != fingerprint:
            changed = sorted(k for k in set(old) | set(fingerprint) if old.get(k) != fingerprint.get(k))
            raise ConfigError(f"{self.root}: holds output of a different job (changed: {', '.join(changed)}); "
                              "rerun with --restart to discard it, or choose another output.path")
        self.parts.mkdir(parents=True, exist_ok=True)
        self.ledger.mkdir(parents=True, exist_ok=True)
        if old is None:
            atomic_write_json(self.ledger / "job.json", {"fingerprint": fingerprint})
        self._finish_compaction()
        entries = self.entries()
        referenced = {p for e in entries.values() for p in e["parts"]}
        for f in list(self.parts.iterdir()) + list(self.ledger.glob(".*.tmp-*")):
            if f.name not in referenced and f.parent == self.parts or f.name.startswith("."):
                f.unlink()  # orphan part or temp file from a killed run: its ids are not done
        done: set[str] = set()
        for name, e in entries.items():
            done.update(e["ids"])
        nums = [int(n.split("-")[1].split(".")[0]) for n in entries if n.startswith("part-")]
        self._next_part = max(nums, default=0) + 1
        return done

    def commit(self, table: pa.Table, ids: list[str]) -> str:
        """Write one part durably, then record its ids as done."""
        name = f"part-{self._next_part:06d}"
        self._next_part += 1
        atomic_write(self.parts / f"{name}.parquet", lambda f: pq.write_table(table, f))
        atomic_write_json(self.ledger / f"{name}.json", {"parts": [f"{name}.parquet"], "ids": ids})
        return name

    # -- compaction (output.order: input) --------------------------------------------------

    def compact(self, row_order, rows_per_part: int) -> None:
        """Rewrite all parts in the order row_order(table) gives (a list of row indices).
        Crash-safe: the new ledger entry names the entries it replaces, and whoever opens the
        store next finishes the swap."""
        entries = self.entries()
        if not entries or (len(entries) == 1 and next(iter(entries)).startswith("final-")):
            return
        table = pa.concat_tables([pq.read_table(self.parts / p) for e in entries.values() for p in e["parts"]],
                                 promote_options="default")
        table = table.take(pa.array(row_order(table), type=pa.int64()))
        parts = []
        for k, start in enumerate(range(0, max(table.num_rows, 1), rows_per_part)):
            name = f"final-{k + 1:06d}.parquet"
            chunk = table.slice(start, rows_per_part)
            atomic_write(self.parts / name, lambda f, c=chunk: pq.write_table(c, f))
            parts.append(name)
        ids = list(dict.fromkeys(table.column("id").to_pylist()))
        atomic_write_json(self.ledger / "final-000001.json", {"parts": parts, "ids": ids, "replaces": sorted(entries)})
        self._finish_compaction()

    def _finish_compaction(self) -> None:
        final = self.ledger / "final-000001.json"
        if not final.exists():
            for f in self.parts.glob("final-*.parquet"):
                f.unlink()  # an unfinished compaction: its parts are not in any ledger entry
            return
        entry = json.loads(final.read_text())
        for name in entry.get("replaces", []):
            old = self.ledger / name
            if old.exists():
                for p in json.loads(old.read_text())["parts"]:
                    (self.parts / p).unlink(missing_ok=True)
                old.unlink()
        fsync_dir(self.ledger)

    def part_files(self) -> list[Path]:
        return [self.parts / p for e in self.entries().values() for p in e["parts"]]
