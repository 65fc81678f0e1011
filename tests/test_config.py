import json

import pytest
import yaml

from batchgen.config import JobSpec, job_json_schema, load_job
from batchgen.errors import ConfigError
from conftest import REPO

MINIMAL = """
model: default
input:
  path: examples/prompts.parquet
  prompt_column: prompt
  id_column: id
output:
  path: out/example
sampling:
  max_tokens: 64
  temperature: 0.0
"""


def _load(tmp_path, text, overrides=None):
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return load_job(p, overrides)


def test_minimal_job_from_the_issue_parses(tmp_path):
    spec = _load(tmp_path, MINIMAL)
    assert spec.model.path == "default" and spec.sampling.max_tokens == 64 and spec.input.id_column == "id"


def test_unknown_key_is_refused_and_named(tmp_path):
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, MINIMAL.replace("max_tokens: 64", "max_tokens: 64\n  temprature: 0.5"))
    assert "sampling.temprature: unknown key" in str(e.value)


def test_bad_value_names_field_and_value(tmp_path):
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, MINIMAL.replace("max_tokens: 64", "max_tokens: -3"))
    assert "sampling.max_tokens" in str(e.value) and "-3" in str(e.value)


def test_set_overrides_dotted_keys(tmp_path):
    spec = _load(tmp_path, MINIMAL, ["sampling.top_k=5", "engine.max_num_seqs=3", "output.order=input"])
    assert spec.sampling.top_k == 5 and spec.engine.max_num_seqs == 3 and spec.output.order == "input"
    with pytest.raises(ConfigError, match="engine.nope"):
        _load(tmp_path, MINIMAL, ["engine.nope=1"])


def test_input_needs_exactly_one_source(tmp_path):
    with pytest.raises(ConfigError, match="exactly one of input.path or input.dataset"):
        _load(tmp_path, MINIMAL.replace("  path: examples/prompts.parquet\n", ""))


def test_not_a_mapping_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="mapping"):
        _load(tmp_path, "- a\n- b\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        _load(tmp_path, "model: [unclosed\n")


def test_committed_schema_is_current():
    committed = json.loads((REPO / "schemas" / "job.schema.json").read_text())
    assert committed == job_json_schema(), "schemas/job.schema.json is stale: run `batchgen schema`"


def test_example_jobs_validate():
    for job in sorted((REPO / "jobs").glob("*.yaml")):
        JobSpec.model_validate(yaml.safe_load(job.read_text()))


def test_output_schema_doc_matches_the_writer():
    import pyarrow as pa

    from batchgen.job.sink import output_schema

    doc = json.loads((REPO / "schemas" / "output.schema.json").read_text())
    # Every optional column at once: n > 1, truncation, logprobs of outputs and prompts.
    from batchgen.job.sink import LOGPROBS_TYPE

    spec = JobSpec.model_validate({"input": {"path": "x"}, "output": {"path": "o"}, "sampling": {"n": 2, "logprobs": 2, "prompt_logprobs": 1},
                                   "on_too_long": "truncate_left"})
    schema = output_schema(spec, pa.string(), {})
    assert schema.names == list(doc["properties"])
    types = {"string": pa.string(), "int32": pa.int32(), "double": pa.float64(), "bool": pa.bool_(),
             str(LOGPROBS_TYPE): LOGPROBS_TYPE}
    assert [types[p["x-arrow-type"]] for p in doc["properties"].values()] == schema.types
