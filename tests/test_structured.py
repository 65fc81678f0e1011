"""Structured output (xgrammar constraints) and prompt logprobs, on the tiny random model: what the
constraint lets through, how rows end, per-row and OpenAI forms, and everything else still works
(n > 1, seeds, stop strings, the prefix cache, preemption, resume)."""
import json

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.engine.request import SamplingParams
from batchgen.llm import GenerationRequest
from helpers import engine_specs, read_output, write_job, write_prompts

runner = CliRunner()

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["label", "score"],
          "properties": {"label": {"type": "string", "enum": ["cat", "dog", "bird"]},
                         "score": {"type": "integer", "minimum": 0, "maximum": 9}}}


def cli(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from batchgen.models.loader import load_hf_model, load_tokenizer, resolve_model

    src = resolve_model(str(tiny_model_dir))
    return load_hf_model(src), load_tokenizer(src)


def engine(tiny, **kw):
    from batchgen.llm import Engine

    hf, tok = tiny
    kw.setdefault("kv_cache_gib", 0.05)
    return Engine(hf, tok, *engine_specs(**kw))


def prompts(tok, n=6):
    return [tok(f"Question {i}: what animal is this?").input_ids for i in range(n)]


def run(e, ps, sp):
    return {(r.request_id, r.sample_index): r for r in e.generate(GenerationRequest(str(i), p, sp)
                                                                   for i, p in enumerate(ps))}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_json_schema_row_that_stops_validates(tiny, temperature):
    sp = SamplingParams(max_tokens=40, temperature=temperature, seed=3,
                        response_format={"type": "json_schema", "schema": SCHEMA})
    res = run(engine(tiny), prompts(tiny[1]), sp)
    stopped = [r for r in res.values() if r.finish_reason == "stop"]
    assert stopped, "a tiny random model still completes this small grammar"
    for r in stopped:
        jsonschema.validate(json.loads(r.text), SCHEMA)


def test_choices_yield_only_the_labels_and_logprobs_over_the_allowed_tokens(tiny):
    hf, tok = tiny
    labels = ("alpha", "beta", "gamma")
    sp = SamplingParams(max_tokens=8, temperature=0.0, logprobs=20, response_format={"type": "choice", "choices": labels})
    res = run(engine(tiny), prompts(tok), sp)
    for r in res.values():
        assert r.text in labels and r.finish_reason == "stop"
        lp, top = r.logprobs[0]
        # The first token is drawn from tokens that start a label only (any tokenization of it):
        # every other token has probability 0, and the allowed ones sum to 1.
        allowed = {t: v for t, v in top.items() if v > float("-inf")}
        assert 1 < len(allowed) < 20
        assert all(any(lab.startswith(tok.decode([t])) for lab in labels) for t in allowed), allowed
        assert abs(sum(torch.tensor(list(allowed.values())).exp().tolist()) - 1) < 1e-4
        assert lp == max(allowed.values()), "greedy takes the most likely allowed token"


def test_regex_grammar_invalid_constraints_and_length_cuts(tiny):
    hf, tok = tiny
    e = engine(tiny)
    reqs = [GenerationRequest("date", prompts(tok)[0], SamplingParams(max_tokens=20, temperature=1.0, seed=1,
                              response_format={"type": "regex", "pattern": r"\d{4}-\d{2}-\d{2}"})),
            GenerationRequest("ab", prompts(tok)[1], SamplingParams(max_tokens=20, temperature=1.0, seed=2,
                              response_format={"type": "grammar", "ebnf": 'root ::= ("a" | "b")+ "."'})),
            GenerationRequest("bad", prompts(tok)[2], SamplingParams(max_tokens=5, response_format={
                "type": "json_schema", "schema": {"type": "object", "properties": {"x": {"type": "no-such-type"}}}})),
            GenerationRequest("cut", prompts(tok)[3], SamplingParams(max_tokens=3, temperature=0.0,
                              response_format={"type": "regex", "pattern": r"x{50}"}))]
    res = {r.request_id: r for r in e.generate(reqs)}
    import re

    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", res["date"].text) and res["date"].finish_reason == "stop"
    assert re.fullmatch(r"[ab]+\.", res["ab"].text) or res["ab"].finish_reason == "length"
    assert res["bad"].finish_reason == "error" and "invalid JSON schema" in res["bad"].error
    assert res["cut"].finish_reason == "length" and len(res["cut"].token_ids) == 3 and set(res["cut"].text) == {"x"}


def test_constraints_with_n_seeds_stop_strings_prefix_cache_and_preemption(tiny):
    hf, tok = tiny
    fmt = {"type": "json_schema", "schema": SCHEMA}
    sp = SamplingParams(max_tokens=40, temperature=0.9, seed=5, n=3, response_format=fmt)
    base = run(engine(tiny), prompts(tok), sp)
    # A tiny KV cache forces preemptions; the prefix cache and swapping are on; same seeds, same text.
    per_block = engine(tiny).kv_bytes_per_token * 16
    tight = engine(tiny, kv_cache_gib=14 * per_block / 2**30, cpu_offload_gib=64 * per_block / 2**30, max_num_seqs=8)
    again = run(tight, prompts(tok), sp)
    assert tight.scheduler.stats.num_preemptions > 0
    assert {k: r.text for k, r in again.items()} == {k: r.text for k, r in base.items()}
    for r in base.values():
        if r.finish_reason == "stop":
            jsonschema.validate(json.loads(r.text), SCHEMA)
    stop = run(engine(tiny), prompts(tok), SamplingParams(max_tokens=40, temperature=0.0, stop=('"score"',),
                                                          response_format=fmt))
    assert all(r.text.startswith('{"label": "') and '"score"' not in r.text for r in stop.values())


def test_prompt_logprobs_equal_a_plain_forward(tiny):
    """Each prompt token's logprob (and top-2) equals log_softmax of transformers' own logits at the
    position before it, with chunked prefill and a prefix-cache hit available (not taken)."""
    hf, tok = tiny
    ps = [tok("The quick brown fox jumps over the lazy dog and runs far away").input_ids,
          tok("The quick brown fox jumps over the lazy cat").input_ids]
    e = engine(tiny, max_num_batched_tokens=5)
    res = run(e, ps, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))
    for i, p in enumerate(ps):
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)
        got = res[(str(i), 0)].prompt_logprobs
        assert len(got) == len(p) - 1
        for k, (lp, top) in enumerate(got):
            assert abs(lp - want[k, p[k + 1]].item()) < 1e-4
            vals, idx = want[k].topk(2)
            assert list(top) == idx.tolist()


