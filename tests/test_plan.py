import json

import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.plan import plan, shape_from_config
from conftest import REPO
from helpers import write_job, write_prompts

runner = CliRunner()


def test_llama3_70b_matches_published_figures():
    cfg = json.loads((REPO / "examples/configs/llama-3-70b.json").read_text())
    p = plan(shape_from_config(cfg), "bfloat16", 80 * 2**30, 131072, batch=1)
    assert p["kv_bytes_per_token"] == 320 * 1024
    assert abs(p["kv_gib_per_seq"] - 40.0) < 0.1
    assert 139 <= p["weight_gb"] <= 142
    assert p["seqs_that_fit"] == 2


def test_8b_and_qwen_param_counts():
    for name, lo, hi in [("llama-3-8b", 7.9e9, 8.1e9), ("qwen2.5-7b", 7.5e9, 7.7e9)]:
        mem = shape_from_config(json.loads((REPO / f"examples/configs/{name}.json").read_text()))
        assert lo <= mem.num_params() <= hi, name


def test_thrash_warning_and_cli(tmp_path):
    cfg = json.loads((REPO / "examples/configs/llama-3-8b.json").read_text())
    p = plan(shape_from_config(cfg), "bfloat16", 2**30, 8192, max_num_seqs=256)
    assert p["seqs_that_fit"] == 1 and any("thrashing" in w for w in p["warnings"])
    r = runner.invoke(app, ["plan", "--model", str(REPO / "examples/configs/llama-3-70b.json"), "--context", "131072",
                            "--batch", "1", "--kv-gib", "80"])
    assert r.exit_code == 0 and "KV per token (bfloat16): 320.0 KiB" in r.output and "40.0 GiB" in r.output


def test_plan_for_a_job_uses_its_prompt_lengths(tmp_path, tiny_model_dir):
    inp = write_prompts(tmp_path / "in.parquet", n=5)
    job = write_job(tmp_path, tiny_model_dir, inp, engine={"kv_cache_gib": 0.001, "max_num_seqs": 64})
    r = runner.invoke(app, ["plan", str(job), "--dtype", "float32"])
    assert r.exit_code == 0, r.output
    assert "warning: max_num_seqs 64 exceeds" in r.output


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantised_kv_doubles_concurrency_over_bf16(kv_dtype):
    cfg = json.loads((REPO / "examples/configs/llama-3-8b.json").read_text())
    mem = shape_from_config(cfg)
    bf16 = plan(mem, "bfloat16", 40 * 2**30, 8192)
    quant = plan(mem, "bfloat16", 40 * 2**30, 8192, kv_dtype=kv_dtype)
    assert quant["kv_bytes_per_token"] == 2 * 32 * 8 * (128 + 4)  # one fp32 scale per token and head
    assert quant["seqs_that_fit"] >= 1.9 * bf16["seqs_that_fit"]
    r = runner.invoke(app, ["plan", "--model", str(REPO / "examples/configs/llama-3-8b.json"), "--kv-dtype", "int8",
                            "--context", "8192", "--kv-gib", "40"])
    assert r.exit_code == 0 and "KV per token (int8)" in r.output
