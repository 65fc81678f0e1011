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
    # Mixture-of-experts (Mixtral, Qwen2-MoE, Qwen3-MoE): experts per sparse layer, experts each
    # token is routed to, one expert's intermediate size, the shared expert's (Qwen2-MoE; 0 = none),
    # whether the top-k routing weights are renormalised to sum to 1, and the layers that are sparse.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()

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
        model_type = _get(cfg, "model_type", "llama")
        layers = need("num_hidden_layers")
        moe: dict[str, Any] = {}
        if model_type == "mixtral":
            moe = dict(num_experts=need("num_local_experts"), experts_per_token=need("num_experts_per_tok"),
                       expert_intermediate_size=need("intermediate_size"), norm_topk_prob=True,
                       moe_layers=tuple(range(layers)))
        elif model_type in ("qwen2_moe", "qwen3_moe") and (experts := _get(cfg, "num_experts")
                                                          or _get(cfg, "num_local_experts") or 0) > 0:
            step, dense = _get(cfg, "decoder_sparse_step", 1) or 1, set(_get(cfg, "mlp_only_layers") or ())
            moe = dict(num_experts=experts, experts_per_token=need("num_experts_per_tok"),
                       expert_intermediate_size=need("moe_intermediate_size"),
                       shared_expert_intermediate_size=_get(cfg, "shared_expert_intermediate_size", 0) or 0,
                       norm_topk_prob=bool(_get(cfg, "norm_topk_prob", False)),
                       moe_layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0))
        return cls(
            model_type=model_type,
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=_get(cfg, "num_key_value_heads") or heads,
            head_dim=_get(cfg, "head_dim") or hidden // heads,
            intermediate_size=need("intermediate_size"),
            vocab_size=need("vocab_size"),
            max_position=_get(cfg, "max_position_embeddings", 0) or 0,
            rms_eps=_get(cfg, "rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
            qkv_bias=(model_type == "qwen2" or (model_type == "qwen2_moe" and bool(_get(cfg, "qkv_bias", True)))
                      or bool(_get(cfg, "attention_bias", False))),
            sliding_window=int(window) if window else None,
            **moe,
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def _attention_params(self) -> int:
        """Matrix parameters of all layers' attention projections (q, k, v, o)."""
        h = self.hidden_size
        return self.num_layers * (h * (self.q_size + 2 * self.kv_size) + self.q_size * h)

    def _mlp_params(self, experts: int) -> int:
        """Matrix parameters of all MLPs when each sparse layer counts `experts` experts."""
        h, sparse = self.hidden_size, len(self.moe_layers)
        dense = (self.num_layers - sparse) * 3 * h * self.intermediate_size
        shared = 3 * h * self.shared_expert_intermediate_size + (h if self.shared_expert_intermediate_size else 0)
        per_sparse = h * self.num_experts + experts * 3 * h * self.expert_intermediate_size + shared
        return dense + sparse * per_sparse

    def non_embedding_params(self) -> int:
        """Parameters that every token multiplies through (2 FLOP each): the layers' matrices, with
        only the experts a token is routed to counted in a sparse layer."""
        return self._attention_params() + self._mlp_params(self.experts_per_token)

    def num_params(self) -> int:
        """Every parameter: the layers' matrices (every expert), biases and norms, the embedding
        and lm_head."""
        h = self.hidden_size
        small = 2 * h + (self.q_size + 2 * self.kv_size if self.qkv_bias else 0)
        if self.model_type in ("qwen3", "qwen3_moe"):
            small += 2 * self.head_dim  # q/k norms
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return (self._attention_params() + self._mlp_params(self.num_experts) + self.num_layers * small
                + embeddings + h)


def rope_parameters(cfg: Any) -> Any:
    """A config's rotary-embedding parameters as written (a transformers config or a config.json
    dict; transformers 5's `rope_parameters` or the older `rope_scaling`), {} where it has none."""
    return _get(cfg, "rope_parameters") or _get(cfg, "rope_scaling") or {}


def rope_kind(rope: dict) -> str:
    """The rope type of rope_parameters(), Phi-3's old `su` named `longrope` as transformers does."""
    kind = rope.get("rope_type") or rope.get("type") or "default"
    return "longrope" if kind == "su" else kind


def kv_bytes_per_token_head(kv_dtype: str, head_dim: int) -> int:
    """Bytes one token takes per KV head in one of K or V (the quantised kinds add a scale)."""
    return head_dim * KV_DTYPE_BYTES[kv_dtype] + (_SCALE_BYTES if kv_dtype in QUANTISED_KV else 0)


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str) -> int:
    """K and V of every layer for one token: 2 x layers x KV heads x (head_dim x dtype bytes)."""
    return 2 * shape.num_layers * shape.num_kv_heads * kv_bytes_per_token_head(kv_dtype, shape.head_dim)