def test_a_constrained_job_per_row_forms_openai_and_fingerprint(tmp_path, tiny_model_dir):
    inp = tmp_path / "in.parquet"
    rows = [None, json.dumps({"type": "choice", "choices": ["x", "y"]}), json.dumps({"type": "regex", "pattern": "("}),
            "not json"]
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(4)], "prompt": [f"p{i}" for i in range(4)], "rf": rows}),
                   inp)
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    job = write_job(tmp_path, tiny_model_dir, inp,
                    sampling={"max_tokens": 40, "temperature": 0.0,
                              "response_format": {"type": "json_schema", "schema": str(schema_file)}},
                    input={"sampling_columns": {"response_format": "rf"}})
    r = cli("run", job)
    assert r.exit_code == 0, r.output
    df = read_output(tmp_path / "out").sort("id")
    by = dict(zip(df["id"], zip(df["text"], df["finish_reason"], df["error"])))
    if by["r0"][1] == "stop":
        jsonschema.validate(json.loads(by["r0"][0]), SCHEMA)
    assert by["r1"][0] in ("x", "y")
    assert "column 'rf': invalid regex" in by["r2"][2] and "column 'rf': bad per-row response_format (not JSON" in by["r3"][2]
    schema_file.write_text(json.dumps({**SCHEMA, "required": ["label"]}))
    r = runner.invoke(app, ["run", str(job), "--limit", "1", "--restart"])
    assert r.exit_code == 0
    schema_file.write_text(json.dumps(SCHEMA))
    r = runner.invoke(app, ["run", str(job)])
    assert r.exit_code == 1 and "changed: sampling" in r.output, "a changed schema is a different job"

    src = tmp_path / "b.jsonl"
    fmt = {"type": "json_schema", "json_schema": {"name": "animal", "strict": True, "schema": SCHEMA}}
    src.write_text("\n".join(json.dumps({"custom_id": f"c{i}", "body": {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "response_format": f}})
        for i, f in enumerate([fmt, {"type": "text"}, {"type": "json_object"}, {"type": "yaml"}])) + "\n")
    ojob = tmp_path / "o.yaml"
    ojob.write_text(f"model: {tiny_model_dir}\ninput: {{format: openai_batch, path: {src}}}\n"
                    f"output: {{path: {tmp_path / 'oout'}}}\nsampling: {{temperature: 0.0}}\n")
    assert cli("run", ojob).exit_code == 0
    odf = read_output(tmp_path / "oout")
    err = dict(zip(odf["id"], odf["error"]))
    assert "response_format.type 'yaml'" in err["c3"] and err["c0"] is None and err["c1"] is None
    texts = dict(zip(odf["id"], zip(odf["text"], odf["finish_reason"])))
    if texts["c0"][1] == "stop":
        jsonschema.validate(json.loads(texts["c0"][0]), SCHEMA)
    if texts["c2"][1] == "stop":
        assert isinstance(json.loads(texts["c2"][0]), dict)


def test_prompt_logprobs_column(tmp_path, tiny_model_dir):
    inp = write_prompts(tmp_path / "in.parquet", n=3)
    job = write_job(tmp_path, tiny_model_dir, inp, sampling={"max_tokens": 2, "temperature": 0.0, "prompt_logprobs": 1,
                                                             "logprobs": 0})
    assert cli("run", job).exit_code == 0
    df = read_output(tmp_path / "out")
    for row in df.iter_rows(named=True):
        assert len(row["prompt_logprobs"]) == row["prompt_tokens"] - 1
        assert all(len(t["top"]) == 1 and t["logprob"] <= 0 for t in row["prompt_logprobs"])
        assert len(row["logprobs"]) == 2 and all(t["top"] == [] for t in row["logprobs"])
