"""Random-weight model folders at real shapes, for benchmarks on more than one model size.

    .venv/bin/python examples/make_model_ladder.py [--out /tmp/batchgen-ladder] [--only qwen2.5-1.5b,llama-3-8b]

Each folder is a local HF model (config.json, bf16 safetensors in shards, the bundled SmolLM2
tokenizer) with the named model's architecture and sizes, its vocabulary cut to the tokenizer's
49,152 tokens. The weights are random (normal, std 0.02; norms at 1): the text is noise, the
speed and memory are the real model's. Tensors are made and written one at a time, so even the
8B rung (about 15 GB) needs little memory. Then:

    batchgen bench --model /tmp/batchgen-ladder/qwen2.5-1.5b --dtype bfloat16 --peers ''
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

VOCAB = 49152
# name -> (transformers model_type, config fields)
LADDER = {
    # The default model's shapes (SmolLM2-135M), where its GGUF cannot travel (the GPU check).
    "smollm2-135m": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                                   rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)),
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                                   rope_theta=1e6, max_position_embeddings=32768, rms_norm_eps=1e-6)),
    "llama-3.2-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                   tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072,
                                   rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                                   rms_norm_eps=1e-5)),
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                                   rope_theta=1e6, max_position_embeddings=32768, rms_norm_eps=1e-6)),
    "qwen2.5-3b": ("qwen2", dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                                 num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True,
                                 rope_theta=1e6, max_position_embeddings=32768, rms_norm_eps=1e-6)),
    "llama-3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                                 rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)),
    # Multi-head attention (32 K/V heads) at head_dim 96, fused qkv_proj and gate_up_proj tensors.
    "phi-3-mini": ("phi3", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=False,
                                rope_theta=10000.0, max_position_embeddings=4096,
                                original_max_position_embeddings=4096, rms_norm_eps=1e-5)),
    # A small mixture of experts at Qwen3-MoE's layout (0.55B parameters, 0.17B active per token).
    "qwen3-moe-0.5b": ("qwen3_moe", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=16,
                                         num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                                         num_experts=16, num_experts_per_tok=4, moe_intermediate_size=512,
                                         norm_topk_prob=True, tie_word_embeddings=True, rope_theta=1e6,
                                         max_position_embeddings=32768, rms_norm_eps=1e-6)),
    # Qwen3-30B-A3B's layers (128 experts of 768, 8 per token, 32 query / 4 K/V heads of 128), 6 of
    # its 48: the expert count and sizes a real MoE checkpoint has (3.9B parameters, 0.24B active).
    "qwen3-30b-a3b-6l": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=6,
                                           num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                           num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                           norm_topk_prob=True, tie_word_embeddings=False, rope_theta=1e6,
                                           max_position_embeddings=32768, rms_norm_eps=1e-6)),
    # Mixed sliding-window and full layers (the hybrid KV layout), head_dim 256.
    "gemma-2-2b": ("gemma2", dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                                  num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=4096,
                                  query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                                  final_logit_softcapping=30.0, max_position_embeddings=8192, rms_norm_eps=1e-6,
                                  tie_word_embeddings=True)),
    "gemma-3-1b": ("gemma3_text", dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                                       num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                       sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256,
                                       max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                       rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                        "sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": 1e4}})),
}


def tensors(config, seed: int = 0):
    """(name, tensor) of a llama-family checkpoint with random weights, one at a time (a sparse
    layer's experts under the per-expert names real checkpoints use; Gemma's extra norms)."""
    from batchgen.shapes import QK_NORM_TYPES, ModelShape

    s = ModelShape.from_config(config)
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def norm(n: int) -> torch.Tensor:  # a scale of 1: Gemma stores it as w in (1 + w)
        return (torch.zeros if s.gemma else torch.ones)(n, dtype=torch.bfloat16)

    h, q, kv, inter = s.hidden_size, s.q_size, s.kv_size, s.intermediate_size
    fused = s.model_type == "phi3"  # Phi-3 checkpoints store q/k/v and gate/up fused
    yield "model.embed_tokens.weight", rand(s.vocab_size, h)
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", norm(h)
        if fused:
            yield p + "self_attn.qkv_proj.weight", rand(q + 2 * kv, h)
        else:
            for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                yield p + f"self_attn.{name}.weight", rand(rows, h)
                if s.qkv_bias:
                    yield p + f"self_attn.{name}.bias", rand(rows)
        yield p + "self_attn.o_proj.weight", rand(h, q)
        yield p + "post_attention_layernorm.weight", norm(h)
        if s.gemma:
            yield p + "pre_feedforward_layernorm.weight", norm(h)
            yield p + "post_feedforward_layernorm.weight", norm(h)
        if s.model_type in QK_NORM_TYPES:
            yield p + "self_attn.q_norm.weight", norm(s.head_dim)
            yield p + "self_attn.k_norm.weight", norm(s.head_dim)
        if i in s.moe_layers:
            yield p + "mlp.gate.weight", rand(s.num_experts, h)
            for j in range(s.num_experts):
                e = s.expert_intermediate_size
                yield p + f"mlp.experts.{j}.gate_proj.weight", rand(e, h)
                yield p + f"mlp.experts.{j}.up_proj.weight", rand(e, h)
                yield p + f"mlp.experts.{j}.down_proj.weight", rand(h, e)
            continue
        if fused:
            yield p + "mlp.gate_up_proj.weight", rand(2 * inter, h)
        else:
            yield p + "mlp.gate_proj.weight", rand(inter, h)
            yield p + "mlp.up_proj.weight", rand(inter, h)
        yield p + "mlp.down_proj.weight", rand(h, inter)
    yield "model.norm.weight", norm(h)
    if not s.tie_word_embeddings:
        yield "lm_head.weight", rand(s.vocab_size, h)


def make(name: str, out: Path, tokenizer) -> Path:
    from transformers import AutoConfig

    from batchgen.models.weights import save_safetensors_shards

    folder = out / name
    if (folder / "model.safetensors.index.json").exists():
        return folder
    model_type, fields = LADDER[name]
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, torch_dtype="bfloat16", **fields)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]  # other engines pick their class by it
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    save_safetensors_shards(tensors(config), folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/batchgen-ladder")
    ap.add_argument("--only", default=",".join(LADDER))
    args = ap.parse_args()
    from batchgen.models.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model("default"))
    for name in args.only.split(","):
        print(make(name, Path(args.out), tok), flush=True)


if __name__ == "__main__":
    main()
