"""Circular (sliding-window) KV: a tiny Mistral with a window shorter than its prompts."""
import pytest

from batchgen.engine.request import SamplingParams
from batchgen.llm import Engine, GenerationRequest
from batchgen.shapes import cdiv
from helpers import engine_specs, tiny_hf_model
from test_engine import IdTokenizer, hf_greedy, prompts


@pytest.fixture(scope="module", params=[24, 16])
def windowed(request):
    model = tiny_hf_model("mistral", sliding_window=request.param)
    ps = prompts(seed=11, lengths=(70, 5, 41, 100, 23))
    return request.param, model, ps, hf_greedy(model, ps, 30)


def _run(model, ps, **cfg):
    e = Engine(model, IdTokenizer(), *engine_specs(kv_cache_gib=0.02, **cfg))
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    res = {}
    gen = e.generate(GenerationRequest(str(i), p, sp) for i, p in enumerate(ps))
    for r in gen:
        res[r.request_id] = r.token_ids
    return e, res


@pytest.mark.parametrize("cfg", [dict(decode_attention="exact"), dict(decode_attention="batched"),
                                 dict(decode_attention="batched", max_num_batched_tokens=13)],
                         ids=["exact", "batched", "chunked"])
def test_window_matches_transformers(windowed, cfg):
    _assert_window_matches(windowed, **cfg)


@pytest.mark.parametrize("windowed", [16], indirect=True)  # one window: Triton's interpreter is slow
def test_window_on_the_triton_kernels_matches_transformers(windowed):
    e = _assert_window_matches(windowed, attention_backend="triton", max_num_batched_tokens=40)
    assert e.backend.attention == "triton"


def _assert_window_matches(windowed, **cfg):
    """Greedy tokens equal transformers' for every prompt, and every block is free afterwards."""
    window, model, ps, ref = windowed
    e, res = _run(model, ps, **cfg)
    assert e.window == window
    for i, want in enumerate(ref):
        assert res[str(i)] == want, f"prompt {i} (len {len(ps[i])}) diverged"
    e.kv_manager.check_all_free()
    return e


def test_window_bounds_kv_per_sequence(windowed):
    window, model, ps, _ = windowed
    e = Engine(model, IdTokenizer(), *engine_specs(kv_cache_gib=0.02, max_num_seqs=1, max_num_batched_tokens=16))
    sp = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    list(e.generate([GenerationRequest("long", ps[3], sp)]))  # 100 + 60 tokens = 10 blocks without a window
    bound = cdiv(window + 16, 16) + 1
    assert e.scheduler.stats.peak_kv_blocks <= bound < 10


def test_qwen2_max_window_layers_runs_mixed_layers_on_hybrid_kv():
    """Qwen2 with use_sliding_window and max_window_layers: full attention below that layer,
    the window above it (transformers' layer_types), one KV group each; greedy tokens equal
    transformers' with prompts longer than the window."""
    from test_families import sharpen_attention

    model = sharpen_attention(tiny_hf_model("qwen2", seed=3, use_sliding_window=True, sliding_window=24,
                                            max_window_layers=1), by=4.0)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    ps = prompts(seed=2, lengths=(5, 30, 60, 84))
    e, res = _run(model, ps, decode_attention="exact", linear_path="plain")
    assert e.model.shape.kv_groups == (None, 24)
    assert [res[str(i)] for i in range(len(ps))] == hf_greedy(model, ps, 30)
    e.kv_manager.check_all_free()
