"""Model families beyond dense Llama/Qwen: Phi-3 (fused projections), mixtures of experts (Mixtral,
Qwen2-MoE with a shared expert and a dense layer, Qwen3-MoE), RoPE scaling as real checkpoints
use it; greedy tokens equal transformers', and what is not implemented is refused up front."""
import json

import pytest
import torch

from batchgen.engine.request import SamplingParams
from batchgen.errors import ConfigError
from batchgen.kernels.fused_moe import align, fused_moe, fused_moe_reference
from batchgen.llm import Engine, GenerationRequest
from batchgen.models.loader import load_checkpoint, resolve_model
from batchgen.plan import shape_from_config
from helpers import engine_specs, tiny_hf_model, write_gguf
from test_engine import IdTokenizer, _assert_top5_close, engine, hf_greedy, prompts, run

FAMILIES = ["phi3", "mixtral", "qwen2_moe", "qwen3_moe"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel tests run on a GPU where there is one


def generate(model_or_ckpt, ps, n, **kw):
    e = Engine(model_or_ckpt, IdTokenizer(), *engine_specs(kv_cache_gib=0.02, **kw))
    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    got = {r.request_id: r.token_ids for r in e.generate(GenerationRequest(str(i), p, sp) for i, p in enumerate(ps))}
    return [got[str(i)] for i in range(len(ps))]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_greedy_equals_transformers_from_memory_and_folder(tmp_path, family):
    """The plain fp32 path gives transformers' greedy tokens, both from the model in memory
    (transformers' fused expert tensors) and from the folder it saves (per-expert matrices,
    Mixtral's w1/w3/w2 names, Phi-3's qkv_proj/gate_up_proj)."""
    model = tiny_hf_model(family, seed=7)
    ps = prompts(seed=2)
    want = hf_greedy(model, ps, 32)
    exact = dict(linear_path="plain", decode_attention="exact")
    assert generate(model, ps, 32, **exact) == want
    # Chunked prefill (13-token steps) on the same path.
    assert generate(model, ps, 32, max_num_batched_tokens=13, **exact) == want
    model.save_pretrained(tmp_path / family)
    names = json.dumps(sorted(__import__("safetensors").safe_open(str(tmp_path / family / "model.safetensors"),
                                                                   "pt").keys()))
    if family == "mixtral":
        assert "block_sparse_moe.experts.3.w2" in names
    if family == "phi3":
        assert "qkv_proj" in names and "gate_up_proj" in names
    ckpt = load_checkpoint(resolve_model(str(tmp_path / family)))
    assert generate(ckpt, ps, 32, **exact) == want


@pytest.mark.parametrize("family", FAMILIES)
def test_family_prefix_hit_keeps_transformers_tokens(family):
    """Prompts sharing a 48-token prefix, one at a time: the later ones start from the first one's
    cached blocks and still give transformers' greedy tokens."""
    model = tiny_hf_model(family, seed=7)
    prefix = prompts(seed=5, lengths=(48,))[0]
    ps = [prefix + tail for tail in prompts(seed=6, lengths=(7, 12, 20))]
    e = Engine(model, IdTokenizer(), *engine_specs(kv_cache_gib=0.02, max_num_seqs=1, linear_path="plain",
                                                  decode_attention="exact"))
    sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    res = {r.request_id: r for r in e.generate(GenerationRequest(str(i), p, sp) for i, p in enumerate(ps))}
    assert [res[str(i)].token_ids for i in range(3)] == hf_greedy(model, ps, 32)
    assert [res[str(i)].cached_tokens for i in range(3)] == [0, 48, 48]


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_default_cpu_path_agrees_with_transformers(family):
    """The engine's default CPU path (oneDNN GEMMs per expert, the C++ layer ops) on an MoE: the
    same greedy tokens as transformers on nearly every step (fp32 GEMMs may round differently)."""
    model = tiny_hf_model(family, seed=11)
    ps = prompts(seed=4)
    want = hf_greedy(model, ps, 8)
    got = generate(model, ps, 8)
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    assert same >= 0.9 * sum(map(len, want)), (got, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_fast_paths_pass_the_top5_rule(family, dtype):
    """The default CPU path in fp32 and bf16 against the exact path, by vLLM's closeness rule."""
    model = tiny_hf_model(family, seed=13)
    _assert_top5_close(engine(model, dtype=dtype), engine(model, linear_path="plain", decode_attention="exact"),
                       prompts(seed=3))


def test_fused_last_layer_runs_only_the_sampled_rows():
    """The last layer's output projection and MLP see only the rows that are sampled: one per
    prompt in its final prefill chunk and one per decode, while the first layer sees every token."""
    model = tiny_hf_model("llama", seed=13)
    e = engine(model)
    layers = e.runner.model.layers
    assert e.runner.model.fused
    seen = {0: 0, -1: 0}
    for idx in seen:
        lin = layers[idx].o

        def counted(x, lin=lin, idx=idx, call=type(lin).__call__):
            seen[idx] += x.shape[0]
            return call(lin, x)

        layers[idx].o = counted
    ps = prompts(seed=3)
    out = run(e, ps, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    tokens = sum(len(r.token_ids) for r in out.values())
    assert tokens == 6 * len(ps)
    assert seen[-1] == tokens  # every generated token came from one sampled row
    assert seen[0] == sum(map(len, ps)) + tokens - len(ps)


def sharpen_attention(model, by=12.0):
    """Scale q and k so that attention depends strongly on position: a random tiny model's
    near-uniform attention would give the same tokens under any rotary table."""
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if hasattr(attn, "qkv_proj"):
                kv = model.config.num_key_value_heads * attn.head_dim
                attn.qkv_proj.weight[: attn.qkv_proj.weight.shape[0] - kv] *= by
            else:
                attn.q_proj.weight *= by
                attn.k_proj.weight *= by
    return model


ROPES = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_rope_scaling_matches_transformers(kind):
    model = sharpen_attention(tiny_hf_model("llama", seed=5, rope_scaling=dict(ROPES[kind], rope_theta=10000.0)))
    assert model.config.rope_parameters["rope_type"] == kind
    ps = prompts(seed=6)
    assert generate(model, ps, 10, linear_path="plain", decode_attention="exact") == hf_greedy(model, ps, 10)


def test_phi3_longrope_uses_short_factors_within_the_original_length():
    """Phi-3's longrope: sequences within original_max_position_embeddings (96 here; the 84-token
    prompt plus 12 tokens ends at position 95) get transformers' tokens, from the short factors;
    the long factors would give other tokens. (Past that length transformers drops its cache and
    recomputes everything with the long factors; the runner uses them from that position on.)"""
    half = 8  # head_dim 16 -> 8 frequencies
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [4.0 + 2 * i for i in range(half)], "original_max_position_embeddings": 96}
    model = sharpen_attention(tiny_hf_model("phi3", seed=9, rope_scaling=rope, max_position_embeddings=1024,
                                            original_max_position_embeddings=96))
    assert model.config.rope_parameters["original_max_position_embeddings"] == 96
    ps = prompts(seed=8, lengths=(5, 30, 60, 17, 84))
    want = hf_greedy(model, ps, 12)
    assert generate(model, ps, 12, linear_path="plain", decode_attention="exact") == want


@pytest.mark.parametrize("change, match", [
    ({"rope_scaling": {"rope_type": "mrope", "mrope_section": [2, 2, 4]}}, "rope scaling 'mrope' is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
    ({"model_type": "falcon"}, "type 'falcon' is not supported; supported: llama, .*phi3, mixtral.*gemma2"),
])
def test_unimplemented_configs_are_refused_before_any_weight_is_read(tmp_path, change, match):
    model = tiny_hf_model("llama", seed=1)
    model.save_pretrained(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(change)
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "m" / "model.safetensors").write_bytes(b"not read")  # refused before this is opened
    with pytest.raises(ConfigError, match=match):
        resolve_model(str(tmp_path / "m"))


@pytest.mark.parametrize("family", FAMILIES)
def test_planner_counts_every_expert(family):
    model = tiny_hf_model(family, seed=0)
    shape = shape_from_config(model.config.to_dict())
    assert shape.num_params() == sum(p.numel() for p in model.parameters())
    if family != "phi3":
        assert shape.non_embedding_params() < shape.num_params() - shape.vocab_size * shape.hidden_size


@pytest.mark.parametrize("n, hidden, inter, experts, top_k, dtype", [
    (5, 32, 24, 4, 2, torch.float32), (37, 64, 48, 8, 2, torch.bfloat16), (1, 48, 40, 3, 3, torch.float16),
    (19, 32, 16, 6, 1, torch.float32)])
def test_fused_moe_kernel_matches_reference(n, hidden, inter, experts, top_k, dtype):
    """The Triton grouped-GEMM MoE (the interpreter on a CPU) against a per-token fp32 reference."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, hidden, generator=g).to(DEVICE, dtype)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(DEVICE, dtype)
    w_down = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(DEVICE, dtype)
    weights, ids = torch.topk(torch.randn(n, experts, generator=g).softmax(-1).to(DEVICE), top_k)
    out = fused_moe(x, w_gate_up, w_down, weights, ids)
    ref = fused_moe_reference(x, w_gate_up, w_down, weights, ids)
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    assert out.dtype == dtype and (out.float() - ref).abs().max() <= tol * max(1.0, ref.abs().max())


def test_moe_align_puts_each_pair_once_in_its_experts_block():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [3, 2]], device=DEVICE)
    sorted_ids, block_expert = align(ids, num_experts=5, block_m=4)
    pairs = ids.numel()
    real = sorted_ids[sorted_ids < pairs].tolist()
    assert sorted(real) == list(range(pairs))
    for b, e in enumerate(block_expert.tolist()):
        rows = sorted_ids[b * 4 : (b + 1) * 4]
        rows = rows[rows < pairs]
        if e < 0:
            assert rows.numel() == 0
        else:
            assert all(int(ids.flatten()[r]) == e for r in rows.tolist())


@pytest.mark.parametrize("family, arch", [("phi3", "phi3"), ("qwen2_moe", "qwen2moe"), ("qwen3_moe", "qwen3moe")])
def test_gguf_of_phi3_and_the_qwen_moes_gives_the_models_tokens(tmp_path, smol_source, family, arch):
    """A float32 GGUF as llama.cpp writes these families (Phi-3's fused qkv and gate/up and its
    LongRoPE factors as tensors; the MoEs' stacked experts, shared expert and a dense layer):
    dequantised into the cache and run, it gives the original model's greedy tokens. The MoE
    sizes, dense layers and LongRoPE come from the file where transformers' GGUF config lacks them."""
    kw, rope = {}, None
    if family == "phi3":
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [4.0 + 2 * i for i in range(8)], "original_max_position_embeddings": 96}
        kw = dict(rope_scaling=rope, original_max_position_embeddings=96)
    model = sharpen_attention(tiny_hf_model(family, vocab_size=49152, seed=4, **kw))
    gguf = write_gguf(tmp_path / f"{family}.gguf", model, arch, smol_source.gguf_file,
                      (rope["long_factor"], rope["short_factor"]) if rope else None)
    ckpt = load_checkpoint(resolve_model(str(gguf)))
    assert ckpt.config.model_type == family
    ps = prompts(seed=8, lengths=(5, 30, 60, 17, 84))
    assert generate(ckpt, ps, 12, linear_path="plain", decode_attention="exact") == hf_greedy(model, ps, 12)


@pytest.mark.parametrize("family, arch", [("gemma2", "gemma2"), ("gemma3_text", "gemma3")])
def test_gemma_gguf_gives_the_models_tokens(tmp_path, smol_source, family, arch):
    """Gemma GGUFs as llama.cpp writes them (norms stored as 1 + w, Gemma's own norm names, soft
    caps and Gemma 3's local rope base and layer pattern in the metadata): the soft caps, layer
    kinds and per-kind rope, missing from transformers' GGUF config, come from the file; the query
    scale is llama.cpp's rule (head_dim below 27B, which the file cannot say otherwise)."""
    model = sharpen_attention(tiny_hf_model(family, vocab_size=49152, seed=5, query_pre_attn_scalar=16), by=4.0)
    gguf = write_gguf(tmp_path / f"{family}.gguf", model, arch, smol_source.gguf_file)
    ckpt = load_checkpoint(resolve_model(str(gguf)))
    assert ckpt.config.model_type == family and "full_attention" in ckpt.config.layer_types
    ps = prompts(seed=8, lengths=(5, 30, 60, 17, 84))
    assert generate(ckpt, ps, 32, linear_path="plain", decode_attention="exact") == hf_greedy(model, ps, 32)


def test_mixtral_gguf_is_refused_from_its_header(tmp_path):
    """llama.cpp writes Mixtral as a `llama` GGUF with experts, which transformers reads as a dense
    Llama: refused from the header, before anything is dequantised."""
    with pytest.raises(ConfigError, match="with experts \\(Mixtral\\) is not supported"):
        resolve_model(str(header_only_gguf(tmp_path / "m.gguf", "llama", expert_count=8)))


def header_only_gguf(path, arch: str, **metadata):
    """A GGUF of a header alone (two blocks, and e.g. expert_count=8): enough to be refused."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_block_count(2)
    for key, value in metadata.items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
