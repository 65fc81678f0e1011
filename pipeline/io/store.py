"""The output folder: immutable Parquet parts, a ledger of committed ids, a lock and the job's
fingerprint.

Layout of output.path:
  parts/part-000001.parquet ...   immutable once renamed into place
  _ledger/part-000001.json ...    {"parts", "files": {name: {bytes, sha256}}, "ids", "pos", "shards"},
                                  written after its part is durable
  _ledger/job.json                the fingerprint of the job that wrote the ledger
  .lock                           flock()ed by the running job; the kernel drops it if the job dies
  summary.json

An id is done exactly when a ledger entry lists it and the entry's parts are whole (their size
is checked on every start, their SHA-256 on merge and on request). A part without a ledger
entry (a crash between the two renames), a broken entry or a damaged part is dropped with one
line saying so, and its ids are generated again, so every id ends up in exactly one part.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..digest import file_sha256
from ..errors import ConfigError, DiskFullError, LockedError, OutputError

log = logging.getLogger("batchgen")

_FULL = (errno.ENOSPC, errno.EDQUOT)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write) -> None:
    """write(file) into a temp file beside path, fsync, rename over path, fsync the folder.
    The temp file is removed when anything fails."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, data) -> None:
    atomic_write(path, lambda f: f.write(json.dumps(data, indent=1, sort_keys=True).encode()))


def write_error(err: OSError, path: Path, kept: str) -> Exception:
    """One-line error for a failed write: its own exit code for a full disk or quota."""
    what = os.strerror(err.errno) if err.errno else str(err)
    if err.errno in _FULL:
        return DiskFullError(f"{path}: {what.lower()} while writing; {kept}. Free space (or raise the quota) and "
                             "rerun the same command to resume")
    return OutputError(f"{path}: cannot write ({what}); {kept}")


@dataclass
class LedgerEntry:
    name: str
    parts: list[str]
    # part file name -> {"bytes": size, "sha256": hex digest}
    files: dict
    # The ids done and each one's position in the job's input index (input order); None when
    # loaded light (only `rows` kept: status and checks of a 10M-row job need no ids in memory).
    ids: list | None
    pos: list | None
    # Rows per input shard.
    shards: dict
    rows: int = 0

    @classmethod
    def load(cls, path: Path, light: bool = False) -> "LedgerEntry":
        d = json.loads(path.read_text())
        ids, pos = list(d["ids"]), list(d.get("pos", []))
        return cls(path.name, list(d["parts"]), dict(d.get("files", {})), None if light else ids,
                   None if light else pos, dict(d.get("shards", {})), len(ids))

    def dump(self) -> dict:
        return {"parts": self.parts, "files": self.files, "ids": self.ids, "pos": self.pos, "shards": self.shards}


class OutputStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.parts = self.root / "parts"
        self.ledger = self.root / "_ledger"
        self._lock_fd: int | None = None
        self._next_part = 1
        self.rows_committed = 0
        # One line per entry dropped by the last open(): a damaged, missing or unreadable part.
        self.dropped: list[str] = []

    # -- lock ------------------------------------------------------------------------------

    def acquire_lock(self) -> None:
        """Create the folder and take its lock; an unusable path is one line naming it."""
        try:
            if self.root.exists() and not self.root.is_dir():
                raise OutputError(f"output.path: {self.root} exists and is not a folder; choose another output.path")
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except FileExistsError:
            raise OutputError(f"output.path: {self.root} (or a folder above it) is a file; choose another "
                              "output.path") from None
        except NotADirectoryError:
            raise OutputError(f"output.path: a part of {self.root} is a file, not a folder; choose another "
                              "output.path") from None
        except OSError as e:
            raise write_error(e, self.root, "nothing was written") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            os.close(fd)
            raise LockedError(f"{self.root}: another batchgen run of this job is running ({holder or 'pid unknown'}); "
                              "not starting a second one") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0)
        except OSError as e:
            os.close(fd)
            raise write_error(e, self.root / ".lock", "nothing was written") from None
        self._lock_fd = fd

    def release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def is_locked(self) -> bool:
        """Whether a run holds this store's lock now (without taking it)."""
        lock = self.root / ".lock"
        if not lock.exists():
            return False
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def check_free_space(self, part_bytes: int) -> None:
        """Refuse before the model loads when the disk cannot take a part (and its temp copy)."""
        free = shutil.disk_usage(self.root).free
        if free < 2 * part_bytes:
            raise DiskFullError(f"{self.root}: only {free / 2**20:.1f} MiB free; a part of this job needs about "
                                f"{part_bytes / 2**20:.1f} MiB. Free space or choose another output.path")

    # -- ledger ----------------------------------------------------------------------------

    def _entry_paths(self) -> list[Path]:
        if not self.ledger.is_dir():
            return []
        return sorted(self.ledger.glob("part-*.json")) + sorted(self.ledger.glob("final-*.json"))

    def _load_entries(self, light: bool = False) -> tuple[dict[str, LedgerEntry], list[str]]:
        """The readable entries by file name, and one line per unreadable one. An entry that
        vanished while being read (a running compaction replaced it) is skipped."""
        out, problems = {}, []
        for p in self._entry_paths():
            try:
                out[p.name] = LedgerEntry.load(p, light)
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError) as e:
                problems.append(f"{p}: unreadable ledger entry ({type(e).__name__}: {e}): its rows count as not done")
        return out, problems

    def entries(self, strict: bool = False, light: bool = False) -> dict[str, LedgerEntry]:
        """The ledger's readable entries; with strict, an unreadable one is a ConfigError."""
        out, problems = self._load_entries(light)
        if strict and problems:
            raise ConfigError(problems[0])
        return out

    def fingerprint(self) -> dict | None:
        p = self.ledger / "job.json"
        if not p.exists():
            return None
        try:
            return json.loads(p.read_text())["fingerprint"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{p}: unreadable ({type(e).__name__}: {e}); the job's fingerprint cannot be checked, "
                              "so nothing will be resumed: rerun with --restart to discard this output, or restore "
                              "the file") from None

    def open(self, fingerprint: dict, restart: bool, id_type: pa.DataType = pa.large_string()) -> pa.Array:
        """Check the fingerprint, tidy up after a crash, verify the parts' sizes and return the ids
        already done (as id_type)."""
        try:
            if restart:
                self._discard()
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
            entries, problems = self.audit(checksum=False)
            for name in set(self.entries_on_disk()) - set(entries):
                (self.ledger / name).unlink()  # its ids are not done; its part is an orphan now
            self.dropped = [f"{p}: they will be generated again" for p in problems]
            self._remove_orphans(entries)
        except OSError as e:
            raise write_error(e, self.root, "no row was lost") from None
        for line in self.dropped:
            log.warning("%s", line)
        nums = [int(n.split("-")[1].split(".")[0]) for n in entries if n.startswith("part-")]
        self._next_part = max(nums, default=0) + 1
        return self.ids_array(entries, id_type)

    def _discard(self) -> None:
        """--restart: the ledger is moved aside in one rename first, so a kill at any later point
        leaves no entry pointing at a deleted part; then everything goes at leisure."""
        if self.ledger.exists():
            aside = self.root / f".discarded-ledger-{os.getpid()}-{time.time_ns()}"
            os.rename(self.ledger, aside)
            fsync_dir(self.root)
        shutil.rmtree(self.parts, ignore_errors=True)
        for p in self.root.glob(".discarded-ledger-*"):
            shutil.rmtree(p, ignore_errors=True)
        for name in ("summary.json", "results.jsonl", "errors.jsonl"):
            (self.root / name).unlink(missing_ok=True)

    def _check_entry(self, e: LedgerEntry, checksum: bool) -> str | None:
        """What is wrong with an entry's parts, or None. Size always; SHA-256 with checksum."""
        for name in e.parts:
            p = self.parts / name
            want = e.files.get(name, {})
            try:
                size = p.stat().st_size
            except FileNotFoundError:
                return f"{p}: missing (listed in {self.ledger / e.name})"
            if "bytes" in want and size != want["bytes"]:
                return f"{p}: {size} bytes, but {self.ledger / e.name} recorded {want['bytes']} (damaged)"
            if checksum and "sha256" in want and file_sha256(p) != want["sha256"]:
                return f"{p}: its SHA-256 differs from the one {self.ledger / e.name} recorded (damaged)"
        return None

    def audit(self, checksum: bool = False, light: bool = True) -> tuple[dict[str, LedgerEntry], list[str]]:
        """The entries whose parts are whole, and one line per problem: an unreadable entry, a
        missing or damaged part (sizes always, SHA-256 with checksum). Changes nothing."""
        entries, problems = self._load_entries(light)
        good = {}
        for name, e in entries.items():
            problem = self._check_entry(e, checksum)
            if problem:
                problems.append(f"{problem}: its {e.rows} rows count as not done")
            else:
                good[name] = e
        return good, problems

    def read_entry(self, name: str) -> LedgerEntry:
        """One entry with its ids and positions."""
        return LedgerEntry.load(self.ledger / name)

    def ids_array(self, entries, id_type: pa.DataType) -> pa.Array:
        """The ids of the given entries as one Arrow array, read an entry at a time."""
        arrays = [pa.array(self.read_entry(name).ids, type=id_type) for name in entries]
        return pa.concat_arrays(arrays) if arrays else pa.array([], type=id_type)

    def entries_on_disk(self) -> list[str]:
        return [p.name for p in self._entry_paths()]

    def _remove_orphans(self, entries: dict[str, LedgerEntry]) -> None:
        """Parts no entry lists (a crash between the two renames) and temp files of killed runs."""
        referenced = {p for e in entries.values() for p in e.parts}
        for f in list(self.parts.iterdir()):
            if f.name not in referenced:
                f.unlink()
        for d in (self.ledger, self.root):
            for f in d.glob(".*.tmp-*"):
                if f.is_dir():
                    shutil.rmtree(f, ignore_errors=True)  # a killed compaction's or merge's runs
                else:
                    f.unlink()

    def _write_part(self, name: str, table: pa.Table, ids: list, pos: list, shards: dict) -> LedgerEntry:
        """The part file, durable, and its (not yet written) ledger entry with size and checksum."""
        part = self.parts / f"{name}.parquet"
        atomic_write(part, lambda f: pq.write_table(table, f))
        files = {part.name: {"bytes": part.stat().st_size, "sha256": file_sha256(part)}}
        return LedgerEntry(f"{name}.json", [part.name], files, ids, pos, shards)

    def commit(self, table: pa.Table, ids: list, pos: list, shards: dict) -> str:
        """Write one part durably, then record its ids as done."""
        name = f"part-{self._next_part:06d}"
        self._next_part += 1
        try:
            entry = self._write_part(name, table, ids, pos, shards)
            atomic_write_json(self.ledger / entry.name, entry.dump())
        except OSError as e:
            (self.parts / f"{name}.parquet").unlink(missing_ok=True)
            raise write_error(e, self.parts / f"{name}.parquet",
                              f"{self.rows_committed} rows committed by this run before it are kept") from None
        self.rows_committed += len(ids)
        return name

    # -- compaction (output.order: input) --------------------------------------------------

    def write_finals(self, tables, replaces: list[str]) -> None:
        """Replace the entries `replaces` with final-*.parquet parts holding the tables
        ((table, ids, pos, shards) in order). Crash-safe: the finals' entries are staged, and one
        atomic compaction.json makes the swap; whoever opens the store next finishes it."""
        staged = []
        first = max((int(p.stem.split("-")[1]) for p in self.parts.glob("final-*.parquet")), default=0) + 1
        for k, (table, ids, pos, shards) in enumerate(tables):
            entry = self._write_part(f"final-{first + k:06d}", table, ids, pos, shards)
            atomic_write_json(self.ledger / f".staged-{entry.name}", entry.dump())
            staged.append(entry.name)
        atomic_write_json(self.ledger / "compaction.json", {"finals": staged, "replaces": sorted(replaces)})
        self._finish_compaction()

    def _finish_compaction(self) -> None:
        marker = self.ledger / "compaction.json"
        if not marker.exists():
            # An unfinished compaction: its finals are in no entry.
            for f in self.ledger.glob(".staged-*.json"):
                f.unlink()
            listed = {p for e in self.entries().values() for p in e.parts}
            for f in self.parts.glob("final-*.parquet"):
                if f.name not in listed:
                    f.unlink()
            return
        swap = json.loads(marker.read_text())
        for name in swap["replaces"]:
            old = self.ledger / name
            if old.exists():
                for p in json.loads(old.read_text())["parts"]:
                    (self.parts / p).unlink(missing_ok=True)
                old.unlink()
        for name in swap["finals"]:
            staged = self.ledger / f".staged-{name}"
            if staged.exists():
                os.replace(staged, self.ledger / name)
        fsync_dir(self.ledger)
        marker.unlink()
        fsync_dir(self.ledger)

    def part_files(self) -> list[Path]:
        return [self.parts / p for e in self.entries().values() for p in e.parts]
