"""What a new user runs into: output paths, the plan, progress off a TTY, OpenAI Batch fields,
empty input, exit codes, id types, model diagnostics, output details and help text."""
import errno
import json
import logging
import re
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from conftest import REPO
from helpers import read_output, write_job, write_prompts

runner = CliRunner()


def cli(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def job(tmp_path, tiny_model_dir):
    return write_job(tmp_path, tiny_model_dir, write_prompts(tmp_path / "in.parquet", n=6))


def _no_model_load(monkeypatch):
    from batchgen.job import run

    real, loaded = run.load_engine, []
    monkeypatch.setattr(run, "load_engine", lambda job: loaded.append(1) or real(job))
    return loaded


def test_an_output_path_that_is_a_file_is_one_line_before_loading(job, tmp_path, monkeypatch):
    loaded = _no_model_load(monkeypatch)
    (tmp_path / "taken").write_text("a file")
    r = runner.invoke(app, ["run", str(job), "--set", f"output.path={tmp_path / 'taken'}"])
    assert r.exit_code == 1 and "taken exists and is not a folder" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["run", str(job), "--set", f"output.path={tmp_path / 'taken' / 'below'}"])
    assert r.exit_code == 1 and "is a file" in r.output and "Traceback" not in r.output
    assert not loaded


def test_a_read_only_output_folder_is_one_line_naming_it(job, tmp_path, monkeypatch):
    loaded = _no_model_load(monkeypatch)
    real_mkdir = Path.mkdir

    def read_only(self, *a, **k):
        if "ro" in self.parts:
            raise OSError(errno.EROFS, "Read-only file system")
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", read_only)
    r = runner.invoke(app, ["run", str(job), "--set", f"output.path={tmp_path / 'ro' / 'out'}"])
    assert r.exit_code == 1 and f"{tmp_path / 'ro' / 'out'}: cannot write (Read-only file system)" in r.output
    assert "Traceback" not in r.output and not loaded


def test_plan_of_a_cpu_job_uses_the_runs_dtype_and_budget(tmp_path, tiny_model_dir):
    inp = write_prompts(tmp_path / "in.parquet", n=4)
    job = write_job(tmp_path, tiny_model_dir, inp, engine={"kv_cache_gib": 0.25})
    r = cli("plan", job)
    assert r.exit_code == 0, r.output
    # The tiny model (2 layers, 2 KV heads, head_dim 16) in fp32 on a CPU: 2 x 2 x 2 x 16 x 4 bytes.
    assert "dtype float32 on cpu" in r.output and "KV per token (float32): 0.5 KiB" in r.output
    assert "KV budget 0.25 GiB (engine.kv_cache_gib)" in r.output
    r = cli("plan", job, "--set", "engine.kv_cache_gib=null", "--set", "engine.kv_cache_fraction=0.1")
    assert "engine.kv_cache_fraction 0.1 of" in r.output


def test_plan_says_plainly_when_nothing_fits():
    r = cli("plan", "--model", REPO / "examples/configs/llama-3-70b.json", "--kv-gib", "1", "--context", "131072")
    assert r.exit_code == 0
    assert "no sequence of 131072 tokens fits" in r.output and "Raise engine.kv_cache_gib to at least" in r.output
    assert "suggested:" not in r.output


def test_progress_lines_come_on_a_timer_with_live_rates(tmp_path, tiny_model_dir, caplog, monkeypatch):
    """One long row: lines come while it runs (no row finished yet), tok/s moves, no 'nan'."""
    from batchgen.config import load_job
    from batchgen.job import progress, run_job

    monkeypatch.setattr(progress.Progress.__init__, "__defaults__", (0.05, True, None))
    inp = write_prompts(tmp_path / "in.parquet", n=1)
    job = write_job(tmp_path, tiny_model_dir, inp, sampling={"max_tokens": 450, "temperature": 0.0, "ignore_eos": True})
    with caplog.at_level(logging.INFO, logger="batchgen"):
        run_job(load_job(job))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress:")]
    early = [ln for ln in lines if ln.startswith("progress: 0/1")]
    assert len(early) >= 2, lines
    rates = [float(re.search(r"rows, ([\d.]+) output tok/s", ln).group(1)) for ln in early]
    assert rates[-1] > 0 and all("nan" not in ln and "ETA" not in ln for ln in early)


