"""Gemma 2 and Gemma 3 on the hybrid KV layout: layers that mix sliding-window and full
attention get one KV pool and block table per kind. Greedy tokens equal transformers' with
prompts longer than the window, chunked prefill, a prefix-cache hit and swapping; the fast paths
stay within vLLM's top-5 rule."""
import json

import pytest
import torch

from batchgen.config import EngineSpec
from batchgen.engine.kv_manager import HybridKVManager
from batchgen.engine.request import SamplingParams
from batchgen.errors import ConfigError
from batchgen.llm import Engine, GenerationRequest
from batchgen.models.loader import load_checkpoint, resolve_model
from batchgen.plan import plan, shape_from_config
from batchgen.runner.build import hybrid_blocks
from helpers import engine_specs, tiny_hf_model
from test_engine import IdTokenizer, _assert_top5_close, engine, hf_greedy, prompts
from test_families import sharpen_attention

EXACT = dict(linear_path="plain", decode_attention="exact")
WINDOW = 24  # tiny_hf_model's Gemma window: most prompts below are longer


@pytest.fixture(scope="module", params=["gemma2", "gemma3_text"])
def gemma(request):
    model = sharpen_attention(tiny_hf_model(request.param, seed=3), by=4.0)
    ps = prompts(seed=2, lengths=(5, 30, 60, 17, 84, 3))
    return request.param, model, ps, hf_greedy(model, ps, 32)


def generate(model, ps, n, **kw):
    e = Engine(model, IdTokenizer(), *engine_specs(**{"kv_cache_gib": 0.02, **kw}))
    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    res = {r.request_id: r for r in e.generate(GenerationRequest(str(i), p, sp) for i, p in enumerate(ps))}
    return e, [res[str(i)] for i in range(len(ps))]


@pytest.mark.parametrize("cfg", [EXACT, dict(EXACT, max_num_batched_tokens=13), dict(linear_path="plain")],
                         ids=["exact", "chunked", "batched"])
def test_gemma_greedy_equals_transformers(gemma, cfg):
    family, model, ps, want = gemma
    e, res = generate(model, ps, 32, **cfg)
    assert [r.token_ids for r in res] == want
    assert e.model.shape.kv_groups == (None, WINDOW) and isinstance(e.kv_manager, HybridKVManager)
    if family == "gemma2":
        assert e.model.shape.attn_softcap == 3.0 and e.model.shape.final_softcap == 5.0
    e.kv_manager.check_all_free()


def test_gemma_from_a_saved_folder(tmp_path, gemma):
    """The streaming loader reads the folder transformers saves (config.json with layer_types and,
    for Gemma 3, rope parameters per layer kind)."""
    family, model, ps, want = gemma
    model.save_pretrained(tmp_path / family)
    cfg = json.loads((tmp_path / family / "config.json").read_text())
    assert "full_attention" in cfg["layer_types"]
    _, res = generate(load_checkpoint(resolve_model(str(tmp_path / family))), ps, 32, **EXACT)
    assert [r.token_ids for r in res] == want


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemma_default_cpu_path_is_close(gemma, dtype):
    """The engine's default CPU path (oneDNN GEMMs, the C++ layer ops, attention on the C++ ops
    with each group's window and Gemma 2's soft cap) by the top-5 rule against the exact path."""
    family, model, ps, _ = gemma
    e = engine(model, dtype=dtype)
    assert e.backend.fused_ops and e.backend.attention == "cpu"
    _assert_top5_close(e, engine(model, **EXACT), ps)


def test_gemma_prefix_hit_far_past_the_window(gemma):
    """Prompts sharing an 80-token prefix, one at a time: later ones reuse the first one's blocks
    (64 tokens, well past the 24-token window) in both KV groups, and the tokens stay transformers'."""
    _, model, _, _ = gemma
    prefix = prompts(seed=5, lengths=(80,))[0]
    ps = [prefix + tail for tail in prompts(seed=6, lengths=(7, 12, 20))]
    e, res = generate(model, ps, 12, max_num_seqs=1, **EXACT)
    assert [r.token_ids for r in res] == hf_greedy(model, ps, 12)
    assert [r.cached_tokens for r in res] == [0, 80, 80]
    e.kv_manager.check_all_free()


def test_sliding_group_keeps_only_its_window(gemma):
    """One 100-token prompt + 60 tokens: the full-attention group holds all 10 blocks, the sliding
    group never more than its window's (cdiv(24 + 16, 16) + 1)."""
    _, model, ps, _ = gemma
    e, _ = generate(model, [ps[4] + ps[2][:16]], 60, max_num_seqs=1, max_num_batched_tokens=16)
    full, sliding = e.kv_manager.groups
    assert full.pool.peak_used == 10
    assert sliding.pool.peak_used <= 4
    assert sliding.window == WINDOW and full.window is None


def test_hybrid_swap_preemption_keeps_transformers_tokens(gemma):
    """A cache too small for the batch with preemption by swapping: the sliding group's tables
    have holes where blocks left the window; only live blocks go to the CPU tier and back."""
    _, model, ps, want = gemma
    per_block = engine(model).kv_bytes_per_token * 16
    e, res = generate(model, ps, 32, kv_cache_gib=12 * per_block / 2**30, cpu_offload_gib=64 * per_block / 2**30,
                      preemption="swap", **EXACT)
    assert [r.token_ids for r in res] == want
    c = e.counters()
    assert c["preemptions_swap"] > 0 and c["swapped_in_blocks"] > 0
    assert [g["window"] for g in c["kv_groups"]] == [None, WINDOW]
    e.kv_manager.check_all_free()


