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


def config_get(cfg: Any, key: str, default: Any = None) -> Any:
    """cfg[key] of a config.json dict, or the attribute of a transformers config object."""
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
    # The sliding window of the model's sliding layers (every layer in Mistral-style models, some
    # in Gemma 2/3), or None.
    sliding_window: int | None = None
    # Per layer: its attention window (sliding_window) or None (full attention). Layers with the
    # same window form one KV group with a block table of its own (the hybrid layout).
    layer_windows: tuple[int | None, ...] = ()
    # Gemma 2/3: RMSNorm scales by (1 + w) in fp32; norms after attention and after the MLP as
    # well as before them; the embedding is scaled by sqrt(hidden); queries scale by
    # query_pre_attn_scalar ** -0.5; GELU-tanh gating; tanh soft-capping of attention scores
    # (Gemma 2) and of the final logits (cap * tanh(x / cap)); 0 = no cap.
    gemma: bool = False
    embed_scale: float = 0.0
    attn_scale: float = 0.0
    hidden_act: str = "silu"
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
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
        cfg = text_config(cfg)

        def need(key: str) -> Any:
            v = config_get(cfg, key)
            if v is None:
                raise KeyError(key)
            return v

        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        model_type = config_get(cfg, "model_type", "llama")
        layers = need("num_hidden_layers")
        windows = layer_windows(cfg, layers)
        window = next((w for w in windows if w), None)
        head_dim = config_get(cfg, "head_dim") or hidden // heads
        gemma = model_type in GEMMA_TYPES
        extra: dict[str, Any] = {}
        if gemma:
            extra = dict(gemma=True, embed_scale=hidden ** 0.5,
                         attn_scale=float(config_get(cfg, "query_pre_attn_scalar") or head_dim) ** -0.5,
                         hidden_act=config_get(cfg, "hidden_activation") or config_get(cfg, "hidden_act") or "gelu_pytorch_tanh",
                         attn_softcap=float(config_get(cfg, "attn_logit_softcapping") or 0.0),
                         final_softcap=float(config_get(cfg, "final_logit_softcapping") or 0.0))
        moe: dict[str, Any] = {}
        if model_type == "mixtral":
            moe = dict(num_experts=need("num_local_experts"), experts_per_token=need("num_experts_per_tok"),
                       expert_intermediate_size=need("intermediate_size"), norm_topk_prob=True,
                       moe_layers=tuple(range(layers)))
        elif model_type in ("qwen2_moe", "qwen3_moe") and (experts := config_get(cfg, "num_experts")
                                                          or config_get(cfg, "num_local_experts") or 0) > 0:
            step, dense = config_get(cfg, "decoder_sparse_step", 1) or 1, set(config_get(cfg, "mlp_only_layers") or ())
            moe = dict(num_experts=experts, experts_per_token=need("num_experts_per_tok"),
                       expert_intermediate_size=need("moe_intermediate_size"),
                       shared_expert_intermediate_size=config_get(cfg, "shared_expert_intermediate_size", 0) or 0,
                       norm_topk_prob=bool(config_get(cfg, "norm_topk_prob", False)),
                       moe_layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0))
        return cls(
            model_type=model_type,
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=config_get(cfg, "num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=need("intermediate_size"),
            vocab_size=need("vocab_size"),
            max_position=config_get(cfg, "max_position_embeddings", 0) or 0,
            rms_eps=config_get(cfg, "rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(config_get(cfg, "tie_word_embeddings", False)),
            qkv_bias=(model_type == "qwen2" or (model_type == "qwen2_moe" and bool(config_get(cfg, "qkv_bias", True)))
                      or bool(config_get(cfg, "attention_bias", False))),
            sliding_window=window,
            layer_windows=windows,
            **moe,
            **extra,
        )

    @property
    def kv_groups(self) -> tuple[int | None, ...]:
        """The distinct attention windows of the layers, full attention (None) first: one KV
        group (pool and block table) each."""
        return tuple(sorted(set(self.layer_windows), key=lambda w: (w is not None, w or 0)))

    @property
    def layer_group(self) -> tuple[int, ...]:
        """Each layer's index into kv_groups."""
        groups = self.kv_groups
        return tuple(groups.index(w) for w in self.layer_windows)

    def group_layers(self, group: int) -> int:
        """How many layers belong to KV group `group`."""
        return self.layer_group.count(group)

    @property
    def attention_scale(self) -> float:
        """The factor applied to q.k scores: head_dim ** -0.5, or Gemma's query_pre_attn_scalar's."""
        return self.attn_scale or self.head_dim ** -0.5

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
        small = (4 if self.gemma else 2) * h + (self.q_size + 2 * self.kv_size if self.qkv_bias else 0)
        if self.model_type in QK_NORM_TYPES:
            small += 2 * self.head_dim  # q/k norms
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return (self._attention_params() + self._mlp_params(self.num_experts) + self.num_layers * small
                + embeddings + h)


GEMMA_TYPES = ("gemma2", "gemma3_text")
# Multimodal wrappers whose language model we run (text in, text out): model_type -> the
# prefixes its checkpoints put before the text model's `model.` tensors (transformers' in-memory
# layout, then the hub's).
TEXT_PARTS = {"gemma3": ("model.language_model.", "language_model.model.")}


def text_config(cfg: Any) -> Any:
    """The language model's config of a multimodal wrapper (Gemma 3's text_config), else cfg."""
    if config_get(cfg, "model_type") in TEXT_PARTS and config_get(cfg, "text_config") is not None:
        return config_get(cfg, "text_config")
    return cfg


# Families with per-head RMSNorms on q and k before the rotary embedding.
QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3_text")
# Layer kinds of a config's `layer_types` and whether each is windowed.
LAYER_KINDS = {"full_attention": False, "sliding_attention": True}


def layer_windows(cfg: Any, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's attention window from `layer_types` (Gemma 2/3, Qwen2's max_window_layers),
    else the uniform `sliding_window` (Mistral; Qwen2 only with use_sliding_window). Raises
    ValueError naming a layer kind other than full or sliding attention."""
    window = config_get(cfg, "sliding_window")
    kinds = config_get(cfg, "layer_types")
    model_type = config_get(cfg, "model_type")
    if not kinds and model_type in GEMMA_TYPES and window:
        # An older config.json without layer_types: Gemma 2 alternates (sliding first), Gemma 3
        # has one full layer in every sliding_window_pattern (transformers' derivation).
        every = 2 if model_type == "gemma2" else (config_get(cfg, "sliding_window_pattern") or 6)
        kinds = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)]
    if kinds:
        if len(kinds) != num_layers:
            raise ValueError(f"layer_types lists {len(kinds)} layers for num_hidden_layers {num_layers}")
        for i, kind in enumerate(kinds):
            if kind not in LAYER_KINDS:
                raise ValueError(f"layer {i} is of kind {kind!r} (supported: {', '.join(LAYER_KINDS)})")
            if LAYER_KINDS[kind] and not window:
                raise ValueError(f"layer {i} is {kind} but the config has no sliding_window")
        return tuple(int(window) if LAYER_KINDS[k] else None for k in kinds)
    uniform = int(window) if window and config_get(cfg, "use_sliding_window", True) else None
    return (uniform,) * num_layers


def rope_parameters(cfg: Any) -> Any:
    """A config's rotary-embedding parameters as written (a transformers config or a config.json
    dict; transformers 5's `rope_parameters` or the older `rope_scaling`), {} where it has none."""
    return config_get(cfg, "rope_parameters") or config_get(cfg, "rope_scaling") or {}


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
