"""Nothing lost in any phase: signals during preparation, a kill during --restart, damaged parts
and ledger entries, a full disk, task-count changes, merge beside a running job, fingerprints."""
import errno
import json
import os
import shutil
import signal
import time

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.config import load_job
from batchgen.errors import ConfigError, Interrupted
from batchgen.io.store import OutputStore
from helpers import read_output, write_job, write_prompts

runner = CliRunner()


def cli(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def job(tmp_path, tiny_model_dir):
    inp = write_prompts(tmp_path / "in.parquet", n=12)
    return write_job(tmp_path, tiny_model_dir, inp)


def _ids(out):
    df = read_output(out)
    return [] if df is None else df["id"].to_list()


def _assert_exactly_once(out, n=12):
    ids = _ids(out)
    assert sorted(ids) == [f"r{i:04d}" for i in range(n)] and len(ids) == len(set(ids))


def _signal_on_call(monkeypatch, owner, name, signum=signal.SIGTERM):
    """Deliver signum to this process inside the first call of owner.name (in whatever thread runs it)."""
    real = getattr(owner, name)
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            os.kill(os.getpid(), signum)
            time.sleep(0.05)  # the handler runs in the main thread at its next bytecode
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)
    return calls


@pytest.mark.parametrize("point", ["index", "template", "tokenize", "load"])
def test_a_signal_during_preparation_stops_cleanly_and_commits_no_row(job, tmp_path, monkeypatch, point):
    """The handler only records the signal: wherever it lands while reading, templating,
    tokenizing (in the background thread) or loading, no row becomes an error row; the run stops
    with 75 before generating, and the rerun does every row."""
    from batchgen.io import sources
    from batchgen.job import prepare, run

    spec = load_job(job)
    owner, name = {"index": (sources.ParquetSource, "index"), "template": (prepare.TextEncoder, "render"),
                   "tokenize": (prepare.Preparer, "prepare"), "load": (run, "load_engine")}[point]
    calls = _signal_on_call(monkeypatch, owner, name)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted, match="before any row was generated"):
        run.run_job(spec)
    assert calls and signal.getsignal(signal.SIGTERM) is before
    assert _ids(tmp_path / "out") == []
    monkeypatch.undo()
    summary = run.run_job(spec)
    assert summary["rows_ok"] == 12 and summary["rows_error"] == 0
    _assert_exactly_once(tmp_path / "out")


def test_a_kill_between_the_deletions_of_a_restart_loses_no_id(job, tmp_path, monkeypatch):
    """--restart moves the ledger aside before deleting anything, so a kill after the first
    deletion leaves no ledger entry pointing at a deleted part."""
    from batchgen.io import store as store_mod

    assert cli("run", job).exit_code == 0
    real = shutil.rmtree

    class Killed(BaseException):
        pass

    def killed_after_first(path, *a, **k):
        real(path, *a, **k)
        raise Killed

    monkeypatch.setattr(store_mod.shutil, "rmtree", killed_after_first)
    with pytest.raises(Killed):
        cli("run", job, "--restart")
    monkeypatch.undo()
    r = cli("status", job)
    assert "total: 0/12" in r.output, r.output
    r = cli("run", job)
    assert r.exit_code == 0 and "12 ok" in r.output, r.output
    _assert_exactly_once(tmp_path / "out")


def _a_part(out):
    return sorted((out / "parts").glob("part-*.parquet"))[0]


def test_a_truncated_part_is_found_reported_and_regenerated(job, tmp_path):
    out = tmp_path / "out"
    assert cli("run", job).exit_code == 0
    part = _a_part(out)
    rows = pq.read_table(part).num_rows
    part.write_bytes(part.read_bytes()[:-50])
    r = cli("status", job)
    assert r.exit_code == 1 and f"{part}:" in r.output and "recorded" in r.output and f"total: {12 - rows}/12" in r.output
    r = cli("validate", job, "--outputs")
    assert r.exit_code == 1 and f"output problem: {part}" in r.output
    r = cli("merge", job)
    assert r.exit_code == 1 and f"cannot merge: {part}" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["run", str(job)])
    assert r.exit_code == 0 and f"{rows} ok" in r.output
    _assert_exactly_once(out)
    assert cli("merge", job).exit_code == 0


def test_a_part_damaged_in_place_fails_its_checksum(job, tmp_path):
    out = tmp_path / "out"
    assert cli("run", job).exit_code == 0
    part = _a_part(out)
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the SHA-256 tells
    part.write_bytes(bytes(data))
    assert cli("status", job).exit_code == 0, "sizes are checked always, checksums on request"
    r = cli("status", job, "--verify")
    assert r.exit_code == 1 and "SHA-256 differs" in r.output
    assert cli("merge", job).exit_code == 1


def test_a_broken_ledger_entry_and_job_json_are_one_line_each(job, tmp_path):
    out = tmp_path / "out"
    assert cli("run", job).exit_code == 0
    entry = sorted((out / "_ledger").glob("part-*.json"))[0]
    n = len(json.loads(entry.read_text())["ids"])
    entry.write_text("{not json")
    r = cli("status", job)
    assert r.exit_code == 1 and f"{entry}: unreadable ledger entry" in r.output
    r = runner.invoke(app, ["run", str(job)])
    assert r.exit_code == 0 and f"{n} ok" in r.output
    _assert_exactly_once(out)
    (out / "_ledger" / "job.json").write_text("{")
    r = runner.invoke(app, ["run", str(job)])
    assert r.exit_code == 1 and "job.json: unreadable" in r.output and "--restart" in r.output
    assert "Traceback" not in r.output
    r = cli("status", job)
    assert r.exit_code == 1 and "job.json: unreadable" in r.output