def test_gemma_on_the_triton_kernels(gemma):
    """The CUDA path's kernels (the interpreter here), soft cap and per-group windows included."""
    _, model, ps, want = gemma
    _, res = generate(model, ps[1:3], 12, attention_backend="triton", max_num_batched_tokens=40)
    assert [r.token_ids for r in res] == [w[:12] for w in want[1:3]]


def test_hybrid_sizing_gives_the_full_layers_what_the_window_cannot_use():
    """6 layers (4 sliding, 2 full), window 24: with 2 sequences of at most 32 new tokens a step,
    a sliding layer never holds more than 2 x (2 + 2) + 2 = 10 blocks; the rest of a 600
    layer-block budget goes to the full layers. A budget under the cap splits evenly."""
    shape = shape_from_config(tiny_hf_model("gemma3_text").config.to_dict())
    assert shape.kv_groups == (None, 24) and [shape.group_layers(g) for g in (0, 1)] == [2, 4]
    spec = EngineSpec(max_num_seqs=2, block_size=16, max_num_batched_tokens=32)
    assert hybrid_blocks(spec, shape, 600) == [280, 10]
    assert hybrid_blocks(spec, shape, 30) == [5, 5]


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_planner_counts_gemma_weights_and_both_layer_kinds(family):
    model = tiny_hf_model(family)
    shape = shape_from_config(model.config.to_dict())
    assert shape.num_params() == sum(p.numel() for p in model.parameters())
    p = plan(shape, "float32", 1 << 30, seq_tokens=1000)
    full, sliding = (2, 2) if family == "gemma2" else (2, 4)
    assert p["layers_full"] == full and p["layers_sliding"] == sliding
    # KV per sequence: the full layers keep 1000 tokens, the sliding ones their 24-token window.
    per_layer_token = p["kv_bytes_per_token"] // shape.num_layers
    assert p["kv_bytes_per_seq"] == per_layer_token * (full * 1008 + sliding * 32)


@pytest.mark.parametrize("change, match", [
    ({"layer_types": ["sliding_attention", "chunked_attention", "sliding_attention", "full_attention"]},
     "layer 1 is of kind 'chunked_attention'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "vision": {"rope_type": "default", "rope_theta": 1e4}}}, "rope parameters per"),
])
def test_gemma_configs_we_cannot_run_are_refused_up_front(tmp_path, change, match):
    tiny_hf_model("gemma2").save_pretrained(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg.update(change)
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "m" / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(ConfigError, match=match):
        resolve_model(str(tmp_path / "m"))


def test_final_soft_cap_shapes_the_logprobs(gemma):
    """Gemma 2's final logits are capped (at 5 here, inside the logits' range): the logprobs are
    transformers' capped distribution's."""
    family, model, ps, _ = gemma
    if family != "gemma2":
        pytest.skip("Gemma 3 has no final soft cap")
    e = engine(model, **EXACT)
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=5)
    res = list(e.generate([GenerationRequest("a", ps[2], sp)]))[0]
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([ps[2]])).logits[0, -1].float(), -1)
    vals, ids = want.topk(5)
    first = res.logprobs[0][1]
    assert set(first) == set(ids.tolist())
    assert all(abs(first[t] - v) < 1e-4 for t, v in zip(ids.tolist(), vals.tolist()))


def test_gemma3_multimodal_checkpoint_runs_its_language_model(tmp_path):
    """Gemma 3 4B-27B ship as Gemma3ForConditionalGeneration (a vision tower beside the text
    model): a text job reads only the language model's tensors, from memory (model.language_model.*)
    and from the saved folder (the hub's language_model.model.*), and gives transformers' tokens
    for text-only prompts."""
    from transformers import AutoConfig, Gemma3ForConditionalGeneration

    text = sharpen_attention(tiny_hf_model("gemma3_text", seed=3), by=4.0)
    cfg = AutoConfig.for_model("gemma3", text_config=text.config.to_dict(), mm_tokens_per_image=4,
                               image_token_index=511, boi_token_index=509, eoi_token_index=510,
                               vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                  num_attention_heads=2, image_size=28, patch_size=14))
    model = Gemma3ForConditionalGeneration(cfg).eval()
    model.model.language_model.load_state_dict(text.model.state_dict())
    ps = prompts(seed=2, lengths=(5, 30, 60))
    want = hf_greedy(model, ps, 16)
    assert want == hf_greedy(text, ps, 16)
    _, res = generate(model, ps, 16, **EXACT)
    assert [r.token_ids for r in res] == want
    model.save_pretrained(tmp_path / "mm")
    assert json.loads((tmp_path / "mm" / "config.json").read_text())["model_type"] == "gemma3"
    e, res = generate(load_checkpoint(resolve_model(str(tmp_path / "mm"))), ps, 16, **EXACT)
    assert [r.token_ids for r in res] == want and e.model.shape.kv_groups == (None, WINDOW)
    p = plan(shape_from_config(json.loads((tmp_path / "mm" / "config.json").read_text())), "float32", 1 << 30, 100)
    assert p["layers_sliding"] == 4 and p["params"] == sum(t.numel() for t in text.parameters())
