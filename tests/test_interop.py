"""OpenAI Batch JSONL in/out, the throughput-latency sweep, and the latency profile."""
import json

import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from helpers import engine_specs, read_output

runner = CliRunner()


def _batch_line(cid, content, **body):
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "x", "messages": [{"role": "user", "content": content}], **body}})


def test_openai_batch_roundtrip_with_a_malformed_line(tmp_path, tiny_model_dir):
    src = tmp_path / "batch.jsonl"
    src.write_text("\n".join([
        _batch_line("req-1", "Hello", max_tokens=3),
        "{this is not json",
        _batch_line("req-2", "Hi", max_tokens=5, temperature=0.7, seed=3, stop=["zzz-never"]),
        json.dumps({"custom_id": "req-3", "body": {"prompt": "legacy completions"}}),
    ]) + "\n")
    job = tmp_path / "job.yaml"
    job.write_text(f"""
model: {tiny_model_dir}
input: {{format: openai_batch, path: {src}}}
output: {{path: {tmp_path / 'out'}}}
sampling: {{max_tokens: 8, temperature: 0.0, ignore_eos: true}}
""")
    r = runner.invoke(app, ["run", str(job)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    df = read_output(tmp_path / "out").sort("id")
    assert df["id"].to_list() == ["batch:line2", "req-1", "req-2", "req-3"]
    errs = dict(zip(df["id"], df["error"]))
    assert "line 2: not valid JSON" in errs["batch:line2"]
    assert "line 4: body.messages is missing" in errs["req-3"]
    assert dict(zip(df["id"], df["completion_tokens"]))["req-1"] == 3
    assert dict(zip(df["id"], df["completion_tokens"]))["req-2"] == 5
    results = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    errors = [json.loads(x) for x in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()]
    assert sorted(x["custom_id"] for x in results) == ["req-1", "req-2"]
    one = next(x for x in results if x["custom_id"] == "req-1")
    assert one["response"]["body"]["usage"]["completion_tokens"] == 3
    assert isinstance(one["response"]["body"]["choices"][0]["message"]["content"], str)
    assert sorted(x["custom_id"] for x in errors) == ["batch:line2", "req-3"]
    assert "line 2" in next(x for x in errors if x["custom_id"] == "batch:line2")["error"]["message"]
    # Resumable like any job: a rerun is a no-op.
    assert "already complete" in runner.invoke(app, ["run", str(job)]).output


def test_sweep_writes_a_table_and_a_plot(tmp_path, tiny_model_dir):
    from batchgen.bench import format_sweep, parse_sweep, run_sweep

    name, values = parse_sweep("max_num_seqs=1,4")
    rep = run_sweep(name, values, num_prompts=4, output_cap=4, model=str(tiny_model_dir),
                    engine_kw={"kv_cache_gib": 0.05}, plot_path=str(tmp_path / "sweep.png"))
    assert [r["max_num_seqs"] for r in rep["rows"]] == [1, 4]
    assert all(r["output_tokens"] == rep["rows"][0]["output_tokens"] > 0 for r in rep["rows"])
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ITL p50" in format_sweep(rep)
    with pytest.raises(ValueError, match="NAME=v1"):
        parse_sweep("temperature=1,2")


def test_latency_profile_caps_the_batch():
    """profile: latency runs at most 16 sequences and 512 tokens a step, whatever max_num_seqs says."""
    from batchgen.engine.request import SamplingParams
    from batchgen.llm import Engine, GenerationRequest
    from helpers import tiny_hf_model
    from test_engine import IdTokenizer, prompts

    e = Engine(tiny_hf_model("llama"), IdTokenizer(), *engine_specs(profile="latency", max_num_seqs=256,
                                                                    kv_cache_gib=0.05))
    steps = []
    schedule = e.scheduler.schedule
    e.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = list(e.generate(GenerationRequest(str(i), p, sp) for i, p in enumerate(prompts(lengths=[60] * 40))))
    assert len(out) == 40 and e.counters()["profile"] == "latency"
    assert e.scheduler.stats.peak_running == 16 and max(s.num_tokens for s in steps) == 512
