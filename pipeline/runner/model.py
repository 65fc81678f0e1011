"""A lean decoder for the Llama family and its relatives (Llama, Mistral, Qwen2, Qwen3, SmolLM,
Phi-3, Gemma 2 and Gemma 3, and the mixture-of-experts Mixtral, Qwen2-MoE and Qwen3-MoE) over a
paged KV cache.

Weights are read a tensor at a time from the checkpoint (models.weights); the forward pass is
ours: one flat varlen batch, fused QKV and gate/up GEMMs, logits only at sampled positions. The
arithmetic of each op follows transformers' so the fp32 `plain` path reproduces its greedy
tokens exactly.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..shapes import ModelShape, rope_kind, rope_parameters
from .attention import AttentionMetadata, paged_attention
from .linear import Linear, own_bf16_path
from .moe import DenseMLP, SparseMoE, silu_mul_reference


@functools.lru_cache(maxsize=None)
def _native_bf16() -> bool:
    """The CPU probe, once per process: verified_greedy asks it every step."""
    cpu = getattr(torch, "cpu", None)
    try:
        return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())
    except AttributeError:  # a torch without the probes
        return False


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' LlamaRMSNorm: normalise in fp32, scale in the input dtype.
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma RMSNorm, with weight already (1 + w): normalise and scale in fp32,
    then round to the input dtype."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * weight.to(torch.float32)).to(x.dtype)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[n, 2I] (gate, then up) -> gelu_tanh(gate) * up (Gemma's gelu_pytorch_tanh gating)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


_GATED_ACTS = {"silu": silu_mul_reference, "gelu_pytorch_tanh": gelu_tanh_mul, "gelu_tanh": gelu_tanh_mul}


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma 2's logit soft-capping), as transformers computes it."""
    return torch.tanh(x / cap) * cap


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    # The norm before the MLP (Llama's post_attention_layernorm, Gemma's pre_feedforward_layernorm).
    post_norm: torch.Tensor
    mlp: DenseMLP | SparseMoE
    # Gemma: norms of the attention output and of the MLP output, before each residual add.
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    # Its KV group (ModelShape.kv_groups) and rotary table (CausalLM.rope).
    group: int = 0
    rope: int = 0


