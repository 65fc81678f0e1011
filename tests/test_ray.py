"""The Ray Data runner against a local Ray instance (ray.init(num_cpus=2))."""
import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_runner_exactly_once_and_resume(tmp_path, tiny_model_dir, local_ray):
    import polars as pl
    from typer.testing import CliRunner

    from batchgen.cli import app

    from batchgen.config import load_job
    from batchgen.ray_runner import run_ray
    from helpers import write_job, write_prompts

    inp = write_prompts(tmp_path / "in.parquet", n=9, prompts=[f"prompt {i}" for i in range(8)] + [""])
    job = load_job(write_job(tmp_path, tiny_model_dir, inp))
    first = run_ray(job, limit=5)
    assert first["rows_done"] == 5
    summary = run_ray(job)
    assert summary["rows_done"] == 9 and summary["rows_error"] == 1
    df = pl.read_parquet(str(tmp_path / "out" / "parts" / "*.parquet"))
    assert sorted(df["id"].to_list()) == [f"r{i:04d}" for i in range(9)]
    assert df.columns[:2] == ["id", "text"] and set(df.filter(pl.col("error").is_null())["completion_tokens"]) == {6}
    # The driver committed through the same ledger as a local run: status and a local rerun agree.
    r = CliRunner().invoke(app, ["status", str(tmp_path / "job.yaml")])
    assert "total: 9/9" in r.output
    assert run_ray(job)["status"] == "already_complete"

    r = CliRunner().invoke(app, ["run", str(tmp_path / "job.yaml"), "--runner", "ray"])
    assert r.exit_code == 0 and "already complete" in r.output