def test_openai_batch_content_parts_n_logprobs_and_unknown_fields(tmp_path, tiny_model_dir):
    def line(cid, **body):
        body.setdefault("messages", [{"role": "user", "content": "Hi"}])
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                           "body": {"model": "gpt-x", **body}})

    src = tmp_path / "b.jsonl"
    src.write_text("\n".join([
        line("parts", messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                               {"type": "text", "text": "there"}]}]),
        line("two", n=2, temperature=0.9, seed=5, max_tokens=4),
        line("lp", logprobs=True, top_logprobs=3, max_tokens=3),
        line("tools", tools=[{"type": "function"}]),
        line("image", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        line("neutral", frequency_penalty=0, presence_penalty=0.0, user="u1"),
    ]) + "\n")
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {tiny_model_dir}\ninput: {{format: openai_batch, path: {src}}}\n"
                   f"output: {{path: {tmp_path / 'out'}}}\nsampling: {{max_tokens: 3, temperature: 0.0, ignore_eos: true}}\n")
    r = cli("run", job)
    assert r.exit_code == 0, r.output
    df = read_output(tmp_path / "out")
    errs = {k: v for k, v in zip(df["id"], df["error"]) if v}
    assert set(errs) == {"tools", "image"}
    assert "body.tools is not supported" in errs["tools"] and "line 4" in errs["tools"]
    assert "content[0] has type 'image_url'" in errs["image"]
    assert sorted(df.filter(pl.col("id") == "two")["sample_index"].to_list()) == [0, 1]
    results = {x["custom_id"]: x for x in map(json.loads, (tmp_path / "out" / "results.jsonl").read_text().splitlines())}
    assert [c["index"] for c in results["two"]["response"]["body"]["choices"]] == [0, 1]
    assert results["two"]["response"]["body"]["usage"]["completion_tokens"] == 8
    content = results["lp"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(t["top_logprobs"]) == 3 and t["logprob"] <= 0 for t in content)
    assert results["parts"]["response"]["body"]["choices"][0]["logprobs"] is None
    assert "neutral" in results


def test_an_empty_input_is_an_error_unless_allowed(tmp_path, tiny_model_dir):
    p = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "prompt": pa.array([], pa.string())}), p)
    job = write_job(tmp_path, tiny_model_dir, p)
    r = runner.invoke(app, ["run", str(job)])
    assert r.exit_code == 1 and "no rows to run" in r.output and "--allow-empty" in r.output
    assert cli("run", job, "--allow-empty").exit_code == 0


@pytest.mark.parametrize("args", [["--shard", "2/2"], ["--shard", "x"], ["--runner", "spark"]])
def test_a_bad_command_line_exits_2(job, args):
    r = runner.invoke(app, ["run", str(job), *args])
    assert r.exit_code == 2, r.output


def test_integer_ids_keep_their_type_and_sort_by_value(tmp_path, tiny_model_dir):
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    pq.write_table(pa.table({"id": pa.array([10, 2], pa.int64()), "prompt": ["x", "y"]}), a)
    pq.write_table(pa.table({"id": pa.array([1, 0], pa.int32()), "prompt": ["z", "w"]}), b)
    job = write_job(tmp_path, tiny_model_dir, tmp_path / "*.parquet")
    assert cli("run", job).exit_code == 0
    df = read_output(tmp_path / "out")
    assert df.schema["id"] == pl.Int64 and sorted(df["id"].to_list()) == [0, 1, 2, 10]
    assert cli("merge", job).exit_code == 0
    merged = pl.read_parquet(str(tmp_path / "out" / "merged" / "*.parquet"))
    assert merged["id"].to_list() == [0, 1, 2, 10], "by value, not as text"
    pq.write_table(pa.table({"id": ["s1"], "prompt": ["v"]}), tmp_path / "c.parquet")
    r = runner.invoke(app, ["run", str(job)])
    assert r.exit_code == 1 and "an integer in some files and a string in others" in r.output


def test_model_diagnostics_name_the_type_and_the_file(tmp_path, smol_source):
    d = tmp_path / "weird"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    from batchgen.errors import ConfigError
    from batchgen.models.loader import resolve_model

    with pytest.raises(ConfigError, match="type 'mamba' is not supported; supported: llama"):
        resolve_model(str(d))
    inp = write_prompts(tmp_path / "in.parquet", n=2)
    r = cli("validate", write_job(tmp_path, "default", inp))
    assert r.exit_code == 0 and "model SmolLM2-135M-Instruct.Q4_1.gguf (gguf:" in r.output


def test_a_cut_multibyte_character_is_left_out(smol_tokenizer):
    from batchgen.llm import Engine

    ids = smol_tokenizer("caf\u00e9 \U0001f600", add_special_tokens=False).input_ids
    assert "\ufffd" in smol_tokenizer.decode(ids[:-1]), "the emoji spans several byte tokens"
    cut = Engine.decode(type("E", (), {"tokenizer": smol_tokenizer})(), ids[:-1])
    assert "\ufffd" not in cut and cut.startswith("caf\u00e9")


def test_truncated_prompts_are_flagged_and_n_samples_count_the_prompt_once(tmp_path, tiny_model_dir):
    inp = write_prompts(tmp_path / "in.parquet", prompts=["word " * 600, "short one"])
    job = write_job(tmp_path, tiny_model_dir, inp, on_too_long="truncate_left",
                    sampling={"max_tokens": 4, "temperature": 0.7, "seed": 1, "n": 3, "ignore_eos": True})
    assert cli("run", job).exit_code == 0
    df = read_output(tmp_path / "out")
    flags = dict(zip(df["id"], df["prompt_truncated"]))
    assert flags == {"r0000": True, "r0001": False}
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    per_row = df.group_by("id").agg(pl.col("prompt_tokens").first())["prompt_tokens"].sum()
    assert summary["prompt_tokens"] == per_row and summary["rows_truncated"] == 1
    assert summary["engine"]["prefix_hit_rate"] >= 0.6


def test_help_texts_read_as_written():
    assert "batchgen[ray]" in cli("run", "--help").output
    merge = cli("merge", "--help").output
    assert "after\n  checking that every input id" in merge or "after checking" in merge.replace("\n  ", " ")
    assert "{job}" not in cli("status", "--help").output
