"""End-to-end on the real SmolLM2-135M-Instruct (the bundled default model)."""
import pytest
import torch
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.engine.request import SamplingParams
from batchgen.llm import Engine, GenerationRequest
from batchgen.runner.linear import amx_gemm_available, dpbf16_available, fma_available, onednn_bf16_available
from batchgen.workload import sample_sharegpt
from conftest import REPO
from helpers import engine_specs, read_output

N_PROMPTS, N_NEW, TOP = 12, 32, 5
ONE_AT_A_TIME = 4  # max_num_seqs=1 runs every prompt alone: a few show it

pytestmark = pytest.mark.slow  # the real SmolLM2: `pytest -m 'not slow'` skips these


def test_example_job_answers_paris(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    r = CliRunner().invoke(app, ["run", "jobs/example.yaml", "--set", f"output.path={tmp_path / 'out'}"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    df = read_output(tmp_path / "out")
    assert len(df) == 16
    answer = df.filter(df["id"] == "q000")["text"].item()
    assert "Paris" in answer, answer


@pytest.fixture(scope="module")
def workload(smol_tokenizer):
    return [w.prompt_token_ids for w in sample_sharegpt(smol_tokenizer, N_PROMPTS, output_cap=N_NEW)]


@pytest.fixture(scope="module")
def reference(hf_model, workload):
    """transformers' greedy generate, one prompt at a time, with its top-5 logprobs."""
    out = []
    for p in workload:
        g = hf_model.generate(torch.tensor([p]), max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False,
                              output_scores=True, return_dict_in_generate=True, pad_token_id=2)
        toks = g.sequences[0, len(p):].tolist()
        tops = []
        for s in g.scores:
            v, i = torch.log_softmax(s[0].float(), -1).topk(TOP)
            tops.append(dict(zip(i.tolist(), v.tolist())))
        out.append((toks, tops))
    return out


def generate(hf_model, tokenizer, workload, **cfg):
    e = Engine(hf_model, tokenizer, *engine_specs(kv_cache_gib=0.5, **cfg))
    sp = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True, logprobs=TOP)
    res = {r.request_id: r for r in e.generate(GenerationRequest(str(i), p, sp) for i, p in enumerate(workload))}
    e.kv_manager.check_all_free()
    return [(res[str(i)].token_ids, [top for _, top in res[str(i)].logprobs]) for i in range(len(workload))]


@pytest.mark.parametrize("case", ["one_at_a_time", "batched", "small_chunks"])
def test_plain_fp32_path_matches_transformers_exactly(hf_model, smol_tokenizer, workload, reference, case):
    cfg = {"one_at_a_time": dict(max_num_seqs=1), "batched": dict(), "small_chunks": dict(max_num_batched_tokens=24)}
    n = ONE_AT_A_TIME if case == "one_at_a_time" else len(workload)
    ours = generate(hf_model, smol_tokenizer, workload[:n], linear_path="plain", decode_attention="exact", **cfg[case])
    assert len(ours) == n
    mismatched = [i for i, ((a, _), (b, _)) in enumerate(zip(ours, reference[:n])) if a != b]
    assert not mismatched, f"prompts {mismatched} diverged from transformers"


def check_logprobs_close(ours, ref) -> int:
    """vLLM's rule: sequences may diverge only where each side's token is in the other's top-k;
    after the first divergence the rest is not compared. Returns how many matched exactly."""
    exact = 0
    for k, ((a, a_top), (b, b_top)) in enumerate(zip(ours, ref)):
        for pos, (ta, tb) in enumerate(zip(a, b)):
            if ta != tb:
                assert ta in b_top[pos] and tb in a_top[pos], (
                    f"prompt {k} position {pos}: ours {ta} not in reference top-{TOP} or vice versa")
                break
        else:
            exact += 1
    return exact


@pytest.mark.parametrize("path", [dict(dtype="float32", linear_path="onednn", decode_attention="batched"),
                                  pytest.param(dict(dtype="bfloat16", linear_path="onednn", decode_attention="batched"),
                                               marks=pytest.mark.skipif(not onednn_bf16_available(),
                                                                        reason="oneDNN has no bf16 kernels here")),
                                  pytest.param(dict(dtype="bfloat16", linear_path="dpbf16", decode_attention="batched"),
                                               marks=pytest.mark.skipif(not dpbf16_available(),
                                                                        reason="no AVX512-BF16 here")),
                                  pytest.param(dict(dtype="bfloat16", linear_path="amx", decode_attention="batched"),
                                               marks=pytest.mark.skipif(not amx_gemm_available(),
                                                                        reason="no AMX here")),
                                  # where it is auto's bf16 path (the kernel runs everywhere in test_cpu_gemm)
                                  pytest.param(dict(dtype="bfloat16", linear_path="fma", decode_attention="batched"),
                                               marks=pytest.mark.skipif(onednn_bf16_available() or not fma_available(),
                                                                        reason="oneDNN takes bf16 here"))],
                         ids=["fp32-onednn", "bf16-onednn", "bf16-dpbf16", "bf16-amx", "bf16-fma"])
def test_fast_paths_are_close_to_transformers(hf_model, smol_tokenizer, workload, reference, path, record_property):
    ours = generate(hf_model, smol_tokenizer, workload, **path)
    exact = check_logprobs_close(ours, reference)
    record_property("exact_match", f"{exact}/{len(workload)}")
    print(f"\n{path}: {exact}/{len(workload)} prompts matched transformers exactly")
    if path["dtype"] == "float32":
        assert exact == len(workload)


def test_json_extraction_and_choice_jobs_on_the_real_model(tmp_path):
    """A held-out extraction job: every row that ends with `stop` validates against the schema
    (required fields, an enum, bounded integers); a choice job yields only its labels, with the
    logprob of each label's first token from the distribution over the labels."""
    import json

    import jsonschema
    import pyarrow as pa
    import pyarrow.parquet as pq

    people = [("Maria", 34, "green"), ("Tom", 51, "red"), ("Aiko", 27, "blue"), ("Lars", 68, "green"),
              ("Fatima", 45, "blue"), ("Diego", 19, "red"), ("Chen", 38, "blue"), ("Olga", 73, "red"),
              ("Sam", 22, "green"), ("Priya", 30, "red"), ("Jonas", 56, "blue"), ("Zara", 41, "green")]
    prompts = [f"Extract the person's name, age and favourite colour as JSON: '{n} is {a} years old and loves "
               f"{c}.'" for n, a, c in people]
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age", "colour"],
              "properties": {"name": {"type": "string", "maxLength": 30},
                             "age": {"type": "integer", "minimum": 0, "maximum": 130},
                             "colour": {"type": "string", "enum": ["red", "green", "blue"]}}}
    inp = tmp_path / "people.parquet"
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(len(prompts))], "prompt": prompts}), inp)
    job = tmp_path / "extract.yaml"
    job.write_text(json.dumps({"model": "default", "input": {"path": str(inp), "id_column": "id"},
                               "output": {"path": str(tmp_path / "out")},
                               "sampling": {"max_tokens": 64, "temperature": 0.0,
                                            "response_format": {"type": "json_schema", "schema": schema}},
                               "engine": {"kv_cache_gib": 0.5}}))
    r = CliRunner().invoke(app, ["run", str(job)])
    assert r.exit_code == 0, r.output
    df = read_output(tmp_path / "out")
    stopped = df.filter(df["finish_reason"] == "stop")
    assert stopped.height >= len(prompts) - 1
    for text in stopped["text"]:
        jsonschema.validate(json.loads(text), schema)

    labels = ["positive", "negative"]
    reviews = ["I loved this film, wonderful!", "Terrible service, never again.", "Great value and kind staff.",
               "The food was cold and bland."]
    inp2 = tmp_path / "reviews.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(4)],
                             "prompt": [f"Is this review positive or negative? {t}" for t in reviews]}), inp2)
    job2 = tmp_path / "choice.yaml"
    job2.write_text(json.dumps({"model": "default", "input": {"path": str(inp2), "id_column": "id"},
                                "output": {"path": str(tmp_path / "out2")},
                                "sampling": {"max_tokens": 8, "temperature": 0.0, "logprobs": 20,
                                             "response_format": {"type": "choice", "choices": labels}},
                                "engine": {"kv_cache_gib": 0.5}}))
    assert CliRunner().invoke(app, ["run", str(job2)]).exit_code == 0
    df2 = read_output(tmp_path / "out2")
    assert set(df2["text"]) <= set(labels) and set(df2["finish_reason"]) == {"stop"}
    for lp in df2["logprobs"]:
        first = lp[0]
        allowed = [t for t in first["top"] if t["logprob"] > float("-inf")]
        assert all(any(lab.startswith(t["token"]) for lab in labels) for t in allowed)
        assert abs(sum(torch.tensor([t["logprob"] for t in allowed]).exp().tolist()) - 1) < 1e-3
        assert first["logprob"] == max(t["logprob"] for t in allowed)


def test_gguf_dequantised_by_the_loader_equals_transformers(smol_source):
    """Our tensor-at-a-time GGUF dequantisation (names mapped, llama's q/k rows un-permuted) gives
    exactly the tensors transformers' own GGUF loader gives."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from batchgen.models.loader import gguf_tensors, load_config

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(load_config(smol_source))
    ref = load_gguf_checkpoint(str(smol_source.gguf_file), return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = dict(gguf_tensors(smol_source.gguf_file, load_config(smol_source), torch.float32))
    assert set(ours) == set(ref) - {"lm_head.weight"} or set(ours) == set(ref)
    for name, t in ours.items():
        assert torch.equal(t, torch.as_tensor(ref[name]).float()), name
