"""Model shapes and the arithmetic every layer shares: block counts, KV bytes, parameter counts.

Torch-free, so the planner (config only) and the engine (loaded weights) compute the same
numbers from the same code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Bytes per KV element by storage name; the quantised kinds keep one fp32 scale per token and head.
KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8": 1}
QUANTISED_KV = ("int8", "fp8")
_SCALE_BYTES = 4


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative a and positive b."""
    return -(-a // b)


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    rms_eps: float
    tie_word_embeddings: bool
    # Bias on the q/k/v projections (Qwen2, or attention_bias: true).
    qkv_bias: bool = False
    # The uniform sliding window (Mistral-style), or None.
    sliding_window: int | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> "ModelShape":
        """From a transformers config object or a config.json dict. Raises KeyError naming a
        missing required key."""
        def need(key: str) -> Any:
            v = _get(cfg, key)
            if v is None:
                raise KeyError(key)
            return v

        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        window = _get(cfg, "sliding_window") if _get(cfg, "use_sliding_window", True) else None
        return cls(
            model_type=_get(cfg, "model_type", "llama"),
            num_layers=need("num_hidden_layers"),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=_get(cfg, "num_key_value_heads") or heads,
            head_dim=_get(cfg, "head_dim") or hidden // heads,
            intermediate_size=need("intermediate_size"),
            vocab_size=need("vocab_size"),
            max_position=_get(cfg, "max_position_embeddings", 0) or 0,
            rms_eps=_get(cfg, "rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
            qkv_bias=_get(cfg, "model_type") == "qwen2" or bool(_get(cfg, "attention_bias", False)),
            sliding_window=int(window) if window else None,
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def non_embedding_params(self) -> int:
        """Parameters that every token multiplies through (2 FLOP each): the layers' matrices."""
        h = self.hidden_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * self.intermediate_size
        return self.num_layers * per_layer

    def num_params(self) -> int:
        """Every parameter: the layers' matrices, biases and norms, the embedding and lm_head."""
        h = self.hidden_size
        small = 2 * h + (self.q_size + 2 * self.kv_size if self.qkv_bias else 0)
        if self.model_type == "qwen3":
            small += 2 * self.head_dim  # q/k norms
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.non_embedding_params() + self.num_layers * small + embeddings + h


def kv_bytes_per_token_head(kv_dtype: str, head_dim: int) -> int:
    """Bytes one token takes per KV head in one of K or V (the quantised kinds add a scale)."""
    return head_dim * KV_DTYPE_BYTES[kv_dtype] + (_SCALE_BYTES if kv_dtype in QUANTISED_KV else 0)


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str) -> int:
    """K and V of every layer for one token: 2 x layers x KV heads x (head_dim x dtype bytes)."""
    return 2 * shape.num_layers * shape.num_kv_heads * kv_bytes_per_token_head(kv_dtype, shape.head_dim)
