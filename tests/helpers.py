"""Helpers shared by the tests (importable: tests/ is on pytest's pythonpath)."""
from __future__ import annotations

import functools


def tiny_hf_model(family: str = "llama", vocab_size: int = 512, seed: int = 0, **overrides):
    """A randomly initialised tiny decoder: Llama with GQA, Qwen3 with q/k norm, Phi-3 (fused
    projections), or a mixture of experts (Mixtral, Qwen2-MoE with a shared expert and one dense
    layer, Qwen3-MoE)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    common.update(overrides)
    if family == "llama":
        cfg = LlamaConfig(**common)
    elif family == "qwen3":
        cfg = Qwen3Config(head_dim=16, **common)
    elif family == "mistral":
        cfg = MistralConfig(**common)
    elif family == "qwen2":
        cfg = Qwen2Config(**common)
    elif family == "phi3":
        cfg = AutoConfig.for_model("phi3", **common)
    elif family == "mixtral":
        cfg = AutoConfig.for_model("mixtral", num_local_experts=4, num_experts_per_tok=2, **common)
    elif family == "qwen2_moe":
        cfg = AutoConfig.for_model("qwen2_moe", num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
                                   shared_expert_intermediate_size=80, mlp_only_layers=[1], norm_topk_prob=False,
                                   **common)
    elif family == "qwen3_moe":
        cfg = AutoConfig.for_model("qwen3_moe", head_dim=16, num_experts=8, num_experts_per_tok=3,
                                   moe_intermediate_size=32, norm_topk_prob=True, **common)
    elif family in ("gemma2", "gemma3_text"):
        # Mixed layers (Gemma 2 alternates sliding and full; Gemma 3 has one full in 3 here), a
        # window shorter than most prompts, query_pre_attn_scalar != head_dim, and for Gemma 2
        # soft caps low enough to change attention.
        gemma = dict(head_dim=16, sliding_window=24, query_pre_attn_scalar=24, num_hidden_layers=4)
        if family == "gemma2":
            gemma.update(attn_logit_softcapping=3.0, final_logit_softcapping=5.0)
        else:
            gemma.update(num_hidden_layers=6, sliding_window_pattern=3,
                         layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                         rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
        gemma.update(overrides)
        cfg = AutoConfig.for_model(family, **{**common, **gemma})
    else:
        raise ValueError(family)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    if family.startswith("gemma"):
        # transformers starts Gemma's (1 + w) norm weights at w = 0: make them matter.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.3)
    return model


def write_prompts(path, n=20, id_prefix="r", extra=None, prompts=None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompts = prompts or [f"Question {i}: say something about the number {i}." for i in range(n)]
    cols = {"id": [f"{id_prefix}{i:04d}" for i in range(len(prompts))], "prompt": prompts}
    cols.update(extra or {})
    pq.write_table(pa.table(cols), path)
    return path


def write_job(tmp_path, model, input_path, out="out", **sections):
    import yaml

    job = {"model": model if isinstance(model, dict) else str(model), "input": {"path": str(input_path), "prompt_column": "prompt", "id_column": "id"},
           "output": {"path": str(tmp_path / out), "rows_per_part": 4},
           "sampling": {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True},
           "engine": {"kv_cache_gib": 0.05}}
    for k, v in sections.items():
        if isinstance(v, dict) and isinstance(job.get(k), dict):
            job[k].update(v)
        else:
            job[k] = v
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(job))
    return p


def read_output(out_dir):
    import glob

    import polars as pl

    files = sorted(glob.glob(f"{out_dir}/parts/*.parquet"))
    return pl.concat([pl.read_parquet(f) for f in files]) if files else None


def engine_specs(**kw):
    """(EngineSpec, ModelSpec) from one set of keywords: dtype and device go to the model section."""
    from batchgen.config import EngineSpec, ModelSpec

    model_kw = {k: kw.pop(k) for k in ("dtype", "device") if k in kw}
    return EngineSpec(**kw), ModelSpec(**model_kw)


def read_rows(input_spec):
    """The whole input through the streaming reader: (index, one RowWindow holding every row)."""
    import numpy as np

    from batchgen.io.sources import open_input

    src = open_input(input_spec)
    index = src.index()
    wins = list(src.windows(index, np.arange(len(index), dtype=np.int64), 1 << 30))
    return index, (wins[0] if wins else None)


def prepare_all(spec, tokenizer, max_len):
    """Every row of a job prepared at once: ({pos: PreparedRow}, {pos: error message})."""
    from batchgen.job.prepare import Preparer

    index, win = read_rows(spec.input)
    out = Preparer(spec, tokenizer, max_len, index).prepare(win)
    return {r.pos: r for r in out.rows}, {e.pos: e.message for e in out.errors}


@functools.lru_cache(maxsize=None)
def gguf_tokenizer(path: str) -> tuple:
    """A GGUF's tokenizer fields (model, tokens, types, merges, bos, eos), read once per process:
    reading the bundled SmolLM2's 49,152 tokens field by field takes seconds."""
    from gguf import GGUFReader

    f = GGUFReader(path).fields

    def strings(key: str) -> tuple:
        return tuple(bytes(f[key].parts[i]).decode() for i in f[key].data)

    return (bytes(f["tokenizer.ggml.model"].parts[-1]).decode(), strings("tokenizer.ggml.tokens"),
            tuple(int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data),
            strings("tokenizer.ggml.merges"), int(f["tokenizer.ggml.bos_token_id"].parts[-1][0]),
            int(f["tokenizer.ggml.eos_token_id"].parts[-1][0]))


