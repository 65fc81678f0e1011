"""A lean Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM) over a paged KV cache.

Weights are taken from the transformers model, so loading stays theirs (safetensors, GGUF);
the forward pass is ours: one flat varlen batch, fused QKV and gate/up GEMMs, logits only at
sampled positions. The arithmetic of each op follows transformers' so the fp32 `plain` path
reproduces its greedy tokens exactly.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..shapes import ModelShape
from .attention import AttentionMetadata, paged_attention
from .linear import Linear


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
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


def rotary_tables(config, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [positions, head_dim] from the model family's own transformers rotary module, built
    from the config alone (no weights): it covers every rope scaling transformers implements."""
    import importlib

    mod = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    cls = next(getattr(mod, n) for n in dir(mod) if n.endswith("RotaryEmbedding") and not n.startswith("_"))
    with torch.no_grad():
        cos, sin = cls(config)(torch.zeros(1, dtype=torch.float32), torch.arange(positions)[None])
    return cos[0], sin[0]


class CausalLM:
    def __init__(self, checkpoint, dtype: torch.dtype = torch.float32, device: str = "cpu", linear_path: str = "plain",
                 fused: bool = False, on_layer=None) -> None:
        """checkpoint: a models.weights.Checkpoint (or a transformers model in memory), read a
        tensor at a time straight into this layout in `dtype` on `device`: the fused QKV and
        gate/up matrices are packed layer by layer, so the host holds one layer's source tensors
        at most besides the result. fused: the C++ CPU layer ops (the engine's choice). on_layer(i)
        is called after each layer (a signal check)."""
        from ..models.weights import Checkpoint

        ckpt = Checkpoint.of(checkpoint)
        cfg = ckpt.config
        w = ckpt.weights
        self.shape = s = ModelShape.from_config(cfg)
        self.dtype = dtype
        self.device = torch.device(device)
        self.scale = s.head_dim ** -0.5
        h, q, kv, inter = s.hidden_size, s.q_size, s.kv_size, s.intermediate_size

        def t(name: str, shape: list[int]) -> torch.Tensor:
            x = w.get(name)
            if list(x.shape) != shape:
                raise ConfigError(f"model: {w.where(name)}: tensor {name!r} has shape {list(x.shape)}; the config "
                                  f"({s.model_type}, hidden {h}, heads {s.num_heads}/{s.num_kv_heads}, head_dim "
                                  f"{s.head_dim}) needs {shape}")
            return x.detach().to(device=self.device, dtype=dtype).contiguous()

        def lin(prefix: str, parts: list[tuple[str, int]], cols: int) -> Linear:
            weight = torch.cat([t(f"{prefix}{n}.weight", [rows, cols]) for n, rows in parts], 0)
            bias = None
            if w.has(f"{prefix}{parts[0][0]}.bias"):
                bias = torch.cat([t(f"{prefix}{n}.bias", [rows]) for n, rows in parts], 0)
            return Linear(weight, bias, linear_path)

        self.embed = t("model.embed_tokens.weight", [s.vocab_size, h])
        self.layers: list[Layer] = []
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(Layer(
                input_norm=t(p + "input_layernorm.weight", [h]),
                qkv=lin(p + "self_attn.", [("q_proj", q), ("k_proj", kv), ("v_proj", kv)], h),
                q_norm=t(p + "self_attn.q_norm.weight", [s.head_dim]) if w.has(p + "self_attn.q_norm.weight") else None,
                k_norm=t(p + "self_attn.k_norm.weight", [s.head_dim]) if w.has(p + "self_attn.k_norm.weight") else None,
                o=lin(p + "self_attn.", [("o_proj", h)], q),
                post_norm=t(p + "post_attention_layernorm.weight", [h]),
                gate_up=lin(p + "mlp.", [("gate_proj", inter), ("up_proj", inter)], h),
                down=lin(p + "mlp.", [("down_proj", h)], inter),
            ))
            if on_layer is not None:
                on_layer(i)
        self.norm = t("model.norm.weight", [h])
        # Tied: the same values as the embedding, kept once.
        tied = s.tie_word_embeddings or not w.has("lm_head.weight")
        self._lm_head_weight = self.embed if tied else t("lm_head.weight", [s.vocab_size, h])
        self.lm_head = Linear(self._lm_head_weight, None, linear_path)
        # (bf16 Linear, fp32 weight, row norms) for greedy_tokens(), made on first use.
        self._lm_head_bf16 = None
        self.q_norm_eps = s.rms_eps
        cos, sin = rotary_tables(cfg, s.max_position)
        self.cos = cos.to(device=self.device, dtype=dtype)  # [max_position, head_dim]
        self.sin = sin.to(device=self.device, dtype=dtype)
        self.fused = fused

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], sample_idx: torch.Tensor,
                logits: bool = True) -> torch.Tensor:
        """input_ids/positions [num_tokens] -> logits [num_sampled, vocab] (fp32; the model dtype
        on the fused path, where the sampler converts them). With logits=False it stops at the
        final norm's output [num_sampled, hidden]: `logits()` of row chunks."""
        if self.fused:
            h = self._forward_fused(input_ids, positions, meta, kv_caches, sample_idx)
            return self.logits(h) if logits else h
        s = self.shape
        n = input_ids.shape[0]
        q_size = s.num_heads * s.head_dim
        cos = self.cos[positions][:, None, :]  # [num_tokens, 1, head_dim]
        sin = self.sin[positions][:, None, :]
        h = self.embed[input_ids]  # [num_tokens, hidden]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = rms_norm(h, layer.input_norm, s.rms_eps)
            q, k, v = self._qkv_heads(layer, layer.qkv(x), lambda t: t * cos + rotate_half(t) * sin)
            o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
            h = h + layer.o(o.reshape(n, q_size))
            x = rms_norm(h, layer.post_norm, s.rms_eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
        h = rms_norm(h[sample_idx], self.norm, s.rms_eps)
        return self.lm_head(h).float() if logits else h

    def _qkv_heads(self, layer: Layer, qkv: torch.Tensor, rotate):
        """q, k, v heads ([n, heads, head_dim] views where possible) from the fused QKV output,
        q and k normed (Qwen3) and then rotated by rotate(t). Without q/k norms, q and k rotate
        together: one set of elementwise ops over all their heads, the same arithmetic per element."""
        s = self.shape
        n = qkv.shape[0]
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        v = qkv[:, q_size + kv_size :].view(n, s.num_kv_heads, s.head_dim)
        if layer.q_norm is not None:
            q = rotate(rms_norm(qkv[:, :q_size].view(n, s.num_heads, s.head_dim), layer.q_norm, s.rms_eps))
            k = rotate(rms_norm(qkv[:, q_size : q_size + kv_size].view(n, s.num_kv_heads, s.head_dim), layer.k_norm,
                                s.rms_eps))
            return q, k, v
        qk = rotate(qkv[:, : q_size + kv_size].view(n, s.num_heads + s.num_kv_heads, s.head_dim))
        return qk[:, : s.num_heads], qk[:, s.num_heads :], v

    def _forward_fused(self, input_ids, positions, meta, kv_caches, sample_idx) -> torch.Tensor:
        """The same layers with the C++ CPU ops: RMSNorm fused with the residual add before it,
        rotary embedding in place on the QKV output, SiLU-and-multiply in one pass."""
        from batchgen.kernels import cpu_attention as ops

        s = self.shape
        n = input_ids.shape[0]
        q_size = s.num_heads * s.head_dim
        cos, sin = self.cos[positions], self.sin[positions]  # [num_tokens, head_dim]
        h = self.embed[input_ids]  # [num_tokens, hidden], updated in place by the residual adds
        x = ops.add_rms_norm(h, None, self.layers[0].input_norm, s.rms_eps)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            q, k, v = self._qkv_heads(layer, layer.qkv(x), lambda t: ops.rope_(t, cos, sin))
            o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
            x = ops.add_rms_norm(h, layer.o(o.reshape(n, q_size)), layer.post_norm, s.rms_eps)
            down = layer.down(ops.silu_mul(layer.gate_up(x)))
            if i + 1 < len(self.layers):
                x = ops.add_rms_norm(h, down, self.layers[i + 1].input_norm, s.rms_eps)
            else:
                h += down
        h = h[sample_idx].contiguous()
        return ops.add_rms_norm(h, None, self.norm, s.rms_eps)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-norm outputs [rows, hidden] -> logits [rows, vocab] (fp32, or the model dtype on
        the fused path, where the sampler converts them)."""
        return self.lm_head(h) if self.fused else self.lm_head(h).float()

    @property
    def verified_greedy(self) -> bool:
        """Whether greedy_tokens() applies: the fused path of an fp32 model with a oneDNN lm_head,
        on a CPU with native bf16 dot products (AVX512-BF16 or AMX; elsewhere bf16 is no faster)."""
        return (self.fused and self.dtype == torch.float32 and self.lm_head.path == "onednn"
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
            self._lm_head_bf16 = (Linear(w.to(torch.bfloat16), None, "onednn"), w,
                                  (w.double().norm(dim=1) * (1 + 1e-6)).to(torch.float32))
        lin, w, wnorm = self._lm_head_bf16
        approx = lin(h.to(torch.bfloat16))
        if mask is not None:
            mask(approx)  # a disallowed token (-inf) is never within reach of the best
        return ops.argmax_verified(approx, h, w, wnorm)
