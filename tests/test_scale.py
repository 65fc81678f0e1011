"""Slurm shards, merge, draining on a stop signal, data-parallel workers and cron overlap."""
import json

import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.config import InputSpec
from batchgen.errors import ConfigError
from batchgen.io.store import OutputStore
from batchgen.shard import parse_shard, select_shard
from helpers import engine_specs, read_output, read_rows, write_job, write_prompts

runner = CliRunner()


def test_shards_are_disjoint_and_cover_the_input(tmp_path):
    for k in range(3):
        write_prompts(tmp_path / f"s{k}.parquet", n=5, id_prefix=f"f{k}-")
    index, _ = read_rows(InputSpec(path=str(tmp_path), id_column="id"))
    for n in (2, 3, 5):  # files >= N: whole files; N=5 > 3 files: rows by id hash
        parts = [select_shard(index, (i, n)).ids.to_pylist() for i in range(n)]
        flat = [x for p in parts for x in p]
        assert sorted(flat) == sorted(index.ids.to_pylist()) and len(flat) == len(set(flat))
        assert parts == [select_shard(index, (i, n)).ids.to_pylist() for i in range(n)], "stable across calls"
    assert set(select_shard(index, (1, 3)).ids.to_pylist()) == {f"f1-{i:04d}" for i in range(5)}


def test_parse_shard_from_flag_and_slurm(monkeypatch):
    assert parse_shard("1/4") == (1, 4) and parse_shard("0/1") is None
    with pytest.raises(ConfigError):
        parse_shard("4/4")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "4")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "1")
    assert parse_shard(None) == (2, 4)


def test_tasks_status_and_merge(tmp_path, tiny_model_dir):
    inp = write_prompts(tmp_path / "in.parquet", n=12)
    job = write_job(tmp_path, tiny_model_dir, inp)
    assert runner.invoke(app, ["run", str(job), "--shard", "0/2"]).exit_code == 0
    r = runner.invoke(app, ["merge", str(job)])
    assert r.exit_code == 1 and "ids missing" in r.output
    assert runner.invoke(app, ["run", str(job), "--shard", "1/2"]).exit_code == 0
    assert "total: 12/12" in runner.invoke(app, ["status", str(job)]).output
    r = runner.invoke(app, ["merge", str(job)])
    assert r.exit_code == 0, r.output
    import polars as pl

    merged = pl.read_parquet(str(tmp_path / "out" / "merged" / "*.parquet"))
    assert merged["id"].to_list() == [f"r{i:04d}" for i in range(12)]
    assert "already complete" in runner.invoke(app, ["run", str(job), "--shard", "1/2"]).output


def test_stop_drains_running_requests_and_admits_no_more():
    import torch

    from batchgen.engine.request import SamplingParams
    from batchgen.llm import Engine, GenerationRequest
    from helpers import tiny_hf_model

    class Tok:
        eos_token_id = None

        def decode(self, ids, skip_special_tokens=True):
            return ""

    e = Engine(tiny_hf_model("llama"), Tok(), *engine_specs(max_num_seqs=2, kv_cache_gib=0.01))
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    reqs = [GenerationRequest(str(i), torch.arange(3, 10).tolist(), sp) for i in range(6)]
    steps = iter(range(10_000))
    out = list(e.generate(reqs, should_stop=lambda: next(steps) >= 3, grace_s=60))
    assert len(out) == 2 and all(r.completion_tokens == 6 for r in out), "the two running requests finished"
    out = list(Engine(tiny_hf_model("llama"), Tok(), *engine_specs(max_num_seqs=2, kv_cache_gib=0.01)).generate(
        reqs, should_stop=lambda: True, grace_s=0))
    assert out == []


def test_data_parallel_two_cpu_workers(tmp_path, tiny_model_dir):
    inp = write_prompts(tmp_path / "in.parquet", n=10)
    job = write_job(tmp_path, {"path": str(tiny_model_dir), "device": "cpu"}, inp)
    r = runner.invoke(app, ["run", str(job), "--data-parallel", "2"])
    assert r.exit_code == 0, r.output
    ids = []
    for root in sorted((tmp_path / "out" / "tasks").iterdir()):
        ids += read_output(root)["id"].to_list()
    assert sorted(ids) == [f"r{i:04d}" for i in range(10)]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["data_parallel"] == 2 and summary["rows_ok"] == 10 and summary["complete"]
    assert summary["worker_exit_codes"] == [0, 0] and summary["ttft_s"]["p50"] is not None


def test_data_parallel_parent_forwards_sigterm_to_its_workers(tmp_path, tiny_model_dir):
    """`kill PID` of the parent alone (not its process group, as a Slurm step or Ctrl-C would):
    the workers still drain, commit and exit 75, and so does the parent."""
    import signal
    import subprocess
    import sys
    import time

    n = 600
    inp = write_prompts(tmp_path / "in.parquet", n=n)
    job = write_job(tmp_path, {"path": str(tiny_model_dir), "device": "cpu"}, inp, output={"rows_per_part": 5},
                    sampling={"max_tokens": 24}, engine={"max_num_seqs": 1})
    proc = subprocess.Popen([sys.executable, "-m", "batchgen", "run", str(job), "--data-parallel", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    tasks = tmp_path / "out" / "tasks"
    deadline = time.monotonic() + 180
    while proc.poll() is None and time.monotonic() < deadline and not list(tasks.glob("*/_ledger/part-*.json")):
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 75, err[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["worker_exit_codes"] == [75, 75], "each worker drained and exited by itself"
    ids = []
    for root in sorted(tasks.iterdir()):
        df = read_output(root)
        ids += df["id"].to_list() if df is not None else []
    assert 0 < len(ids) < n and len(ids) == len(set(ids))


def test_overlapping_run_exits_3_with_a_clear_message(tmp_path, tiny_model_dir):
    inp = write_prompts(tmp_path / "in.parquet", n=3)
    job = write_job(tmp_path, tiny_model_dir, inp)
    holder = OutputStore(tmp_path / "out")
    holder.acquire_lock()
    try:
        r = runner.invoke(app, ["run", str(job)])
        assert r.exit_code == 3 and "another batchgen run of this job is running" in r.output
    finally:
        holder.release_lock()
    assert runner.invoke(app, ["run", str(job)]).exit_code == 0