def write_gguf(path, model, arch: str, tokenizer_gguf, rope_factors=None):
    """A float32 GGUF of a transformers model as llama.cpp lays it out (its tensor names, Phi-3's
    fused projections, the Qwen MoEs' stacked experts, Gemma's 1 + w norms and soft caps), with the
    metadata transformers reads and
    the tokenizer of another GGUF (the bundled SmolLM2's: the model's vocabulary must match it).
    rope_factors: (long, short) LongRoPE factors, stored as llama.cpp stores them (tensors)."""
    import numpy as np
    from gguf import GGUFWriter

    from batchgen.models.loader import _GGUF_ARCH_LAYER, _GGUF_LAYER, _GGUF_NAMES

    cfg = model.config
    to_gguf = {v: k for k, v in _GGUF_NAMES.items()}
    layer = {v: k for k, v in {**_GGUF_LAYER, **_GGUF_ARCH_LAYER.get(arch, {})}.items()}
    w = GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    w.add_rope_freq_base((rope.get("full_attention") or rope)["rope_theta"])
    if "sliding_attention" in rope:  # Gemma 3
        w.add_float32(f"{arch}.rope.freq_base_swa", rope["sliding_attention"]["rope_theta"])
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", cfg.layer_types.index("full_attention") + 1)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):  # Gemma 2
        if getattr(cfg, key, None):
            w.add_float32(f"{arch}.{key}", getattr(cfg, key))
    w.add_key_length(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    if getattr(cfg, "num_experts", None):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", 0):
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    if rope_factors:
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        for name, f in zip(("rope_factors_long.weight", "rope_factors_short.weight"), rope_factors):
            w.add_tensor(name, np.asarray(f, dtype=np.float32))
    model_name, tokens, types, merges, bos, eos = gguf_tokenizer(str(tokenizer_gguf))
    w.add_tokenizer_model(model_name)
    w.add_token_list(list(tokens))
    w.add_token_types(list(types))
    w.add_token_merges(list(merges))
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    for name, t in model.state_dict().items():
        t = t.detach().float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            t = t + 1.0  # llama.cpp stores Gemma's (1 + w)
        if name in to_gguf:
            w.add_tensor(to_gguf[name], t)
            continue
        i, rest = name[len("model.layers."):].split(".", 1)
        if rest == "mlp.experts.gate_up_proj":  # [experts, 2I, hidden] -> gate and up stacks
            half = t.shape[1] // 2
            w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(t[:, :half]))
            w.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(t[:, half:]))
            continue
        if rest == "mlp.experts.down_proj":
            w.add_tensor(f"blk.{i}.ffn_down_exps.weight", t)
            continue
        base, suffix = rest.rsplit(".", 1)
        if base == "mlp.shared_expert_gate":
            t = t.reshape(-1)
        w.add_tensor(f"blk.{i}.{layer[base]}.{suffix}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