def test_a_full_disk_exits_74_naming_the_path_and_keeps_committed_rows(job, tmp_path, monkeypatch):
    from batchgen.io import store as store_mod

    real = store_mod.pq.write_table
    calls = []

    def full_on_second(table, where, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(table, where, *a, **k)

    monkeypatch.setattr(store_mod.pq, "write_table", full_on_second)
    r = runner.invoke(app, ["run", str(job)])
    assert r.exit_code == 74, r.output
    assert "part-000002.parquet: no space left on device" in r.output and "4 rows committed" in r.output
    assert "Traceback" not in r.output
    assert not list((tmp_path / "out" / "parts").glob(".*tmp*")), "no temp file left behind"
    assert len(_ids(tmp_path / "out")) == 4
    monkeypatch.undo()
    assert cli("run", job).exit_code == 0
    _assert_exactly_once(tmp_path / "out")


def test_too_little_free_space_is_refused_before_the_model_loads(job, tmp_path, monkeypatch):
    from batchgen.io import store as store_mod
    from batchgen.job import run

    monkeypatch.setattr(store_mod.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 << 30, 10 << 30, 1000))
    real, loaded = run.load_engine, []
    monkeypatch.setattr(run, "load_engine", lambda job: loaded.append(1) or real(job))
    r = runner.invoke(app, ["run", str(job)])
    assert r.exit_code == 74 and "MiB free" in r.output and not loaded


def test_stale_temp_files_are_cleaned_on_start_and_by_merge(job, tmp_path):
    out = tmp_path / "out"
    assert cli("run", job).exit_code == 0
    stale = [out / "parts" / ".part-000009.parquet.tmp-4242", out / "_ledger" / ".part-000009.json.tmp-4242",
             out / ".summary.json.tmp-4242"]
    for p in stale:
        p.write_bytes(b"x")
    (out / ".merged.tmp-4242").mkdir()
    assert cli("merge", job).exit_code == 0
    assert not (out / ".merged.tmp-4242").exists()
    assert "already complete" in cli("run", job).output
    assert not any(p.exists() for p in stale)


def test_a_rerun_with_another_task_count_is_refused_with_the_way_out(job, tmp_path):
    assert cli("run", job, "--shard", "0/2").exit_code == 0
    assert cli("run", job, "--shard", "1/2").exit_code == 0
    r = runner.invoke(app, ["run", str(job), "--shard", "0/3"])
    assert r.exit_code == 1 and "split into 2 task(s)" in r.output and "--shard I/2" in r.output
    assert "--restart" in r.output
    r = runner.invoke(app, ["run", str(job)])
    assert r.exit_code == 1 and "split into 2 task(s)" in r.output
    assert "total: 12/12" in cli("status", job).output
    for i in range(3):
        assert cli("run", job, "--shard", f"{i}/3", "--restart").exit_code == 0
    assert not list((tmp_path / "out" / "tasks").glob("*-of-0002"))
    assert cli("merge", job).exit_code == 0


def test_merge_refuses_while_a_run_holds_the_lock(job, tmp_path):
    assert cli("run", job).exit_code == 0
    holder = OutputStore(tmp_path / "out")
    holder.acquire_lock()
    try:
        r = runner.invoke(app, ["merge", str(job)])
        assert r.exit_code == 3 and "merge once it has finished" in r.output
        assert "total: 12/12" in cli("status", job).output, "status reads beside a running job"
    finally:
        holder.release_lock()
    assert cli("merge", job).exit_code == 0


def test_fingerprint_holds_max_model_len_resolved_dtype_and_the_weights(job, tmp_path, tiny_model_dir):
    assert cli("run", job, "--limit", "2").exit_code == 0
    r = runner.invoke(app, ["run", str(job), "--set", "engine.max_model_len=300"])
    assert r.exit_code == 1 and "changed: max_model_len" in r.output
    fp = json.loads((tmp_path / "out" / "_ledger" / "job.json").read_text())["fingerprint"]
    assert fp["dtype"] == "float32" and fp["max_model_len"] == 512
    # Retrained weights of the same shapes and size: another identity.
    from batchgen.models.loader import resolve_model

    copy = tmp_path / "retrained"
    shutil.copytree(tiny_model_dir, copy)
    before = resolve_model(str(copy)).identity
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8 - i for i in range(8))
    weights.write_bytes(bytes(data))
    assert resolve_model(str(copy)).identity != before


def test_status_of_a_job_never_run_and_a_store_with_a_bad_fingerprint_file(tmp_path):
    store = OutputStore(tmp_path / "o")
    store.open({"f": 1}, restart=False)
    (store.ledger / "job.json").write_text("[]")
    with pytest.raises(ConfigError, match="job.json: unreadable"):
        OutputStore(tmp_path / "o").open({"f": 1}, restart=False)