def rotary_tables(config, positions: int, layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [positions, head_dim] from the model family's own transformers rotary module, built
    from the config alone (no weights): it covers every rope scaling transformers implements
    (models.loader.check_rope refuses the rest). longrope: the short factors below
    original_max_position_embeddings and the long ones from there on, per position. That is
    transformers' result for every sequence within the original length; past it, transformers
    drops its KV cache and recomputes the whole sequence with the long factors, which a paged
    cache would pay for with a second prefill, so the earlier positions keep the short ones.
    layer_type: the table of one layer kind, where the rope parameters are per kind (Gemma 3's
    local and global bases)."""
    import importlib

    # The modeling module beside the config's (gemma3_text's lives in models.gemma3).
    mod = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    cls = next(getattr(mod, n) for n in dir(mod) if n.endswith("RotaryEmbedding") and not n.startswith("_"))
    rope = rope_parameters(config)
    if layer_type is not None:
        rope = rope[layer_type]
    split = positions
    if rope_kind(rope) == "longrope":
        split = min(positions, rope.get("original_max_position_embeddings")
                    or getattr(config, "original_max_position_embeddings", positions))
    rotary = cls(config)
    x = torch.zeros(1, dtype=torch.float32)
    extra = (layer_type,) if layer_type is not None else ()
    with torch.no_grad():
        parts = [rotary(x, torch.arange(lo, hi)[None], *extra) for lo, hi in ((0, split), (split, positions))
                 if hi > lo]
    return torch.cat([c[0] for c, _ in parts]), torch.cat([s[0] for _, s in parts])


class CausalLM:
    def __init__(self, checkpoint, dtype: torch.dtype = torch.float32, device: str = "cpu", linear_path: str = "plain",
                 fused: bool = False, on_layer=None, triton_ops: bool = False) -> None:
        """checkpoint: a models.weights.Checkpoint (or a transformers model in memory), read a
        tensor at a time straight into this layout in `dtype` on `device`: the fused QKV and
        gate/up matrices are packed layer by layer, so the host holds one layer's source tensors
        at most besides the result. fused: the C++ CPU layer ops (the engine's choice);
        triton_ops: the same layer body over the Triton layer ops (CUDA, or the interpreter).
        on_layer(i) is called after each layer (a signal check)."""
        from ..models.weights import Checkpoint, text_part

        ckpt = Checkpoint.of(checkpoint)
        w, cfg = text_part(ckpt.weights, ckpt.config)
        self.shape = s = ModelShape.from_config(cfg)
        self.dtype = dtype
        self.device = torch.device(device)
        self.scale = s.attention_scale
        # Gemma scales its norms by (1 + w): added once here, in fp32, then stored in the model dtype.
        self._norm = gemma_rms_norm if s.gemma else rms_norm
        self._act_mul = _GATED_ACTS.get(s.hidden_act)
        if self._act_mul is None:
            raise ConfigError(f"model: activation {s.hidden_act!r} is not supported (supported: {', '.join(_GATED_ACTS)})")
        h, q, kv, inter = s.hidden_size, s.q_size, s.kv_size, s.intermediate_size

        def t(name: str, shape: list[int]) -> torch.Tensor:
            x = w.get(name)
            if list(x.shape) != shape:
                raise ConfigError(f"model: {w.where(name)}: tensor {name!r} has shape {list(x.shape)}; the config "
                                  f"({s.model_type}, hidden {h}, heads {s.num_heads}/{s.num_kv_heads}, head_dim "
                                  f"{s.head_dim}) needs {shape}")
            return x.detach().to(device=self.device, dtype=dtype).contiguous()

        def norm(name: str, size: int) -> torch.Tensor:
            if not s.gemma:
                return t(name, [size])
            return (1.0 + t(name, [size]).float()).to(dtype)

        # the gate/up activation, for GEMMs that apply it in their epilogue (Linear's gated)
        gated = "silu" if s.hidden_act == "silu" else "gelu_tanh" if s.hidden_act in ("gelu_pytorch_tanh", "gelu_tanh") else None

        def lin(prefix: str, parts: list[tuple[str, int]], cols: int, fused: str | None = None,
                gated: str | None = None) -> Linear:
            """The parts' weights stacked by rows, or the checkpoint's own fused matrix (Phi-3's
            qkv_proj and gate_up_proj) where it has one."""
            if fused is not None and w.has(f"{prefix}{fused}.weight"):
                parts = [(fused, sum(rows for _, rows in parts))]
            weight = torch.cat([t(f"{prefix}{n}.weight", [rows, cols]) for n, rows in parts], 0)
            bias = None
            if w.has(f"{prefix}{parts[0][0]}.bias"):
                bias = torch.cat([t(f"{prefix}{n}.bias", [rows]) for n, rows in parts], 0)
            return Linear(weight, bias, linear_path, gated=gated)

        def mlp(p: str, i: int) -> DenseMLP | SparseMoE:
            if i not in s.moe_layers:
                return DenseMLP(lin(p + "mlp.", [("gate_proj", inter), ("up_proj", inter)], h, fused="gate_up_proj",
                                    gated=gated),
                                lin(p + "mlp.", [("down_proj", h)], inter))
            return self._sparse_moe(w, t, lin, p, linear_path, gated)

        def opt_norm(name: str, size: int) -> torch.Tensor | None:
            return norm(name, size) if w.has(name) else None

        # One rotary table per layer kind where the rope parameters are per kind (Gemma 3).
        kinds = ["sliding_attention" if win else "full_attention" for win in s.layer_windows]
        per_kind = sorted(set(kinds)) if any(isinstance(v, dict) for v in rope_parameters(cfg).values()) else [None]
        self.embed = t("model.embed_tokens.weight", [s.vocab_size, h])
        self.layers: list[Layer] = []
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            gemma = s.gemma
            self.layers.append(Layer(
                input_norm=norm(p + "input_layernorm.weight", h),
                qkv=lin(p + "self_attn.", [("q_proj", q), ("k_proj", kv), ("v_proj", kv)], h, fused="qkv_proj"),
                q_norm=opt_norm(p + "self_attn.q_norm.weight", s.head_dim),
                k_norm=opt_norm(p + "self_attn.k_norm.weight", s.head_dim),
                o=lin(p + "self_attn.", [("o_proj", h)], q),
                post_norm=norm(p + ("pre_feedforward_layernorm" if gemma else "post_attention_layernorm") + ".weight", h),
                mlp=mlp(p, i),
                attn_out_norm=norm(p + "post_attention_layernorm.weight", h) if gemma else None,
                mlp_out_norm=norm(p + "post_feedforward_layernorm.weight", h) if gemma else None,
                group=s.layer_group[i],
                rope=per_kind.index(kinds[i]) if per_kind != [None] else 0,
            ))
            if on_layer is not None:
                on_layer(i)
        self.norm = norm("model.norm.weight", h)
        # Tied: the same values as the embedding, kept once.
        tied = s.tie_word_embeddings or not w.has("lm_head.weight")
        self._lm_head_weight = self.embed if tied else t("lm_head.weight", [s.vocab_size, h])
        self.lm_head = Linear(self._lm_head_weight, None, linear_path)
        # (bf16 Linear, fp32 weight, row norms) for greedy_tokens(), made on first use.
        self._lm_head_bf16 = None
        self.q_norm_eps = s.rms_eps
        # (cos, sin) [max_position, head_dim] per rotary table.
        self.rope = [tuple(x.to(device=self.device, dtype=dtype) for x in rotary_tables(cfg, s.max_position, kind))
                     for kind in per_kind]
        self.cos, self.sin = self.rope[0]
        self.fused = fused
        self.triton_ops = triton_ops and not fused

    def _sparse_moe(self, w, t, lin, p: str, linear_path: str, gated: str | None) -> SparseMoE:
        """A sparse layer's router and experts, from transformers' in-memory layout (experts as
        [experts, 2I, hidden] and [experts, hidden, I]) or a checkpoint's per-expert matrices
        (Mixtral's block_sparse_moe.experts.j.w1/w3/w2, the Qwen MoEs' mlp.experts.j.*_proj)."""
        s = self.shape
        h, e, inter = s.hidden_size, s.num_experts, s.expert_intermediate_size
        moe = p + ("block_sparse_moe." if w.has(p + "block_sparse_moe.gate.weight") else "mlp.")
        router = t(moe + "gate.weight", [e, h])
        if w.has(moe + "experts.gate_up_proj"):
            stacked_gu = t(moe + "experts.gate_up_proj", [e, 2 * inter, h])
            stacked_d = t(moe + "experts.down_proj", [e, h, inter])
            gate_up, down = list(stacked_gu.unbind(0)), list(stacked_d.unbind(0))
        else:
            names = (("w1", "w3"), "w2") if w.has(moe + "experts.0.w1.weight") else (("gate_proj", "up_proj"), "down_proj")
            gate_up = [torch.cat([t(f"{moe}experts.{j}.{n}.weight", [inter, h]) for n in names[0]], 0)
                       for j in range(e)]
            down = [t(f"{moe}experts.{j}.{names[1]}.weight", [h, inter]) for j in range(e)]
        shared = shared_gate = None
        if s.shared_expert_intermediate_size:
            si = s.shared_expert_intermediate_size
            shared = DenseMLP(lin(moe + "shared_expert.", [("gate_proj", si), ("up_proj", si)], h),
                              lin(moe + "shared_expert.", [("down_proj", h)], si))
            shared_gate = t(moe + "shared_expert_gate.weight", [1, h])
        return SparseMoE(router, gate_up, down, s.experts_per_token, s.norm_topk_prob,
                         fp32_weights=s.model_type == "mixtral", linear_path=linear_path, shared=shared,
                         shared_gate=shared_gate, gated=gated)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], sample_idx: torch.Tensor,
                logits: bool = True) -> torch.Tensor:
        """input_ids/positions [num_tokens] -> logits [num_sampled, vocab] (fp32; the model dtype
        on the fused path, where the sampler converts them). With logits=False it stops at the
        final norm's output [num_sampled, hidden]: `logits()` of row chunks."""
        metas = meta if isinstance(meta, (list, tuple)) else [meta]
        if self.fused or self.triton_ops:
            h = self._forward_fused(input_ids, positions, metas, kv_caches, sample_idx)
            return self.logits(h) if logits else h
        s = self.shape
        n = input_ids.shape[0]
        q_size = s.num_heads * s.head_dim
        norm = self._norm
        rope = [(cos[positions][:, None, :], sin[positions][:, None, :]) for cos, sin in self.rope]  # [n, 1, head_dim]
        h = self._embed(input_ids)  # [num_tokens, hidden]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            cos, sin = rope[layer.rope]
            x = norm(h, layer.input_norm, s.rms_eps)
            q, k, v = self._qkv_heads(layer, layer.qkv(x), lambda t: t * cos + rotate_half(t) * sin)
            o = paged_attention(q, k, v, k_cache, v_cache, metas[layer.group], self.scale, s.attn_softcap)
            a = layer.o(o.reshape(n, q_size))
            if layer.attn_out_norm is not None:
                a = norm(a, layer.attn_out_norm, s.rms_eps)
            h = h + a
            x = norm(h, layer.post_norm, s.rms_eps)
            d = layer.mlp(x, self._act_mul)
            if layer.mlp_out_norm is not None:
                d = norm(d, layer.mlp_out_norm, s.rms_eps)
            h = h + d
        h = norm(h[sample_idx], self.norm, s.rms_eps)
        return self.logits(h) if logits else h

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [n, hidden]; Gemma's scaled by sqrt(hidden) in the model dtype."""
        h = self.embed[input_ids]
        if self.shape.embed_scale:
            h = h * torch.tensor(self.shape.embed_scale, dtype=h.dtype, device=h.device)
        return h

    def _qkv_heads(self, layer: Layer, qkv: torch.Tensor, rotate, norm=None):
        """q, k, v heads ([n, heads, head_dim] views where possible) from the fused QKV output,
        q and k normed (Qwen3, Gemma 3: by norm(t, weight, eps), default self._norm) and then
        rotated by rotate(t). Without q/k norms, q and k rotate together: one set of elementwise
        ops over all their heads, the same arithmetic per element."""
        s = self.shape
        n = qkv.shape[0]
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        v = qkv[:, q_size + kv_size :].view(n, s.num_kv_heads, s.head_dim)
        if layer.q_norm is not None:
            norm = norm or self._norm
            q = rotate(norm(qkv[:, :q_size].view(n, s.num_heads, s.head_dim), layer.q_norm, s.rms_eps))
            k = rotate(norm(qkv[:, q_size : q_size + kv_size].view(n, s.num_kv_heads, s.head_dim), layer.k_norm,
                            s.rms_eps))
            return q, k, v
        qk = rotate(qkv[:, : q_size + kv_size].view(n, s.num_heads + s.num_kv_heads, s.head_dim))
        return qk[:, : s.num_heads], qk[:, s.num_heads :], v

    def _forward_fused(self, input_ids, positions, metas, kv_caches, sample_idx) -> torch.Tensor:
        """The same layers with fused layer ops, the C++ CPU ones or (triton_ops) their Triton
        twins: RMSNorm fused with the residual add before it, rotary embedding in place on the QKV
        output, SiLU- or GELU-tanh-and-multiply in one pass. Gemma's output norms run through the
        same op without the add.

        The last layer stores every token's K/V and attends for every token, but its output
        projection, norms and MLP run only for the sampled rows: nothing reads the other rows'
        last hidden states. In a prefill step that skips ~93% of one layer's GEMMs (3-4% of a
        24-32-layer model's prefill FLOPs); each kept row's arithmetic is unchanged."""
        if self.triton_ops:
            from batchgen.kernels import layer_ops as ops
        else:
            from batchgen.kernels import cpu_attention as ops

        s = self.shape
        n = input_ids.shape[0]
        q_size = s.num_heads * s.head_dim
        eps = s.rms_eps
        rope = [(cos[positions], sin[positions]) for cos, sin in self.rope]  # [num_tokens, head_dim]
        act = ops.silu_mul if s.hidden_act == "silu" else ops.gelu_tanh_mul

        def head_norm(t: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            # q/k norms per head through the C++ RMSNorm (one pass, fp32 inside, one rounding, as
            # the other norms here), not six torch ops: [n, heads, head_dim] -> a contiguous copy.
            rows, heads, dim = t.shape
            return ops.add_rms_norm(t.reshape(rows * heads, dim), None, weight, eps).view(rows, heads, dim)
        h = self._embed(input_ids)  # [num_tokens, hidden], updated in place by the residual adds
        x = ops.add_rms_norm(h, None, self.layers[0].input_norm, eps)
        gathered = False
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            cos, sin = rope[layer.rope]
            q, k, v = self._qkv_heads(layer, layer.qkv(x), lambda t: ops.rope_(t, cos, sin), head_norm)
            o = paged_attention(q, k, v, k_cache, v_cache, metas[layer.group], self.scale, s.attn_softcap)
            o = o.reshape(n, q_size)
            if i + 1 == len(self.layers) and sample_idx.shape[0] < n:
                o, h, gathered = o[sample_idx], h[sample_idx], True
            a = layer.o(o)
            if layer.attn_out_norm is not None:
                a = ops.add_rms_norm(a, None, layer.attn_out_norm, eps)
            x = ops.add_rms_norm(h, a, layer.post_norm, eps)
            down = layer.mlp(x, act)
            if layer.mlp_out_norm is not None:
                down = ops.add_rms_norm(down, None, layer.mlp_out_norm, eps)
            if i + 1 < len(self.layers):
                x = ops.add_rms_norm(h, down, self.layers[i + 1].input_norm, s.rms_eps)
            else:
                h += down
        if not gathered:  # every row sampled (or some twice)
            h = h[sample_idx]
        return ops.add_rms_norm(h.contiguous(), None, self.norm, eps)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-norm outputs [rows, hidden] -> logits [rows, vocab] (fp32, or the model dtype on
        the fused path, where the sampler converts them)."""
        logits = self.lm_head(h) if self.fused else self.lm_head(h).float()
        return softcap(logits, self.shape.final_softcap) if self.shape.final_softcap else logits

    @property
    def verified_greedy(self) -> bool:
        """Whether greedy_tokens() applies: the fused path of an fp32 model with a packed lm_head
        (oneDNN's, or our fp32 GEMM's on Zen 4), on a CPU with native bf16 dot products (AVX512-BF16
        or AMX; elsewhere bf16 is no faster)."""
        return (self.fused and self.dtype == torch.float32 and self.lm_head.path in ("onednn", "fma")
                and _native_bf16())

    def greedy_tokens(self, h: torch.Tensor, mask=None) -> torch.Tensor:
        """argmax of the fp32 logits of final-norm outputs h [rows, hidden], at about the bf16
        lm_head's cost: bf16 logits first (oneDNN's bf16 GEMM rate is a multiple of fp32's on such
        CPUs: `batchgen bench` prints both), then an
        fp32 dot product for each token that their error bound leaves in reach of the largest
        (batchgen.kernels.cpu_attention.argmax_verified). The token is the fp32 argmax's. mask(logits)
        sets the tokens a constraint disallows to -inf in the bf16 logits first."""
        from batchgen.kernels import cpu_attention as ops

        if self._lm_head_bf16 is None:
            w = self._lm_head_weight.contiguous()
            path = own_bf16_path() or "onednn"
            self._lm_head_bf16 = (Linear(w.to(torch.bfloat16), None, path), w,
                                  (w.double().norm(dim=1) * (1 + 1e-6)).to(torch.float32))
        lin, w, wnorm = self._lm_head_bf16
        approx = lin(h.to(torch.bfloat16))
        if mask is not None:
            mask(approx)  # a disallowed token (-inf) is never within reach of the best
        return ops.argmax_verified(approx, h, w, wnorm)
