"""`batchgen plan`: memory arithmetic from a model config alone (no weights).

weights = parameters x dtype bytes; KV per token = 2 (K and V) x layers x KV heads x head_dim x
dtype bytes. For Llama 3 70B in bf16 that is ~141 GB of weights and 320 KiB per token, so one
128k-token sequence needs 40 GiB of KV.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1}


@dataclass
class ModelMemory:
    name: str
    params: int
    layers: int
    kv_heads: int
    head_dim: int
    max_position: int
    sliding_window: int | None

    @classmethod
    def from_config(cls, cfg: dict, name: str = "model") -> "ModelMemory":
        try:
            h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
            heads = cfg["num_attention_heads"]
            kvh = cfg.get("num_key_value_heads") or heads
            d = cfg.get("head_dim") or h // heads
            inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]
        except KeyError as e:
            raise ConfigError(f"{name}: config lacks {e.args[0]!r}; a decoder config.json is needed") from None
        attn = h * heads * d + 2 * h * kvh * d + heads * d * h
        if cfg.get("model_type") == "qwen2" or cfg.get("attention_bias"):
            attn += heads * d + 2 * kvh * d
        per_layer = attn + 3 * h * inter + 2 * h
        params = layers * per_layer + vocab * h * (1 if cfg.get("tie_word_embeddings") else 2) + h
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(name, params, layers, kvh, d, cfg.get("max_position_embeddings", 0), window)

    def weight_bytes(self, dtype: str) -> int:
        return self.params * DTYPE_BYTES[dtype]

    def kv_bytes_per_token(self, dtype: str) -> int:
        # int8 and fp8 KV keep one fp32 scale per token and head beside the values.
        scale = 4 if dtype in ("int8", "fp8") else 0
        return 2 * self.layers * self.kv_heads * (self.head_dim * DTYPE_BYTES[dtype] + scale)


def load_model_config(path: str) -> tuple[dict, str]:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if p.suffix == ".json" and p.is_file():
        return json.loads(p.read_text()), str(p)
    from .models.loader import load_config, resolve_model

    source = resolve_model(path)
    return load_config(source).to_dict(), source.identity


def plan(mem: ModelMemory, dtype: str, kv_budget_bytes: int, seq_tokens: int, batch: int | None = None,
         max_num_seqs: int | None = None, block_size: int = 16, avg_prompt: int | None = None,
         kv_dtype: str | None = None) -> dict:
    """How many sequences of seq_tokens fit the KV budget, and what to set."""
    kv_dtype = kv_dtype or dtype
    per_tok = mem.kv_bytes_per_token(kv_dtype)
    kept = min(seq_tokens, mem.sliding_window) if mem.sliding_window else seq_tokens
    per_seq = -(-kept // block_size) * block_size * per_tok
    fits = kv_budget_bytes // per_seq if per_seq else 0
    suggest_seqs = max(1, min(256, fits))
    suggest_tokens = max(2048, min(16384, (avg_prompt or seq_tokens // 2) + suggest_seqs))
    out = {"model": mem.name, "params": mem.params, "dtype": dtype, "kv_dtype": kv_dtype,
           "weight_bytes": mem.weight_bytes(dtype), "weight_gb": round(mem.weight_bytes(dtype) / 1e9, 1),
           "kv_bytes_per_token": per_tok, "kv_kib_per_token": round(per_tok / 1024, 1),
           "seq_tokens": seq_tokens, "kv_bytes_per_seq": per_seq, "kv_gib_per_seq": round(per_seq / 2**30, 2),
           "kv_budget_gib": round(kv_budget_bytes / 2**30, 2), "seqs_that_fit": fits,
           "suggested_max_num_seqs": suggest_seqs, "suggested_max_num_batched_tokens": suggest_tokens,
           "sliding_window": mem.sliding_window, "warnings": []}
    if mem.sliding_window and seq_tokens > mem.sliding_window:
        out["warnings"].append(f"sliding window {mem.sliding_window}: KV per sequence is bounded by the window")
    if batch is not None:
        need = batch * per_seq
        out["batch"] = batch
        out["kv_gib_for_batch"] = round(need / 2**30, 2)
        if need > kv_budget_bytes:
            out["warnings"].append(f"batch {batch} needs {need / 2**30:.1f} GiB of KV, over the "
                                   f"{kv_budget_bytes / 2**30:.1f} GiB budget")
    if max_num_seqs is not None and fits < max_num_seqs:
        out["warnings"].append(
            f"max_num_seqs {max_num_seqs} exceeds the {fits} sequences of {seq_tokens} tokens the KV budget holds: "
            f"expect constant preemption (thrashing); set max_num_seqs <= {max(fits, 1)} or raise the budget")
    return out


def format_plan(p: dict) -> str:
    lines = [f"model: {p['model']} ({p['params'] / 1e9:.2f} B parameters), dtype {p['dtype']}",
             f"weights: {p['weight_gb']} GB",
             f"KV per token ({p['kv_dtype']}): {p['kv_kib_per_token']} KiB; per sequence of {p['seq_tokens']} tokens: "
             f"{p['kv_gib_per_seq']} GiB"]
    if "batch" in p:
        lines.append(f"batch {p['batch']}: {p['kv_gib_for_batch']} GiB of KV")
    lines += [f"KV budget {p['kv_budget_gib']} GiB holds {p['seqs_that_fit']} such sequences",
              f"suggested: max_num_seqs {p['suggested_max_num_seqs']}, "
              f"max_num_batched_tokens {p['suggested_max_num_batched_tokens']}"]
    lines += [f"warning: {w}" for w in p["warnings"]]
    return "\n".join(lines)
