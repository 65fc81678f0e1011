"""The job pipeline through the CLI on a tiny local HF model folder."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.errors import LockedError
from batchgen.io.store import OutputStore
from helpers import read_output, write_job, write_prompts

runner = CliRunner()


def cli(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def job(tmp_path, tiny_model_dir):
    inp = write_prompts(tmp_path / "in.parquet", n=10, extra={"topic": [f"t{i % 3}" for i in range(10)]})
    return write_job(tmp_path, tiny_model_dir, inp, input={"passthrough_columns": ["topic"]})


def test_run_writes_every_id_once_with_all_columns(job, tmp_path):
    r = cli("run", job)
    assert r.exit_code == 0, r.output
    df = read_output(tmp_path / "out")
    assert sorted(df["id"].to_list()) == [f"r{i:04d}" for i in range(10)]
    assert df.columns == ["id", "topic", "text", "finish_reason", "error", "prompt_tokens", "completion_tokens",
                          "ttft_s", "itl_s"]
    assert set(df["finish_reason"]) == {"length"} and set(df["completion_tokens"]) == {6}
    assert df.filter(df["id"] == "r0004")["topic"].item() == "t1"
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["rows_ok"] == 10 and summary["completion_tokens"] == 60
    assert summary["engine"]["num_kv_blocks"] > 0 and summary["ttft_s"]["p50"] > 0
    assert len(list((tmp_path / "out" / "parts").glob("*.parquet"))) == 3  # rows_per_part 4


def test_rerun_is_a_noop_and_status_counts(job, tmp_path):
    assert cli("run", job).exit_code == 0
    parts = sorted((tmp_path / "out" / "parts").iterdir())
    r = cli("run", job)
    assert r.exit_code == 0 and "already complete" in r.output
    assert sorted((tmp_path / "out" / "parts").iterdir()) == parts
    s = cli("status", job)
    assert "in: 10/10" in s.output and "total: 10/10" in s.output


def test_limit_then_resume_runs_only_the_rest(job, tmp_path):
    assert cli("run", job, "--limit", 3).exit_code == 0
    assert len(read_output(tmp_path / "out")) == 3
    assert "total: 3/10" in cli("status", job).output
    r = cli("run", job)
    assert "7 ok" in r.output
    df = read_output(tmp_path / "out")
    assert sorted(df["id"].to_list()) == [f"r{i:04d}" for i in range(10)]


def test_changed_fingerprint_is_refused_unless_restart(job, tmp_path):
    assert cli("run", job, "--limit", 2).exit_code == 0
    r = runner.invoke(app, ["run", str(job), "--set", "sampling.max_tokens=3"])
    assert r.exit_code == 1 and "different job (changed: sampling)" in r.output
    r = cli("run", job, "--set", "sampling.max_tokens=3", "--restart")
    assert r.exit_code == 0
    df = read_output(tmp_path / "out")
    assert len(df) == 10 and set(df["completion_tokens"]) == {3}


def test_bad_rows_become_error_rows_and_the_job_goes_on(tmp_path, tiny_model_dir):
    inp = write_prompts(tmp_path / "in.parquet", prompts=["fine prompt", None, "", "also fine", "word " * 600])
    job = write_job(tmp_path, tiny_model_dir, inp)
    r = cli("run", job)
    assert r.exit_code == 0, r.output
    df = read_output(tmp_path / "out").sort("id")
    errors = dict(zip(df["id"], df["error"]))
    assert errors["r0000"] is None and errors["r0003"] is None
    assert "prompt is null" in errors["r0001"] and "prompt is empty" in errors["r0002"]
    assert "tokens; the context holds 512" in errors["r0004"]
    assert df.filter(df["id"] == "r0001")["finish_reason"].item() == "error"


def test_on_too_long_fail_names_the_row_before_loading(tmp_path, tiny_model_dir):
    inp = write_prompts(tmp_path / "in.parquet", prompts=["ok", "word " * 600])
    job = write_job(tmp_path, tiny_model_dir, inp, on_too_long="fail")
    r = runner.invoke(app, ["run", str(job)])
    assert r.exit_code == 1 and "row 1 (id 'r0001')" in r.output and "on_too_long: fail" in r.output


def test_truncate_left_keeps_the_end_of_the_prompt(tmp_path, tiny_model_dir):
    inp = write_prompts(tmp_path / "in.parquet", prompts=["word " * 600])
    job = write_job(tmp_path, tiny_model_dir, inp, on_too_long="truncate_left")
    assert cli("run", job).exit_code == 0
    row = read_output(tmp_path / "out").row(0, named=True)
    assert row["error"] is None and row["prompt_tokens"] + 6 <= 512


def test_validate_reports_without_generating(job, tmp_path):
    r = cli("validate", job)
    assert r.exit_code == 0 and "ok: 10 rows in 1 shard(s)" in r.output
    assert not (tmp_path / "out").exists()


def test_missing_input_exits_1_with_a_clear_message(tmp_path, tiny_model_dir):
    job = write_job(tmp_path, tiny_model_dir, tmp_path / "missing.parquet")
    r = runner.invoke(app, ["run", str(job)])
    assert r.exit_code == 1 and "missing.parquet' not found" in r.output


def test_per_row_max_tokens_and_n_samples(tmp_path, tiny_model_dir):
    inp = write_prompts(tmp_path / "in.parquet", n=3, extra={"mt": [1, None, 4]})
    job = write_job(tmp_path, tiny_model_dir, inp, input={"sampling_columns": {"max_tokens": "mt"}},
                    sampling={"n": 2, "temperature": 1.0, "seed": 7})
    assert cli("run", job).exit_code == 0
    df = read_output(tmp_path / "out").sort(["id", "sample_index"])
    assert df["sample_index"].to_list() == [0, 1] * 3
    assert df["completion_tokens"].to_list() == [1, 1, 6, 6, 4, 4]


def test_order_input_compacts_parts_in_input_order(tmp_path, tiny_model_dir):
    prompts = ["x " * (30 - i) for i in range(9)]  # longest first: length sorting reverses the order
    inp = write_prompts(tmp_path / "in.parquet", prompts=prompts)
    job = write_job(tmp_path, tiny_model_dir, inp, output={"order": "input"})
    assert cli("run", job).exit_code == 0
    files = sorted((tmp_path / "out" / "parts").iterdir())
    assert [f.name for f in files] == ["final-000001.parquet", "final-000002.parquet", "final-000003.parquet"]
    assert read_output(tmp_path / "out")["id"].to_list() == [f"r{i:04d}" for i in range(9)]
    assert "total: 9/9" in cli("status", job).output
    assert "already complete" in cli("run", job).output


def test_second_concurrent_run_is_refused(tmp_path):
    a, b = OutputStore(tmp_path / "o"), OutputStore(tmp_path / "o")
    a.acquire_lock()
    with pytest.raises(LockedError, match="another batchgen run"):
        b.acquire_lock()
    a.release_lock()
    b.acquire_lock()
    b.release_lock()


def test_orphan_part_without_ledger_entry_is_removed(tmp_path):
    store = OutputStore(tmp_path / "o")
    store.open({"f": 1}, restart=False)
    store.commit(pa.table({"id": ["a"]}), ["a"], [0], {"in": 1})
    orphan = store.parts / "part-000002.parquet"
    pq.write_table(pa.table({"id": ["b"]}), orphan)
    done = OutputStore(tmp_path / "o").open({"f": 1}, restart=False)
    assert done.to_pylist() == ["a"] and not orphan.exists()


def _ledger_count(out: Path) -> int:
    return len(list((out / "_ledger").glob("part-*.json"))) if (out / "_ledger").exists() else 0


@pytest.mark.parametrize("kill_after_parts", [0, 2, 5])
def test_kill_9_then_resume_gives_exactly_once_output(tmp_path, tiny_model_dir, kill_after_parts):
    # One sequence at a time over 300 rows, so the kill lands mid-job however fast the machine;
    # the resume runs the rest in big batches (engine settings are not part of the fingerprint).
    n = 300
    inp = write_prompts(tmp_path / "in.parquet", n=n)
    job = write_job(tmp_path, tiny_model_dir, inp, output={"rows_per_part": 3},
                    sampling={"max_tokens": 24}, engine={"max_num_seqs": 1})
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "batchgen", "run", str(job)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    if kill_after_parts == 0:
        for line in proc.stderr:  # mid-generation, before any part is written
            if "model loaded" in line:
                break
    else:
        while _ledger_count(out) < kill_after_parts and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = sum(len(json.loads(p.read_text())["ids"]) for p in (out / "_ledger").glob("part-*.json"))
    assert done_before < n, "the job finished before it could be killed; the test needs a slower job"
    r = subprocess.run(cmd + ["--set", "engine.max_num_seqs=64"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    df = read_output(out)
    ids = df["id"].to_list()
    assert sorted(ids) == [f"r{i:04d}" for i in range(n)] and len(ids) == len(set(ids))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows_ok"] == n - done_before, "only the work not yet committed is redone"


def test_sigterm_flushes_finished_rows_and_exits_75(tmp_path, tiny_model_dir):
    # One sequence at a time over 600 rows: far longer than the wait for the first committed part,
    # however fast the machine. The signal is sent once rows are being committed.
    n = 600
    inp = write_prompts(tmp_path / "in.parquet", n=n)
    job = write_job(tmp_path, tiny_model_dir, inp, output={"rows_per_part": 5},
                    sampling={"max_tokens": 24}, engine={"max_num_seqs": 1})
    cmd = [sys.executable, "-m", "batchgen", "run", str(job)]
    out = tmp_path / "out"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while _ledger_count(out) < 1 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=60)[1]
    assert proc.returncode == 75, rest
    assert "rerun the same command to resume" in rest
    done = read_output(out)
    assert done is not None and 0 < len(done) < n, "finished rows were committed before exiting"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] == signal.SIGTERM and summary["complete"] is False
    # Resume with a bigger batch (not part of the fingerprint): every id exactly once.
    r = subprocess.run(cmd + ["--set", "engine.max_num_seqs=128"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    ids = read_output(out)["id"].to_list()
    assert sorted(ids) == [f"r{i:04d}" for i in range(n)] and len(ids) == len(set(ids))


def _signal_self_on_call(monkeypatch, module, name, signum, on_calls=(1,)):
    """Wrap module.name so that each of its calls numbered in on_calls (1-based) first delivers
    signum to this process."""
    real = getattr(module, name)
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) in on_calls:
            os.kill(os.getpid(), signum)
            time.sleep(0.05)  # the handler runs in the main thread at the next bytecode
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)
    return calls


def test_signal_before_generation_stops_at_once_with_75(tmp_path, tiny_model_dir, monkeypatch):
    """During model loading nothing is at stake: the run stops there, exits 75 and loses nothing."""
    from batchgen.config import load_job
    from batchgen.errors import Interrupted
    from batchgen.job import run_job
    from batchgen.models import loader

    inp = write_prompts(tmp_path / "in.parquet", n=8)
    spec = load_job(write_job(tmp_path, tiny_model_dir, inp))
    _signal_self_on_call(monkeypatch, loader, "load_checkpoint", signal.SIGTERM)
    with pytest.raises(Interrupted, match="before any row was generated"):
        run_job(spec)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "the handler was put back"
    assert read_output(tmp_path / "out") is None
    monkeypatch.undo()
    assert run_job(spec)["rows_done"] == 8


def test_signal_during_generation_drains_then_resume_is_exact(tmp_path, tiny_model_dir, monkeypatch):
    from batchgen import job as job_mod
    from batchgen.config import load_job
    from batchgen.errors import Interrupted
    from batchgen.job import sink

    n = 40
    inp = write_prompts(tmp_path / "in.parquet", n=n)
    spec = load_job(write_job(tmp_path, tiny_model_dir, inp, engine={"max_num_seqs": 4, "kv_cache_gib": 0.05}))
    _signal_self_on_call(monkeypatch, sink.ResultSink, "add", signal.SIGUSR1, on_calls=(3,))
    with pytest.raises(Interrupted, match="after committing finished rows"):
        job_mod.run_job(spec)
    done = read_output(tmp_path / "out")["id"].to_list()
    # The 3rd result raised the flag; at most the other running requests drained after it.
    assert 3 <= len(done) <= 3 + 3, done
    monkeypatch.undo()
    summary = job_mod.run_job(spec)
    assert summary["rows_ok"] == n - len(done)
    ids = read_output(tmp_path / "out")["id"].to_list()
    assert sorted(ids) == [f"r{i:04d}" for i in range(n)] and len(ids) == len(set(ids))


def test_signal_after_the_last_row_lets_the_job_finish_with_0(tmp_path, tiny_model_dir, monkeypatch):
    """A signal during the final flush and input-order compaction stops nothing: outputs stay whole."""
    from batchgen import job as job_mod
    from batchgen.config import load_job
    from batchgen.job import run

    inp = write_prompts(tmp_path / "in.parquet", n=10)
    spec = load_job(write_job(tmp_path, tiny_model_dir, inp, output={"order": "input"}))
    calls = _signal_self_on_call(monkeypatch, run, "finish_outputs", signal.SIGTERM)
    summary = job_mod.run_job(spec)
    assert calls and summary["complete"] and summary["interrupted"] is None
    assert read_output(tmp_path / "out")["id"].to_list() == [f"r{i:04d}" for i in range(10)]


def test_ctrl_c_twice_stops_without_draining(tmp_path, tiny_model_dir, monkeypatch):
    from batchgen import job as job_mod
    from batchgen.config import load_job
    from batchgen.errors import Aborted
    from batchgen.job import sink

    n = 40
    inp = write_prompts(tmp_path / "in.parquet", n=n)
    spec = load_job(write_job(tmp_path, tiny_model_dir, inp, engine={"max_num_seqs": 4, "grace_s": 600}))
    # The suite may run with SIGINT ignored (a background launch): this test needs it delivered.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        # The first Ctrl-C asks for a drain, the second one ends it at the next step.
        _signal_self_on_call(monkeypatch, sink.ResultSink, "add", signal.SIGINT, on_calls=(2, 3))
        with pytest.raises(Aborted, match="interrupted twice"):
            job_mod.run_job(spec)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "the handler was put back"
    finally:
        signal.signal(signal.SIGINT, before)
    monkeypatch.undo()
    job_mod.run_job(spec)  # the lock was released and the job resumes
    ids = read_output(tmp_path / "out")["id"].to_list()
    assert sorted(ids) == [f"r{i:04d}" for i in range(n)] and len(ids) == len(set(ids))


def test_cli_maps_ctrl_c_twice_to_130_with_a_message(job, monkeypatch):
    import batchgen.job
    from batchgen.errors import Aborted

    def stopped(*a, **k):
        raise Aborted("interrupted twice: stopped without draining; rows committed so far are kept")

    monkeypatch.setattr(batchgen.job, "run_job", stopped)
    r = runner.invoke(app, ["run", str(job)])
    assert r.exit_code == 130 and "rows committed so far are kept" in r.output


def test_periodic_log_line_carries_live_stats(tmp_path, tiny_model_dir, caplog):
    import logging

    from batchgen.config import load_job
    from batchgen.job import run_job

    inp = write_prompts(tmp_path / "in.parquet", n=6)
    job = write_job(tmp_path, tiny_model_dir, inp, engine={"kv_cache_gib": 0.05, "cpu_offload_gib": 0.01})
    with caplog.at_level(logging.INFO, logger="batchgen"):
        run_job(load_job(job))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("progress: 6/6"))
    for field in ("running", "waiting", "kv ", "prefix hits", "prefill", "decode", "preemptions",
                  "cpu tier", "swapped out/in"):
        assert field in line, (field, line)
